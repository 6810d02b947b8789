"""One-token decode step of the `Decoder` over a grouped KV cache.

The math is the decoder's own (`stare_jax.models.decoder`: same norms, RoPE, grouped-query
attention, SwiGLU and dtype handling), specialised to one new token per row of a batch of
N = B*G responses that share their prompts in groups of G (rows i*G .. i*G+G-1 answer
prompt i). What differs is how the keys and values are stored:

* prompt keys/values are kept once per prompt (`PromptCache`, [B, K, P, hd] per layer) and
  every response of the group attends to them: the G*(H/K) queries of a group and KV head
  form one matmul against the shared keys, so the prompt part of the cache costs B*P slots
  of memory and bandwidth instead of N*P;
* response keys/values live in per-row buffers, keys [N, K, hd, R] and values [N, K, R, hd]
  per layer, so both attention products are plain batched matmuls with no per-step transpose;
  the layers are unrolled, so each layer's buffers are their own arrays, written in place
  inside the decode loop (under `lax.scan` each layer's slice of a stacked cache is copied
  out and back every step);
* the per-layer parameters are sliced out of the stacked `[L, ...]` arrays once per rollout,
  outside the decode loop (slices inside it would be re-materialised every step).

Attention over the prompt and response parts shares one softmax, so the result equals
attention over the concatenated sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from stare_jax.models.config import rope_inverse_frequencies
from stare_jax.models.decoder import (Decoder, attention_inputs, attention_residual, fuse_projections, mlp_residual,
                                      rms_norm)

_MASK_VALUE = -1e30  # as in the decoder: finite, so fully masked rows stay finite

LayerKV = tuple[jax.Array, jax.Array]


class PromptCache(NamedTuple):
    """Keys/values of the B unique prompts: per layer (k, v) [B, K, P, hd], and the additive
    attention bias [B, 1, 1, P] (0 on prompt tokens, a large negative value on padding)."""

    layers: list[LayerKV]
    bias: jax.Array


def prompt_cache(prefill_cache: tuple[jax.Array, jax.Array], prompt_mask: jax.Array) -> PromptCache:
    """Rearranges the decoder's prefill cache (k, v) [L, B, P, K, hd] into a `PromptCache`."""
    k, v = prefill_cache
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    bias = jnp.where(prompt_mask > 0, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None, :]
    return PromptCache([(heads_first(k[i]), heads_first(v[i])) for i in range(k.shape[0])], bias)


def empty_response_cache(model: Decoder, rows: int, length: int) -> list[LayerKV]:
    """Zeroed per-layer response buffers in the compute dtype: k [rows, K, hd, length] (slots
    last, so scores are a plain matmul) and v [rows, K, length, hd]."""
    c = model.config
    k_shape = (rows, c.num_kv_heads, c.head_dim, length)
    v_shape = (rows, c.num_kv_heads, length, c.head_dim)
    return [(jnp.zeros(k_shape, model.dtype), jnp.zeros(v_shape, model.dtype)) for _ in range(c.num_layers)]


def layer_params(model: Decoder) -> list[dict[str, jax.Array]]:
    """The decoder's stacked layer parameters as one dict of arrays per layer (with q/k/v and
    gate/up concatenated when the model fuses its projections; built once, outside the decode loop)."""
    stacked = model.layers.arrays()
    layers = [{name: w[i] for name, w in stacked.items()} for i in range(model.config.num_layers)]
    return [fuse_projections(p) for p in layers] if model.fused_projections else layers


def decode_step(model: Decoder, layers: list[dict[str, jax.Array]], prompt: PromptCache,
                response: list[LayerKV], tokens: jax.Array, positions: jax.Array,
                slot) -> tuple[jax.Array, list[LayerKV]]:
    """Logits [N, V] (float32) for one new token per row, and the response cache holding its keys.

    tokens, positions: [N] (RoPE position of each new token). The new key/value goes into
    response slot `slot`; the token attends to its prompt and to response slots 0..slot.
    """
    cfg, dtype = model.config, model.dtype
    x = jnp.take(model.embed[...], tokens, axis=0).astype(dtype)                      # [N, D]
    angles = positions.astype(jnp.float32)[:, None, None] * jnp.asarray(rope_inverse_frequencies(cfg))
    cos, sin = jnp.cos(angles), jnp.sin(angles)                                        # [N, 1, hd/2]
    length = response[0][1].shape[2]
    response_bias = jnp.where(jnp.arange(length) <= slot, 0.0, _MASK_VALUE).astype(jnp.float32)
    new_response = []
    for p, prompt_kv, response_kv in zip(layers, prompt.layers, response):
        x, response_kv = _layer(cfg, dtype, p, x, cos, sin, prompt_kv, prompt.bias, response_kv, response_bias, slot)
        new_response.append(response_kv)
    return model.logits(rms_norm(x, model.final_norm[...], cfg.rms_norm_eps)), new_response


