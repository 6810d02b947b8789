"""Orbax checkpoints of the whole run: train state (parameters, optimizer, controller, step, RNG),
data-pipeline position and the config.

Layout: `WORKDIR/checkpoints/<step>/{state, data, meta}`. Saves are asynchronous; the train loop
only waits for them at exit. A step directory counts only when Orbax committed it
(`commit_success.txt` in the step and in every item): on a local disk Orbax itself would also
count an empty or half-written `<step>/`, so `Checkpointer` validates, moves a bad step aside to
`<step>.invalid-<n>` with a warning, and falls back to the previous one. Restoring takes an
abstract target whose shardings decide the placement, so a checkpoint saved on one mesh restores
onto any other mesh or device count.

Integrity: Orbax 0.12 stores no checksum of the array data (a flipped bit in an OCDBT data file
restores silently), so `save` records a content digest of every array of the state in the step's
`meta` item, committed atomically with it, and every restore recomputes it from the restored
arrays (`state_digest`: two wrapping uint32 sums per array, layout-independent, so it holds across
meshes and partial restores). A mismatch, or a non-finite parameter or optimizer value, makes the
step unusable like a truncated one: training, `evaluate` and `export` all go through
`Checkpointer.restore` and fall back to the previous step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from stare_jax import config as config_lib
from stare_jax import workdir as workdir_lib

log = logging.getLogger(__name__)

ITEMS = workdir_lib.CHECKPOINT_ITEMS
FAULT_KILL_DURING_SAVE = "STARE_FAULT_KILL_DURING_SAVE"  # test hook: SIGKILL right after save(step) starts
FAULT_DISK_FULL_FROM_SAVE = "STARE_FAULT_DISK_FULL_FROM_SAVE"  # test hook: no free space from save(step) on
# test hook "STEP:PROCESS": that process's files are limited to 1 KiB from save(STEP) on, so its part of
# the checkpoint fails in Orbax's writer threads (EFBIG) while the other processes' parts succeed
FAULT_WRITE_FAILS_FROM_SAVE = "STARE_FAULT_WRITE_FAILS_FROM_SAVE"
WAIT_POLL_S = 0.05  # how often processes agree on a pending save's state while one waits for it
ORBAX_ERRORS_LOG = "checkpoint_errors.log"  # in the workdir: Orbax's error records of failed saves
# Old steps are deleted by an atomic rename into this folder, which is then emptied: a kill during
# the deletion leaves a half-deleted tree there (removed on the next start), never a half-deleted
# `<step>/` that Orbax would list as a step.
TODELETE = "todelete"

# Keys that may change between a run and its resumption: they do not alter what the saved state
# means (logging, evaluation, checkpoint cadence, run length, device layout, verifier resources, where
# compiled programs are cached, the float rounding of computations: rematerialisation, attention in blocks, the
# vocabulary chunk and whether its logits are kept, packing, a GPU's GEMM kernels, the decode
# layers' layout, the static batch's compaction, and whether a multi-step update's pre-update
# statistics come from the sampler or a pre-pass).
RESUMABLE_CHANGES = ("total_steps", "checkpoint_every", "keep_checkpoints", "checkpoint_compression", "log_every",
                     "test_freq", "compilation_cache_dir",
                     "logging.", "eval.", "mesh.", "distributed.", "reward.timeout_s", "reward.num_workers",
                     "data.data_dir", "data.prompt_bucket_multiple", "model.preset", "model.scan_layers",
                     "model.remat", "model.remat_saves", "model.remat_saves_layers", "model.attention_block", "model.vocab_chunk", "model.vocab_keep_logits_mb",
                     "dynamic_sampling.max_num_gen_batches", "ppo.pack_tokens", "ppo.pack_buckets", "rollout.decode_layout",
                     "rollout.compact_min_rows", "model.matmul_precision", "model.gpu_gemm",
                     "model.cpu_gemm", "ppo.old_stats")

# Keys added after runs were first saved, with the value that reproduces the behaviour from before
# they existed: a saved config without such a key counts as holding that value.
ADDED_KEYS = {"stare.top_p_ratio_minus": 0.0,
              # the polarity-entropy family (issue 18): their defaults leave earlier methods unchanged
              "loss.hapo_alpha": 0.2, "loss.hapo_phi": 2.0, "loss.entropy_adv_alpha": 0.4,
              "loss.entropy_adv_kappa": 2.0, "loss.w_reinforce_lambda": 0.1, "loss.quadrants": "",
              # slot-refilling rollouts (issue 20): 0 is the static batch every earlier run used
              "rollout.slots": 0,
              # the static batch's compaction (issue 20): 0 decodes every row to the end, as before
              "rollout.compact_min_rows": 0,
              # what a rematerialised layer keeps (issue 20): "nothing" is the whole-layer remat of before
              "model.remat_saves": "nothing",
              # how many layers keep it (issue 20): -1, every layer, as before
              "model.remat_saves_layers": -1,
              # the precision of float32 products: "default" is each backend's own, as before
              "model.matmul_precision": "default",
              # the packed capacities' buckets (issue 20): the multiples of ppo.pack_tokens of before
              "ppo.pack_buckets": "linear",
              # kept vocabulary-pass logits (issue 20): 0 recomputes them in the backward, as before
              "model.vocab_keep_logits_mb": 0}


DIGEST_ALGORITHM = "u32-wsum-mix-v1"
# Leaves that may legitimately be non-finite (the controller's last H_bar is NaN before any step).
NONFINITE_ALLOWED = ("last_entropy",)


class IncompatibleCheckpointError(RuntimeError):
    """The workdir's checkpoint was written under a config this run may not continue."""


