"""Plot the training metrics of one or more runs into one PNG.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] --out metrics.png [--smooth 10]
        [--labels a,b] [--target-entropy 0.3]

Each RUN_DIR holds the trainer's `metrics.jsonl` (one JSON object per step). Panels: batch entropy
(H_bar, with the target band [0.7 H_tgt, 1.3 H_tgt] when H_tgt is known from the run's
config.json or --target-entropy), reward and accuracy, response length, STARE gate activity
(`stare_gate_on`, smoothed into a fraction of steps), and the four-quadrant diagnostics
(`quad_*_frac` and `quad_*_dH`, see stare_jax/rl/diagnostics.py). Missing metrics leave their
panel empty. `--smooth N` is a trailing moving average over N steps (1 = raw).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # stare_jax without an install

from stare_jax.writers import read_metrics, smooth  # noqa: E402

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")




def series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` over the rows that have it as a finite number."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(int(r.get("step", len(xs))) + 1)
            ys.append(float(v))
    return np.asarray(xs, np.int64), np.asarray(ys, np.float64)




def run_target_entropy(run_dir: str) -> float | None:
    """stare.target_entropy from RUN_DIR/config.json, if present."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    st = cfg.get("stare", {}) if isinstance(cfg, dict) else {}
    v = st.get("target_entropy") if isinstance(st, dict) else cfg.get("stare.target_entropy")
    return float(v) if isinstance(v, (int, float)) else None


def draw_band(ax, h_tgt: float | None) -> None:
    if h_tgt:
        ax.axhspan(0.7 * h_tgt, 1.3 * h_tgt, color="tab:green", alpha=0.12, label="[0.7, 1.3] H_tgt")
        ax.axhline(h_tgt, color="tab:green", lw=0.8, ls="--")
        ax.axhline(0.5 * h_tgt, color="tab:red", lw=0.6, ls=":", label="0.5 H_tgt")


def plot_runs(run_dirs: Sequence[str], out: str, *, labels: Sequence[str] | None = None, smooth_window: int = 1,
              target_entropy: float | None = None, title: str | None = None) -> str:
    """Draws the panels for `run_dirs` into the PNG `out`; returns `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [read_metrics(d) for d in run_dirs]
    h_tgt = target_entropy
    if h_tgt is None:
        found = {t for t in (run_target_entropy(d) for d in run_dirs) if t is not None}
        h_tgt = found.pop() if len(found) == 1 else None

    fig, axes = plt.subplots(3, 3, figsize=(16, 12))
    ax_h, ax_acc, ax_len, ax_gate, ax_w, ax_qf, ax_qd, ax_qt, ax_g = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def line(ax, rows, key, color, label, ls="-"):
        x, y = series(rows, key)
        if x.size:
            ax.plot(x, smooth(y, smooth_window), color=color, ls=ls, lw=1.2, label=label)
        return x.size > 0

    draw_band(ax_h, h_tgt)
    for i, (rows, lab) in enumerate(zip(runs, labels)):
        c = colors[i % len(colors)]
        line(ax_h, rows, "entropy", c, lab)
        line(ax_acc, rows, "accuracy", c, f"{lab} accuracy")
        if any("reward_mean" in r and "accuracy" in r and r["reward_mean"] != r["accuracy"] for r in rows):
            line(ax_acc, rows, "reward_mean", c, f"{lab} reward", ls="--")
        line(ax_len, rows, "response_length_mean", c, lab)
        line(ax_gate, rows, "stare_gate_on", c, lab)
        if series(rows, "stare_gate_on")[1].sum() > 0:  # W / M are only meaningful when STARE ever gated on
            line(ax_w, rows, "stare_w", c, f"{lab} W")
            line(ax_w, rows, "stare_m", c, f"{lab} M", ls="--")
        line(ax_g, rows, "grad_norm", c, lab)
        for q, ls in zip(QUADRANTS, ("-", "--", "-.", ":")):
            qlab = f"{lab} {q}" if len(runs) > 1 else q
            line(ax_qf, rows, f"quad_{q}_frac", c, qlab, ls=ls)
            line(ax_qd, rows, f"quad_{q}_dH", c, qlab, ls=ls)
        line(ax_qt, rows, "quad_total_dH", c, lab)
    ax_qt.axhline(0.0, color="k", lw=0.5)
    ax_qd.axhline(0.0, color="k", lw=0.5)

    for ax, t, yl in ((ax_h, "batch entropy H_bar" + (f" (H_tgt {h_tgt:g})" if h_tgt else ""), "nats/token"),
                      (ax_acc, "train accuracy (solid) / reward (dashed)", ""),
                      (ax_len, "response length (mean)", "tokens"),
                      (ax_gate, "STARE gate activity (stare_gate_on)", "fraction of steps"),
                      (ax_w, "STARE W (solid) and M (dashed)", ""),
                      (ax_qf, "quadrant token fractions quad_*_frac", ""),
                      (ax_qd, "quadrant predicted dH quad_*_dH", ""),
                      (ax_qt, "predicted total dH (quad_total_dH)", ""),
                      (ax_g, "grad norm", "")):
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("step")
        if yl:
            ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles and len(handles) <= 16:
            ax.legend(fontsize=7, loc="best")
    ax_gate.set_ylim(-0.05, 1.05)
    fig.suptitle(title or (f"{len(runs)} run(s)" + (f", smoothing {smooth_window}" if smooth_window > 1 else "")))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", required=True, help="PNG path to write")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in steps (1 = raw)")
    p.add_argument("--labels", default="", help="comma-separated legend labels, one per run")
    p.add_argument("--target-entropy", type=float, default=None,
                   help="H_tgt for the band (default: stare.target_entropy of the runs' config.json)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    for d in a.runs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            print(f"plot_metrics: {d}: no metrics.jsonl", file=sys.stderr)
            return 2
    from stare_jax.workdir import unwritable_file_reason

    reason = unwritable_file_reason(a.out)
    if reason:
        print(f"plot_metrics: --out: {a.out}: cannot be written ({reason})", file=sys.stderr)
        return 2
    labels = a.labels.split(",") if a.labels else None
    out = plot_runs(a.runs, a.out, labels=labels, smooth_window=a.smooth, target_entropy=a.target_entropy,
                    title=a.title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
