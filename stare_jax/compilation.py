"""Counting XLA compilations, so that recompilation in the train loop is visible and testable.

    counter = CompilationCounter()
    ...                       # run a step
    counter.take()            # backend compilations since the last take (all jitted functions)

A recompilation after the first step of a run means a shape, dtype or static argument changed
between steps (a new prompt bucket, a ragged batch): the trainer logs it as the `compilations`
metric and warns.
"""

from __future__ import annotations

import os
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total = 0
_installed = False


def on_backend_compile(callback) -> None:
    """Calls `callback()` after every XLA backend compilation of this process (a JAX monitoring
    listener on `BACKEND_COMPILE_EVENT`, which fires when the compiler returns, before the program's
    first run)."""
    def listener(event: str, duration_secs: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            callback()

    jax.monitoring.register_event_duration_secs_listener(listener)


def _count() -> None:
    global _total
    with _lock:
        _total += 1


class CompilationCounter:
    """Counts XLA backend compilations (cache misses of every `jax.jit`) between `take()` calls."""

    def __init__(self):
        global _installed
        with _lock:
            if not _installed:
                on_backend_compile(_count)
                _installed = True
        self._last = _total

    def take(self) -> int:
        """Compilations since the previous `take()` (or since construction)."""
        now = _total
        n, self._last = now - self._last, now
        return n


# ----------------------------------------------------------------------------- persistent cache

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_cache_hits = 0
_cache_dir = ""


def _count_hit(event: str, **kwargs) -> None:
    global _cache_hits
    if event == CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1


def _atomic_put(self, key: str, value: bytes) -> None:
    """`LRUCache.put` for a local cache without eviction, written to a temporary file and renamed
    into place: a process killed mid-write (or a reader in another process) never sees a partial
    entry, which JAX would otherwise fail to read with a warning on every later start."""
    path = self.path / f"{key}-cache"
    if path.exists():
        return
    tmp = self.path / f".{key}-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        tmp.write_bytes(value)
        os.replace(str(tmp), str(path))
    finally:
        if tmp.exists():
            tmp.unlink()


def _make_writes_atomic(path: str) -> None:
    from jax._src import lru_cache

    cache_cls = getattr(lru_cache, "LRUCache", None)
    if cache_cls is None or getattr(cache_cls, "_stare_atomic", False) or "://" in path:
        return
    original = cache_cls.put

    def put(self, key, value):
        if getattr(self, "eviction_enabled", True):  # bounded caches write under JAX's own file lock
            return original(self, key, value)
        return _atomic_put(self, key, value)

    cache_cls.put = put
    cache_cls._stare_atomic = True


def use_persistent_cache(path: str) -> str:
    """Keeps every compiled XLA program in `path` (a directory, created if absent; a `gs://` URL on
    Cloud TPU) and loads it from there in later processes with the same program, devices and XLA
    version, so a resumed, restarted or repeated run skips its compilations. `path` "" reads
    $STARE_COMPILATION_CACHE_DIR; both empty: off. Returns the directory in use ("" when off).

    Local entries are written to a temporary file and renamed into place (a kill mid-write leaves no
    partial entry). A loaded program still counts in `CompilationCounter` (JAX reports its build as
    a backend compilation); `persistent_cache_hits()` counts the loads."""
    global _cache_dir
    from stare_jax.config import compilation_cache_path

    path = compilation_cache_path(path)
    if not path or path == _cache_dir:
        return _cache_dir
    if "://" not in path:
        os.makedirs(path, exist_ok=True)
    _make_writes_atomic(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    with _lock:
        first = not _cache_dir
        _cache_dir = path
    if first:
        jax.monitoring.register_event_listener(_count_hit)
    return path


def persistent_cache_hits() -> int:
    """Programs loaded from the persistent compilation cache by this process so far."""
    return _cache_hits


def cache_dir() -> str:
    """The persistent compilation cache in use ("" when off)."""
    return _cache_dir
