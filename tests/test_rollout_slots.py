"""Slot-refilling rollouts (`generate(..., slots=S)`, issue 20): the same responses as the static
sampler for the same keys, at any slot count, without recompiling for new length outcomes."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax import config as config_lib
from stare_jax import parallel
from stare_jax.compilation import CompilationCounter
from stare_jax.models import from_pretrained
from stare_jax.rollout import generate, sampler, slots
from tests import hf_fixtures
from tests.test_rollout import policies, prompts  # noqa: F401  (the same tiny policies and prompts)

FREQUENT = (2, 5, 7, 11, 13)  # EOS ids common enough on the tiny models that rows stop at varied steps
PAD = 0


def assert_same_rollout(got, ref):
    """Identical tokens, masks and truncation flags; log-probs within 1e-5."""
    for name in ("tokens", "attention_mask", "response_ids", "response_mask", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(ref.log_probs), atol=1e-5, rtol=0)
    assert got.prompt_len == ref.prompt_len


def lengths_of(result):
    return np.asarray(result.response_mask).sum(axis=1)


SAMPLED = dict(group_size=4, max_new_tokens=13, eos_ids=FREQUENT, temperature=0.8, pad_id=PAD)


@pytest.fixture(scope="module")
def sampled_reference(policies):
    """The static sampler's rollout of 3 prompts x 4 responses (qwen2), with varied lengths."""
    ids, mask = prompts()
    ref = generate(policies["qwen2"], ids, mask, rng=jax.random.key(3), **SAMPLED)
    lengths = lengths_of(ref)
    assert len(set(lengths.tolist())) >= 4 and np.asarray(ref.truncated).any(), lengths
    return ref


# Fewer slots than responses (1 and 5), as many (12), and more (clamped to 12); the decode loop
# split into blocks of columns (13 columns: 1, 3, 4 and 2 blocks).
@pytest.mark.parametrize("num_slots,segments", [(1, 1), (5, 3), (12, 4), (40, 2)])
def test_sampled_slots_equal_static(policies, sampled_reference, num_slots, segments):
    ids, mask = prompts()
    got = generate(policies["qwen2"], ids, mask, rng=jax.random.key(3), slots=num_slots, decode_segments=segments,
                   **SAMPLED)
    assert_same_rollout(got, sampled_reference)


def test_token_stats_are_the_teacher_forced_entropy_and_q_in_every_sampler(policies, sampled_reference):
    """`token_stats=True` (what `ppo.old_stats = "sampler"` asks for): the same tokens and log-probs,
    and each response position's entropy and Q equal those of the teacher-forced policy at
    temperature 1 (sampling at 0.8), 0 where masked; the static batch, the compacting static batch
    and the slot sampler agree."""
    from stare_jax.rl.logprobs import naive_token_stats

    ids, mask = prompts()
    policy = policies["qwen2"]
    ref = sampled_reference
    logits = policy(ref.tokens, ref.attention_mask)[:, ref.prompt_len - 1:-1]
    expected = naive_token_stats(logits, ref.response_ids)
    response = np.asarray(ref.response_mask) > 0
    assert ref.entropy is None and ref.pi2_dev is None
    runs = {"static": {}, "compacting": dict(compact_min_rows=3), "slots": dict(slots=5, decode_segments=3)}
    for name, extra in runs.items():
        got = generate(policy, ids, mask, rng=jax.random.key(3), token_stats=True, **SAMPLED, **extra)
        assert_same_rollout(got, ref)
        for field in ("entropy", "pi2_dev"):
            value = np.asarray(getattr(got, field))
            np.testing.assert_allclose(value[response], np.asarray(getattr(expected, field))[response], atol=2e-5,
                                       rtol=1e-4, err_msg=f"{name} {field}")
            assert (value[~response] == 0).all(), (name, field)
        assert np.asarray(got.entropy)[response].min() > 0.1  # real spread, not zeros


