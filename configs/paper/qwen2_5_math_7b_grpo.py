"""GRPO-ds twin of configs/paper/qwen2_5_math_7b_stare.py: STARE off, everything else identical
(DAPO dynamic sampling, clip-higher, token-mean, same model, batch, lengths and mesh).

    python -m stare_jax.dryrun --config configs/paper/qwen2_5_math_7b_grpo.py --devices 64 --chip v5p
"""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "qwen2_5_math_7b_stare.py"))
    c.loss.name = "grpo"
    c.stare.enabled = False
    return c
