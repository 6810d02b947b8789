"""`model.gpu_gemm` (`stare_jax.gpu_gemm`, issue 20): per-phase XLA options that choose a GPU's GEMM
kernels. CPU-only tests: the choice table, and that the options reach the update's and the
rollout's compilations (a platform forced to "gpu"; XLA:CPU accepts the GPU options and ignores them,
and refuses an option name it does not know, which shows the options are handed to the compiler)."""

import jax
import numpy as np
import pytest

from stare_jax import cpu_gemm, gpu_gemm, parallel, precision
from stare_jax.gpu_gemm import CUBLAS, UNTUNED_TRITON, compiler_options
from stare_jax.rl import update as update_lib
from stare_jax.rollout import generate, sampler
from tests.test_rl_update import make_batch, make_config, update_once
from tests.test_rollout import policies, prompts  # noqa: F401  (the tiny policies and prompts)

#: the update's options on a CPU mesh under the default `model.cpu_gemm` (stare_jax.cpu_gemm)
CPU_OWN = {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **cpu_gemm.EIGEN_PRODUCTS}


def test_each_choice_names_the_measured_kernels_per_phase_and_nothing_off_a_gpu():
    for choice in gpu_gemm.CHOICES:
        for phase in gpu_gemm.PHASES:
            for platform in ("cpu", "tpu"):
                assert compiler_options(phase, choice, platform=platform, dtype=np.float32, full_float32=True) == {}
            assert compiler_options(phase, "xla", platform="gpu", dtype=np.float32, full_float32=True) == {}
            assert compiler_options(phase, "cublas", platform="gpu", dtype="bfloat16", full_float32=False) == CUBLAS
            # auto: only full-float32 products in float32 compute leave XLA's own choice
            for dtype, full in ((np.float32, False), ("bfloat16", True), ("bfloat16", False)):
                assert compiler_options(phase, "auto", platform="gpu", dtype=dtype, full_float32=full) == {}
    assert compiler_options("update", "auto", platform="gpu", dtype=np.float32, full_float32=True) == {
        "xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
    assert compiler_options("rollout", "auto", platform="gpu", dtype=np.float32, full_float32=True) == {
        "xla_gpu_autotune_level": 0}
    with pytest.raises(ValueError, match="model.gpu_gemm"):
        compiler_options("update", "triton", platform="gpu", dtype=np.float32)
    with pytest.raises(ValueError, match="phase"):
        compiler_options("prefill", "auto", platform="gpu", dtype=np.float32)


def test_full_float32_products_follow_the_run_s_matmul_precision():
    assert not gpu_gemm.full_float32_products()
    with precision.matmul_precision("float32"):
        assert gpu_gemm.full_float32_products()
        assert compiler_options("update", "auto", platform="gpu", dtype=np.float32) == CUBLAS
    with precision.matmul_precision("tensorfloat32"):
        assert not gpu_gemm.full_float32_products()
    with jax.default_matmul_precision("highest"):
        assert gpu_gemm.full_float32_products()


def _as_if_on_a_gpu(monkeypatch):
    """Every call of `gpu_gemm.compiler_options` (the update's and the rollout's) sees the platform "gpu"."""
    real = gpu_gemm.compiler_options
    monkeypatch.setattr(gpu_gemm, "compiler_options", lambda phase, choice, *, platform, dtype, **kw: real(
        phase, choice, platform="gpu", dtype=dtype, **kw))


def test_update_step_compiles_with_its_phase_options(monkeypatch):
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    batch = make_batch()
    with precision.matmul_precision("float32"):
        _, want, want_params = update_once(make_config(**{"model.gpu_gemm": "xla"}), mesh, batch)
        step, _, _ = update_once(make_config(), mesh, batch)
        assert step.compiler_options == CPU_OWN  # on a CPU: the CPU's own
        _as_if_on_a_gpu(monkeypatch)
        step, got, got_params = update_once(make_config(), mesh, batch)  # "auto", the default
        assert step.compiler_options == {**CPU_OWN, **CUBLAS}
        assert got == want  # XLA:CPU ignores the GPU's options: the same program
        for a, b in zip(jax.tree_util.tree_leaves(got_params), jax.tree_util.tree_leaves(want_params)):
            np.testing.assert_array_equal(a, b)
        monkeypatch.setitem(CUBLAS, "xla_gpu_no_such_option", 1)
        with pytest.raises(Exception, match="xla_gpu_no_such_option"):
            update_once(make_config(), mesh, batch)
    step, _, _ = update_once(make_config(), mesh, batch)  # default precision: XLA's own choice
    assert step.compiler_options == CPU_OWN
    with pytest.raises(ValueError, match="model.gpu_gemm"):
        update_once(make_config(**{"model.gpu_gemm": "triton"}), mesh, batch)


def test_rollout_compiles_with_its_phase_options(monkeypatch, policies):  # noqa: F811
    policy = policies["qwen2"]
    ids, mask = prompts()
    kw = dict(rng=jax.random.key(3), group_size=2, max_new_tokens=6, temperature=1.0)
    specs = []
    compiled = sampler._compiled_rollout
    monkeypatch.setattr(sampler, "_compiled_rollout",
                        lambda graphdef, spec, **k: specs.append(spec) or compiled(graphdef, spec, **k))
    with precision.matmul_precision("float32"):
        want = generate(policy, ids, mask, gpu_gemm="xla", **kw)
        _as_if_on_a_gpu(monkeypatch)
        got = generate(policy, ids, mask, **kw)
        assert dict(specs[-1].compiler_options) == UNTUNED_TRITON
        np.testing.assert_array_equal(got.response_ids, want.response_ids)
        np.testing.assert_array_equal(got.log_probs, want.log_probs)
        generate(policy, ids, mask, gpu_gemm="cublas", slots=3, **kw)
        assert dict(specs[-1].compiler_options) == CUBLAS and specs[-1].slots == 3
        monkeypatch.setitem(UNTUNED_TRITON, "xla_gpu_no_such_option", 1)
        with pytest.raises(Exception, match="xla_gpu_no_such_option"):
            generate(policy, ids, mask, **kw)
    assert specs[0].compiler_options == ()
