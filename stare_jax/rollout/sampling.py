"""Next-token selection from logits: temperature, top-k, top-p (nucleus) and greedy.

Pure functions of `[N, V]` float32 logits. The filters follow the `transformers` order
(temperature, then top-k, then top-p) and its tie rules: every token whose logit equals the
cut-off value is kept. A full-vocabulary sort happens only when top-p is on without top-k;
with top-k the nucleus is computed over the k candidates from `lax.top_k`, and with neither
there is no sort at all. A draw inverts the cumulative distribution at one uniform number
per row (linear in V), which is exact up to float rounding and much cheaper than Gumbel-max's
V random numbers per row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; hashable, so one compiled sampler exists per setting.

    `top_k=0` and `top_p=1.0` switch those filters off; `greedy=True` takes the argmax of the
    raw logits and ignores the other fields.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (or use greedy=True), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The logits sampling draws from: `logits / T`, with tokens outside the top-k set and the
    top-p nucleus set to -inf. The nucleus is the smallest set of most likely tokens whose
    probability (after temperature and top-k) reaches `top_p`."""
    logits = logits.astype(jnp.float32) / jnp.float32(params.temperature)
    use_top_k = 0 < params.top_k < logits.shape[-1]
    use_top_p = params.top_p < 1.0
    if not (use_top_k or use_top_p):
        return logits
    if use_top_k:
        candidates = jax.lax.top_k(logits, params.top_k)[0]     # [N, k], descending
    else:
        candidates = -jnp.sort(-logits, axis=-1)                # [N, V], descending
    if use_top_p:
        probs = jax.nn.softmax(candidates, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < params.top_p                        # the most likely token always is
        cutoff = jnp.min(jnp.where(kept, candidates, jnp.inf), axis=-1, keepdims=True)
    else:
        cutoff = candidates[..., -1:]
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def choose_tokens(logits: jax.Array, uniforms: jax.Array | None, params: SamplingParams) -> jax.Array:
    """int32 token ids [N]: argmax of the raw logits when greedy, else one draw per row from
    softmax(filter_logits(logits)) at the row's uniform number in [0, 1) (`uniforms`: [N]),
    by `inverse_cdf`. One random number per row, where Gumbel-max needs V."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, params)
    return inverse_cdf(jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True)), uniforms)


def inverse_cdf(weights: jax.Array, uniforms: jax.Array) -> jax.Array:
    """For each row of non-negative `weights` [N, V] (not necessarily normalised), the index j with
    cdf[j-1] <= u * cdf[V-1] < cdf[j], where u = `uniforms` [N] in [0, 1) and cdf = cumsum(weights).

    Entries of weight 0 are never chosen. The search runs in two levels, over blocks of about
    sqrt(V) entries and then inside the chosen block, which keeps it linear in V.
    """
    N, V = weights.shape
    block = 1 << max(0, math.ceil(math.log2(V) / 2))
    num_blocks = -(-V // block)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * block - V))).reshape(N, num_blocks, block)
    block_cdf = jnp.cumsum(blocks.sum(axis=-1), axis=-1)                          # [N, num_blocks]
    total = block_cdf[:, -1:]
    # target < total strictly, even where u * total would round up to it.
    target = jnp.minimum(uniforms.astype(jnp.float32)[:, None] * total, jnp.nextafter(total, 0.0))
    b = jnp.sum(block_cdf <= target, axis=-1, keepdims=True)      # block_cdf[b-1] <= target < block_cdf[b]
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0), axis=-1), 0.0)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(blocks, b[:, :, None], axis=1)[:, 0], axis=-1)  # [N, block]
    # Rounding may put target - before at or past the block's own total: stop at its last non-zero entry.
    rest = jnp.minimum(target - before, jnp.nextafter(inner_cdf[:, -1:], 0.0))
    return (b[:, 0] * block + jnp.sum(inner_cdf <= rest, axis=-1)).astype(jnp.int32)


def token_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] per row at temperature 1, float32 [N]."""
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def uniforms_at(rng: jax.Array, shape: tuple[int, int]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """u(t, r) = jax.random.uniform(rng, shape, float32)[t, r], bit for bit, for int arrays t, r of
    one shape, without drawing the other numbers of the [R, N] array when that is possible.

    With a threefry key and `jax_threefry_partitionable` on (JAX's default), element i = t N + r
    of the array comes from counter i alone: (b1, b2) = threefry2x32(key, (0, i)), bits = b1 ^ b2,
    and the number is the float32 with mantissa bits >> 9 in [1, 2), minus 1. Computing those for
    the S responses a slot sampler decodes in a step costs S hashes and holds no [R, N] array (a
    replicated one, with its threefry temporaries, took ~2 GB a copy a device at a million tokens
    and 512 responses in the dry run). Any other key implementation, the flag off, or R N >= 2^32
    draws the array once and indexes it."""
    R, N = int(shape[0]), int(shape[1])
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(rng)) if typed else str(jax.config.jax_default_prng_impl)
    if not (jax.config.jax_threefry_partitionable and "threefry2x32" in impl and R * N < 2**32):
        table = jax.random.uniform(rng, (R, N), jnp.float32)
        return lambda t, r: table[t, r]
    data = jax.random.key_data(rng) if typed else rng

    def at(t: jax.Array, r: jax.Array) -> jax.Array:
        t, r = jnp.broadcast_arrays(jnp.asarray(t), jnp.asarray(r))
        i = (t.astype(jnp.uint32) * np.uint32(N) + r.astype(jnp.uint32)).ravel()
        hashed = threefry_2x32(data, jnp.concatenate([jnp.zeros_like(i), i]))
        bits = hashed[:i.size] ^ hashed[i.size:]
        unit = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - 1.0
        return jnp.maximum(unit, 0.0).reshape(t.shape)

    return at
