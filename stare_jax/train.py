"""Command line of the main job (contract 5 of DESIGN.md).

    python -m stare_jax.train --config configs/quickstart.py --workdir runs/quickstart [--config.key=value ...]

Running the same command again resumes from the latest usable checkpoint in WORKDIR/checkpoints.
A bad config, a missing model or data path, a workdir that is a file or is in use by another
training exit with status 2 and a one-line message before anything is compiled; so does a model
directory that cannot be used (a damaged config.json, weights or tokenizer file, an unsupported
architecture). SIGTERM/SIGINT
finish the current step, save a checkpoint and exit with 143/130 (docs/faults.md); so does a closed
terminal (SIGHUP, 129), after which the run's output goes to WORKDIR/hangup.log. With
`--restarts N` a training process killed by a signal (an XLA abort, the OOM killer) is started
again from its newest checkpoint, at most N times in a row without a new checkpoint, each restart
recorded in WORKDIR/restarts.jsonl
(`stare_jax.supervisor`). On several processes, an error or a death on one stops the others
within seconds, each with one line (a path missing on one host: at start-up, exit 2).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from stare_jax import config as config_lib

ABANDON_GRACE_S = 3.0  # process 0 outlives the others by this much when it stops alone or abandons a failed save


def parse_workdir(argv) -> str:
    """The value of --workdir (or --workdir=...), or exit 2 with a one-line message."""
    for i, arg in enumerate(argv):
        if arg == "--workdir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
    print("config error: --workdir: missing; allowed: a directory path (created if absent)", file=sys.stderr)
    sys.exit(2)


def config_and_workdir(argv):
    """(the config of `--config` with its overrides, the `--workdir` value) from argv (argv[0] the
    program); exits 2 with one line on a config error or a missing --workdir."""
    config = config_lib.load_config_or_exit([a for a in argv if not a.startswith("--workdir")
                                             and not _is_workdir_value(argv, a)],
                                            own_flags=("--workdir DIR", "--restarts N"))
    return config, parse_workdir(argv)


def main(argv=None) -> None:
    """Parses flags, validates the config against the devices, and runs training."""
    argv = list(sys.argv if argv is None else argv)
    config_lib.exit_with_usage_if_asked(argv, __doc__)
    config, workdir = config_and_workdir(argv)
    from stare_jax import distributed
    from stare_jax import workdir as workdir_lib

    problem = None
    try:
        workdir_lib.check_workdir(workdir, create=True)
        config_lib.check_paths(config)
    except (config_lib.ConfigError, workdir_lib.WorkdirError) as e:
        problem = str(e) if isinstance(e, config_lib.ConfigError) else f"config error: {e}"
    if problem is not None and not distributed.spans_processes(config):
        print(problem, file=sys.stderr)
        sys.exit(2)
    from stare_jax.writers import configure_logging

    configure_logging()
    distributed.initialize(config)
    # On several processes a path may be missing on one host only: every process stops, each with
    # one line (the others would wait for the failed one in their first collective).
    problem = distributed.agree_on_startup_problem(problem)
    if problem is not None:
        print(problem, file=sys.stderr)
        sys.exit(2)
    from stare_jax import compilation

    compilation.use_persistent_cache(config.compilation_cache_dir)
    import jax

    try:
        config_lib.validate(config, num_devices=jax.device_count())
    except config_lib.ConfigError as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)
    from stare_jax import trainer
    from stare_jax.preemption import Preempted

    try:
        trainer.train(config, workdir)
    except KeyboardInterrupt:  # Ctrl-C before the handlers are installed
        print("stopped by SIGINT before the first training step: nothing to save; rerun the same command to "
              "start again", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        line, status = outcome(e, workdir)
        several = jax.process_count() > 1
        if line is None and not several:
            raise  # a bug: its traceback
        if line is None:
            traceback.print_exc()
        else:
            print(line, file=sys.stderr)
        if getattr(e, "abandoned", False) or (several and not isinstance(e, Preempted)):
            # This process stopped alone (or its Orbax threads wait for a barrier it will never
            # reach): JAX's shutdown at exit would wait for the others, which wait for it in their
            # next collective, until the coordination service's timeout (5 minutes) aborts them all.
            exit_leaving_threads(status)
        sys.exit(status)


def outcome(e: Exception, workdir: str) -> tuple[str | None, int]:
    """(the one-line message, the exit status) of a training that raised `e`: 2 for bad input found
    once the run started (a model directory, a reward spec, a config relation, a checkpoint of
    another config), 1 for what the environment did (storage, device memory, data, a lost peer
    process), a stop signal's own status; the message is None for an error that keeps its
    traceback (a bug)."""
    from stare_jax import checkpoint, distributed
    from stare_jax.data import DataFormatError
    from stare_jax.dynamic_sampling import DynamicSamplingError
    from stare_jax.models import MODEL_INPUT_ERRORS
    from stare_jax.models.gguf import GGUFImportError
    from stare_jax.preemption import Interrupted, Preempted
    from stare_jax.rewards import RewardSpecError
    from stare_jax import workdir as workdir_lib

    if isinstance(e, (Preempted, Interrupted)):
        return str(e), e.exit_code
    if isinstance(e, (GGUFImportError, *MODEL_INPUT_ERRORS)):
        return f"model error: {e}", 2
    if isinstance(e, workdir_lib.WorkdirError):
        return f"error: {e}", 2
    if isinstance(e, RewardSpecError):
        return reward_error_line(e), 2
    if isinstance(e, config_lib.ConfigError):  # a relation known once the data are read
        return str(e), 2
    if isinstance(e, checkpoint.IncompatibleCheckpointError):
        return f"error: {e}", 2
    if isinstance(e, DataFormatError):
        return f"data error: {e}", 1
    if isinstance(e, DynamicSamplingError):
        return f"error: {e} (the last checkpoint is intact; rerun the command to resume)", 1
    line = failure_line(e, workdir)  # a full disk, out of memory
    reason = distributed.peer_failure_reason(e) if line is None else None
    if reason is not None:
        line = peer_failure_line(reason, workdir)
    return line, 1


def exit_leaving_threads(status: int) -> None:
    """Ends the process at once with `status`: without joining Orbax's threads, which wait at a
    barrier a failed process never reaches (`CheckpointWriteError.abandoned`), and without JAX's
    shutdown barrier, which waits for every process of the run (a process that stopped alone would
    wait there for the coordination service's timeout while the others wait for it in their next
    collective). Process 0 hosts JAX's coordination service, whose end makes the other processes'
    agents abort: it leaves a moment after them."""
    import jax

    from stare_jax import preemption

    sys.stdout.flush()
    sys.stderr.flush()
    preemption.remove_multiprocessing_tempdir()  # an exit finalizer's job, which os._exit skips
    if jax.process_index() == 0 and jax.process_count() > 1:
        time.sleep(ABANDON_GRACE_S)
    os._exit(status)


def failure_line(e: Exception, workdir: str, *, resume: bool = True) -> str | None:
    """The one-line message of a run stopped by its environment rather than a bug, or None: its
    files could not be written (a checkpoint, metrics, an evaluation, data: the system's reason) or
    a device ran out of memory (XLA's RESOURCE_EXHAUSTED, with what to lower); each names the
    committed checkpoint a rerun resumes from (`resume`; evaluate: False)."""
    import jax

    from stare_jax import checkpoint
    from stare_jax import workdir as workdir_lib
    from stare_jax.config import first_line

    if isinstance(e, checkpoint.CheckpointWriteError):
        what, fix = str(e), "free space (or fix the file system)"
    elif workdir_lib.storage_reason(e) is not None:
        what = (f"writing under {workdir} failed: {workdir_lib.storage_reason(e)} "
                f"({type(e).__name__}: {first_line(e)[:160]})")
        fix = "free space (or fix the file system)"
    elif isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
        what = f"out of device memory ({first_line(e)[:200]})"
        fix = ("lower data.prompt_batch_size, rollout.group_size or rollout.max_new_tokens, or use more devices "
               "(python -m stare_jax.dryrun sizes a config's programs before a run)")
    else:
        return None
    return (f"error: {what}; {kept_checkpoint(workdir)}: {fix} and rerun the same command"
            + (" to resume" if resume else ""))


def kept_checkpoint(workdir: str) -> str:
    """What a stopped run's message says of its checkpoints: the committed step a rerun resumes
    from, or that none was committed yet."""
    from stare_jax import supervisor

    step = supervisor.latest_committed_step(os.path.abspath(workdir))
    return "no checkpoint was committed yet" if step is None else f"the checkpoint of step {step} is intact"


def peer_failure_line(reason: str, workdir: str) -> str:
    """The one-line message of a process whose collective failed because another process of the run
    stopped (`reason`: `distributed.peer_failure_reason`), naming the committed checkpoint all of
    them resume from."""
    import jax

    return (f"error: process {jax.process_index()} of {jax.process_count()} lost a peer: {reason}; another process "
            f"of the run stopped (its own output gives the reason); {kept_checkpoint(workdir)}: rerun every process "
            f"with the same command to resume")


def reward_error_line(e: Exception) -> str:
    """The one-line message of a reward function that cannot be loaded (`rewards.RewardSpecError`)."""
    from stare_jax.rewards import REGISTRY

    return (f"config error: reward.name: {e}; allowed: one of {', '.join(repr(r) for r in REGISTRY)} or an importable "
            f"'package.module:function'")


def _is_workdir_value(argv, arg) -> bool:
    return any(argv[i] == "--workdir" and argv[i + 1] is arg for i in range(len(argv) - 1))


def cli(argv=None) -> None:
    """The command line: `main` in this process, or, with `--restarts N` (N > 0), `main` in a child
    process that `supervisor.supervise` restarts after a death by signal; exits with its status."""
    from stare_jax import supervisor

    argv = list(sys.argv if argv is None else argv)
    try:
        rest, restarts = supervisor.split_restarts_flag(argv[1:])
    except supervisor.RestartsFlagError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if not restarts:
        from stare_jax import allocator

        allocator.reexec_if_wanted()  # oneTBB's malloc on a CPU host (STARE_JAX_MALLOC; allocator module)
        main([argv[0], *rest])
        return
    config, workdir = config_and_workdir([argv[0], *rest])
    if config.distributed.num_processes > 1 or config.distributed.coordinator_address:
        print(f"config error: {supervisor.FLAG}: restarts one process; a training on several processes must restart "
              f"all of them together (the cluster scheduler's restart policy); allowed: {supervisor.FLAG} 0 here",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(supervisor.supervise([sys.executable, "-m", "stare_jax.train", *rest], os.path.abspath(workdir),
                                  restarts))


if __name__ == "__main__":
    cli()
