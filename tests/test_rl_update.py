"""The jitted update step on a tiny decoder: the STARE gradient, gradient-accumulation exactness,
determinism, the non-finite guard, the controller in the train state, sharding invariance, and the
multi-epoch path with a KL reference."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from stare_jax import parallel
from stare_jax.models import ModelConfig, build_model
from stare_jax.rl import RLSettings, abstract_train_state, create_train_state, make_update_step
from stare_jax.rl.advantages import group_advantages
from stare_jax.rl.stare import controller_update
from stare_jax.rl.update import single_pass_loss_and_grad
from tests.test_rl_stare import np_stare_weights

VOCAB = 61
CFG = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=False)
N, G, P_LEN, R = 8, 4, 4, 6


def make_config(**overrides):
    """An RL config with the issue's key names; overrides as {"section.key": value}."""
    c = ml_collections.ConfigDict({
        "loss": {"name": "stare", "agg": "token-mean", "clip_low": 0.2, "clip_high": 0.28, "clip_c": 10.0,
                 "entropy_coef": 0.0, "forking_rho": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                 "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0, "kl_type": "none", "kl_coef": 0.0},
        "advantage": {"scale": "group", "eps": 1e-6},
        "stare": {"enabled": True, "variant": "C2", "top_p_ratio": 0.2, "w": 1.1, "m": 0.9, "target_entropy": 100.0,
                  "adaptive": True, "alpha": 0.01, "w_max": 1.5, "m_min": 0.5, "selection_scope": "global"},
        "optim": {"lr": 1e-4, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "grad_clip": 1.0,
                  "warmup_steps": 0},
        "update": {"ppo_epochs": 1, "num_minibatches": 1, "grad_accum": 1},
        "model": {"vocab_chunk": 16},
        "rollout": {"group_size": G},
    })
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def make_batch(seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(3, VOCAB, (N, P_LEN + R)).astype(np.int32)
    ids[:, :P_LEN] = np.repeat(ids[::G, :P_LEN], G, axis=0)  # the rows of a group share their prompt
    am = np.ones((N, P_LEN + R), np.int32)
    am[:G, :2] = 0  # left padding
    am[G:, :1] = 0
    ids = np.where(am > 0, ids, 0).astype(np.int32)
    rm = np.ones((N, R), np.float32)
    rm[1, 4:] = 0  # a short response
    rm[6, 2:] = 0
    am[1, P_LEN + 4:] = 0
    am[6, P_LEN + 2:] = 0
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 1], np.float32)
    old = (-3.5 + 0.2 * rs.randn(N, R)).astype(np.float32)
    return dict(input_ids=ids, attention_mask=am, response_mask=rm, old_log_probs=old, rewards=rewards)


def fresh_state(config, mesh, *, ref=False):
    model = build_model(CFG, mesh=mesh, seed=0)
    ref_model = build_model(CFG, mesh=mesh, seed=0) if ref else None
    return create_train_state(model, config, mesh=mesh, ref_model=ref_model)


def update_once(config, mesh, batch, *, ref=False):
    """One update step of a fresh train state on `batch` (packed as the step lays it out):
    (step, metrics as floats, updated parameters)."""
    ts = fresh_state(config, mesh, ref=ref)
    step = make_update_step(config, mesh, ts)
    ts, m = step(ts, parallel.shard_batch(batch, mesh), jax.random.key(0), packing=step.packing(batch))
    return step, {k: float(v) for k, v in m.items()}, params_of(ts)


def params_of(ts):
    return jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(ts.model, nnx.Param)))


def assert_trees_close(a, b, atol, rtol=0.0, equal_nan=False):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol, equal_nan=equal_nan)


@pytest.fixture(scope="module")
def mesh8():
    return parallel.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def step_acc1(mesh8):
    config = make_config()
    return config, make_update_step(config, mesh8, fresh_state(config, mesh8))


# ----------------------------------------------------------------------------- gradient (acceptance 3)

