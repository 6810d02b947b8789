"""The polarity-entropy quadrant intervention study (issue 18) in miniature, on the embedded countdown task.

    python scripts/quadrant_study.py --root runs/quadrant_study [--seeds 0,1,2] [--rows a,b,...]
        [--steps N] [--out docs/figures/quadrant_study.png] [--table docs/quadrant_study_table.md]
        [--report-only] [--list] [--override key=value ...]

The controlled interventions of "Rethinking Token-Level Credit Assignment in RLVR: A Polarity-Entropy
Analysis" (arXiv 2604.11056): GRPO-ds (configs/quickstart_grpo.py) trained on all tokens, and on the
tokens of one quadrant only (`loss.quadrants` = PHR, PLR, NLR or NHR: reward polarity x token entropy
at or above the group's mean), with the token-mean normaliser of all valid tokens, so the four
single-quadrant gradients add up to the full one. Same seeds, steps and batches for every row.

Runs, resumption and reporting are those of scripts/entropy_study.py (one subprocess per run,
skipped when finished, resumed from its checkpoint otherwise; one warm-started model per seed
shared by every row). The report adds the paper's three findings, each checked on the means over
seeds and stated as holding or not:

  1. PHR-only keeps entropy (the highest last-half median entropy of the single quadrants) and
     generalises best among them (the highest final avg@n, and pass@k);
  2. PLR-only collapses entropy (the lowest last-half median of the single quadrants) and gains
     least beyond the start (the smallest train-accuracy gain, last 10% minus first 10% of steps);
  3. NHR learns faster than NLR (a higher mean train accuracy over the first half of the run).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from typing import Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_entropy_study():
    spec = importlib.util.spec_from_file_location("_entropy_study", os.path.join(HERE, "entropy_study.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


es = _load_entropy_study()
Row = es.Row
QUADRANTS = ("PHR", "PLR", "NLR", "NHR")
ROWS: tuple = (Row("grpo_ds", "GRPO-ds (all tokens)", es.QUICKSTART_GRPO),) + tuple(
    Row(f"q_{q.lower()}", f"{q} only", es.QUICKSTART_GRPO, (("loss.quadrants", q),)) for q in QUADRANTS)
ROW_BY_NAME = {r.name: r for r in ROWS}


def _mean(agg: dict, row: str, key: str) -> float:
    a = agg.get(row)
    return float(a[key][0]) if a is not None and a[key][2] > 0 else float("nan")


def first_half_accuracy(metric_rows: dict[str, list[list[dict]]], row: str) -> float:
    """Mean over seeds of the mean train accuracy over the first half of each run's steps."""
    vals = []
    for rows in metric_rows.get(row, []):
        acc = es._col(rows, "accuracy")
        if acc.size:
            vals.append(float(np.nanmean(acc[:max(1, acc.size // 2)])))
    return float(np.mean(vals)) if vals else float("nan")


def stopped_runs(root: str, rows: Sequence, seeds: Sequence[int], total_steps: int) -> dict[str, list[dict]]:
    """Per row, the runs that stopped before total_steps: steps done, train accuracy and entropy of
    their last 10 steps, mean train accuracy over their steps in the first half of the run, and the
    trainer's last `error:` line."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        for sd in seeds:
            d = os.path.join(root, r.name, f"seed_{sd}")
            m = es.read_metrics(d)
            if not m or es.is_finished(d, total_steps):
                continue
            why = None
            try:
                with open(os.path.join(d, "train.log")) as f:
                    errors = [line.strip()[len("error:"):].strip() for line in f if line.startswith("error:")]
                why = errors[-1] if errors else None
            except OSError:
                pass
            out.setdefault(r.name, []).append({
                "seed": sd, "steps": len(m), "accuracy_last10": float(np.nanmean(es._col(m[-10:], "accuracy"))),
                "entropy_last10": float(np.nanmean(es._col(m[-10:], "entropy"))), "reason": why,
                "first_half_accuracy": float(np.nanmean(es._col(m[:max(1, total_steps // 2)], "accuracy")))})
    return out


def findings(agg: dict, metric_rows: dict, stopped: dict | None = None) -> list[tuple[str, bool, str]]:
    """The paper's three findings as (statement, holds here, detail), compared among the single-quadrant
    rows with finished runs; a row whose runs all stopped early (`stopped_runs`) is named in the
    detail, and finding 3 then uses the train accuracy of the steps its runs did (up to half the run)."""
    stopped = stopped or {}
    singles = [f"q_{q.lower()}" for q in QUADRANTS if f"q_{q.lower()}" in agg]
    missing = [f"q_{q.lower()}" for q in QUADRANTS if f"q_{q.lower()}" not in agg]
    if len(singles) < 2 or "q_phr" not in singles:
        return [("quadrant findings", False, f"too few single-quadrant rows finished (missing: {missing})")]
    note = (f" (no finished run: {', '.join(m[2:].upper() for m in missing)})" if missing else "")
    h = {r: _mean(agg, r, "entropy_last_half_median") for r in singles}
    avg = {r: _mean(agg, r, "avg@n") for r in singles}
    pk = {r: _mean(agg, r, "pass@k") for r in singles}
    gain = {r: _mean(agg, r, "accuracy_end") - _mean(agg, r, "accuracy_start") for r in singles}
    fmt = lambda d: ", ".join(f"{r[2:].upper()} {v:.3f}" for r, v in d.items()) + note  # noqa: E731
    out = []
    keeps = max(h, key=h.get) == "q_phr"
    best = max(avg, key=avg.get) == "q_phr" and max(pk, key=pk.get) == "q_phr"
    out.append(("1a. PHR-only keeps entropy best of the single quadrants (last-half median H)", keeps, fmt(h)))
    out.append(("1b. PHR-only generalises best of the single quadrants (avg@n and pass@k)", best,
                f"avg@n {fmt(avg)}; pass@k {fmt(pk)}"))
    out.append(("2a. PLR-only collapses entropy most (lowest last-half median H)",
                "q_plr" in h and min(h, key=h.get) == "q_plr", fmt(h)))
    out.append(("2b. PLR-only gains least beyond the start (train accuracy, last 10% - first 10%)",
                "q_plr" in gain and min(gain, key=gain.get) == "q_plr", fmt(gain)))
    def early(r):  # mean over seeds: finished runs' first half, stopped runs' steps within the first half
        if r in metric_rows:
            return first_half_accuracy(metric_rows, r)
        vals = [x["first_half_accuracy"] for x in stopped.get(r, [])]
        return float(np.mean(vals)) if vals else float("nan")

    nhr, nlr = early("q_nhr"), early("q_nlr")
    out.append(("3. NHR learns faster than NLR (mean train accuracy, first half of the run)",
                bool(np.isfinite(nhr) and np.isfinite(nlr) and nhr > nlr), f"NHR {nhr:.3f} vs NLR {nlr:.3f}"))
    return out


def report(root: str, rows: Sequence, seeds: Sequence[int], total_steps: int, target_entropy: float,
           group_size: int, out_png: str, out_md: str, wall_s: float | None, command: str) -> str:
    """Table (entropy study columns), the findings, and the figure (entropy trajectory, accuracy, evals)."""
    summaries, metric_rows = es.collect(root, rows, seeds, total_steps, target_entropy, group_size)
    summaries = {k: v for k, v in summaries.items() if v}
    metric_rows = {k: v for k, v in metric_rows.items() if v}
    labels = {r.name: r.label for r in rows}
    agg = es.aggregate(summaries)
    lines = [f"Command: `{command}`", "",
             f"Seeds {', '.join(map(str, seeds))}; {total_steps} steps per run; GRPO-ds settings "
             f"(configs/quickstart_grpo.py) with `loss.quadrants` per row.", "",
             es.markdown_table(agg, labels, target_entropy), "", "The paper's findings, here:", ""]
    stopped = stopped_runs(root, rows, seeds, total_steps)
    lines += [f"- [{'x' if ok else ' '}] {name}: {detail}" for name, ok, detail in findings(agg, metric_rows, stopped)]
    pending = [f"{r.name} seed {s}" for r in rows for s in seeds
               if not es.is_finished(os.path.join(root, r.name, f"seed_{s}"), total_steps)]
    if pending:
        lines.append(f"- not finished (left out above): {', '.join(pending)}")
    for name, runs in stopped.items():
        for x in runs:
            lines.append(f"- {name} seed {x['seed']} stopped after {x['steps']} of {total_steps} steps (last 10: train "
                         f"accuracy {x['accuracy_last10']:.3f}, H {x['entropy_last10']:.3f})"
                         + (f": {x['reason'][:120]}" if x["reason"] else ""))
    if wall_s is not None:
        lines.append(f"- study wall time (this invocation): {wall_s / 60:.1f} min")
    text = "\n".join(lines) + "\n"
    if out_md:
        os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
        with open(out_md, "w") as f:
            f.write(text)
    if out_png and metric_rows:
        es.plot_study(metric_rows, agg, labels, target_entropy, out_png,
                      title=f"quadrant interventions: {total_steps} steps, seeds {','.join(map(str, seeds))}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    es.study_arguments(p, root="runs/quadrant_study", out="docs/figures/quadrant_study.png", rows=ROWS)
    a = p.parse_args(argv)
    if a.list:
        for r in ROWS:
            print(f"{r.name:10s} {r.config:28s} {' '.join(r.args())}")
        return 0
    rows = es.chosen_rows(a.rows, ROW_BY_NAME, "quadrant_study")
    if rows is None:
        return 2
    seeds = [int(s) for s in a.seeds.split(",") if s]
    root = es.study_root(a.root, "quadrant_study", (("--out", a.out), ("--table", a.table)))
    if root is None:
        return 2
    base = es.load_base_config(es.QUICKSTART_GRPO)
    total_steps = a.steps or base.total_steps
    target_entropy = float(base.stare.target_entropy)
    group_size = int(base.rollout.group_size)
    extra = [o if o.startswith("--config.") else f"--config.{o}" for o in a.override]
    command = "python scripts/quadrant_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env, log = es.study_env(), es.study_logger(root)
    t_start = time.time()
    failed: list[str] = []
    if not a.report_only:
        jobs = [(r, s) for s in seeds for r in rows]  # seed-major: an interrupted study has whole seeds
        log(f"quadrant study: {len(rows)} rows x {len(seeds)} seeds, {total_steps} steps each, root {root}")
        failed = es.run_jobs(jobs, root, total_steps, lambda row, seed: es.run_one(
            row, seed, root, a.steps, extra, env, log, share_model=True), log)
    wall = time.time() - t_start
    figure = es.figure_path(a, p, a.committed_figure)
    text = report(root, rows, seeds, total_steps, target_entropy, group_size, figure,
                  a.table or os.path.join(root, "table.md"), None if a.report_only else wall, command)
    print(text)
    log(f"report of {root} written; figure {figure}" + (f"; FAILED runs: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
