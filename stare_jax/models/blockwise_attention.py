"""Causal self-attention in blocks of positions: memory linear in the sequence length.

The plain attention of `Decoder.hidden_states` forms the whole score matrix, heads x T x T float32
per row (13.6 GiB a layer for a 1.5B Qwen2 at 17k positions), and its autodiff keeps it for the
backward. `causal_attention` computes the same softmax(q k^T / sqrt(hd) + bias) v, bias 0 where key
s <= query t and key s is a real token, a large negative value elsewhere, one block of C query
positions against one block of C key positions at a time (flash attention's online softmax, Dao et
al. 2022 / Dao 2023):

    s = q_i k_j^T / sqrt(hd) + bias_ij,   m' = max(m, rowmax(s)),
    l' = l e^(m - m') + rowsum(e^(s - m')),   acc' = acc e^(m - m') + e^(s - m') v_j,

over the key blocks j <= i (the blocks above the diagonal are all masked and never computed), then
o_i = acc / l and the log-sum-exp L_i = m + log l. The forward keeps only o and L; the backward
(written out, flash attention 2's order: an outer loop over key blocks, an inner one over the query
blocks at or below the diagonal) recomputes p = e^(s - L) block by block, with D = rowsum(do * o):

    dv_j += p^T do_i,   ds = p * (do_i v_j^T - D_i),   dk_j += ds^T q_i / sqrt(hd),
    dq_i += ds k_j / sqrt(hd).

The largest buffer is one block's scores, [B, K, (H/K) C, C]. Values equal the full-matrix form's
to float32 rounding at every position with at least one real key before it; a query with none
(left padding) reads a different finite average in each form, and nothing downstream reads it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stare_jax.models.products import einsum_f32 as _mm

_F32 = jnp.float32
# The masked value of the full-matrix form (decoder._MASK_VALUE): large, finite, negative.
MASK_VALUE = -1e30


def _full(x, shape, value=0.0):
    """A float32 array of `shape` filled with `value` that varies over the manual mesh axes `x`
    varies over (inside `jax.shard_map` a loop's initial carry must match what its body makes)."""
    return jnp.full_like(x, value, dtype=_F32, shape=shape)


def _pad_positions(x, length: int):
    """x [B, T, ...] padded with zeros along T to `length`."""
    pad = length - x.shape[1]
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x


def _query_blocks(x, K: int, C: int):
    """Query-side rows [B, T, H, hd] (q, or the output's cotangent) -> head-major blocks
    [nb, B, K, Q*C, hd] (rows: Q query heads x C positions), T padded to nb*C."""
    B, T, H, hd = x.shape
    nb, Q = -(-T // C), H // K
    x = _pad_positions(x, nb * C)
    return x.reshape(B, nb, C, K, Q, hd).transpose(1, 0, 3, 4, 2, 5).reshape(nb, B, K, Q * C, hd)


def _blocks(q, k, v, key_valid, block: int):
    """Head-major blocks: q [B,T,H,hd] -> [nb, B, K, Q*C, hd] (`_query_blocks`), k, v [B,T,K,hd] ->
    [nb, B, K, C, hd], key_valid [B, T] -> [nb, B, C]; T padded to nb*C with masked keys."""
    B, T, _, hd = q.shape
    K, C = k.shape[2], block
    nb = -(-T // C)
    kv = lambda x: _pad_positions(x, nb * C).reshape(B, nb, C, K, hd).transpose(1, 0, 3, 2, 4)  # noqa: E731
    valid = _pad_positions(key_valid, nb * C).reshape(B, nb, C).transpose(1, 0, 2)
    return _query_blocks(q, K, C), kv(k), kv(v), valid


def _rows(xh, B: int, T: int, Q: int):
    """[nb, B, K, Q*C, hd] -> [B, T, K, Q, hd] (inverse of the query layout, padding cut)."""
    nb, _, K, QC, hd = xh.shape
    C = QC // Q
    return xh.reshape(nb, B, K, Q, C, hd).transpose(1, 0, 4, 2, 3, 5).reshape(B, nb * C, K, Q, hd)[:, :T]


def _bias(valid_j, i, j, Q: int, C: int):
    """Additive mask [B, 1, Q*C, C] of query block i against key block j: 0 where the key is a real
    token at or before the query's position, MASK_VALUE elsewhere."""
    query = i * C + jnp.tile(jnp.arange(C), Q)
    key = j * C + jnp.arange(C)
    allowed = (key[None, :] <= query[:, None])[None, None] & (valid_j[:, None, None, :] > 0)
    return jnp.where(allowed, 0.0, MASK_VALUE).astype(_F32)


def _forward(qh, kh, vh, valid, Q: int):
    """Output [nb, B, K, Q*C, hd] (float32) and log-sum-exp [nb, B, K, Q*C] of every query block."""
    nb, B, K, QC, hd = qh.shape
    C, dtype, scale = QC // Q, qh.dtype, qh.shape[-1] ** -0.5

    def query_block(_, xs):
        i, q_i = xs

        def key_block(j, carry):
            m, l, acc = carry
            s = _mm("bkmd,bksd->bkms", q_i, kh[j], dtype) * scale + _bias(valid[j], i, j, Q, C)
            m_new = jnp.maximum(m, s.max(-1))
            e = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return m_new, l * corr + e.sum(-1), acc * corr[..., None] + _mm("bkms,bksd->bkmd", e, vh[j], dtype)

        init = (_full(q_i, (B, K, QC), -jnp.inf), _full(q_i, (B, K, QC)), _full(q_i, (B, K, QC, hd)))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
        return None, (acc / l[..., None], m + jnp.log(l))

    _, (o, lse) = jax.lax.scan(query_block, None, (jnp.arange(nb), qh))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def causal_attention(q, k, v, key_valid, block: int):
    """Causal grouped-query attention in blocks of `block` positions, float32 [B, T, K, H/K, hd]:
    the value of `decoder._attend` with the bias of `key_valid` (key s allowed for query t when
    s <= t and key_valid[b, s] > 0), without a [T, T] buffer.

    q [B, T, H, hd], k, v [B, T, K, hd] (products in q's dtype, accumulated in float32), key_valid
    float [B, T] (1 on real tokens; its cotangent is zero)."""
    return _vjp_forward(q, k, v, key_valid, block)[0]


def _vjp_forward(q, k, v, key_valid, block):
    B, T, H, _ = q.shape
    Q = H // k.shape[2]
    qh, kh, vh, valid = _blocks(q, k, v, key_valid, block)
    o, lse = _forward(qh, kh, vh, valid, Q)
    return _rows(o, B, T, Q), (qh, kh, vh, valid, o, lse, key_valid)


def _vjp_backward(block, res, d_out):
    qh, kh, vh, valid, o, lse, key_valid = res
    nb, B, K, QC, hd = qh.shape
    Q, T = d_out.shape[3], d_out.shape[1]
    C, dtype, scale = QC // Q, qh.dtype, hd ** -0.5
    doh = _query_blocks(d_out.astype(_F32).reshape(B, T, K * Q, hd), K, C)
    rowdot = (doh * o).sum(-1)                                                       # D [nb, B, K, QC]

    def key_block(dq, xs):
        j, k_j, v_j = xs

        def query_block(i, carry):
            dq, dk, dv = carry
            q_i, do_i = qh[i], doh[i]
            s = _mm("bkmd,bksd->bkms", q_i, k_j, dtype) * scale + _bias(valid[j], i, j, Q, C)
            p = jnp.exp(s - lse[i][..., None])
            dv = dv + _mm("bkms,bkmd->bksd", p, do_i, dtype)
            ds = p * (_mm("bkmd,bksd->bkms", do_i, v_j, dtype) - rowdot[i][..., None])
            dk = dk + _mm("bkms,bkmd->bksd", ds, q_i, dtype)
            dq = dq.at[i].add(_mm("bkms,bksd->bkmd", ds, k_j, dtype))
            return dq, dk, dv

        zeros = _full(k_j, (B, K, C, hd))
        dq, dk, dv = jax.lax.fori_loop(j, nb, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, _full(qh, qh.shape), (jnp.arange(nb), kh, vh))
    back_kv = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(B, nb * C, K, hd)[:, :T]  # noqa: E731
    dq = _rows(dq * scale, B, T, Q).reshape(B, T, K * Q, hd)
    return (dq.astype(qh.dtype), (back_kv(dk) * scale).astype(kh.dtype), back_kv(dv).astype(vh.dtype),
            jnp.zeros_like(key_valid))


causal_attention.defvjp(_vjp_forward, _vjp_backward)
