"""The entropy study: GRPO-ds vs STARE settings vs entropy baselines on the embedded countdown task.

    python scripts/entropy_study.py --root runs/entropy_study [--seeds 0,1,2] [--rows a,b,...]
        [--steps N] [--out docs/figures/entropy_study.png] [--table docs/entropy_study_table.md]
        [--report-only] [--list]

Every row (see ROWS) runs with the same seeds, the same number of steps and the same batch budget
(all rows start from configs/quickstart.py's task, model, optimiser and rollout settings and
differ only in the loss). Each run is a subprocess

    python -m stare_jax.train --config CONFIG --workdir ROOT/ROW/seed_S --config.key=value ...

and is skipped when already finished (its metrics.jsonl has total_steps rows and its final
eval/step_<total_steps>.json exists); an unfinished run is started again with the same command, so
the trainer resumes it from its latest checkpoint. The warm-started embedded model is built once
per seed under ROOT/models/seed_S/model (with the same function the trainer uses for
WORKDIR/model) and shared by every row of that seed through --config.model.path, and the countdown
TFDS data is shared through --config.data.data_dir=ROOT/tfds.

At the end (or with --report-only, on whatever has finished) it writes one PNG (entropy with the
target band [0.7 H_tgt, 1.3 H_tgt], train accuracy, final avg@n and pass@k, response length, STARE
gate activity and W) and a Markdown table of final figures, mean +- standard deviation over seeds,
plus the acceptance checks of the study, and prints the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # stare_jax without an install (a device image runs the scripts so), as the other scripts do

from stare_jax.writers import read_metrics, smooth  # noqa: E402
QUICKSTART = os.path.join("configs", "quickstart.py")
QUICKSTART_GRPO = os.path.join("configs", "quickstart_grpo.py")


@dataclasses.dataclass(frozen=True)
class Row:
    """One setting of the study: a config file plus overrides."""

    name: str
    label: str
    config: str
    overrides: tuple = ()

    def args(self) -> list[str]:
        return [f"--config.{k}={v}" for k, v in self.overrides]


# The paper-default STARE rows pin every STARE key, so they do not depend on what the quickstart chose.
_PAPER_O1 = (("loss.name", "stare"), ("stare.enabled", True), ("stare.variant", "O1"), ("stare.w", 1.1),
             ("stare.m", 0.9), ("stare.top_p_ratio", 0.1), ("stare.top_p_ratio_minus", 0.0),
             ("stare.adaptive", False))
ROWS: tuple[Row, ...] = (
    Row("grpo_ds", "GRPO-ds", QUICKSTART_GRPO),
    Row("stare_o1_paper", "STARE-O1 paper (W=1.1)", QUICKSTART, _PAPER_O1),
    Row("stare_c2_paper", "STARE-C2 paper (W=1.1, M=0.9)", QUICKSTART,
        _PAPER_O1[:2] + (("stare.variant", "C2"),) + _PAPER_O1[3:]),
    Row("stare_quickstart", "STARE quickstart", QUICKSTART),
    Row("stare_qs_one_p", "STARE quickstart, one P (P- = P = 0.05)", QUICKSTART, (("stare.top_p_ratio_minus", 0.0),)),
    Row("stare_o1_adaptive", "STARE-O1 adaptive (W 1.1->w_max 1.5)", QUICKSTART,
        _PAPER_O1[:-1] + (("stare.adaptive", True), ("stare.alpha", 0.01), ("stare.w_max", 1.5),
                          ("stare.m_min", 0.5))),
    Row("entropy_bonus", "entropy bonus (c=0.01)", QUICKSTART_GRPO,
        (("loss.name", "entropy_bonus"), ("loss.entropy_coef", 0.01))),
    Row("forking_tokens", "forking tokens (rho=0.2)", QUICKSTART_GRPO,
        (("loss.name", "forking_tokens"), ("loss.forking_rho", 0.2))),
    # the polarity-entropy family (issue 18), on GRPO-ds's settings with their papers' defaults
    Row("hapo", "HAPO (alpha=0.2, phi=2)", QUICKSTART_GRPO,
        (("loss.name", "hapo"), ("loss.hapo_alpha", 0.2), ("loss.hapo_phi", 2.0))),
    Row("entropy_advantage", "EntroAdv (alpha=0.4, kappa=2)", QUICKSTART_GRPO,
        (("loss.name", "entropy_advantage"), ("loss.entropy_adv_alpha", 0.4), ("loss.entropy_adv_kappa", 2.0))),
    Row("w_reinforce", "W-REINFORCE (lambda=0.1)", QUICKSTART_GRPO,
        (("loss.name", "w_reinforce"), ("loss.w_reinforce_lambda", 0.1))),
)
ROW_BY_NAME = {r.name: r for r in ROWS}
CORE_ROWS = ("grpo_ds", "stare_quickstart")


# ----------------------------------------------------------------------------- run bookkeeping



def final_eval(run_dir: str, total_steps: int) -> dict | None:
    """The results of RUN_DIR/eval/step_<total_steps>.json (first dataset), or None."""
    path = os.path.join(run_dir, "eval", f"step_{total_steps}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    results = data.get("results", {})
    if not results:
        return None
    return results[sorted(results)[0]]


def is_finished(run_dir: str, total_steps: int) -> bool:
    """A run is finished when metrics.jsonl has total_steps rows and its final eval json exists."""
    return len(read_metrics(run_dir)) >= total_steps and final_eval(run_dir, total_steps) is not None




def _col(rows: Sequence[dict], key: str) -> np.ndarray:
    out = []
    for r in rows:
        v = r.get(key)
        out.append(float(v) if isinstance(v, (int, float)) and v is not None else np.nan)
    return np.asarray(out, np.float64)


def run_summary(run_dir: str, total_steps: int, target_entropy: float, group_size: int,
                smooth_window: int = 10) -> dict:
    """Final figures of one finished (or partial) run.

    entropy_last_half_median: median of `entropy` over the last half of the steps;
    entropy_final: mean over the last `smooth_window` steps; collapse_step: first step at which the
    `smooth_window`-step moving average of `entropy` is below 0.5 H_tgt (None if never);
    in_band: entropy_last_half_median in [0.7 H_tgt, 1.3 H_tgt]; accuracy_start / accuracy_end:
    mean train accuracy over the first / last 10% of steps (at least 5); avg@n, pass@k from the final
    eval json (k = group size when available, else the largest k).
    """
    rows = read_metrics(run_dir)
    n = len(rows)
    s: dict = {"run_dir": run_dir, "steps_done": n, "finished": is_finished(run_dir, total_steps)}
    if n == 0:
        return s
    h = _col(rows, "entropy")
    half = h[n // 2:]
    s["entropy_initial"] = float(np.nanmean(h[:min(5, n)]))
    s["entropy_last_half_median"] = float(np.nanmedian(half))
    s["entropy_final"] = float(np.nanmean(h[-smooth_window:]))
    s["entropy_min_smoothed"] = float(np.nanmin(smooth(h, smooth_window)))
    below = np.nonzero(smooth(h, smooth_window) < 0.5 * target_entropy)[0]
    s["collapse_step"] = int(below[0]) + 1 if below.size else None
    s["in_band"] = bool(0.7 * target_entropy <= s["entropy_last_half_median"] <= 1.3 * target_entropy)
    edge = max(5, n // 10)
    acc = _col(rows, "accuracy")
    s["accuracy_start"] = float(np.nanmean(acc[:edge]))
    s["accuracy_end"] = float(np.nanmean(acc[-edge:]))
    s["response_length_end"] = float(np.nanmean(_col(rows, "response_length_mean")[-edge:]))
    gate = _col(rows, "stare_gate_on")
    s["gate_on_frac"] = float(np.nanmean(gate)) if np.isfinite(gate).any() else 0.0
    s["gate_on_frac_last_half"] = float(np.nanmean(gate[n // 2:])) if np.isfinite(gate).any() else 0.0
    w = _col(rows, "stare_w")
    s["stare_w_end"] = float(w[-1]) if np.isfinite(w[-1]) else None
    st = _col(rows, "step_s")
    s["train_s"] = float(np.nansum(st)) if np.isfinite(st).any() else None
    ev = final_eval(run_dir, total_steps)
    if ev is not None:
        nn = int(ev.get("n", group_size))
        s["eval_n"] = nn
        s["avg@n"] = float(ev.get(f"avg@{nn}", np.nan))
        ks = sorted(int(k.split("@")[1]) for k in ev if k.startswith("pass@"))
        k = group_size if group_size in ks else (ks[-1] if ks else None)
        s["pass_k"] = k
        s["pass@k"] = float(ev[f"pass@{k}"]) if k else None
        s["pass@1"] = float(ev.get("pass@1", np.nan))
    try:
        with open(os.path.join(run_dir, "study_run.json")) as f:
            s["wall_s"] = json.load(f).get("wall_s")
    except (OSError, json.JSONDecodeError):
        pass
    return s


def mean_sd(values: Sequence) -> tuple[float, float, int]:
    """(mean, sample standard deviation (ddof=1; 0 for one value), count) of the finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if v.size == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def _fmt(m: float, sd: float, nd: int = 3) -> str:
    if not np.isfinite(m):
        return "n/a"
    return f"{m:.{nd}f} ± {sd:.{nd}f}"


