"""Orbax checkpoints of the whole run: train state (parameters, optimizer, controller, step, RNG),
data-pipeline position and the config.

Layout: `WORKDIR/checkpoints/<step>/{state, data, meta}`. Saves are asynchronous; the train loop
only waits for them at exit. A step directory counts only when Orbax committed it
(`commit_success.txt` in the step and in every item): on a local disk Orbax itself would also
count an empty or half-written `<step>/`, so `Checkpointer` validates, moves a bad step aside to
`<step>.invalid-<n>` with a warning, and falls back to the previous one. Restoring takes an
abstract target whose shardings decide the placement, so a checkpoint saved on one mesh restores
onto any other mesh or device count.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

from stare_jax import config as config_lib

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "meta")
FAULT_KILL_DURING_SAVE = "STARE_FAULT_KILL_DURING_SAVE"  # test hook: SIGKILL right after save(step) starts
_COMMIT = "commit_success.txt"

# Keys that may change between a run and its resumption: they do not alter what the saved state
# means (logging, evaluation, checkpoint cadence, run length, device layout, verifier resources).
RESUMABLE_CHANGES = ("total_steps", "checkpoint_every", "keep_checkpoints", "log_every", "test_freq",
                     "logging.", "eval.", "mesh.", "distributed.", "reward.timeout_s", "reward.num_workers",
                     "data.data_dir", "data.prompt_bucket_multiple", "model.preset", "model.scan_layers",
                     "dynamic_sampling.max_num_gen_batches")

# Keys added after runs were first saved, with the value that reproduces the behaviour from before
# they existed: a saved config without such a key counts as holding that value.
ADDED_KEYS = {"stare.top_p_ratio_minus": 0.0,
              # the polarity-entropy family (issue 18): their defaults leave earlier methods unchanged
              "loss.hapo_alpha": 0.2, "loss.hapo_phi": 2.0, "loss.entropy_adv_alpha": 0.4,
              "loss.entropy_adv_kappa": 2.0, "loss.w_reinforce_lambda": 0.1, "loss.quadrants": ""}


class IncompatibleCheckpointError(RuntimeError):
    """The workdir's checkpoint was written under a config this run may not continue."""


def config_to_json(config) -> dict[str, Any]:
    """The flattened config as a JSON-able dict {"a.b": value}."""
    return {k: v for k, v in config_lib.flatten(config).items()}


def incompatible_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Config keys whose values differ between the saved run and this one, except resumable ones
    (a key of `ADDED_KEYS` missing from `saved` counts as its old-behaviour value)."""
    saved, current = {**ADDED_KEYS, **saved}, {**ADDED_KEYS, **current}
    keys = sorted(set(saved) | set(current))
    return [k for k in keys if saved.get(k) != current.get(k)
            and not any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUMABLE_CHANGES)]


class Checkpointer:
    """Saves and restores the run's checkpoints in `workdir/checkpoints` (absolute path)."""

    def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.read_only = read_only
        if not read_only and jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
        self._keep = keep
        self._manager = None
        self._open()

    def _open(self):
        if self._manager is not None:
            self._manager.close()
        options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=not self.read_only,
                                               read_only=self.read_only, enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------ inspection
    def is_complete(self, step: int) -> bool:
        """Whether `<step>/` and each of its items carry Orbax's commit marker."""
        root = os.path.join(self.directory, str(step))
        return os.path.isfile(os.path.join(root, _COMMIT)) and all(
            os.path.isfile(os.path.join(root, item, _COMMIT)) for item in ITEMS)

    def steps(self) -> list[int]:
        """All step numbers Orbax lists (complete or not), ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _quarantine(self, step: int, reason: str) -> None:
        src = os.path.join(self.directory, str(step))
        n = 0
        while os.path.exists(f"{src}.invalid-{n}"):
            n += 1
        log.warning("checkpoint step %d is unusable (%s); moved aside to %s.invalid-%d", step, reason, src, n)
        if jax.process_index() == 0 and not self.read_only:
            os.replace(src, f"{src}.invalid-{n}")
        self._open()

    # ------------------------------------------------------------------ save / restore
    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Starts an asynchronous save of `state` (a pytree of arrays), the data position and metadata."""
        saved = self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=True)
        if not saved:
            raise RuntimeError(f"checkpoint for step {step} was not written (existing steps: {self.steps()})")
        if os.environ.get(FAULT_KILL_DURING_SAVE) == str(step):
            # Fault injection for the tests: die while the asynchronous save is in flight.
            os.kill(os.getpid(), signal.SIGKILL)

    def wait(self) -> None:
        """Blocks until pending saves are committed."""
        self._manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of `step` (config, step, versions)."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_latest(self, abstract_state) -> tuple[int, Any, dict, dict] | None:
        """(step, state, data_state, meta) of the newest usable checkpoint, or None when there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings (the target layout).
        Incomplete or unreadable steps are moved aside with a warning and the previous one is tried.
        """
        for step in reversed(self.steps()):
            if not self.is_complete(step):
                self._quarantine(step, "incomplete: no commit marker (interrupted save?)")
                continue
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore()))
            except Exception as e:  # corrupt files: fall back to the previous checkpoint
                self._quarantine(step, f"restore failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            return step, restored["state"], restored["data"], restored["meta"]
        return None

    def restore_model(self, step: int, abstract_model_state):
        """The policy parameters alone of checkpoint `step`: the `model` subtree of its train state,
        read with Orbax's partial restore onto `abstract_model_state` (a pytree of
        `jax.ShapeDtypeStruct` with shardings). The optimizer moments and the reference model are
        never read, so evaluation and export need the parameters' memory once, not the whole
        train state's."""
        target = {"train": {"model": abstract_model_state}}
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
        return restored["state"]["train"]["model"]

    def check_compatible(self, config) -> None:
        """Raises IncompatibleCheckpointError when the latest checkpoint's config differs from `config`
        in a key that changes what the saved state means."""
        for step in reversed(self.steps()):
            if not self.is_complete(step):
                continue
            try:
                saved = self.read_meta(step)["config"]
            except Exception:
                continue
            bad = incompatible_keys(saved, config_to_json(config))
            if bad:
                detail = ", ".join(f"{k}: {saved.get(k)!r} -> {config_lib.flatten(config).get(k)!r}" for k in bad[:6])
                raise IncompatibleCheckpointError(
                    f"cannot resume from {self.directory} (step {step}): config differs in {detail}. "
                    f"Use a new --workdir, or rerun with the original values.")
            return

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def write_json_atomic(path: str, obj) -> None:
    """Writes JSON to `path` via a temporary file and rename, so readers never see half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