def test_greedy_slots_equal_static_with_forced_and_natural_eos(policies):
    """Greedy (rows of a group identical until they stop): stop lengths vary the ends inside each
    group, and EOS ids taken from the free greedy continuations end rows earlier on their own."""
    ids, mask = prompts()
    policy = policies["llama"]
    free = np.asarray(generate(policy, ids, mask, rng=None, group_size=1, max_new_tokens=12, greedy=True).response_ids)
    eos = tuple(dict.fromkeys(int(x) for x in (free[0, 2], free[1, 4]) if x not in free[0, :2]))
    stop = np.array([3, 13, 6, 1, 9, 2, 13, 4, 7, 5, 11, 8], np.int32)
    kw = dict(rng=None, group_size=4, max_new_tokens=12, eos_ids=eos, greedy=True, pad_id=PAD, stop_lengths=stop)
    ref = generate(policy, ids, mask, **kw)
    got = generate(policy, ids, mask, slots=3, **kw)
    assert_same_rollout(got, ref)
    lengths = lengths_of(ref)
    assert (lengths <= np.minimum(stop, 12)).all() and (lengths < np.minimum(stop, 12)).any(), lengths
    ends = np.asarray(ref.response_ids)[np.arange(12), lengths - 1]
    assert np.isin(ends[lengths < 12], eos).all()   # natural ends, and forced ones (the first EOS id)
    assert not np.asarray(ref.truncated)[lengths < 12].any()