def aggregate(summaries: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: mean, sd and count over seeds of each numeric figure, plus band / collapse counts."""
    out = {}
    for row, runs in summaries.items():
        runs = [r for r in runs if r.get("steps_done", 0) > 0]
        agg: dict = {"seeds": len(runs), "finished": sum(bool(r.get("finished")) for r in runs)}
        for key in ("entropy_initial", "entropy_last_half_median", "entropy_final", "entropy_min_smoothed",
                    "accuracy_start", "accuracy_end", "response_length_end", "gate_on_frac",
                    "gate_on_frac_last_half", "avg@n", "pass@k", "pass@1", "wall_s", "train_s"):
            agg[key] = mean_sd([r.get(key) for r in runs])
        agg["in_band"] = sum(bool(r.get("in_band")) for r in runs)
        agg["collapsed"] = sum(r.get("collapse_step") is not None for r in runs)
        steps = [r["collapse_step"] for r in runs if r.get("collapse_step") is not None]
        agg["collapse_steps"] = steps
        agg["pass_k"] = next((r.get("pass_k") for r in runs if r.get("pass_k")), None)
        agg["eval_n"] = next((r.get("eval_n") for r in runs if r.get("eval_n")), None)
        out[row] = agg
    return out


def markdown_table(agg: dict[str, dict], labels: dict[str, str], target_entropy: float) -> str:
    """The table of final figures (mean ± sd over seeds)."""
    n = next((a["eval_n"] for a in agg.values() if a.get("eval_n")), "n")
    k = next((a["pass_k"] for a in agg.values() if a.get("pass_k")), "k")
    lo, hi = 0.7 * target_entropy, 1.3 * target_entropy
    head = ("| row | seeds | H median, last half | H final | in band [{:.3g}, {:.3g}] | H < {:.3g} (step) "
            "| train acc start → end | avg@{} | pass@{} | resp. length | gate on (last half) |").format(
                lo, hi, 0.5 * target_entropy, n, k)
    lines = [head, "|" + "---|" * 11]
    for row, a in agg.items():
        steps = a["collapse_steps"]
        coll = f"{a['collapsed']}/{a['seeds']}" + (f" ({int(np.median(steps))})" if steps else "")
        lines.append("| {} | {} | {} | {} | {}/{} | {} | {} → {} | {} | {} | {} | {} |".format(
            labels.get(row, row), a["seeds"] if a["finished"] == a["seeds"] else f"{a['finished']}/{a['seeds']} done",
            _fmt(*a["entropy_last_half_median"][:2]), _fmt(*a["entropy_final"][:2]), a["in_band"], a["seeds"],
            coll, _fmt(*a["accuracy_start"][:2], nd=2), _fmt(*a["accuracy_end"][:2], nd=2),
            _fmt(*a["avg@n"][:2]), _fmt(*a["pass@k"][:2]), _fmt(*a["response_length_end"][:2], nd=1),
            _fmt(*a["gate_on_frac_last_half"][:2], nd=2)))
    return "\n".join(lines)


def acceptance(agg: dict[str, dict], summaries: dict[str, list[dict]], target_entropy: float,
               baseline: str = "grpo_ds", candidate: str = "stare_quickstart") -> list[tuple[str, bool, str]]:
    """The study's checks 1-3 as (name, passed, detail); missing rows count as not passed."""
    out = []
    g, q = summaries.get(baseline, []), summaries.get(candidate, [])
    if g:
        ok = all(r.get("collapse_step") is not None for r in g)
        out.append(("1. GRPO-ds entropy falls below 0.5 H_tgt (10-step mean), every seed", ok,
                    "collapse steps " + ", ".join(str(r.get("collapse_step")) for r in g)
                    + "; final H " + ", ".join(f"{r.get('entropy_final', float('nan')):.3f}" for r in g)))
    else:
        out.append(("1. GRPO-ds entropy collapse", False, "row did not run"))
    if q:
        ok = all(r.get("in_band") for r in q)
        out.append(("2. quickstart STARE last-half median entropy in [0.7, 1.3] H_tgt, every seed", ok,
                    "medians " + ", ".join(f"{r.get('entropy_last_half_median', float('nan')):.3f}" for r in q)
                    + f" vs band [{0.7 * target_entropy:.3f}, {1.3 * target_entropy:.3f}]"))
    else:
        out.append(("2. quickstart STARE in band", False, "row did not run"))
    if baseline in agg and candidate in agg:
        (qm, qs, _), (gm, gs, _) = agg[candidate]["avg@n"], agg[baseline]["avg@n"]
        ok_avg = np.isfinite(qm) and np.isfinite(gm) and qm >= gm - gs
        out.append(("3a. quickstart STARE avg@n >= GRPO-ds avg@n - 1 sd (GRPO's sd over seeds)", bool(ok_avg),
                    f"{qm:.3f} ± {qs:.3f} vs {gm:.3f} ± {gs:.3f}"))
        (qp, qps, _), (gp, gps, _) = agg[candidate]["pass@k"], agg[baseline]["pass@k"]
        ok_pass = np.isfinite(qp) and np.isfinite(gp) and qp >= gp
        out.append((f"3b. quickstart STARE pass@{agg[candidate].get('pass_k')} >= GRPO-ds's (means over seeds)",
                    bool(ok_pass), f"{qp:.3f} ± {qps:.3f} vs {gp:.3f} ± {gps:.3f}"))
        (a0, _, _), (a1, _, _) = agg[candidate]["accuracy_start"], agg[candidate]["accuracy_end"]
        out.append(("4b. quickstart STARE train accuracy rises over the run", bool(a1 > a0),
                    f"{a0:.3f} -> {a1:.3f}"))
    return out


# ----------------------------------------------------------------------------- figure

def plot_study(summaries_rows: dict[str, list[list[dict]]], agg: dict[str, dict], labels: dict[str, str],
               target_entropy: float, out: str, smooth_window: int = 10, title: str = "") -> str:
    """One PNG: entropy (mean over seeds, min-max shaded) with the target band, train accuracy,
    final avg@n / pass@k bars, response length, gate activity, STARE W."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    ax_h, ax_acc, ax_eval, ax_len, ax_gate, ax_w = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(summaries_rows) > len(colors):  # distinct colours beyond the default ten
        colors = [plt.get_cmap("tab20")(i) for i in range(20)]
    ax_h.axhspan(0.7 * target_entropy, 1.3 * target_entropy, color="tab:green", alpha=0.12,
                 label=f"target band [0.7, 1.3] × H_tgt ({target_entropy:g})")
    ax_h.axhline(target_entropy, color="tab:green", lw=0.8, ls="--")
    ax_h.axhline(0.5 * target_entropy, color="tab:red", lw=0.8, ls=":", label="0.5 H_tgt")

    def band(ax, runs, key, color, label, window):
        curves = [smooth(_col(r, key), window) for r in runs if r]
        if not curves or not any(np.isfinite(c).any() for c in curves):
            return
        n = min(len(c) for c in curves)
        y = np.stack([c[:n] for c in curves])
        x = np.arange(1, n + 1)
        ax.plot(x, np.nanmean(y, 0), color=color, lw=1.4, label=label)
        if len(curves) > 1:
            ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), color=color, alpha=0.15)

    for i, (row, runs) in enumerate(summaries_rows.items()):
        c = colors[i % len(colors)]
        lab = labels.get(row, row)
        band(ax_h, runs, "entropy", c, lab, smooth_window)
        band(ax_acc, runs, "accuracy", c, lab, smooth_window)
        band(ax_len, runs, "response_length_mean", c, lab, smooth_window)
        band(ax_gate, runs, "stare_gate_on", c, lab, smooth_window)
        if any(np.nansum(_col(r, "stare_gate_on")) > 0 for r in runs):  # W is only meaningful with STARE on
            band(ax_w, runs, "stare_w", c, lab, 1)

    names = list(agg)
    x = np.arange(len(names))
    avg = [agg[r]["avg@n"] for r in names]
    pk = [agg[r]["pass@k"] for r in names]
    n = next((agg[r]["eval_n"] for r in names if agg[r].get("eval_n")), "n")
    k = next((agg[r]["pass_k"] for r in names if agg[r].get("pass_k")), "k")
    ax_eval.bar(x - 0.2, [a[0] for a in avg], 0.4, yerr=[a[1] for a in avg], label=f"avg@{n}", capsize=3)
    ax_eval.bar(x + 0.2, [p[0] for p in pk], 0.4, yerr=[p[1] for p in pk], label=f"pass@{k}", capsize=3)
    ax_eval.set_xticks(x, [labels.get(r, r) for r in names], rotation=30, ha="right", fontsize=7)
    ax_eval.set_ylim(0, 1)

    for ax, t in ((ax_h, f"batch entropy H_bar (mean over seeds, min-max shaded; {smooth_window}-step avg)"),
                  (ax_acc, "train accuracy (sampled, T=1)"), (ax_eval, "final eval (mean ± sd over seeds)"),
                  (ax_len, "response length (mean tokens)"), (ax_gate, "STARE gate on (fraction, smoothed)"),
                  (ax_w, "STARE W")):
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        if ax is not ax_eval:
            ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    ax_gate.set_ylim(-0.05, 1.05)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=85)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------- running

def load_base_config(config_path: str):
    from stare_jax.config import load_config_file
    return load_config_file(os.path.join(REPO, config_path))


def ensure_model(root: str, seed: int, env: dict, log) -> str:
    """Builds (once) the warm-started embedded model of configs/quickstart.py for `seed` under
    ROOT/models/seed_S/model, in a subprocess, with the trainer's own `embedded_model_dir`."""
    workdir = os.path.join(root, "models", f"seed_{seed}")
    path = os.path.join(workdir, "model")
    if os.path.isfile(os.path.join(path, "stare_embedded.json")):
        return path
    code = ("import sys; from stare_jax.config import load_config_file; from stare_jax.trainer import "
            "embedded_model_dir; c = load_config_file(sys.argv[1]); c.seed = int(sys.argv[2]); "
            "print(embedded_model_dir(c, sys.argv[3]))")
    t0 = time.time()
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "build.log"), "w") as f:
        subprocess.run([sys.executable, "-c", code, QUICKSTART, str(seed), workdir], cwd=REPO, env=env,
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    log(f"  warm-start model seed {seed}: {time.time() - t0:.0f}s -> {path}")
    return path


def run_one(row: Row, seed: int, root: str, steps: int | None, extra: Sequence[str], env: dict, log,
            share_model: bool) -> float:
    run_dir = os.path.join(root, row.name, f"seed_{seed}")
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "stare_jax.train", "--config", row.config, "--workdir", run_dir,
           f"--config.seed={seed}", "--config.logging.progress=False", "--config.logging.tensorboard=False",
           f"--config.data.data_dir={os.path.join(root, 'tfds')}"]
    if share_model:
        cmd.append(f"--config.model.path={ensure_model(root, seed, env, log)}")
    if steps:
        cmd.append(f"--config.total_steps={steps}")
    cmd += row.args() + list(extra)
    return launch(cmd, run_dir, env, f"{row.name} seed {seed}")


