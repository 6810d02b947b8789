"""Counting XLA compilations, so that recompilation in the train loop is visible and testable.

    counter = CompilationCounter()
    ...                       # run a step
    counter.take()            # backend compilations since the last take (all jitted functions)

A recompilation after the first step of a run means a shape, dtype or static argument changed
between steps (a new prompt bucket, a ragged batch): the trainer logs it as the `compilations`
metric and warns.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total = 0
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _total
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _total += 1


class CompilationCounter:
    """Counts XLA backend compilations (cache misses of every `jax.jit`) between `take()` calls."""

    def __init__(self):
        global _installed
        with _lock:
            if not _installed:
                jax.monitoring.register_event_duration_secs_listener(_listener)
                _installed = True
        self._last = _total

    def take(self) -> int:
        """Compilations since the previous `take()` (or since construction)."""
        now = _total
        n, self._last = now - self._last, now
        return n
