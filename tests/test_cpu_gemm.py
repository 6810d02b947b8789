"""`model.cpu_gemm` (`stare_jax.cpu_gemm`, issue 20): which kernels XLA:CPU runs the update's products
with. The choice table, and that the options reach the update's compilation: under "auto" no
product of the compiled update is a YNNPACK fusion while its reductions still are, under "ynnpack"
its products are, and both give the same update to float rounding; a rematerialisation Eigen's
products were not checked on ("projections", whose metrics came out wrong on two devices) gets
XLA's defaults under "auto"."""

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax import cpu_gemm, parallel
from stare_jax.cpu_gemm import EIGEN_CHECKED_REMAT, EIGEN_PRODUCTS, compiler_options, remat_policy
from stare_jax.models import build_model
from stare_jax.rl import create_train_state
from stare_jax.rl import update as update_lib
from stare_jax.rl.update import make_update_step
from tests.test_rl_update import CFG, assert_trees_close, fresh_state, make_batch, make_config, update_once


def test_each_choice_names_its_kernels_for_the_update_only_and_nothing_off_a_cpu():
    assert compiler_options("update", "auto", platform="cpu") == EIGEN_PRODUCTS
    assert EIGEN_PRODUCTS == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
    assert compiler_options("rollout", "auto", platform="cpu") == {}  # the decode's thin products: defaults
    assert update_lib.cpu_update_compiler_options() == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **EIGEN_PRODUCTS}
    assert update_lib.cpu_update_compiler_options("ynnpack") == update_lib.CPU_UPDATE_COMPILER_OPTIONS
    for choice in cpu_gemm.CHOICES:
        for phase in cpu_gemm.PHASES:
            for platform in ("gpu", "tpu"):
                assert compiler_options(phase, choice, platform=platform) == {}
            assert compiler_options(phase, "ynnpack", platform="cpu") == {}
    with pytest.raises(ValueError, match="model.cpu_gemm"):
        compiler_options("update", "eigen", platform="cpu")  # Eigen's products with XLA's reductions: refused
    with pytest.raises(ValueError, match="phase"):
        compiler_options("prefill", "auto", platform="cpu")


def test_the_trainers_fallback_config_leaves_eigens_products():
    """`with_choice` copies a config with another `model.cpu_gemm` (the original unchanged, an unknown
    choice refused); `uses_eigen_products` tells the shipped update's options from XLA's defaults."""
    from stare_jax.cpu_gemm import uses_eigen_products, with_choice

    config = make_config(**{"model.cpu_gemm": "auto"})
    fallback = with_choice(config, "ynnpack")
    assert fallback.model.cpu_gemm == "ynnpack" and config.model.cpu_gemm == "auto"
    with pytest.raises(ValueError, match="model.cpu_gemm"):
        with_choice(config, "eigen")
    assert uses_eigen_products(update_lib.cpu_update_compiler_options("auto"))
    assert not uses_eigen_products(update_lib.cpu_update_compiler_options("ynnpack"))
    assert not uses_eigen_products({})


def test_auto_keeps_eigens_products_only_for_the_rematerialisations_they_were_checked_on():
    assert EIGEN_CHECKED_REMAT == ("none", "nothing", "mlp")
    for remat in EIGEN_CHECKED_REMAT:
        assert compiler_options("update", "auto", platform="cpu", remat=remat) == EIGEN_PRODUCTS
    for remat in ("projections", "nothing+mlp"):  # wrong metrics seen on Eigen's products (cpu_gemm's docstring)
        assert compiler_options("update", "auto", platform="cpu", remat=remat) == {}
    assert update_lib.cpu_update_compiler_options("auto", "projections") == update_lib.CPU_UPDATE_COMPILER_OPTIONS
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    config = make_config()
    depth = CFG.num_layers
    for remat, saves, keep, policy, options in ((False, "projections", -1, "none", EIGEN_PRODUCTS),
                                                (True, "nothing", -1, "nothing", EIGEN_PRODUCTS),
                                                (True, "nothing", 1, "nothing", EIGEN_PRODUCTS),
                                                (True, "mlp", -1, "mlp", EIGEN_PRODUCTS),
                                                (True, "mlp", depth, "mlp", EIGEN_PRODUCTS),
                                                (True, "mlp", 0, "nothing", EIGEN_PRODUCTS),
                                                (True, "mlp", 1, "nothing+mlp", {}),
                                                (True, "projections", -1, "projections", {}),
                                                (True, "projections", 1, "nothing+projections", {})):
        model = build_model(CFG, mesh=mesh, seed=0, remat=remat, remat_saves=saves, remat_saves_layers=keep)
        assert remat_policy(model) == policy
        step = make_update_step(config, mesh, create_train_state(model, config, mesh=mesh))
        assert step.compiler_options == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **options}, (remat, saves)