def test_filtered_sampling_and_sharded_slots_equal_static(tiny_checkpoints, policies):
    """top-k + top-p sampling on qwen3 with stop lengths; the slot sampler on a 2x2x2 mesh too."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3), total=7)
    stop = np.array([10, 2, 7, 10, 4, 9, 1, 6], np.int32)
    kw = dict(rng=jax.random.key(9), group_size=4, max_new_tokens=10, eos_ids=(2, 5), temperature=0.9, top_k=40,
              top_p=0.95, stop_lengths=stop)
    ref = generate(policies["qwen3"], ids, mask, **kw)
    assert_same_rollout(generate(policies["qwen3"], ids, mask, slots=3, **kw), ref)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh, load_tokenizer=False)
    multi = generate(sharded, ids, mask, slots=4, **kw)
    assert multi.tokens.sharding.spec[0] == parallel.BATCH_AXES
    assert_same_rollout(multi, ref)


def rollout_loop_collectives(policy, mesh, inputs, **spec_args):
    """([collectives inside the compiled rollout's while loops, bodies and conditions, that span more
    than one `tensor` group], the rollout's int32 [2] steps) for `sampler.rollout_spec(**spec_args)` on `mesh`, run on
    `inputs` (prompt ids, mask, key, stop lengths; placed replicated as `generate` places them).
    Tensor parallelism's own sums (the heads' partial products) are the only ones a loop may hold."""
    import re

    from tests.test_rl_logprobs import _while_computations
    graphdef, state = nnx.split(policy.model)
    ids, mask, rng, stop = inputs
    placed = jax.device_put((jax.numpy.asarray(ids, np.int32), jax.numpy.asarray(mask, np.int32), rng,
                             jax.numpy.asarray(stop, np.int32)), parallel.replicated(mesh))
    spec = sampler.rollout_spec(policy.model.dtype, state, pad_id=PAD, mesh=mesh, **spec_args)
    compiled = sampler._compiled_rollout(graphdef, spec, True)
    loops = _while_computations(compiled.lower(state, *placed).compile().as_text())
    assert loops
    collective = re.compile(r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
    tensor_only = f"replica_groups=[{mesh.size // mesh.shape['tensor']},{mesh.shape['tensor']}]<=[{mesh.size}]"
    found = [line.strip() for body in loops.values() for line in body.splitlines() if collective.search(line)]
    return [line for line in found if tensor_only not in line], compiled(state, *placed)[1]


@pytest.mark.parametrize("layout,num_slots", [(dict(data=4, tensor=2), 4), (dict(data=2), 6)],
                         ids=["dp4-tp2-1slot", "dp2-3slots"])
def test_per_device_slot_loops_equal_static_hold_their_rows_and_no_loop_collective(tiny_checkpoints, policies,
                                                                                   layout, num_slots):
    """With a mesh whose batch shards divide the prompts and the slots, each device runs its own
    slot loop over its own prompts' responses (`sampler.rollout_shards`): the single-device static
    sampler's responses, every output split over the batch axes, no collective inside any while
    loop (the shared-queue form, with slots that do not divide, gathers inside its loop), and the
    longest device loop's decode steps as `slots.schedule(..., shards=D)` replays them."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3, 5, 1), total=7)
    stop = np.array([10, 2, 7, 10, 4, 9, 1, 6, 3, 8, 2, 5], np.int32)
    kw = dict(rng=jax.random.key(9), group_size=3, max_new_tokens=10, eos_ids=(2, 5), temperature=0.9,
              stop_lengths=stop)
    ref = generate(policies["qwen3"], ids, mask, **kw)
    mesh = parallel.make_mesh(**layout, devices=jax.devices()[:int(np.prod(list(layout.values())))])
    shards = parallel.batch_divisor(mesh)
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh, load_tokenizer=False)
    assert sampler.rollout_shards(mesh, 4, 3, num_slots) == shards > 1
    assert sampler.rollout_shards(parallel.make_mesh(data=2, fsdp=2, tensor=2), 4, 3, 4) == 1  # FSDP: the shared queue
    got = generate(sharded, ids, mask, slots=num_slots, **kw)
    assert_same_rollout(got, ref)
    for name in ("tokens", "response_ids", "log_probs", "truncated"):
        array = getattr(got, name)
        assert array.sharding.spec[0] == parallel.BATCH_AXES
        assert {s.data.shape[0] for s in array.addressable_shards} == {12 // shards}, name  # not replicated

    # Dynamic sampling's top-up (`num_groups`): the groups spread over the devices, each device's
    # first ones; those equal the full rollout's, the others come back empty.
    for k in (1, 3):
        limited = generate(sharded, ids, mask, slots=num_slots, num_groups=k, **kw)
        chosen = sampler.generated_groups(k, 4, group_size=3, slots=num_slots, mesh=mesh)
        assert chosen.sum() == k and chosen.tolist() == slots.wanted_groups(k, 4, shards).tolist()
        rows = np.repeat(chosen, 3)
        np.testing.assert_array_equal(np.asarray(limited.response_ids)[rows], np.asarray(ref.response_ids)[rows])
        assert lengths_of(limited)[~rows].sum() == 0 and not np.asarray(limited.truncated)[~rows].any()
    assert slots.wanted_groups(3, 4, 2).tolist() == [True, True, True, False]  # 2 + 1
    assert slots.wanted_groups(1, 4, 2).tolist() == [True, False, False, False]
    assert slots.wanted_groups(2, 4, 2).tolist() == [True, False, True, False]
    assert slots.wanted_groups(3, 4, 1).tolist() == [True, True, True, False]

    inputs = (ids, mask, jax.random.key(9), stop)

    def loop_collectives(num):
        """(the while-loop collectives over more than the tensor axis, the loop's decode steps)."""
        return rollout_loop_collectives(sharded, mesh, inputs, rows=12, group_size=3, max_new_tokens=10,
                                        eos_ids=(2, 5), temperature=0.9, slots=num)

    inside, steps = loop_collectives(num_slots)
    assert not inside  # (tensor parallelism's own sums stay: the heads' partial products)
    lengths = lengths_of(ref)
    assert int(steps[0]) == slots.schedule(lengths, num_slots, shards)["decode_steps"]
    assert slots.schedule(lengths, num_slots, shards)["decode_steps"] > slots.schedule(lengths, num_slots)["decode_steps"]
    assert loop_collectives(num_slots + 1)[0]  # the shared queue (slots not divisible) gathers inside its loop


def test_new_length_outcomes_do_not_recompile(policies, sampled_reference):
    """New keys (other EOS positions) and new stop lengths reuse the compiled slot rollout."""
    ids, mask = prompts()
    model = policies["qwen2"]
    generate(model, ids, mask, rng=jax.random.key(0), slots=5, **SAMPLED)
    counter = CompilationCounter()
    seen = set()
    for seed in (1, 2, 4):
        result = generate(model, ids, mask, rng=jax.random.key(seed), slots=5, **SAMPLED)
        seen.add(tuple(lengths_of(result)))
    assert counter.take() == 0 and len(seen) > 1
    rs = np.random.RandomState(0)
    generate(model, ids, mask, rng=jax.random.key(0), slots=5, stop_lengths=rs.randint(1, 14, 12), **SAMPLED)
    counter.take()
    for _ in range(2):
        generate(model, ids, mask, rng=jax.random.key(0), slots=5, stop_lengths=rs.randint(1, 14, 12), **SAMPLED)
    assert counter.take() == 0


def test_stop_lengths_set_lengths_and_schedule_counts_device_steps(policies):
    """Without EOS ids, stop lengths alone set every length (finished, not truncated); the host
    replay `slots.schedule` predicts the decode steps the device loop ran."""
    model = policies["qwen2"].model
    ids, mask = prompts()
    stop = np.array([1, 12, 3, 9, 2, 2, 12, 5, 20, 7, 1, 4], np.int32)
    kw = dict(rng=jax.random.key(5), group_size=4, max_new_tokens=12, eos_ids=(), stop_lengths=stop)
    ref = generate(model, ids, mask, **kw)
    np.testing.assert_array_equal(lengths_of(ref), np.minimum(stop, 12))
    np.testing.assert_array_equal(np.asarray(ref.truncated), stop > 12)
    graphdef, state = nnx.split(model)
    spec = sampler.RolloutSpec(group_size=4, max_new_tokens=12, eos_ids=(), pad_id=PAD,
                               sampling=sampler.SamplingParams(), slots=3)
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(5), stop)
    assert_same_rollout(result, ref)
    plan = slots.schedule(np.minimum(stop, 12), 3)
    assert int(steps[0]) == plan["decode_steps"]
    assert plan["busy_slot_steps"] == int((np.minimum(stop, 12) - 1).sum())


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (256, 64), (3, 4099)])
def test_uniforms_at_are_the_static_samplers_numbers_bit_for_bit(shape):
    """The slot sampler hashes only the numbers it needs (`sampling.uniforms_at`); they are the
    elements of jax.random.uniform(rng, (R, N)) exactly, for typed and raw keys, inside jit and out,
    and with the partitionable flag off (where it indexes the drawn array instead)."""
    from stare_jax.rollout.sampling import uniforms_at

    R, N = shape
    t, r = np.meshgrid(np.arange(R), np.arange(N), indexing="ij")
    for rng in (jax.random.key(11), jax.random.PRNGKey(5), jax.random.fold_in(jax.random.key(2), 9),
                jax.random.key(3, impl="rbg")):  # rbg: not threefry's counters, so the drawn array
        want = np.asarray(jax.random.uniform(rng, (R, N), np.float32))
        np.testing.assert_array_equal(np.asarray(uniforms_at(rng, (R, N))(t, r)), want)
        picked = jax.jit(lambda k, a, b: uniforms_at(k, (R, N))(a, b))(rng, t[::2, -1:], r[::2, -1:])
        np.testing.assert_array_equal(np.asarray(picked), want[::2, -1:])
    with jax.threefry_partitionable(False):
        rng = jax.random.key(4)
        np.testing.assert_array_equal(np.asarray(uniforms_at(rng, (R, N))(t, r)),
                                      np.asarray(jax.random.uniform(rng, (R, N), np.float32)))


