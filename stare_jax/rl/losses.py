"""Policy losses: the clipped surrogate (contract 3), exact aggregations and a registry of methods.

Per-token PPO surrogate with clip-higher and dual-clip (verl's `compute_policy_loss_vanilla`):

    log r = clip(log pi - log pi_old, -20, 20),  r = exp(log r)
    l1 = -A r,  l2 = -A clip(r, 1 - eps_low, 1 + eps_high),  l_clip = max(l1, l2)
    l = min(-A c, l_clip) if A < 0 else l_clip          (dual-clip only for negative advantages)

Aggregations are linear in the token losses, loss = sum_t c_t l_t, with coefficients c computed
from the mask of the whole aggregation scope (one mini-batch):

    token-mean            c_t = m_t / sum(m)                       (exact global token mean)
    seq-mean-token-mean   c_t = m_t / (|y_i| * #nonempty sequences)
    seq-mean-token-sum    c_t = m_t / #nonempty sequences

so gradient accumulation over micro-batches is exact: each micro-batch uses its rows of the
scope's coefficients (deferred division by the global count, never a mean of means).

A registry entry `POLICY_LOSSES[name](ctx) -> (loss, metrics)` gets a `LossContext`: the
micro-batch's differentiable log-probs and entropy, its old log-probs, advantages, mask, token
weights (STARE's, or ones), an rng, the loss settings, and a stop-gradient `ScopeView` of the
whole scope for rules that select tokens globally (forking tokens, Clip-Cov, KL-Cov). Metrics an
entry returns must be additive over micro-batches (use `ctx.token_mean`).

Methods that change the advantage itself (HAPO, EntroAdv, W-REINFORCE) also have an entry in
`ADVANTAGE_RULES[name](settings, batch) -> [N, T]`: it sees the whole update batch in group order
(`BatchView`: GRPO advantages, rewards, pre-update entropy and log-probs, mask, group size), runs
once per step before the batch is split into micro-batches, and its result is the `advantages`
every later stage sees (STARE selection, diagnostics, the loss). `loss.quadrants` likewise becomes a
0/1 factor of the token weights (`quadrant_keep`), so it combines with every entry.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp

from stare_jax.rl.advantages import entropy_token_advantages, hapo_token_advantages, w_reinforce_token_advantages
from stare_jax.rl.diagnostics import CORRECT_THRESHOLD
from stare_jax.rl.selection import floor_count, select_top_fraction, select_top_k
from stare_jax.rl.settings import LossSettings

LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------- aggregation

def _coef_token_mean(mask: jax.Array) -> jax.Array:
    """c_t = m_t / sum(m): the mean over every valid token of the scope."""
    return mask / jnp.maximum(mask.sum(), 1.0)


def _nonempty(mask: jax.Array) -> jax.Array:
    return jnp.maximum((mask.sum(axis=-1) > 0).sum().astype(jnp.float32), 1.0)


def _coef_seq_mean_token_mean(mask: jax.Array) -> jax.Array:
    """c_t = m_t / (|y_i| * #nonempty sequences): mean over sequences of each one's token mean."""
    lengths = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
    return mask / lengths / _nonempty(mask)


def _coef_seq_mean_token_sum(mask: jax.Array) -> jax.Array:
    """c_t = m_t / #nonempty sequences: mean over sequences of each one's token sum."""
    return mask / _nonempty(mask)


AGGREGATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "token-mean": _coef_token_mean,
    "seq-mean-token-mean": _coef_seq_mean_token_mean,
    "seq-mean-token-sum": _coef_seq_mean_token_sum,
}


