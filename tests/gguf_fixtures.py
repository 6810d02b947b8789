"""Tiny GGUF files written with the `gguf` package, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

import numpy as np

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's 256 byte-level characters, in byte order."""
    from stare_jax.tasks.embedded import _byte_level_alphabet

    table = _byte_level_alphabet()
    return [table[b] for b in range(256)]


def tokenizer_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte-level characters, 4 merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "in"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(arch: str, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names (PyTorch layout)."""
    rs = np.random.RandomState(seed)
    vocab = len(tokenizer_vocab()[0])
    hd = HIDDEN // HEADS

    def w(*shape, scale=0.08):
        return (rs.randn(*shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, HIDDEN, scale=0.5), "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": 1 + w(HIDDEN), p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
                    p + "self_attn.q_proj.weight": w(HEADS * hd, HIDDEN), p + "self_attn.k_proj.weight": w(KV_HEADS * hd, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * hd, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * hd),
                    p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, FFN)})
        if arch == "qwen2":
            out.update({p + "self_attn.q_proj.bias": w(HEADS * hd), p + "self_attn.k_proj.bias": w(KV_HEADS * hd),
                        p + "self_attn.v_proj.bias": w(KV_HEADS * hd)})
    return out


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    if hf in _TOP:
        return _TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_BLOCK[module]}.{kind}"


def write_gguf(path: str, *, arch: str = "llama", qtype: str = "Q8_0", seed: int = 0, tied: bool = True,
               raw_override: tuple[str, str] | None = None, pre: str = "smollm") -> dict[str, np.ndarray]:
    """Writes a tiny `arch` model as GGUF (2-D weights in `qtype`, norms and biases F32) and returns its
    HF-named float32 weights before quantisation. `raw_override=(hf name, type)` stores one tensor as
    raw bytes of another type (for refusal tests)."""
    import gguf

    weights = hf_weights(arch, seed, tied)
    tokens, types, merges = tokenizer_vocab()
    wr = gguf.GGUFWriter(path, arch)
    wr.add_name("tiny")
    wr.add_block_count(LAYERS)
    wr.add_context_length(256)
    wr.add_embedding_length(HIDDEN)
    wr.add_feed_forward_length(FFN)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(HIDDEN // HEADS)
    wr.add_vocab_size(len(tokens))
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_pad_token_id(2)
    wr.add_unk_token_id(0)
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    qt = gguf.GGMLQuantizationType[qtype]
    for hf, x in weights.items():
        name = gguf_name(hf)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            x = permute_rotary(x, HEADS)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            x = permute_rotary(x, KV_HEADS)
        if raw_override is not None and hf == raw_override[0]:
            rq = gguf.GGMLQuantizationType[raw_override[1]]
            block, size = gguf.GGML_QUANT_SIZES[rq]
            raw = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
            wr.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=rq)
        elif x.ndim == 2:
            q = gguf.quants.quantize(x, qt)
            wr.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            wr.add_tensor(name, x)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return weights
