"""Policy models: one Flax NNX decoder for Llama / Qwen2 / Qwen3, and Hugging Face I/O."""

from stare_jax.models.config import ModelConfig, UnsupportedModelError
from stare_jax.models.decoder import Decoder, positions_from_mask
from stare_jax.models.hf import (CheckpointFormatError, ModelDirectoryError, Policy, build_model, from_pretrained,
                                 load_config, save_pretrained)
from stare_jax.models.safetensors_io import SafetensorsError

# A model directory that cannot be used as given: the entry points report these as one line, exit 2.
MODEL_INPUT_ERRORS = (UnsupportedModelError, CheckpointFormatError, ModelDirectoryError, SafetensorsError)

__all__ = ["ModelConfig", "UnsupportedModelError", "Decoder", "positions_from_mask", "CheckpointFormatError",
           "ModelDirectoryError", "SafetensorsError", "MODEL_INPUT_ERRORS",
           "Policy", "build_model", "from_pretrained", "load_config", "save_pretrained"]
