"""The CPU run's allocator switch (stare_jax/allocator.py): which malloc a CLI process ends up with."""

import os
import subprocess
import sys

import pytest

from stare_jax import allocator

HAVE_TBB = allocator.tbbmalloc_libraries() is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A CLI in miniature: the entry points' first line, then report what serves this process.
PROBE = ("from stare_jax import allocator; allocator.reexec_if_wanted(); import os; "
         "print(allocator.active(), os.environ.get('TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD'))")


def _python(code, **env):
    """Runs `code` in a fresh interpreter with this process's environment minus every allocator
    setting, plus `env`."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", "STARE_JAX_MALLOC", "_STARE_JAX_MALLOC_REEXEC", "JAX_PLATFORMS",
                          "TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD", "STARE_JAX_MALLOC_LIMIT_GB")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**clean, "PYTHONPATH": ROOT, **env}, timeout=120)


def _probe(**env):
    return _python(PROBE, **env)


def test_choices_and_platforms():
    assert allocator.wanted_libraries({"STARE_JAX_MALLOC": "system"}) is None
    # an accelerator named first: the system malloc, whatever is installed
    assert allocator.wanted_libraries({"JAX_PLATFORMS": "cuda,cpu"}) is None
    assert allocator.runs_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not allocator.runs_on_cpu({"JAX_PLATFORMS": "tpu"})
    with pytest.raises(allocator.AllocatorError, match="allowed: auto, tbb, system"):
        allocator.wanted_libraries({"STARE_JAX_MALLOC": "jemalloc"})
    if HAVE_TBB:
        assert allocator.wanted_libraries({"JAX_PLATFORMS": "cpu"}) == allocator.tbbmalloc_libraries()
    else:
        assert allocator.wanted_libraries({"JAX_PLATFORMS": "cpu"}) is None
        with pytest.raises(allocator.AllocatorError, match="not found"):
            allocator.wanted_libraries({"STARE_JAX_MALLOC": "tbb"})


def test_preload_env_keeps_what_was_there():
    env = allocator.preload_env({"LD_PRELOAD": "/x/libfoo.so:/a/b.so", "TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD": "7"},
                                ["/l/libtbbmalloc.so.2", "/l/libtbbmalloc_proxy.so.2"])
    assert env["LD_PRELOAD"] == "/l/libtbbmalloc.so.2 /l/libtbbmalloc_proxy.so.2 /x/libfoo.so /a/b.so"
    assert env["TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD"] == "7"
    assert allocator.preload_env({}, ["/l/a.so"])["TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD"] == str(1 << 20)


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_cli_process_reexecutes_with_tbbmalloc_on_cpu():
    out = _probe(JAX_PLATFORMS="cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(1 << 20)]
    assert _probe(JAX_PLATFORMS="cpu", STARE_JAX_MALLOC="system").stdout.split() == ["False", "None"]
    assert _probe(JAX_PLATFORMS="cuda").stdout.split() == ["False", "None"]


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_name_is_what_the_benchmarks_record():
    code = "from stare_jax import allocator; allocator.reexec_if_wanted(); print(allocator.name())"
    assert _python(code, JAX_PLATFORMS="cpu").stdout.split() == ["tbb"]
    assert _python(code, JAX_PLATFORMS="cpu", STARE_JAX_MALLOC="system").stdout.split() == ["system"]


def test_bad_choice_exits_2_with_one_line():
    out = _probe(STARE_JAX_MALLOC="jemalloc")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: STARE_JAX_MALLOC='jemalloc'"), out.stderr


def test_soft_limit_setting():
    assert allocator.soft_limit_bytes({"STARE_JAX_MALLOC_LIMIT_GB": "1.5"}) == 3 * 2**29
    memory = allocator.physical_memory_bytes()
    # the default: 0.55 of the memory, room above half for the real-model step's cached temporaries
    default = allocator.soft_limit_bytes({})
    assert default == int(0.55 * memory) and memory // 2 < default < memory
    for bad in ("0", "-2", "lots"):
        with pytest.raises(allocator.AllocatorError, match="positive number of GB"):
            allocator.soft_limit_bytes({"STARE_JAX_MALLOC_LIMIT_GB": bad})
    out = _probe(JAX_PLATFORMS="cpu", STARE_JAX_MALLOC_LIMIT_GB="none") if HAVE_TBB else None
    if out is not None:
        assert out.returncode == 2 and out.stderr.startswith("config error: STARE_JAX_MALLOC_LIMIT_GB='none'")


# Frees blocks of ten distinct sizes (100-190 MB) and prints the largest RSS seen, in MB.
GROW = ("from stare_jax import allocator; allocator.reexec_if_wanted(); import numpy as np, psutil; "
        "p = psutil.Process(); peak = 0\n"
        "for i in range(10):\n"
        "    a = np.ones((100 + 10 * i) * 2**18, np.float32); del a; peak = max(peak, p.memory_info().rss)\n"
        "print(peak >> 20)")


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_the_cache_of_freed_blocks_is_bounded_by_the_soft_limit():
    def peak_mb(limit_gb):
        out = _python(GROW, JAX_PLATFORMS="cpu", STARE_JAX_MALLOC="tbb", STARE_JAX_MALLOC_LIMIT_GB=str(limit_gb))
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    unbounded, bounded = peak_mb(64), peak_mb(0.25)
    assert unbounded > 900  # cached blocks of most sizes (1.45 GB of them freed; 1.0 GB measured)
    assert bounded < 450, (bounded, unbounded)  # 0.24 GB measured


def _freed_block_then(action: str, malloc: str) -> tuple[int, str]:
    """In a fresh process under STARE_JAX_MALLOC=`malloc` (JAX's CPU backend up first): frees a 256 MB
    block (oneTBB caches it), then evaluates `action`; returns the MB the resident set lost across
    `action` and `action`'s value as printed."""
    code = ("from stare_jax import allocator; allocator.reexec_if_wanted(); import numpy as np, psutil, jax; "
            "jax.devices(); p = psutil.Process(); a = np.ones(2**26, np.float32); del a; "
            f"before = p.memory_info().rss >> 20; value = {action}; print(before, p.memory_info().rss >> 20, value)")
    out = _python(code, JAX_PLATFORMS="cpu", STARE_JAX_MALLOC=malloc, STARE_JAX_MALLOC_LIMIT_GB="64")
    assert out.returncode == 0, out.stderr
    before, after, value = out.stdout.split()
    return int(before) - int(after), value


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_release_cache_hands_the_cached_blocks_back():
    released, done = _freed_block_then("allocator.release_cache()", "tbb")
    assert done == "True" and released > 200, (released, done)  # the freed 256 MB block stayed cached
    assert _freed_block_then("allocator.release_cache()", "system")[1] == "False"  # glibc: nothing to release


# installs the listener, compiles one new program, and gives "installed/releases so far"
ON_COMPILE = ("'%s/%d' % (allocator.release_cache_on_compile(), (jax.jit(lambda x: x * 3.0 + 1.0)"
              "(np.float32(2.0)).block_until_ready(), allocator.releases_on_compile())[1])")


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_a_compilation_empties_the_cache_before_the_program_runs():
    released, value = _freed_block_then(ON_COMPILE, "tbb")
    installed, releases = value.split("/")
    assert installed == "True" and int(releases) >= 1, value
    assert released > 150, released  # the cached 256 MB block left when the program compiled
    assert _freed_block_then(ON_COMPILE, "system")[1] == "False/0"  # glibc: no cache, no listener


# keys of three steps' update programs: one, the same again, then another
ON_SWITCH = ("'%s/%s/%s' % (allocator.release_cache_on_switch(5120), allocator.release_cache_on_switch(5120), "
             "allocator.release_cache_on_switch(6144))")
SAME_AGAIN = "'%s/%s' % (allocator.release_cache_on_switch(5120), allocator.release_cache_on_switch(5120))"


@pytest.mark.skipif(not HAVE_TBB, reason="the tbb package is not installed (Linux x86_64 dependency)")
def test_a_switch_of_update_program_empties_the_cache():
    released, value = _freed_block_then(ON_SWITCH, "tbb")
    assert value == "False/False/True", value  # the first key is only recorded; a repeat keeps the cache
    assert released > 150, released  # the cached 256 MB block left at the switch
    kept, value = _freed_block_then(SAME_AGAIN, "tbb")
    assert value == "False/False" and kept < 50, (kept, value)  # the same program again: the block stays cached
    assert _freed_block_then(ON_SWITCH, "system")[1] == "False/False/False"  # glibc: nothing to empty
