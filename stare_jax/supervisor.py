"""Restarting a training whose process dies (`python -m stare_jax.train ... --restarts N`).

A training process can die without a chance to save: XLA aborting it (SIGABRT; on a CPU host split
into several devices, the rare collective-ordering deadlock of docs/performance.md ends that way
after 40 s), the kernel's OOM killer (SIGKILL), a crash in native code (SIGSEGV, SIGBUS). Run again,
the same command resumes from the newest usable checkpoint and redoes the steps since, bit for bit.
With `--restarts N` the command does that itself: it runs the training as a child process (in its
own process group) and waits; when the child is *killed by a signal* and no stop was asked for,
it appends one JSON line to `WORKDIR/restarts.jsonl` (time, the signal, the checkpoint step the
next attempt resumes from, the restart's number), prints one line, and starts the same command
again. N bounds the restarts *in a row without progress*: a death after the attempt committed a
newer checkpoint than the one it started from begins the count again, so a long run that loses a
process now and then keeps going, while one that dies before its next checkpoint every time (a
crash loop) gives up after N attempts. Everything else ends the command with the child's own
status: success, a bad input (2), a data error (1), a stop by SIGTERM/SIGINT/SIGHUP (143/130/129,
after the child saved its checkpoint). SIGTERM and SIGINT sent to the supervising process are passed
on to the child once each (Ctrl-C in a terminal reaches only the supervisor, so the child sees one
signal per press, as without `--restarts`); SIGHUP is passed on once however often it comes (a
closing terminal sends it twice), and the supervisor's own output then goes to WORKDIR/hangup.log as
the child's does; once any has arrived, nothing is restarted. A SIGHUP ignored at start (`nohup`)
stays ignored, and the child inherits that. If the supervisor itself is
killed, the kernel kills the child too (`PR_SET_PDEATHSIG`), so no training outlives its command.

Only one process restarts: a training on several processes (`distributed.num_processes > 1`)
must restart all of them together, which is the cluster scheduler's job, so `--restarts` is
refused there (exit 2).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys

from stare_jax import workdir as workdir_lib

FLAG = "--restarts"
RECORD = "restarts.jsonl"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class RestartsFlagError(ValueError):
    """`--restarts` without a non-negative integer."""


def split_restarts_flag(argv: list[str]) -> tuple[list[str], int]:
    """(argv without `--restarts N` / `--restarts=N`, N; 0 when absent), or RestartsFlagError."""
    rest, value = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 >= len(argv):
                raise RestartsFlagError(f"{FLAG}: missing value; allowed: an integer >= 0")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, 0
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise RestartsFlagError(f"{FLAG}: {value!r} is not allowed; allowed: an integer >= 0")
    return rest, n


def latest_committed_step(workdir: str) -> int | None:
    """The newest step in WORKDIR/checkpoints whose directory and items all carry Orbax's commit
    marker (what a restart resumes from, unless its content check fails), or None."""
    root = os.path.join(workdir, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return None
    return max((int(n) for n in names if n.isdigit() and workdir_lib.step_is_committed(root, int(n))), default=None)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGKILL when the supervisor dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the child may outlive a killed supervisor
        pass


def _describe(returncode: int) -> str:
    """'SIGABRT' for a death by signal 6, 'exit status 3' otherwise."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def shell_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + the signal for a death by signal."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(child_argv: list[str], workdir: str, max_restarts: int, *, env=None) -> int:
    """Runs `child_argv` until it ends other than by a signal, restarting it after a death by signal
    (each restart recorded in WORKDIR/restarts.jsonl) at most `max_restarts` times in a row without a
    newer committed checkpoint; returns the shell status the command should exit with."""
    from stare_jax import preemption

    stop: list[int] = []
    child: subprocess.Popen | None = None
    terminal = preemption.terminal_fds()

    def forward(signum, frame):
        nonlocal terminal
        if signum == signal.SIGHUP:
            preemption.detach_from_terminal(terminal, os.path.join(workdir, preemption.HANGUP_LOG))
            terminal = ()
            if signal.SIGHUP in stop:
                return
        stop.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in _STOP_SIGNALS if not preemption.nohup(s)}
    try:
        restarts = in_a_row = 0
        while True:
            started_from = latest_committed_step(workdir)
            child = subprocess.Popen(child_argv, env=env, process_group=0, preexec_fn=_die_with_parent)
            if stop:  # a stop signal that arrived while the child was being started
                child.send_signal(stop[0])
            returncode = child.wait()  # a forwarded signal's handler returns; wait() goes on (PEP 475)
            if returncode >= 0 or stop:
                return shell_status(returncode)
            step = latest_committed_step(workdir)
            cause = _describe(returncode)
            if step is not None and (started_from is None or step > started_from):  # a newer checkpoint: progress
                in_a_row = 0
            if in_a_row >= max_restarts:
                newest = "no checkpoint yet" if step is None else f"the newest checkpoint is step {step}"
                print(f"training process {child.pid} died of {cause} after {in_a_row} restart(s) in a row without "
                      f"a new checkpoint: giving up; {newest}; rerun the command to resume",
                      file=sys.stderr, flush=True)
                return shell_status(returncode)
            restarts, in_a_row = restarts + 1, in_a_row + 1
            record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "pid": child.pid, "died_of": cause, "returncode": returncode, "resume_step": step,
                      "restart": restarts, "in_a_row": in_a_row, "max_restarts": max_restarts}
            os.makedirs(workdir, exist_ok=True)
            with open(os.path.join(workdir, RECORD), "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"training process {child.pid} died of {cause}; restarting, {_resume_phrase(step)} "
                  f"(restart {in_a_row} of {max_restarts} in a row without a new checkpoint, {restarts} in all; "
                  f"recorded in {os.path.join(workdir, RECORD)})", file=sys.stderr, flush=True)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _resume_phrase(step: int | None) -> str:
    return "from the start (no checkpoint yet)" if step is None else f"from checkpoint step {step}"
