"""The host memory allocator of a CPU run: oneTBB's scalable malloc, so XLA's temporaries stay mapped.

XLA:CPU mallocs every execution's temporaries and frees them when it ends. glibc serves blocks
above 32 MiB with `mmap` and hands them back with `munmap`, so each update step faults its
gigabytes of temporaries in afresh: 1.1-1.3 M minor faults (~5 GB) a SmolLM2-135M update on a
2-core Xeon, 3.4-6 s of kernel CPU back to back and several times that when another process ran
in between (docs/performance.md, "the neighbour effect"). oneTBB's malloc (the `tbb` wheel's
`libtbbmalloc_proxy`, which replaces malloc/free process-wide) keeps freed objects of at least
`TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD` bytes in its cache instead of unmapping them, and the next
execution reuses them: ~0.2 M faults an update.

oneTBB caches each distinct size apart (a freed 1.2 GB block does not serve a 1.1 GB request), so
a run whose programs vary (the packed update's capacity buckets, the sampler's prompt buckets)
would keep one block per size. The cache is therefore bounded: once the process holds more than a
soft limit (`STARE_JAX_MALLOC_LIMIT_GB`, default `CACHE_SHARE` of the host's physical memory)
oneTBB hands cached blocks back to the system instead of keeping them (`scalable_allocation_mode`'s
soft heap limit; 30 distinct sizes of 0.5-1.6 GB held 13.6 GB without it, under 4 GB with a 4 GB
limit). The default leaves the real-model (SmolLM2-135M) step room on a 24 GB host: its process
holds ~10 GB in use and oneTBB 11.5-12.3 GB with the update's temporaries cached, above half the
memory (11.8 GB), where every update faulted 1.3-1.5 M pages in again, including updates that
repeated the previous step's program; at 13 GiB only the compiling and switching steps did, and the
update ran 1.23x faster (on a 2-vCPU AMD EPYC Zen 4; docs/performance.md, "The real-model step's
page faults alone"). The share
stays well under the memory: the benchmark runs TRL's process beside this one.
Blocks above the huge-object threshold leave the cache only then, all at once, or when asked: a
block of a size freed once (the compiler's temporaries, another program's buffers) stays until the
process crosses the limit, and the crossing also drops the blocks every step reuses. So a
training run empties the cache each time XLA has compiled a program, before that program first
runs (`release_cache_on_compile`): the compiler's temporaries and the blocks of programs run
before leave, the new program's run maps its own, and the steps that follow reuse them, caching
only the blocks they recycle. (Emptying it after the compiling step instead, as the trainer did
at first, made the next step fault all its temporaries in afresh: 1.29 M faults, +16 s of kernel
time in a SmolLM2-135M update; docs/performance.md.) It is emptied too when a step's update runs
another program than the previous step's (`release_cache_on_switch`: a packed capacity switch),
so that the cache never holds two programs' temporaries at once.

The replacement must be in place before the process's first malloc, so it is installed by
re-executing the command with `LD_PRELOAD` (`reexec_if_wanted`, called first thing by the CLI
entry points). `STARE_JAX_MALLOC` chooses:

    auto    (default) oneTBB's malloc when the run is on the CPU (JAX_PLATFORMS names cpu first,
            or no accelerator plugin, libtpu or jax_plugins, is installed) and the library is
            there (Linux, the `tbb` package); else the system malloc
    tbb     oneTBB's malloc, or exit 2 when its library is missing
    system  the C library's malloc, as before

Which allocator serves the process changes no result: the same programs run on the same values.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping

ENV = "STARE_JAX_MALLOC"
LIMIT_ENV = "STARE_JAX_MALLOC_LIMIT_GB"
CHOICES = ("auto", "tbb", "system")
#: objects of at least this many bytes stay cached when freed (XLA's temporaries: hundreds of MB)
HUGE_THRESHOLD_BYTES = 1 << 20
#: the default cache bound as a share of the physical memory (module docstring)
CACHE_SHARE = 0.55
_LIBRARIES = ("libtbbmalloc.so.2", "libtbbmalloc_proxy.so.2")  # the proxy needs the allocator loaded
_ACCELERATOR_MODULES = ("jax_plugins", "libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin")


class AllocatorError(ValueError):
    """`STARE_JAX_MALLOC` asks for something this host cannot give."""


def tbbmalloc_libraries() -> list[str] | None:
    """Absolute paths of oneTBB's allocator and its malloc-replacing proxy as the installed `tbb`
    distribution lists them (its wheel puts them in the environment's `lib/`), or None when the
    package or either file is missing or the host is not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = {f.name: os.path.realpath(str(f.locate())) for f in files if f.name in _LIBRARIES}
    paths = [found.get(name) for name in _LIBRARIES]
    return paths if all(p is not None and os.path.isfile(p) for p in paths) else None


def runs_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX will run on the CPU, judged without starting a backend: JAX_PLATFORMS, when set,
    names cpu first; otherwise no accelerator plugin (jax_plugins, libtpu) is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_MODULES)