def test_on_policy_stare_gradient_is_weighted_log_likelihood_gradient():
    config = make_config(**{"stare.w": 1.5, "stare.m": 0.5, "stare.top_p_ratio": 0.3})
    settings = RLSettings.from_config(config)
    model = build_model(CFG, seed=1)
    batch = {k: jnp.asarray(v) for k, v in make_batch(1).items()}
    graphdef, state = nnx.split(model)
    ids, am, rm = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    adv = jnp.broadcast_to(group_advantages(batch["rewards"], G)[:, None], (N, R))

    def naive_log_probs(st):
        logits = nnx.merge(graphdef, st)(ids, am)[:, P_LEN - 1:-1]
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, P_LEN:, None], -1)[..., 0]

    lp = jax.jit(naive_log_probs)(state)  # on-policy: old = current log-probs

    @jax.jit
    def ours(st):
        loss, grads, metrics, prep = single_pass_loss_and_grad(
            settings, nnx.merge(graphdef, st), create_train_state(nnx.merge(graphdef, st), config).controller_state(),
            input_ids=ids, attention_mask=am, response_mask=rm, old_log_probs=lp, advantages=adv,
            rng=jax.random.key(0))
        return loss, grads, prep.weights

    loss, grads, weights = ours(state)
    want_w = np_stare_weights(np.asarray(lp), np.asarray(adv), np.asarray(rm), P=0.3, W=1.5, M=0.5, variant="C2",
                              gate_on=True)
    np.testing.assert_array_equal(np.asarray(weights), want_w.astype(np.float32))
    assert (np.asarray(weights) == 1.5).any() and (np.asarray(weights) == 0.5).any()

    def reference(st):
        return -jnp.sum(weights * adv * rm * naive_log_probs(st)) / jnp.sum(rm)

    want_grads = jax.jit(jax.grad(reference))(state)
    # the surrogate's value is -(1/N) sum w A r with r = 1; only its gradient matches the reference
    np.testing.assert_allclose(float(loss), float(-jnp.sum(weights * adv * rm) / jnp.sum(rm)), atol=1e-6)
    ours_g = nnx.to_pure_dict(grads)
    ref_g = nnx.to_pure_dict(want_grads)
    assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(ref_g)) > 1e-3
    assert_trees_close(ours_g, ref_g, atol=1e-5)


# ----------------------------------------------------------------------------- update step

def test_gradient_accumulation_is_exact(mesh8, step_acc1):
    config1, step1 = step_acc1
    config2 = make_config(**{"update.grad_accum": 2})
    ts1, ts2 = fresh_state(config1, mesh8), fresh_state(config2, mesh8)
    step2 = make_update_step(config2, mesh8, ts2)
    batch = parallel.shard_batch(make_batch(), mesh8)
    ts1, m1 = step1(ts1, batch, jax.random.key(0))
    ts2, m2 = step2(ts2, batch, jax.random.key(0))
    for k in ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl", "quad_total_dH"):
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), atol=1e-6, rtol=1e-6, err_msg=k)
    for k in ("stare_lplus_frac", "stare_lminus_frac", "stare_w", "stare_gate_on"):
        assert float(m2[k]) == float(m1[k]), k
    assert float(m1["stare_lplus_frac"]) > 0
    assert_trees_close(params_of(ts2), params_of(ts1), atol=1e-6)


