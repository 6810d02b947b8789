"""Figures of the recipes on an accelerator: the chip's measured peaks, the quickstart, and the
real-model recipe (configs/smollm2_math.py) in float32 and bfloat16, with per-step time, tokens/s
and the update's MFU against the chip's bf16 peak.

    python scripts/accelerator_figures.py peaks --out OUT/peaks.json
    python scripts/accelerator_figures.py quickstart --root ROOT --out OUT/quickstart.json
    python scripts/accelerator_figures.py recipe --dtype bfloat16 --root ROOT --peaks OUT/peaks.json \
        [--model smollm2|FILE.gguf] [--out OUT/recipe_bfloat16.json]
    python scripts/accelerator_figures.py report OUT/*.json     # Markdown tables of what was measured

`peaks`: the device, JAX's float32 and bfloat16 matmul peaks (best of 8192^3 products and smaller,
random operands; on a GPU XLA's float32 default may use TF32) and the device-to-device copy
bandwidth (bytes read + written per second), plus the chip's published dense bf16 peak where the
device is one this script knows. `recipe` runs the real-model recipe as the README does, with
`model.dtype` set (parameters and optimizer state stay float32), then summarises the run: held-out
avg@8 / pass@8 before and after, the step profile of `real_model_study.step_profile` (medians over
steps after the first), decoded tokens/s of the sampler (every decode slot of every generation
batch; the static sampler decodes max_new_tokens for each row) and the update's MFU (model FLOPs of
`bench_step.update_model_flops`) against the peak measured in the run's dtype (`peaks`: float32
runs at XLA's default precision, TF32 on an NVIDIA GPU) and against the published bf16 peak. The run is
the trainer's, so a rerun of the same command resumes it (a finished run is summarised again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "bench_peers"))

#: published dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by JAX device_kind
PUBLISHED_BF16_PEAK = {
    "NVIDIA H100 80GB HBM3": 989.4e12,   # H100 SXM5
    "NVIDIA H200": 989.4e12,             # same GH100 compute as H100 SXM5
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
}


def peaks() -> dict:
    """The default device and its measured float32 / bfloat16 matmul peaks and copy bandwidth."""
    import jax

    import common

    kind = jax.devices()[0].device_kind
    sizes = common.accelerator_sizes()
    out = {"device": kind, "backend": jax.default_backend(), "jax": jax.__version__, "host_cpu": common.host_cpu(),
           "matmul_peak_gflops": {d: common.matmul_peak_gflops(lambda n, d=d: common.jax_matmul(n, d), sizes)
                                  for d in ("float32", "bfloat16")},
           "copy_bandwidth_gbs": common.jax_copy_bandwidth_gbs(1 << 30), "sizes": list(sizes)}
    if kind in PUBLISHED_BF16_PEAK:
        out["published_bf16_peak_gflops"] = PUBLISHED_BF16_PEAK[kind] / 1e9
    return out


def _train(config: str, workdir: str, overrides: list[str], log: str) -> float:
    """Runs `python -m stare_jax.train` with the overrides, its output into `log`; wall seconds."""
    cmd = [sys.executable, "-m", "stare_jax.train", "--config", config, "--workdir", workdir] + overrides
    t0 = time.time()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}; see {log}")
    return time.time() - t0


def quickstart(root: str) -> dict:
    """The README's quickstart (configs/quickstart.py) on this device: wall time and final evaluation."""
    import entropy_study as es

    workdir = os.path.join(root, "quickstart")
    os.makedirs(root, exist_ok=True)
    wall = _train("configs/quickstart.py", workdir, [], os.path.join(root, "quickstart.log"))
    rows = es.read_metrics(workdir)
    step_s = es._col(rows[1:], "step_s")
    final = sorted(f for f in os.listdir(os.path.join(workdir, "eval")) if f.startswith("step_"))[-1]
    with open(os.path.join(workdir, "eval", final)) as f:
        ev = json.load(f)
    return {"wall_s": round(wall, 1), "steps": len(rows), "median_step_s": round(float(sorted(step_s)[len(step_s) // 2]), 4),
            "final_eval": {name: {k: v for k, v in res.items() if k.startswith(("avg@", "pass@"))}
                           for name, res in ev.get("results", {}).items()}, "eval_file": final}


def recipe(root: str, dtype: str, model: str, peaks_file: str | None, steps: int | None) -> dict:
    """The real-model recipe in `dtype` on this device, summarised (see the module docstring)."""
    import numpy as np

    import entropy_study as es
    import real_model_study as rms
    from stare_jax.config import load_config_file

    workdir = os.path.join(root, f"smollm2_{dtype}")
    os.makedirs(root, exist_ok=True)
    overrides = [f"--config.model.path={model}", f"--config.model.dtype={dtype}"]
    if steps:
        overrides.append(f"--config.total_steps={steps}")
    wall = _train("configs/smollm2_math.py", workdir, overrides, os.path.join(root, f"smollm2_{dtype}.log"))
    c = load_config_file(os.path.join(REPO, "configs", "smollm2_math.py"))
    total = steps or c.total_steps
    peak = None
    if peaks_file:
        with open(peaks_file) as f:
            pk = json.load(f)
        peak = pk["matmul_peak_gflops"][dtype]  # the run's dtype: float32 runs TF32 on a GPU by default
    model_dir = model if os.path.isdir(model) else os.path.join(workdir, "model")  # a GGUF is converted there
    profile = rms.step_profile(workdir, peak, model_dir=model_dir)
    summ = rms.summary(workdir, total, c.stare.target_entropy, c.rollout.group_size)
    every = es.read_metrics(workdir)
    rows = every[1:] or every  # as step_profile: a one-step run keeps its only step
    gen_s = es._col(rows, "generate_s")
    batches = es._col(rows, "dynamic_sampling_gen_batches")
    slots = batches * c.data.prompt_batch_size * c.rollout.group_size * c.rollout.max_new_tokens
    useful = batches * c.data.prompt_batch_size * c.rollout.group_size * es._col(rows, "response_length_mean")
    out = {"dtype": dtype, "wall_s": round(wall, 1), "total_steps": total, "profile": profile,
           "update_mfu_peak_dtype": dtype,  # profile["update_mfu"] is against this dtype's measured peak
           "decode_slot_tokens_per_s": round(float(np.nanmedian(slots / gen_s)), 1),
           "response_tokens_per_s": round(float(np.nanmedian(useful / gen_s)), 1),
           "summary": {k: v for k, v in summ.items() if not isinstance(v, (list, dict))}}
    if peak and "published_bf16_peak_gflops" in pk:
        out["update_mfu_vs_published_bf16"] = (profile["update_tflop"] * 1e3 / profile["update_s"]
                                               / pk["published_bf16_peak_gflops"])
    return out


_RECIPE_KEYS = ("base_avg@n", "final_avg@n", "base_pass@8", "final_pass@8", "accuracy_start", "accuracy_end", "entropy_initial",
                "entropy_last_half_median", "response_length_end")


def report(files: list[str]) -> str:
    """Markdown tables of the JSON files this script wrote."""
    lines = []
    for path in files:
        with open(path) as f:
            d = json.load(f)
        name = os.path.basename(path)
        if "matmul_peak_gflops" in d and "device" in d and "profile" not in d:
            lines += [f"**{name}**: {d['device']} ({d['backend']}, JAX {d['jax']}; host {d['host_cpu']}): matmul "
                      f"peak float32 {d['matmul_peak_gflops']['float32'] / 1e3:.1f} TFLOP/s, bfloat16 "
                      f"{d['matmul_peak_gflops']['bfloat16'] / 1e3:.1f} TFLOP/s"
                      + (f" (published {d['published_bf16_peak_gflops'] / 1e3:.0f})" if "published_bf16_peak_gflops" in d
                         else "") + f"; copy {d['copy_bandwidth_gbs']:.0f} GB/s", ""]
        elif "profile" in d:
            p, s = d["profile"], d["summary"]
            lines += [f"**{name}** ({d['dtype']}, {d['total_steps']} steps, {d['wall_s']:.0f} s wall): step "
                      f"{p['step_s']:.2f} s (sampling {p['generate_s']:.2f}, update {p['update_s']:.3f}, "
                      f"gen. batches {p['gen_batches']:.0f}); decode {d['decode_slot_tokens_per_s']:.0f} slot-tokens/s "
                      f"({d['response_tokens_per_s']:.0f} response tokens/s); update MFU "
                      f"{p.get('update_mfu', float('nan')):.3f} of the measured {d.get('update_mfu_peak_dtype', 'bfloat16')} peak"
                      + (f", {d['update_mfu_vs_published_bf16']:.3f} of the published" if
                         "update_mfu_vs_published_bf16" in d else "")
                      + "; held-out " + ", ".join(f"{k} {s[k]:.3f}" for k in _RECIPE_KEYS if isinstance(s.get(k), (int, float))),
                      ""]
        else:
            lines += [f"**{name}**: {json.dumps(d)}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("peaks")
    p.add_argument("--out", required=True)
    q = sub.add_parser("quickstart")
    q.add_argument("--root", required=True)
    q.add_argument("--out", required=True)
    r = sub.add_parser("recipe")
    r.add_argument("--root", required=True)
    r.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    r.add_argument("--model", default="smollm2", help="model.path: smollm2 (the package's GGUF) or a .gguf file")
    r.add_argument("--peaks", default=None, help="peaks.json of this device (for the MFU)")
    r.add_argument("--steps", type=int, default=None, help="total_steps (default: the recipe's)")
    r.add_argument("--out", required=True)
    t = sub.add_parser("report")
    t.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "report":
        print(report(a.files))
        return 0
    if a.cmd == "peaks":
        result = peaks()
    elif a.cmd == "quickstart":
        result = quickstart(a.root)
    else:
        result = recipe(a.root, a.dtype, a.model, a.peaks, a.steps)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
