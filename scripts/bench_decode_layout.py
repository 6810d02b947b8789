"""Decode speed of the real model under different device layouts of the same CPU host.

The rollout of a model whose weights do not fit in cache is bound by the bytes each decode step
reads. With the host split into one JAX device per core and the rows split over them (`data`),
every device reads its own replica of every weight each step; on one device (both cores inside
each matmul) or with the weights split over the devices (`tensor`) each weight is read once.
This script times `rollout.sampler.generate` on the same prompts, keys and fixed response lengths
(`stop_lengths`) in each layout, alternating layouts over `--rounds`, and prints JSON: per layout
the median and every round's seconds, seconds per decode step, and whether its tokens equal the
first layout's. `one_device` is what `mesh.rollout_devices = 1` decodes on
(`parallel.rollout_placement` of the data-parallel model). Each layout decodes with the sampler's
default layers (feature-major on CPU, `rollout.decode_layout`); `<layout>+row_major` (or
`--row-major`, every layout both ways) decodes row-major. With `--profile DIR` (one layout only)
one more rollout runs under `jax.profiler.trace` and the output adds `profile`: each device's time
by XLA op kind and by (kind, output shape) of the optimised program (dumped into DIR/hlo), which
tells the weight matmuls (YNNPACK fusions of output [rows, F]) from attention, cache writes and
sampling.

    python scripts/bench_decode_layout.py --model runs/bench_models/smollm2 --rows 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

LAYOUTS = ("data", "one_device", "tensor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/bench_models/smollm2", help="Hugging Face directory")
    ap.add_argument("--rows", type=int, default=64, help="responses (8 per prompt)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens every response decodes")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--cpu-devices", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--profile", default="", help="trace one more rollout of the (single) layout into DIR")
    ap.add_argument("--row-major", action="store_true",
                    help="also time each layout with row-major decode layers (`<layout>+row_major`), "
                         "against the feature-major layers the sampler uses on CPU")
    args = ap.parse_args()
    if args.profile and (args.row_major or len([s for s in args.layouts.split(",") if s]) != 1):
        ap.error("--profile traces one layout: give exactly one in --layouts (e.g. one_device+row_major), "
                 "without --row-major")
    unknown = [s for s in args.layouts.split(",")
               if s and (s.split("+")[0] not in LAYOUTS or s.count("+") > 1 or ("+" in s and not s.endswith("+row_major")))]
    if unknown or not [s for s in args.layouts.split(",") if s]:
        ap.error(f"--layouts: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(LAYOUTS)} "
                 "(each optionally with +row_major)")
    if args.profile:  # the optimised programs, to name each traced op's output shape
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.profile}/hlo "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$").strip()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "bench_peers"))
    sys.path.insert(0, os.path.dirname(here))
    import common
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import numpy as np

    from stare_jax import parallel
    from stare_jax.models import from_pretrained
    from stare_jax.rollout.sampler import generate

    devices = jax.devices()
    data = parallel.make_mesh(data=len(devices), devices=devices)
    layouts = [s for s in args.layouts.split(",") if s]
    if args.row_major:
        layouts = [v for k in layouts for v in (k, f"{k}+row_major")]
    base = {k: k.split("+")[0] for k in layouts}  # "<layout>+row_major": that layout, row-major decode layers
    policies = {"data": from_pretrained(args.model, mesh=data, load_tokenizer=False).model}
    if "one_device" in base.values():
        policies["one_device"] = parallel.rollout_placement(policies["data"], data, 1)[0]
    if "tensor" in base.values():
        tensor = parallel.make_mesh(data=1, tensor=len(devices), devices=devices)
        policies["tensor"] = from_pretrained(args.model, mesh=tensor, load_tokenizer=False).model
    group = 8
    B = args.rows // group
    rng = np.random.default_rng(0)
    policies.update({k: policies[base[k]] for k in layouts})
    vocab = policies[layouts[0]].config.vocab_size
    ids = rng.integers(3, vocab, size=(B, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(ids)
    stop = np.full((args.rows,), args.new_tokens, np.int32)
    key = jax.random.key(0)

    def run(k):
        t0 = time.perf_counter()
        out = generate(policies[k], ids, mask, rng=key, group_size=group, max_new_tokens=args.new_tokens,
                       eos_ids=(0,), stop_lengths=stop, decode_layout="rows" if k.endswith("+row_major") else "auto")
        jax.block_until_ready(out)
        return time.perf_counter() - t0, out

    first = {}
    for k in layouts:  # compile
        first[k] = run(k)[1]
    times = {k: [] for k in layouts}
    for r in range(args.rounds):
        for k in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:
            times[k].append(run(k)[0])
    ref = np.asarray(first[layouts[0]].response_ids)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(policies[layouts[0]]) if hasattr(x, "size"))
    from stare_jax import allocator

    out = {"cpu": common.host_cpu(), "malloc": allocator.name(),
           "devices": len(devices), "rows": args.rows, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
           "params": int(n_params), "layouts": {}}
    for k in layouts:
        med = statistics.median(times[k])
        out["layouts"][k] = {"median_s": round(med, 3), "all_s": [round(t, 3) for t in times[k]],
                             "s_per_step": round(med / args.new_tokens, 4),
                             "same_tokens_as_first": bool(np.array_equal(np.asarray(first[k].response_ids), ref))}
    if args.profile:
        out["profile"] = profile(run, layouts[0], args.profile,
                                 1 if layouts[0].startswith("one_device") else len(devices))
    print(json.dumps(out, indent=1))


def profile(run, layout: str, directory: str, devices: int) -> dict:
    """One traced rollout of `layout`: its time, the trace's event count, each device's self time by
    op kind and the 15 costliest (kind, output shape) pairs."""
    import glob

    import jax
    import profile_ops

    trace = os.path.join(directory, "trace")
    jax.profiler.start_trace(trace)
    seconds = run(layout)[0]
    jax.profiler.stop_trace()
    events = profile_ops.trace_events(trace)
    texts = [open(f).read() for f in glob.glob(os.path.join(directory, "hlo", "*cpu_after_optimizations.txt"))]
    return {"traced_s": round(seconds, 3), "trace_events": len(events), "devices": devices,
            "op_seconds_per_device": profile_ops.op_seconds_per_device(events, devices),
            "by_kind_and_shape": profile_ops.seconds_by_kind_and_shape(events, profile_ops.hlo_output_shapes(texts),
                                                                       devices)}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # the malloc `python -m stare_jax.train` runs with (oneTBB's on CPU)
    main()