def test_determinism_and_controller_round_trip(mesh8, step_acc1):
    config, step = step_acc1
    settings = RLSettings.from_config(config)
    batch = parallel.shard_batch(make_batch(), mesh8)
    runs = []
    for _ in range(2):
        ts = fresh_state(config, mesh8)
        ts, metrics = step(ts, batch, jax.random.key(7))
        runs.append((jax.device_get(metrics), params_of(ts), ts))
    (m_a, p_a, ts_a), (m_b, p_b, _) = runs
    assert m_a.keys() == m_b.keys()
    for k in m_a:
        assert np.array_equal(m_a[k], m_b[k], equal_nan=True), k
    assert_trees_close(p_a, p_b, atol=0)
    required = {"loss", "grad_norm", "entropy", "stare_gate_on", "stare_w", "stare_m", "stare_lplus_frac",
                "stare_lminus_frac", "clip_frac", "approx_kl", "advantage_mean", "advantage_std",
                "nonfinite_skipped"} | {f"quad_{q}_{s}" for q in ("pos_high", "pos_low", "neg_high", "neg_low")
                                        for s in ("frac", "dH")}
    assert required <= set(m_a), required - set(m_a)
    assert all(np.asarray(v).dtype == np.float32 and np.asarray(v).shape == () for v in m_a.values())

    # the controller moved by the equations and lives in the train state
    start = create_train_state(build_model(CFG, seed=0), config).controller_state()
    want = controller_update(start, m_a["entropy"], settings.stare)
    got = ts_a.controller_state()
    assert bool(got.gate_on) == bool(want.gate_on) is True
    np.testing.assert_allclose([float(got.w), float(got.m), float(got.last_entropy)],
                               [float(want.w), float(want.m), float(want.last_entropy)], atol=1e-7)
    assert float(got.w) == pytest.approx(1.11) and float(m_a["stare_w"]) == pytest.approx(1.11)
    assert int(ts_a.step[...]) == 1 and int(ts_a.optimizer.step[...]) == 1
    pure = nnx.to_pure_dict(nnx.state(ts_a))
    assert set(pure["controller"]) == {"w", "m", "gate_on", "last_entropy"}

    # round trip: the saved state restored into a fresh train state drives the next step
    target = abstract_train_state(ts_a, mesh8)
    assert target["controller"]["w"].shape == () and target["controller"]["gate_on"].dtype == jnp.bool_
    restored = fresh_state(config, mesh8)
    nnx.update(restored, jax.device_put(nnx.state(ts_a), step.state_shardings))
    assert float(restored.controller_state().w) == float(got.w)
    restored, m_next = step(restored, batch, jax.random.key(8))
    assert float(m_next["stare_w"]) == pytest.approx(1.12)
    assert int(restored.step[...]) == 2


def test_nonfinite_guard_skips_the_step(mesh8, step_acc1):
    config, step = step_acc1
    # a NaN reward
    ts = fresh_state(config, mesh8)
    before = params_of(ts)
    opt_before = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(ts.optimizer)))
    ctrl_before = jax.device_get(ts.controller_state())
    batch = make_batch()
    batch["rewards"][2] = np.nan
    ts, metrics = step(ts, parallel.shard_batch(batch, mesh8), jax.random.key(0))
    assert float(metrics["nonfinite_skipped"]) == 1.0
    assert_trees_close(params_of(ts), before, atol=0)
    assert_trees_close(jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(ts.optimizer))), opt_before,
                       atol=0)
    ctrl = jax.device_get(ts.controller_state())
    assert float(ctrl.w) == float(ctrl_before.w) and bool(ctrl.gate_on) == bool(ctrl_before.gate_on)
    assert np.isnan(ctrl.last_entropy)  # unchanged from the initial "none seen yet"
    assert int(ts.step[...]) == 1 and int(ts.optimizer.step[...]) == 0

    # a NaN parameter
    ts = fresh_state(config, mesh8)
    norm = ts.model.final_norm
    norm[...] = norm[...].at[0].set(jnp.nan)
    before = params_of(ts)
    ts, metrics = step(ts, parallel.shard_batch(make_batch(), mesh8), jax.random.key(0))
    assert float(metrics["nonfinite_skipped"]) == 1.0
    assert_trees_close(params_of(ts), before, atol=0, equal_nan=True)
    assert int(ts.optimizer.step[...]) == 0

    # and a clean batch afterwards is not skipped
    ts = fresh_state(config, mesh8)
    ts, metrics = step(ts, parallel.shard_batch(make_batch(), mesh8), jax.random.key(0))
    assert float(metrics["nonfinite_skipped"]) == 0.0 and int(ts.optimizer.step[...]) == 1


