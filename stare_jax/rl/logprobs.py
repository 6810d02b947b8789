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
shifted first moments pick up (m - m') times the matching zeroth moment. The chunk body is wrapped
in `jax.checkpoint`, so reverse-mode autodiff saves only the per-position carries and recomputes a
chunk's logits in the backward pass: peak extra memory is O(N T C), not O(N T V). A vocabulary of
at most C columns is one chunk, computed without the loop and without recomputation. The running max
carries no gradient (the result is shift-invariant).

A vocabulary that C does not divide is handled without padding the matrix: the last chunk starts at
V - C and ignores the columns an earlier chunk already covered.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": keeps every shifted product finite


class TokenStats(NamedTuple):
    """Per-position results [N, T] (float32): target log-prob, entropy and (optionally) Q."""

    log_probs: jax.Array
    entropy: jax.Array
    pi2_dev: Optional[jax.Array] = None


def token_stats(hidden: jax.Array, w_out: jax.Array, targets: jax.Array, *, chunk_size: int = 8192,
                temperature: float = 1.0, compute_dtype=None, with_pi2: bool = False) -> TokenStats:
    """log pi(targets), entropy H and optionally Q = sum_j pi_j^2 (s_j - H), all [N, T] float32.

    hidden [N, T, D] (final-norm hidden states), w_out [D, V], targets [N, T] int. The logits are
    (hidden @ w_out) / temperature computed in `compute_dtype` (default: hidden's dtype) with
    float32 accumulation, `chunk_size` vocabulary columns at a time. `log_probs` and `entropy` are
    differentiable w.r.t. hidden and w_out; Q is not.
    """
    N, T, D = hidden.shape
    V = w_out.shape[1]
    C = int(min(chunk_size, V))
    num_chunks = -(-V // C)
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else hidden.dtype
    h = hidden.astype(dtype)
    w = w_out.astype(dtype)
    targets = targets.astype(jnp.int32)
    inv_temp = 1.0 / float(temperature)

    def body(carry, c):
        m, se, sz, zk, s2, s2z = carry
        chunk_start = c * C
        start = jnp.minimum(chunk_start, V - C)
        w_c = jax.lax.dynamic_slice_in_dim(w, start, C, axis=1)
        z = jnp.einsum("ntd,dc->ntc", h, w_c, preferred_element_type=jnp.float32)
        if inv_temp != 1.0:
            z = z * inv_temp
        col = start + jnp.arange(C, dtype=jnp.int32)
        fresh = col >= chunk_start  # columns not already folded in by an earlier chunk
        z = jnp.where(fresh, z, _NEG)
        m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(z, axis=-1)))
        shift = m - m_new
        a = jnp.exp(shift)
        d = z - m_new[..., None]
        e = jnp.exp(d)
        se_new = a * se + e.sum(-1)
        sz_new = a * (sz + shift * se) + (e * d).sum(-1)
        hit = fresh & (col == targets[..., None])
        zk_new = zk + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        if with_pi2:
            ds = jax.lax.stop_gradient(d)
            e2 = jnp.exp(2.0 * ds)
            a2 = a * a
            s2_new = a2 * s2 + e2.sum(-1)
            s2z_new = a2 * (s2z + shift * s2) + (e2 * ds).sum(-1)
        else:
            s2_new, s2z_new = s2, s2z
        return (m_new, se_new, sz_new, zk_new, s2_new, s2z_new), None

    zeros = jnp.zeros((N, T), jnp.float32)
    init = (jnp.full((N, T), _NEG, jnp.float32), zeros, zeros, zeros, zeros, zeros)
    if num_chunks == 1:  # the whole vocabulary is one chunk: no loop, and no recomputation in the backward
        (m, se, sz, zk, s2, s2z), _ = body(init, jnp.int32(0))
    else:
        body = jax.checkpoint(body, prevent_cse=False)
        (m, se, sz, zk, s2, s2z), _ = jax.lax.scan(body, init, jnp.arange(num_chunks, dtype=jnp.int32))
    log_se = jnp.log(se)
    mean_shifted = sz / se  # sum_j pi_j (z_j - m)
    log_probs = zk - m - log_se
    entropy = log_se - mean_shifted
    pi2_dev = None
    if with_pi2:
        inv_se2 = 1.0 / (se * se)
        pi2_dev = jax.lax.stop_gradient(s2 * inv_se2 * mean_shifted - s2z * inv_se2)
    return TokenStats(log_probs=log_probs, entropy=entropy, pi2_dev=pi2_dev)


def naive_token_stats(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> TokenStats:
    """Reference computation from full logits [N, T, V] (tests and small vocabularies only)."""
    z = logits.astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(p * logp, axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    s = -logp
    pi2_dev = jnp.sum(p * p * (s - entropy[..., None]), axis=-1)
    return TokenStats(log_probs=lp, entropy=entropy, pi2_dev=pi2_dev)
