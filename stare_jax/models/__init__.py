"""Policy models: one Flax NNX decoder for Llama / Qwen2 / Qwen3, and Hugging Face I/O."""

from stare_jax.models.config import ModelConfig, UnsupportedModelError
from stare_jax.models.decoder import Decoder, positions_from_mask
from stare_jax.models.hf import (CheckpointFormatError, Policy, build_model, from_pretrained, load_config,
                                 save_pretrained)

__all__ = ["ModelConfig", "UnsupportedModelError", "Decoder", "positions_from_mask", "CheckpointFormatError",
           "Policy", "build_model", "from_pretrained", "load_config", "save_pretrained"]