def test_schedule_by_hand():
    # Lengths 1 need no decode step; work 4, 1, 2, 3 on 2 slots: slot 0 runs 4; slot 1 runs 1, 2, then 3 (steps 4-6).
    plan = slots.schedule([5, 1, 2, 3, 4], 2)
    assert plan["decode_steps"] == 6 and plan["slot_steps"] == 12 and plan["busy_slot_steps"] == 10
    assert plan["static_decode_steps"] == 4 and plan["static_slot_steps"] == 20
    assert plan["idle_share"] == pytest.approx(2 / 12) and plan["static_idle_share"] == pytest.approx(0.5)
    assert slots.schedule([3, 3], 5)["decode_steps"] == 2      # more slots than responses: one wave
    assert slots.schedule([1, 1], 2)["decode_steps"] == 0


def test_rejects_bad_slots_and_stop_lengths(policies):
    ids, mask = prompts()
    kw = dict(rng=jax.random.key(0), group_size=2, max_new_tokens=3, eos_ids=())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="slots"):
            generate(policies["qwen2"], ids, mask, slots=bad, **kw)
    with pytest.raises(ValueError, match="stop_lengths"):
        generate(policies["qwen2"], ids, mask, stop_lengths=np.ones(5, np.int32), **kw)


def assert_rollout_count_key(capsys, name: str):
    """`rollout.<name>` defaults to 0, takes 16 on the quickstart config and refuses -2 with one
    line naming the key (exit 2)."""
    assert getattr(config_lib.default_config().rollout, name) == 0
    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.py")
    c = config_lib.load_config_or_exit(["train", "--config", quickstart, f"--config.rollout.{name}=16"])
    assert getattr(c.rollout, name) == 16
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(["train", "--config", quickstart, f"--config.rollout.{name}=-2"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and f"rollout.{name}" in err and len(err.splitlines()) == 1


def test_config_key_rollout_slots(capsys):
    assert_rollout_count_key(capsys, "slots")


def test_bench_length_mix_has_the_recorded_ratio():
    """scripts/bench_rollout_skew.py: the log-normal mix has p95 / p5 = 10 and p95 at the target."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        "bench_rollout_skew.py")
    spec = importlib.util.spec_from_file_location("bench_rollout_skew", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths, mix = bench.length_mix("lognormal", 100000, 10**6, ratio=10.0, p95=0.001, seed=3)
    p5, p95 = np.percentile(lengths, [5, 95])
    assert p95 / p5 == pytest.approx(10.0, rel=0.03) and p95 == pytest.approx(1000, rel=0.03)
    assert mix["seed"] == 3 and mix["clipped"] == 0
    again, _ = bench.length_mix("lognormal", 100000, 10**6, ratio=10.0, p95=0.001, seed=3)
    np.testing.assert_array_equal(again, lengths)
    fixed, _ = bench.length_mix("fixed", 5, 7, ratio=10.0, p95=0.5, seed=0)
    assert fixed.tolist() == [7] * 5


def test_bench_recorded_length_mix_reads_a_bench_step_output(tmp_path):
    """`--length-mix recorded --lengths-from OUT.json[:k]` takes stare-jax's response lengths of
    step k of a bench_step.py output; a file without them, or lengths the batch cannot hold, stop
    the script with one line naming the file."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        "bench_rollout_skew.py")
    spec = importlib.util.spec_from_file_location("bench_rollout_skew", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench_step.json"
    steps = [{"response_lens": [3, 9, 9, 1]}, {"response_lens": [2, 2, 4, 9]}]
    out.write_text(json.dumps({"participants": {"stare-jax": {"per_step": steps}}}))
    lengths, mix = bench.recorded_mix(f"{out}:1", 4, 9)
    assert lengths.tolist() == [2, 2, 4, 9] and mix["dist"] == "recorded" and mix["at_max"] == 1
    assert bench.recorded_mix(str(out), 4, 9)[0].tolist() == [3, 9, 9, 1]
    for source, n, max_len in ((f"{out}:2", 4, 9), (str(out), 8, 9), (str(out), 4, 8), (str(tmp_path / "no"), 4, 9)):
        with pytest.raises(SystemExit) as exc:
            bench.recorded_mix(source, n, max_len)
        assert "--lengths-from" in str(exc.value) and "\n" not in str(exc.value)


def test_bench_rollout_skew_end_to_end_reports_each_sampler_and_its_progress():
    """`scripts/bench_rollout_skew.py` on a tiny mix: the slot sampler reproduces the static one's
    responses (same keys, `same_responses`), the schedules the report prints match the device's
    decode steps (the script asserts it), and each compilation and timed round is announced on
    stderr with its elapsed time."""
    import subprocess
    import sys

    from tests.e2e_helpers import ROOT, subprocess_env

    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_rollout_skew.py"), "--batch", "16",
                        "--group-size", "4", "--new-tokens", "16", "--repeats", "2", "--slots", "8",
                        "--static-rows", "8"], cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["same_responses"] is True and out["useful_tokens"] > 0
    assert out["slots8"]["identical_responses"] == 1.0 and out["slots8"]["rows"] == 8
    assert out["static"]["rows"] == 16 and out["static_rows8"]["rows"] == 8
    progress = [line.split(" at ")[0] for line in r.stderr.splitlines() if line.startswith("[bench_rollout_skew]")]
    assert progress == ["[bench_rollout_skew] model ready on cpu", "[bench_rollout_skew] static sampler compiled",
                        "[bench_rollout_skew] slot sampler (8 slots) compiled and checked",
                        "[bench_rollout_skew] timed round 1 of 2", "[bench_rollout_skew] timed round 2 of 2"]


def test_refills_per_step_are_capped_and_schedule_replays_the_cap(policies):
    """When more than REFILL_LANES slots free up together while responses are pending, only
    REFILL_LANES are refilled in that step (the rest the next step); responses stay the static
    sampler's and `schedule` predicts the device's decode steps."""
    assert slots.REFILL_LANES == 8
    # 24 responses of 3 tokens on 12 slots: all 12 end at step 2, 8 refill then, 4 at step 3.
    plan = slots.schedule([3] * 24, 12)
    assert plan["decode_steps"] == 5 and plan["busy_slot_steps"] == 48
    model = policies["qwen2"].model
    ids, mask = prompts()
    stop = np.full(ids.shape[0] * 8, 3, np.int32)
    kw = dict(rng=jax.random.key(7), group_size=8, max_new_tokens=6, eos_ids=(), stop_lengths=stop)
    ref = generate(model, ids, mask, **kw)
    graphdef, state = nnx.split(model)
    spec = sampler.RolloutSpec(group_size=8, max_new_tokens=6, eos_ids=(), pad_id=PAD,
                               sampling=sampler.SamplingParams(), slots=12)
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(7), stop)
    assert_same_rollout(result, ref)
    assert int(steps[0]) == slots.schedule(stop, 12)["decode_steps"]


def test_slot_groups_share_their_prompt_while_aligned(policies, sampled_reference):
    """With S a multiple of G, slot groups read one shared copy of their prompt's keys while every
    busy slot of a group answers that prompt: on equal lengths every decode step does (the waves
    refill whole groups), on varied lengths only the steps before the first unaligned refill; the
    responses are the static sampler's either way."""
    model = policies["qwen2"].model
    ids, mask = prompts()
    graphdef, state = nnx.split(model)
    stop = np.full(ids.shape[0] * 4, 5, np.int32)            # 12 responses of 5 tokens on 8 slots: two waves
    ref = generate(model, ids, mask, rng=jax.random.key(4), group_size=4, max_new_tokens=9, eos_ids=(),
                   stop_lengths=stop, temperature=0.8, pad_id=PAD)
    spec = sampler.RolloutSpec(group_size=4, max_new_tokens=9, eos_ids=(), pad_id=PAD,
                               sampling=sampler.SamplingParams(temperature=0.8), slots=8)
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(4), stop)
    assert_same_rollout(result, ref)
    assert int(steps[0]) == slots.schedule(stop, 8)["decode_steps"] == 8 and int(steps[1]) == int(steps[0])
    spec = sampler.RolloutSpec(group_size=4, max_new_tokens=13, eos_ids=FREQUENT, pad_id=PAD,
                               sampling=sampler.SamplingParams(temperature=0.8), slots=8)
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(3))
    assert_same_rollout(result, sampled_reference)
    assert 0 < int(steps[1]) < int(steps[0]) == slots.schedule(lengths_of(sampled_reference), 8)["decode_steps"]
    spec = sampler.RolloutSpec(group_size=4, max_new_tokens=13, eos_ids=FREQUENT, pad_id=PAD,    # 6 % 4 != 0:
                               sampling=sampler.SamplingParams(temperature=0.8), slots=6)    # per-slot copies only
    result, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(3))
    assert_same_rollout(result, sampled_reference)
    assert int(steps[1]) == 0


