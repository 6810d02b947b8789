"""The four-quadrant entropy picture of DESIGN.md, measured per update step.

For a softmax policy, a policy-gradient step on sampled token k at a position with entropy H
changes that position's entropy to first order by

    dH_t = eta * A_t * w_t * [pi_k (s_k - H) - sum_j pi_j^2 (s_j - H)],     s = -log pi

(grad_z H = pi (s - H), and the step moves the logits by eta A w (e_k - pi)). Tokens fall into four
quadrants by advantage sign x (s_k > H "high" / s_k <= H "low"); A = 0 tokens belong to none.

Reported per quadrant q in {pos_high, pos_low, neg_high, neg_low}:

    quad_<q>_frac = |q| / N_valid
    quad_<q>_dH   = (1 / N_valid) sum_{t in q} A_t w_t [pi_k (s_k - H) - sum_j pi_j^2 (s_j - H)]

i.e. the predicted summed entropy change for a unit-size SGD step on the token-mean weighted loss
-(1/N) sum_t w_t A_t log pi_t, when every position has its own logits; `quad_total_dH` sums the
four. The inputs come from the chunked log-prob pass (`logprobs.token_stats(..., with_pi2=True)`).

The polarity-entropy quadrants (arXiv 2604.11056, "Four Quadrant Decomposition") split the same
tokens differently: response polarity (reward >= CORRECT_THRESHOLD, the `accuracy` metric's
threshold) x token entropy at or above the mean entropy of the group's valid tokens:
PHR (positive, high), PLR (positive, low), NLR (negative, low), NHR (negative, high). Reported as

    pe_quad_<q>_frac = |q| / N_valid
    pe_quad_<q>_mass = sum_{t in q} |A_t w_t| / sum_{t valid} |A_t w_t|

where A_t w_t is the token's coefficient in the surrogate at ratio 1 (its share of the summed
|advantage-weighted surrogate|; A the method's per-token advantage, w the token weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stare_jax.config import QUADRANT_NAMES as PE_QUADRANTS
from stare_jax.rl.advantages import group_token_stats

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")
CORRECT_THRESHOLD = 0.5  # a response is positive (correct) when its reward is >= this, as in `accuracy`


def predicted_entropy_change(log_probs, entropy, pi2_dev, advantages, weights) -> jax.Array:
    """Per-token first-order entropy change per unit step: A w [pi_k (s_k - H) - sum_j pi_j^2 (s_j - H)]."""
    lp = jnp.asarray(log_probs, jnp.float32)
    s = -lp
    bracket = jnp.exp(lp) * (s - entropy) - pi2_dev
    return jnp.asarray(advantages, jnp.float32) * jnp.asarray(weights, jnp.float32) * bracket


def quadrant_masks(log_probs, entropy, advantages, mask) -> dict[str, jax.Array]:
    """Boolean masks of the four quadrants (valid tokens only; A = 0 in none)."""
    valid = jnp.asarray(mask) > 0
    adv = jnp.asarray(advantages, jnp.float32)
    high = -jnp.asarray(log_probs, jnp.float32) > entropy
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    return {"pos_high": pos & high, "pos_low": pos & ~high, "neg_high": neg & high, "neg_low": neg & ~high}


def quadrant_diagnostics(log_probs, entropy, pi2_dev, advantages, weights, mask) -> dict[str, jax.Array]:
    """Metrics `quad_<q>_frac`, `quad_<q>_dH` for the four quadrants and `quad_total_dH` (float32 scalars).

    All arguments [B, T] (stop-gradient); see the module docstring for the definitions.
    """
    sg = jax.lax.stop_gradient
    log_probs, entropy, pi2_dev = sg(log_probs), sg(entropy), sg(pi2_dev)
    adv = jnp.broadcast_to(jnp.asarray(advantages, jnp.float32), log_probs.shape)
    dh = predicted_entropy_change(log_probs, entropy, pi2_dev, adv, weights)
    count = jnp.maximum((jnp.asarray(mask) > 0).sum(), 1).astype(jnp.float32)
    out = {}
    total = jnp.float32(0.0)
    for name, q in quadrant_masks(log_probs, entropy, adv, mask).items():
        out[f"quad_{name}_frac"] = q.sum().astype(jnp.float32) / count
        dh_q = jnp.sum(jnp.where(q, dh, 0.0)) / count
        out[f"quad_{name}_dH"] = dh_q
        total = total + dh_q
    out["quad_total_dH"] = total
    return out


def polarity_entropy_quadrants(rewards, entropy, mask, *, group_size: int,
                               correct_threshold: float = CORRECT_THRESHOLD) -> dict[str, jax.Array]:
    """Boolean [B, T] masks "PHR", "PLR", "NLR", "NHR" partitioning the valid tokens (contract 11).

    Positive: the response's reward ([B]) >= `correct_threshold`; high: H >= mu_H, the mean entropy
    over the valid tokens of the response's group (rows ordered group by group). Source: arXiv
    2604.11056, Four Quadrant Decomposition.
    """
    valid = jnp.asarray(mask) > 0
    ent = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32)), 0.0)
    mu, _ = group_token_stats(ent, valid, group_size)
    high = ent >= mu
    pos = (jnp.asarray(rewards, jnp.float32) >= correct_threshold)[:, None]
    neg = ~pos
    return {"PHR": valid & pos & high, "PLR": valid & pos & ~high, "NLR": valid & neg & ~high,
            "NHR": valid & neg & high}


def polarity_entropy_diagnostics(quadrants: dict, advantages, weights, mask) -> dict[str, jax.Array]:
    """Metrics `pe_quad_<q>_frac` and `pe_quad_<q>_mass` (q in phr, plr, nlr, nhr; float32 scalars).

    `quadrants` from `polarity_entropy_quadrants`; `advantages` and `weights` [B, T] are the
    method's per-token advantage and token weight (definitions in the module docstring; 0 when
    there is no valid token or no advantage mass).
    """
    sg = jax.lax.stop_gradient
    valid = jnp.asarray(mask) > 0
    count = jnp.maximum(valid.sum(), 1).astype(jnp.float32)
    adv = jnp.broadcast_to(sg(jnp.asarray(advantages, jnp.float32)), valid.shape)
    mass = jnp.where(valid, jnp.abs(adv * sg(jnp.asarray(weights, jnp.float32))), 0.0)
    total = mass.sum()
    total = jnp.where(total > 0, total, 1.0)
    out = {}
    for name in PE_QUADRANTS:
        q = quadrants[name]
        out[f"pe_quad_{name.lower()}_frac"] = q.sum().astype(jnp.float32) / count
        out[f"pe_quad_{name.lower()}_mass"] = jnp.sum(jnp.where(q, mass, 0.0)) / total
    return out
