"""The clipped surrogate (contract 3) against NumPy, exact aggregation under micro-batching, and the
defining rule of every registry loss (which tokens get gradient, and how much)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.rl import losses
from stare_jax.rl.losses import (LossContext, ScopeView, clipped_surrogate, policy_loss, single_scope_context)
from stare_jax.rl.settings import LossSettings


def np_surrogate(lp, old, adv, mask, *, cl=0.2, ch=0.28, c=10.0, w=None, agg="token-mean"):
    """Contract 3 in NumPy (float64)."""
    lp, old, adv, mask = (np.asarray(x, np.float64) for x in (lp, old, adv, mask))
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - cl, 1 + ch)
    lc = np.maximum(l1, l2)
    loss = np.where(adv < 0, np.minimum(-adv * c, lc), lc)
    if w is not None:
        loss = loss * w
    if agg == "token-mean":
        return (loss * mask).sum() / mask.sum()
    lengths = mask.sum(-1)
    nonempty = (lengths > 0).sum()
    if agg == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / np.maximum(lengths, 1)).sum() / nonempty
    return (loss * mask).sum(-1).sum() / nonempty


def case(seed, B=5, T=8, spread=1.0):
    rs = np.random.RandomState(seed)
    lp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    old = (lp + spread * rs.randn(B, T)).astype(np.float32)
    adv = np.repeat(rs.randn(B, 1), T, 1).astype(np.float32)
    mask = (rs.rand(B, T) > 0.3).astype(np.float32)
    mask[2] = 0.0  # an empty sequence
    return lp, old, adv, mask


@pytest.mark.parametrize("agg", list(losses.AGGREGATIONS))
def test_clipped_surrogate_matches_numpy(agg):
    for seed in range(3):
        lp, old, adv, mask = case(seed, spread=1.5)
        w = np.random.RandomState(seed).choice([1.0, 1.1, 0.9], lp.shape).astype(np.float32)
        got = float(clipped_surrogate(lp, old, adv, mask, token_weights=w, agg=agg))
        np.testing.assert_allclose(got, np_surrogate(lp, old, adv, mask, w=w, agg=agg), rtol=1e-5, atol=1e-6)


def test_clip_higher_and_dual_clip_only_for_negative_advantages():
    # one token per case: (log ratio, advantage) -> expected per-token loss and gradient
    g = jax.grad(lambda lp, old, adv: clipped_surrogate(lp, old, adv, jnp.ones_like(lp)))
    cases = [
        (np.log(1.5), 1.0, -1.28, 0.0),  # A>0, r above 1+0.28: clipped, no gradient
        (np.log(1.2), 1.0, -1.2, -1.2),  # A>0 inside the asymmetric range (0.2 would have clipped)
        (np.log(0.7), 1.0, -0.7, -0.7),  # A>0, r below 1-0.2: not clipped (min picks unclipped)
        (np.log(0.7), -1.0, 0.8, 0.0),  # A<0, r below 0.8: clipped at 1-0.2, no gradient
        (np.log(3.0), -1.0, 3.0, 3.0),  # A<0, 1.28 < r < c: unclipped
        (np.log(20.0), -1.0, 10.0, 0.0),  # A<0, r > c = 10: dual-clip caps at -A c, no gradient
        (np.log(20.0), 1.0, -1.28, 0.0),  # A>0, huge r: ordinary clip, no dual-clip
        (40.0, -1.0, 10.0, 0.0),  # log-ratio clamped to 20 before exp: finite
    ]
    for log_r, a, want_loss, want_grad in cases:
        lp, old, adv = jnp.array([[log_r]], jnp.float32), jnp.zeros((1, 1)), jnp.array([[a]], jnp.float32)
        loss = float(clipped_surrogate(lp, old, adv, jnp.ones((1, 1))))
        grad = float(g(lp, old, adv)[0, 0])
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"{log_r}, {a}")
        # d/dlp of -A r is -A r (r = exp(lp - old))
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{log_r}, {a}")
        assert math.isfinite(loss)


def _micro_contexts(lp, old, adv, mask, ent, settings, S, rng):
    """Splits a scope of B rows into S micro-batches of contiguous rows (view [S, n, T])."""
    B, T = lp.shape
    n = B // S
    sg = jax.lax.stop_gradient
    r = lambda x: jnp.asarray(x, jnp.float32).reshape(S, n, T)  # noqa: E731
    view = ScopeView(log_probs=sg(r(lp)), old_log_probs=r(old), advantages=r(adv), mask=r(mask), entropy=sg(r(ent)))
    return [LossContext(log_probs=r(lp)[j], old_log_probs=r(old)[j], advantages=r(adv)[j], mask=r(mask)[j],
                        entropy=r(ent)[j], token_weights=jnp.ones((n, T)), rng=rng, view=view, index=jnp.int32(j),
                        settings=settings) for j in range(S)]


@pytest.mark.parametrize("name,agg", [(n, "token-mean") for n in losses.POLICY_LOSSES] + [
    (n, a) for n in ("grpo", "forking_tokens") for a in losses.AGGREGATIONS if a != "token-mean"])
def test_micro_batched_aggregation_is_exact(name, agg):
    lp, old, adv, mask = case(4, B=8, T=6, spread=0.2)
    ent = np.random.RandomState(1).rand(*lp.shape).astype(np.float32) * 3
    settings = LossSettings(name=name, agg=agg, entropy_coef=0.01, clip_cov_ratio=0.2, clip_cov_lb=-10,
                            clip_cov_ub=10, kl_cov_ratio=0.2)
    rng = jax.random.key(3)

    def full(lp, ent):
        return policy_loss(single_scope_context(lp, old, adv, mask, entropy=ent, settings=settings, rng=rng))[0]

    def micro(lp, ent):
        ctxs = _micro_contexts(lp, old, adv, mask, ent, settings, 4, rng)
        return sum(policy_loss(c)[0] for c in ctxs)

    lf, gf = jax.jit(jax.value_and_grad(full, (0, 1)))(jnp.asarray(lp), jnp.asarray(ent))
    lm, gm = jax.jit(jax.value_and_grad(micro, (0, 1)))(jnp.asarray(lp), jnp.asarray(ent))
    np.testing.assert_allclose(float(lm), float(lf), rtol=1e-6, atol=1e-7)
    for a, b in zip(gm, gf):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


def _grad_wrt_lp(settings, lp, old, adv, mask, **kw):
    def f(lp):
        return policy_loss(single_scope_context(lp, old, adv, mask, settings=settings, **kw))[0]
    return np.asarray(jax.jit(jax.grad(f))(jnp.asarray(lp)))


def test_grpo_and_stare_gradients_are_minus_w_a_over_n_on_policy():
    lp, _, adv, mask = case(0)
    w = np.random.RandomState(0).choice([1.0, 1.1, 0.9], lp.shape).astype(np.float32)
    N = mask.sum()
    for name in ("grpo", "stare"):
        g = _grad_wrt_lp(LossSettings(name=name), lp, lp, adv, mask, token_weights=w)
        np.testing.assert_allclose(g, -w * adv * mask / N, rtol=1e-5, atol=1e-8)


def test_entropy_bonus_rule():
    lp, _, adv, mask = case(1)
    ent = np.random.RandomState(2).rand(*lp.shape).astype(np.float32)
    settings = LossSettings(name="entropy_bonus", entropy_coef=0.05)
    N = mask.sum()

    def f(x, ent):  # on-policy: old log-probs are the (constant) current ones
        return policy_loss(single_scope_context(x, lp, adv, mask, entropy=ent, settings=settings))
    (loss, metrics), (g_lp, g_ent) = jax.value_and_grad(f, (0, 1), has_aux=True)(jnp.asarray(lp), jnp.asarray(ent))
    np.testing.assert_allclose(np.asarray(g_ent), -0.05 * mask / N, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(g_lp), -adv * mask / N, rtol=1e-5, atol=1e-8)
    want = np_surrogate(lp, lp, adv, mask) - 0.05 * (ent * mask).sum() / N
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["entropy_bonus"]), (ent * mask).sum() / N, rtol=1e-5)


def test_forking_tokens_rule():
    lp, _, adv, mask = case(2, B=6, T=10)
    ent = np.random.RandomState(5).permutation(lp.size).reshape(lp.shape).astype(np.float32) / 10  # distinct
    settings = LossSettings(name="forking_tokens", forking_rho=0.2)
    g = _grad_wrt_lp(settings, lp, lp, adv, mask, entropy=ent)
    valid = mask > 0
    k = max(1, int(valid.sum() * 0.2 + 0.9999))  # the paper's rounding
    threshold = np.sort(ent[valid])[::-1][k - 1]
    top = valid & (ent >= threshold)
    assert top.sum() == k
    np.testing.assert_allclose(g[top], -adv[top] / k, rtol=1e-5)  # token-mean over the selected tokens only
    assert (g[~top] == 0).all()


def test_clip_cov_rule():
    rs = np.random.RandomState(6)
    B, T = 8, 16
    lp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    adv = np.repeat(rs.randn(B, 1) * 3, T, 1).astype(np.float32)
    mask = (rs.rand(B, T) > 0.1).astype(np.float32)
    settings = LossSettings(name="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=3.0)
    valid = mask > 0
    cov = (adv - adv[valid].mean()) * (lp - lp[valid].mean())
    candidates = valid & (cov > 0.5) & (cov < 3.0)
    clip_num = max(int(0.05 * valid.sum()), 1)
    assert candidates.sum() > clip_num  # the random choice is a real choice
    zeroed_sets = []
    for seed in (0, 1, 2):
        g = _grad_wrt_lp(settings, lp, lp, adv, mask, rng=jax.random.key(seed))
        zeroed = valid & (g == 0) & (adv != 0)
        assert zeroed.sum() == clip_num and (zeroed <= candidates).all()
        keep = valid & ~zeroed
        np.testing.assert_allclose(g[keep], -adv[keep] / valid.sum(), rtol=1e-5)
        zeroed_sets.append(tuple(np.flatnonzero(zeroed)))
    assert len(set(zeroed_sets)) > 1, "different rngs pick different tokens"
    g_again = _grad_wrt_lp(settings, lp, lp, adv, mask, rng=jax.random.key(0))
    assert tuple(np.flatnonzero(valid & (g_again == 0) & (adv != 0))) == zeroed_sets[0]
    # tokens the PPO clip already clips are never candidates
    old = lp.copy()
    old[candidates] -= 1.0  # ratio e > 1.28: clipped where A > 0
    g = _grad_wrt_lp(settings, lp, old, adv, mask, rng=jax.random.key(0))
    clipped = candidates & (adv > 0)
    assert (g[clipped] == 0).all()


def test_kl_cov_rule():
    rs = np.random.RandomState(7)
    B, T = 6, 12
    lp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    old = (lp + 0.05 * rs.randn(B, T)).astype(np.float32)
    adv = np.repeat(rs.randn(B, 1), T, 1).astype(np.float32)
    mask = (rs.rand(B, T) > 0.2).astype(np.float32)
    settings = LossSettings(name="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=2.0)
    g = _grad_wrt_lp(settings, lp, old, adv, mask)
    valid = mask > 0
    N = valid.sum()
    cov = (adv - adv[valid].mean()) * (lp - lp[valid].mean())
    k = max(1, int(N * 0.1))
    flat = np.where(valid, cov, -np.inf).reshape(-1)
    top = np.zeros(flat.shape, bool)
    top[np.argsort(-flat, kind="stable")[:k]] = True
    top = top.reshape(cov.shape)
    ratio = np.exp(lp - old)
    want = np.where(valid, -adv * ratio / N, 0.0)
    want = want + np.where(top, 2.0 * np.sign(lp - old) / N, 0.0)
    np.testing.assert_allclose(g, want, rtol=2e-5, atol=1e-8)


@pytest.mark.parametrize("kl_type", ["k1", "k3", "low_var_kl"])
def test_kl_penalty_to_reference(kl_type):
    lp, _, adv, mask = case(8)
    ref = (lp + 0.4 * np.random.RandomState(0).randn(*lp.shape)).astype(np.float32)
    base = LossSettings(name="grpo")
    settings = LossSettings(name="grpo", kl_type=kl_type, kl_coef=0.1)
    l0, _ = policy_loss(single_scope_context(lp, lp, adv, mask, settings=base))
    l1, m1 = policy_loss(single_scope_context(lp, lp, adv, mask, settings=settings, ref_log_probs=ref))
    d = ref.astype(np.float64) - lp
    per_token = {"k1": -d, "k3": np.exp(d) - d - 1, "low_var_kl": np.clip(np.exp(d) - d - 1, -10, 10)}[kl_type]
    kl = (per_token * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m1["kl_ref"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(l1) - float(l0), 0.1 * kl, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError):
        policy_loss(single_scope_context(lp, lp, adv, mask, settings=settings))


def test_approx_kl_is_the_k3_estimate_the_readme_describes():
    """Issue 19 item 7: the logged `approx_kl` is k3 = token mean of (r - 1) - log r, r = pi/pi_old, and
    README's metric table says so (it used to describe k1, the mean of old - new log-prob)."""
    import os
    import re

    lp, old, adv, mask = case(10, spread=0.3)
    _, m = policy_loss(single_scope_context(lp, old, adv, mask, settings=LossSettings(name="grpo")))
    d = lp.astype(np.float64) - old
    k3 = ((np.exp(d) - 1 - d) * mask).sum() / mask.sum()
    k1 = (-d * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m["approx_kl"]), k3, rtol=1e-5)
    assert abs(k1 - k3) > 1e-3  # the two estimates are distinguishable on this case
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    row = re.search(r"^\| `approx_kl` \|(.*)\|$", readme, re.M).group(1)
    assert "k3" in row and "(r - 1) - log r" in row and "k1" not in row, row


def test_masked_tokens_never_contribute_even_if_not_finite():
    lp, old, adv, mask = case(9)
    lp = lp.copy()
    lp[mask == 0] = np.nan
    loss = clipped_surrogate(lp, old, adv, mask)
    assert np.isfinite(float(loss))
    g = jax.grad(lambda x: clipped_surrogate(x, old, adv, mask))(jnp.asarray(lp))
    assert np.isfinite(np.asarray(g)).all()
