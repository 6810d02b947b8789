"""The polarity-entropy family (issue 18): contracts 10 and 11 against plain NumPy, the advantage
rules of HAPO / EntroAdv / W-REINFORCE, gradients only through the log-probs, the four-quadrant
identity of `loss.quadrants`, the pe_quad metrics, and the update step's group-order shaping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.config import parse_quadrants
from stare_jax.rl.advantages import (entropy_token_advantages, group_advantages, hapo_token_advantages,
                                     w_reinforce_token_advantages)
from stare_jax.rl.diagnostics import polarity_entropy_diagnostics, polarity_entropy_quadrants
from stare_jax.rl.losses import BatchView, policy_loss, quadrant_keep, single_scope_context, token_advantages
from stare_jax.rl.settings import LossSettings, RLSettings

QUADS = ("PHR", "PLR", "NLR", "NHR")


# ----------------------------------------------------------------------------- NumPy references

def np_group_stats(ent, mask, G):
    """Per row: mean and population std of the group's valid-token entropies (0, 0 when none)."""
    B = ent.shape[0]
    mu, sd = np.zeros(B), np.zeros(B)
    for g in range(B // G):
        rows = slice(g * G, (g + 1) * G)
        h = np.asarray(ent[rows], np.float64)[mask[rows] > 0]
        if h.size:
            mu[rows], sd[rows] = h.mean(), h.std()
    return mu, sd


def np_hapo(adv, ent, mask, G, alpha=0.2, phi=2.0, eps=1e-6):
    """Contract 10, literally, in float64."""
    mu, sd = np_group_stats(ent, mask, G)
    out = np.zeros(ent.shape)
    for i in range(ent.shape[0]):
        for t in range(ent.shape[1]):
            if mask[i, t] <= 0:
                continue
            a = float(adv[i, t])
            z = (float(ent[i, t]) - mu[i]) / (sd[i] + eps)
            out[i, t] = a + alpha * np.sign(a) * min(max(z, -abs(a) / phi), abs(a) / phi)
    return out


def np_quadrants(rewards, ent, mask, G, thr=0.5):
    """Contract 11, literally: polarity by reward >= thr, high by H >= the group's mean valid entropy."""
    mu, _ = np_group_stats(ent, mask, G)
    valid = mask > 0
    with np.errstate(invalid="ignore"):
        high = np.asarray(ent, np.float64) >= mu[:, None]
    pos = (np.asarray(rewards) >= thr)[:, None]
    return {"PHR": valid & pos & high, "PLR": valid & pos & ~high, "NLR": valid & ~pos & ~high,
            "NHR": valid & ~pos & high}


def make_case(seed, groups=5, G=4, T=7):
    """Random batch: entropies on a 1/8 grid (ties, exact group means), ragged masks with empty rows,
    garbage (NaN) entropy on padding, one group of all-equal entropies, one of all-equal rewards
    (A = 0 rows), and GRPO advantages per token."""
    rs = np.random.RandomState(seed)
    B = groups * G
    ent = (rs.randint(0, 17, (B, T)) / 8.0).astype(np.float32)
    ent[:G] = 0.625  # all-equal group
    lengths = rs.randint(0, T + 1, B)
    lengths[G] = 0  # an empty response
    lengths[2 * G] = 1  # a one-token response
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    rewards = rs.randint(0, 2, B).astype(np.float32)
    rewards[G:2 * G] = 1.0  # all-equal rewards: A = 0 for the whole group
    rewards[3 * G:4 * G] = [1, 0, 0, 0]
    ent = np.where(mask > 0, ent, np.nan).astype(np.float32)
    adv = np.repeat(np.asarray(group_advantages(rewards, G))[:, None], T, 1).astype(np.float32)
    return rewards, ent, mask, adv


# ----------------------------------------------------------------------------- contracts

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alpha, phi", [(0.2, 2.0), (0.5, 0.7)])
def test_hapo_token_advantages_matches_numpy(seed, alpha, phi):
    G = 4
    rewards, ent, mask, adv = make_case(seed, G=G)
    if seed % 2:  # also free-form advantages, some rows exactly 0
        rs = np.random.RandomState(100 + seed)
        adv = np.repeat(rs.randn(adv.shape[0], 1) * (rs.rand(adv.shape[0], 1) > 0.25), adv.shape[1], 1)
        adv = adv.astype(np.float32)
    got = np.asarray(hapo_token_advantages(adv, ent, mask, group_size=G, alpha=alpha, phi=phi))
    want = np_hapo(adv, ent, mask, G, alpha=alpha, phi=phi)
    assert got.dtype == np.float32 and got.shape == ent.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[mask == 0] == 0)
    zero_rows = (adv == 0).all(axis=1)
    assert zero_rows.any() and np.all(got[zero_rows] == 0)  # A = 0 keeps 0
    np.testing.assert_array_equal(got[:G], np.where(mask[:G] > 0, adv[:G], 0))  # all-equal entropies: z = 0
    assert np.all(np.sign(got) == np.sign(np.where(mask > 0, adv, 0)))  # sign-preserving
    # per-response advantages [B] give the same
    per_row = np.asarray(hapo_token_advantages(adv[:, 0], ent, mask, group_size=G, alpha=alpha, phi=phi))
    np.testing.assert_array_equal(per_row, got)


