"""GRPO-ds twin of configs/smollm2_math.py: the same model, task, rollouts, optimiser and budget, no STARE."""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "smollm2_math.py"))
    c.loss.name = "grpo"                 # DAPO-style GRPO: clip-higher, dual-clip, token-mean, dynamic sampling
    c.stare.enabled = False              # no token reweighting
    return c
