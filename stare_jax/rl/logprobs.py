"""Token log-probs and entropy from hidden states, chunked over the vocabulary.

Never materialises logits [N, T, V]: a `lax.scan` walks the [D, V] output matrix in chunks of C
columns, computes the chunk's logits z = h W_c / temperature (float32 accumulation) and folds them
into running per-position statistics with an online log-sum-exp (running max m, all sums shifted
by m):

    se  = sum_j e^{z_j - m}                     logZ = m + log se
    sz  = sum_j e^{z_j - m} (z_j - m)           H    = log se - sz / se
    z_k = logit of the target token             log pi_k = z_k - logZ

and, without gradient, the diagnostics quantity Q = sum_j pi_j^2 (s_j - H) with s_j = -log pi_j:

    S2  = sum_j e^{2(z_j - m)},  S2z = sum_j e^{2(z_j - m)} (z_j - m)
    Q   = (S2 / se^2)(sz / se) - S2z / se^2

When m grows to m', old sums are rescaled by a = e^{m - m'} (a^2 for the squared sums) and the
shifted first moments pick up (m - m') times the matching zeroth moment. Each chunk is read once
for its max and then for its sums: in one variadic reduce on an accelerator, one pass a sum on the
CPU, whose multi-output reductions are not vectorised (`_moments`).

The backward pass is written by hand (`_stats_bwd`): it walks the chunks again, recomputes a chunk's
logits, forms dL/dz from the closed forms of d log pi_k / dz and dH / dz in one elementwise pass, and
multiplies it into dh and dW_c. Only per-position statistics are kept between the passes, so the
extra memory is O(N T C), not O(N T V), and nothing is differentiated through the scan's carries. A
vocabulary of at most C columns is one chunk, computed without a loop; its logits are kept for the
backward pass instead of being recomputed. With `keep_logits_mb` every chunk's logits are kept too
when they fit that bound (O(N T V) float32 memory for one [N T, D] x [D, V] product fewer: the
backward reads them instead of recomputing them; the same products, so the same gradients to
float32 rounding: XLA may fuse the forward's and the backward's product differently).

A vocabulary that C does not divide is handled without padding the matrix: the last chunk starts at
V - C and ignores the columns an earlier chunk already covered.

On a data-parallel mesh each device holds its own rows of h, so dW_c = h^T dz is a sum over devices.
Accumulated in a replicated [D, V] carry, that sum is an all-reduce inside every trip of the
backward loop. With `partials` (the sharding of a leading device axis, from
`parallel.partial_sum_sharding`) each device adds its rows' h_s^T dz_s into its own slice of a
[S, D, V] carry instead, and the S partial sums are reduced once after the loop: one collective per
backward pass, none inside the loop, the same sums.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from stare_jax.models.products import dot_nt, dot_tn

_NEG = -1e30  # finite "minus infinity": keeps every shifted product finite


class TokenStats(NamedTuple):
    """Per-position results [N, T] (float32): target log-prob, entropy and (optionally) Q."""

    log_probs: jax.Array
    entropy: jax.Array
    pi2_dev: Optional[jax.Array] = None


def token_stats(hidden: jax.Array, w_out: jax.Array, targets: jax.Array, *, chunk_size: int = 8192,
                temperature: float = 1.0, compute_dtype=None, with_pi2: bool = False,
                partials: NamedSharding | None = None, keep_logits_mb: float = 0,
                row_shards: int = 1) -> TokenStats:
    """log pi(targets), entropy H and optionally Q = sum_j pi_j^2 (s_j - H), all [N, T] float32.

    hidden [N, T, D] (final-norm hidden states), w_out [D, V], targets [N, T] int. The logits are
    (hidden @ w_out) / temperature computed in `compute_dtype` (default: hidden's dtype) with
    float32 accumulation, `chunk_size` vocabulary columns at a time. `log_probs` and `entropy` are
    differentiable w.r.t. hidden and w_out (by the hand-written backward, see `_stats_bwd`); Q is not.
    `partials` (`parallel.partial_sum_sharding`): accumulate dW as one partial sum per data-parallel
    device, reduced once after the backward loop (hidden's leading axis split over those devices).
    `keep_logits_mb`: keep every chunk's float32 logits for the backward pass instead of recomputing
    them there (one [N T, D] x [D, V] product fewer) when they take at most this many MiB a device
    (`kept_logits_mib`); 0 never keeps them. `row_shards`: the devices hidden's rows are split over
    (`parallel.batch_divisor` of the mesh: data x fsdp), which divide what a device keeps.
    """
    V = w_out.shape[1]
    C = int(min(chunk_size, V))
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else jnp.dtype(hidden.dtype)
    keep = C < V and 0 < kept_logits_mib(hidden.shape[0], hidden.shape[1], V, C, row_shards) <= keep_logits_mb
    spec = _Spec(chunk=C, inv_temp=1.0 / float(temperature), dtype=dtype.name,
                 with_pi2=bool(with_pi2), partials=partials, keep_logits=keep)
    log_probs, entropy, pi2_dev = _token_stats(spec, hidden, w_out, targets.astype(jnp.int32))
    return TokenStats(log_probs=log_probs, entropy=entropy, pi2_dev=pi2_dev if with_pi2 else None)


def kept_logits_mib(n: int, t: int, vocab: int, chunk: int, row_shards: int = 1) -> float:
    """MiB a device holds when `token_stats` keeps the logits of hidden [n, t, D]: n t ceil(V/C) C
    float32 values, over the `row_shards` devices that split the n rows (data x fsdp of the mesh)
    when they split them evenly."""
    shards = int(row_shards) if int(row_shards) > 0 and n % int(row_shards) == 0 else 1
    return n * t * (-(-vocab // chunk) * chunk) * 4 / shards / 2**20


class _Spec(NamedTuple):
    """The static part of a `token_stats` call (hashable)."""

    chunk: int
    inv_temp: float
    dtype: str
    with_pi2: bool
    partials: Optional[NamedSharding] = None
    keep_logits: bool = False


def _logits(spec: _Spec, h2: jax.Array, w_c: jax.Array) -> jax.Array:
    """z = (h2 @ w_c) / temperature: [M, D] x [D, C] (h2 already in the compute dtype), float32 result."""
    z = jnp.dot(h2, w_c.astype(spec.dtype), preferred_element_type=jnp.float32)
    return z * spec.inv_temp if spec.inv_temp != 1.0 else z


def _chunk(w: jax.Array, c: jax.Array, C: int):
    """Chunk c of the [D, V] matrix: (its columns [D, C], their ids [C], and a mask [C] of the ids no
    earlier chunk covered, or None when C divides V). The last chunk starts at V - C, not past V."""
    V = w.shape[1]
    start = jnp.minimum(c * C, V - C)
    col = start + jnp.arange(C, dtype=jnp.int32)
    return jax.lax.dynamic_slice_in_dim(w, start, C, axis=1), col, (col >= c * C if V % C else None)


def _moment_terms(with_pi2: bool) -> tuple:
    """The summed terms of `_moments` as functions of (e, d): e, e d and, with pi2, e^2 and e^2 d."""
    first = (lambda e, d: e, lambda e, d: e * d)
    return first + ((lambda e, d: e * e, lambda e, d: e * e * d) if with_pi2 else ())


def _moments_one_reduce(z: jax.Array, m: jax.Array, with_pi2: bool) -> tuple:
    """`_moments` as one variadic reduce: z is read once."""
    terms = _moment_terms(with_pi2)
    d = z - m[:, None]
    e = jnp.exp(d)
    zero = jnp.float32(0)
    return jax.lax.reduce(tuple(t(e, d) for t in terms), (zero,) * len(terms),
                          lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))


def _moments_separate(z: jax.Array, m: jax.Array, with_pi2: bool) -> tuple:
    """`_moments` as one single-output reduce per sum, each re-reading z and recomputing e; an
    optimisation barrier ties each pass to the previous sum, so XLA cannot merge the sibling
    reductions back into one multi-output fusion."""
    sums = []
    for term in _moment_terms(with_pi2):
        if sums:
            z, m, _ = jax.lax.optimization_barrier((z, m, sums[-1]))
        d = z - m[:, None]
        sums.append(jnp.sum(term(jnp.exp(d), d), axis=1))
    return tuple(sums)


def _moments(z: jax.Array, m: jax.Array, with_pi2: bool) -> tuple:
    """Sums over a chunk's logits z [M, C] shifted by m [M], each [M]: of e = e^{z-m}, e (z-m) and,
    with pi2, e^2 and e^2 (z-m).

    On an accelerator one variadic reduce reads z once (`_moments_one_reduce`). XLA:CPU does not
    vectorise a multi-output reduce: in the real-model update on an AMD EPYC (Zen 4; 48 chunks of
    [6,144, 1,024] a device) the four sums took 1.72 s a device that way against 0.83 s as four
    separate passes (`_moments_separate`), so the CPU takes those. The two forms add the same
    terms in different orders (float32 rounding)."""
    return jax.lax.platform_dependent(z, m, cpu=functools.partial(_moments_separate, with_pi2=with_pi2),
                                      default=functools.partial(_moments_one_reduce, with_pi2=with_pi2))


def _forward(spec: _Spec, h2: jax.Array, w: jax.Array, targets: jax.Array):
    """Row statistics (m, se, sz, zk, s2, s2z) [M] of all V logits, and the logits themselves when
    the vocabulary is one chunk ([M, V]) or `spec.keep_logits` ([chunks, M, C], the columns an
    earlier chunk covered set to a large negative number); else None."""
    M, V, C = h2.shape[0], w.shape[1], spec.chunk
    zeros = jnp.zeros((M,), jnp.float32)
    if C == V:
        z = _logits(spec, h2, w)
        m = jnp.max(z, axis=1)
        sums = _moments(z, m, spec.with_pi2)
        zk = jnp.take_along_axis(z, targets[:, None], axis=1)[:, 0]
        s2, s2z = sums[2:] if spec.with_pi2 else (zeros, zeros)
        return (m, sums[0], sums[1], zk, s2, s2z), z

    def body(carry, c):
        m, se, sz, zk, s2, s2z = carry
        w_c, col, fresh = _chunk(w, c, C)
        z = _logits(spec, h2, w_c)
        hit = col == targets[:, None]
        if fresh is not None:  # drop the columns an earlier chunk covered
            z, hit = jnp.where(fresh, z, _NEG), hit & fresh
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        shift = m - m_new
        a = jnp.exp(shift)
        sums = _moments(z, m_new, spec.with_pi2)
        se_new = a * se + sums[0]
        sz_new = a * (sz + shift * se) + sums[1]
        zk_new = zk + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        if spec.with_pi2:
            a2 = a * a
            s2, s2z = a2 * s2 + sums[2], a2 * (s2z + shift * s2) + sums[3]
        return (m_new, se_new, sz_new, zk_new, s2, s2z), (z if spec.keep_logits else None)

    init = (jnp.full((M,), _NEG, jnp.float32), zeros, zeros, zeros, zeros, zeros)
    stats, kept = jax.lax.scan(body, init, jnp.arange(-(-V // C), dtype=jnp.int32))
    return stats, kept


def _finish(spec: _Spec, stats) -> tuple:
    """(log pi_k, H, Q, log Z) from the row statistics."""
    m, se, sz, zk, s2, s2z = stats
    log_se = jnp.log(se)
    mean_shifted = sz / se  # sum_j pi_j (z_j - m)
    log_probs = zk - m - log_se
    entropy = log_se - mean_shifted
    inv_se2 = 1.0 / (se * se)
    pi2_dev = s2 * inv_se2 * mean_shifted - s2z * inv_se2 if spec.with_pi2 else jnp.zeros_like(m)
    return log_probs, entropy, pi2_dev, m + log_se


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _token_stats(spec: _Spec, hidden, w_out, targets):
    """(log pi_k, H, Q) [N, T] of `token_stats`. Without a backward pass (the reference model, the
    pre-update statistics, evaluation) kept logits would be an unused scan output, which JAX drops
    when it traces: nothing is held, whatever the bound."""
    return _token_stats_fwd(spec, hidden, w_out, targets)[0]


def _token_stats_fwd(spec: _Spec, hidden, w_out, targets):
    N, T, D = hidden.shape
    h2 = hidden.reshape(N * T, D).astype(spec.dtype)
    stats, logits = _forward(spec, h2, w_out, targets.reshape(N * T))
    log_probs, entropy, pi2_dev, log_z = _finish(spec, stats)
    out = tuple(x.reshape(N, T) for x in (log_probs, entropy, pi2_dev))
    return out, (hidden, w_out, targets, log_z, entropy, logits)


def _stats_bwd(spec: _Spec, residuals, cotangents):
    """Gradients of log pi_k and H through the logits z_j, chunk by chunk, with p_j = e^{z_j - log Z}:

        d log pi_k / d z_j = [j = k] - p_j        d H / d z_j = -p_j (log p_j + H)

    so dz_j = [j = k] g_lp - p_j (g_lp + g_H (log p_j + H)), scaled by 1/temperature; then
    dh = dz W_c^T and dW_c = h^T dz. A one-chunk vocabulary, or `spec.keep_logits`, reuses the
    forward's logits; otherwise each chunk's logits are recomputed (the forward kept only [M] row
    statistics). Q has no gradient.
    """
    hidden, w_out, targets, log_z, entropy, logits = residuals
    g_lp, g_h, _ = cotangents
    N, T, D = hidden.shape
    M, V, C = N * T, w_out.shape[1], spec.chunk
    h2 = hidden.reshape(M, D).astype(spec.dtype)
    tgt = targets.reshape(M, 1)
    g_lp, g_h, log_z, ent = (x.reshape(M, 1).astype(jnp.float32) for x in (g_lp, g_h, log_z, entropy))

    def dlogits(z, col):
        logp = z - log_z
        p = jnp.exp(logp)
        dz = jnp.where(col == tgt, g_lp, 0.0) - p * (g_lp + g_h * (logp + ent))
        return dz * spec.inv_temp if spec.inv_temp != 1.0 else dz

    def grads(dz, w_c, h=h2):
        """(dh, dW_c) = (dz W_c^T, h^T dz); with h [S, M/S, D] blocks, dW_c is [S, D, C]: one
        partial sum per block."""
        dz = dz.astype(spec.dtype)
        dh = dot_nt(dz, w_c.astype(spec.dtype), jnp.float32)
        if h.ndim == 3:
            return dh, dot_tn(h, dz.reshape(h.shape[:2] + dz.shape[1:]))
        return dh, dot_tn(h, dz)

    if C == V:
        dh, dw = grads(dlogits(logits, jnp.arange(V, dtype=jnp.int32)[None]), w_out)
    else:
        S = 1 if spec.partials is None else int(spec.partials.mesh.shape["data"])
        S = S if N % S == 0 else 1
        if S > 1:  # per-device partial sums of dW: [S, D, V], split over the devices (module doc)
            pin = lambda x: jax.lax.with_sharding_constraint(x, spec.partials)  # noqa: E731
            h_blocks = pin(h2.reshape(S, M // S, D))
        else:
            pin, h_blocks = (lambda x: x), h2

        def body(carry, xs):
            dh, dw = carry
            c, z = xs
            w_c, col, fresh = _chunk(w_out, c, C)
            dz = dlogits(_logits(spec, h2, w_c) if z is None else z, col[None])
            if fresh is not None:
                dz = jnp.where(fresh[None], dz, 0.0)
            dh_c, dw_c = grads(dz, w_c, h_blocks)
            start, axis = col[0], dw.ndim - 1
            dw = jax.lax.dynamic_update_slice_in_dim(
                dw, jax.lax.dynamic_slice_in_dim(dw, start, C, axis) + dw_c, start, axis=axis)
            return (dh + dh_c, pin(dw)), None

        dw0 = pin(jnp.zeros(((S,) if S > 1 else ()) + (D, V), jnp.float32))
        (dh, dw), _ = jax.lax.scan(body, (jnp.zeros((M, D), jnp.float32), dw0),
                                   (jnp.arange(-(-V // C), dtype=jnp.int32), logits))
        if S > 1:
            dw = jnp.sum(dw, axis=0)  # the one cross-device reduction
    return dh.reshape(hidden.shape).astype(hidden.dtype), dw.astype(w_out.dtype), None


_token_stats.defvjp(_token_stats_fwd, _stats_bwd)


def naive_token_stats(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> TokenStats:
    """log pi(targets), H and Q = sum_j pi_j^2 (s_j - H) from full logits [..., V] (float32): the
    reference of the chunked pass in tests, and the sampler's per-step statistics over the [rows, V]
    logits it holds anyway (`rollout.generate(token_stats=True)`). Materialises the whole
    distribution, so never for an update's [N, T, V]."""
    z = logits.astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(p * logp, axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    s = -logp
    pi2_dev = jnp.sum(p * p * (s - entropy[..., None]), axis=-1)
    return TokenStats(log_probs=lp, entropy=entropy, pi2_dev=pi2_dev)
