"""Shared pieces of the end-to-end tests: a tiny run configuration and subprocess launchers."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
TIMING = ("_s",)
PROCESS_FACTS = ("compilations",)  # differ between a resumed and an uninterrupted run by design


def tiny_overrides(model_dir, data_dir, **extra):
    o = {
        "model.path": model_dir, "data.data_dir": data_dir, "data.num_train": 64, "data.num_eval": 8,
        "data.prompt_batch_size": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 12,
        "dynamic_sampling.enabled": False, "total_steps": 6, "checkpoint_every": 2, "eval.enabled": False,
        "reward.num_workers": 1, "optim.lr": 1e-3, "logging.progress": False, "logging.tensorboard": False,
        "stare.target_entropy": 5.0,  # keep the STARE gate on so its path is exercised
    }
    o.update(extra)
    return o


def make_tiny_model(root):
    """The tiny embedded model (warm-started) used by the end-to-end tests; returns (model, tfds dir)."""
    from stare_jax.tasks import embedded

    model = embedded.create_embedded_model(os.path.join(root, "model"), hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64, warmup_steps=150,
                                           task_config=tiny_task())
    return model, os.path.join(root, "tfds")


def tiny_task():
    from stare_jax.tasks import countdown
    return countdown.CountdownConfig(min_numbers=3, max_numbers=3, max_number=9, max_target=30)


def override_args(overrides):
    return [f"--config.{k}={v}" for k, v in overrides.items()]


def subprocess_env(devices=1, **extra):
    """The environment of a process a test starts: `devices` JAX CPU devices and the tests' XLA flags
    (conftest: no LLVM optimisation and the classic emitter, which cost less than they save on the
    tests' programs)."""
    test_flags = os.environ.get("STARE_TEST_XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {test_flags}".strip(),
               JAX_PLATFORMS="cpu")
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra)
    return env


def train_cmd(workdir, overrides):
    return [sys.executable, "-m", "stare_jax.train", "--config", QUICKSTART, "--workdir", workdir, *override_args(overrides)]


def run_train(workdir, overrides, devices=1, **env):
    return subprocess.run(train_cmd(workdir, overrides), cwd=ROOT, env=subprocess_env(devices, **env), capture_output=True,
                          text=True, timeout=600)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.endswith(TIMING) and k not in PROCESS_FACTS} for r in rows]


