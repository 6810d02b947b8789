"""Graceful stop on SIGTERM / SIGINT / SIGHUP (preemption notices, Ctrl-C, a closed terminal).

The first signal only sets a flag: the train loop finishes the step it is in, saves a checkpoint,
prints one line and exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT, 129 for
SIGHUP). A second SIGTERM or SIGINT exits at once (same status, nothing saved beyond what is already
committed). A hang-up arrives twice when a terminal closes (from the kernel, and from the shell to
its jobs), so a repeated SIGHUP changes nothing; and since the terminal is gone, whatever this
process would write to it afterwards (the stop line included) goes to a log file instead
(`detach_from_terminal`; the trainer's is WORKDIR/hangup.log). A SIGHUP ignored when the process
started (`nohup`) stays ignored. SIGINT and SIGTERM are handled even when inherited as ignored (a
background job's SIGINT, a pytest-xdist worker's children): `kill -INT` still stops the run.

Multi-host: every process must stop after the same step, or the checkpoint save (a collective)
would hang. `StopSignal.agreed(step)` is called by every process after every step; it combines
this process's flag with every other's (a max over processes), and with JAX's own preemption
sync point (`multihost_utils.reached_preemption_sync_point`, which the JAX coordination service
drives from SIGTERM on Cloud TPU when `jax.distributed` is initialised). On one process it is the
local flag alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import shutil
import signal
import sys
import threading

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
HANGUP_LOG = "hangup.log"


class Preempted(Exception):
    """Raised by the train loop after it saved a checkpoint because a stop signal arrived."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}: saved a checkpoint at step {step}; "
                         f"rerun the same command to resume")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return 128 + self.signum


class Interrupted(Exception):
    """A stop signal arrived before the train loop began (model set-up, warm start, data, the initial
    evaluation): there is nothing to save, so the run ends at once."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first training step: nothing to "
                         f"save; rerun the same command to start again")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal number."""
        return 128 + self.signum


class StopSignal:
    """Installs the SIGTERM/SIGINT/SIGHUP handlers (main thread only; SIGHUP not under `nohup`) for
    the duration of a `with` block.

    Until `defer()` (called when the train loop starts) a signal raises `Interrupted` at once: the
    set-up has nothing to save, and a warm start or a model conversion may take minutes. After it,
    the first signal only sets the flag the loop reads after each step. On SIGHUP the standard
    streams that were a terminal at entry are redirected to `hangup_log` (or /dev/null)."""

    def __init__(self, hangup_log: str | None = None):
        self.signum: int | None = None
        self.deferring = False
        self.hangup_log = hangup_log
        self._previous: dict[int, object] = {}
        self._terminal_fds: tuple[int, ...] = ()

    def defer(self) -> None:
        """From now on, a first signal is deferred to the end of the current step."""
        self.deferring = True

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._terminal_fds = terminal_fds()
            for s in SIGNALS:
                if not nohup(s):
                    self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            detach_from_terminal(self._terminal_fds, self.hangup_log)
            self._terminal_fds = ()
            if self.signum is not None:  # the shell's copy of the kernel's hang-up, or one after a stop
                return
        if self.signum is not None:  # the second signal: leave now
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting at once without saving\n")
            sys.stderr.flush()
            remove_multiprocessing_tempdir()
            os._exit(128 + signum)
        self.signum = signum  # the one line is printed when the checkpoint is saved (Preempted)
        if not self.deferring:
            raise Interrupted(signum)

    def agreed(self, step: int) -> int | None:
        """The signal number every process stops on after `step`, or None to go on (collective on
        multi-host: every process must call it after every step)."""
        import jax

        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        from stare_jax import parallel

        mine = self.signum or 0
        try:
            if not mine and multihost_utils.reached_preemption_sync_point(step):
                mine = int(signal.SIGTERM)
        except RuntimeError:  # the preemption service is off: our own flags still agree
            pass
        return int(np.max(parallel.gather_hosts(np.asarray([mine], np.int32)))) or None


def nohup(signum: int) -> bool:
    """Whether `signum` is SIGHUP and ignored (`nohup`, inherited): then it stays ignored."""
    return signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN


def terminal_fds() -> tuple[int, ...]:
    """The standard output and error descriptors (1, 2) that are a terminal now. Asked before a
    hang-up: afterwards the terminal's ioctls fail with EIO, so `isatty` answers False."""
    return tuple(fd for fd in (1, 2) if os.isatty(fd))


def detach_from_terminal(fds: tuple[int, ...], log_path: str | None) -> None:
    """After SIGHUP: points the descriptors `fds` (a terminal's, from `terminal_fds`) at `log_path`,
    opened for appending (or /dev/null), so that later writes neither fail with EIO on a hung-up
    terminal nor vanish. A line on the terminal says where output went, if it is still there."""
    if not fds:
        return
    target = log_path or os.devnull
    try:
        new = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        target, new = os.devnull, os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.write(fds[-1], f"\nSIGHUP: output continues in {target}\n".encode())
    except OSError:
        pass
    for fd in fds:
        os.dup2(new, fd)
    os.close(new)


@contextlib.contextmanager
def blocked_hangup():
    """A context in which this thread does not take SIGHUP (one that arrives stays pending until
    the end). Child processes started inside it inherit the block: the reward pool's forkserver and
    workers share the trainer's process group, and a closing terminal's hang-up must not kill them
    under the step that is finishing (SIGINT they ignore already)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def remove_multiprocessing_tempdir() -> None:
    """Removes this process's multiprocessing temporary directory (`/tmp/pymp-*`, which holds the
    reward pool's forkserver socket) if it exists. multiprocessing removes it in an exit finalizer,
    which `os._exit` skips; the forkserver and its workers end by themselves when this process is
    gone (their pipes to it close)."""
    tempdir = getattr(multiprocessing.process.current_process(), "_config", {}).get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
