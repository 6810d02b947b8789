"""Attention of grouped responses to their shared prompt and to themselves, with a hand-written VJP.

In the update's forward (`Decoder.grouped_hidden_states`) the N = B*G responses of B groups attend
to the keys/values of their group's prompt (computed once per prompt) and causally to their own.
`grouped_response_attention` computes, with one softmax over both parts,

    s_p = q k_p^T / sqrt(hd) + bias_p,   s_r = q k_r^T / sqrt(hd) + bias_r,
    [p_p, p_r] = softmax([s_p, s_r]),    o = p_p v_p + p_r v_r.

* Head-major layout: queries [B, K, nb, G, Q, C, hd] (K KV heads, Q = H/K query heads each, the R
  response positions in nb blocks of C), so the prompt part is one matmul per (prompt, KV head)
  over every query row of the group, and the response part one per (prompt, KV head, response),
  all with the batch axes leading (no transposes inside the products).
* Blockwise causal: queries of block i only meet response keys of blocks 0..i, so the
  response-to-response work is (nb + 1) / (2 nb) of the full R x R square.
* Backward written out (the flash-attention identities), reusing the forward's probabilities,
  with D = rowsum(do * o):  ds = p * (do v^T - D),  dq = ds k / sqrt(hd),  dk = ds^T q / sqrt(hd),
  dv = p^T do; the prompt part's ds^T and p^T are formed explicitly (small), so that its dk and dv
  are plain batched matmuls.

Autodiff of the plain einsum formulation gives the same values (tests/test_models.py), but
XLA:CPU wrapped each of its batched products in transposes and ran the full square: attention
took a quarter of the 128-token update step for a few percent of its FLOPs.

This form keeps its probabilities (~R^2/2 floats a head a response) and takes an [N, R, R] mask:
the decoder uses it for responses of at most `model.attention_block` positions and
`blockwise_attention.grouped_causal_attention` (flash blocks, probabilities recomputed in the
backward, no [R, R] buffer) for longer ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stare_jax.models.products import einsum_f32 as _mm

_F32 = jnp.float32


def query_blocks(length: int) -> int:
    """Number of causal query blocks for `length` response positions: the most of 8, 4, 2 that
    divides it into blocks of at least 32 positions (1 when none does)."""
    for nb in (8, 4, 2):
        if length % nb == 0 and length // nb >= 32:
            return nb
    return 1


def _head_major(q, kp, vp, kr, vr, nb: int):
    """q [N,R,H,hd] -> [B,K,nb,G,Q,C,hd]; prompt k/v [B,P,K,hd] -> [B,K,P,hd]; response k/v
    [N,R,K,hd] -> [B,K,G,R,hd]."""
    N, R, H, hd = q.shape
    B, _, K, _ = kp.shape
    G, Q, C = N // B, H // K, R // nb
    qh = q.reshape(B, G, nb, C, K, Q, hd).transpose(0, 4, 2, 1, 5, 3, 6)
    prompt = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    response = lambda x: x.reshape(B, G, R, K, hd).transpose(0, 3, 1, 2, 4)  # noqa: E731
    return qh, prompt(kp), prompt(vp), response(kr), response(vr)


def _rows_major(oh):
    """[B,K,nb,G,Q,C,hd] -> [N,R,H,hd] (inverse of the query layout)."""
    B, K, nb, G, Q, C, hd = oh.shape
    return oh.transpose(0, 3, 2, 5, 1, 4, 6).reshape(B * G, nb * C, K * Q, hd)


def _forward(qh, kph, vph, krh, vrh, prompt_bias, response_bias):
    """Output [B,K,nb,G,Q,C,hd], prompt probabilities [B,K,nb,G,Q,C,P] and, per query block i,
    response probabilities [B,K,G,Q,C,(i+1)C] (float32)."""
    B, K, nb, G, Q, C, hd = qh.shape
    P, R, M, dtype = kph.shape[2], nb * C, nb * G * Q * C, qh.dtype
    scale = hd ** -0.5
    s_p = _mm("bkmd,bkpd->bkmp", qh.reshape(B, K, M, hd), kph, dtype) * scale + prompt_bias[:, None, None, :]
    s_p = s_p.reshape(B, K, nb, G, Q, C, P)
    response_bias = response_bias.reshape(B, G, R, R)
    p_prompt, p_response, o_response = [], [], []
    for i in range(nb):
        L = (i + 1) * C  # keys 0 .. L-1: this block and the ones before it
        s_r = _mm("bkgmd,bkgsd->bkgms", qh[:, :, i].reshape(B, K, G, Q * C, hd), krh[:, :, :, :L], dtype)
        s_r = s_r.reshape(B, K, G, Q, C, L) * scale + response_bias[:, None, :, None, i * C:L, :L]
        top = jnp.maximum(s_p[:, :, i].max(-1), s_r.max(-1))
        e_p, e_r = jnp.exp(s_p[:, :, i] - top[..., None]), jnp.exp(s_r - top[..., None])
        inv = 1.0 / (e_p.sum(-1) + e_r.sum(-1))
        p_prompt.append(e_p * inv[..., None])
        p_response.append(e_r * inv[..., None])
        o = _mm("bkgms,bkgsd->bkgmd", p_response[-1].reshape(B, K, G, Q * C, L), vrh[:, :, :, :L], dtype)
        o_response.append(o.reshape(B, K, G, Q, C, hd))
    p_p = jnp.stack(p_prompt, axis=2)
    o_p = _mm("bkmp,bkpd->bkmd", p_p.reshape(B, K, M, P), vph, dtype).reshape(B, K, nb, G, Q, C, hd)
    return o_p + jnp.stack(o_response, axis=2), p_p, p_response


@jax.custom_vjp
def grouped_response_attention(q, kp, vp, kr, vr, prompt_bias, response_bias):
    """Attention of responses to their group's prompt and (causally) to themselves, float32 [N, R, H, hd].

    q: [N, R, H, hd] queries of the N = B*G responses (rows g*G .. g*G+G-1 answer prompt g);
    kp, vp: [B, P, K, hd] prompt keys/values; kr, vr: [N, R, K, hd] response keys/values;
    prompt_bias [B, P] and response_bias [N, R, R] (query t, key s): additive float32 masks, 0 where
    a key may be attended, a large negative value where not; response_bias must mask every key
    s > t (causal). Products take their inputs in q's dtype and accumulate in float32.
    """
    return _vjp_forward(q, kp, vp, kr, vr, prompt_bias, response_bias)[0]


def _vjp_forward(q, kp, vp, kr, vr, prompt_bias, response_bias):
    heads = _head_major(q, kp, vp, kr, vr, query_blocks(q.shape[1]))
    oh, p_p, p_r = _forward(*heads, prompt_bias, response_bias)
    return _rows_major(oh), (heads, p_p, p_r, oh, prompt_bias, response_bias)


def _vjp_backward(res, d_out):
    (qh, kph, vph, krh, vrh), p_p, p_r, oh, prompt_bias, response_bias = res
    B, K, nb, G, Q, C, hd = qh.shape
    P, R, M, dtype = kph.shape[2], nb * C, nb * G * Q * C, qh.dtype
    scale = hd ** -0.5
    doh = d_out.reshape(B, G, nb, C, K, Q, hd).transpose(0, 4, 2, 1, 5, 3, 6).astype(_F32)
    rowdot = (doh * oh).sum(-1)                                                     # D [B,K,nb,G,Q,C]
    do_rows, q_rows = doh.reshape(B, K, M, hd), qh.reshape(B, K, M, hd)
    dp_p = _mm("bkmd,bkpd->bkmp", do_rows, vph, dtype).reshape(p_p.shape)
    ds_p = (p_p * (dp_p - rowdot[..., None])).reshape(B, K, M, P)
    dq_prompt = _mm("bkmp,bkpd->bkmd", ds_p, kph, dtype).reshape(qh.shape)
    # dk_p = ds_p^T q and dv_p = p_p^T do contract the M query rows: with the [B,K,M,P] operands as
    # they are, the left one is transposed, which XLA:CPU runs in Eigen at a few GFLOP/s (P is 32-96
    # prompt positions; YNNPACK takes no transposed left operand). Both are transposed to [B,K,P,M]
    # first (a few MB), behind a barrier so that XLA does not fold the transpose back into the product.
    ds_pt, p_pt = jax.lax.optimization_barrier((jnp.swapaxes(ds_p, 2, 3), jnp.swapaxes(p_p.reshape(B, K, M, P), 2, 3)))
    dkp = _mm("bkpm,bkmd->bkpd", ds_pt, q_rows, dtype) * scale
    dvp = _mm("bkpm,bkmd->bkpd", p_pt, do_rows, dtype)
    dq_response = []
    dkr, dvr = jnp.zeros(krh.shape, _F32), jnp.zeros(vrh.shape, _F32)
    for i in range(nb):
        L = (i + 1) * C
        do_i = doh[:, :, i].reshape(B, K, G, Q * C, hd)
        q_i = qh[:, :, i].reshape(B, K, G, Q * C, hd)
        dp_r = _mm("bkgmd,bkgsd->bkgms", do_i, vrh[:, :, :, :L], dtype).reshape(p_r[i].shape)
        ds_r = (p_r[i] * (dp_r - rowdot[:, :, i][..., None])).reshape(B, K, G, Q * C, L)
        dq_response.append(_mm("bkgms,bkgsd->bkgmd", ds_r, krh[:, :, :, :L], dtype).reshape(B, K, G, Q, C, hd))
        dkr = dkr.at[:, :, :, :L].add(_mm("bkgms,bkgmd->bkgsd", ds_r, q_i, dtype))
        dvr = dvr.at[:, :, :, :L].add(_mm("bkgms,bkgmd->bkgsd", p_r[i].reshape(B, K, G, Q * C, L), do_i, dtype))
    dq = (dq_prompt + jnp.stack(dq_response, axis=2)) * scale
    prompt_back = lambda x: x.transpose(0, 2, 1, 3).astype(dtype)  # noqa: E731
    response_back = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(B * G, R, K, hd).astype(dtype)  # noqa: E731
    return (_rows_major(dq).astype(dtype), prompt_back(dkp), prompt_back(dvp), response_back(dkr * scale),
            response_back(dvr), jnp.zeros_like(prompt_bias), jnp.zeros_like(response_bias))


grouped_response_attention.defvjp(_vjp_forward, _vjp_backward)
