"""A decoder-only transformer for the Llama, Qwen2 and Qwen3 families, in Flax NNX.

Per layer (pre-norm):  x += Attn(RMSNorm(x));  x += SwiGLU(RMSNorm(x)).
Attention is grouped-query with rotary position embeddings (HF "rotate half" layout);
Qwen2 adds biases on q/k/v, Qwen3 applies an RMSNorm to each head of q and k.

Layer parameters are stacked along a leading `[num_layers]` axis and the layers run
under `lax.scan`, which keeps compile time flat in depth and lets the KV cache be one
array per tensor. The module carries no sharding: partition rules live in
`stare_jax.parallel`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stare_jax import parallel
from stare_jax.models.attention import grouped_response_attention
from stare_jax.models.blockwise_attention import MASK_VALUE, causal_attention, grouped_causal_attention
from stare_jax.models.config import ModelConfig, rope_inverse_frequencies
from stare_jax.models.packing import Packing, gather_packed, packed_inverse_index, packed_token_index, scatter_packed
from stare_jax.models.products import dot_nt, dot_tn, product_dtype

# A large finite negative instead of -inf keeps fully masked (padding) rows finite.
_MASK_VALUE = MASK_VALUE

# Self-attention over more positions than this, and the grouped update's attention of longer
# responses, runs in blocks of this many (`models.blockwise_attention`: no [T, T] score matrix,
# memory linear in the length); shorter sequences form the whole matrix (`models.attention` for
# grouped responses) (`model.attention_block`, whose default in config.py is this value: a test
# holds them equal; 0: always the whole matrix).
DEFAULT_ATTENTION_BLOCK = 512


def attention_block_for(attention_block: int, length: int) -> int:
    """The block size attention over `length` positions runs in under `model.attention_block`:
    `attention_block` when the sequence is longer than it, else 0 (the whole score matrix)."""
    return attention_block if 0 < attention_block < length else 0

# What a rematerialised layer keeps from its forward pass for the backward (`model.remat_saves`):
# "nothing" recomputes the whole layer (one extra forward, least memory); "mlp" keeps the MLP's
# gate/up outputs (2F values per token per layer: 3,072 for a 135M model), so the backward's
# recomputation runs only the attention half (q/k/v, attention, o: about a quarter of a layer's
# projection FLOPs) and SwiGLU; "projections" keeps the outputs of all its matmuls (q/k/v, o,
# gate/up, down: ~5k values per token per layer) and recomputes only the norms, RoPE, SwiGLU and
# attention from them, so the backward repeats no matmul of the projections.
PROJECTION = "projection"
MLP_GATE_UP = "mlp_gate_up"
REMAT_SAVES = {"nothing": jax.checkpoint_policies.nothing_saveable,
               "mlp": jax.checkpoint_policies.save_only_these_names(MLP_GATE_UP),
               "projections": jax.checkpoint_policies.save_only_these_names(PROJECTION, MLP_GATE_UP)}

LAYER_PARAM_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm",
                     "mlp_norm", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Position of each token in a left-padded batch: p_t = (sum_{s<=t} m_s) - 1, 0 on padding."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.where(mask > 0, jnp.cumsum(mask, axis=-1) - 1, 0)


def column_sum(x: jax.Array) -> jax.Array:
    """float32 sum of x [..., F] over all leading axes, as a [1, T] @ [T, F] matmul: XLA:CPU lowers a
    plain reduction over a long leading axis to a windowed tree reduction ~30x slower than the
    matmul (the weight gradients of norms and biases are such sums over every token)."""
    x2 = x.reshape(-1, x.shape[-1])
    return jnp.dot(jnp.ones((1, x2.shape[0]), x2.dtype), x2, preferred_element_type=jnp.float32)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32, result in x's dtype.

    Gradient, with r = 1/sqrt(mean(x^2) + eps), n = x r and u = g w: dx = r (u - n mean(u n)),
    dw = sum over tokens of g n (`column_sum`)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def _rms_norm_fwd(x, weight, eps):
    return rms_norm(x, weight, eps), (x, weight)


def _rms_norm_bwd(eps, res, g):
    x, weight = res
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    n = xf * r
    gf = g.astype(jnp.float32)
    u = gf * weight.astype(jnp.float32)
    dx = r * (u - n * jnp.mean(u * n, axis=-1, keepdims=True))
    return dx.astype(x.dtype), column_sum(gf * n).astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope_angles(cfg: ModelConfig, positions: jax.Array, table: tuple[jax.Array, jax.Array] | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [..., hd/2] (float32) of the rotary angles position * inv_freq_i.

    With `table` (`rope_table(cfg, n)`, every position below n) they are its rows at `positions`:
    the same values, read instead of recomputed. XLA:CPU fuses cos/sin into each consumer, so
    without a table every head of every layer re-evaluates them per element.
    """
    if table is not None:
        return tuple(jnp.take(t, positions, axis=0, mode="clip") for t in table)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inverse_frequencies(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def rope_table(cfg: ModelConfig, length: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [length, hd/2] (float32) of the rotary angles of positions 0 .. length-1."""
    return rope_angles(cfg, jnp.arange(length, dtype=jnp.int32))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs (x_i, x_{i+d/2}) by the angle position * inv_freq_i ("rotate half" layout).

    x: [B, T, H, D]; cos, sin: [B, T, D/2] float32. With x = [x1, x2] along D the result is
    [x1 cos - x2 sin, x2 cos + x1 sin], computed on the [..., 2, D/2] view as
    x cos + flip(x) (-sin, +sin): one elementwise pass, where a concatenate of the two halves
    would be three on XLA:CPU (it does not fuse concatenates with their operands).
    """
    half = x.shape[-1] // 2
    pair = x.astype(jnp.float32).reshape(x.shape[:-1] + (2, half))
    c, s = cos[:, :, None, None, :], sin[:, :, None, None, :]
    first = jax.lax.broadcasted_iota(jnp.int32, pair.shape, pair.ndim - 2) == 0
    rotated = pair * c + jnp.flip(pair, axis=-2) * jnp.where(first, -s, s)
    return rotated.reshape(x.shape).astype(x.dtype)


class LayerStack(nnx.Module):
    """The parameters of all decoder layers, each stacked along a leading [num_layers] axis."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        normal = nnx.initializers.normal(0.02)

        def dense(shape):
            return nnx.Param(normal(rngs.params(), shape, param_dtype))

        def const(shape, value):
            return nnx.Param(jnp.full(shape, value, param_dtype))

        self.attn_norm = const((L, D), 1.0)
        self.wq, self.wk, self.wv = dense((L, D, q_dim)), dense((L, D, kv_dim)), dense((L, D, kv_dim))
        self.wo = dense((L, q_dim, D))
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = const((L, q_dim), 0.0), const((L, kv_dim), 0.0), const((L, kv_dim), 0.0)
        if cfg.o_bias:
            self.bo = const((L, D), 0.0)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = const((L, cfg.head_dim), 1.0), const((L, cfg.head_dim), 1.0)
        self.mlp_norm = const((L, D), 1.0)
        self.w_gate, self.w_up, self.w_down = dense((L, D, F)), dense((L, D, F)), dense((L, F, D))
        if cfg.mlp_bias:
            self.b_gate, self.b_up, self.b_down = const((L, F), 0.0), const((L, F), 0.0), const((L, D), 0.0)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (only those this architecture has)."""
        return {n: getattr(self, n)[...] for n in LAYER_PARAM_NAMES if hasattr(self, n)}


class Decoder(nnx.Module):
    """Causal LM: token ids -> float32 logits, with an optional preallocated KV cache."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 remat: bool = False, remat_saves: str = "nothing", scan_layers: bool = True,
                 mesh: Mesh | None = None, rngs: nnx.Rngs, remat_saves_layers: int = -1,
                 attention_block: int = DEFAULT_ATTENTION_BLOCK):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.remat = remat
        if remat_saves not in REMAT_SAVES:
            raise ValueError(f"remat_saves must be one of {sorted(REMAT_SAVES)}, got {remat_saves!r}")
        self.remat_saves = remat_saves
        # How many layers keep what `remat_saves` names: the last `remat_saves_layers` (whose
        # backward runs first, so their kept values are freed first); the layers below them
        # recompute everything. -1: every layer.
        if remat_saves_layers < -1:
            raise ValueError(f"remat_saves_layers must be -1 (every layer) or >= 0, got {remat_saves_layers}")
        self.remat_saves_layers = remat_saves_layers
        if attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 (0: the whole score matrix), got {attention_block}")
        self.attention_block = attention_block
        # scan_layers=False unrolls the layer loop: longer compiles, but no per-layer slicing and
        # stacking of weights and saved activations (about 15% faster fwd+bwd for small models on CPU).
        self.scan_layers = scan_layers
        # With a mesh, the residual stream is pinned to the batch sharding so XLA gathers FSDP
        # weights instead of all-reducing activations (which would hold a whole micro-batch's MLP
        # activations on every device).
        self.mesh = mesh
        self.fused_projections = mesh is None or mesh.shape.get("tensor", 1) == 1
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), param_dtype))
        self.layers = LayerStack(cfg, param_dtype=param_dtype, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), param_dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size), param_dtype))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Logits [B, T, V] (float32) of a left-padded batch; positions come from the mask."""
        hidden, _ = self.hidden_states(input_ids, positions_from_mask(attention_mask), attention_mask)
        return self.logits(hidden)

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        """x with its leading (batch) axis sharded over the mesh's ("data", "fsdp") axes (no-op
        without a mesh or when the batch does not divide)."""
        if self.mesh is None or x.shape[0] % parallel.batch_divisor(self.mesh):
            return x
        spec = P(parallel.BATCH_AXES, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def output_embedding(self) -> jax.Array:
        """The [D, V] matrix that maps final hidden states to logits."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> float32 logits [..., V]."""
        w = self.output_embedding().astype(self.dtype)
        return jnp.einsum("...d,dv->...v", hidden.astype(self.dtype), w, preferred_element_type=jnp.float32)

    def init_cache(self, batch_size: int, max_len: int) -> tuple[jax.Array, jax.Array]:
        """Zeroed KV cache (k, v), each [L, B, max_len, num_kv_heads, head_dim] in the compute dtype."""
        c = self.config
        shape = (c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array, kv_mask: jax.Array,
                      cache: tuple[jax.Array, jax.Array] | None = None, cache_index=0):
        """Final-norm hidden states [B, T, D] and the updated cache.

        Without a cache the keys are the T input tokens and `kv_mask` is [B, T]. With a cache of
        length S, the new keys/values are written at [cache_index, cache_index + T) and the
        queries attend to every cache slot j <= cache_index + t whose `kv_mask[b, j]` is 1
        (`kv_mask` is [B, S]).
        """
        cfg = self.config
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(self.dtype)
        cos, sin = rope_angles(cfg, positions)
        T = input_ids.shape[1]
        key_len = T if cache is None else cache[0].shape[2]
        # Blockwise (no [T, S] matrix) where the keys are the T inputs themselves: no cache, or a
        # prefill that fills a cache of exactly T slots from slot 0.
        block = self.self_attention_block(T) if key_len == T and isinstance(cache_index, int) and cache_index == 0 else 0
        # [B, T] the keys' validity (causal inside the blocks), or `_attend`'s [B, 1, 1, T, S] mask
        bias = (kv_mask > 0).astype(jnp.float32) if block else causal_bias(kv_mask, T, cache_index)

        x = self.constrain_batch(x)
        if cache is None and self._per_device(x.shape[0]):
            def make_layer(inputs):
                def layer(x, p, _):
                    return _decoder_layer(cfg, self.dtype, p, x, *inputs, None, 0, block)[0], None
                return layer

            return self._final_norm(self._layers_by_device(make_layer, x, (cos, sin, bias))), None

        def layer(x, p, layer_cache):
            x, new_cache = _decoder_layer(cfg, self.dtype, p, x, cos, sin, bias, layer_cache, cache_index, block)
            return self.constrain_batch(x), new_cache

        x, new_cache = self._run_layers(layer, x, cache)
        return self._final_norm(x), new_cache

    def self_attention_block(self, length: int) -> int:
        """The block size of attention over `length` positions (`attention_block_for` of this
        model's `attention_block`); 0: the whole score matrix."""
        return attention_block_for(self.attention_block, length)

    def grouped_hidden_states(self, prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                              response_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Final-norm hidden states of B left-padded prompts [B, P] and of the N = B*G responses
        [N, R] that answer them in groups (rows i*G .. i*G+G-1 continue prompt i).

        Equals `hidden_states` of the concatenated batch [N, P + R] (each prompt repeated G times,
        positions from the concatenated mask) but runs every prompt token once instead of G times:
        responses attend to their group's prompt keys/values (one shared softmax over prompt and
        response keys) and causally to their own tokens with `response_mask` 1. Returns
        (prompt hidden [B, P, D], response hidden [N, R, D]).
        """
        embed, rope_p, rope_r, biases = self._grouped_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        xp, xr = self._run_grouped_layers(embed(prompt_ids), embed(response_ids), rope_p, rope_r, biases)
        return self._final_norm(xp), self._final_norm(xr)

    def packed_grouped_hidden_states(self, prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                                     response_mask: jax.Array, packing: Packing
                                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """`grouped_hidden_states` with the responses packed (`models.packing`): every per-token
        operation runs on each row block's kept tokens [S, C] instead of the padded grid [N, R];
        attention scatters q/k/v onto the grid and gathers its output back.

        The same values as `grouped_hidden_states` at the kept positions (up to float32 rounding).
        `packing` = (C, S), both static: S row blocks (`packing.block_count`, one per batch shard)
        of C entries (`packing.packed_capacity` of the same mask and S). Returns (prompt hidden
        [B, P, D], packed response hidden [S, C, D], index [S, C], inverse [S, N R / S]); the index
        maps packed entries to grid positions (`packing.packed_rows_and_columns`), the inverse grid
        positions to packed entries (`packing.packed_inverse_index`), so that the moves between the
        two layouts and their gradients are gathers.
        """
        N, R = response_ids.shape
        index = packed_token_index(response_mask.astype(jnp.int32), packing.capacity, packing.shards)
        inverse = self.constrain_batch(packed_inverse_index(index, N, R))
        embed, rope_p, rope_r, biases = self._grouped_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        rope_c = tuple(self.constrain_batch(gather_packed(t, index, inverse)) for t in rope_r)
        xp, xc = self._run_grouped_layers(embed(prompt_ids), embed(gather_packed(response_ids, index, inverse)),
                                          rope_p, rope_c, biases, moves=(index, inverse, N, R))
        return self._final_norm(xp), self._final_norm(xc), index, inverse

    def _grouped_inputs(self, prompt_ids, prompt_mask, response_ids, response_mask):
        """(embed, prompt RoPE, response RoPE [N, R], attention biases) of a grouped forward."""
        cfg = self.config
        B, N = prompt_ids.shape[0], response_ids.shape[0]
        if N % B:
            raise ValueError(f"{N} responses do not form groups of the {B} prompts")
        G, R = N // B, response_ids.shape[1]
        prompt_mask, response_mask = prompt_mask.astype(jnp.int32), response_mask.astype(jnp.int32)
        prompt_pos = positions_from_mask(prompt_mask)
        response_pos = jnp.repeat(prompt_mask.sum(-1), G)[:, None] + jnp.cumsum(response_mask, axis=-1) - 1
        response_pos = jnp.where(response_mask > 0, response_pos, 0)
        valid = lambda mask: (mask > 0).astype(jnp.float32)  # noqa: E731
        prompt_self = (valid(prompt_mask) if self.self_attention_block(prompt_ids.shape[1]) else
                       causal_bias(prompt_mask, prompt_ids.shape[1]))                 # [B, P] or [B,1,1,P,P]
        if self.self_attention_block(R):  # grouped_causal_attention: the keys' validity, no [N, R, R] mask
            responses = (valid(prompt_mask), valid(response_mask))                    # [B, P], [N, R]
        else:  # grouped_response_attention's additive masks
            responses = (jnp.where(prompt_mask > 0, 0.0, _MASK_VALUE).astype(jnp.float32),  # [B, P]
                         causal_bias(response_mask, R)[:, 0, 0])                            # [N, R, R]
        biases = (prompt_self, *responses)
        embed = lambda ids: self.constrain_batch(jnp.take(self.embed[...], ids, axis=0).astype(self.dtype))  # noqa: E731
        table = rope_table(cfg, prompt_ids.shape[1] + R)  # every position is below P + R
        return embed, rope_angles(cfg, prompt_pos, table), rope_angles(cfg, response_pos, table), biases

    @property
    def saving_layers(self) -> int:
        """How many layers (the last) keep what `remat_saves` names in the backward: 0 without
        `remat` or with "nothing", else `remat_saves_layers` clipped to the depth (-1: every layer)."""
        if not self.remat or self.remat_saves == "nothing":
            return 0
        L = self.config.num_layers
        return L if self.remat_saves_layers < 0 else min(self.remat_saves_layers, L)

    def _run_layers(self, layer, carry, per_layer=None, params=None):
        """Scans `layer(carry, params, per_layer_slice) -> (carry, out)` over the stacked layers
        (`params`: the stacked arrays, default this model's; fused when `fused_projections`, each
        layer rematerialised with `remat`, keeping what `REMAT_SAVES[remat_saves]` saves: every layer,
        or with `remat_saves_layers` = k >= 0 only the last k, the others in a loop of their own that
        keeps nothing); returns (carry, stacked outs)."""
        def body(c, xs):
            p, extra = xs
            return layer(c, fuse_projections(p) if self.fused_projections else p, extra)

        params = self.layers.arrays() if params is None else params
        scan = lambda f, c, xs: jax.lax.scan(f, c, xs, unroll=not self.scan_layers)  # noqa: E731
        if not self.remat:
            return scan(body, carry, (params, per_layer))
        L, keep = self.config.num_layers, self.saving_layers
        plain = jax.checkpoint(body, policy=REMAT_SAVES["nothing"])
        saving = jax.checkpoint(body, policy=REMAT_SAVES[self.remat_saves])
        if keep in (0, L):  # one loop: no layer keeps anything, or every layer does
            return scan(plain if keep == 0 else saving, carry, (params, per_layer))
        # Two loops: the first L - keep layers recompute everything, the last `keep` keep their values.
        lower, upper = (jax.tree.map(lambda a: a[:L - keep], (params, per_layer)),
                        jax.tree.map(lambda a: a[L - keep:], (params, per_layer)))
        carry, out_lower = scan(plain, carry, lower)
        carry, out_upper = scan(saving, carry, upper)
        return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out_lower, out_upper)

    def _per_device(self, *rows: int) -> bool:
        """Whether a forward without a cache runs its layer stack per device (`_layers_by_device`):
        scanned layers on a purely data-parallel mesh of several CPU devices
        (`parallel.partial_sum_sharding`) whose size divides every batch-like leading axis in
        `rows`. CPU only: there the devices are threads of one process whose collectives inside
        loops can deadlock (docs/performance.md); an accelerator's collective inside the backward
        loop instead overlaps each layer's gradient sum with the next layer's compute, which one
        sum after the loop would give up. Unrolled layers (`scan_layers=False`) have no loop to
        keep collectives out of, and stay as they were (the `--large` update 1 % faster so)."""
        sharding = parallel.partial_sum_sharding(self.mesh)
        return (self.scan_layers and sharding is not None and self.mesh.devices.flat[0].platform == "cpu"
                and all(r % self.mesh.shape["data"] == 0 for r in rows))

    def _layers_by_device(self, make_layer, carry, inputs):
        """The layer stack as one `jax.shard_map` over the "data" axis: each device scans the layers
        over its own rows of `carry` and `inputs` (pytrees split along their leading axes;
        `make_layer(local inputs)` returns the `_run_layers` layer function) with the whole stacked
        weights, cast to device-varying before the scan. A weight's gradient is then a per-device
        partial sum through the backward loop, summed over the devices once where the region ends:
        the same gradient as the replicated form, whose loop all-reduces every layer's gradients in
        every trip, with no collective inside the loop. Returns the last carry."""
        def local(params, carry, inputs):
            params = jax.lax.pcast(params, ("data",), to="varying")
            return self._run_layers(make_layer(inputs), carry, params=params)[0]

        rows = P("data")
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), rows, rows), out_specs=rows)(
            self.layers.arrays(), carry, inputs)

    def _run_grouped_layers(self, xp, xr, rope_p, rope_r, biases, *, moves=None):
        """The grouped blocks over prompts xp and responses xr (grid [N, R, D] or, with `moves` =
        (index, inverse, N, R) of `packed_grouped_hidden_states`, packed [S, C, D]); returns the
        last block's (xp, xr). Per device (`_layers_by_device`) where the mesh allows it."""
        cfg, dtype = self.config, self.dtype
        index, inverse, N, R = moves if moves is not None else (None, None, None, None)
        prompt_block = self.self_attention_block(xp.shape[1])
        response_block = self.self_attention_block(xr.shape[1] if R is None else R)

        def grouped_layer(rope_p, rope_r, biases, index, inverse, rows, constrain):
            grid = packed = None
            if index is not None:
                grid = lambda t: constrain(scatter_packed(t, index, rows, R, inverse))  # noqa: E731
                packed = lambda t: constrain(gather_packed(t, index, inverse))  # noqa: E731

            def layer(carry, p, _):
                xp, xr = _grouped_decoder_layer(cfg, dtype, p, *carry, rope_p, rope_r, biases, grid=grid, packed=packed,
                                                prompt_block=prompt_block, response_block=response_block)
                return (constrain(xp), constrain(xr)), None
            return layer

        inputs = (rope_p, rope_r, biases, index, inverse)
        if self._per_device(xp.shape[0], xr.shape[0]) and (index is None or index.shape[0] == self.mesh.shape["data"]):
            rows = None if N is None else N // self.mesh.shape["data"]
            return self._layers_by_device(lambda local: grouped_layer(*local, rows, lambda t: t), (xp, xr), inputs)
        return self._run_layers(grouped_layer(*inputs, N, self.constrain_batch), (xp, xr))[0]

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(h: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """h @ w over the last axis of h [..., D] with w [D, F] (cast to h's dtype for the product),
    accumulated in float32 and returned in `out_dtype` by the product itself: a bfloat16 result
    comes out of the matmul, not from a float32 [..., F] array and a separate cast (which an
    H200 profile of the bfloat16 update showed as kernels of their own, forward and backward).

    Its gradient is written out as two plain 2-D matmuls, dh = g w^T (in h's dtype) and dw = h^T g
    (float32 accumulation, in w's own dtype: a float32 parameter's gradient is not rounded through
    the compute dtype), rows of h and g flattened, the transposes on the smaller operands. Autodiff
    of the einsum gives the same values, but XLA:CPU then lays the backward out with a transpose of
    every [tokens, F] cotangent fused into a strided elementwise loop, which made the backward pass
    ~2x slower on CPU. A bfloat16 product on a CPU backend returns float32 and is rounded after,
    and its backward takes the forms YNNPACK's bf16 kernels accept (`stare_jax.models.products`).
    """
    y = jnp.einsum("...d,df->...f", h, w.astype(h.dtype), preferred_element_type=product_dtype(out_dtype))
    return y.astype(out_dtype)


def _dense_fwd(h, w, out_dtype):
    return dense(h, w, out_dtype), (h, w)


def _dense_grads(h, w, g):
    """(dh, dw) of h @ w for the cotangent g [..., F]: dh in h's dtype, dw accumulated in float32
    and returned in w's dtype."""
    g2 = g.reshape(-1, g.shape[-1]).astype(h.dtype)
    dh = dot_nt(g2, w.astype(h.dtype), h.dtype)
    dw = dot_tn(h.reshape(-1, h.shape[-1]), g2)
    return dh.reshape(h.shape), dw.astype(w.dtype)


def _dense_bwd(out_dtype, res, g):
    return _dense_grads(*res, g)


dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dense_bias(h: jax.Array, w: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """`dense(h, w) + b` with the bias added in float32, then returned in `out_dtype`; the bias
    gradient is a `column_sum` of the cotangent."""
    return (dense(h, w, jnp.float32) + b.astype(jnp.float32)).astype(out_dtype)


def _dense_bias_fwd(h, w, b, out_dtype):
    return dense_bias(h, w, b, out_dtype), (h, w, b)


def _dense_bias_bwd(out_dtype, res, g):
    h, w, b = res
    dh, dw = _dense_grads(h, w, g)
    return dh, dw, column_sum(g.astype(jnp.float32)).astype(b.dtype)


dense_bias.defvjp(_dense_bias_fwd, _dense_bias_bwd)


def project(h: jax.Array, w: jax.Array, b: jax.Array | None, dtype, name: str = PROJECTION) -> jax.Array:
    """h @ w (+ b) over the last axis, h in `dtype`, accumulated in float32, returned in `dtype`
    (named `name` for the rematerialisation policies of `REMAT_SAVES`); w stays in its parameter
    dtype here (`dense` casts it for the product), so its gradient is not rounded to `dtype`."""
    h = h.astype(dtype)
    y = dense(h, w, dtype) if b is None else dense_bias(h, w, b, dtype)
    return checkpoint_name(y, name)


def fuse_projections(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer's parameters with q/k/v and gate/up concatenated along their output axis
    (`w_qkv`, `b_qkv`, `w_gate_up`, `b_gate_up`), so each block runs two wide matmuls instead of
    five narrow ones. Only for meshes whose `tensor` axis is 1: those outputs are sharded over
    `tensor`, and concatenating sharded outputs would move data between devices."""
    p = dict(p)
    p["w_qkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")], axis=-1)
    if "bq" in p:
        p["b_qkv"] = jnp.concatenate([p.pop("bq"), p.pop("bk"), p.pop("bv")], axis=-1)
    p["w_gate_up"] = jnp.concatenate([p.pop("w_gate"), p.pop("w_up")], axis=-1)
    if "b_gate" in p:
        p["b_gate_up"] = jnp.concatenate([p.pop("b_gate"), p.pop("b_up")], axis=-1)
    return p


def attention_inputs(cfg: ModelConfig, dtype, p, x, cos, sin):
    """q [B, T, H, hd] and k, v [B, T, K, hd] of a block input x [B, T, D]: pre-attention RMSNorm,
    projections (+ Qwen2 biases; one matmul when `p` is `fuse_projections`ed), Qwen3's per-head
    q/k RMSNorm, then RoPE on q and k."""
    B, T, _ = x.shape
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    if "w_qkv" in p:
        qkv = project(h, p["w_qkv"], p.get("b_qkv"), dtype)
        q, k, v = jnp.split(qkv, [H * hd, (H + K) * hd], axis=-1)
    else:
        q, k, v = (project(h, p[w], p.get(b), dtype) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    return rotary_heads(cfg, p, q.reshape(B, T, H, hd), k.reshape(B, T, K, hd), cos, sin) + (v.reshape(B, T, K, hd),)


def rotary_heads(cfg: ModelConfig, p, q: jax.Array, k: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array]:
    """(q, k) [B, T, H|K, hd] after Qwen3's per-head RMSNorm (when the model has it) and RoPE."""
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def attention_residual(p, x: jax.Array, attn: jax.Array, dtype) -> jax.Array:
    """x + o_proj(attn), with attn [..., H * hd]."""
    return x + project(attn.astype(dtype), p["wo"], p.get("bo"), dtype)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(g) * u of gate_up = [g, u] [..., 2F] (float32 math, result in gate_up's dtype).

    Its backward recomputes s = sigmoid(g) from the saved gate_up: dg = da u s (1 + g (1 - s)) and
    du = da g s, each one fused pass that computes s itself, then [dg, du] [..., 2F]. Autodiff
    would also save sigmoid(g) and silu(g) as [tokens, F] arrays and read them back in several
    passes; on CPU these elementwise passes over the MLP's widest activations are bound by memory
    bandwidth.
    """
    g, u = jnp.split(gate_up, 2, axis=-1)
    return silu_times(g, u)


def silu_times(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up = gate sigmoid(gate) up, float32 math, in gate's dtype."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, da):
    # Two optimisation barriers over different tuples give dg and du their own copy of g, so
    # each fusion computes sigmoid(g) itself: with one shared s, XLA would store s as another
    # [tokens, F] array (or, without any barrier, keep the forward's copy between the passes).
    g, u = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    da = da.astype(jnp.float32)
    g1, u1, da1 = jax.lax.optimization_barrier((g, u, da))
    g2, da2 = jax.lax.optimization_barrier((g, da))
    s1, s2 = jax.nn.sigmoid(g1), jax.nn.sigmoid(g2)
    grad = jnp.concatenate([da1 * s1 * (u1 * (1.0 + g1 * (1.0 - s1))), da2 * s2 * g2], axis=-1)
    return (grad.astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def mlp_residual(cfg: ModelConfig, p, x: jax.Array, dtype) -> jax.Array:
    """x + W_down (silu(W_gate h) * W_up h), h = RMSNorm(x): the SwiGLU half of a block."""
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in p:
        act = swiglu(project(h, p["w_gate_up"], p.get("b_gate_up"), dtype, MLP_GATE_UP))
    else:  # gate and up sharded over `tensor`: concatenating them would move data between devices
        gate = project(h, p["w_gate"], p.get("b_gate"), dtype, MLP_GATE_UP)
        up = project(h, p["w_up"], p.get("b_up"), dtype, MLP_GATE_UP)
        act = silu_times(gate, up)
    return x + project(act, p["w_down"], p.get("b_down"), dtype)


def _decoder_layer(cfg: ModelConfig, dtype, p, x, cos, sin, bias, cache, cache_index, block: int = 0):
    """One pre-norm block; returns the new residual stream and this layer's updated (k, v) cache.
    With `block` > 0 the attention is causal self-attention in blocks of that many positions and
    `bias` the keys' validity [B, T] (`blockwise_attention.causal_attention`), else `bias` is the
    additive mask [B, 1, 1, T, S] of `_attend`."""
    B, T, _ = x.shape
    H, hd = cfg.num_heads, cfg.head_dim
    q, k, v = attention_inputs(cfg, dtype, p, x, cos, sin)
    if cache is not None:
        k_cache = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, cache_index, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, cache_index, 0, 0))
        k, v, cache = k_cache, v_cache, (k_cache, v_cache)
    attn = causal_attention(q, k, v, bias, block) if block else _attend(q, k, v, bias, dtype)
    x = attention_residual(p, x, attn.reshape(B, T, H * hd), dtype)
    return mlp_residual(cfg, p, x, dtype), cache


def causal_bias(kv_mask: jax.Array, query_len: int, cache_index=0) -> jax.Array:
    """`_attend`'s additive mask [B, 1, 1, T, S] for T queries at positions cache_index .. cache_index
    + T - 1 over the S keys of `kv_mask` [B, S]: 0 where key s <= the query's position and
    kv_mask[b, s] > 0, `_MASK_VALUE` elsewhere."""
    q_index = cache_index + jnp.arange(query_len)
    allowed = (jnp.arange(kv_mask.shape[1])[None, :] <= q_index[:, None])[None] & (kv_mask[:, None, :] > 0)
    return jnp.where(allowed, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, dtype) -> jax.Array:
    """Grouped-query attention softmax(q k^T / sqrt(hd) + bias) v, float32 [B, T, K, H/K, hd];
    q [B, T, H, hd], k, v [B, S, K, hd], bias [B, 1, 1, T, S]."""
    B, T, H, hd = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, H // K, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    probs = jax.nn.softmax(scores + bias, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(dtype), v, preferred_element_type=jnp.float32)


def _grouped_decoder_layer(cfg: ModelConfig, dtype, p, xp, xr, rope_p, rope_r, biases, *, grid=None, packed=None,
                           prompt_block: int = 0, response_block: int = 0):
    """One pre-norm block over prompts xp [B, P, D] and the responses xr [N, R, D] of their groups
    (see `Decoder.grouped_hidden_states`); `biases` = additive masks (prompt-prompt [B,1,1,P,P],
    or with `prompt_block` > 0 the prompt keys' validity [B, P] for blockwise self-attention;
    response-prompt [B, P], response-response [N, R, R]). The responses' attention is
    `grouped_response_attention` (blockwise causal, hand-written backward) or, with
    `response_block` > 0, `blockwise_attention.grouped_causal_attention` in blocks of that many
    positions, and then the response biases are the keys' validity (prompt [B, P], responses [N, R]).

    Packed responses (`Decoder.packed_grouped_hidden_states`): xr [S, C, D] and rope_r hold the
    kept tokens, `grid` scatters a packed [S, C, ...] array onto [N, R, ...] and `packed` gathers
    it back; only the responses' attention then runs on the grid."""
    grid = grid or (lambda t: t)
    packed = packed or (lambda t: t)
    B, P_len, _ = xp.shape
    H, hd = cfg.num_heads, cfg.head_dim
    bias_pp, bias_rp, bias_rr = biases
    qp, kp, vp = attention_inputs(cfg, dtype, p, xp, *rope_p)
    qr, kr, vr = attention_inputs(cfg, dtype, p, xr, *rope_r)
    attn_p = causal_attention(qp, kp, vp, bias_pp, prompt_block) if prompt_block else _attend(qp, kp, vp, bias_pp, dtype)
    if response_block:
        attn_r = grouped_causal_attention(grid(qr), kp, vp, bias_rp, grid(kr), grid(vr), bias_rr, response_block)
    else:
        attn_r = grouped_response_attention(grid(qr), kp, vp, grid(kr), grid(vr), bias_rp, bias_rr)
    N, R = attn_r.shape[:2]

    xp = attention_residual(p, xp, attn_p.reshape(B, P_len, H * hd), dtype)
    xr = attention_residual(p, xr, packed(attn_r.reshape(N, R, H * hd)), dtype)
    return mlp_residual(cfg, p, xp, dtype), mlp_residual(cfg, p, xr, dtype)
