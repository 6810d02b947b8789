"""Packed response tokens: the update's per-token work on real tokens only, not on padding.

A batch of N responses is a padded grid [N, R]: the sampler stops each response at its EOS, so on a
real model at temperature 1 some 40 % of the grid is padding after the responses' ends. Every
per-token operation of the update (projections, SwiGLU, norms, RoPE, the vocabulary pass) costs the
same on a padding position as on a token. Packing gathers the tokens that matter into a dense
buffer and runs those operations on it; only attention, which needs the (row, column) layout,
scatters its inputs back onto the grid for a moment.

Layout. The rows are split into S contiguous blocks, one per batch shard of the mesh (the batch is
sharded contiguously over (data, fsdp)), so a block's tokens stay on the device that holds its
rows and the gathers and scatters move no data between devices. Block s keeps, row-major, the
positions c < len_r of its rows r, where len_r is one past the row's last real token (the tokens
before it that the mask zeroes, if any, are kept too: they are queries in the padded forward and
predict the next token), then pads to `capacity` with the out-of-range index rows_per_block * R.
A gather reads zeros at such an index and a scatter drops it, so the padding entries never touch
the grid.

The capacity C is static (part of the compiled program's shape): the host rounds the largest
block's count up to a bucket (`packed_capacity`), so batches whose lengths fall in the same
bucket share one compilation. Buckets are the multiples of M (`linear`: at most M - 1 padding
entries, up to full / M programs) or a geometric ladder M x {1, 2, 3, 4, 6, 8, 12, ...}
(`geometric`: about 2 log2(full / M) programs, padding under max(M, a third of the capacity)),
for a chip on which a compilation costs far more than the padding's compute. Since the largest
block sets C for all of them, the host first deals whole groups to the blocks so that their token
counts come out even (`balanced_group_order`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stare_jax import parallel


class Packing(NamedTuple):
    """The static layout of a packed forward: `shards` row blocks of `capacity` entries each."""

    capacity: int
    shards: int


def block_count(mesh, rows: int) -> int:
    """Row blocks of a packed forward over `rows` rows on `mesh`: one per batch shard when the
    shards divide the rows, else 1 (the rows are then not split over the batch axes either)."""
    shards = 1 if mesh is None else parallel.batch_divisor(mesh)
    return shards if rows % shards == 0 else 1


def kept_lengths(response_mask) -> np.ndarray | jax.Array:
    """len_r = 1 + the column of row r's last nonzero mask entry (0 for an empty row), [N]."""
    xp = jnp if isinstance(response_mask, jax.Array) else np
    R = response_mask.shape[-1]
    cols = xp.arange(1, R + 1, dtype=np.int32)
    return xp.max(xp.where(response_mask > 0, cols, 0), axis=-1)


PACK_BUCKETS = ("linear", "geometric")


