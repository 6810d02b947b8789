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
