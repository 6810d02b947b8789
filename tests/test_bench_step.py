"""Contract 9: `scripts/bench_step.py` runs the full stare-jax step and prints its JSON line last."""

import json
import os
import subprocess
import sys

from tests.e2e_helpers import ROOT, subprocess_env


def test_bench_step_prints_contract_keys_and_checks_its_workload():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--steps", "2", "--grpo"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("median_step_s", "median_rollout_s", "median_update_s", "rollout_tokens_per_s", "peak_rss_mb"):
        assert out[key] > 0, key
    assert out["shape"] == {"vocab_size": 1024, "hidden_size": 256, "num_layers": 4, "num_heads": 4,
                            "num_kv_heads": 2, "intermediate_size": 688, "num_prompts": 8, "group_size": 8,
                            "prompt_len": 32, "new_tokens": 64}
    ours = out["participants"]["stare-jax"]
    assert ours["steps"] == 2 and ours["loss"] == "stare"
    assert 0 < out["update_mfu"] < 1
    # The framework's own float32 matmul peak and the host it was measured on (ratios depend on both).
    assert ours["matmul_peak_gflops"] == out["matmul_peak_gflops"] > 0
    assert isinstance(out["host_cpu"], str) and out["host_cpu"]
    assert out["median_step_s"] >= out["median_update_s"]
    # --grpo: the plain-GRPO update is timed on the same batches in the same worker.
    assert out["grpo_median_update_s"] > 0
    assert -1 < out["stare_update_overhead"] < 10 and abs(out["stare_overhead"]) < 10


def test_bench_stare_overhead_times_both_updates_in_one_process():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_stare_overhead.py"), "--rounds", "1"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 1 and out["shape"] == {"hidden_size": 256, "num_layers": 4, "new_tokens": 64}
    assert out["stare_update_s"] > 0 and out["grpo_update_s"] > 0 and out["rollout_s"] > 0
    assert abs(out["step_overhead"]) < 1 and -1 < out["update_overhead"] < 10
