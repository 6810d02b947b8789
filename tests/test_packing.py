"""Packed responses (`ppo.pack_tokens`, models/packing.py): the layout, the packed forward against
the padded one, and the update step with packing against the same step on the padded grid."""

import jax
import numpy as np
import pytest

from stare_jax import parallel
from stare_jax.compilation import CompilationCounter
from stare_jax.models.packing import (balanced_group_order, balanced_micro_order, gather_packed, kept_lengths, packed_capacity, packed_rows_and_columns,
                                      packed_token_index, scatter_packed)
from stare_jax.rl import make_update_step
from tests.test_rl_update import (G, N, P_LEN, VOCAB, assert_trees_close, fresh_state, make_config, params_of,
                                  update_once)

R = 16
LENGTHS = np.array([16, 3, 1, 9, 5, 16, 2, 11])


def long_batch(lengths=LENGTHS, seed=0):
    """N = 8 responses of up to R = 16 tokens in groups of G = 4, ending at `lengths`, with one
    masked token inside row 3 (kept as a query, as in the padded forward)."""
    rs = np.random.RandomState(seed)
    prompts = np.repeat(rs.randint(3, VOCAB, (N // G, P_LEN)), G, axis=0)
    pm = np.ones((N, P_LEN), np.int32)
    pm[G:, :1] = 0
    rm = (np.arange(R)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    rm[3, 4] = 0
    ids = np.concatenate([np.where(pm > 0, prompts, 0), np.where(rm > 0, rs.randint(3, VOCAB, (N, R)), 0)], 1)
    am = np.concatenate([pm, (np.arange(R)[None] < np.asarray(lengths)[:, None])], 1).astype(np.int32)
    am[3, P_LEN + 4] = 0
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 1], np.float32)
    old = np.where(rm > 0, -3.5 + 0.2 * rs.randn(N, R), 0).astype(np.float32)
    return dict(input_ids=ids.astype(np.int32), attention_mask=am, response_mask=rm, old_log_probs=old,
                rewards=rewards)


def test_layout_capacity_index_and_round_trip():
    mask = long_batch()["response_mask"]
    assert kept_lengths(mask).tolist() == LENGTHS.tolist()  # the hole in row 3 does not end it
    # 2 row blocks: rows 0-3 keep 16+3+1+9 = 29 tokens, rows 4-7 keep 5+16+2+11 = 34.
    assert packed_capacity(mask, shards=2, multiple=1) == 34
    assert packed_capacity(mask, shards=2, multiple=8) == 40
    assert packed_capacity(mask, shards=2, multiple=1000) == 4 * R  # never above the block's grid
    # 2 micro-batches (rows {2i}, {2i + 1}) of 2 blocks: {16, 1}, {5, 2}, {3, 9}, {16, 11} -> 27.
    assert packed_capacity(mask, shards=2, multiple=1, micro_batches=2) == 27
    # each micro-batch rounds to multiple / K: 27 -> 28 with 8 / 2 (a whole 8 would pad it to 32)
    assert packed_capacity(mask, shards=2, multiple=8, micro_batches=2) == 28
    assert packed_capacity(mask, shards=2, multiple=7, micro_batches=2) == 28  # 7 / 2 rounded up: 4
    with pytest.raises(ValueError, match="split"):
        packed_capacity(mask, shards=3, multiple=1)

    # Group balancing: groups of 2 rows with 30, 28, 2 and 4 tokens; blocks {30 + 28, 2 + 4} become
    # {30 + 2, 28 + 4}, whole groups moving, each block keeping its groups in their order.
    skewed = (np.arange(R)[None] < np.array([15, 15, 14, 14, 1, 1, 2, 2])[:, None]).astype(np.float32)
    order = balanced_group_order(skewed, 2, 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert packed_capacity(skewed[order], shards=2, multiple=1) == 32 < packed_capacity(skewed, shards=2, multiple=1)
    assert balanced_group_order(mask, 4, 2).tolist() == list(range(N))  # two groups: no better order
    assert balanced_group_order(skewed, 2, 3).tolist() == list(range(N))  # 4 groups do not split in 3

    index = np.asarray(packed_token_index(jax.numpy.asarray(mask), 34, 2))
    assert index.shape == (2, 34)
    assert index[0, :17].tolist() == list(range(16)) + [R]          # row 0, then row 1 from column 0
    assert (index[0, 29:] == 4 * R).all() and (index[1] < 4 * R).all()  # padding only where a block is short
    row, col = map(np.asarray, packed_rows_and_columns(jax.numpy.asarray(index), N, R))
    assert row[1, 0] == 4 and col[0, 16] == 0 and row[0, 16] == 1
    grid = np.arange(N * R * 2, dtype=np.float32).reshape(N, R, 2) + 1
    packed = gather_packed(jax.numpy.asarray(grid), jax.numpy.asarray(index))
    assert np.asarray(packed)[0, 29:].sum() == 0  # padding entries read zeros
    back = np.asarray(scatter_packed(packed, jax.numpy.asarray(index), N, R))
    keep = np.arange(R)[None] < LENGTHS[:, None]
    np.testing.assert_array_equal(back[keep], grid[keep])
    assert back[~keep].sum() == 0


@pytest.fixture(scope="module")
def mesh4():
    return parallel.make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:4])


@pytest.mark.parametrize("overrides", [{},
                                       {"update.ppo_epochs": 2, "update.num_minibatches": 2, "loss.kl_type": "k3",
                                        "loss.kl_coef": 0.1, "update.share_prompt": False, "loss.name": "hapo"}])
def test_packed_update_equals_the_padded_update(mesh4, overrides):
    """The update step with `ppo.pack_tokens` gives the metrics and parameters of the step on the
    padded grid (the single pass; several optimizer steps over micro-batches with a KL reference and
    one prompt per row), on a 4-shard mesh where every row block packs its own tokens."""
    batch = long_batch([13, 3, 1, 9, 5, 12, 2, 11])
    (_, m_padded, p_padded), (step, m_packed, p_packed) = (
        update_once(make_config(**overrides, **{"update.pack_tokens": pack}), mesh4, batch,
                    ref="loss.kl_type" in overrides) for pack in (0, 1))
    packing = step.packing(batch)  # really packed: under each row block's grid of N / (micro-batches x 4) rows
    assert packing.shards == 4 and packing.capacity < N // (step.settings.num_micro * 4) * R
    for k in m_padded:
        np.testing.assert_allclose(m_packed[k], m_padded[k], atol=2e-6, rtol=5e-5, err_msg=k)
    assert m_padded["loss"] != 0.0 and m_padded["grad_norm"] > 0.0
    # AdamW's m / sqrt(v) turns float32 rounding of a near-zero gradient into up to a few % of lr = 1e-4
    assert_trees_close(p_packed, p_padded, atol=5e-6)


def test_micro_batches_balanced_inside_groups_give_the_padded_update():
    """With several micro-batches of one mini-batch, `arrange` also moves rows inside their groups
    so the strided micro-batches hold even token counts (`balanced_micro_order`): in group 0 (one
    group a row block) micro-batch 0, rows {0, 2}, held 16 + 9 tokens and micro-batch 1 1 + 3, in
    group 1 5 + 2 and 16 + 11; balanced, every row stays in its group, the fullest block holds 18
    tokens instead of 27, and the update still equals the padded one."""
    lengths = np.array([16, 1, 9, 3, 5, 16, 2, 11])
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    order = balanced_micro_order(mask, 4, 2, 2)
    assert sorted(order.tolist()) == list(range(N)) and (order // 4 == np.arange(N) // 4).all()
    assert order.tolist() == [0, 2, 1, 3, 5, 7, 6, 4]  # {16, 1} and {9, 3}; {16, 2} and {11, 5}
    fullest = lambda o: packed_capacity(mask[o], shards=2, multiple=1, micro_batches=2)  # noqa: E731
    assert fullest(order) == 18 < fullest(np.arange(N)) == 27
    assert balanced_micro_order(mask, 4, 3, 2).tolist() == list(range(N))  # 3 does not divide G = 4
    assert balanced_micro_order(mask, 4, 1, 2).tolist() == list(range(N))

    mesh2 = parallel.make_mesh(data=2, devices=jax.devices()[:2])
    batch = long_batch(lengths)
    overrides = {"update.grad_accum": 2, "loss.name": "hapo"}
    _, m_padded, p_padded = update_once(make_config(**overrides), mesh2, batch)
    config = make_config(**overrides, **{"update.pack_tokens": 1})
    ts = fresh_state(config, mesh2)
    step = make_update_step(config, mesh2, ts)
    arranged, packing = step.arrange(batch)
    assert not np.array_equal(arranged["input_ids"], batch["input_ids"]) and packing.capacity == 18
    ts, m = step(ts, parallel.shard_batch(arranged, mesh2), jax.random.key(0), packing=packing)
    for k in m_padded:
        np.testing.assert_allclose(float(m[k]), m_padded[k], atol=2e-6, rtol=5e-5, err_msg=k)
    assert m_padded["loss"] != 0.0
    assert_trees_close(params_of(ts), p_padded, atol=5e-6)
    # several mini-batches: rows stay where they are (which rows a mini-batch holds would change)
    other = make_update_step(make_config(**{"update.num_minibatches": 2, "update.pack_tokens": 1}), mesh2, ts)
    assert other.arrange(batch)[0] is batch


def test_packed_capacity_buckets_bound_recompilation(mesh4):
    """Batches whose capacities round to the same multiple share one compiled step; a longer batch
    compiles once more. The packing is computed from host memory, and a wrong `ppo.pack_tokens` is
    refused by the settings."""
    config = make_config(**{"update.pack_tokens": 8})
    ts = fresh_state(config, mesh4)
    step = make_update_step(config, mesh4, ts)
    counter = CompilationCounter()
    capacities = []
    for lengths in ([16, 3, 1, 9, 5, 16, 2, 11], [12, 3, 1, 9, 5, 16, 2, 11], [16, 16, 16, 16, 5, 16, 2, 11]):
        batch = long_batch(lengths)
        arranged, packing = step.arrange(batch)
        assert arranged is batch  # 2 groups over 4 shards: nothing to balance
        ts, m = step(ts, parallel.shard_batch(batch, mesh4), jax.random.key(0), packing=packing)
        jax.block_until_ready(m)
        capacities.append((packing.capacity, counter.take()))
    assert capacities[0][0] == capacities[1][0] == 24 and capacities[2][0] == 32
    assert capacities[0][1] > 0 and capacities[1][1] == 0 and capacities[2][1] > 0
    assert step.full_packing(N, R).capacity == 2 * R
    with pytest.raises(ValueError, match="pack_tokens"):
        from stare_jax.rl import RLSettings
        RLSettings.from_config(make_config(**{"update.pack_tokens": -1}))


def test_geometric_buckets_bound_the_number_of_capacities_and_their_padding():
    """`ppo.pack_buckets = "geometric"`: capacities M x {1, 2, 3, 4, 6, 8, 12, 16, ...}, so a
    16,384-token grid at M = 1,024 has 8 possible programs instead of 16, with the padding under
    max(M, a third of the capacity); "linear" is the multiples of M as before."""
    from stare_jax.models.packing import bucket_capacity

    assert [bucket_capacity(c, 1, "geometric") for c in range(1, 18)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    counts = range(1, 16385)
    geometric = {c: bucket_capacity(c, 1024, "geometric") for c in counts}
    assert sorted(set(geometric.values())) == [1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384]
    assert len({bucket_capacity(c, 1024, "linear") for c in counts}) == 16
    assert all(c <= cap and cap - c < max(1024, cap / 3) for c, cap in geometric.items())
    assert all(bucket_capacity(c, 1024) == -(-c // 1024) * 1024 for c in (1, 1023, 1024, 1025, 16384))
    with pytest.raises(ValueError, match="buckets"):
        bucket_capacity(5, 4, "cubic")

    mask = long_batch()["response_mask"]  # 2 row blocks keep 29 and 34 tokens
    assert packed_capacity(mask, shards=2, multiple=4) == 36
    assert packed_capacity(mask, shards=2, multiple=4, buckets="geometric") == 48  # 4 x 12
    assert packed_capacity(mask, shards=2, multiple=33, buckets="geometric") == 4 * R  # 66 capped at the block's grid


def test_update_step_takes_its_capacity_buckets_from_the_config(mesh4, capsys):
    """The update step rounds with `update.pack_buckets` (the config's `ppo.pack_buckets`; linear by
    default); an unknown value is refused by the settings and, on the command line, with exit 2 and
    one line naming the key."""
    import os

    from stare_jax import config as config_lib
    from stare_jax.rl import RLSettings

    batch = long_batch()  # 4 row blocks of 2 rows: 19, 10, 21 and 13 tokens
    capacity = {}
    for buckets in ("linear", "geometric"):
        config = make_config(**{"update.pack_tokens": 2, "update.pack_buckets": buckets})
        step = make_update_step(config, mesh4, fresh_state(config, mesh4))
        capacity[buckets] = step.packing(batch).capacity
    assert capacity == {"linear": 22, "geometric": 24}  # 2 x 11, against 2 x 12 on the ladder
    assert RLSettings.from_config(make_config(**{"update.pack_tokens": 2})).pack_buckets == "linear"
    with pytest.raises(ValueError, match="pack_buckets"):
        RLSettings.from_config(make_config(**{"update.pack_buckets": "cubic"}))
    assert config_lib.default_config().ppo.pack_buckets == "linear"
    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.py")
    c = config_lib.load_config_or_exit(["train", "--config", quickstart, "--config.ppo.pack_buckets=geometric"])
    assert c.ppo.pack_buckets == "geometric" and RLSettings.from_config(c).pack_buckets == "geometric"
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(["train", "--config", quickstart, "--config.ppo.pack_buckets=cubic"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "ppo.pack_buckets" in err and len(err.splitlines()) == 1


def test_moves_between_the_layouts_are_gathers_with_exact_gradients():
    """With the inverse index (`packed_inverse_index`) `gather_packed` and `scatter_packed` give the
    same values as without it, and gradients equal to the bit to autodiff's, computed by gathers:
    no scatter-add in the gradient's program (a GPU runs one with atomic adds, a CPU as a loop)."""
    from stare_jax.models.packing import packed_inverse_index

    mask = long_batch()["response_mask"]
    for shards, capacity in ((1, 80), (2, 40), (4, 24)):
        index = packed_token_index(jax.numpy.asarray(mask), capacity, shards)
        inverse = packed_inverse_index(index, N, R)
        assert inverse.shape == (shards, N // shards * R)
        kept = np.asarray(index) < N // shards * R  # the packed entries that hold a token
        for s in range(shards):  # one-to-one: the inverse sends each kept position back to its entry
            np.testing.assert_array_equal(np.asarray(inverse)[s][np.asarray(index)[s][kept[s]]],
                                          np.arange(capacity)[kept[s]])
        assert int((np.asarray(inverse) < capacity).sum()) == int(kept.sum())
        keys = jax.random.split(jax.random.key(shards), 4)
        grid = jax.random.normal(keys[0], (N, R, 3))
        packed = jax.random.normal(keys[1], (shards, capacity, 3))
        to_packed = lambda x, *inv: (gather_packed(x, index, *inv) * jax.random.normal(keys[2], (shards, capacity, 3))).sum()  # noqa: E731
        to_grid = lambda x, *inv: (scatter_packed(x, index, N, R, *inv) * jax.random.normal(keys[3], (N, R, 3))).sum()  # noqa: E731
        np.testing.assert_array_equal(gather_packed(grid, index, inverse), gather_packed(grid, index))
        np.testing.assert_array_equal(scatter_packed(packed, index, N, R, inverse), scatter_packed(packed, index, N, R))
        np.testing.assert_array_equal(jax.grad(to_packed)(grid, inverse), jax.grad(to_packed)(grid))
        np.testing.assert_array_equal(jax.grad(to_grid)(packed, inverse), jax.grad(to_grid)(packed))
        for f, x in ((to_packed, grid), (to_grid, packed)):
            with_inverse = str(jax.make_jaxpr(jax.grad(f))(x, inverse))
            assert "scatter-add" not in with_inverse and "scatter_add" not in with_inverse
        assert "scatter-add" in str(jax.make_jaxpr(jax.grad(to_packed))(grid))  # autodiff's own gradient


def test_group_balancing_swaps_groups_after_the_greedy_pass():
    """Longest-first dealing leaves 23 / 19 tokens for single-row groups of 10, 9, 8, 7, 6 and 2
    tokens over two blocks of three ({10, 7, 6} / {9, 8, 2}); exchanging the 10 for the 8 evens
    them at 21 / 21, which the swap search finds, each block keeping its rows in order."""
    lengths = np.array([10, 9, 8, 7, 6, 2])
    mask = (np.arange(12)[None] < lengths[:, None]).astype(np.float32)
    assert balanced_group_order(mask, 1, 2, swaps=False).tolist() == [0, 3, 4, 1, 2, 5]  # the greedy pass: 23 / 19
    order = balanced_group_order(mask, 1, 2)
    assert order.tolist() == [2, 3, 4, 0, 1, 5]
    assert mask[order].reshape(2, -1).sum(1).tolist() == [21, 21]
    assert packed_capacity(mask[order], shards=2, multiple=1) == 21 < packed_capacity(mask, shards=2, multiple=1)
    # four blocks: every block ends within the largest group's size of the mean, never above the greedy pass
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 64, size=32)
        mask = (np.arange(64)[None] < lengths[:, None]).astype(np.float32)
        order = balanced_group_order(mask, 2, 4)
        assert sorted(order.tolist()) == list(range(32))
        assert all(sorted(order[k:k + 2].tolist()) == [order[k] // 2 * 2, order[k] // 2 * 2 + 1]
                   for k in range(0, 32, 2))  # whole groups move
        loads = mask[order].reshape(4, -1).sum(1)
        assert loads.max() <= mask.sum() / 4 + lengths.reshape(16, 2).sum(1).max()