def test_num_groups_generates_only_the_wanted_groups_and_stops_early(policies, sampled_reference):
    """`num_groups=k` (dynamic sampling's top-up): the first k groups equal the full rollout's,
    later groups come back empty (mask 0, not truncated), the loop runs only the decode steps
    those k groups need, and new k values reuse the compiled program."""
    ids, mask = prompts()
    model = policies["qwen2"].model
    graphdef, state = nnx.split(model)
    spec = sampler.RolloutSpec(group_size=4, max_new_tokens=13, eos_ids=FREQUENT, pad_id=PAD,
                               sampling=sampler.SamplingParams(temperature=0.8), slots=5)
    run = sampler._compiled_rollout(graphdef, spec, True)
    _, full_steps = run(state, ids, mask, jax.random.key(3), None, np.int32(3))
    counter = CompilationCounter()
    got, steps = run(state, ids, mask, jax.random.key(3), None, np.int32(1))
    assert counter.take() == 0
    ref_lengths = lengths_of(sampled_reference)
    for name in ("response_ids", "response_mask", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[:4], np.asarray(getattr(sampled_reference, name))[:4])
    np.testing.assert_allclose(np.asarray(got.log_probs)[:4], np.asarray(sampled_reference.log_probs)[:4], atol=1e-5)
    assert lengths_of(got)[4:].sum() == 0 and not np.asarray(got.truncated)[4:].any()
    assert (np.asarray(got.response_ids)[4:] == PAD).all()
    assert int(steps[0]) == slots.schedule(ref_lengths[:4], 5)["decode_steps"] < int(full_steps[0])
    via_generate = generate(model, ids, mask, rng=jax.random.key(3), slots=5, num_groups=1, **SAMPLED)
    np.testing.assert_array_equal(np.asarray(via_generate.response_mask), np.asarray(got.response_mask))
    with pytest.raises(ValueError, match="slot sampler"):
        generate(model, ids, mask, rng=jax.random.key(3), num_groups=1, **SAMPLED)
    with pytest.raises(ValueError, match="num_groups"):
        generate(model, ids, mask, rng=jax.random.key(3), slots=5, num_groups=4, **SAMPLED)