def aggregation_coefficients(mask: jax.Array, agg: str) -> jax.Array:
    """Coefficients c [B, T] with loss = sum(c * token_losses) for aggregation `agg` over `mask`."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss.agg must be one of {sorted(AGGREGATIONS)}, got {agg!r}")
    return AGGREGATIONS[agg](jnp.asarray(mask, jnp.float32))


def aggregate(token_losses: jax.Array, mask: jax.Array, agg: str = "token-mean") -> jax.Array:
    """sum_t c_t l_t over one scope (masked-out tokens contribute exactly 0, even if not finite)."""
    coef = aggregation_coefficients(mask, agg)
    return jnp.sum(jnp.where(coef > 0, coef * token_losses, 0.0))


# ----------------------------------------------------------------------------- surrogate

def _broadcast_adv(advantages, like):
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == like.ndim - 1:
        adv = adv[..., None]
    return jnp.broadcast_to(adv, like.shape)


def ppo_token_terms(log_probs, old_log_probs, advantages, *, clip_low=0.2, clip_high=0.28, clip_c=10.0,
                    mask=None):
    """Per-token surrogate and its pieces: dict with `loss`, `ratio`, `log_ratio`, `clipped`
    (l2 > l1, the PPO clip is active) and `clipped_lower` (dual-clip active, A < 0).

    With `mask`, masked-out tokens are computed from zeros, so their (unused) values and
    gradients are finite whatever the inputs hold there.
    """
    lp = jnp.asarray(log_probs, jnp.float32)
    adv = _broadcast_adv(advantages, lp)
    old = jnp.asarray(old_log_probs, jnp.float32)
    if mask is not None:
        keep = jnp.asarray(mask) > 0
        lp, old, adv = jnp.where(keep, lp, 0.0), jnp.where(keep, old, 0.0), jnp.where(keep, adv, 0.0)
    log_ratio = jnp.clip(lp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    l_clip = jnp.maximum(l1, l2)
    l3 = -adv * clip_c
    loss = jnp.where(adv < 0, jnp.minimum(l3, l_clip), l_clip)
    return {"loss": loss, "ratio": ratio, "log_ratio": log_ratio, "unclipped": l1, "clip": l2,
            "clipped": l2 > l1, "clipped_lower": (l_clip > l3) & (adv < 0)}


def clipped_surrogate(log_probs, old_log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.28, clip_c=10.0,
                      token_weights=None, agg="token-mean") -> jax.Array:
    """Scalar clipped-surrogate loss (contract 3): sum_t c_t w_t l_t with l_t as in the module docstring.

    `advantages` per token [B, T] (or per sequence [B]); `token_weights` default 1.
    """
    terms = ppo_token_terms(log_probs, old_log_probs, advantages, clip_low=clip_low, clip_high=clip_high,
                            clip_c=clip_c, mask=mask)
    losses = terms["loss"] if token_weights is None else terms["loss"] * jnp.asarray(token_weights, jnp.float32)
    return aggregate(losses, mask, agg)


# ----------------------------------------------------------------------------- context

@flax.struct.dataclass
class ScopeView:
    """Stop-gradient arrays of the whole aggregation/selection scope, each [S, n, T].

    S is the number of micro-batches in the scope; the micro-batch being differentiated is
    row `index` of the leading axis. `log_probs` and `entropy` are the pre-update policy's.
    """

    log_probs: jax.Array
    old_log_probs: jax.Array
    advantages: jax.Array
    mask: jax.Array
    entropy: jax.Array


@flax.struct.dataclass
class LossContext:
    """Everything a registry entry sees for one micro-batch (arrays [n, T]); see module docstring."""

    log_probs: jax.Array
    old_log_probs: jax.Array
    advantages: jax.Array
    mask: jax.Array
    entropy: jax.Array
    token_weights: jax.Array
    rng: jax.Array
    view: ScopeView
    index: jax.Array
    settings: LossSettings = flax.struct.field(pytree_node=False)
    ref_log_probs: Optional[jax.Array] = None

    def local(self, x: jax.Array) -> jax.Array:
        """This micro-batch's rows of a scope array [S, n, T]."""
        return jax.lax.dynamic_index_in_dim(x, self.index, axis=0, keepdims=False)

    def aggregate(self, token_losses: jax.Array, selection: Optional[jax.Array] = None) -> jax.Array:
        """This micro-batch's share of the scope aggregation of `token_losses` ([n, T]).

        `selection` ([S, n, T], optional) restricts the loss mask to selected tokens, which also
        changes the normaliser (as the forking-token rule does).
        """
        mask = self.view.mask if selection is None else self.view.mask * selection.astype(jnp.float32)
        S, n, T = mask.shape
        coef = self.local(aggregation_coefficients(mask.reshape(S * n, T), self.settings.agg).reshape(S, n, T))
        return jnp.sum(jnp.where(coef > 0, coef * token_losses, 0.0))

    def token_mean(self, x: jax.Array) -> jax.Array:
        """This micro-batch's share of the scope's token mean of x (for metrics and token-mean terms)."""
        count = jnp.maximum(self.view.mask.sum(), 1.0)
        return jnp.sum(jnp.where(self.mask > 0, x, 0.0)) / count

    def ppo_terms(self, settings: Optional[LossSettings] = None):
        """`ppo_token_terms` of this micro-batch with the configured clip ranges."""
        s = settings or self.settings
        return ppo_token_terms(self.log_probs, self.old_log_probs, self.advantages, clip_low=s.clip_low,
                               clip_high=s.clip_high, clip_c=s.clip_c, mask=self.mask)