def _layer(cfg, dtype, p, x, cos, sin, prompt_kv, prompt_bias, response_kv, response_bias, slot):
    """One pre-norm block for x [N, D]; returns the new residual stream and the layer's response (k, v)."""
    N = x.shape[0]
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = attention_inputs(cfg, dtype, p, x[:, None, :], cos, sin)   # [N, 1, H|K, hd]
    q = q.reshape(N, K, H // K, hd)
    k = k.transpose(0, 2, 3, 1)                                           # [N, K, hd, 1]
    v = v.transpose(0, 2, 1, 3)                                           # [N, K, 1, hd]
    k_cache = jax.lax.dynamic_update_slice(response_kv[0], k.astype(dtype), (0, 0, 0, slot))
    v_cache = jax.lax.dynamic_update_slice(response_kv[1], v.astype(dtype), (0, 0, slot, 0))
    attn = _grouped_attention(q, prompt_kv, prompt_bias, (k_cache, v_cache), response_bias, dtype)
    x = attention_residual(p, x, attn.reshape(N, H * hd), dtype)
    return mlp_residual(cfg, p, x, dtype), (k_cache, v_cache)


def _grouped_attention(q, prompt_kv, prompt_bias, response_kv, response_bias, dtype):
    """softmax(q.[k_prompt; k_response] / sqrt(hd) + bias) . [v_prompt; v_response], float32 [N, K, Q, hd].

    q: [N, K, Q, hd] (Q query heads per KV head); prompt k/v: [B, K, P, hd], shared by the
    G = N/B consecutive rows of a group; response k: [N, K, hd, R] and v: [N, K, R, hd]. The two
    parts share one softmax: a common max, and a common normaliser applied at the end.
    """
    N, K, Q, hd = q.shape
    B = prompt_kv[0].shape[0]
    G = N // B
    scale = hd ** -0.5
    # rows [B*G, K, Q, ...] <-> groups [B, K, G*Q, ...]: a group's queries against its prompt.
    to_groups = lambda a: a.reshape(B, G, K, Q, a.shape[-1]).swapaxes(1, 2).reshape(B, K, G * Q, a.shape[-1])
    to_rows = lambda a: a.reshape(B, K, G, Q, a.shape[-1]).swapaxes(1, 2).reshape(N, K, Q, a.shape[-1])

    prompt_scores = jnp.einsum("bkmd,bksd->bkms", to_groups(q), prompt_kv[0], preferred_element_type=jnp.float32)
    prompt_scores = prompt_scores * scale + prompt_bias                                  # [B, K, G*Q, P]
    response_scores = jnp.einsum("nkqd,nkds->nkqs", q, response_kv[0], preferred_element_type=jnp.float32)
    response_scores = response_scores * scale + response_bias                            # [N, K, Q, R]
    top = jnp.maximum(to_rows(prompt_scores.max(axis=-1, keepdims=True)), response_scores.max(axis=-1, keepdims=True))
    prompt_weights = jnp.exp(prompt_scores - to_groups(top))
    response_weights = jnp.exp(response_scores - top)
    total = to_rows(prompt_weights.sum(axis=-1, keepdims=True)) + response_weights.sum(axis=-1, keepdims=True)
    out = to_rows(jnp.einsum("bkms,bksd->bkmd", prompt_weights.astype(dtype), prompt_kv[1],
                             preferred_element_type=jnp.float32))
    out = out + jnp.einsum("nkqs,nksd->nkqd", response_weights.astype(dtype), response_kv[1],
                           preferred_element_type=jnp.float32)
    return out / total
