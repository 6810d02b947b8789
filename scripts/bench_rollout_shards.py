"""The static rollout's loops per device against one program over the mesh, timed in one process.

On a data-parallel mesh whose batch shards divide the prompts, `sampler.rollout_shards` gives each
device its own decode loop (one `jax.shard_map`) wherever one program over the mesh would hold a
collective in its loop; for the static sampler that is whenever rows can end early (EOS ids or stop
lengths: its loop condition reduces the rows' done flags over the devices every decode step) or it
compacts (rows move). This script builds `sampler.grouped_rollout` both ways for the same spec
(the one-program form by tracing it with `rollout_shards` answering 1), checks that both give the
same responses, then times them alternating over `--rounds` rounds in one process (on a 2-vCPU VM
the drift between processes is larger than the difference) and prints JSON: per form the median
and every round's seconds, its decode steps and rows stepped, the loops per device that the rule
chose, the speed-up and the host's CPU. Response lengths: every row `--new-tokens` (`--mix fixed`)
or drawn uniformly from 1 .. `--new-tokens` with seed 0 (`--mix uniform`), set by stop lengths with
EOS id 0 on.

    python scripts/bench_rollout_shards.py --model runs/bench_models/synthetic_default --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/bench_models/synthetic_default",
                    help="Hugging Face directory (bench_step.py writes the synthetic ones, --model smollm2 the real one)")
    ap.add_argument("--rows", type=int, default=64, help="responses")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mix", choices=("fixed", "uniform"), default="fixed", help="response lengths (above)")
    ap.add_argument("--compact-min-rows", type=int, default=0, help="rollout.compact_min_rows (0: off)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cpu-devices", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if min(args.rows, args.group_size, args.prompt_len, args.new_tokens, args.rounds) < 1 or args.cpu_devices < 2:
        ap.error("--rows, --group-size, --prompt-len, --new-tokens and --rounds must be >= 1, --cpu-devices >= 2")
    if args.rows % (args.group_size * args.cpu_devices):
        ap.error(f"--rows {args.rows} must be a multiple of --group-size x --cpu-devices "
                 f"({args.group_size} x {args.cpu_devices}): each device takes whole prompts")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    sys.path.insert(0, os.path.join(HERE, "bench_peers"))
    sys.path.insert(0, os.path.dirname(HERE))
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # the malloc `python -m stare_jax.train` runs with (oneTBB's on CPU)
    print(json.dumps(run(args), indent=1))


def run(args) -> dict:
    """Both forms' results and times (the module docstring)."""
    import common
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import numpy as np
    from flax import nnx

    from stare_jax import allocator, parallel
    from stare_jax.models import from_pretrained
    from stare_jax.rollout import sampler

    mesh = parallel.make_mesh(data=args.cpu_devices, devices=jax.devices()[:args.cpu_devices])
    policy = from_pretrained(args.model, mesh=mesh, load_tokenizer=False)
    graphdef, state = nnx.split(policy.model)
    prompts = args.rows // args.group_size
    rng = np.random.default_rng(0)
    ids = rng.integers(3, policy.config.vocab_size, size=(prompts, args.prompt_len)).astype(np.int32)
    lengths = (np.full(args.rows, args.new_tokens) if args.mix == "fixed"
               else rng.integers(1, args.new_tokens + 1, size=args.rows)).astype(np.int32)
    inputs = jax.device_put((jax.numpy.asarray(ids), jax.numpy.ones_like(ids), jax.random.key(0),
                             jax.numpy.asarray(lengths)), parallel.replicated(mesh))
    spec = sampler.rollout_spec(policy.model.dtype, state, rows=args.rows, group_size=args.group_size,
                                max_new_tokens=args.new_tokens, eos_ids=(0,), pad_id=0, mesh=mesh,
                                compact_min_rows=args.compact_min_rows)
    loops = sampler.rollout_shards(mesh, prompts, args.group_size, early_stop=True)
    forms = {"per_device": sampler._compiled_rollout.__wrapped__(graphdef, spec, True)}
    with mock.patch.object(sampler, "rollout_shards", lambda *a, **k: 1):  # traced at its first call
        forms["one_program"] = sampler._compiled_rollout.__wrapped__(graphdef, spec, True)
        first = {"one_program": jax.block_until_ready(forms["one_program"](state, *inputs))}
    first["per_device"] = jax.block_until_ready(forms["per_device"](state, *inputs))
    (a, steps_a), (b, steps_b) = first["one_program"], first["per_device"]
    same = bool(np.array_equal(np.asarray(a.response_ids), np.asarray(b.response_ids)))
    times = {k: [] for k in forms}
    order = list(forms)
    for r in range(args.rounds):
        for k in order[r % 2:] + order[:r % 2]:
            t0 = time.perf_counter()
            jax.block_until_ready(forms[k](state, *inputs))
            times[k].append(time.perf_counter() - t0)
    out = {"host_cpu": common.host_cpu(), "malloc": allocator.name(), "devices": args.cpu_devices,
           "model": args.model, "rows": args.rows, "group_size": args.group_size, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "mix": args.mix, "compact_min_rows": args.compact_min_rows,
           "useful_tokens": int(lengths.sum()), "loops_per_device_rule": loops, "same_responses": same,
           "max_log_prob_difference": float(np.abs(np.asarray(a.log_probs) - np.asarray(b.log_probs)).max()),
           "forms": {}}
    for k, steps in (("one_program", steps_a), ("per_device", steps_b)):
        out["forms"][k] = {"median_s": round(statistics.median(times[k]), 4), "all_s": [round(t, 4) for t in times[k]],
                           "decode_steps": int(steps[0]), "rows_stepped": int(steps[1])}
    out["speedup"] = round(out["forms"]["one_program"]["median_s"] / out["forms"]["per_device"]["median_s"], 3)
    return out


if __name__ == "__main__":
    main()
