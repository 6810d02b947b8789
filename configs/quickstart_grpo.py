"""GRPO-ds twin of configs/quickstart.py: identical except that STARE is off (plain clipped surrogate).

Same task, warm start, learning rate, batch, steps, dynamic sampling and evaluation, so the two runs
differ only in the token weights (all 1 here).
"""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.loss.name = "grpo"                 # DAPO-style GRPO: clip-higher, dual-clip, token-mean, dynamic sampling
    c.stare.enabled = False              # no token reweighting; the controller's gate never turns on
    return c
