"""Compacting static rollouts (`generate(..., compact_min_rows=m)`, `rollout.compact_min_rows`,
issue 20): once at most half the decode rows are live the live ones move into a batch of half the
rows. The same responses as the uncompacted sampler for the same keys; the host replay
`compaction_schedule` predicts the rows the device stepped; new length outcomes do not recompile."""

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax import parallel
from stare_jax.compilation import CompilationCounter
from stare_jax.models import from_pretrained
from stare_jax.rollout import generate, sampler
from tests import hf_fixtures
from tests.test_rollout import policies, prompts  # noqa: F401  (the same tiny policies and prompts)
from tests.test_rollout_slots import (PAD, SAMPLED, assert_rollout_count_key, assert_same_rollout, lengths_of,
                                      rollout_loop_collectives)


def device_steps(policy, ids, mask, rng, stop, *, min_rows, **kw):
    """(result, (decode steps, rows stepped)) of the compacting static rollout, from its `with_steps` jit."""
    graphdef, state = nnx.split(getattr(policy, "model", policy))
    spec = sampler.RolloutSpec(group_size=kw["group_size"], max_new_tokens=kw["max_new_tokens"],
                               eos_ids=tuple(kw.get("eos_ids", ())), pad_id=PAD,
                               sampling=sampler.SamplingParams(float(kw.get("temperature", 1.0))),
                               decode_segments=kw.get("decode_segments", 1), compact_min_rows=min_rows,
                               feature_major=sampler.feature_major_decode("auto", state))
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, rng, stop)
    return result, (int(steps[0]), int(steps[1]))


@pytest.mark.parametrize("min_rows,segments", [(1, 1), (3, 4), (2, 3)])
def test_sampled_compaction_equals_static(policies, min_rows, segments):
    """EOS at varied steps (3 prompts x 4 responses, 13 tokens): every stage down to `min_rows`
    rows, inside the decode blocks of any split, gives the static sampler's responses."""
    ids, mask = prompts()
    for name in ("qwen2", "llama"):
        ref = generate(policies[name], ids, mask, rng=jax.random.key(3), **SAMPLED)
        got = generate(policies[name], ids, mask, rng=jax.random.key(3), compact_min_rows=min_rows,
                       decode_segments=segments, **SAMPLED)
        assert_same_rollout(got, ref)
        plan = sampler.compaction_schedule(lengths_of(ref), sampler.decode_stages(12, min_rows))
        assert sum(k > 0 for _, k in plan["stages"]) >= 2, (name, plan)  # it did compact
        assert plan["row_steps"] < 12 * plan["decode_steps"]


def test_greedy_compaction_with_empty_rows_and_device_steps(policies):
    """Greedy with stop lengths that leave fewer live rows than a stage holds (empty rows), and
    natural EOS: the same rollout, and the device's decode steps and rows stepped are the host
    replay's (12 rows: 12 until step 1, then 6 with one empty, then 3)."""
    ids, mask = prompts()
    policy = policies["llama"]
    stop = np.array([1, 1, 12, 1, 1, 1, 12, 1, 12, 9, 12, 1], np.int32)
    kw = dict(group_size=4, max_new_tokens=12, eos_ids=(), temperature=1.0)
    ref = generate(policy, ids, mask, rng=None, greedy=True, pad_id=PAD, stop_lengths=stop,
                   **{k: v for k, v in kw.items() if k != "temperature"})
    got = generate(policy, ids, mask, rng=None, greedy=True, pad_id=PAD, stop_lengths=stop, compact_min_rows=3,
                   **{k: v for k, v in kw.items() if k != "temperature"})
    assert_same_rollout(got, ref)
    stages = sampler.decode_stages(12, 3)
    assert stages == [12, 6, 3]
    plan = sampler.compaction_schedule(lengths_of(ref), stages)
    # live before step t: 5 rows for t = 1..8 (one of them stops at 9), then 4 until 11.
    assert plan["stages"] == [[12, 0], [6, 11], [3, 0]] and plan["row_steps"] == 66
    sampled, steps = device_steps(policy, ids, mask, jax.random.key(7), stop, min_rows=3, **kw)
    unsampled = generate(policy, ids, mask, rng=jax.random.key(7), pad_id=PAD, stop_lengths=stop, **kw)
    assert_same_rollout(sampled, unsampled)
    assert steps == (plan["decode_steps"], plan["row_steps"])


