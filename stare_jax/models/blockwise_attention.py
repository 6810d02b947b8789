"""Causal attention in blocks of positions (self-attention, and grouped responses after their
shared prompt): memory linear in the sequence length.

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

`grouped_causal_attention` is the same computation for the grouped update's responses
(`Decoder.grouped_hidden_states`): N = B*G response rows in groups of G, each attending to its
group's shared prompt (keys kp, vp [B, P, K, hd], every real prompt token allowed) and causally to
its own tokens, one softmax over both. The prompt is a key block that comes before every response
block: it seeds the online softmax (m, l, acc) of each query block and gets its own pass in the
backward, so that `models.attention.grouped_response_attention`'s kept probabilities (~R^2/2 per
head and response) and its [N, R, R] mask are never formed. Query rows are laid out
[nb, B, K, G, Q*C, hd], so the prompt part is one product per (prompt, KV head) over the group's G
responses and the response part one per (prompt, KV head, response); the largest buffers are a
block's response scores [B, K, G, Q*C, C] and its prompt scores [B, K, G*Q*C, P].

On a CPU, updates whose sequences are longer than `model.attention_block` compile on XLA's default
kernels: with Eigen's products these programs computed wrong rows (`stare_jax.cpu_gemm`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stare_jax.models.products import einsum_f32 as _mm

_F32 = jnp.float32
# The masked value of every additive attention mask (the decoder's too): large, finite, negative.
MASK_VALUE = -1e30


def _full(x, shape, value=0.0):
    """A float32 array of `shape` filled with `value` that varies over the manual mesh axes `x`
    varies over (inside `jax.shard_map` a loop's initial carry must match what its body makes)."""
    return jnp.full_like(x, value, dtype=_F32, shape=shape)


def _pad_positions(x, length: int):
    """x [N, T, ...] padded with zeros along T to `length`."""
    pad = length - x.shape[1]
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x


def _query_blocks(x, K: int, C: int, G: int):
    """Query-side rows [N, T, H, hd] (q, or the output's cotangent; N = B*G rows in groups of G) ->
    head-major blocks [nb, B, K, G, Q*C, hd] (rows: Q query heads x C positions), T padded to nb*C."""
    N, T, H, hd = x.shape
    nb, Q = -(-T // C), H // K
    x = _pad_positions(x, nb * C).reshape(N // G, G, nb, C, K, Q, hd)
    return x.transpose(2, 0, 4, 1, 5, 3, 6).reshape(nb, N // G, K, G, Q * C, hd)


def _key_blocks(x, C: int, G: int):
    """Keys or values [N, T, K, hd] -> [nb, B, K, G, C, hd], T padded to nb*C."""
    N, T, K, hd = x.shape
    nb = -(-T // C)
    return _pad_positions(x, nb * C).reshape(N // G, G, nb, C, K, hd).transpose(2, 0, 4, 1, 3, 5)


def _valid_blocks(key_valid, C: int, G: int):
    """Key validity [N, T] -> [nb, B, G, C], the padding (T up to nb*C) masked."""
    N, T = key_valid.shape
    nb = -(-T // C)
    return _pad_positions(key_valid, nb * C).reshape(N // G, G, nb, C).transpose(2, 0, 1, 3)


def _rows(xh, T: int, Q: int):
    """[nb, B, K, G, Q*C, hd] -> [N, T, K, Q, hd] (inverse of the query layout, padding cut)."""
    nb, B, K, G, QC, hd = xh.shape
    C = QC // Q
    xh = xh.reshape(nb, B, K, G, Q, C, hd).transpose(1, 3, 0, 5, 2, 4, 6)
    return xh.reshape(B * G, nb * C, K, Q, hd)[:, :T]


def _key_rows(xh, T: int):
    """[nb, B, K, G, C, hd] -> [N, T, K, hd] (inverse of `_key_blocks`)."""
    nb, B, K, G, C, hd = xh.shape
    return xh.transpose(1, 3, 0, 4, 2, 5).reshape(B * G, nb * C, K, hd)[:, :T]


def _bias(valid_j, i, j, Q: int, C: int):
    """Additive mask [B, 1, G, Q*C, C] of query block i against key block j (valid_j [B, G, C]):
    0 where the key is a real token at or before the query's position, MASK_VALUE elsewhere."""
    query = i * C + jnp.tile(jnp.arange(C), Q)
    key = j * C + jnp.arange(C)
    allowed = (key[None, :] <= query[:, None])[None, None, None] & (valid_j[:, None, :, None, :] > 0)
    return jnp.where(allowed, 0.0, MASK_VALUE).astype(_F32)


def _prompt_scores(q_i, prompt, scale):
    """Scores [B, K, G*Q*C, P] of query block q_i [B, K, G, Q*C, hd] against the group's prompt keys
    (prompt = (kp [B, K, P, hd], vp, additive bias [B, P]))."""
    B, K, G, QC, hd = q_i.shape
    kp, _, bias = prompt
    return _mm("bkmd,bkpd->bkmp", q_i.reshape(B, K, G * QC, hd), kp, q_i.dtype) * scale + bias[:, None, None, :]


def _forward(qh, kh, vh, valid, prompt, Q: int):
    """Output [nb, B, K, G, Q*C, hd] (float32) and log-sum-exp [nb, B, K, G, Q*C] of every query
    block; with a `prompt` (`_prompt_scores`) its keys come before every response key."""
    nb, B, K, G, QC, hd = qh.shape
    C, dtype, scale = QC // Q, qh.dtype, hd ** -0.5

    def query_block(_, xs):
        i, q_i = xs

        def key_block(j, carry):
            m, l, acc = carry
            s = _mm("bkgmd,bkgsd->bkgms", q_i, kh[j], dtype) * scale + _bias(valid[j], i, j, Q, C)
            m_new = jnp.maximum(m, s.max(-1))
            e = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return m_new, l * corr + e.sum(-1), acc * corr[..., None] + _mm("bkgms,bkgsd->bkgmd", e, vh[j], dtype)

        if prompt:  # the prompt block seeds the online softmax
            s = _prompt_scores(q_i, prompt, scale)
            m = s.max(-1)
            e = jnp.exp(s - m[..., None])
            acc = _mm("bkmp,bkpd->bkmd", e, prompt[1], dtype)
            init = (m.reshape(B, K, G, QC), e.sum(-1).reshape(B, K, G, QC), acc.reshape(B, K, G, QC, hd))
        else:
            init = (_full(q_i, (B, K, G, QC), -jnp.inf), _full(q_i, (B, K, G, QC)), _full(q_i, (B, K, G, QC, hd)))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
        return None, (acc / l[..., None], m + jnp.log(l))

    _, (o, lse) = jax.lax.scan(query_block, None, (jnp.arange(nb), qh))
    return o, lse


def _prompt_backward(qh, doh, lse, rowdot, prompt):
    """The prompt block's share of the backward: (dq [nb, B, K, G, Q*C, hd] unscaled, dkp, dvp
    [B, K, P, hd]), one query block at a time with p = e^(s - L) recomputed."""
    nb, B, K, G, QC, hd = qh.shape
    kp, vp, _ = prompt
    dtype, scale, M = qh.dtype, hd ** -0.5, G * QC

    def query_block(carry, xs):
        dkp, dvp = carry
        q_i, do_i, lse_i, rowdot_i = xs
        p = jnp.exp(_prompt_scores(q_i, prompt, scale) - lse_i.reshape(B, K, M)[..., None])
        do_i, q_i = do_i.reshape(B, K, M, hd), q_i.reshape(B, K, M, hd)
        dvp = dvp + _mm("bkmp,bkmd->bkpd", p, do_i, dtype)
        ds = p * (_mm("bkmd,bkpd->bkmp", do_i, vp, dtype) - rowdot_i.reshape(B, K, M)[..., None])
        dkp = dkp + _mm("bkmp,bkmd->bkpd", ds, q_i, dtype)
        return (dkp, dvp), _mm("bkmp,bkpd->bkmd", ds, kp, dtype).reshape(B, K, G, QC, hd)

    zeros = _full(kp, kp.shape)
    (dkp, dvp), dq = jax.lax.scan(query_block, (zeros, zeros), (qh, doh, lse, rowdot))
    return dq, dkp, dvp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, key_valid, prompt, block: int, group: int):
    """Blockwise causal attention of rows [N, T] in groups of `group` (optionally after a shared
    prompt per group, `prompt` = (kp [B, K, P, hd], vp, additive bias [B, P]) or ()), float32
    [N, T, K, H/K, hd]."""
    return _vjp_forward(q, k, v, key_valid, prompt, block, group)[0]


def _vjp_forward(q, k, v, key_valid, prompt, block, group):
    T, Q = q.shape[1], q.shape[2] // k.shape[2]
    qh = _query_blocks(q, k.shape[2], block, group)
    kh, vh, valid = _key_blocks(k, block, group), _key_blocks(v, block, group), _valid_blocks(key_valid, block, group)
    o, lse = _forward(qh, kh, vh, valid, prompt, Q)
    return _rows(o, T, Q), (qh, kh, vh, valid, prompt, o, lse, key_valid)


def _vjp_backward(block, group, res, d_out):
    qh, kh, vh, valid, prompt, o, lse, key_valid = res
    nb, B, K, G, QC, hd = qh.shape
    T, Q = d_out.shape[1], d_out.shape[3]
    C, dtype, scale = QC // Q, qh.dtype, hd ** -0.5
    doh = _query_blocks(d_out.astype(_F32).reshape(B * G, T, K * Q, hd), K, C, G)
    rowdot = (doh * o).sum(-1)                                                       # D [nb, B, K, G, QC]
    if prompt:
        dq0, dkp, dvp = _prompt_backward(qh, doh, lse, rowdot, prompt)
        d_prompt = ((dkp * scale).astype(prompt[0].dtype), dvp.astype(prompt[1].dtype), jnp.zeros_like(prompt[2]))
    else:
        dq0, d_prompt = _full(qh, qh.shape), ()

    def key_block(dq, xs):
        j, k_j, v_j = xs

        def query_block(i, carry):
            dq, dk, dv = carry
            q_i, do_i = qh[i], doh[i]
            s = _mm("bkgmd,bkgsd->bkgms", q_i, k_j, dtype) * scale + _bias(valid[j], i, j, Q, C)
            p = jnp.exp(s - lse[i][..., None])
            dv = dv + _mm("bkgms,bkgmd->bkgsd", p, do_i, dtype)
            ds = p * (_mm("bkgmd,bkgsd->bkgms", do_i, v_j, dtype) - rowdot[i][..., None])
            dk = dk + _mm("bkgms,bkgmd->bkgsd", ds, q_i, dtype)
            dq = dq.at[i].add(_mm("bkgms,bkgsd->bkgmd", ds, k_j, dtype))
            return dq, dk, dv

        zeros = _full(k_j, k_j.shape)
        dq, dk, dv = jax.lax.fori_loop(j, nb, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, dq0, (jnp.arange(nb), kh, vh))
    dq = _rows(dq * scale, T, Q).reshape(B * G, T, K * Q, hd)
    return (dq.astype(qh.dtype), (_key_rows(dk, T) * scale).astype(kh.dtype), _key_rows(dv, T).astype(vh.dtype),
            jnp.zeros_like(key_valid), d_prompt)


_attention.defvjp(_vjp_forward, _vjp_backward)


def causal_attention(q, k, v, key_valid, block: int):
    """Causal grouped-query attention in blocks of `block` positions, float32 [B, T, K, H/K, hd]:
    the value of `decoder._attend` with the bias of `key_valid` (key s allowed for query t when
    s <= t and key_valid[b, s] > 0), without a [T, T] buffer.

    q [B, T, H, hd], k, v [B, T, K, hd] (products in q's dtype, accumulated in float32), key_valid
    float [B, T] (1 on real tokens; its cotangent is zero)."""
    return _attention(q, k, v, key_valid, (), block, 1)


def grouped_causal_attention(q, kp, vp, prompt_valid, kr, vr, response_valid, block: int):
    """`models.attention.grouped_response_attention` in blocks of `block` response positions, float32
    [N, R, H, hd]: the N = B*G responses (rows g*G .. g*G+G-1 answer prompt g) attend, in one
    softmax, to every real token of their group's prompt and causally to their own real tokens,
    without an [R, R] buffer (flash attention's online softmax, the prompt as the first key block).

    q [N, R, H, hd]; kp, vp [B, P, K, hd] prompt keys/values; prompt_valid float [B, P] (1 on real
    prompt tokens; at least one per prompt); kr, vr [N, R, K, hd]; response_valid float [N, R] (key
    s allowed for query t when s <= t and response_valid[n, s] > 0). Products take their inputs in
    q's dtype and accumulate in float32; the validity masks get zero cotangents."""
    N, R, H, hd = q.shape
    B = kp.shape[0]
    prompt_bias = jnp.where(prompt_valid > 0, 0.0, MASK_VALUE).astype(_F32)
    prompt = (kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3), prompt_bias)
    return _attention(q, kr, vr, response_valid, prompt, block, N // B).reshape(N, R, H, hd)
