"""Hugging Face checkpoint directories <-> `Policy` (contract 4 of DESIGN.md).

Weights are read per device shard: each parameter is built with
`jax.make_array_from_callback`, whose callback slices the memory-mapped safetensors tensor,
so a sharded load never holds a full copy of a weight on one device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from stare_jax import parallel
from stare_jax.config import first_line
from stare_jax.models.config import ModelConfig, UnsupportedModelError
from stare_jax.models.decoder import DEFAULT_ATTENTION_BLOCK, Decoder
from stare_jax.models.safetensors_io import SafetensorsReader, write_file

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# our layer parameter -> (HF name inside model.layers.{i}., transposed?)
_LAYER_MAP = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "wk": ("self_attn.k_proj.weight", True), "bk": ("self_attn.k_proj.bias", False),
    "wv": ("self_attn.v_proj.weight", True), "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.o_proj.weight", True), "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "b_gate": ("mlp.gate_proj.bias", False),
    "w_up": ("mlp.up_proj.weight", True), "b_up": ("mlp.up_proj.bias", False),
    "w_down": ("mlp.down_proj.weight", True), "b_down": ("mlp.down_proj.bias", False),
}
_TOP_MAP = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
            "lm_head": ("lm_head.weight", True)}


class CheckpointFormatError(ValueError):
    """A Hugging Face directory lacks a tensor, has an unexpected one, or has a wrong shape."""


class ModelDirectoryError(ValueError):
    """A Hugging Face directory's config.json or tokenizer files cannot be read (damaged, not JSON,
    a required field missing); the message names the file and the cause on one line."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}"


@dataclasses.dataclass
class Policy:
    """A loaded causal LM: the NNX decoder, its architecture, tokenizer and mesh.

    `policy(input_ids, attention_mask)` returns float32 logits [B, T, V] of a left-padded batch.
    """

    model: Decoder
    config: ModelConfig
    tokenizer: Any = None
    mesh: Mesh | None = None

    def __call__(self, input_ids, attention_mask) -> jax.Array:
        return _forward(self.model, jnp.asarray(input_ids), jnp.asarray(attention_mask))

    @property
    def dtype(self):
        return self.model.dtype


@nnx.jit
def _forward(model, input_ids, attention_mask):
    return model(input_ids, attention_mask)


def hf_tensor_names(cfg: ModelConfig, state_paths: list[str]) -> dict[str, list[str] | str]:
    """For each parameter path of the decoder, the HF tensor name(s) that hold it."""
    out: dict[str, list[str] | str] = {}
    for path in state_paths:
        if path.startswith("layers/"):
            name = path.split("/", 1)[1]
            out[path] = [f"model.layers.{i}.{_LAYER_MAP[name][0]}" for i in range(cfg.num_layers)]
        else:
            out[path] = _TOP_MAP[path][0]
    return out


def _transposed(path: str) -> bool:
    name = path.split("/")[-1]
    return (_LAYER_MAP.get(name) or _TOP_MAP[name])[1]


def _decoder_factory(cfg: ModelConfig, dtype: str, param_dtype: str | None, remat: bool, scan_layers: bool,
                     mesh: Mesh | None, seed: int = 0, remat_saves: str = "nothing", remat_saves_layers: int = -1,
                     attention_block: int = DEFAULT_ATTENTION_BLOCK):
    pdt = DTYPES[param_dtype or dtype]
    return lambda: Decoder(cfg, dtype=DTYPES[dtype], param_dtype=pdt, remat=remat, remat_saves=remat_saves,
                           scan_layers=scan_layers, mesh=mesh, rngs=nnx.Rngs(seed),
                           remat_saves_layers=remat_saves_layers, attention_block=attention_block)


