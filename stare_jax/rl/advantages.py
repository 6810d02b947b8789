"""Group-relative advantages (contract 2 of DESIGN.md).

Rewards arrive ordered group by group: response i of prompt g sits at index g * G + i.

    scale="group":  A_i = (r_i - mean_g) / (std_g + eps)   (std with ddof=1; GRPO)
    scale="none":   A_i = r_i - mean_g                      (Dr.GRPO)

A group of size 1 has no spread; as in verl it gets mean 0 and std 1.

A group with no reward spread (all rewards bit-identical, e.g. sixteen 0.7s) gets A = 0 exactly:
float32 rounding of its mean would otherwise leave tiny residuals r - mean that the division by
std + eps blows up (0.7 - mean(0.7, ...) is not 0 in float32), and those tokens would enter T+/T-.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _group_scale(r: jax.Array, centred: jax.Array, eps: float) -> jax.Array:
    """(r - mean) / (std_ddof1 + eps) per group (rows of r)."""
    std = jnp.std(r, axis=1, ddof=1, keepdims=True)
    return centred / (std + eps)


def _no_scale(r: jax.Array, centred: jax.Array, eps: float) -> jax.Array:
    """r - mean (Dr.GRPO, arXiv 2503.20783)."""
    return centred


ADVANTAGE_SCALES: dict[str, Callable[[jax.Array, jax.Array, float], jax.Array]] = {
    "group": _group_scale,
    "none": _no_scale,
}


def group_advantages(rewards: jax.Array, group_size: int, *, scale: str = "group", eps: float = 1e-6) -> jax.Array:
    """Per-response advantages [N] from rewards [N] (N = prompts * group_size, group by group).

    A_i = (r_i - mean_g) / (std_g + eps) with ddof=1 (`scale="group"`) or A_i = r_i - mean_g
    (`scale="none"`), float32. A group whose rewards are all equal gets exactly 0.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage.scale must be one of {sorted(ADVANTAGE_SCALES)}, got {scale!r}")
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards must be [N] with N divisible by group_size={group_size}, got {r.shape}")
    r = r.reshape(-1, group_size)
    if group_size == 1:
        return (r / (1.0 + eps) if scale == "group" else r).reshape(-1)
    spread = jnp.max(r, axis=1, keepdims=True) > jnp.min(r, axis=1, keepdims=True)
    centred = jnp.where(spread, r - jnp.mean(r, axis=1, keepdims=True), 0.0)
    return jnp.where(spread, ADVANTAGE_SCALES[scale](r, centred, eps), 0.0).reshape(-1)


# ----------------------------------------------------------------------------- per-token advantage rules
# Arrays [B, T] over response tokens, rows ordered group by group (B = groups x group_size). Each
# rule reads its inputs through stop_gradient: an advantage only scales the log-prob gradient.

def group_token_stats(x: jax.Array, mask: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """Per row [B, 1]: mean and population std (ddof 0) of `x` over the valid tokens of the row's group.

    A group with no valid token gets mean 0 and std 0.
    """
    x = jnp.asarray(x, jnp.float32)
    B, T = x.shape
    if B % group_size:
        raise ValueError(f"{B} rows are not whole groups of group_size={group_size}")
    valid = (jnp.asarray(mask) > 0).reshape(B // group_size, group_size * T)
    g = jnp.where(valid, x.reshape(B // group_size, group_size * T), 0.0)
    count = jnp.maximum(valid.sum(axis=1, keepdims=True), 1).astype(jnp.float32)
    mean = g.sum(axis=1, keepdims=True) / count
    var = jnp.sum(jnp.where(valid, jnp.square(g - mean), 0.0), axis=1, keepdims=True) / count
    rows = lambda s: jnp.repeat(s, group_size, axis=0, total_repeat_length=B)  # noqa: E731
    return rows(mean), rows(jnp.sqrt(var))


def _per_token(advantages, like: jax.Array) -> jax.Array:
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.broadcast_to(adv, like.shape)


def hapo_token_advantages(advantages, entropy, mask, *, group_size: int, alpha: float = 0.2, phi: float = 2.0,
                          eps: float = 1e-6) -> jax.Array:
    """HAPO / EAPO credit-assigned advantage [B, T] (contract 10 of DESIGN.md).

    "Rethinking Token-Level Credit Assignment in RLVR: A Polarity-Entropy Analysis" (arXiv 2604.11056,
    v1 section 5 "EAPO", v2 "HAPO"): with A the response's GRPO advantage and H the pre-update
    token entropy,

        z    = (H - mu_H) / (sigma_H + eps)       mu_H, sigma_H (ddof 0) over the group's valid tokens
        A_H  = clip(z, -|A| / phi, +|A| / phi)
        A_CA = A + alpha * sign(A) * stop_gradient(A_H)

    Sign-preserving (|alpha A_H| <= alpha |A| / phi < |A| for alpha < phi); A = 0 stays 0; invalid
    tokens get 0. `advantages` is per token [B, T] or per response [B].
    """
    sg = jax.lax.stop_gradient
    valid = jnp.asarray(mask) > 0
    ent = jnp.where(valid, sg(jnp.asarray(entropy, jnp.float32)), 0.0)
    adv = jnp.where(valid, sg(_per_token(advantages, ent)), 0.0)
    mu, sigma = group_token_stats(ent, valid, group_size)
    z = (ent - mu) / (sigma + eps)
    bound = jnp.abs(adv) / phi
    a_h = jnp.clip(z, -bound, bound)
    return jnp.where(valid, adv + alpha * jnp.sign(adv) * a_h, 0.0)


def entropy_token_advantages(advantages, entropy, mask, *, alpha: float = 0.4, kappa: float = 2.0) -> jax.Array:
    """EntroAdv advantage [B, T]: A + min(alpha * stop_gradient(H), |A| / kappa); 0 on invalid tokens.

    Cheng et al. 2025, "Reasoning with Exploration: An Entropy Perspective" (arXiv 2506.14758),
    the entropy-based advantage term psi(H) = min(alpha H_detached, |A| / kappa) added to the
    GRPO/PPO advantage. The clip keeps the term below |A| / kappa, so for kappa > 1 it never flips
    the sign of a negative advantage; A = 0 stays 0 (H >= 0).
    """
    sg = jax.lax.stop_gradient
    valid = jnp.asarray(mask) > 0
    ent = jnp.where(valid, sg(jnp.asarray(entropy, jnp.float32)), 0.0)
    adv = jnp.where(valid, sg(_per_token(advantages, ent)), 0.0)
    return jnp.where(valid, adv + jnp.minimum(alpha * ent, jnp.abs(adv) / kappa), 0.0)


def w_reinforce_token_advantages(rewards, mask, *, lam: float = 0.1, correct_threshold: float = 0.5) -> jax.Array:
    """W-REINFORCE advantage [B, T]: +lambda on the tokens of correct responses (reward >=
    `correct_threshold`), -1 on those of incorrect ones, 0 on invalid tokens.

    Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"
    (arXiv 2506.01347): L = lambda L_PSR + L_NSR with REINFORCE on +-1 rewards (no group baseline),
    lambda = 0.1; their code (RLVR-Decomposed, `compute_psr_nsr_outcome_advantage`,
    advantage="weighted") sets the advantage to lambda * 1 for correct and 0 - 1 for incorrect
    responses.
    """
    valid = jnp.asarray(mask) > 0
    correct = (jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32)) >= correct_threshold)[:, None]
    return jnp.where(valid, jnp.where(correct, jnp.float32(lam), jnp.float32(-1.0)), 0.0)