@pytest.mark.parametrize("seed", range(4))
def test_polarity_entropy_quadrants_match_numpy_and_partition(seed):
    G = 4
    rewards, ent, mask, _ = make_case(seed, G=G)
    rewards = rewards * np.random.RandomState(seed).choice([0.25, 1.0], rewards.shape)  # 0.25: negative
    got = {k: np.asarray(v) for k, v in polarity_entropy_quadrants(rewards, ent, mask, group_size=G).items()}
    want = np_quadrants(rewards, ent, mask, G)
    assert set(got) == set(QUADS)
    for q in QUADS:
        assert got[q].dtype == bool and got[q].shape == ent.shape
        np.testing.assert_array_equal(got[q], want[q], err_msg=q)
    stacked = np.stack([got[q] for q in QUADS]).astype(int)
    np.testing.assert_array_equal(stacked.sum(0), (mask > 0).astype(int))  # a partition of the valid tokens
    assert got["PHR"][:G].sum() + got["NHR"][:G].sum() == (mask[:G] > 0).sum()  # ties at mu_H are "high"


def test_entropy_advantage_and_w_reinforce_match_numpy():
    G = 4
    rewards, ent, mask, adv = make_case(7, G=G)
    valid = mask > 0
    h = np.where(valid, ent, 0).astype(np.float64)
    for alpha, kappa in ((0.4, 2.0), (1.0, 3.0)):
        got = np.asarray(entropy_token_advantages(adv, ent, mask, alpha=alpha, kappa=kappa))
        want = np.where(valid, adv + np.minimum(alpha * h, np.abs(adv) / kappa), 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert np.all(got[(adv == 0) & valid] == 0)
    graded = rewards * 0.9  # 0.9 >= 0.5: still correct
    for lam in (0.1, 0.0, 1.0):
        got = np.asarray(w_reinforce_token_advantages(graded, mask, lam=lam))
        want = np.where(valid, np.where((graded >= 0.5)[:, None], lam, -1.0), 0.0)
        np.testing.assert_array_equal(got, want.astype(np.float32))


def test_registry_rules_use_their_settings():
    G = 4
    rewards, ent, mask, adv = make_case(3, G=G)
    lp = -np.abs(np.random.RandomState(0).randn(*ent.shape)).astype(np.float32)
    b = BatchView(advantages=jnp.asarray(adv), rewards=jnp.asarray(rewards), entropy=jnp.asarray(ent),
                  log_probs=jnp.asarray(lp), mask=jnp.asarray(mask), group_size=G)
    cases = {
        "hapo": (dict(hapo_alpha=0.3, hapo_phi=1.5), np_hapo(adv, ent, mask, G, alpha=0.3, phi=1.5)),
        "entropy_advantage": (dict(entropy_adv_alpha=0.7, entropy_adv_kappa=3.0), np.where(
            mask > 0, adv + np.minimum(0.7 * np.where(mask > 0, ent, 0), np.abs(adv) / 3.0), 0)),
        "w_reinforce": (dict(w_reinforce_lambda=0.25), np.where(mask > 0, np.where(rewards[:, None] >= 0.5, 0.25, -1.0),
                                                               0)),
    }
    for name, (kw, want) in cases.items():
        got = np.asarray(token_advantages(LossSettings(name=name, **kw), b))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    for name in ("grpo", "stare", "forking_tokens"):
        assert token_advantages(LossSettings(name=name), b) is b.advantages


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("name", ["hapo", "entropy_advantage", "w_reinforce"])
def test_gradient_flows_only_through_log_probs(name):
    """On policy the loss gradient is -(1/N) A' m w.r.t. the log-probs, and exactly 0 w.r.t. the
    entropy and the GRPO advantages that A' is computed from (both stop-gradient)."""
    G = 4
    rewards, ent, mask, adv = make_case(5, G=G)
    ent = np.where(mask > 0, ent, 0).astype(np.float32)
    lp = -np.abs(np.random.RandomState(1).randn(*ent.shape)).astype(np.float32)
    settings = LossSettings(name=name)

    def f(lp_, ent_, adv_):
        a = token_advantages(settings, BatchView(advantages=adv_, rewards=jnp.asarray(rewards), entropy=ent_,
                                                 log_probs=lp_, mask=jnp.asarray(mask), group_size=G))
        return policy_loss(single_scope_context(lp_, lp, a, mask, entropy=ent_, settings=settings))[0]

    g_lp, g_ent, g_adv = jax.jit(jax.grad(f, (0, 1, 2)))(jnp.asarray(lp), jnp.asarray(ent), jnp.asarray(adv))
    assert not np.asarray(g_ent).any() and not np.asarray(g_adv).any()
    a = np.asarray(token_advantages(settings, BatchView(advantages=jnp.asarray(adv), rewards=jnp.asarray(rewards),
                                                        entropy=jnp.asarray(ent), log_probs=jnp.asarray(lp),
                                                        mask=jnp.asarray(mask), group_size=G)))
    np.testing.assert_allclose(np.asarray(g_lp), -a * mask / mask.sum(), rtol=1e-5, atol=1e-8)
    assert np.abs(np.asarray(g_lp)).max() > 0


# ----------------------------------------------------------------------------- quadrant restriction

@pytest.mark.parametrize("name", ["grpo", "stare", "hapo", "entropy_advantage", "w_reinforce", "forking_tokens",
                                  "clip_cov", "kl_cov"])
def test_four_single_quadrant_losses_add_up_to_the_full_loss(name):
    """loss.quadrants keeps the normaliser of all valid tokens: the four single-quadrant losses (and
    gradients) sum to the unrestricted one, for every policy-gradient method, STARE weights included."""
    G = 4
    rewards, ent, mask, adv = make_case(11, G=G)
    ent = np.where(mask > 0, ent, 0).astype(np.float32)
    rs = np.random.RandomState(2)
    lp = -np.abs(rs.randn(*ent.shape)).astype(np.float32)
    old = (lp + 0.3 * rs.randn(*lp.shape)).astype(np.float32)
    w = rs.choice([1.0, 1.5, 0.7], lp.shape).astype(np.float32)  # STARE-like token weights
    quads = polarity_entropy_quadrants(rewards, ent, mask, group_size=G)
    kw = dict(clip_cov_ratio=0.2, clip_cov_lb=-10, clip_cov_ub=10, kl_cov_ratio=0.2)
    rng = jax.random.key(4)

    def loss(s, x):
        a = token_advantages(s, BatchView(advantages=jnp.asarray(adv), rewards=jnp.asarray(rewards),
                                          entropy=jnp.asarray(ent), log_probs=x, mask=jnp.asarray(mask), group_size=G))
        keep = quadrant_keep(s, quads)
        tw = jnp.asarray(w) if keep is None else jnp.asarray(w) * keep
        return policy_loss(single_scope_context(x, old, a, mask, entropy=ent, settings=s, token_weights=tw, rng=rng))[0]

    full_s = LossSettings(name=name, **kw)
    assert quadrant_keep(full_s, quads) is None
    lf, gf = jax.value_and_grad(lambda x: loss(full_s, x))(jnp.asarray(lp))
    parts = [jax.value_and_grad(lambda x, q=q: loss(LossSettings(name=name, quadrants=(q,), **kw), x))(jnp.asarray(lp))
             for q in QUADS]
    np.testing.assert_allclose(sum(float(l) for l, _ in parts), float(lf), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(np.asarray(g) for _, g in parts), np.asarray(gf), rtol=1e-5, atol=1e-7)
    assert sum(abs(float(l)) > 0 for l, _ in parts) >= 2  # forking tokens: only high-entropy tokens
    pair = loss(LossSettings(name=name, quadrants=("PHR", "NHR"), **kw), jnp.asarray(lp))
    np.testing.assert_allclose(float(pair), float(parts[0][0]) + float(parts[3][0]), rtol=1e-5, atol=1e-6)


def test_parse_quadrants():
    assert parse_quadrants("") == () and parse_quadrants("  ") == ()
    assert parse_quadrants("nhr, PHR,phr") == ("PHR", "NHR")
    for bad in (",", " , ", "PHX", "PHR,XYZ"):
        with pytest.raises(ValueError):
            parse_quadrants(bad)
    with pytest.raises(ValueError, match="loss.quadrants"):
        RLSettings.from_config({"loss": {"quadrants": "PHR,,HIGH"}})
    assert RLSettings.from_config({"loss": {"quadrants": "plr"}}).loss.quadrants == ("PLR",)
    for key, value in (("hapo_alpha", 0.0), ("hapo_phi", -1.0), ("entropy_adv_kappa", 0.0),
                       ("w_reinforce_lambda", 1.5)):
        with pytest.raises(ValueError, match=f"loss.{key}"):
            RLSettings.from_config({"loss": {key: value}})


def test_pe_quad_metrics_definition():
    G = 4
    rewards, ent, mask, adv = make_case(2, G=G)
    quads = polarity_entropy_quadrants(rewards, ent, mask, group_size=G)
    w = np.random.RandomState(0).choice([1.0, 2.0, 0.0], ent.shape).astype(np.float32)
    m = {k: float(v) for k, v in polarity_entropy_diagnostics(quads, adv, w, mask).items()}
    mass = np.abs(adv * w) * mask
    for q in QUADS:
        qm = np.asarray(quads[q])
        np.testing.assert_allclose(m[f"pe_quad_{q.lower()}_frac"], qm.sum() / mask.sum(), rtol=1e-6)
        np.testing.assert_allclose(m[f"pe_quad_{q.lower()}_mass"], mass[qm].sum() / mass.sum(), rtol=1e-5)
    np.testing.assert_allclose(sum(m[f"pe_quad_{q.lower()}_frac"] for q in QUADS), 1.0, rtol=1e-6)
    np.testing.assert_allclose(sum(m[f"pe_quad_{q.lower()}_mass"] for q in QUADS), 1.0, rtol=1e-5)
    zero = polarity_entropy_diagnostics(quads, np.zeros_like(adv), w, mask)  # no advantage mass: 0, finite
    assert all(float(zero[f"pe_quad_{q.lower()}_mass"]) == 0 for q in QUADS)


# ----------------------------------------------------------------------------- the update step

def test_micro_batch_layout_round_trips_to_group_order():
    """The micro-batched update path rebuilds group order (`_from_micro`) before shaping advantages:
    it must be the exact inverse of the strided split (micro-batch k = rows {i K + k})."""
    from stare_jax.rl.update import _from_micro, _to_micro

    x = jnp.arange(24 * 3).reshape(24, 3)
    for K in (1, 2, 3, 4, 8):
        micro = _to_micro(x, K)
        np.testing.assert_array_equal(np.asarray(micro[1 % K, 0]), np.asarray(x[1 % K]))
        np.testing.assert_array_equal(np.asarray(_from_micro(micro)), np.asarray(x))
