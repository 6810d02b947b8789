"""Embedded default: STARE on the countdown task with a tiny model, trains on a laptop CPU in minutes.

python -m stare_jax.train --config configs/quickstart.py --workdir runs/quickstart
"""

from stare_jax.config import default_config


def get_config():
    c = default_config()
    c.loss.name = "stare"
    c.stare.enabled = True
    return c
