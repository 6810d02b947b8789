"""Metric sinks at the edge of the system: JSONL (the contract), TensorBoard, optional W&B, and a
progress line. Only process 0 writes; other processes get a writer that does nothing."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import jax


def configure_logging() -> None:
    """The entry points' logging: INFO lines with time and logger name on stderr, with absl (Orbax
    logs every checkpoint step at INFO) and JAX's backend probing ("Unable to initialize backend
    'tpu'" on every CPU or GPU host) at WARNING, without the `KNOWN_NOTICES`."""
    import logging

    from absl import logging as absl_logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    quiet_known_notices()


#: absl warnings that only repeat what the system does by design: TFDS's for a builder config that is
#: not predefined (every builder here is made from its settings), Orbax's for a checkpoint directory
#: opened read-only (evaluate, export)
KNOWN_NOTICES = ("Using custom data configuration", "Given directory is read only")


def _not_a_known_notice(record) -> bool:
    return not str(record.msg).startswith(KNOWN_NOTICES)


def quiet_known_notices() -> None:
    """Drops `KNOWN_NOTICES` from the absl logger (once, however often it is called)."""
    import logging

    absl_logger = logging.getLogger("absl")
    if _not_a_known_notice not in absl_logger.filters:
        absl_logger.addFilter(_not_a_known_notice)


def _jsonable(v: Any):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def truncate_jsonl(path: str, last_step: int) -> int:
    """Drops the lines of `path` whose `step` is greater than `last_step` (and any torn last line);
    returns the number of lines kept. Used on resume so the file matches an uninterrupted run."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a kill: it and anything after it are dropped
            if row.get("step", -1) <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(kept)


def read_metrics(run_dir: str) -> list[dict]:
    """Rows of RUN_DIR/metrics.jsonl sorted by step, one per step (the last written wins); a torn
    line ends the file; [] when the run has no metrics yet."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            rows[int(row.get("step", len(rows)))] = row
    return [rows[k] for k in sorted(rows)]


def smooth(y, window: int):
    """Trailing moving average of `y` over `window` points (shorter at the start; window <= 1: y)."""
    import numpy as np

    y = np.asarray(y, np.float64)
    if window <= 1 or y.size == 0:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def read_jsonl(path: str) -> list[dict]:
    """All rows of a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends one JSON object per step to `workdir/metrics.jsonl` and mirrors scalars to TensorBoard/W&B."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, wandb: bool = False, wandb_project: str = "",
                 config: Mapping | None = None, filename: str = "metrics.jsonl", purge_step: int | None = None):
        """`purge_step`: the step this attempt starts at; TensorBoard then hides the events of steps
        >= it written by earlier attempts of the run (steps redone after a resume)."""
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, filename)
        self._tb = None
        self._wandb = None
        if not self.active:
            return
        os.makedirs(workdir, exist_ok=True)
        self._file = open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter
            tb_dir = os.path.join(workdir, "tensorboard")
            resumed = os.path.isdir(tb_dir) and any(f.startswith("events.") for f in os.listdir(tb_dir))
            self._tb = SummaryWriter(tb_dir, purge_step=purge_step if resumed else None)
        if wandb:
            import wandb as wandb_lib  # optional dependency, installed by the user
            self._wandb = wandb_lib.init(project=wandb_project, dir=workdir, config=dict(config or {}),
                                         resume="allow", id=os.path.basename(os.path.abspath(workdir)))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes the metrics of `step` (flushed, so a kill loses at most the line being written)."""
        if not self.active:
            return
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        if not self.active:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """A one-line progress display with ETA and the key metrics (stderr, process 0 only)."""

    KEYS = ("reward_mean", "accuracy", "entropy", "stare_gate_on", "response_length_mean")

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total, self.start = total, start
        self.enabled = enabled and jax.process_index() == 0
        self.t0 = time.time()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start
        rate = (time.time() - self.t0) / max(done, 1)
        eta = rate * (self.total - step - 1)
        parts = [f"step {step + 1}/{self.total}", f"{rate:.2f}s/it", f"eta {_fmt_time(eta)}"]
        parts += [f"{k.replace('_mean', '')}={float(metrics[k]):.3f}" for k in self.KEYS if k in metrics]
        line = " | ".join(parts)
        if self.tty:
            sys.stderr.write("\r" + line[:200].ljust(120))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
