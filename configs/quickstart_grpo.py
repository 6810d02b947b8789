"""GRPO-ds twin of configs/quickstart.py: identical except that STARE is off (plain clipped surrogate)."""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.loss.name = "grpo"
    c.stare.enabled = False
    return c
