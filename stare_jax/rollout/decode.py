"""One-token decode step of the `Decoder` over a grouped KV cache.

The math is the decoder's own (`stare_jax.models.decoder`: same norms, RoPE, grouped-query
attention, SwiGLU and dtype handling), specialised to one new token per row of a batch of
N = B*G responses that share their prompts in groups of G (rows i*G .. i*G+G-1 answer
prompt i). What differs is how the keys and values are stored:

* prompt keys/values are kept once per prompt (`PromptCache`, [B, K, P, hd] per layer) and
  every response of the group attends to them: the G*(H/K) queries of a group and KV head
  form one matmul against the shared keys, so the prompt part of the cache costs B*P slots
  of memory and bandwidth instead of N*P;
* response keys/values live in per-row buffers, keys [N, K, hd, S] and values [N, K, S, hd]
  per layer and block of S slots, so both attention products are plain batched matmuls with
  no per-step transpose; the sampler's decode loop for block j reads blocks 0..j only;
  the layers are unrolled, so each layer's buffers are their own arrays, written in place
  inside the decode loop (under `lax.scan` each layer's slice of a stacked cache is copied
  out and back every step);
* the per-layer parameters are sliced out of the stacked `[L, ...]` arrays once per rollout,
  outside the decode loop (slices inside it would be re-materialised every step);
* on CPU the layers run *feature-major* (`layer_params(..., feature_major=True)`, whose
  transposed matrices are named `<name>_t`: the decode step reads the layout from the names, so
  weights and layers cannot disagree): the residual
  stream is kept as x^T [D, N] and every projection is W^T [F, D] @ x^T, its output [F, N]. A
  decode step's matmuls have only N (tens of) rows; XLA:CPU's kernels run them faster with the
  weight as the left operand (SmolLM2-135M's rollout 1.05-1.25x faster on a 2-core Xeon,
  `docs/performance.md`). Only attention, per row, transposes its small q/k/v and output. Same
  math; float rounding of the matmuls may differ from the row-major layout's.

Attention over the prompt and response parts shares one softmax, so the result equals
attention over the concatenated sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from stare_jax.models.decoder import (Decoder, attention_inputs, attention_residual, fuse_projections, mlp_residual,
                                      rms_norm, rope_angles, rotary_heads, silu_times)

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


def layer_params(model: Decoder, feature_major: bool = False) -> list[dict[str, jax.Array]]:
    """The decoder's stacked layer parameters as one dict of arrays per layer (with q/k/v and
    gate/up concatenated when the model fuses its projections; built once, outside the decode loop).
    `feature_major`: every projection matrix transposed to [F, D] and named `<name>_t`, which makes
    the decode step run its layers feature-major."""
    stacked = model.layers.arrays()
    layers = [{name: w[i] for name, w in stacked.items()} for i in range(model.config.num_layers)]
    layers = [fuse_projections(p) for p in layers] if model.fused_projections else layers
    if feature_major:
        layers = [{(f"{name}_t" if w.ndim == 2 else name): (w.T if w.ndim == 2 else w) for name, w in p.items()}
                  for p in layers]
    return layers


def decode_step(model: Decoder, layers: list[dict[str, jax.Array]], prompt: PromptCache,
                response: list[LayerKV], tokens: jax.Array, positions: jax.Array,
                slot, past: list[list[LayerKV]] | None = None, rope: tuple[jax.Array, jax.Array] | None = None
                ) -> tuple[jax.Array, list[LayerKV]]:
    """Logits [N, V] (float32) for one new token per row, and the response block holding its keys.

    tokens, positions: [N] (RoPE position of each new token). The new key/value goes into slot
    `slot` (one index for all rows, which advance in lockstep) of the current response block
    (`response`, per layer); the token attends to its prompt, to every slot of the earlier, full
    blocks `past[layer]` and to slots 0..slot of the current block. `rope`: a `rope_table` covering
    every position (read, not recomputed). The layers run feature-major when `layers` come from
    `layer_params(..., feature_major=True)` (module docstring).
    """
    length = response[0][1].shape[2]
    bias = jnp.where(jnp.arange(length) <= slot, 0.0, _MASK_VALUE).astype(jnp.float32)
    past = past or [[] for _ in layers]

    def write(k, v, response_kv, past_kv):
        k_cache = jax.lax.dynamic_update_slice(response_kv[0], k, (0, 0, 0, slot))
        v_cache = jax.lax.dynamic_update_slice(response_kv[1], v, (0, 0, slot, 0))
        return (k_cache, v_cache), [*past_kv, (k_cache, v_cache)], [None] * len(past_kv) + [bias]

    return _decode(model, layers, prompt, list(zip(response, past)), tokens, positions, rope, write)


def decode_step_rows(model: Decoder, layers: list[dict[str, jax.Array]], prompt: PromptCache,
                     blocks: list[list[LayerKV]], starts: tuple[int, ...], tokens: jax.Array, positions: jax.Array,
                     columns: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None
                     ) -> tuple[jax.Array, list[list[LayerKV]]]:
    """`decode_step` for rows at different steps of different responses (the slot-refilling
    sampler): `prompt` holds one prompt per row (B = N), and row n writes its new key/value at its
    own response column `columns[n]` and attends to its columns 0..columns[n].

    The response columns are split into blocks (`blocks[layer]`, a list of (k, v) blocks, block i
    covering columns starts[i] .. starts[i] + its size - 1): each row writes into the block holding
    its column (a scatter of N columns per block, rows of other blocks dropped, in place inside the
    decode loop), and attention reads only the blocks given, so a loop whose rows all sit in the
    first blocks does not read the rest. Returns the logits and the updated blocks.
    """
    N = tokens.shape[0]
    rows = jnp.arange(N)
    sizes = [kv[1].shape[2] for kv in blocks[0]]
    inside = [(columns >= a) & (columns < a + n) for a, n in zip(starts, sizes)]
    local = [jnp.clip(columns - a, 0, n - 1) for a, n in zip(starts, sizes)]
    biases = [jnp.where(a + jnp.arange(n)[None, :] <= columns[:, None], 0.0,
                        _MASK_VALUE).astype(jnp.float32)[:, None, None, :] for a, n in zip(starts, sizes)]

    def write(k, v, layer_blocks, _):
        new = []
        for (k_block, v_block), hit, col in zip(layer_blocks, inside, local):
            row = jnp.where(hit, rows, N)  # N: a dropped write
            new.append((k_block.at[row, :, :, col].set(k[..., 0], mode="drop"),
                        v_block.at[row, :, col, :].set(v[:, :, 0], mode="drop")))
        return new, new, biases

    return _decode(model, layers, prompt, [(b, None) for b in blocks], tokens, positions, rope, write)


def _decode(model: Decoder, layers, prompt: PromptCache, caches, tokens, positions, rope, write):
    """The decoder over one new token per row. Per layer, `write(k [N, K, hd, 1], v [N, K, 1, hd],
    *caches[layer])` stores the new key/value and returns (the layer's new cache, the response
    blocks to attend to, their attention biases (None: unmasked)). Returns (logits [N, V] float32,
    the new caches). Feature-major when `layers` hold transposed (`_t`) matrices."""
    cfg, dtype = model.config, model.dtype
    feature_major = "wo_t" in layers[0]
    x = jnp.take(model.embed[...], tokens, axis=0).astype(dtype)                      # [N, D]
    cos, sin = rope_angles(cfg, positions[:, None], rope)                                 # [N, 1, hd/2]
    N = x.shape[0]
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    if feature_major:
        x = x.T                                                                          # [D, N]
    new_caches = []
    for p, prompt_kv, cache in zip(layers, prompt.layers, caches):
        if feature_major:
            q, k, v = _attention_inputs_by_feature(cfg, dtype, p, x, cos, sin)
        else:
            q, k, v = attention_inputs(cfg, dtype, p, x[:, None, :], cos, sin)   # [N, 1, H|K, hd]
        cache, blocks, biases = write(k.transpose(0, 2, 3, 1).astype(dtype), v.transpose(0, 2, 1, 3).astype(dtype),
                                      *cache)
        attn = _grouped_attention(q.reshape(N, K, H // K, hd), prompt_kv, prompt.bias, blocks, biases, dtype)
        if feature_major:
            x = x + _project_by_feature(p["wo_t"], p.get("bo"), attn.reshape(N, H * hd).T.astype(dtype), dtype)
            x = x + _mlp_by_feature(p, _rms_norm_by_feature(x, p["mlp_norm"], eps), dtype)
        else:
            x = mlp_residual(cfg, p, attention_residual(p, x, attn.reshape(N, H * hd), dtype), dtype)
        new_caches.append(cache)
    if feature_major:
        # Rows first again, materialised: without the barrier XLA folds this transpose into the
        # output projection's dot, whose transposed left operand XLA:CPU's fast kernels do not take
        # (a 2-3x slower generic dot on the synthetic benchmark model).
        x = jax.lax.optimization_barrier(x.T)
    return model.logits(rms_norm(x, model.final_norm[...], eps)), new_caches


def _rms_norm_by_feature(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`rms_norm` of the columns of a feature-major x [D, N]."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=0, keepdims=True) + eps)
    return weight.astype(x.dtype)[:, None] * y.astype(x.dtype)


def _project_by_feature(w_t: jax.Array, b: jax.Array | None, x: jax.Array, dtype) -> jax.Array:
    """`project` feature-major: W^T [F, D] @ x [D, N] (+ b), accumulated in float32, in `dtype`."""
    y = jnp.dot(w_t.astype(dtype), x, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)[:, None]
    return y.astype(dtype)


def _attention_inputs_by_feature(cfg, dtype, p, x: jax.Array, cos, sin):
    """`attention_inputs` of a feature-major residual stream x [D, N]: q [N, 1, H, hd] and k, v
    [N, 1, K, hd] (rows first again, for attention)."""
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    N = x.shape[1]
    h = _rms_norm_by_feature(x, p["attn_norm"], cfg.rms_norm_eps)
    if "w_qkv_t" in p:
        qkv = _project_by_feature(p["w_qkv_t"], p.get("b_qkv"), h, dtype)
        q, k, v = jnp.split(qkv, [H * hd, (H + K) * hd], axis=0)
    else:
        q, k, v = (_project_by_feature(p[w], p.get(b), h, dtype)
                   for w, b in (("wq_t", "bq"), ("wk_t", "bk"), ("wv_t", "bv")))
    rows = lambda a, heads: a.T.reshape(N, 1, heads, hd)
    return rotary_heads(cfg, p, rows(q, H), rows(k, K), cos, sin) + (rows(v, K),)


def _mlp_by_feature(p, h: jax.Array, dtype) -> jax.Array:
    """The SwiGLU half of `mlp_residual` (without the residual) on feature-major h [D, N]."""
    if "w_gate_up_t" in p:
        gate, up = jnp.split(_project_by_feature(p["w_gate_up_t"], p.get("b_gate_up"), h, dtype), 2, axis=0)
    else:
        gate = _project_by_feature(p["w_gate_t"], p.get("b_gate"), h, dtype)
        up = _project_by_feature(p["w_up_t"], p.get("b_up"), h, dtype)
    return _project_by_feature(p["w_down_t"], p.get("b_down"), silu_times(gate, up), dtype)


def _grouped_attention(q, prompt_kv, prompt_bias, blocks, biases, dtype):
    """softmax(q.[k_prompt; k_block 0; k_block 1; ...] / sqrt(hd) + bias) . [v_prompt; v_block 0; ...],
    float32 [N, K, Q, hd].

    q: [N, K, Q, hd] (Q query heads per KV head); prompt k/v: [B, K, P, hd], shared by the
    G = N/B consecutive rows of a group; response blocks k [N, K, hd, S_j] and v [N, K, S_j, hd],
    each with its additive bias in `biases` (None: unmasked). All parts share one softmax: a
    common max, and a common normaliser applied at the end.
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
    scores = [jnp.einsum("nkqd,nkds->nkqs", q, k, preferred_element_type=jnp.float32) * scale for k, _ in blocks]
    scores = [s if b is None else s + b for s, b in zip(scores, biases)]                 # [N, K, Q, S_j]
    top = to_rows(prompt_scores.max(axis=-1, keepdims=True))
    for s in scores:
        top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
    prompt_weights = jnp.exp(prompt_scores - to_groups(top))
    weights = [jnp.exp(s - top) for s in scores]
    total = to_rows(prompt_weights.sum(axis=-1, keepdims=True)) + sum(w.sum(axis=-1, keepdims=True) for w in weights)
    out = to_rows(jnp.einsum("bkms,bksd->bkmd", prompt_weights.astype(dtype), prompt_kv[1],
                             preferred_element_type=jnp.float32))
    for w, (_, v) in zip(weights, blocks):
        out = out + jnp.einsum("nkqs,nksd->nkqd", w.astype(dtype), v, preferred_element_type=jnp.float32)
    return out / total