def single_scope_context(log_probs, old_log_probs, advantages, mask, *, settings: LossSettings, entropy=None,
                         token_weights=None, rng=None, ref_log_probs=None) -> LossContext:
    """A context whose scope is the given batch itself (no micro-batching): the common case."""
    lp = jnp.asarray(log_probs, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    adv = _broadcast_adv(advantages, lp)
    old = jnp.asarray(old_log_probs, jnp.float32)
    ent = jnp.zeros_like(lp) if entropy is None else jnp.asarray(entropy, jnp.float32)
    sg = jax.lax.stop_gradient
    view = ScopeView(log_probs=sg(lp)[None], old_log_probs=old[None], advantages=adv[None], mask=mask[None],
                     entropy=sg(ent)[None])
    return LossContext(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask, entropy=ent,
                       token_weights=jnp.ones_like(lp) if token_weights is None else jnp.asarray(token_weights,
                                                                                                 jnp.float32),
                       rng=jax.random.key(0) if rng is None else rng, view=view, index=jnp.int32(0),
                       settings=settings, ref_log_probs=ref_log_probs)


# ----------------------------------------------------------------------------- registry

def _grpo(ctx: LossContext):
    """GRPO / DAPO surrogate: sum_t c_t w_t l_t with clip-higher and dual-clip.

    Source: DAPO (Yu et al. 2025, arXiv 2503.14476) clip-higher; dual-clip from Ye et al. 2020
    (arXiv 1912.09729); verl `compute_policy_loss_vanilla`. `w` is 1 unless `stare.enabled`.
    """
    terms = ctx.ppo_terms()
    return ctx.aggregate(terms["loss"] * ctx.token_weights), {}


def _stare(ctx: LossContext):
    """STARE: the GRPO surrogate with each token's loss multiplied by its STARE weight w_t
    (W on L+, and M on L- for variant C2) before aggregation. The weights are computed once per
    step by `stare.stare_weights` from the pre-update surprisal (DESIGN.md steps 1-6; STARE,
    arXiv 2606.19236) and arrive as `ctx.token_weights`."""
    return _grpo(ctx)


def _entropy_bonus(ctx: LossContext):
    """Entropy regularisation: loss = L_grpo - c * token-mean(H_t), c = `loss.entropy_coef`.

    The entropy is the differentiable full-vocabulary entropy of the current policy (verl's
    `entropy_coeff`; Williams & Peng 1991).
    """
    loss, metrics = _grpo(ctx)
    bonus = ctx.token_mean(ctx.entropy)
    return loss - ctx.settings.entropy_coef * bonus, {**metrics, "entropy_bonus": bonus}


def _forking_tokens(ctx: LossContext):
    """Policy gradient only on the forking tokens: the top rho (0.2) of the scope's valid tokens by
    entropy, k = max(1, ceil(rho N)), ties by index; the loss mask (and so the token-mean
    normaliser) is restricted to them.

    Source: Wang et al. 2025, "Beyond the 80/20 Rule" (arXiv 2506.01939), their verl fork's
    `get_global_entropy_top_mask` + `agg_loss(..., response_mask * entropy_top_mask)`.
    """
    selected = select_top_fraction(ctx.view.entropy, ctx.view.mask > 0, ctx.settings.forking_rho)
    terms = ctx.ppo_terms()
    loss = ctx.aggregate(terms["loss"] * ctx.token_weights, selection=selected)
    return loss, {"forking_frac": ctx.token_mean(ctx.local(selected).astype(jnp.float32))}


def _covariance(view: ScopeView) -> jax.Array:
    """Per-token centred covariance (A_t - mean A)(log pi_t - mean log pi) over the scope's valid tokens."""
    valid = view.mask > 0
    count = jnp.maximum(valid.sum(), 1).astype(jnp.float32)
    mean_adv = jnp.sum(jnp.where(valid, view.advantages, 0.0)) / count
    mean_lp = jnp.sum(jnp.where(valid, view.log_probs, 0.0)) / count
    return (view.advantages - mean_adv) * (view.log_probs - mean_lp)


def _clip_cov(ctx: LossContext):
    """Clip-Cov: detach (zero the gradient and loss of) a random subset of high-covariance tokens.

    cov_t = (A_t - mean A)(log pi_t - mean log pi) over the scope's valid tokens; candidates are
    valid tokens with lb < cov_t < ub (1, 5) that the PPO clip does not already clip; a uniformly
    random subset of min(|candidates|, max(1, int(r N_valid))) of them (r = 2e-4) gets weight 0.
    Other tokens use max(l1, l2) (no dual-clip, as in the source).

    Source: Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs" (arXiv 2505.22617);
    PRIME-RL/Entropy-Mechanism-of-RL and verl `compute_policy_loss_clip_cov`.
    """
    s = ctx.settings
    view = ctx.view
    valid = view.mask > 0
    cov = _covariance(view)
    view_terms = ppo_token_terms(view.log_probs, view.old_log_probs, view.advantages, clip_low=s.clip_low,
                                 clip_high=s.clip_high, clip_c=s.clip_c, mask=view.mask)
    candidates = valid & ~view_terms["clipped"] & (cov > s.clip_cov_lb) & (cov < s.clip_cov_ub)
    clip_num = jnp.maximum(floor_count(s.clip_cov_ratio, valid.sum()), 1)
    noise = jax.random.uniform(ctx.rng, cov.shape)
    detached = select_top_k(noise, candidates, clip_num)
    corr = 1.0 - ctx.local(detached).astype(jnp.float32)
    terms = ctx.ppo_terms()
    per_token = jnp.maximum(terms["unclipped"], terms["clip"]) * corr
    loss = ctx.aggregate(per_token * ctx.token_weights)
    return loss, {"clip_cov_frac": ctx.token_mean(1.0 - corr)}


def _kl_cov(ctx: LossContext):
    """KL-Cov: add beta |log pi - log pi_old| to the top kappa of tokens by covariance.

    cov_t as in Clip-Cov; the k = max(1, int(kappa N_valid)) (kappa = 2e-3) valid tokens with the
    largest cov_t get l_t = -A r + beta |log r| (beta = `loss.kl_cov_coef`); every other token has
    l_t = -A r (no ratio clipping, as in the source).

    Source: Cui et al. 2025 (arXiv 2505.22617); verl `compute_policy_loss_kl_cov`.
    """
    s = ctx.settings
    view = ctx.view
    valid = view.mask > 0
    k = jnp.maximum(floor_count(s.kl_cov_ratio, valid.sum()), 1)
    selected = ctx.local(select_top_k(_covariance(view), valid, k))
    terms = ctx.ppo_terms()
    abs_kl = jnp.abs(terms["log_ratio"])
    per_token = terms["unclipped"] + jnp.where(selected, s.kl_cov_coef * abs_kl, 0.0)
    loss = ctx.aggregate(per_token * ctx.token_weights)
    return loss, {"kl_cov_frac": ctx.token_mean(selected.astype(jnp.float32))}


def _hapo(ctx: LossContext):
    """HAPO / EAPO (arXiv 2604.11056): the GRPO-ds surrogate (token-mean, clip 0.2/0.28, no KL) on the
    credit-assigned advantage A_CA = A + alpha sign(A) sg(clip((H - mu_H)/(sigma_H + eps), -|A|/phi,
    |A|/phi)), alpha = `loss.hapo_alpha` (0.2), phi = `loss.hapo_phi` (2); see
    `advantages.hapo_token_advantages`. A_CA arrives as `ctx.advantages` (`ADVANTAGE_RULES`)."""
    return _grpo(ctx)


def _entropy_advantage(ctx: LossContext):
    """EntroAdv (Cheng et al. 2025, arXiv 2506.14758, the entropy-based advantage): the GRPO-ds surrogate
    on A + min(alpha sg(H), |A| / kappa), alpha = `loss.entropy_adv_alpha`, kappa =
    `loss.entropy_adv_kappa`; see `advantages.entropy_token_advantages`.

    Defaults alpha = 0.4, kappa = 2: the values a public implementation (lucidrains' PPO/GRPO
    trainers) attributes to the paper for GRPO (0.1 for PPO). The paper's own hyper-parameter table
    could not be read here, so these are not confirmed from the paper's text.
    """
    return _grpo(ctx)


def _w_reinforce(ctx: LossContext):
    """W-REINFORCE (Zhu et al. 2025, arXiv 2506.01347): L = lambda L_PSR + L_NSR, i.e. the surrogate on
    the advantage +lambda (correct response) / -1 (incorrect), lambda = `loss.w_reinforce_lambda`
    (0.1); no group baseline, so `advantage.scale` does not apply. See
    `advantages.w_reinforce_token_advantages`."""
    return _grpo(ctx)


POLICY_LOSSES: dict[str, Callable[[LossContext], tuple[jax.Array, dict]]] = {
    "grpo": _grpo,
    "stare": _stare,
    "entropy_bonus": _entropy_bonus,
    "forking_tokens": _forking_tokens,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "hapo": _hapo,
    "entropy_advantage": _entropy_advantage,
    "w_reinforce": _w_reinforce,
}


# ----------------------------------------------------------------------------- per-token advantage rules

@flax.struct.dataclass
class BatchView:
    """The whole update batch in group order, stop-gradient: what an advantage rule may read.

    `advantages` [N, T] are GRPO's (`group_advantages` broadcast over each response's tokens),
    `rewards` [N], `entropy` / `log_probs` [N, T] the pre-update policy's, `mask` [N, T].
    """

    advantages: jax.Array
    rewards: jax.Array
    entropy: jax.Array
    log_probs: jax.Array
    mask: jax.Array
    group_size: int = flax.struct.field(pytree_node=False)


ADVANTAGE_RULES: dict[str, Callable[[LossSettings, BatchView], jax.Array]] = {
    "hapo": lambda s, b: hapo_token_advantages(b.advantages, b.entropy, b.mask, group_size=b.group_size,
                                               alpha=s.hapo_alpha, phi=s.hapo_phi),
    "entropy_advantage": lambda s, b: entropy_token_advantages(b.advantages, b.entropy, b.mask,
                                                               alpha=s.entropy_adv_alpha, kappa=s.entropy_adv_kappa),
    "w_reinforce": lambda s, b: w_reinforce_token_advantages(b.rewards, b.mask, lam=s.w_reinforce_lambda,
                                                             correct_threshold=CORRECT_THRESHOLD),
}


def token_advantages(settings: LossSettings, batch: BatchView) -> jax.Array:
    """The per-token advantage [N, T] method `settings.name` trains on: its `ADVANTAGE_RULES` entry,
    or GRPO's `batch.advantages` unchanged (the same array) for methods without one."""
    rule = ADVANTAGE_RULES.get(settings.name)
    if rule is None:
        return batch.advantages
    return jax.lax.stop_gradient(rule(settings, batch))


def quadrant_keep(settings: LossSettings, quadrants: dict) -> Optional[jax.Array]:
    """0/1 float [N, T]: the tokens of the `loss.quadrants` quadrants (None when all are kept).

    Multiplied into the token weights, it drops the other tokens from the policy-gradient sum while
    the aggregation's normaliser still counts every valid token: the losses restricted to each of
    the four quadrants add up to the unrestricted loss (arXiv 2604.11056's controlled quadrant
    interventions).
    """
    if not settings.quadrants:
        return None
    keep = functools.reduce(jnp.logical_or, [quadrants[q] for q in settings.quadrants])
    return keep.astype(jnp.float32)


# ----------------------------------------------------------------------------- KL to a reference

def _kl_k1(log_probs, ref_log_probs):
    """k1 = log pi - log pi_ref (unbiased, high variance)."""
    return log_probs - ref_log_probs


def _kl_k3(log_probs, ref_log_probs):
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi clamped to +-20 (Schulman 2020)."""
    d = jnp.clip(ref_log_probs - log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.exp(d) - d - 1.0


def _kl_low_var(log_probs, ref_log_probs):
    """verl's `low_var_kl`: k3 clamped to [-10, 10]."""
    return jnp.clip(_kl_k3(log_probs, ref_log_probs), -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable] = {"k1": _kl_k1, "k3": _kl_k3, "low_var_kl": _kl_low_var}


def policy_loss(ctx: LossContext) -> tuple[jax.Array, dict]:
    """Registry loss `settings.name` + optional KL penalty to the reference, and common metrics.

    loss = L_name + kl_coef * agg(KL(pi, pi_ref)) when `kl_type` is not "none". Metrics (additive
    over micro-batches): `pg_loss`, `clip_frac`, `clip_frac_lower`, `approx_kl`
    (token mean of (r - 1) - log r), `kl_ref` (when KL is on) and the entry's own.
    """
    s = ctx.settings
    if s.name not in POLICY_LOSSES:
        raise ValueError(f"loss.name must be one of {sorted(POLICY_LOSSES)}, got {s.name!r}")
    pg_loss, extra = POLICY_LOSSES[s.name](ctx)
    loss = pg_loss
    terms = jax.tree_util.tree_map(jax.lax.stop_gradient, ctx.ppo_terms())
    metrics = {
        "pg_loss": pg_loss,
        "clip_frac": ctx.token_mean(terms["clipped"].astype(jnp.float32)),
        "clip_frac_lower": ctx.token_mean(terms["clipped_lower"].astype(jnp.float32)),
        "approx_kl": ctx.token_mean((terms["ratio"] - 1.0) - terms["log_ratio"]),
    }
    if s.kl_type != "none":
        if ctx.ref_log_probs is None:
            raise ValueError(f"loss.kl_type={s.kl_type!r} needs reference log-probs (a reference model)")
        keep = ctx.mask > 0
        kl = KL_ESTIMATORS[s.kl_type](jnp.where(keep, ctx.log_probs, 0.0),
                                      jnp.where(keep, jax.lax.stop_gradient(ctx.ref_log_probs), 0.0))
        kl_term = ctx.aggregate(kl)
        loss = loss + s.kl_coef * kl_term
        metrics["kl_ref"] = kl_term
    metrics.update(extra)
    return loss, metrics
