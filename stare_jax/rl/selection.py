"""Exact, jit-friendly token selection with a data-dependent count.

Every token-selection rule of the RL core (STARE's L+/L-, the forking-token mask, Clip-Cov's random
subset, KL-Cov's top covariance) is "the k highest-scoring members of a set", with k computed from
the set's size. Here k is a traced integer, so selection is done by ranking (one stable sort)
instead of `lax.top_k`, which needs a static k:

    rank_i = position of token i when members are ordered by score, descending, ties by index
    selected_i = member_i and rank_i < k

Counts use exact integer arithmetic when the ratio is a simple fraction (0.1 = 1/10, 2e-4 =
1/5000, ...), so `ceil(0.1 * 1_500_000 - 1e-6)` is 150000 as in float64 Python, not 150001 as a
float32 product would give.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

_MAX_DENOMINATOR = 10_000


def _as_fraction(ratio: float) -> Fraction | None:
    """`ratio` as a/b with b <= 10^4 when that is exact to 1e-12, else None."""
    frac = Fraction(float(ratio)).limit_denominator(_MAX_DENOMINATOR)
    return frac if abs(float(frac) - float(ratio)) < 1e-12 else None


def ceil_count(ratio: float, n: jax.Array) -> jax.Array:
    """ceil(ratio * n - 1e-6) for an int32 count n (the reference's rounding).

    Exact for ratios a/b with b <= 10^4: there ceil(a n / b - 1e-6) = ceil(a n / b) because the
    fractional part of a n / b is either 0 or at least 1e-4. Other ratios use float32.
    """
    n = jnp.asarray(n, jnp.int32)
    frac = _as_fraction(ratio)
    if frac is None:
        return jnp.ceil(jnp.float32(ratio) * n.astype(jnp.float32) - 1e-6).astype(jnp.int32)
    a, b = frac.numerator, frac.denominator
    # a*n/b = a*(n//b) + a*(n%b)/b; each product stays far below 2^31.
    q, r = n // b, n % b
    return a * q + (a * r + b - 1) // b


def floor_count(ratio: float, n: jax.Array) -> jax.Array:
    """int(ratio * n) (floor, as Python's int() of a positive float) for an int32 count n."""
    n = jnp.asarray(n, jnp.int32)
    frac = _as_fraction(ratio)
    if frac is None:
        return jnp.floor(jnp.float32(ratio) * n.astype(jnp.float32)).astype(jnp.int32)
    a, b = frac.numerator, frac.denominator
    q, r = n // b, n % b
    return a * q + (a * r) // b


def descending_rank(scores: jax.Array, member: jax.Array) -> jax.Array:
    """Rank of each element along the last axis: members first, by score descending, ties by index.

    Non-members rank after every member. Batched over leading axes (one ranking per row).
    """
    shape = scores.shape
    iota = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    not_member = jnp.logical_not(member).astype(jnp.int32)
    neg = -scores.astype(jnp.float32)
    # Lexicographic sort by (non-member, -score); stability breaks remaining ties by index.
    _, _, order = jax.lax.sort((not_member, neg, iota), dimension=len(shape) - 1, num_keys=2, is_stable=True)
    # Inverse permutation: sorting the iota by `order` gives, for each element, its rank.
    _, rank = jax.lax.sort((order, iota), dimension=len(shape) - 1, num_keys=1, is_stable=True)
    return rank


def select_top_k(scores: jax.Array, member: jax.Array, k: jax.Array, *, num_groups: int = 1) -> jax.Array:
    """Boolean mask of the k highest-scoring members (ties by lower flat index), per group.

    `scores`, `member`: any shape; the flattened (row-major) array is split into `num_groups`
    contiguous equal groups and `k` (scalar or [num_groups]) members are selected in each.
    """
    shape = scores.shape
    flat_scores = scores.reshape(num_groups, -1)
    flat_member = member.reshape(num_groups, -1).astype(bool)
    rank = descending_rank(flat_scores, flat_member)
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), (num_groups,))
    return (flat_member & (rank < k[:, None])).reshape(shape)


def select_top_fraction(scores: jax.Array, member: jax.Array, ratio: float, *, num_groups: int = 1) -> jax.Array:
    """The top k = max(1, ceil(ratio * |members| - 1e-6)) members by score (none if the set is empty).

    Selection is per group of the flattened array (see `select_top_k`).
    """
    count = member.reshape(num_groups, -1).astype(jnp.int32).sum(axis=1)
    k = jnp.where(count > 0, jnp.maximum(1, ceil_count(ratio, count)), 0)
    return select_top_k(scores, member, k, num_groups=num_groups)
