"""The update's vocabulary pass alone: log-probs and entropy, forward and backward, on a
data-parallel CPU mesh, with dW all-reduced inside the chunk loop or summed per device.

`stare_jax.rl.logprobs.token_stats` walks the [D, V] output matrix in chunks of C columns. Its
backward pass forms each chunk's dW_c = h^T dz; with the tokens split over the devices that is a
sum over devices. `partials` (what the update passes on a data-parallel mesh,
`parallel.partial_sum_sharding`) keeps one partial sum per device and reduces once after the loop;
without it the replicated accumulation all-reduces inside every trip. This script times
jit(grad(0.3 sum log pi - 0.7 sum H)) for each (chunk, accumulation) pair on random hidden states
of the real model's shape (SmolLM2-135M: D 576, V 49,152), alternating the order every round in
one process, and prints one JSON object per pair (times, median) with the host's CPU.

    python scripts/bench_vocab_pass.py [--tokens 6144] [--chunks 8192,1024] [--rounds 5] [--devices 2]

`--tokens` is per device (the real-model update's packed capacity was 5,120-6,144 a device).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6144, help="response tokens per device")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunks", default="8192,1024", help="comma-separated vocabulary chunks")
    ap.add_argument("--rounds", type=int, default=5, help="timed calls of each pair (after one warm-up)")
    ap.add_argument("--devices", type=int, default=2, help="CPU devices of the data-parallel mesh")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if args.tokens < 1 or args.rounds < 1 or args.devices < 2 or not chunks or min(chunks) < 1:
        sys.exit("bench_vocab_pass: --tokens, --rounds and every chunk must be >= 1, --devices >= 2")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import common
    from stare_jax import parallel
    from stare_jax.rl.logprobs import token_stats

    mesh = parallel.make_mesh(data=args.devices, devices=jax.devices()[:args.devices])
    S, M, D, V = args.devices, args.tokens, args.hidden, args.vocab
    k = jax.random.split(jax.random.key(0), 3)
    rows = NamedSharding(mesh, P("data"))
    h = jax.device_put(jax.random.normal(k[0], (S, M, D)) * 0.05, rows)
    w = jax.device_put(jax.random.normal(k[1], (D, V)) * 0.05, NamedSharding(mesh, P()))
    t = jax.device_put(jax.random.randint(k[2], (S, M), 0, V), rows)

    def make(chunk: int, partials):
        def loss(h, w):
            s = token_stats(h, w, t, chunk_size=chunk, partials=partials)
            return jnp.sum(0.3 * s.log_probs - 0.7 * s.entropy)
        return jax.jit(jax.grad(loss, (0, 1)))

    pairs = {}
    for chunk in chunks:
        for name, partials in (("allreduce_in_loop", None), ("per_device_partials", parallel.partial_sum_sharding(mesh))):
            fn = make(chunk, partials)
            jax.block_until_ready(fn(h, w))  # compile and warm up
            pairs[(chunk, name)] = fn
    times = {key: [] for key in pairs}
    for r in range(args.rounds):
        order = list(pairs.items())
        for key, fn in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(h, w))
            times[key].append(time.perf_counter() - t0)
    for (chunk, name), ts in times.items():
        print(json.dumps({"chunk": chunk, "dw": name, "median_s": round(statistics.median(ts), 6),
                          "times_s": [round(x, 6) for x in ts], "tokens_per_device": M, "hidden": D, "vocab": V,
                          "devices": S, "host_cpu": common.host_cpu()}), flush=True)


if __name__ == "__main__":
    main()
