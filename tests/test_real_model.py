"""The real-model recipe trains SmolLM2-135M-Instruct (the packaged GGUF) end to end."""

import json
import math
import os

from tests.e2e_helpers import ROOT, override_args, subprocess_env

RECIPE = os.path.join(ROOT, "configs", "smollm2_math.py")


def test_real_model_trains_two_steps_with_finite_nonzero_loss_and_gradient(tmp_path, smollm2_dir):
    import subprocess
    import sys

    overrides = {
        "model.path": smollm2_dir, "data.data_dir": str(tmp_path / "tfds"), "data.num_train": 32,
        "data.num_eval": 4, "data.prompt_batch_size": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 8,
        "total_steps": 2, "checkpoint_every": 2, "eval.enabled": False, "reward.num_workers": 1,
        "reward.name": "tests.train_fixtures:length_parity", "dynamic_sampling.max_num_gen_batches": 20,
        "logging.progress": False, "logging.tensorboard": False, "stare.target_entropy": 5.0,  # STARE gate on
    }
    workdir = str(tmp_path / "run")
    # the tests' XLA flags (conftest), not the compiler's defaults: two steps of the real model compile
    # more than they compute (this run took 67 s against 86 s alone on the 2-vCPU AMD EPYC)
    r = subprocess.run([sys.executable, "-m", "stare_jax.train", "--config", RECIPE, "--workdir", workdir,
                        *override_args(overrides)], cwd=ROOT, env=subprocess_env(1),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert math.isfinite(row["loss"]) and row["loss"] != 0.0, row
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0.0, row
        assert row["nonfinite_skipped"] == 0 and row["stare_gate_on"] == 1.0
        assert 0 < row["entropy"] < math.log(49152)
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