def test_update_step_is_sharding_invariant(mesh8, step_acc1):
    config, step8 = step_acc1
    one = parallel.make_mesh(devices=jax.devices()[:1])
    ts1 = fresh_state(config, one)
    step1 = make_update_step(config, one, ts1)
    ts1, m1 = step1(ts1, parallel.shard_batch(make_batch(), one), jax.random.key(0))
    ts8, m8 = step8(fresh_state(config, mesh8), parallel.shard_batch(make_batch(), mesh8), jax.random.key(0))
    assert abs(float(m1["loss"]) - float(m8["loss"])) <= 1e-6
    for k in ("stare_lplus_frac", "stare_lminus_frac", "quad_pos_high_frac", "quad_neg_high_frac"):
        assert float(m1[k]) == float(m8[k]), k
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m8["grad_norm"]), rtol=1e-5)
    assert_trees_close(params_of(ts1), params_of(ts8), atol=1e-6)


def test_multi_epoch_minibatch_path_with_reference_kl(mesh8):
    config = make_config(**{"update.ppo_epochs": 2, "update.num_minibatches": 2, "loss.kl_type": "k3",
                            "loss.kl_coef": 0.1, "stare.selection_scope": "microbatch"})
    ts = fresh_state(config, mesh8, ref=True)
    step = make_update_step(config, mesh8, ts, donate=False)
    batch = make_batch()
    state0 = nnx.state(ts)
    out_a, m_a = step.apply(state0, parallel.shard_batch(batch, mesh8), jax.random.key(0))
    # With several optimizer steps per batch the old log-probs come from the no-grad first pass, so
    # the behaviour log-probs of the batch are not used.
    batch_b = dict(batch, old_log_probs=batch["old_log_probs"] - 1.0)
    out_b, m_b = step.apply(state0, parallel.shard_batch(batch_b, mesh8), jax.random.key(0))
    for k in m_a.keys() - {"sampler_approx_kl"}:  # that one compares the pre-update policy with the sampler's
        assert np.array_equal(np.asarray(m_a[k]), np.asarray(m_b[k])), k
    assert float(m_b["sampler_approx_kl"]) != float(m_a["sampler_approx_kl"])  # it reads them
    assert float(m_a["nonfinite_skipped"]) == 0.0
    assert float(m_a["kl_ref"]) >= 0.0 and "kl_ref" in m_a
    assert float(m_a["approx_kl"]) < 1e-3  # pre-update policy is the old policy
    ts_new = nnx.merge(step.graphdef, out_a)
    assert int(ts_new.optimizer.step[...]) == 4 and int(ts_new.step[...]) == 1
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(ts_new.model, nnx.Param)), jax.tree_util.tree_leaves(nnx.state(ts.model)))]
    assert all(changed)
    ref_same = [np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(ts_new.ref_model)), jax.tree_util.tree_leaves(nnx.state(ts.ref_model)))]
    assert all(ref_same), "the reference model is frozen"


@pytest.mark.parametrize("overrides", [{}, {"update.grad_accum": 2},
                                       {"update.ppo_epochs": 2, "update.num_minibatches": 2, "loss.kl_type": "k3",
                                        "loss.kl_coef": 0.1}])
def test_shared_prompt_forward_matches_the_full_batch_forward(mesh8, overrides):
    """update.share_prompt runs each group's prompt once (one shared prompt per G / K rows of a
    micro-batch); metrics and updated parameters equal those of the forward over every row."""
    (_, m_shared, p_shared), (_, m_full, p_full) = (
        update_once(make_config(**overrides, **{"update.share_prompt": share}), mesh8, make_batch(),
                    ref="loss.kl_type" in overrides) for share in (True, False))
    for k in m_full:
        np.testing.assert_allclose(m_shared[k], m_full[k], atol=2e-6, rtol=1e-5, err_msg=k)
    assert m_full["loss"] != 0.0 and m_full["grad_norm"] > 0.0
    assert_trees_close(p_shared, p_full, atol=1e-6)


