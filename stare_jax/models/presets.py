"""Architecture presets: the Hugging Face `config.json` of the models the paper trains, as published.

No weights and no downloads: a preset is only the architecture, so a run can be planned (shapes,
shardings, compiled memory; see `stare_jax.dryrun`) without the checkpoint on disk. The numbers are
those of the models' `config.json` files on the Hugging Face hub; `tiny` and `tiny-qwen3` are small
made-up models for tests.

    >>> preset_config("qwen2.5-math-7b").num_layers
    28

A preset is looked up by its short name or by the hub repository id
(`preset_config("Qwen/Qwen2.5-Math-7B")`), case-insensitively.
"""

from __future__ import annotations

import copy
from typing import Any

from stare_jax.models.config import ModelConfig

# Qwen/Qwen2.5-Math-7B: Qwen2 architecture, 4k context (rope_theta 10000), untied embeddings.
QWEN2_5_MATH_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 4096,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.37.0",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# Qwen/Qwen2.5-32B (base): Qwen2 architecture, 64 layers, GQA 40/8.
QWEN2_5_32B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 27648,
    "max_position_embeddings": 131072,
    "max_window_layers": 64,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B: Qwen2 architecture (from Qwen2.5-Math-1.5B), GQA 12/2,
# untied embeddings, 131072 positions at rope_theta 10000.
DEEPSEEK_R1_DISTILL_QWEN_1_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 131072,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen3-8B: Qwen3 architecture (q/k RMSNorm per head, no q/k/v bias), explicit head_dim 128.
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Test-sized models (made up): every dimension divisible by 8 shards where it matters.
TINY: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 256,
}

TINY_QWEN3: dict[str, Any] = {
    **TINY,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 32,
    "tie_word_embeddings": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-math-7b": QWEN2_5_MATH_7B,
    "qwen2.5-32b": QWEN2_5_32B,
    "deepseek-r1-distill-qwen-1.5b": DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    "qwen3-8b": QWEN3_8B,
    "tiny": TINY,
    "tiny-qwen3": TINY_QWEN3,
}

# Hub repository ids -> preset names.
HUB_IDS: dict[str, str] = {
    "qwen/qwen2.5-math-7b": "qwen2.5-math-7b",
    "qwen/qwen2.5-32b": "qwen2.5-32b",
    "deepseek-ai/deepseek-r1-distill-qwen-1.5b": "deepseek-r1-distill-qwen-1.5b",
    "qwen/qwen3-8b": "qwen3-8b",
}


class UnknownPresetError(KeyError):
    """The name is neither a preset nor the hub id of one."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0] if self.args else ""


def preset_names() -> tuple[str, ...]:
    """The short names of every preset."""
    return tuple(PRESETS)


def resolve_name(name: str) -> str:
    """The short preset name for `name` (a short name or a hub id, any case)."""
    key = name.strip().lower()
    key = HUB_IDS.get(key, key)
    if key not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)} "
                                 f"(or the hub ids {', '.join(sorted(HUB_IDS))})")
    return key


def preset_hf_dict(name: str) -> dict[str, Any]:
    """A copy of the `config.json` dict of preset `name`."""
    return copy.deepcopy(PRESETS[resolve_name(name)])


def preset_config(name: str) -> ModelConfig:
    """The `ModelConfig` of preset `name` (parsed by `ModelConfig.from_hf_dict`, as a checkpoint's would be)."""
    return ModelConfig.from_hf_dict(preset_hf_dict(name))


def num_parameters(cfg: ModelConfig) -> int:
    """The parameter count of the decoder built from `cfg` (embeddings, head and biases included)."""
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = 2 * D + D * q + 2 * D * kv + q * D + 3 * D * F
    if cfg.qkv_bias:
        layer += q + 2 * kv
    if cfg.o_bias:
        layer += D
    if cfg.qk_norm:
        layer += 2 * cfg.head_dim
    if cfg.mlp_bias:
        layer += 2 * F + D
    head = 0 if cfg.tie_word_embeddings else D * V
    return L * layer + V * D + D + head


__all__ = ["PRESETS", "HUB_IDS", "UnknownPresetError", "preset_names", "resolve_name", "preset_hf_dict",
           "preset_config", "num_parameters"]