def bucket_capacity(count: int, multiple: int, buckets: str = "linear") -> int:
    """The smallest bucket >= `count` (and >= `multiple`): with `linear` buckets the next multiple
    of M = `multiple`; with `geometric` ones the next rung of M x {1, 2, 3, 4, 6, 8, 12, 16, ...}
    (M 2^k and 3 M 2^(k-1)), each rung from 2M on at most 1.5x the one below, so the padding stays
    under max(M, a third of the capacity) while the number of distinct capacities up to n grows as
    2 log2(n / M) instead of n / M."""
    if buckets not in PACK_BUCKETS:
        raise ValueError(f"unknown packing buckets {buckets!r} (one of {', '.join(PACK_BUCKETS)})")
    multiple = max(int(multiple), 1)
    count = max(int(count), 1)
    if buckets == "linear":
        return -(-count // multiple) * multiple
    units = 1  # the rung in multiples of M: 1, 2, 3, 4, 6, 8, 12, ... (from 2^k on 1.5x, from 3 2^(k-1) on 4/3x)
    while units * multiple < count:
        units = 2 if units == 1 else (units * 3 // 2 if units & (units - 1) == 0 else units * 4 // 3)
    return units * multiple


def packed_capacity(response_mask: np.ndarray, *, shards: int, multiple: int, micro_batches: int = 1,
                    buckets: str = "linear") -> int:
    """Host side: the static capacity C for a batch's [N, R] response mask (numpy).

    The rows are cut like the update cuts them: micro-batch k holds rows {i K + k} (K =
    `micro_batches`), each split into `shards` contiguous blocks; C is the largest block's kept
    token count rounded up to its bucket (`bucket_capacity` of `buckets` and the micro-batch's
    multiple, `multiple` / K rounded up: a device's K buffers then add up to about one bucket of
    `multiple`, padded as a single pass's would be, where a whole `multiple` per micro-batch
    padded four micro-batches of 1,401 tokens to 2,048 each), and at most the block's full grid
    (rows per block * R).
    """
    mask = np.asarray(response_mask)
    N, R = mask.shape
    if N % (micro_batches * shards):
        raise ValueError(f"{N} rows do not split into {micro_batches} micro-batches x {shards} shards")
    lengths = kept_lengths(mask).astype(np.int64)
    per_block = lengths.reshape(N // micro_batches, micro_batches).T.reshape(micro_batches, shards, -1).sum(-1)
    full = N // (micro_batches * shards) * R
    step = -(-max(int(multiple), 1) // micro_batches)
    return int(min(full, bucket_capacity(int(per_block.max()), step, buckets)))


def balanced_group_order(response_mask: np.ndarray, group_size: int, shards: int, *, swaps: bool = True) -> np.ndarray:
    """Host side: a row permutation [N] that moves whole groups of `group_size` rows between the
    `shards` contiguous row blocks so that the blocks' kept token counts are even.

    Greedy (longest processing time first): groups in decreasing token count, each to the block
    with the fewest tokens among those with room left (every block takes N / (G shards) groups);
    then, with `swaps`, pairwise swaps (`_refine_by_swaps`) while one lowers the fullest block
    (`swaps=False`: the greedy pass alone, for comparison). Inside a block the
    groups keep their original order. The identity when that is no more even than the order as it
    is, or when the groups do not divide evenly over the blocks.
    """
    mask = np.asarray(response_mask)
    N = mask.shape[0]
    B = N // group_size
    if shards <= 1 or N % group_size or B % shards:
        return np.arange(N)
    tokens = kept_lengths(mask).astype(np.int64).reshape(B, group_size).sum(axis=1)
    load, members = np.zeros(shards, np.int64), [[] for _ in range(shards)]
    for g in np.argsort(-tokens, kind="stable"):
        s = min((s for s in range(shards) if len(members[s]) < B // shards), key=lambda s: (load[s], s))
        members[s].append(g)
        load[s] += tokens[g]
    if swaps:
        members, load = _refine_by_swaps(tokens, members, load)
    if load.max() >= tokens.reshape(shards, -1).sum(axis=1).max():
        return np.arange(N)  # the order as it is is as even: keep it
    groups = np.concatenate([sorted(m) for m in members])
    return (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


def _refine_by_swaps(tokens: np.ndarray, members: list[list[int]], load: np.ndarray):
    """Local search on a partition of groups into equal-count blocks: while exchanging a group of
    the fullest block with a smaller group of another block lowers the pair's larger load below the
    fullest load, make the exchange that lowers it most (ties: the first found, so deterministic).
    Each exchange strictly lowers the fullest block or the number of blocks at the maximum, so it
    ends. On the real-model benchmark's recorded batches (8 groups of 8 over 2 blocks) it brings the
    fullest block from ~3x to ~1.5x the exact optimum's excess over half the batch
    (`scripts/packing_capacity_study.py`; docs/performance.md, "Even blocks, a finer packing
    multiple, and a disagreeing step left undone"). Returns (members, load), both updated."""
    load = load.copy()
    while True:
        f = int(np.argmax(load))
        best = None  # (the pair's larger load after the exchange, block, index in f, index in block)
        for b in range(len(members)):
            for i, gf in enumerate(members[f] if b != f else ()):
                for j, gb in enumerate(members[b]):
                    d = int(tokens[gf] - tokens[gb])
                    larger = max(load[f] - d, load[b] + d)
                    if d > 0 and larger < (load[f] if best is None else best[0]):
                        best = (larger, b, i, j)
        if best is None:
            return members, load
        _, b, i, j = best
        d = int(tokens[members[f][i]] - tokens[members[b][j]])
        members[f][i], members[b][j] = members[b][j], members[f][i]
        load[f] -= d
        load[b] += d


def balanced_micro_order(response_mask: np.ndarray, group_size: int, micro_batches: int, shards: int) -> np.ndarray:
    """Host side: a row permutation [N] that moves rows inside their groups of `group_size` so
    that the `micro_batches` strided micro-batches (micro-batch k: rows {i K + k}) hold even kept
    token counts in each of the `shards` contiguous row blocks (the buffers `packed_capacity`
    sizes by the fullest of them).

    With K dividing G, position p of a group falls in micro-batch p mod K, so every micro-batch
    keeps G / K rows of every group whatever the order inside it. Per block, group by group, the
    group's rows in decreasing token count each go to the micro-batch with the fewest tokens so far
    among those with room left in the group (longest processing time first). The identity when K
    is 1 or does not divide G, the groups do not divide evenly over the blocks, or the result is
    no more even than the order as it is.
    """
    mask = np.asarray(response_mask)
    N, G, K = mask.shape[0], int(group_size), int(micro_batches)
    identity = np.arange(N)
    if K <= 1 or G % K or N % G or (N // G) % shards:
        return identity
    tokens = kept_lengths(mask).astype(np.int64)
    order = identity.copy()
    per_block = N // shards
    for start in range(0, N, per_block):
        load = np.zeros(K, np.int64)
        for g in range(start, start + per_block, G):
            room = np.full(K, G // K)
            for r in g + np.argsort(-tokens[g:g + G], kind="stable"):
                k = min((k for k in range(K) if room[k]), key=lambda k: (load[k], k))
                order[g + (G // K - room[k]) * K + k] = r
                room[k] -= 1
                load[k] += tokens[r]

    def fullest(o):
        return tokens[o].reshape(N // K, K).T.reshape(K, shards, -1).sum(-1).max()

    return order if fullest(order) < fullest(identity) else identity


def packed_token_index(response_mask: jax.Array, capacity: int, shards: int) -> jax.Array:
    """[S, C] int32 positions (local row * R + column) of each row block's kept tokens, row-major,
    padded with the out-of-range index rows_per_block * R (see the module docstring)."""
    N, R = response_mask.shape
    per = N // shards * R
    keep = jnp.arange(R, dtype=jnp.int32)[None, :] < kept_lengths(response_mask)[:, None]
    keep = keep.reshape(shards, per)
    return jax.vmap(lambda k: jnp.nonzero(k, size=capacity, fill_value=per)[0].astype(jnp.int32))(keep)


def packed_inverse_index(index: jax.Array, rows: int, length: int) -> jax.Array:
    """[S, rows / S * length] int32: for each grid position of a row block, the packed entry that
    holds it, or C (out of range) where none does: the inverse of `packed_token_index`'s map, which
    is one-to-one on the kept positions. One integer scatter per forward; with it every move between
    the grid and the packed layout, and each one's gradient, is a gather (`gather_packed`,
    `scatter_packed`)."""
    S, C = index.shape
    per = rows // S * length
    entries = jnp.arange(C, dtype=jnp.int32)
    return jax.vmap(lambda i: jnp.full((per,), C, jnp.int32).at[i].set(entries, mode="drop"))(index)


def _take(x: jax.Array, src: jax.Array) -> jax.Array:
    """x [S, A, ...] -> [S, B, ...] with out[s, b] = x[s, src[s, b]], zeros where src[s, b] >= A."""
    return jax.vmap(lambda v, i: jnp.take(v, i, axis=0, mode="fill", fill_value=0))(x, src)


@jax.custom_vjp
def _take_blocks(x: jax.Array, src: jax.Array, inverse: jax.Array) -> jax.Array:
    """x [S, A, ...] -> [S, B, ...] with out[s, b] = x[s, src[s, b]], zeros where src[s, b] >= A.

    `src` is one-to-one on its in-range entries and `inverse` [S, A] is its inverse (B where no b
    reads a), so the gradient, dx[s, a] = g[s, inverse[s, a]], is another such gather rather than
    the scatter-add that autodiff of a gather makes (atomic adds on a GPU, a serial loop on a CPU),
    and it is exact: each dx entry receives at most one cotangent."""
    return _take(x, src)


def _take_blocks_fwd(x, src, inverse):
    return _take_blocks(x, src, inverse), (src, inverse)


def _take_blocks_bwd(res, g):
    src, inverse = res
    return _take_blocks(g, inverse, src), None, None


_take_blocks.defvjp(_take_blocks_fwd, _take_blocks_bwd)


def gather_packed(grid: jax.Array, index: jax.Array, inverse: jax.Array | None = None) -> jax.Array:
    """grid [N, R, ...] -> packed [S, C, ...]: the grid's entries at `index` (zeros at padding).
    With `inverse` (`packed_inverse_index`) its gradient is a gather too (`_take_blocks`)."""
    S = index.shape[0]
    blocks = grid.reshape((S, grid.shape[0] // S * grid.shape[1]) + grid.shape[2:])
    return _take(blocks, index) if inverse is None else _take_blocks(blocks, index, inverse)


def scatter_packed(packed: jax.Array, index: jax.Array, rows: int, length: int,
                   inverse: jax.Array | None = None) -> jax.Array:
    """packed [S, C, ...] -> grid [rows, length, ...] with the packed entries at `index` and zeros
    elsewhere (padding entries dropped); the inverse of `gather_packed` on the kept positions. With
    `inverse` (`packed_inverse_index`) it is computed as a gather by it, and so is its gradient."""
    S = index.shape[0]
    per = rows // S * length
    tail = packed.shape[2:]
    if inverse is not None:
        return _take_blocks(packed, inverse, index).reshape((rows, length) + tail)
    blocks = jax.vmap(lambda v, i: jnp.zeros((per,) + tail, packed.dtype).at[i].set(v, mode="drop"))(packed, index)
    return blocks.reshape((rows, length) + tail)


def packed_rows_and_columns(index: jax.Array, rows: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Global row and column [S, C] of each packed entry (padding entries get the block's last row
    and column 0; their values are dropped)."""
    S = index.shape[0]
    per_rows = rows // S
    local_row = jnp.minimum(index // length, per_rows - 1)
    row = local_row + (jnp.arange(S, dtype=jnp.int32) * per_rows)[:, None]
    return row, index % length