def test_shared_prompt_settings_default_and_validate():
    assert RLSettings.from_config(make_config()).share_prompt is True
    config = make_config()
    del config["update"]
    config["ppo"] = {"share_prompt": False}
    assert RLSettings.from_config(config).share_prompt is False


def test_lminus_fraction_is_its_own_config_key(mesh8, step_acc1):
    """stare.top_p_ratio_minus = 1 puts every negative-advantage token in L- (so M weighs all of T-),
    while L+ keeps stare.top_p_ratio's size."""
    config, step = step_acc1
    wide = make_config(**{"stare.top_p_ratio_minus": 1.0})
    wide_step = make_update_step(wide, mesh8, fresh_state(wide, mesh8))
    batch = make_batch()
    _, m = step(fresh_state(config, mesh8), parallel.shard_batch(batch, mesh8), jax.random.key(0))
    _, mw = wide_step(fresh_state(wide, mesh8), parallel.shard_batch(batch, mesh8), jax.random.key(0))
    negative = np.repeat(np.asarray(group_advantages(jnp.asarray(batch["rewards"]), G)) < 0, R)
    valid = batch["response_mask"].reshape(-1) > 0
    assert float(mw["stare_lminus_frac"]) == pytest.approx((negative & valid).sum() / valid.sum(), abs=1e-6)
    assert float(mw["stare_lminus_frac"]) > float(m["stare_lminus_frac"]) > 0
    assert float(mw["stare_lplus_frac"]) == float(m["stare_lplus_frac"])


@pytest.mark.parametrize("layout", [{}, {"update.pack_tokens": 4}, {"update.share_prompt": False}],
                         ids=["grouped", "packed", "plain"])
def test_update_loops_hold_no_collective_on_a_data_parallel_mesh(layout):
    """On a purely data-parallel mesh of CPU devices no while loop of the compiled update holds a
    collective: the layer stack runs per device (`Decoder._layers_by_device`: each layer's weight
    gradient is a per-device partial sum through the backward loop, summed once after it), token
    selection gathers its scores before its 32-trip bisection, and the vocabulary pass sums dW per
    device.
    (Collectives inside loops are what the CPU host's rare ordering deadlock needs.) The update
    equals one device's: same selections and loss, gradients to float32 rounding."""
    import re

    from tests.test_rl_logprobs import _while_computations
    mesh = parallel.make_mesh(data=2, devices=jax.devices()[:2])
    config = make_config(**layout)
    ts = fresh_state(config, mesh)
    step = make_update_step(config, mesh, ts, donate=False)
    batch = make_batch()
    hlo = step.lower(nnx.state(ts), batch, jax.random.key(0), packing=step.packing(batch)).compile().as_text()
    loops = _while_computations(hlo)
    collective = re.compile(r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
    assert len([b for b in loops.values() if "jvp()/while/body/closed_call/or" in b]) >= 2  # L+ and L- bisections
    assert any("transpose(jvp())" in b for b in loops.values())  # the scanned layers' backward
    assert not [name for name, body in loops.items() if collective.search(body)]
    assert collective.search(hlo)  # the sums over devices are still there, outside the loops

    one = parallel.make_mesh(devices=jax.devices()[:1])
    ts1 = fresh_state(config, one)
    step1 = make_update_step(config, one, ts1)
    ts1, m1 = step1(ts1, parallel.shard_batch(batch, one), jax.random.key(0), packing=step1.packing(batch))
    ts2, m2 = step(ts, parallel.shard_batch(batch, mesh), jax.random.key(0), packing=step.packing(batch))
    for k in ("stare_lplus_frac", "stare_lminus_frac"):
        assert float(m1[k]) == float(m2[k]) > 0, k
    assert abs(float(m1["loss"]) - float(m2["loss"])) <= 1e-6
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    assert_trees_close(params_of(ts1), params_of(ts2), atol=1e-6)


# ----------------------------------------------------------------------------- the sampler's statistics
def model_stats_batch(config, mesh, shift=0.0):
    """`make_batch` with the fresh model's own log-probs (minus `shift`) as behaviour log-probs and
    its entropy and Q as the sampler's statistics (`update.old_stats = "sampler"`)."""
    from stare_jax.rl.update import response_token_stats

    batch = make_batch()
    model = fresh_state(config, mesh).model
    s = response_token_stats(model, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]), R,
                             vocab_chunk=16, with_pi2=True)
    mask = batch["response_mask"]
    return dict(batch, old_log_probs=(np.asarray(s.log_probs) - shift) * mask, old_entropy=np.asarray(s.entropy) * mask,
                old_pi2_dev=np.asarray(s.pi2_dev) * mask)


