"""Graceful stop on SIGTERM / SIGINT (preemption notices, Ctrl-C).

The first signal only sets a flag: the train loop finishes the step it is in, saves a checkpoint,
prints one line and exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT). A second
signal exits at once (same status, nothing saved beyond what is already committed).

Multi-host: every process must stop after the same step, or the checkpoint save (a collective)
would hang. `StopSignal.agreed(step)` is called by every process after every step; it combines
this process's flag with every other's (a max over processes), and with JAX's own preemption
sync point (`multihost_utils.reached_preemption_sync_point`, which the JAX coordination service
drives from SIGTERM on Cloud TPU when `jax.distributed` is initialised). On one process it is the
local flag alone.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import signal
import sys
import threading

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    """Installs the SIGTERM/SIGINT handlers (main thread only) for the duration of a `with` block.

    Until `defer()` (called when the train loop starts) a signal raises `Interrupted` at once: the
    set-up has nothing to save, and a warm start or a model conversion may take minutes. After it,
    the first signal only sets the flag the loop reads after each step."""

    def __init__(self):
        self.signum: int | None = None
        self.deferring = False
        self._previous: dict[int, object] = {}

    def defer(self) -> None:
        """From now on, a first signal is deferred to the end of the current step."""
        self.deferring = True

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: leave now
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting at once without saving\n")
            sys.stderr.flush()
            remove_multiprocessing_tempdir()
            os._exit(128 + signum)
        if not self.deferring:
            raise Interrupted(signum)
        self.signum = signum  # the one line is printed when the checkpoint is saved (Preempted)

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


def remove_multiprocessing_tempdir() -> None:
    """Removes this process's multiprocessing temporary directory (`/tmp/pymp-*`, which holds the
    reward pool's forkserver socket) if it exists. multiprocessing removes it in an exit finalizer,
    which `os._exit` skips; the forkserver and its workers end by themselves when this process is
    gone (their pipes to it close)."""
    tempdir = getattr(multiprocessing.process.current_process(), "_config", {}).get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
