"""The update's matmul shapes alone, on every CPU device of the host at once, under XLA:CPU options.

The real-model update (`scripts/bench_update.py`) runs one product per device at a time on a
data-parallel CPU mesh, so what bounds it is what one core delivers while its neighbours multiply
too, not the one-product peak on every core that the benchmarks' MFU divides by
(`bench_peers/common.matmul_peak_gflops`). This script times, for each option set, a square
product and the update's own products (SmolLM2-135M's shapes by default: hidden 576, q/k/v 960,
gate/up 3,072, down 1,536, 1,024-column vocabulary chunks, `--tokens` packed positions a device)
as `shard_map`ped programs, each device multiplying its own operands, best of `--repeats` calls,
the option sets alternating in rounds in one process. Forms: the forward x @ W, the input gradient
g @ W^T, the weight gradient h^T @ g (left operand transposed, which XLA:CPU does not hand to
YNNPACK), that product with h transposed first behind an optimization barrier, the forward
and input gradient with the weight stored transposed ([f, d]: x @ W_t^T and g @ W_t), and the
forward with a leading unit axis (the einsum form of `decoder.dense`), and the model's own input-
and weight-gradient forms (`stare_jax.models.products.dot_nt` and `dot_tn`, which take their CPU
forms for bfloat16 operands and are the plain products for float32). `--dtype bfloat16` gives
every product bfloat16 operands, each accumulated and returned in float32 as the model's
products on a CPU are (the form that reaches YNNPACK's bf16 kernels), and measures the peak the
same way.

    python scripts/bench_matmul_shapes.py [--tokens 6144] [--repeats 5] [--rounds 2] [--devices 2]
        [--dtype float32|bfloat16]
        [--options '{"defaults": {}, "eigen": {"xla_cpu_experimental_ynn_fusion_type": ""}}']

It prints one JSON object: per option set and product, the best time and GFLOP/s a device (median
over rounds), with the host's CPU and the one-product peak measured as the benchmarks measure it.
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


def default_option_sets() -> dict:
    """The update's shipped CPU options (`update.CPU_UPDATE_COMPILER_OPTIONS` with `model.cpu_gemm =
    "auto"`: Eigen's products) and the same with XLA:CPU's default YNNPACK products (`model.cpu_gemm =
    "ynnpack"`). Imports JAX: call after XLA_FLAGS is set."""
    from stare_jax.rl.update import cpu_update_compiler_options

    return {"shipped": cpu_update_compiler_options("auto"), "ynnpack": cpu_update_compiler_options("ynnpack")}


def products(tokens: int, hidden: int, qkv: int, mlp: int, vocab_chunk: int, square: int):
    """(name, operand shapes, function, FLOPs) of each timed product: 2·M·K·N FLOPs each. Every
    product accumulates and returns float32 (`preferred_element_type`), the same program as `a @ b`
    for float32 operands."""
    import jax
    import jax.numpy as jnp

    from stare_jax.models.products import dot_nt, dot_tn

    def mm(a, b):
        return jnp.matmul(a, b, preferred_element_type=jnp.float32)

    t, d = tokens, hidden
    rows = [(f"square {square}", [(square, square), (square, square)], mm, 2 * square ** 3)]
    for label, f in (("q/k/v", qkv), ("gate/up", 2 * mlp), ("vocab chunk", vocab_chunk)):
        rows += [
            (f"{label} forward x@W", [(t, d), (d, f)], mm, 2 * t * d * f),
            (f"{label} dh g@W^T", [(t, f), (d, f)], lambda g, w: mm(g, w.T), 2 * t * d * f),
            (f"{label} dW h^T@g", [(t, d), (t, f)], lambda h, g: mm(h.T, g), 2 * t * d * f),
            (f"{label} forward, W stored [f,d]", [(t, d), (f, d)], lambda x, wt: mm(x, wt.T), 2 * t * d * f),
            (f"{label} dh, W stored [f,d]", [(t, f), (f, d)], mm, 2 * t * d * f),
            (f"{label} dh, the model's form", [(t, f), (d, f)], lambda g, w: dot_nt(g, w, jnp.float32),
             2 * t * d * f),
            (f"{label} dW, the model's form", [(t, d), (t, f)], dot_tn, 2 * t * d * f),
        ]
    rows += [
        ("down forward x@W", [(t, mlp), (mlp, d)], mm, 2 * t * d * mlp),
        ("gate/up forward, leading unit axis", [(1, t, d), (d, 2 * mlp)],
         lambda x, w: jnp.einsum("...d,df->...f", x, w, preferred_element_type=jnp.float32), 2 * t * d * 2 * mlp),
        ("gate/up dW, h transposed first", [(t, d), (t, 2 * mlp)],
         lambda h, g: mm(jax.lax.optimization_barrier(jnp.transpose(h)), g), 2 * t * d * 2 * mlp),
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6144, help="packed positions a device (the real update's 5,120-6,144)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960, help="q/k/v output columns")
    ap.add_argument("--mlp", type=int, default=1536, help="MLP intermediate size (gate/up has twice the columns)")
    ap.add_argument("--vocab-chunk", type=int, default=1024)
    ap.add_argument("--square", type=int, default=2048, help="side of the square product")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls a round (best taken)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the option sets alternating")
    ap.add_argument("--devices", type=int, default=2, help="CPU devices, each multiplying at once")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the operands' dtype (every product accumulates and returns float32)")
    ap.add_argument("--options", default="",
                    help="JSON object: option-set name -> XLA compiler options (default: the update's "
                         "shipped options and the same with Eigen's matmuls)")
    args = ap.parse_args()
    try:
        option_sets = json.loads(args.options) if args.options else None
    except json.JSONDecodeError as e:
        ap.error(f"--options: not JSON: {e}")
    if option_sets is not None and (not isinstance(option_sets, dict) or not option_sets
                                    or not all(isinstance(v, dict) for v in option_sets.values())):
        ap.error("--options must be a non-empty JSON object of option-set name -> JSON object of options")
    sizes = (args.tokens, args.hidden, args.qkv, args.mlp, args.vocab_chunk, args.square, args.repeats, args.rounds)
    if min(sizes) < 1 or args.devices < 1:
        ap.error("--tokens, --hidden, --qkv, --mlp, --vocab-chunk, --square, --repeats, --rounds and --devices must be >= 1")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import common

    option_sets = option_sets or default_option_sets()

    if jax.default_backend() != "cpu":
        ap.error("this benchmark times XLA:CPU's kernels; run it on a CPU host")
    mesh = Mesh(jax.devices()[: args.devices], ("d",))
    table = products(args.tokens, args.hidden, args.qkv, args.mlp, args.vocab_chunk, args.square)
    compiled = {}
    for set_name, options in option_sets.items():
        for name, shapes, fn, _ in table:
            operands = [jax.device_put(jax.random.normal(jax.random.key(i), (args.devices,) + s, jnp.float32)
                                       .astype(args.dtype), NamedSharding(mesh, P("d"))) for i, s in enumerate(shapes)]
            per_device = jax.shard_map(lambda *a, fn=fn: fn(*[x[0] for x in a])[None], mesh=mesh,
                                       in_specs=tuple(P("d") for _ in shapes), out_specs=P("d"))
            try:
                program = jax.jit(per_device).lower(*operands).compile(options or None)
            except Exception as e:  # an unknown option name: say which set
                sys.exit(f"bench_matmul_shapes: option set {set_name!r} does not compile: {str(e).splitlines()[0]}")
            program(*operands).block_until_ready()
            compiled[set_name, name] = (program, operands)
    times = {key: [] for key in compiled}
    for r in range(args.rounds):
        order = list(option_sets) if r % 2 == 0 else list(reversed(option_sets))
        for set_name in order:
            for name, *_ in table:
                program, operands = compiled[set_name, name]
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    program(*operands).block_until_ready()
                    best = min(best, time.perf_counter() - t0)
                times[set_name, name].append(best)
    flops = {name: f for name, _, _, f in table}
    result = {"host_cpu": common.host_cpu(), "jax": jax.__version__, "devices": args.devices, "dtype": args.dtype,
              "one_product_peak_gflops": common.matmul_peak_gflops(lambda n: common.jax_matmul(n, args.dtype)),
              "tokens_per_device": args.tokens, "option_sets": option_sets, "rounds": args.rounds,
              "products": {}}
    for set_name in option_sets:
        rows = {}
        for name, *_ in table:
            t = statistics.median(times[set_name, name])
            rows[name] = {"best_s": [round(x, 5) for x in times[set_name, name]],
                          # four significant digits: a tiny product timed on a loaded host (the
                          # tests' shapes) reads well under 0.05 GFLOP/s, which one decimal made 0
                          "gflops_per_device": float(f"{flops[name] / t / 1e9:.4g}")}
        result["products"][set_name] = rows
    result["one_product_peak_per_device_gflops"] = round(result["one_product_peak_gflops"] / args.devices, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