def wanted_libraries(environ: Mapping[str, str]) -> list[str] | None:
    """The libraries to preload under `environ`'s STARE_JAX_MALLOC (module docstring), or None for
    the system malloc. Raises `AllocatorError` for an unknown choice or a missing library."""
    choice = environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise AllocatorError(f"{ENV}={environ[ENV]!r}: allowed: {', '.join(CHOICES)}")
    if choice == "system" or (choice == "auto" and not runs_on_cpu(environ)):
        return None
    libraries = tbbmalloc_libraries()
    if libraries is None and choice == "tbb":
        raise AllocatorError(f"{ENV}=tbb: oneTBB's malloc is not installed here (pip install tbb; Linux only): "
                             f"the tbb package with {' and '.join(_LIBRARIES)} was not found")
    return libraries


def preload_env(environ: Mapping[str, str], libraries: list[str]) -> dict[str, str]:
    """`environ` with `libraries` first in LD_PRELOAD and oneTBB's huge-object threshold set (a
    threshold already in `environ` is kept)."""
    env = dict(environ)
    earlier = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p not in libraries]
    env["LD_PRELOAD"] = " ".join([*libraries, *earlier])
    env.setdefault("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD", str(HUGE_THRESHOLD_BYTES))
    return env


def active() -> bool:
    """Whether oneTBB's malloc proxy is loaded into this process."""
    try:
        with open("/proc/self/maps") as f:
            return "libtbbmalloc_proxy" in f.read()
    except OSError:
        return False


def name() -> str:
    """The malloc serving this process, as the benchmarks record it: "tbb" (oneTBB's proxy loaded)
    or "system"."""
    return "tbb" if active() else "system"


def physical_memory_bytes() -> int:
    """The host's physical memory in bytes (page size x physical pages)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def soft_limit_bytes(environ: Mapping[str, str]) -> int:
    """The cache bound (module docstring): STARE_JAX_MALLOC_LIMIT_GB, else `CACHE_SHARE` of the
    physical memory. Raises `AllocatorError` for a value that is not a positive number."""
    raw = environ.get(LIMIT_ENV, "").strip()
    if not raw:
        return int(CACHE_SHARE * physical_memory_bytes())
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise AllocatorError(f"{LIMIT_ENV}={raw!r}: allowed: a positive number of GB")
    return int(gb * 2**30)


def _loaded_tbbmalloc() -> ctypes.CDLL:
    """The oneTBB allocator already in this process (opened by soname, wherever it came from), with
    the argument types of the two calls made here."""
    lib = ctypes.CDLL(_LIBRARIES[0])
    lib.scalable_allocation_mode.argtypes = [ctypes.c_int, ctypes.c_ssize_t]
    lib.scalable_allocation_command.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return lib


def _limit_cache(limit: int) -> None:
    """Sets the loaded oneTBB allocator's soft heap limit (TBBMALLOC_SET_SOFT_HEAP_LIMIT = 1) to
    `limit` bytes."""
    if _loaded_tbbmalloc().scalable_allocation_mode(1, limit) != 0:
        raise AllocatorError(f"oneTBB refused a soft heap limit of {limit} bytes")


def release_cache() -> bool:
    """Hands every free block oneTBB's malloc holds cached back to the system
    (`scalable_allocation_command(TBBMALLOC_CLEAN_ALL_BUFFERS = 0, NULL)`; module docstring): True
    when it did, False when oneTBB's malloc does not serve this process (nothing to do)."""
    if not active():
        return False
    # TBBMALLOC_OK (0), or TBBMALLOC_NO_EFFECT (4) when nothing was cached
    return _loaded_tbbmalloc().scalable_allocation_command(0, None) in (0, 4)


