"""Architecture description of a decoder-only policy, read from a Hugging Face `config.json`.

One dataclass covers the Llama, Qwen2 and Qwen3 families; the differences are flags
(`qkv_bias`, `qk_norm`, explicit `head_dim`, tied embeddings, RoPE scaling).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder; hashable so it can be a static jit argument."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hashable form of the rope scaling dict: tuple of (key, value) pairs, or None.
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    hidden_act: str = "silu"

    @property
    def model_type(self) -> str:
        return _MODEL_TYPES[self.architecture]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Parses a Hugging Face config dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {v: k for k, v in _MODEL_TYPES.items()}.get(hf.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or hf.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        theta, scaling = _parse_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
        model_type = _MODEL_TYPES[arch]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            hidden_act=act,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content that `transformers` (4.x and 5.x) loads for this model."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0])
            if self.eos_token_ids else None,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen3":
            hf["attention_bias"] = self.qkv_bias
        # transformers 5 reads RoPE from `rope_parameters`; older versions from the top-level keys.
        params = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            params.update(self.rope_scaling_dict)
            params["rope_theta"] = self.rope_theta
        hf["rope_parameters"] = params
        return hf


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """Returns (theta, scaling dict or None) from either `rope_parameters` (transformers 5) or the
    legacy top-level `rope_theta` / `rope_scaling` keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and params and all(
            isinstance(v, dict) for v in params.values()):
        # Per-layer-type form ({"full_attention": {...}}): all layers here share one RoPE.
        params = next(iter(params.values()))
    theta = None
    scaling = None
    if isinstance(params, dict):
        theta = params.get("rope_theta")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if theta is None:
        theta = hf.get("rope_theta", 10000.0)
    legacy = hf.get("rope_scaling")
    if scaling is None and isinstance(legacy, dict):
        rope_type = legacy.get("rope_type", legacy.get("type", "default"))
        if rope_type != "default":
            scaling = dict(legacy)
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type")
        scaling["rope_type"] = rope_type
        if rope_type not in ("llama3", "linear"):
            raise UnsupportedModelError(
                f"unsupported rope_scaling type {rope_type!r}; implemented: 'default', 'linear', 'llama3'")
        # Keep only JSON scalars so the config stays hashable.
        scaling = {k: v for k, v in scaling.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return float(theta), scaling


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """inv_freq_i = theta^(-2i/d), adjusted by linear or llama3 scaling when the config has it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling["rope_type"] == "linear":
        return (inv_freq / float(scaling["factor"])).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
