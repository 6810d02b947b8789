"""Exact, jit-friendly token selection with a data-dependent count.

Every token-selection rule of the RL core (STARE's L+/L-, the forking-token mask, Clip-Cov's random
subset, KL-Cov's top covariance) is "the k highest-scoring members of a set", with k computed from
the set's size. Here k is a traced integer, so `lax.top_k` (static k) does not apply; selection finds
the k-th largest member score t by bisection on the float32 bit pattern and keeps

    selected_i = member_i and (score_i > t, or score_i == t and i is among the first
                 k - |{members: score > t}| members scoring t by index)

which is the ordering "score descending, ties by index" without a sort. On a mesh the scores are
gathered whole onto every device before the bisection (`parallel.replicated_in_trace`), so its loop
holds no collective: on a CPU host split into several devices, collectives inside loops are what
the rare ordering deadlock of docs/performance.md needs.

Counts use exact integer arithmetic when the ratio is a simple fraction (0.1 = 1/10, 2e-4 =
1/5000, ...), so `ceil(0.1 * 1_500_000 - 1e-6)` is 150000 as in float64 Python, not 150001 as a
float32 product would give.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from stare_jax import parallel

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


def _order_key(scores: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 scores (-0.0 below +0.0): the sign bit flipped for
    non-negative numbers, all bits flipped for negative ones."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def select_top_k(scores: jax.Array, member: jax.Array, k: jax.Array, *, num_groups: int = 1) -> jax.Array:
    """Boolean mask of the k highest-scoring members (ties by lower flat index), per group.

    `scores`, `member`: any shape; the flattened (row-major) array is split into `num_groups`
    contiguous equal groups and `k` (scalar or [num_groups]) members are selected in each.

    Without sorting: the k-th largest member key t is found bit by bit from the top (32 counting
    passes, t = the largest value with |{members: key >= t}| >= k); every member above t is selected,
    and of the members equal to t the first k - |{key > t}| by index.
    """
    shape = scores.shape
    # Whole on every device of the trace's mesh: the 32 counting passes below then sum locally,
    # with no collective inside the loop (parallel.replicated_in_trace).
    key = parallel.replicated_in_trace(_order_key(scores.reshape(num_groups, -1)))
    member = parallel.replicated_in_trace(member.reshape(num_groups, -1).astype(bool))
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), (num_groups,))[:, None]

    def refine(bit, t):
        candidate = t | (jnp.uint32(1) << (31 - bit).astype(jnp.uint32))
        enough = jnp.sum(member & (key >= candidate), axis=1, keepdims=True, dtype=jnp.int32) >= k
        return jnp.where(enough, candidate, t)

    t = jax.lax.fori_loop(0, 32, refine, jnp.zeros((num_groups, 1), jnp.uint32))
    above = member & (key > t)
    tie = member & (key == t)
    room = k - jnp.sum(above, axis=1, keepdims=True, dtype=jnp.int32)
    selected = above | (tie & (jnp.cumsum(tie, axis=1, dtype=jnp.int32) <= room))
    return (selected & (k > 0)).reshape(shape)


def select_top_fraction(scores: jax.Array, member: jax.Array, ratio: float, *, num_groups: int = 1) -> jax.Array:
    """The top k = max(1, ceil(ratio * |members| - 1e-6)) members by score (none if the set is empty).

    Selection is per group of the flattened array (see `select_top_k`).
    """
    count = member.reshape(num_groups, -1).astype(jnp.int32).sum(axis=1)
    k = jnp.where(count > 0, jnp.maximum(1, ceil_count(ratio, count)), 0)
    return select_top_k(scores, member, k, num_groups=num_groups)
