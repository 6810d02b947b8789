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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


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