class CheckpointUnusableError(RuntimeError):
    """A checkpoint step that was asked for by number cannot be used (missing, incomplete or damaged)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a read-only or failing file system);
    `step` is the step whose save failed. The committed steps before it are untouched.

    `abandoned`: the save failed on some process of several, whose Orbax threads still wait at a
    barrier the failed process never reaches (until Orbax's 10-minute timeout): the process must
    end with `os._exit`, which does not join them (`train` does)."""

    def __init__(self, message: str, step: int | None, *, abandoned: bool = False):
        super().__init__(message)
        self.step = step
        self.abandoned = abandoned


class _OrbaxErrorsToFile(logging.Filter):
    """Diverts Orbax's ERROR records from stderr to a file (`path`, WORKDIR/checkpoint_errors.log):
    a save that fails in the background logs each writer thread's traceback (~300 lines for one
    failed write) before the run reports the failure in one line that names this file. A record
    that cannot be written there (the disk that failed) is dropped."""

    path: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.path is None or record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        try:
            with open(self.path, "a") as f:
                f.write(logging.Formatter("%(asctime)s %(levelname)s [%(threadName)s] %(message)s").format(record)
                        + "\n")
        except OSError:
            pass
        return False


_ORBAX_ERRORS = _OrbaxErrorsToFile()


# ----------------------------------------------------------------------------- content digest

