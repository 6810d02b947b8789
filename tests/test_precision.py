"""`model.matmul_precision`: the precision of float32 products reaches every compiled program of a run."""

import jax
import jax.numpy as jnp
import pytest

from stare_jax import checkpoint as ckpt_lib
from stare_jax import precision, trainer
from stare_jax.config import default_config


def _dot_precision(fn, *args) -> str:
    """The precision attribute of the first dot_general in fn's lowered StableHLO ("" when none)."""
    for line in jax.jit(fn).lower(*args).as_text().splitlines():
        if "dot_general" in line:
            return line.split("precision = ")[1].split("]")[0] + "]" if "precision = " in line else ""
    raise AssertionError("no dot_general in the program")


def test_each_precision_is_carried_into_the_compiled_dot():
    x = jnp.ones((8, 8), jnp.float32)
    matmul = lambda a, b: a @ b
    with precision.matmul_precision("default"):
        assert _dot_precision(matmul, x, x) in ("", "[DEFAULT, DEFAULT]")
    with precision.matmul_precision("float32"):
        assert _dot_precision(matmul, x, x) == "[HIGHEST, HIGHEST]"
    with precision.matmul_precision("tensorfloat32"):
        assert _dot_precision(matmul, x, x) == "[HIGH, HIGH]"
    assert _dot_precision(matmul, x, x) in ("", "[DEFAULT, DEFAULT]")  # the context does not leak
    with pytest.raises(ValueError, match="allowed: default, float32, tensorfloat32"):
        precision.matmul_precision("highest")


def test_the_trainer_runs_inside_the_configured_precision(monkeypatch, tmp_path):
    """train() runs its whole loop (every sampler, update and evaluation it compiles) inside the
    run's `model.matmul_precision`, and restores the process's setting afterwards."""
    seen = []
    monkeypatch.setattr(trainer, "_train", lambda config, workdir, stop, pool: seen.append(
        jax.config.jax_default_matmul_precision) or {})
    config = default_config()
    for name, expected in (("float32", "float32"), ("tensorfloat32", "tensorfloat32"), ("default", None)):
        config.model.matmul_precision = name
        trainer.train(config, str(tmp_path / name))
        assert seen[-1] == expected
        assert jax.config.jax_default_matmul_precision is None


def test_changing_the_precision_is_a_resumable_change():
    """Only rounding changes with the precision, so a run may resume under another one; a saved
    config from before the key existed counts as "default"."""
    assert "model.matmul_precision" in ckpt_lib.RESUMABLE_CHANGES
    assert ckpt_lib.ADDED_KEYS["model.matmul_precision"] == "default"
    assert default_config().model.matmul_precision == "default"