def param_sharding(path: str, shape: tuple, mesh: Mesh | None):
    """Where parameter `path` lives: by the partition rules on `mesh`, else on the first device."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, parallel.spec_for_param(path, shape, mesh))


def abstract_model(cfg: ModelConfig, *, dtype: str = "float32", param_dtype: str | None = None,
                   remat: bool = False, scan_layers: bool = True, mesh: Mesh | None = None):
    """(graphdef, state) of the decoder `build_model` would build, without allocating a parameter:
    the state's leaves are `jax.ShapeDtypeStruct`s carrying their shardings: a restore target for a
    checkpoint's weights, to `nnx.merge` with the graphdef once restored."""
    graphdef, state = nnx.split(nnx.eval_shape(_decoder_factory(cfg, dtype, param_dtype, remat, scan_layers, mesh)))
    place = lambda path, x: jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, x.dtype, sharding=param_sharding(parallel.path_to_str(path), x.shape, mesh))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(state)))
    return graphdef, state


def build_model(cfg: ModelConfig, *, dtype: str = "float32", param_dtype: str | None = None,
                remat: bool = False, scan_layers: bool = True, mesh: Mesh | None = None,
                load: Callable[[str, tuple, tuple], np.ndarray] | None = None, seed: int = 0,
                remat_saves: str = "nothing", remat_saves_layers: int = -1,
                attention_block: int = DEFAULT_ATTENTION_BLOCK) -> Decoder:
    """Builds the decoder with every parameter placed by the partition rules.

    `load(path, shape, index)` returns the block `index` of parameter `path` (a tuple of slices);
    without it the parameters are randomly initialised (on the host, then sharded).
    """
    make = _decoder_factory(cfg, dtype, param_dtype, remat, scan_layers, mesh, seed, remat_saves, remat_saves_layers,
                            attention_block)
    graphdef, state = nnx.split(nnx.eval_shape(make))
    pure = nnx.to_pure_dict(state)
    if load is None:
        with jax.default_device(jax.devices("cpu")[0]):
            init_pure = nnx.to_pure_dict(nnx.state(make()))
        load = lambda path, shape, index: np.asarray(_get(init_pure, path))[index]

    def place(path, leaf):
        p = parallel.path_to_str(path)
        return jax.make_array_from_callback(leaf.shape, param_sharding(p, leaf.shape, mesh),
                                            lambda idx: np.asarray(load(p, leaf.shape, idx)).astype(leaf.dtype))

    pure = jax.tree_util.tree_map_with_path(place, pure)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _get(tree, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def load_config(path: str) -> ModelConfig:
    """Reads `path/config.json` into a ModelConfig."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelDirectoryError(f"{cfg_file}: cannot be read as JSON ({_one_line(e)})") from None
    if not isinstance(hf, dict):
        raise ModelDirectoryError(f"{cfg_file}: not a JSON object")
    try:
        return ModelConfig.from_hf_dict(hf)
    except UnsupportedModelError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelDirectoryError(f"{cfg_file}: a required field is missing or malformed ({_one_line(e)})") from None


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise CheckpointFormatError(f"{path}: {INDEX_FILE} lists missing shard file(s) {missing}")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointFormatError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def from_pretrained(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
                    mesh: Mesh | None = None, remat: bool = False, scan_layers: bool = True,
                    load_tokenizer: bool = True, remat_saves: str = "nothing", remat_saves_layers: int = -1,
                    attention_block: int = DEFAULT_ATTENTION_BLOCK) -> Policy:
    """Loads a Llama/Qwen2/Qwen3 HF directory (config.json, safetensors, tokenizer) as a Policy.

    With `mesh`, each weight is created already sharded by `stare_jax.parallel.PARAM_RULES`.
    Raises CheckpointFormatError naming the tensor when one is missing, unexpected or misshapen.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg = load_config(path)
    reader = SafetensorsReader(_safetensors_files(path))
    abstract_state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    shapes = {parallel.path_to_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(abstract_state)}
    names = hf_tensor_names(cfg, list(shapes))
    expected = set()
    for p, hf in names.items():
        per_layer = hf if isinstance(hf, list) else [hf]
        want = shapes[p][1:] if isinstance(hf, list) else shapes[p]
        if _transposed(p):
            want = tuple(reversed(want))
        for n in per_layer:
            expected.add(n)
            if n not in reader:
                if p == "lm_head" and "model.embed_tokens.weight" in reader:
                    raise CheckpointFormatError(
                        f"{path}: tensor 'lm_head.weight' is missing but tie_word_embeddings is false in config.json")
                raise CheckpointFormatError(f"{path}: tensor {n!r} is missing from the checkpoint")
            if reader.shape(n) != tuple(want):
                raise CheckpointFormatError(
                    f"{path}: tensor {n!r} has shape {reader.shape(n)}, expected {tuple(want)} from config.json")
    unexpected = [k for k in reader.keys() if k not in expected and not k.endswith(_IGNORED_SUFFIXES)
                  and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if unexpected:
        raise CheckpointFormatError(f"{path}: unexpected tensor(s) {unexpected[:5]} for {cfg.architecture}")

    def load(p, shape, index):
        hf = names[p]
        if isinstance(hf, list):
            layers = range(*index[0].indices(shape[0]))
            rest = index[1:]
            blocks = [_read(reader.get(hf[i]), rest, _transposed(p)) for i in layers]
            return np.stack(blocks)
        return _read(reader.get(hf), index, _transposed(p))

    model = build_model(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers, mesh=mesh,
                        load=load, remat_saves=remat_saves, remat_saves_layers=remat_saves_layers,
                        attention_block=attention_block)
    tokenizer = load_tokenizer_dir(path) if load_tokenizer else None
    return Policy(model=model, config=cfg, tokenizer=tokenizer, mesh=mesh)


def _read(tensor: np.ndarray, index: tuple, transposed: bool) -> np.ndarray:
    """Block `index` (in our layout) of an HF tensor, transposing 2-D weights [out, in] -> [in, out]."""
    if transposed:
        return np.asarray(tensor[tuple(reversed(index))]).T
    return np.asarray(tensor[index])


def load_tokenizer_dir(path: str):
    """The tokenizer of `path` as `transformers.AutoTokenizer` loads it (`models.tokenizer`, without
    its start-up cost), or None (with a warning) when it has no tokenizer files."""
    from stare_jax.models import tokenizer

    if not tokenizer.has_tokenizer_files(path):
        log.warning("%s has no tokenizer files; the policy has no tokenizer", path)
        return None
    try:
        return tokenizer.load_tokenizer(path)
    except Exception as e:  # transformers/tokenizers raise many types for a damaged file
        raise ModelDirectoryError(f"{path}: its tokenizer files cannot be loaded ({_one_line(e)})") from e


def save_pretrained(policy: Policy, path: str, *, max_shard_bytes: int = 4 << 30, dtype: str | None = None) -> None:
    """Writes `policy` as a HF directory: config.json, safetensors (sharded with an index file when
    larger than `max_shard_bytes`), generation_config.json and the tokenizer files."""
    os.makedirs(path, exist_ok=True)
    cfg = policy.config
    state = nnx.state(policy.model, nnx.Param)
    arrays = {parallel.path_to_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    names = hf_tensor_names(cfg, list(arrays))
    out_dtype = None if dtype is None else np.dtype(DTYPES[dtype])
    tensors: dict[str, np.ndarray] = {}
    for p, x in arrays.items():
        host = np.asarray(jax.device_get(x) if x.is_fully_addressable else
                          jax.experimental.multihost_utils.process_allgather(x, tiled=True))
        if out_dtype is not None:
            host = host.astype(out_dtype)
        hf = names[p]
        if isinstance(hf, list):
            for i, n in enumerate(hf):
                tensors[n] = host[i].T if _transposed(p) else host[i]
        else:
            tensors[hf] = host.T if _transposed(p) else host
    if jax.process_index() != 0:
        return
    # Deterministic order: HF's own (embed, layers in order, norm, head).
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for n in sorted(tensors, key=_hf_sort_key):
        t = np.ascontiguousarray(tensors[n])
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += t.nbytes
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        write_file(os.path.join(path, SINGLE_FILE), shards[0])
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(os.path.join(path, fn), shard)
            weight_map.update({n: fn for n in shard})
            total += sum(t.nbytes for t in shard.values())
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_cfg = cfg.to_hf_dict()
    first = next(iter(tensors.values()))
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = "bfloat16" if first.dtype == np.dtype(jnp.bfloat16) else "float32"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
    if policy.tokenizer is not None:
        policy.tokenizer.save_pretrained(path)


def _hf_sort_key(name: str):
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    return (2, 0, name)