_released_on_compile = 0
_hook_installed = False


def _release_after_compile() -> None:
    global _released_on_compile
    if release_cache():
        _released_on_compile += 1


def release_cache_on_compile() -> bool:
    """Makes every XLA backend compilation of this process end with `release_cache()`
    (`compilation.on_backend_compile`: after the compiler returns, before the program's first run;
    module docstring). Returns whether oneTBB's malloc serves this
    process (else nothing is installed: there is no cache to empty). Idempotent."""
    global _hook_installed
    if not active():
        return False
    if not _hook_installed:
        from stare_jax import compilation  # imports JAX: not at this module's import, before the re-exec

        compilation.on_backend_compile(_release_after_compile)
        _hook_installed = True
    return True


def releases_on_compile() -> int:
    """How often `release_cache_on_compile`'s listener has emptied the cache in this process."""
    return _released_on_compile


_NOTHING_RUN = object()
_last_program: object = _NOTHING_RUN


def release_cache_on_switch(program) -> bool:
    """Empties oneTBB's cache (`release_cache()`) when `program`, a hashable key naming the large
    program a step is about to run (the packed update's capacity), differs from the key of the
    previous call in this process; True when it did. The first call only records its key.

    Each program's temporaries are blocks of its own sizes, and a freed block serves only requests
    of its size: a run whose steps switch between two packed capacities would keep both programs'
    temporaries cached (one preallocated block a device, 2.5 GB at SmolLM2-135M's capacity 5,120 and
    2.8 GB at 6,144), past the soft limit. Emptied at the switch, the cache holds one program's
    blocks: the switching step maps its own, and the steps that repeat it reuse them as long as the
    rest of the process leaves room under the limit (on a 24 GB host it often does not: the
    real-model benchmark's process sits at the bound with one program's blocks; docs/performance.md,
    "The real-model step's page faults alone")."""
    global _last_program
    switched = _last_program is not _NOTHING_RUN and program != _last_program
    _last_program = program
    return release_cache() if switched else False


def reexec_if_wanted(environ: Mapping[str, str] | None = None) -> None:
    """Re-executes this process's command line with oneTBB's malloc preloaded when STARE_JAX_MALLOC
    wants it and it is not loaded yet; in the re-executed process, sets the cache's soft limit and
    returns (as it returns at once when the system malloc is wanted). Call before anything
    allocates much (the first lines of a CLI's main). An unusable setting exits 2 with a one-line
    message."""
    environ = os.environ if environ is None else environ
    try:
        libraries = wanted_libraries(environ)
        limit = None if libraries is None else soft_limit_bytes(environ)
        if libraries is not None and active():
            _limit_cache(limit)  # the re-executed process: bound the cache, carry on
            return
    except AllocatorError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if libraries is None or environ.get("_STARE_JAX_MALLOC_REEXEC"):
        return  # the second test stops a loop should the preload not take
    env = preload_env(environ, libraries)
    env["_STARE_JAX_MALLOC_REEXEC"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