def launch(cmd: Sequence[str], run_dir: str, env: dict, name: str) -> float:
    """Runs one training command (output appended to RUN_DIR/train.log), adds its wall time to
    RUN_DIR/study_run.json and returns it; raises RuntimeError when it fails."""
    t0 = time.time()
    with open(os.path.join(run_dir, "train.log"), "a") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(list(cmd), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{name} failed with status {rc}; see {run_dir}/train.log")
    prev = 0.0
    try:
        with open(os.path.join(run_dir, "study_run.json")) as f:
            prev = json.load(f).get("wall_s", 0.0)
    except (OSError, json.JSONDecodeError):
        pass
    with open(os.path.join(run_dir, "study_run.json"), "w") as f:
        json.dump({"cmd": list(cmd), "wall_s": prev + wall}, f, indent=1)
    return wall


def collect(root: str, rows: Sequence[Row], seeds: Sequence[int], total_steps: int, target_entropy: float,
            group_size: int):
    summaries, metric_rows = {}, {}
    for row in rows:
        summaries[row.name], metric_rows[row.name] = [], []
        for s in seeds:
            d = os.path.join(root, row.name, f"seed_{s}")
            if is_finished(d, total_steps):  # runs still in progress are left out of the figures
                summaries[row.name].append(run_summary(d, total_steps, target_entropy, group_size))
                metric_rows[row.name].append(read_metrics(d))
    return summaries, metric_rows


def write_report(lines: Sequence[str], out_md: str, root: str, summary: dict) -> str:
    """Joins the report's Markdown lines, writes them to `out_md` (if given) and `summary` to
    ROOT/summary.json; returns the text."""
    text = "\n".join(lines) + "\n"
    if out_md:
        os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
        with open(out_md, "w") as f:
            f.write(text)
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return text


def report(root: str, rows: Sequence[Row], seeds: Sequence[int], total_steps: int, target_entropy: float,
           group_size: int, out_png: str, out_md: str, wall_s: float | None, command: str) -> str:
    summaries, metric_rows = collect(root, rows, seeds, total_steps, target_entropy, group_size)
    summaries = {k: v for k, v in summaries.items() if v}
    metric_rows = {k: v for k, v in metric_rows.items() if v}
    labels = {r.name: r.label for r in rows}
    agg = aggregate(summaries)
    table = markdown_table(agg, labels, target_entropy)
    checks = acceptance(agg, summaries, target_entropy)
    lines = [f"Command: `{command}`", "",
             f"Seeds {', '.join(map(str, seeds))}; {total_steps} steps per run; H_tgt = {target_entropy:g}.", "",
             table, "", "Checks:", ""]
    lines += [f"- [{'x' if ok else ' '}] {name}: {detail}" for name, ok, detail in checks]
    pending = [f"{r.name} seed {s}" for r in rows for s in seeds
               if not is_finished(os.path.join(root, r.name, f"seed_{s}"), total_steps)]
    if pending:
        lines.append(f"- not finished (left out above): {', '.join(pending)}")
    run_walls = [r.get("wall_s") for v in summaries.values() for r in v if r.get("wall_s")]
    if run_walls:
        lines.append(f"- sum of per-run wall times: {sum(run_walls) / 60:.1f} min over {len(run_walls)} runs")
    if wall_s is not None:
        lines.append(f"- study wall time (this invocation): {wall_s / 60:.1f} min")
    text = write_report(lines, out_md, root, {"summaries": summaries, "aggregate": agg, "checks": checks})
    if out_png and metric_rows:
        plot_study(metric_rows, agg, labels, target_entropy, out_png,
                   title=f"entropy study: {total_steps} steps, seeds {','.join(map(str, seeds))}")
    return text


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a study's --steps: 0 or less is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {value}")
    return value


def seed_list(text: str) -> str:
    """argparse type: comma-separated integers >= 0 (a study's --seeds), returned as given; "" stands
    for the study's default seeds."""
    parts = [x for x in text.split(",") if x]
    if not all(x.isdigit() for x in parts) or (text and not parts):
        raise argparse.ArgumentTypeError(f"comma-separated integers >= 0, got {text!r}")
    return text


def study_arguments(p: argparse.ArgumentParser, *, root: str, out: str, rows: Sequence[Row]) -> None:
    """Adds the options every countdown study takes to `p`: where its runs live, seeds, rows, steps,
    figure, table, --report-only, --list and extra config overrides."""
    p.add_argument("--root", default=root, help="directory of all the study's runs")
    p.add_argument("--seeds", type=seed_list, default="0,1,2")
    p.add_argument("--rows", default=",".join(r.name for r in rows), help="comma-separated row names (--list)")
    p.add_argument("--steps", type=positive_int, default=None, help="total_steps of every run (default: the config's)")
    p.add_argument("--out", default="", help=f"the figure (default: {out} for the full default study, "
                   f"ROOT/{os.path.basename(out)} when --rows, --seeds, --steps or --override narrow or change it)")
    p.set_defaults(committed_figure=out)
    p.add_argument("--table", default="", help="also write the Markdown report here (default: ROOT/table.md)")
    p.add_argument("--report-only", action="store_true", help="do not train; summarise what has finished")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.add_argument("--override", action="append", default=[],
                   help="extra --config.key=value for every run (repeatable; changes the study)")


def figure_path(a: argparse.Namespace, p: argparse.ArgumentParser,
                committed: str, study_keys: Sequence[str] = ("rows", "seeds", "steps", "override")) -> str:
    """Where a study's figure goes: `--out` when given; else the figure the docs show (`committed`)
    only when every option in `study_keys` has its default (the full study), and ROOT/<its file name>
    for a narrower or changed one, so that a run of one row or seed never overwrites the committed
    figure with a partial one."""
    if a.out:
        return a.out
    if all(getattr(a, k) == p.get_default(k) for k in study_keys):
        return committed
    return os.path.join(a.root, os.path.basename(committed))


def chosen_rows(names: str, by_name: dict[str, Row], study: str) -> list[Row] | None:
    """The rows named in the comma-separated `names`, or None after printing one line to stderr that
    names the unknown ones and the allowed ones (the caller exits 2)."""
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        print(f"{study}: unknown rows {unknown}; allowed: {', '.join(by_name)}", file=sys.stderr)
        return None
    return [by_name[n] for n in names.split(",")]


def study_root(path: str, study: str, outputs: Sequence[tuple[str, str]] = ()) -> str | None:
    """The absolute study root `path`, made if absent, or None after printing one line to stderr
    when it is empty, a file, or cannot be created or written, or when one of `outputs` ((flag,
    path) of files written at the end; "" for the default) cannot be written (the caller exits 2)."""
    from stare_jax.workdir import WorkdirError, check_workdir, unwritable_file_reason

    try:
        root = check_workdir(path, create=True, flag="--root")
    except WorkdirError as e:
        print(f"{study}: {e}", file=sys.stderr)
        return None
    for flag, out in outputs:
        reason = unwritable_file_reason(out) if out else None
        if reason:
            print(f"{study}: {flag}: {out}: cannot be written ({reason})", file=sys.stderr)
            return None
    os.makedirs(root, exist_ok=True)
    return root


def study_env(one_device: bool = True) -> dict:
    """The environment of a study's runs: this one with the repository on PYTHONPATH and, with
    `one_device` and unless XLA_FLAGS is set, one XLA CPU device a run."""
    env = dict(os.environ)
    if one_device:
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def study_logger(root: str):
    """A log function: prints each message with the time and appends it to ROOT/study.log."""
    path = os.path.join(root, "study.log")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    return log


def run_jobs(jobs: Sequence[tuple[Row, int]], root: str, total_steps: int, run, log, done=None) -> list[str]:
    """Runs every (row, seed) job whose run under ROOT/ROW/seed_S has not finished: `run(row, seed)`
    trains it and returns its wall seconds; a run that fails (RuntimeError or CalledProcessError) is
    logged and the study goes on. `done(row, seed, run_dir)` adds text to a finished run's log line.
    Returns the failed jobs' names."""
    failed: list[str] = []
    t_start = time.time()
    for i, (row, seed) in enumerate(jobs, 1):
        run_dir = os.path.join(root, row.name, f"seed_{seed}")
        if is_finished(run_dir, total_steps):
            log(f"[{i}/{len(jobs)}] {row.name} seed {seed}: finished, reused")
            continue
        log(f"[{i}/{len(jobs)}] {row.name} seed {seed}: running ...")
        try:
            wall = run(row, seed)
        except (RuntimeError, subprocess.CalledProcessError) as e:  # keep going; the report shows it
            failed.append(f"{row.name} seed {seed}")
            log(f"[{i}/{len(jobs)}] FAILED: {e}")
            continue
        extra = f"; {done(row, seed, run_dir)}" if done else ""
        log(f"[{i}/{len(jobs)}] {row.name} seed {seed}: {wall:.0f}s{extra}; elapsed {(time.time() - t_start) / 60:.1f} min")
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    study_arguments(p, root="runs/entropy_study", out="docs/figures/entropy_study.png", rows=ROWS)
    p.add_argument("--no-share-model", action="store_true",
                   help="let each run warm-start its own model in WORKDIR/model (slower)")
    a = p.parse_args(argv)
    if a.list:
        for r in ROWS:
            print(f"{r.name:20s} {r.config:28s} {' '.join(r.args())}")
        return 0
    rows = chosen_rows(a.rows, ROW_BY_NAME, "entropy_study")
    if rows is None:
        return 2
    seeds = [int(s) for s in a.seeds.split(",") if s]
    root = study_root(a.root, "entropy_study", (("--out", a.out), ("--table", a.table)))
    if root is None:
        return 2
    base = load_base_config(QUICKSTART)
    total_steps = a.steps or base.total_steps
    target_entropy = float(base.stare.target_entropy)
    group_size = int(base.rollout.group_size)
    extra = [o if o.startswith("--config.") else f"--config.{o}" for o in a.override]
    command = "python scripts/entropy_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env, log = study_env(), study_logger(root)

    def done(row: Row, seed: int, run_dir: str) -> str:
        s = run_summary(run_dir, total_steps, target_entropy, group_size)
        return (f"H median last half {s.get('entropy_last_half_median', float('nan')):.3f}, "
                f"avg@n {s.get('avg@n', float('nan')):.3f}, pass@k {s.get('pass@k') or float('nan'):.3f}")

    t_start = time.time()
    failed: list[str] = []
    if not a.report_only:
        # the two rows the acceptance checks compare run first for every seed, then the rest seed-major,
        # so an interrupted study has the comparison complete and every row for the first seeds
        core = [r for r in rows if r.name in CORE_ROWS]
        jobs = [(r, s) for r in core for s in seeds] + [(r, s) for s in seeds for r in rows if r not in core]
        log(f"study: {len(rows)} rows x {len(seeds)} seeds, {total_steps} steps each, root {root}")
        failed = run_jobs(jobs, root, total_steps, lambda row, seed: run_one(
            row, seed, root, a.steps, extra, env, log, share_model=not a.no_share_model), log, done)
    wall = time.time() - t_start
    figure = figure_path(a, p, a.committed_figure)
    text = report(root, rows, seeds, total_steps, target_entropy, group_size, figure,
                  a.table or os.path.join(root, "table.md"), None if a.report_only else wall, command)
    print(text)
    log((f"report of {root} written" if a.report_only else f"study done in {wall / 60:.1f} min") + f"; figure {figure}" + (f"; FAILED runs: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