def test_compaction_on_a_mesh_with_filtered_sampling(tiny_checkpoints, policies):
    """top-k + top-p on qwen3 with EOS and stop lengths: compacted on one device and on a 2x2x2
    mesh (8 rows over 4 batch shards: stages 8 and 4), the rollout of the static sampler."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3), total=7)
    stop = np.array([10, 2, 7, 10, 1, 3, 1, 2], np.int32)
    kw = dict(rng=jax.random.key(9), group_size=4, max_new_tokens=10, eos_ids=(2, 5), temperature=0.9, top_k=40,
              top_p=0.95, stop_lengths=stop)
    ref = generate(policies["qwen3"], ids, mask, **kw)
    assert_same_rollout(generate(policies["qwen3"], ids, mask, compact_min_rows=2, **kw), ref)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    assert sampler.decode_stages(8, 1, parallel.batch_divisor(mesh)) == [8, 4]
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh, load_tokenizer=False)
    multi = generate(sharded, ids, mask, compact_min_rows=1, **kw)
    assert multi.tokens.sharding.spec[0] == parallel.BATCH_AXES
    assert_same_rollout(multi, ref)
    assert sampler.compaction_schedule(lengths_of(ref), [8, 4])["stages"][1][1] > 0


@pytest.mark.parametrize("layout,min_rows", [(dict(data=4, tensor=2), 4), (dict(data=2), 2), (dict(data=4, tensor=2), 0),
                                             (dict(data=2), 0)],
                         ids=["dp4-tp2-compacting", "dp2-compacting", "dp4-tp2", "dp2"])
def test_a_static_rollout_whose_rows_can_end_early_runs_one_loop_per_device(tiny_checkpoints, policies, layout,
                                                                            min_rows):
    """On a mesh whose batch shards divide the prompts (weights not FSDP-sharded) a static rollout
    whose rows can end early (EOS ids, stop lengths) runs one loop per device
    (`sampler.rollout_shards`), compacting (`min_rows` > 0) or not: one program over the mesh would
    gather rows when it compacts, and reduce the rows' done flags over the devices in its loop
    condition every decode step either way. The one-device static sampler's responses, outputs
    split over the batch axes, no collective in any while loop's body or condition beyond tensor
    parallelism's own (the one-program form on an FSDP mesh has them), and the devices' steps and
    rows stepped as `compaction_schedule(..., shards=D)` replays them: each device compacts, or
    stops, with its own rows. A fixed trip count (no EOS ids, no stop lengths) stays one program."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3, 5, 1), total=7)
    stop = np.array([10, 2, 7, 10, 1, 3, 1, 2, 4, 9, 2, 2, 8, 1, 1, 3], np.int32)
    kw = dict(group_size=4, max_new_tokens=10, eos_ids=(2, 5), temperature=0.9, compact_min_rows=min_rows)
    ref = generate(policies["qwen3"], ids, mask, rng=jax.random.key(9), stop_lengths=stop, **dict(kw, compact_min_rows=0))
    mesh = parallel.make_mesh(**layout, devices=jax.devices()[:int(np.prod(list(layout.values())))])
    shards = parallel.batch_divisor(mesh)
    assert sampler.rollout_shards(mesh, 4, 4, early_stop=True) == shards
    assert sampler.rollout_shards(mesh, 4, 4) == 1  # a fixed trip count: one program, no collective in its loop
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh, load_tokenizer=False)
    got = generate(sharded, ids, mask, rng=jax.random.key(9), stop_lengths=stop, **kw)
    assert_same_rollout(got, ref)
    for name in ("tokens", "response_ids", "log_probs"):
        assert {s.data.shape[0] for s in getattr(got, name).addressable_shards} == {16 // shards}, name
    inside, steps = rollout_loop_collectives(sharded, mesh, (ids, mask, jax.random.key(9), stop), rows=16, **kw)
    assert not inside
    stages = sampler.decode_stages(16, min_rows, shards)
    plan = sampler.compaction_schedule(lengths_of(ref), stages, shards)
    assert (int(steps[0]), int(steps[1])) == (plan["decode_steps"], plan["row_steps"])
    if min_rows:
        assert len(stages) > 2 and any(k > 0 for shard in plan["stages"] for _, k in shard[1:])  # it compacted
    else:
        assert plan["row_steps"] < 16 * plan["decode_steps"]  # a device whose rows were done stopped early
    fsdp = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    on_fsdp = from_pretrained(tiny_checkpoints["qwen3"], mesh=fsdp, load_tokenizer=False)
    assert rollout_loop_collectives(on_fsdp, fsdp, (ids, mask, jax.random.key(9), stop), rows=16, **kw)[0]


def test_new_length_outcomes_do_not_recompile(policies):
    ids, mask = prompts()
    model = policies["qwen2"]
    generate(model, ids, mask, rng=jax.random.key(0), compact_min_rows=2, **SAMPLED)
    counter = CompilationCounter()
    seen = set()
    for seed in (1, 2, 4):
        seen.add(tuple(lengths_of(generate(model, ids, mask, rng=jax.random.key(seed), compact_min_rows=2,
                                           **SAMPLED))))
    assert counter.take() == 0 and len(seen) > 1


def test_decode_stages_and_schedule_by_hand():
    assert sampler.decode_stages(64, 0) == [64]
    assert sampler.decode_stages(64, 16) == [64, 32, 16]
    assert sampler.decode_stages(64, 17) == [64, 32]
    assert sampler.decode_stages(12, 1) == [12, 6, 3]
    assert sampler.decode_stages(64, 1, divisor=16) == [64, 32, 16]
    # Lengths 5, 1, 2, 3, 4 on stages 5, 2: live before steps 1..4 = 4, 3, 2, 1 -> 5, 5, 2, 2 rows.
    plan = sampler.compaction_schedule([5, 1, 2, 3, 4], [5, 2])
    assert plan["decode_steps"] == 4 and plan["row_steps"] == 14 and plan["busy_row_steps"] == 10
    assert plan["stages"] == [[5, 2], [2, 2]] and plan["idle_share"] == pytest.approx(4 / 14)
    assert sampler.compaction_schedule([1, 1], [2, 1])["decode_steps"] == 0
    # Two shards, [5, 1, 2, 3] and [4, 1, 2, 1], each on stages 4, 2: live before steps 1..4 = 3, 2,
    # 2, 1 -> 4, 2, 2, 2 rows; and before steps 1..3 = 2, 1, 1 -> 2, 2, 2 rows.
    plan = sampler.compaction_schedule([5, 1, 2, 3, 4, 1, 2, 1], [8, 4], shards=2)
    assert plan["decode_steps"] == 4 and plan["row_steps"] == 10 + 6 and plan["busy_row_steps"] == 7 + 4
    assert plan["stages"] == [[[4, 1], [2, 3]], [[4, 0], [2, 3]]]
    with pytest.raises(ValueError, match="shards"):
        sampler.compaction_schedule([5, 1, 2], [3], shards=2)


def test_rejects_bad_compact_min_rows(policies, capsys):
    ids, mask = prompts()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="compact_min_rows"):
            generate(policies["qwen2"], ids, mask, rng=jax.random.key(0), group_size=2, max_new_tokens=3,
                     compact_min_rows=bad)
    assert_rollout_count_key(capsys, "compact_min_rows")