@pytest.mark.parametrize("overrides", [{"update.grad_accum": 2},
                                       {"update.ppo_epochs": 2, "update.num_minibatches": 2,
                                        "stare.selection_scope": "microbatch", "loss.name": "clip_cov"}])
def test_sampler_stats_replace_the_pre_pass(mesh8, overrides):
    """With several micro-batches or optimizer steps the update reads the sampler's entropy and Q
    (`update.old_stats = "sampler"`, the default) instead of recomputing them: the same metrics and
    parameters as the pre-pass on a batch whose sampler agrees with the policy, in a program of
    fewer FLOPs; a batch without the statistics runs the pre-pass; its `sampler_approx_kl` is the
    first optimizer step's against the behaviour log-probs."""
    config = make_config(**overrides)
    assert RLSettings.from_config(config).takes_sampler_stats
    batch = model_stats_batch(config, mesh8)
    plain = {k: v for k, v in batch.items() if k not in ("old_entropy", "old_pi2_dev")}
    ts = fresh_state(config, mesh8)
    step = make_update_step(config, mesh8, ts, donate=False)  # one step object: both of its programs
    state0 = nnx.state(ts)

    def apply(b):
        new_state, m = step.apply(state0, parallel.shard_batch(b, mesh8), jax.random.key(0))
        return {k: float(v) for k, v in m.items()}, params_of(nnx.merge(step.graphdef, new_state))

    (m_sampler, p_sampler), (m_fallback, p_fallback) = apply(batch), apply(plain)
    _, m_recompute, p_recompute = update_once(make_config(**overrides, **{"update.old_stats": "recompute"}), mesh8,
                                              batch)
    for k in m_recompute:
        np.testing.assert_allclose(m_sampler[k], m_recompute[k], atol=2e-6, rtol=1e-5, err_msg=k)
        assert m_fallback[k] == m_recompute[k], k
    assert m_recompute["loss"] != 0.0 and m_recompute["stare_lplus_frac"] > 0.0
    assert_trees_close(p_sampler, p_recompute, atol=1e-6)
    assert_trees_close(p_fallback, p_recompute, atol=0.0)

    flops = {name: step.lower(state0, parallel.shard_batch(b, mesh8), jax.random.key(0)).cost_analysis()["flops"]
             for name, b in (("sampler", batch), ("pre-pass", plain))}
    assert flops["sampler"] < 0.9 * flops["pre-pass"], flops

    # behaviour log-probs 0.3 below the policy's: sampler_approx_kl = (e^0.3 - 1) - 0.3 over the
    # first optimizer step's tokens (the whole batch with one mini-batch)
    m_shifted, _ = apply(model_stats_batch(config, mesh8, shift=0.3))
    if RLSettings.from_config(config).num_minibatches == 1:
        np.testing.assert_allclose(m_shifted["sampler_approx_kl"], np.expm1(0.3) - 0.3, rtol=1e-4)
    else:
        assert m_shifted["sampler_approx_kl"] > 0.04


def test_old_stats_key_and_when_the_sampler_records_them():
    assert RLSettings.from_config(make_config()).old_stats == "sampler"
    assert not RLSettings.from_config(make_config()).takes_sampler_stats  # the single pass computes its own
    assert not RLSettings.from_config(make_config(**{"update.grad_accum": 2, "update.old_stats": "recompute"})
                                      ).takes_sampler_stats
    with pytest.raises(ValueError, match="update.old_stats"):
        RLSettings.from_config(make_config(**{"update.old_stats": "cached"}))