def test_dynamic_sampling_tops_up_with_the_groups_it_expects_to_need():
    from stare_jax.dynamic_sampling import GroupBuffer, groups_to_generate

    buffer = GroupBuffer(target=8, group_size=2)
    assert groups_to_generate(buffer, 8) == 8               # nothing seen yet: a whole batch
    buffer.add({"r": np.zeros(16)}, np.array([1, 0, 1, 0, 1, 0, 1, 0], bool))
    assert groups_to_generate(buffer, 8) == 8               # 4 missing at a keep rate of 1/2
    buffer.add({"r": np.zeros(16)}, np.array([1, 1, 1, 0, 0, 0, 0, 0], bool))
    assert groups_to_generate(buffer, 8) == 3               # 1 missing at 7/16: ceil(16/7)
    empty = GroupBuffer(target=4, group_size=2)
    empty.add({"r": np.zeros(8)}, np.zeros(4, bool))
    assert groups_to_generate(empty, 4) == 4                # nothing kept yet: a whole batch


class _ScriptedPool:
    """Rewards by position from a script, one list of per-group rewards per call: a group's G
    responses get 0, 1, 0, 1, ... (spread) or all 0 (no spread). Records how many it scored."""

    def __init__(self, spread_per_call, group_size):
        self.script, self.G, self.scored = list(spread_per_call), group_size, []

    def score(self, texts, truths):
        spread = self.script.pop(0)
        self.scored.append(len(texts))
        rewards = [float(spread[i // self.G] and i % 2) for i in range(len(texts))]
        return rewards, {"reward_s": 0.0, "reward_calls": len(texts)}


@pytest.mark.parametrize("num_slots,devices", [(0, 1), (4, 1), (4, 2)])
def test_dynamic_sampling_with_slots_generates_only_the_missing_groups(tiny_model, num_slots, devices):
    """collect_batch with dynamic sampling: after a first batch keeps 3 of the 4 groups it needs,
    the slot sampler generates ceil(1 / (3/4)) = 2 groups of the next prompt batch (and the reward
    function sees only those), where the static sampler generates and scores all 4. On 2 devices,
    each running its own slot loop, the 2 groups are each device's first (groups 0 and 2)."""
    from stare_jax.models import from_pretrained
    from stare_jax.trainer import collect_batch

    model_dir, _ = tiny_model
    mesh = parallel.make_mesh(data=devices, devices=jax.devices()[:devices])
    policy = from_pretrained(model_dir, mesh=mesh)
    c = config_lib.default_config()
    c.data.prompt_batch_size, c.rollout.group_size, c.rollout.max_new_tokens = 4, 4, 6
    c.data.max_prompt_len, c.data.prompt_bucket_multiple = 5, 0
    c.dynamic_sampling.enabled, c.rollout.slots = True, num_slots
    c.ppo.grad_accum = 2 if devices == 2 else 1  # then the update reads the sampler's entropy and Q
    rs = np.random.RandomState(0)

    def prompt_batches():
        while True:
            yield {"prompt_ids": rs.randint(3, 20, (4, 5)).astype(np.int32), "prompt_mask": np.ones((4, 5), np.int32),
                   "ground_truth": np.array(["1"] * 4)}

    pool = _ScriptedPool([[1, 1, 0, 1], [0, 1, 0, 0]], group_size=4)
    batch, metrics = collect_batch(c, policy.model, policy.tokenizer, prompt_batches(), pool, jax.random.key(0),
                                   eos_ids=(), pad_id=PAD, mesh=mesh)
    assert pool.scored == [16, 8 if num_slots else 16]
    assert metrics["dynamic_sampling_gen_batches"] == 2 and batch["rewards"].shape == (16,)
    assert metrics["dynamic_sampling_kept_frac"] == (4 / 6 if num_slots else 4 / 8)
    assert (batch["response_mask"].sum(axis=1) == 6).all()  # every kept response was generated
    assert ("old_entropy" in batch) == ("old_pi2_dev" in batch) == (devices == 2)
    if devices == 2:  # kept groups of both generation batches, row for row with their log-probs
        assert batch["old_entropy"].shape == batch["old_log_probs"].shape == (16, 6)
        assert (batch["old_entropy"] > 0).all() and np.isfinite(batch["old_pi2_dev"]).all()
    # The second batch's second generated group is the one kept: group 1 of the batch, or on two
    # devices group 2 (device 1's first group; device 0 generated group 0).
    kept = 2 if num_slots and devices == 2 else 1
    replay = np.random.RandomState(0)
    second = [replay.randint(3, 20, (4, 5)) for _ in range(2)][1]
    np.testing.assert_array_equal(batch["input_ids"][12:16, :5], np.repeat(second[kept:kept + 1], 4, axis=0))
