"""STARE weights (contract 1), group advantages (contract 2), the controller, and sharding invariance,
checked against plain NumPy written from DESIGN.md's equations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from stare_jax import parallel
from stare_jax.rl import selection
from stare_jax.rl.advantages import group_advantages
from stare_jax.rl.losses import clipped_surrogate
from stare_jax.rl.settings import StareSettings
from stare_jax.rl.stare import ControllerState, controller_update, init_controller, stare_sets, stare_weights


# ----------------------------------------------------------------------------- NumPy references

def np_stare_weights(lp, adv, mask, *, P, W, M, variant, gate_on, groups=1, P_minus=None):
    """DESIGN.md steps 1-3, literally: per sign, top k = max(1, ceil(P|T| - 1e-6)) by surprisal
    (P_minus for T- when given)."""
    lp, mask = np.asarray(lp, np.float64), np.asarray(mask)
    adv = np.broadcast_to(np.asarray(adv, np.float64).reshape(lp.shape[0], -1), lp.shape)
    w = np.ones(lp.shape, np.float64)
    if not gate_on:
        return w
    s = -lp.reshape(-1)
    flat_w = w.reshape(-1)
    rows_per_group = lp.shape[0] // groups
    T = lp.shape[1]
    for g in range(groups):
        lo, hi = g * rows_per_group * T, (g + 1) * rows_per_group * T
        for sign in (1, -1):
            members = [i for i in range(lo, hi) if mask.reshape(-1)[i] > 0 and sign * adv.reshape(-1)[i] > 0]
            if not members:
                continue
            ratio = P if sign > 0 or not P_minus else P_minus
            k = max(1, math.ceil(ratio * len(members) - 1e-6))
            chosen = sorted(members, key=lambda i: (-s[i], i))[:k]
            if sign > 0:
                flat_w[chosen] = W
            elif variant == "C2":
                flat_w[chosen] = M
    return w


def np_group_advantages(r, G, scale, eps=1e-6):
    r = np.asarray(r, np.float64).reshape(-1, G)
    mean = r.mean(1, keepdims=True)
    if scale == "none":
        return (r - mean).reshape(-1)
    return ((r - mean) / (r.std(1, ddof=1, keepdims=True) + eps)).reshape(-1)


def random_case(seed, B=6, T=9, ties=False):
    rs = np.random.RandomState(seed)
    lp = -rs.exponential(2.0, (B, T)).astype(np.float32)
    if ties:
        lp = np.round(lp)  # many exact ties in surprisal
    adv = rs.choice([-1.5, -0.3, 0.0, 0.7, 2.0], size=B).astype(np.float32)
    mask = (rs.rand(B, T) > 0.25).astype(np.float32)
    return lp, np.repeat(adv[:, None], T, axis=1), mask


# ----------------------------------------------------------------------------- counts and selection

def test_ceil_and_floor_counts_match_python():
    ns = np.array(list(range(0, 200)) + [999, 1000, 1001, 1_500_000, 1_572_864, 9_999_999], np.int32)
    for ratio in (0.1, 0.2, 0.05, 0.15, 2e-4, 2e-3, 1.0, 0.3333):
        got_c = np.asarray(selection.ceil_count(ratio, jnp.asarray(ns)))
        got_f = np.asarray(selection.floor_count(ratio, jnp.asarray(ns)))
        want_c = [math.ceil(ratio * int(n) - 1e-6) for n in ns]
        want_f = [int(ratio * int(n)) for n in ns]
        np.testing.assert_array_equal(got_c, want_c, err_msg=f"ceil ratio={ratio}")
        np.testing.assert_array_equal(got_f, want_f, err_msg=f"floor ratio={ratio}")


def test_select_top_k_breaks_ties_by_index():
    scores = jnp.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    member = jnp.array([1, 1, 1, 1, 0, 1], bool)
    sel = selection.select_top_k(scores, member, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(sel), [0, 1, 1, 0, 0, 0])
    sel = selection.select_top_k(scores, member, jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(sel), [0, 1, 1, 1, 0, 0])


def test_select_top_k_matches_a_stable_sort_per_group():
    """Bisection on the float bits selects exactly what ranking by (score desc, index) selects: ties,
    negative and signed-zero scores, empty groups, k = 0 and k above the member count."""
    rs = np.random.RandomState(0)
    jitted = jax.jit(selection.select_top_k, static_argnames="num_groups")
    for trial in range(40):
        groups, n = rs.randint(1, 4), rs.randint(1, 60)
        scores = rs.choice([-2.5, -0.0, 0.0, 0.25, 1e-30, 3.0, np.inf, -np.inf], size=(groups, n)).astype(np.float32)
        if trial % 2:
            scores = rs.randn(groups, n).astype(np.float32) * 10.0 ** rs.randint(-3, 4)
        member = rs.rand(groups, n) < rs.choice([0.0, 0.5, 1.0])
        k = rs.randint(0, n + 3, size=groups).astype(np.int32)
        got = np.asarray(jitted(jnp.asarray(scores), jnp.asarray(member), jnp.asarray(k), num_groups=groups))
        want = np.zeros_like(member)
        for g in range(groups):
            # numpy's stable sort of (-score) orders -0.0 and +0.0 as equal; the total order puts +0.0 first
            order = sorted(np.flatnonzero(member[g]), key=lambda i: (-scores[g, i], int(np.signbit(scores[g, i])), i))
            want[g, order[:k[g]]] = True
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")


# ----------------------------------------------------------------------------- contract 1

@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("seed,ties", [(0, False), (1, True), (2, False), (3, True)])
def test_stare_weights_match_numpy(variant, seed, ties):
    lp, adv, mask = random_case(seed, ties=ties)
    for P_ratio in (0.1, 0.25, 0.5):
        got = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=P_ratio, w=1.1, m=0.9, variant=variant,
                                       gate_on=True))
        want = np_stare_weights(lp, adv, mask, P=P_ratio, W=1.1, M=0.9, variant=variant, gate_on=True)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("seed,ties", [(0, False), (1, True)])
def test_separate_lminus_fraction_matches_numpy(seed, ties):
    """stare.top_p_ratio_minus sizes L- alone: L+ keeps P, L- takes the top P- of T-; 0 means P."""
    lp, adv, mask = random_case(seed, ties=ties)
    for P_ratio, P_minus in ((0.05, 0.25), (0.3, 0.1), (0.1, 1.0)):
        got = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=P_ratio, w=1.3, m=0.4, variant="C2",
                                       gate_on=True, top_p_ratio_minus=P_minus))
        want = np_stare_weights(lp, adv, mask, P=P_ratio, W=1.3, M=0.4, variant="C2", gate_on=True, P_minus=P_minus)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
        plain = np_stare_weights(lp, adv, mask, P=P_ratio, W=1.3, M=0.4, variant="C2", gate_on=True)
        np.testing.assert_array_equal(got == np.float32(1.3), plain == 1.3)  # L+ unchanged
        assert (got == np.float32(0.4)).sum() != (plain == 0.4).sum()        # L- resized
    same = stare_weights(lp, adv, mask, top_p_ratio=0.2, w=1.3, m=0.4, variant="C2", gate_on=True, top_p_ratio_minus=0.0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(
        stare_weights(lp, adv, mask, top_p_ratio=0.2, w=1.3, m=0.4, variant="C2", gate_on=True)))


def test_stare_rules_ceil_at_least_one_and_sign_partition():
    # 25 positive tokens with distinct surprisal: ceil(0.1 * 25 - 1e-6) = 3.
    T = 25
    lp = -np.arange(1, T + 1, dtype=np.float32)[None] / 10.0  # surprisal increases with index
    adv = np.ones((1, T), np.float32)
    mask = np.ones((1, T), np.float32)
    w = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.1, w=1.1, m=0.9, variant="C2", gate_on=True))
    assert np.flatnonzero(w != 1.0).tolist() == [22, 23, 24]
    # exactly 10 tokens: ceil(0.1 * 10 - 1e-6) = 1, not 2
    w = np.asarray(stare_weights(lp[:, :10], adv[:, :10], mask[:, :10], top_p_ratio=0.1, w=1.1, m=0.9,
                                 variant="C2", gate_on=True))
    assert np.flatnonzero(w != 1.0).tolist() == [9]
    # a single member still gets one selected token (at-least-one rule)
    adv1 = np.zeros((1, T), np.float32)
    adv1[0, 3] = -2.0
    w = np.asarray(stare_weights(lp, adv1, mask, top_p_ratio=0.1, w=1.1, m=0.9, variant="C2", gate_on=True))
    assert np.flatnonzero(w != 1.0).tolist() == [3] and w[0, 3] == np.float32(0.9)
    # A = 0 tokens are never selected, however surprising; masked tokens neither
    adv0 = np.zeros((1, T), np.float32)
    adv0[0, :5] = 1.0
    mask0 = mask.copy()
    mask0[0, 4] = 0.0
    w = np.asarray(stare_weights(lp, adv0, mask0, top_p_ratio=0.5, w=1.1, m=0.9, variant="C2", gate_on=True))
    assert np.flatnonzero(w != 1.0).tolist() == [2, 3]  # ceil(0.5 * 4) = 2 of tokens {0, 1, 2, 3}
    # empty sets select nothing
    w = np.asarray(stare_weights(lp, np.zeros_like(adv), mask, top_p_ratio=0.1, w=1.1, m=0.9, variant="C2",
                                 gate_on=True))
    assert (w == 1.0).all()


def test_gate_off_gives_ones_and_variants_touch_the_right_sets():
    lp, adv, mask = random_case(5)
    w_off = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.3, w=1.4, m=0.6, variant="C2", gate_on=False))
    assert (w_off == 1.0).all()
    w_o1 = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.3, w=1.4, m=0.6, variant="O1", gate_on=True))
    w_c2 = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.3, w=1.4, m=0.6, variant="C2", gate_on=True))
    neg = (adv < 0) | (mask == 0)
    assert (w_o1[neg] == 1.0).all(), "O1 never touches T-"
    assert set(np.unique(w_o1)) == {np.float32(1.0), np.float32(1.4)}
    assert (w_c2[adv > 0] == w_o1[adv > 0]).all()
    assert (w_c2 == np.float32(0.6)).any(), "C2 puts M on L-"
    assert (adv[w_c2 == np.float32(0.6)] < 0).all() and (mask[w_c2 != 1.0] > 0).all()
    # traced gate / w / m under jit
    f = jax.jit(lambda g, w, m: stare_weights(lp, adv, mask, top_p_ratio=0.3, w=w, m=m, variant="C2", gate_on=g))
    np.testing.assert_array_equal(np.asarray(f(True, 1.4, 0.6)), w_c2)
    np.testing.assert_array_equal(np.asarray(f(False, 1.4, 0.6)), w_off)


def test_microbatch_scope_selects_per_chunk():
    lp, adv, mask = random_case(7, B=8, T=7)
    got = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.2, w=1.1, m=0.9, variant="C2", gate_on=True,
                                   selection_scope="microbatch", num_microbatches=4))
    want = np_stare_weights(lp, adv, mask, P=0.2, W=1.1, M=0.9, variant="C2", gate_on=True, groups=4)
    np.testing.assert_allclose(got, want, atol=1e-7)
    glob = np.asarray(stare_weights(lp, adv, mask, top_p_ratio=0.2, w=1.1, m=0.9, variant="C2", gate_on=True))
    assert not np.array_equal(got, glob)  # the scopes really differ on this case


# ----------------------------------------------------------------------------- contract 2

@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_advantages_match_numpy(scale):
    rs = np.random.RandomState(0)
    r = rs.randint(0, 2, 32).astype(np.float32)
    r[:8] = 1.0  # a group with no spread -> all zeros
    r[8:16] = rs.randn(8)
    got = np.asarray(group_advantages(r, 8, scale=scale))
    np.testing.assert_allclose(got, np_group_advantages(r, 8, scale), rtol=1e-5, atol=1e-6)
    assert (got[:8] == 0).all()
    with pytest.raises(ValueError):
        group_advantages(r, 8, scale="bogus")


@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_without_reward_spread_gets_exactly_zero_advantage(scale):
    """Issue 19 item 7: sixteen 0.7s are equal but their float32 mean is not 0.7; A must be exactly 0,
    so none of their tokens can enter T+/T- (L+/L-)."""
    r = np.concatenate([np.full(16, 0.7, np.float32), np.full(16, 0.1, np.float32),
                        np.linspace(0, 1, 16, dtype=np.float32)])
    adv = np.asarray(group_advantages(r, 16, scale=scale))
    assert (adv[:32] == 0.0).all(), adv[:32]
    np.testing.assert_allclose(adv[32:], np_group_advantages(r[32:], 16, scale), rtol=1e-5, atol=1e-6)
    lp = -np.random.RandomState(0).exponential(1.0, (48, 4)).astype(np.float32)
    lplus, lminus = stare_sets(lp, adv, np.ones_like(lp), top_p_ratio=1.0)
    assert not np.asarray(lplus)[:32].any() and not np.asarray(lminus)[:32].any()


# ----------------------------------------------------------------------------- controller

def np_controller(w, m, h, *, tgt, alpha, w_max, m_min, adaptive):
    gate = h < tgt
    if adaptive:
        d = np.sign(tgt - h)
        w = min(max(w + alpha * d, 1.0), w_max)
        m = min(max(m - alpha * d, m_min), 1.0)
    return w, m, gate


def test_controller_follows_the_equations_over_a_script():
    st = StareSettings(enabled=True, w=1.1, m=0.9, target_entropy=0.3, adaptive=True, alpha=0.1, w_max=1.35,
                       m_min=0.75)
    entropies = [0.5, 0.2, 0.1, 0.05, 0.29, 0.3, 0.31, 0.6, 0.7, 0.8, 0.9, 0.25, 0.1, 0.1]
    state = init_controller(st)
    assert not bool(state.gate_on) and float(state.w) == np.float32(1.1)
    update = jax.jit(lambda s, h: controller_update(s, h, st))
    w, m = 1.1, 0.9
    saw_w_max = saw_w_min = saw_m_min = False
    for h in entropies:
        state = update(state, jnp.float32(h))
        w, m, gate = np_controller(w, m, np.float32(h), tgt=0.3, alpha=0.1, w_max=1.35, m_min=0.75, adaptive=True)
        assert bool(state.gate_on) == gate
        np.testing.assert_allclose(float(state.w), w, atol=1e-6)
        np.testing.assert_allclose(float(state.m), m, atol=1e-6)
        assert float(state.last_entropy) == np.float32(h)
        assert 1.0 <= float(state.w) <= 1.35 + 1e-7 and 0.75 - 1e-7 <= float(state.m) <= 1.0
        saw_w_max |= abs(w - 1.35) < 1e-9
        saw_w_min |= abs(w - 1.0) < 1e-9
        saw_m_min |= abs(m - 0.75) < 1e-9
    assert saw_w_max and saw_w_min and saw_m_min, "the script must exercise both clips"
    # non-adaptive: W, M fixed, gate still follows H_bar; disabled: gate always off
    fixed = StareSettings(enabled=True, w=1.2, m=0.8, target_entropy=0.3, adaptive=False)
    s = controller_update(init_controller(fixed), 0.1, fixed)
    assert bool(s.gate_on) and float(s.w) == np.float32(1.2) and float(s.m) == np.float32(0.8)
    off = StareSettings(enabled=False, target_entropy=0.3, adaptive=True)
    s = controller_update(init_controller(off), 0.1, off)
    assert not bool(s.gate_on) and float(s.w) == np.float32(off.w)
    assert isinstance(s, ControllerState)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_entropy_leaves_the_controller_unchanged_and_is_counted(bad):
    """Issue 19 item 7: a NaN/inf H_bar must not turn W and M into NaN (adaptive mode)."""
    from stare_jax.rl.update import prepare_step
    from stare_jax.rl.settings import RLSettings

    st = StareSettings(enabled=True, w=1.1, m=0.9, target_entropy=0.3, adaptive=True, alpha=0.1, variant="C2")
    state = controller_update(init_controller(st), jnp.float32(0.1), st)
    after = jax.jit(lambda s, h: controller_update(s, h, st))(state, jnp.float32(bad))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    settings = RLSettings.from_config(_rl_config(adaptive=True))
    rs = np.random.RandomState(0)
    lp = -rs.exponential(1.0, (4, 6)).astype(np.float32)
    ent = np.full((4, 6), bad, np.float32)
    adv = np.repeat(rs.randn(4, 1), 6, 1).astype(np.float32)
    ctrl = controller_update(init_controller(settings.stare), jnp.float32(0.1), settings.stare)
    prep = prepare_step(settings, ctrl, lp, ent, np.zeros_like(lp), adv, np.ones_like(lp))
    assert float(prep.metrics["stare_entropy_nonfinite"]) == 1.0
    assert np.isfinite(float(prep.controller.w)) and np.isfinite(float(prep.controller.m))
    assert float(prep.controller.w) == float(ctrl.w)
    ok = prepare_step(settings, ctrl, lp, np.full_like(lp, 0.2), np.zeros_like(lp), adv, np.ones_like(lp))
    assert float(ok.metrics["stare_entropy_nonfinite"]) == 0.0


def _rl_config(**stare):
    from stare_jax import config as config_lib

    c = config_lib.default_config()
    for k, v in stare.items():
        c.stare[k] = v
    return c


# ----------------------------------------------------------------------------- sharding invariance

def test_weights_and_loss_identical_on_one_and_eight_devices():
    rs = np.random.RandomState(3)
    B, T = 16, 24
    lp = -rs.exponential(1.5, (B, T)).astype(np.float32)
    old = (lp + 0.3 * rs.randn(B, T)).astype(np.float32)
    adv = np.repeat(rs.randn(B, 1), T, 1).astype(np.float32)
    mask = (rs.rand(B, T) > 0.2).astype(np.float32)

    def fn(lp, old, adv, mask):
        w = stare_weights(lp, adv, mask, top_p_ratio=0.1, w=1.1, m=0.9, variant="C2", gate_on=True)
        return w, clipped_surrogate(lp, old, adv, mask, token_weights=w)

    one = parallel.make_mesh(devices=jax.devices()[:1])
    eight = parallel.make_mesh(data=2, fsdp=4, tensor=1)
    results = []
    for mesh in (one, eight):
        sh = NamedSharding(mesh, P(parallel.BATCH_AXES, None))
        args = [jax.device_put(x, sh) for x in (lp, old, adv, mask)]
        out = jax.jit(fn, out_shardings=(sh, NamedSharding(mesh, P())))(*args)
        results.append(jax.device_get(out))
    (w1, l1), (w8, l8) = results
    np.testing.assert_array_equal(w1, w8)
    assert abs(float(l1) - float(l8)) <= 1e-6
    # and a transposed layout (tokens sharded the other way) changes nothing either
    other = parallel.make_mesh(data=1, fsdp=1, tensor=8)
    sh = NamedSharding(other, P(None, "tensor"))
    args = [jax.device_put(x, sh) for x in (lp, old, adv, mask)]
    w_t, l_t = jax.device_get(jax.jit(fn)(*args))
    np.testing.assert_array_equal(w1, w_t)
    assert abs(float(l1) - float(l_t)) <= 1e-6


# ----------------------------------------------------------------------------- config reading

def test_settings_read_the_config_keys_and_aliases():
    import ml_collections

    from stare_jax.rl.settings import RLSettings

    c = ml_collections.ConfigDict({"loss": {"name": "grpo"}, "stare": {"enabled": False, "variant": "C2"},
                                   "update": {"ppo_epochs": 3, "num_minibatches": 2, "grad_accum": 4}})
    s = RLSettings.from_config(c)  # `update` is reached by item access (c.update is a method)
    assert (s.ppo_epochs, s.num_minibatches, s.grad_accum) == (3, 2, 4)
    assert s.loss.name == "grpo" and not s.stare.enabled and s.stare.variant == "C2"
    alias = ml_collections.ConfigDict({"loss": {"name": "stare"}, "stare": {"enabled": False},
                                       "ppo": {"epochs": 2, "num_minibatches": 1, "grad_accum": 2}})
    s = RLSettings.from_config(alias)
    assert (s.ppo_epochs, s.grad_accum) == (2, 2)
    assert s.stare.enabled, "loss.name == 'stare' implies stare.enabled"
    for key, bad in (("loss", {"name": "ppo"}), ("stare", {"variant": "O3"}), ("loss", {"agg": "mean"})):
        with pytest.raises(ValueError, match=f"{key}\\."):
            RLSettings.from_config(ml_collections.ConfigDict({key: bad}))