def test_auto_leaves_an_update_with_a_reference_model_to_xlas_defaults():
    """The KL-to-reference update read sampler_approx_kl 0.42 on Eigen's products on two devices
    (Zen 4 host): its program gets no Eigen options, whatever the remat; without a KL term it does."""
    assert compiler_options("update", "auto", platform="cpu", reference=True) == {}
    assert update_lib.cpu_update_compiler_options("auto", "nothing", reference=True) == \
        update_lib.CPU_UPDATE_COMPILER_OPTIONS
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    for kl_type, options in (("none", EIGEN_PRODUCTS), ("k3", {})):
        config = make_config()
        config.loss.kl_type = kl_type
        config.loss.kl_coef = 0.01 if kl_type != "none" else 0.0
        model = build_model(CFG, mesh=mesh, seed=0)
        ref = build_model(CFG, mesh=mesh, seed=0)
        step = make_update_step(config, mesh, create_train_state(model, config, mesh=mesh, ref_model=ref))
        assert step.compiler_options == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **options}, kl_type


def test_auto_leaves_a_bfloat16_update_to_xlas_defaults():
    """Eigen's products are float32 ones: a bfloat16 update on them ran at Eigen's float32 rate,
    where YNNPACK's bf16 kernels ran 3-6x faster (Intel Xeon with AMX). Under "auto" a bfloat16
    model's update gets XLA's defaults, a float32 one Eigen's products."""
    import jax.numpy as jnp

    assert compiler_options("update", "auto", platform="cpu", dtype=jnp.bfloat16) == {}
    assert compiler_options("update", "auto", platform="cpu", dtype="float32") == EIGEN_PRODUCTS
    assert update_lib.cpu_update_compiler_options("auto", "nothing", dtype="bfloat16") == \
        update_lib.CPU_UPDATE_COMPILER_OPTIONS
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    config = make_config()
    for dtype, options in (("float32", EIGEN_PRODUCTS), ("bfloat16", {})):
        model = build_model(CFG, mesh=mesh, seed=0, dtype=dtype)
        step = make_update_step(config, mesh, create_train_state(model, config, mesh=mesh))
        assert step.compiler_options == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **options}, dtype


def test_auto_leaves_an_update_with_attention_in_blocks_to_xlas_defaults():
    """The real model's update forward with the grouped responses in flash blocks computed wrong rows
    on Eigen's products (Intel Xeon, `check_update_kernels.py --attention-block 32`): a batch whose
    sequences are longer than `model.attention_block` compiles without Eigen's options (its
    program's products are YNNPACK fusions), a shorter one of the same step with them."""
    assert compiler_options("update", "auto", platform="cpu", blockwise=True) == {}
    assert update_lib.cpu_update_compiler_options("auto", "nothing", blockwise=True) == \
        update_lib.CPU_UPDATE_COMPILER_OPTIONS
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    config = make_config()
    batch = make_batch()  # prompt 4 + response 6 = 10 columns
    for block, blockwise in ((4, True), (10, False), (0, False)):
        ts = create_train_state(build_model(CFG, mesh=mesh, seed=0, attention_block=block), config, mesh=mesh)
        step = make_update_step(config, mesh, ts)
        assert step.compiler_options == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **EIGEN_PRODUCTS}
        assert step.blockwise(batch) is blockwise
        assert step.options_for(batch) == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS,
                                           **({} if blockwise else EIGEN_PRODUCTS)}, block
        text = step.lower(nnx.state(ts), parallel.shard_batch(batch, mesh), jax.random.key(0),
                          step.packing(batch)).compile().as_text()
        ynn_products = [line for line in text.splitlines() if "__ynn_fusion" in line and "dot_general" in line]
        assert bool(ynn_products) is blockwise, block