def _u32_words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 values, same shape (a trailing axis of 2 for 64-bit dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes -> [..., 2]


def _leaf_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(two uint32 sums over the array's bits, all-finite flag). Integer sums wrap exactly and do not
    depend on the order of reduction, so the digest is the same for any sharding or device count.
    The first sum weights word i by the odd number 2i + 1, so any single flipped bit changes it; the
    second sums a mixed (avalanched) hash of (word, index), catching multi-bit damage."""
    u = _u32_words(x)
    idx = jnp.zeros(u.shape, jnp.uint32)
    for d, n in enumerate(u.shape):
        idx = idx * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d)
    s1 = jnp.sum(u * (idx * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    h = u ^ (idx * jnp.uint32(0x9E3779B9))
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    s2 = jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jnp.stack([s1, s2]), finite


# One small program per distinct (shape, dtype, sharding) of a leaf, not one for the whole state,
# and on a CPU without XLA's tree-reduction rewrite: that pass (there for the rounding of long float
# sums; these sums are exact integer ones) split each sum into a windowed reduction whose inputs, the
# hashed words, were written out in full first. Without it the hashing fuses into the two sums:
# SmolLM2-135M's train state (41 arrays, 404 M words) digests in 0.31-0.38 s against 0.65-0.77 s
# (1.8-2.4 s under glibc's malloc, which faults those temporaries in afresh every call), the first
# digest of a process (compilation included) in 1.06 s against 4.9-5.6 s (2-vCPU AMD EPYC, Zen 3;
# `scripts/bench_checkpoint.py --part digest`, docs/faults.md). The sums are the same either way.
# Every process dispatches the same leaves in the same order.
CPU_DIGEST_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}
_leaf_digest_fns = {"cpu": jax.jit(_leaf_digest, compiler_options=CPU_DIGEST_COMPILER_OPTIONS),
                    "other": jax.jit(_leaf_digest)}


def _leaf_digest_fn(x: jax.Array):
    """`_leaf_digest(x)` compiled for the platform of `x`'s devices (see CPU_DIGEST_COMPILER_OPTIONS)."""
    platform = next(iter(x.devices())).platform if isinstance(x, jax.Array) else jax.default_backend()
    return _leaf_digest_fns["cpu" if platform == "cpu" else "other"](x)


def _holds_cpu_collectives(x) -> bool:
    """True when `x` is split over several XLA:CPU devices, so its digest program sums over them
    with collectives (a replicated leaf is summed on each device alone). XLA:CPU runs each device's
    part of a program as a task of one shared thread pool, and a part waiting at a collective holds
    its thread: with several such programs in flight the threads can all wait at one program's
    all-reduce while a device's part of it is queued behind another, a deadlock XLA:CPU aborts after
    40 s (reproduced with 4 CPU devices on 2 cores and 40 sharded leaves within a few hundred
    digests; a CI run of the mesh-restore test died of it)."""
    return (isinstance(x, jax.Array) and not x.sharding.is_fully_replicated
            and next(iter(x.devices())).platform == "cpu")


def state_digest(tree) -> dict[str, tuple[list[int], bool]]:
    """{leaf path: ([sum1, sum2], all finite)} for every array of `tree` (a pytree of jax Arrays,
    NNX states included). Pure and deterministic; the same on any mesh. Each leaf runs
    `_leaf_digest` as its own jitted program, all dispatched before the first result is read,
    except that a program with XLA:CPU collectives finishes before the next starts
    (`_holds_cpu_collectives`)."""
    from stare_jax import parallel

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [parallel.path_to_str(p) for p, _ in flat]
    out = []
    for _, x in flat:
        out.append(_leaf_digest_fn(x))
        if _holds_cpu_collectives(x):
            jax.block_until_ready(out[-1])
    return {p: ([int(v) for v in parallel.to_host(sums)], bool(parallel.to_host(ok)))
            for p, (sums, ok) in zip(paths, out)}


def digest_problem(restored_digest: dict, saved: dict | None) -> str | None:
    """Why a restored state may not be used, or None: a leaf whose digest differs from the one saved
    with the checkpoint (`saved`: meta["digest"], None for checkpoints written before digests), a
    leaf the checkpoint has no digest for, or a non-finite value outside `NONFINITE_ALLOWED`."""
    leaves = None if saved is None else saved.get("leaves", {})
    if saved is not None and saved.get("algorithm") != DIGEST_ALGORITHM:
        return f"unknown digest algorithm {saved.get('algorithm')!r}"
    for path, (sums, finite) in sorted(restored_digest.items()):
        if leaves is not None:
            if path not in leaves:
                return f"no saved digest for {path}"
            if list(leaves[path]) != list(sums):
                return f"content digest mismatch in {path} (data damaged after it was written)"
        if not finite and not path.endswith(NONFINITE_ALLOWED):
            return f"non-finite values in {path}"
    return None


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

    def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False, compression: bool = False):
        """`compression`: zstd (level 3) on the state's arrays as they are written (`checkpoint_compression`);
        restores read either kind."""
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.read_only = read_only
        self.compression = compression
        if not read_only and jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
        self._keep = keep
        self._manager = None
        self._pending: int | None = None  # the step of the last save started, until it is known done
        self.abandoned = False  # a save failed on one of several processes (see CheckpointWriteError)
        self._errors_logged = 0  # the size of WORKDIR/checkpoint_errors.log when the last save started
        if not read_only and jax.process_index() == 0:
            self._remove_unfinished_saves()  # of a killed run (Orbax's own option does it in a thread)
        self._open()

    def _open(self):
        if self._manager is not None:
            self._manager.close()
        # read-only: the values Orbax would otherwise set with a warning each
        options = ocp.CheckpointManagerOptions(max_to_keep=None if self.read_only else self._keep,
                                               save_interval_steps=0 if self.read_only else 1,
                                               create=not self.read_only,
                                               read_only=self.read_only, enable_async_checkpointing=True,
                                               todelete_subdir=None if self.read_only else TODELETE)
        # The state item's handler, configured (Orbax's StandardCheckpointHandler, which `StandardSave`
        # picked before, always compresses); the same zarr3 + OCDBT layout, so earlier steps restore.
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                                         use_compression=self.compression),
                    "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._taken_error: BaseException | None = None
        if not self.read_only:
            self._record_background_errors()
            _ORBAX_ERRORS.path = os.path.join(os.path.dirname(self.directory), ORBAX_ERRORS_LOG)
            logging.getLogger("absl").addFilter(_ORBAX_ERRORS)
        self.purge_deleted()

    def purge_deleted(self) -> None:
        """Removes the steps Orbax retired into `checkpoints/todelete/` (and any half-deleted leftover)."""
        path = os.path.join(self.directory, TODELETE)
        if not self.read_only and jax.process_index() == 0 and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ inspection
    def is_complete(self, step: int) -> bool:
        """Whether `<step>/` and each of its items carry Orbax's commit marker."""
        return workdir_lib.step_is_committed(self.directory, step)

    def steps(self) -> list[int]:
        """All step numbers Orbax lists (complete or not), ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _quarantine(self, step: int, reason: str) -> None:
        src = os.path.join(self.directory, str(step))
        n = 0
        while os.path.exists(f"{src}.invalid-{n}"):
            n += 1
        if self.read_only:
            log.warning("checkpoint step %d is unusable (%s); skipped", step, reason)
            return
        log.warning("checkpoint step %d is unusable (%s); moved aside to %s.invalid-%d", step, reason, src, n)
        if jax.process_index() == 0 and os.path.exists(src):
            os.replace(src, f"{src}.invalid-{n}")
        self._open()

    # ------------------------------------------------------------------ save / restore
    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Starts an asynchronous save of `state` (a pytree of arrays), the data position and metadata.
        The content digest of `state` (`state_digest`) is stored in the metadata item."""
        self.wait()  # the previous save's failure is reported as its own
        self._check_space(step, state)
        digest = {p: sums for p, (sums, _) in state_digest(state).items()}
        meta = {**meta, "digest": {"algorithm": DIGEST_ALGORITHM, "leaves": digest}}
        self._taken_error = None
        log_path = _ORBAX_ERRORS.path
        self._errors_logged = os.path.getsize(log_path) if log_path and os.path.exists(log_path) else 0
        if os.environ.get(FAULT_WRITE_FAILS_FROM_SAVE) == f"{step}:{jax.process_index()}":
            import resource
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, resource.RLIM_INFINITY))
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:
            raise self._write_failed(e, step) from e
        self._pending = step
        if not saved:
            raise RuntimeError(f"checkpoint for step {step} was not written (existing steps: {self.steps()})")
        if os.environ.get(FAULT_KILL_DURING_SAVE) == str(step):
            # Fault injection for the tests: die while the asynchronous save is in flight, once its
            # temporary `<step>.*` directory exists (under load Orbax may not have created it yet)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                    name.startswith(f"{step}.") for name in os.listdir(self.directory)):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

    def bytes_needed(self, state) -> int:
        """About how many bytes this process's next checkpoint takes on disk: the newest committed
        step's size, with 5 % and 1 MiB to spare, or, before the first (and uncompressed), the
        state's own bytes; 0 when unknown (a first compressed save, a directory this process does
        not see)."""
        if not os.path.isdir(self.directory):  # another process's local directory, made by its process 0
            return 0
        committed = [int(n) for n in os.listdir(self.directory) if n.isdigit() and self.is_complete(int(n))]
        if committed:
            size = sum(os.path.getsize(os.path.join(root, f))
                       for root, _, files in os.walk(os.path.join(self.directory, str(max(committed)))) for f in files)
        elif not self.compression:
            size = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(state)) // jax.process_count()
        else:
            return 0
        return int(size * 1.05) + 2 ** 20

    def _check_space(self, step: int, state) -> None:
        """CheckpointWriteError, on every process, when any process's checkpoint directory has less
        free space than `bytes_needed`: checked before the save starts, so a full disk stops the run
        with one line instead of failing in Orbax's writer threads."""
        from stare_jax import parallel

        needed = self.bytes_needed(state)
        free = shutil.disk_usage(self.directory).free if needed else 0
        if step >= int(os.environ.get(FAULT_DISK_FULL_FROM_SAVE) or 2 ** 62):
            free = 0
        short = np.asarray([needed > free], np.int32)
        if int(np.max(parallel.gather_hosts(short))):
            where = (f"{self.directory} needs about {needed / 2 ** 20:.1f} MiB and has {free / 2 ** 20:.1f} MiB free"
                     if short[0] else "another process's checkpoint directory is short of space")
            raise CheckpointWriteError(f"the checkpoint of step {step} was not started: {where}", step)

    def check(self) -> None:
        """CheckpointWriteError if a save running in the background has failed by now (does not
        block: the train loop calls it after every step, so a failed save stops the run before more
        steps are done that no checkpoint holds). On several processes every process raises at the
        same step when any one's part of the save failed (agreed over processes while a save is
        pending: one small host gather a step then, none otherwise)."""
        if self._pending is None:
            return
        failed, busy = self._agree_on_pending()
        if failed and jax.process_count() > 1:
            raise self._failed_elsewhere(failed)
        if failed or not busy:  # agreed already: no second gather in wait
            self.wait(agree=False)  # a finished save returns at once; a failed one raises its error here

    def wait(self, *, agree: bool = True) -> None:
        """Blocks until pending saves are committed; CheckpointWriteError if one failed. On several
        processes with `agree` (every process calls it at the same point, as the train loop does):
        if any process's part failed, on every process, without waiting for Orbax's barrier timeout."""
        if agree and self._pending is not None and jax.process_count() > 1:
            while True:
                failed, busy = self._agree_on_pending()
                if failed:
                    raise self._failed_elsewhere(failed)
                if not busy:
                    break
                time.sleep(WAIT_POLL_S)
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_failed(e, self._pending) from e
        self._pending = None

    def _async_manager(self):
        """Orbax's asynchronous-save manager behind this CheckpointManager (private attributes of
        orbax-checkpoint, pinned in pyproject.toml), or None where a version lays it out otherwise."""
        return getattr(getattr(self._manager, "_checkpointer", None), "_async_manager", None)

    def _background_error(self) -> BaseException | None:
        """The exception of this process's failed background write, as soon as Orbax's writer thread
        has stored it: read without clearing it (Orbax's finalize must still see it, or it would go
        on to retire old steps after a failed save), or as recorded when the finalize thread took it
        (on several processes that thread then waits at a barrier and reports nothing)."""
        return self._taken_error or getattr(self._async_manager(), "_exception", None)

    def _record_background_errors(self) -> None:
        """Wraps the manager's `check_for_errors` (where Orbax's finalize thread takes, and clears,
        its writer thread's exception) to keep a copy for `_background_error`."""
        async_manager = self._async_manager()
        check = getattr(async_manager, "check_for_errors", None)
        if check is None:
            return

        def recording_check():
            try:
                check()
            except BaseException as e:
                self._taken_error = e
                raise

        async_manager.check_for_errors = recording_check

    def _agree_on_pending(self) -> tuple[int, bool]:
        """(1 + the index of the first process whose part of the pending save failed, or 0; whether
        a save is still in progress on any process), the same on every process."""
        from stare_jax import parallel

        mine = np.asarray([[self._background_error() is not None, self._manager.is_saving_in_progress()]], np.int32)
        every = parallel.gather_hosts(mine)
        failed = [i for i in range(len(every)) if every[i, 0]]
        return (failed[0] + 1 if failed else 0), bool(every[:, 1].any())

    def _failed_elsewhere(self, failed: int) -> CheckpointWriteError:
        """The error every process raises when process `failed - 1`'s part of the pending save failed
        on several processes: that process names the system's reason, the others the process."""
        step, self.abandoned = self._pending, True
        error = self._background_error()
        if error is not None:
            e = self._write_failed(error, step)
            return CheckpointWriteError(f"{e} (on process {jax.process_index()} of {jax.process_count()})", step,
                                        abandoned=True)
        return CheckpointWriteError(f"the checkpoint of step {step} could not be written to {self.directory}: "
                                    f"process {failed - 1}'s part failed (its own error line gives the reason)",
                                    step, abandoned=True)

    def _remove_unfinished_saves(self) -> None:
        """Removes the temporary `<step>.orbax-checkpoint-tmp*` directories of saves that never
        committed (a kill, a failed write): they hold no usable step and take space."""
        for name in os.listdir(self.directory):
            if ".orbax-checkpoint-tmp" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _write_failed(self, e: Exception, step: int | None) -> CheckpointWriteError:
        """The error for a save that failed, after removing the temporary directories of unfinished
        saves (what a full disk most needs back; Orbax would remove them on the next start)."""
        if not self.read_only and jax.process_index() == 0:
            self._remove_unfinished_saves()
        failed = f"step {step}" if step is not None else "a step"
        details = ""
        if _ORBAX_ERRORS.path and os.path.exists(_ORBAX_ERRORS.path) and os.path.getsize(_ORBAX_ERRORS.path) > self._errors_logged:
            details = f" (Orbax's log of it: {_ORBAX_ERRORS.path})"
        return CheckpointWriteError(f"the checkpoint of {failed} could not be written to {self.directory}: "
                                    f"{workdir_lib.storage_reason(e) or config_lib.first_line(e)[:200]}{details}", step)

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of `step` (config, step, versions)."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, abstract_state, *, step: int | None = None, partial: bool = False):
        """(step, state, data_state, meta) of the newest usable checkpoint (or of `step`), or None.

        The one restore path of training, evaluation and export. `abstract_state` is a pytree of
        `jax.ShapeDtypeStruct` with shardings (the target layout); with `partial=True` it may be a
        subtree of the saved state (e.g. {"train": {"model": ...}}), the rest is never read, and
        data_state is None. A step is usable when it is complete (commit markers), Orbax restores
        it, and the restored arrays match the content digest saved with it and are finite. An
        unusable step is moved aside (read-only: skipped) with a warning and the previous one is
        tried; an unusable `step` asked for by number raises CheckpointUnusableError.
        """
        candidates = [step] if step is not None else list(reversed(self.steps()))
        for s in candidates:
            problem, restored = self._try_restore(s, abstract_state, partial)
            if problem is None:
                state, meta = restored["state"], restored["meta"]
                return s, state, None if partial else restored["data"], meta
            if step is not None:
                raise CheckpointUnusableError(f"checkpoint step {s} in {self.directory} is unusable: {problem}")
            self._quarantine(s, problem)
        return None

    def _try_restore(self, step: int, abstract_state, partial: bool):
        """(None, restored items) or (why the step is unusable, None)."""
        if step not in self.steps():
            return f"no such step (steps: {self.steps()})", None
        if not self.is_complete(step):
            return "incomplete: no commit marker (interrupted save?)", None
        missing = self._missing_files(step)
        if missing:
            return f"missing file {missing}", None
        try:
            state_args = ocp.args.PyTreeRestore(
                item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                partial_restore=partial)
            if partial:
                args = ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
            else:
                args = ocp.args.Composite(state=state_args, data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # corrupt files: fall back to the previous checkpoint
            return f"restore failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}", None
        saved = restored["meta"].get("digest") if isinstance(restored["meta"], dict) else None
        if saved is None:
            log.warning("checkpoint step %d has no content digest (written before digests existed); only its "
                        "finiteness is checked", step)
        problem = digest_problem(state_digest(restored["state"]), saved)
        return (problem, None) if problem else (None, restored)

    def _missing_files(self, step: int) -> str | None:
        """A file every committed OCDBT state item has and Orbax needs (checked before Orbax reads
        it: a missing root manifest otherwise surfaces as ~50 "Event loop is closed" tracebacks), or
        None when both are there. Damage elsewhere is caught by the restore or the digest."""
        state = os.path.join(self.directory, str(step), "state")
        for name in ("manifest.ocdbt", "_METADATA"):
            if not os.path.isfile(os.path.join(state, name)):
                return os.path.join(state, name)
        return None

    def restore_latest(self, abstract_state) -> tuple[int, Any, dict, dict] | None:
        """(step, state, data_state, meta) of the newest usable checkpoint, or None (see `restore`)."""
        return self.restore(abstract_state)

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

    def abandon(self) -> None:
        """Gives up a pending save without waiting for it: after another process of the run was
        lost, Orbax's threads wait for it at the save's commit barrier until their timeout. `close`
        then does nothing and the process must end with `os._exit`; the uncommitted step is moved
        aside when the next run starts."""
        if self._pending is not None:
            log.warning("checkpoint of step %d abandoned uncommitted: another process of the run was lost",
                        self._pending)
        self.abandoned = True

    def close(self) -> None:
        """Waits for pending saves and releases the manager (its threads end even when a save
        failed: CheckpointWriteError is raised after). After a save that failed on one of several
        processes it does nothing: Orbax's threads wait at a barrier the failed process never
        reaches, and the process ends with `os._exit` (`CheckpointWriteError.abandoned`)."""
        if self.abandoned:
            return
        try:
            self.wait(agree=False)  # also reached on one process alone, by an error of its own
        finally:
            try:
                self._manager.close()
            except Exception as e:  # the failed save's error again: already reported by wait()
                log.debug("checkpoint manager close: %s", e)
            self.purge_deleted()


def write_json_atomic(path: str, obj) -> None:
    """Writes JSON to `path` via a temporary file and rename, so readers never see half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
