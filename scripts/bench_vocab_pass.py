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
        [--with-pi2] [--dw per_device_partials] [--against GIT_REF]

`--with-pi2` also computes Q (as the update does, for its diagnostics); `--against REF` times, beside
each of the working tree's pairs, the same pair with the `stare_jax/rl/logprobs.py` of git REF
(loaded from `git show` as a second module), alternating in the same process: an A/B of a change
to the pass that a whole update on this noisy host cannot resolve. Each line then names its `code`.

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
    ap.add_argument("--with-pi2", action="store_true", help="also compute Q (the update's setting)")
    ap.add_argument("--dw", default="allreduce_in_loop,per_device_partials",
                    help="dW accumulations to time (comma-separated)")
    ap.add_argument("--against", default="", help="git ref whose logprobs.py is timed beside the working tree's")
    args = ap.parse_args()
    accumulations = [a for a in args.dw.split(",") if a]
    if not accumulations or set(accumulations) - {"allreduce_in_loop", "per_device_partials"}:
        ap.error("--dw: allowed: allreduce_in_loop, per_device_partials")
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c]
    except ValueError:
        ap.error(f"--chunks: comma-separated integers, got {args.chunks!r}")
    if args.tokens < 1 or args.rounds < 1 or args.devices < 2 or not chunks or min(chunks) < 1:
        ap.error("--tokens, --rounds and every chunk must be >= 1, --devices >= 2")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import common
    from stare_jax import parallel
    from stare_jax.rl import logprobs

    codes = {"working tree": logprobs}
    if args.against:
        codes[args.against] = module_at_ref(args.against, "stare_jax/rl/logprobs.py")

    mesh = parallel.make_mesh(data=args.devices, devices=jax.devices()[:args.devices])
    S, M, D, V = args.devices, args.tokens, args.hidden, args.vocab
    k = jax.random.split(jax.random.key(0), 3)
    rows = NamedSharding(mesh, P("data"))
    h = jax.device_put(jax.random.normal(k[0], (S, M, D)) * 0.05, rows)
    w = jax.device_put(jax.random.normal(k[1], (D, V)) * 0.05, NamedSharding(mesh, P()))
    t = jax.device_put(jax.random.randint(k[2], (S, M), 0, V), rows)

    def make(module, chunk: int, partials):
        def loss(h, w):
            s = module.token_stats(h, w, t, chunk_size=chunk, partials=partials, with_pi2=args.with_pi2)
            q = jnp.sum(s.pi2_dev) if args.with_pi2 else jnp.float32(0)  # an output, so Q is computed
            return jnp.sum(0.3 * s.log_probs - 0.7 * s.entropy), q
        return jax.jit(jax.grad(loss, (0, 1), has_aux=True))

    pairs = {}
    for chunk in chunks:
        for name in accumulations:
            partials = parallel.partial_sum_sharding(mesh) if name == "per_device_partials" else None
            for code, module in codes.items():
                fn = make(module, chunk, partials)
                jax.block_until_ready(fn(h, w))  # compile and warm up
                pairs[(chunk, name, code)] = fn
    times = {key: [] for key in pairs}
    for r in range(args.rounds):
        order = list(pairs.items())
        for key, fn in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(h, w))
            times[key].append(time.perf_counter() - t0)
    for (chunk, name, code), ts in times.items():
        print(json.dumps({"chunk": chunk, "dw": name, "code": code, "with_pi2": args.with_pi2,
                          "median_s": round(statistics.median(ts), 6),
                          "times_s": [round(x, 6) for x in ts], "tokens_per_device": M, "hidden": D, "vocab": V,
                          "devices": S, "host_cpu": common.host_cpu()}), flush=True)


def module_at_ref(ref: str, path: str):
    """The file `path` of git `ref` (this repository), imported as a module of its own."""
    import importlib.util
    import subprocess
    import tempfile

    root = os.path.dirname(HERE)
    try:
        source = subprocess.run(["git", "-C", root, "show", f"{ref}:{path}"], check=True, capture_output=True,
                                text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"bench_vocab_pass: --against {ref!r}: cannot read {path} there ({e})".splitlines()[0], file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="bench_vocab_pass_") as tmp:  # gone once the module is loaded
        file = os.path.join(tmp, os.path.basename(path))
        with open(file, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"at_{ref}_{os.path.basename(path)[:-3]}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
