"""Rollout throughput on a length-skewed batch: the static sampler vs slot-refilling (issue 20).

Response lengths are fixed up front, independent of the model: drawn from a log-normal whose
95th percentile is `--ratio` (default 10) times its 5th, scaled so that the 95th percentile is
`--p95` x `--new-tokens`, rounded and clipped to [1, --new-tokens], from `--seed`
(`--length-mix fixed` makes every response `--new-tokens` long instead; `--length-mix recorded
--lengths-from OUT.json[:k]` takes the response lengths of step k of a `bench_step.py --model`
run, the mix the real-model workload produced). They are enforced by
`generate(..., stop_lengths=...)` with no EOS ids: response r ends after exactly lengths[r]
tokens in both samplers (one compare per row and step, the same cost in both), tokens are
sampled at temperature 1 as usual. Both samplers produce the same responses (checked).

Reports, in one JSON line printed last, per sampler: useful tokens/s (sum of the response
lengths / median wall time), decode steps, and the share of idle slot-steps (rows or slots
stepped while holding no unfinished response; from `stare_jax.rollout.slots.schedule`, which
replays the assignment, and checked against the device's step count), plus the slot sampler's
speed-up over static and the recorded length mix (seed, parameters, percentiles, realised
p95/p5 ratio). `same_responses` says whether every sampler reproduced the static sampler's
tokens; `identical_responses`, per slot count, the share of responses that did (at temperature 1
on a near-flat distribution a float-rounding difference between batch shapes can flip a sampled
token, and the rest of that response then differs).

    python scripts/bench_rollout_skew.py [--batch 64] [--group-size 8] [--new-tokens 256]
        [--slots 32[,16]] [--static-rows 32[,16]] [--compact 16[,8]] [--length-mix lognormal|fixed|recorded]
        [--repeats 5]
        [--model HF_DIR]

`--compact M` adds the static sampler compacting its live rows down to M decode rows
(`rollout.compact_min_rows`), with its decode steps, rows stepped and stages from the host replay
`sampler.compaction_schedule`, checked against the device's counts.
`--static-rows S` adds the static sampler run S rows at a time (S / G prompts per call, calls one
after the other, each decoding until its own longest response ends): the same KV-cache memory as
S slots, which is the comparison that matters when the batch does not fit on the device at once
(many more responses than rows, as in evaluation or large RL batches). Its responses have the
same lengths but are sampled with per-call keys, so they are not compared token for token.

The default model is a random Qwen2-style decoder built in JAX (hidden 256, 4 layers, 4 heads /
2 KV heads, vocab 1024, tied embeddings), the shape of `scripts/bench_rollout.py`; `--model`
loads a Hugging Face directory instead (e.g. the converted SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_peers"))

import common  # noqa: E402  (scripts/bench_peers/common.py: host facts shared by the benchmarks)

VOCAB = 1024
Z95 = 1.6448536269514722  # standard normal 95th percentile


def length_mix(kind: str, n: int, max_len: int, *, ratio: float, p95: float, seed: int) -> tuple[np.ndarray, dict]:
    """(lengths int [n] in [1, max_len], record): the response lengths of the benchmark and what
    reproduces them. Log-normal: sigma = ln(ratio) / (2 z_0.95), so p95 / p5 = ratio, and the
    median puts the 95th percentile at p95 * max_len."""
    if kind == "fixed":
        return np.full(n, max_len, np.int64), {"dist": "fixed", "length": max_len}
    sigma = np.log(ratio) / (2 * Z95)
    median = p95 * max_len / np.exp(Z95 * sigma)
    draw = np.random.default_rng(seed).lognormal(np.log(median), sigma, n)
    lengths = np.clip(np.rint(draw), 1, max_len).astype(np.int64)
    q = lambda p: float(np.percentile(lengths, p))  # noqa: E731
    record = {"dist": "lognormal", "seed": seed, "ratio_p95_p5": ratio, "p95_target": round(p95 * max_len, 2),
              "sigma": round(float(sigma), 4), "median": round(float(median), 2), "p5": q(5), "p50": q(50),
              "p95": q(95), "max": int(lengths.max()), "mean": round(float(lengths.mean()), 2),
              "clipped": int((draw >= max_len).sum()), "realised_ratio_p95_p5": round(q(95) / max(q(5), 1), 2)}
    return lengths, record


def recorded_mix(source: str, n: int, max_len: int) -> tuple[np.ndarray, dict]:
    """(lengths, record) of a step the real-model workload generated: `source` is a
    `bench_step.py` JSON output, optionally with ":<step>" (default 0), whose stare-jax
    `per_step[step].response_lens` (n of them, each at most max_len) become the mix."""
    path, _, step = source.partition(":")
    try:
        with open(path) as f:
            steps = json.load(f)["participants"]["stare-jax"]["per_step"]
        lengths = np.asarray(steps[int(step or 0)]["response_lens"], np.int64)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SystemExit(f"bench_rollout_skew: --lengths-from {source!r}: no stare-jax per_step response_lens "
                         f"({type(e).__name__}: {e})")
    if lengths.size != n or lengths.min() < 1 or lengths.max() > max_len:
        raise SystemExit(f"bench_rollout_skew: --lengths-from {source!r}: {lengths.size} lengths in "
                         f"[{lengths.min()}, {lengths.max()}], the benchmark needs {n} in [1, {max_len}]")
    q = lambda p: float(np.percentile(lengths, p))  # noqa: E731
    return lengths, {"dist": "recorded", "source": source, "p5": q(5), "p50": q(50), "p95": q(95),
                     "max": int(lengths.max()), "mean": round(float(lengths.mean()), 2),
                     "at_max": int((lengths == max_len).sum()), "realised_ratio_p95_p5": round(q(95) / max(q(5), 1), 2)}


def random_model(dtype: str, seed: int = 0):
    """A random Qwen2-style `Decoder` (the shape of scripts/bench_rollout.py), built in JAX."""
    import jax.numpy as jnp
    from flax import nnx

    from stare_jax.models.config import ModelConfig
    from stare_jax.models.decoder import Decoder

    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                      qkv_bias=True, max_position_embeddings=4096, pad_token_id=0)
    return Decoder(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))


def make_prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int = 0):
    """Left-padded random prompts [num_prompts, prompt_len], lengths between prompt_len/2 and prompt_len."""
    rs = np.random.RandomState(seed)
    lengths = rs.randint(prompt_len // 2, prompt_len + 1, num_prompts)
    mask = (np.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).astype(np.int32)
    ids = np.where(mask > 0, rs.randint(1, vocab, (num_prompts, prompt_len)), 0).astype(np.int32)
    return ids, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="responses per call (prompts x group size)")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    ap.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens (the longest possible response)")
    ap.add_argument("--prompt-len", type=int, default=32, help="padded prompt length")
    ap.add_argument("--slots", default="",
                    help="comma-separated slot counts (default: batch / 2 for lognormal, batch for fixed; "
                         "'none': no slot sampler, e.g. to time compaction alone)")
    ap.add_argument("--static-rows", default="",
                    help="comma-separated row counts: the static sampler run that many rows at a time as well")
    ap.add_argument("--compact", default="",
                    help="comma-separated minimum row counts: the static sampler with compaction down to that "
                         "many rows (`rollout.compact_min_rows`) as well")
    ap.add_argument("--length-mix", choices=("lognormal", "fixed", "recorded"), default="lognormal",
                    help="recorded: the lengths of one real-model step, from --lengths-from")
    ap.add_argument("--lengths-from", default="",
                    help="a bench_step.py JSON output[:step]: its stare-jax step's response lengths "
                         "(with --length-mix recorded)")
    ap.add_argument("--ratio", type=float, default=10.0, help="log-normal p95 / p5 length ratio")
    ap.add_argument("--p95", type=float, default=0.5, help="log-normal p95 length as a fraction of --new-tokens")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each runs every sampler once)")
    ap.add_argument("--model", default="", help="Hugging Face directory (default: a random Qwen2-style decoder)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--cpu-devices", type=int, default=1, help="JAX CPU devices (rows split over them when > 1)")
    args = ap.parse_args()
    if min(args.repeats, args.batch, args.group_size, args.new_tokens, args.prompt_len, args.cpu_devices) < 1:
        ap.error("--repeats, --batch, --group-size, --new-tokens, --prompt-len and --cpu-devices must be >= 1")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    if args.batch % args.group_size:
        ap.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size}")
    if (args.length_mix == "recorded") != bool(args.lengths_from):
        ap.error("--length-mix recorded and --lengths-from go together")
    if not (args.ratio > 1 and 0 < args.p95 <= 1):
        ap.error("--ratio must be > 1 and --p95 in (0, 1]")
    try:
        slot_counts = [] if args.slots == "none" else [int(s) for s in args.slots.split(",") if s] or [
            args.batch if args.length_mix == "fixed" else max(1, args.batch // 2)]
    except ValueError:
        ap.error(f"--slots: comma-separated integers or 'none', got {args.slots!r}")
    if slot_counts and min(slot_counts) < 1:
        ap.error("--slots must be positive")
    try:
        static_rows = [int(s) for s in args.static_rows.split(",") if s]
        compact_rows = [int(s) for s in args.compact.split(",") if s]
    except ValueError:
        ap.error(f"--static-rows and --compact: comma-separated integers, got {args.static_rows!r} and {args.compact!r}")
    if min(compact_rows, default=1) < 1:
        ap.error("--compact: each must be a positive row count")
    if any(r < 1 or r % args.group_size or args.batch % r for r in static_rows):
        ap.error("--static-rows: each must be a multiple of --group-size that divides --batch")

    t_start = time.perf_counter()

    def progress(what: str) -> None:  # stderr: a run cut off by a deadline shows where it was
        print(f"[bench_rollout_skew] {what} at {time.perf_counter() - t_start:.1f}s", file=sys.stderr, flush=True)

    from stare_jax import allocator, distributed, parallel

    distributed.use_cpu_devices(args.cpu_devices)
    import jax

    from stare_jax.models import from_pretrained
    from stare_jax.rollout import generate, sampler, slots

    mesh = parallel.make_mesh(data=args.cpu_devices) if args.cpu_devices > 1 else None
    if args.model:
        policy = from_pretrained(args.model, dtype=args.dtype, mesh=mesh, load_tokenizer=False)
        vocab = policy.model.config.vocab_size
    else:
        if mesh is not None:
            ap.error("--cpu-devices > 1 needs --model (the random model is built on one device)")
        policy, vocab = random_model(args.dtype), VOCAB
    progress(f"model ready on {jax.devices()[0].device_kind}")
    ids, mask = make_prompts(args.batch // args.group_size, args.prompt_len, vocab)
    if args.length_mix == "recorded":
        lengths, mix = recorded_mix(args.lengths_from, args.batch, args.new_tokens)
    else:
        lengths, mix = length_mix(args.length_mix, args.batch, args.new_tokens, ratio=args.ratio, p95=args.p95,
                                  seed=args.seed)
    kw = dict(group_size=args.group_size, max_new_tokens=args.new_tokens, eos_ids=(), temperature=1.0,
              stop_lengths=lengths.astype(np.int32), pad_id=0)

    def run(num_slots, seed: int):
        if isinstance(num_slots, tuple):  # ("compact", min rows): the static sampler, compacting
            out = generate(policy, ids, mask, rng=jax.random.key(seed), compact_min_rows=num_slots[1], **kw)
            return jax.block_until_ready(out)
        if num_slots < 0:  # the static sampler, -num_slots rows per call
            rows = -num_slots
            p = rows // args.group_size
            out = None
            for c in range(args.batch // rows):
                out = generate(policy, ids[c * p:(c + 1) * p], mask[c * p:(c + 1) * p],
                               rng=jax.random.fold_in(jax.random.key(seed), c), slots=0,
                               **dict(kw, stop_lengths=kw["stop_lengths"][c * rows:(c + 1) * rows]))
            return jax.block_until_ready(out)
        out = generate(policy, ids, mask, rng=jax.random.key(seed), slots=num_slots, **kw)
        return jax.block_until_ready(out)

    def steps_on_device(**spec_fields) -> tuple[int, int]:
        """The (decode steps, second count) a sampler's `with_steps` rollout reports (`_compiled_rollout`)."""
        from flax import nnx

        graphdef, state = nnx.split(getattr(policy, "model", policy))
        spec = sampler.RolloutSpec(group_size=args.group_size, max_new_tokens=args.new_tokens, eos_ids=(), pad_id=0,
                                   sampling=sampler.SamplingParams(), mesh=mesh,
                                   feature_major=sampler.feature_major_decode("auto", state), **spec_fields)
        _, steps = sampler._compiled_rollout(graphdef, spec, True)(state, ids, mask, jax.random.key(0),
                                                                   lengths.astype(np.int32))
        return int(steps[0]), int(steps[1])

    names = {0: "static", **{-r: f"static_rows{r}" for r in static_rows}, **{s: f"slots{s}" for s in slot_counts},
             **{("compact", m): f"static_compact{m}" for m in compact_rows}}
    for r in static_rows:
        run(-r, 0)  # warm-up (compilation at this row count)
    reference = run(0, 0)  # warm-up (compilation) and the responses every sampler must reproduce
    progress("static sampler compiled")
    got_lengths = np.asarray(reference.response_mask).sum(axis=1)
    assert (got_lengths == lengths).all(), "stop_lengths did not set the response lengths"
    same = True
    identical = {}  # share of responses token-for-token equal to the static sampler's, per slot count
    device_steps = {}
    for m in compact_rows:
        out = run(("compact", m), 0)
        got, want = np.asarray(out.response_ids), np.asarray(reference.response_ids)
        same &= bool(np.array_equal(got, want))
        identical[("compact", m)] = round(float((got == want).all(axis=1).mean()), 4)
        device_steps[("compact", m)] = steps_on_device(compact_min_rows=m)
        progress(f"compacting sampler ({m} rows) compiled and checked")
    for s in slot_counts:
        out = run(s, 0)
        got, want = np.asarray(out.response_ids), np.asarray(reference.response_ids)
        same &= bool(np.array_equal(got, want))
        identical[s] = round(float((got == want).all(axis=1).mean()), 4)
        device_steps[s] = steps_on_device(slots=min(s, args.batch))
        progress(f"slot sampler ({s} slots) compiled and checked")
    times: dict[int, list[float]] = {s: [] for s in names}
    order = list(names)
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        for s in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            run(s, r + 1)
            times[s].append(time.perf_counter() - t0)
        progress(f"timed round {r + 1} of {args.repeats}")
    load_after = os.getloadavg()[0]
    useful = int(lengths.sum())
    report = {"length_mix": mix, "batch": args.batch, "group_size": args.group_size,
              "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "repeats": args.repeats,
              "useful_tokens": useful, "same_responses": same}
    static_tps = useful / statistics.median(times[0])
    for s, name in names.items():
        median = statistics.median(times[s])
        if isinstance(s, tuple):
            loops = sampler.rollout_shards(mesh, args.batch // args.group_size, args.group_size,
                                           early_stop=True)  # its stop lengths end the rows
            plan = sampler.compaction_schedule(lengths, sampler.decode_stages(args.batch, s[1], args.cpu_devices), loops)
            if (plan["decode_steps"], plan["row_steps"]) != device_steps[s]:
                raise AssertionError(f"compaction schedule {plan['decode_steps']}, {plan['row_steps']} != device "
                                     f"{device_steps[s]} (decode steps, row steps)")
            report[name] = {"median_s": round(median, 4), "useful_tokens_per_s": round(useful / median, 1),
                            "decode_steps": plan["decode_steps"], "row_steps": plan["row_steps"],
                            "stages": plan["stages"], "idle_share": round(plan["idle_share"], 4),
                            "identical_responses": identical[s],
                            "speedup_vs_static": round(useful / median / static_tps, 3)}
            continue
        rows = s if s > 0 else args.batch
        loops = sampler.rollout_shards(mesh, args.batch // args.group_size, args.group_size, slots=min(rows, args.batch))
        plan = slots.schedule(lengths, rows, loops)
        entry = {"median_s": round(median, 4), "useful_tokens_per_s": round(useful / median, 1)}
        if s == 0:
            entry |= {"decode_steps": plan["static_decode_steps"], "rows": args.batch,
                      "idle_share": round(plan["static_idle_share"], 4)}
        elif s < 0:
            chunks = lengths.reshape(-1, -s)
            steps = int((chunks.max(axis=1) - 1).sum())
            entry |= {"decode_steps": steps, "rows": -s, "idle_share": round(1 - int((lengths - 1).sum()) / (steps * -s), 4),
                      "speedup_vs_static": round(useful / median / static_tps, 3)}
        else:
            if plan["decode_steps"] != device_steps[s][0]:
                raise AssertionError(f"schedule {plan['decode_steps']} != device {device_steps[s][0]} decode steps")
            entry |= {"decode_steps": plan["decode_steps"], "rows": min(s, args.batch),
                      "idle_share": round(plan["idle_share"], 4),
                      "shared_prompt_steps": device_steps[s][1], "identical_responses": identical[s],
                      "speedup_vs_static": round(useful / median / static_tps, 3)}
            if s in static_rows:  # the same rows in flight: the same KV-cache memory
                entry["speedup_vs_static_same_rows"] = round(statistics.median(times[-s]) / median, 3)
        report[name] = entry
    report |= {"model": args.model or "random-qwen2-256x4", "dtype": args.dtype, "devices": jax.device_count(),
               "platform": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
               "load_avg_before": round(load_before, 2), "load_avg_after": round(load_after, 2),
               "jax": jax.__version__, "host_cpu": common.host_cpu(), "malloc": allocator.name()}
    print(json.dumps(report))


if __name__ == "__main__":
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # the malloc `python -m stare_jax.train` runs with (oneTBB's on CPU)
    main()