def _projection_dot_operand_dtypes(monkeypatch, cpu_forms: bool) -> set[tuple[str, str]]:
    """The operand dtypes of every product of the projections (forward, dh and dW; named by their
    JAX operation) in the compiled update of a bfloat16 model on a CPU device, with
    `products.CPU_FLOAT32_PRODUCTS` set to `cpu_forms`."""
    import re

    from stare_jax.models import products

    monkeypatch.setattr(products, "CPU_FLOAT32_PRODUCTS", cpu_forms)
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    config = make_config()
    ts = create_train_state(build_model(CFG, mesh=mesh, seed=0, dtype="bfloat16"), config, mesh=mesh)
    step = make_update_step(config, mesh, ts)
    batch = make_batch()
    text = step.lower(nnx.state(ts), parallel.shard_batch(batch, mesh), jax.random.key(0),
                      step.packing(batch)).compile().as_text()
    dtype_of = {m.group(1): m.group(2) for m in re.finditer(r"%(\S+) = (\w+)\[", text)}
    found = set()
    for line in text.splitlines():
        name = re.search(r'op_name="([^"]*)"', line)
        if " dot(" in line and name and (name.group(1).endswith("closed_call/dot_general")
                                         or "...d,df->...f" in name.group(1) or "...skm,...skn->...mn" in name.group(1)):
            a, b = re.search(r"dot\(%(\S+?), %(\S+?)\)", line).groups()
            found.add((dtype_of[a], dtype_of[b]))
    return found


def test_bfloat16_projections_reach_the_bf16_products_on_a_cpu(monkeypatch):
    """XLA:CPU multiplies bf16 operands in YNNPACK's bf16 kernels (AMX / AVX512-BF16) only in the
    forms of `stare_jax.models.products`; otherwise it converts both operands to float32 first
    (3-6x slower on an Intel Xeon with AMX). In the compiled update of a bfloat16 model every
    product of the projections, forward and backward, keeps its bf16 operands; the accelerator's
    forms (the flag off, as in the dry run) make XLA:CPU convert them."""
    assert _projection_dot_operand_dtypes(monkeypatch, True) == {("bf16", "bf16")}
    assert ("f32", "f32") in _projection_dot_operand_dtypes(monkeypatch, False)


def _ynnpack_fusions(config, mesh, batch) -> list[str]:
    """The `op_name` of every YNNPACK fusion in the update step's optimised program under `config`."""
    ts = fresh_state(config, mesh)
    step = make_update_step(config, mesh, ts)
    sharded = parallel.shard_batch(batch, mesh)
    text = step.lower(nnx.state(ts), sharded, jax.random.key(0), step.packing(batch)).compile().as_text()
    return [line.split('op_name="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if "__ynn_fusion" in line and 'op_name="' in line]


def test_update_products_follow_the_choice_and_give_the_same_update():
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    batch = make_batch()
    auto = _ynnpack_fusions(make_config(), mesh, batch)
    ynnpack = _ynnpack_fusions(make_config(**{"model.cpu_gemm": "ynnpack"}), mesh, batch)
    assert any("dot_general" in name for name in ynnpack), ynnpack  # XLA:CPU's default: YNNPACK's products
    assert not any("dot_general" in name for name in auto), auto  # "auto": every product in Eigen's kernels
    # ... and reductions still YNNPACK's (the tiny update has none large enough: a product and a row sum)
    x = jax.numpy.ones((512, 256))
    text = jax.jit(lambda a, b: (a @ b).sum(axis=1)).lower(x, x.T).compile(EIGEN_PRODUCTS).as_text()
    fused = [line for line in text.splitlines() if "__ynn_fusion" in line]
    assert fused and all("reduce" in line and "dot_general" not in line for line in fused), fused
    step, got, got_params = update_once(make_config(), mesh, batch)
    assert step.compiler_options == {**update_lib.CPU_UPDATE_COMPILER_OPTIONS, **EIGEN_PRODUCTS}
    _, want, want_params = update_once(make_config(**{"model.cpu_gemm": "ynnpack"}), mesh, batch)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert_trees_close(got_params, want_params, atol=1e-6)
    with pytest.raises(ValueError, match="model.cpu_gemm"):
        update_once(make_config(**{"model.cpu_gemm": "eigen"}), mesh, batch)
