"""Eigen's fault (docs/performance.md, "Eigen's fault on the Zen 5 host ...") with stare-jax's own decoder
and nothing of the update: SmolLM2-135M's forward (`Decoder.hidden_states`, causal attention in blocks of
BLOCK positions) on ROWS x LENGTH token ids, compiled once per CPU device as a single-device program with
Eigen's products and YNNPACK's reductions, run from two threads at once and then one after the other,
RUNS times; prints one JSON line a run: for each device, whether its output at once is bit-identical to
its output alone, and if not the rows that differ (largest difference, positions off).

The weights are SmolLM2-135M-Instruct's as `scripts/bench_step.py --model smollm2` converts them
(runs/bench_models/smollm2), or with --random-weights the same architecture initialised at random (seed
SEED); the token ids are random (seed SEED) and every position is a real token unless --lengths gives each
row a left-padded prompt of PROMPT positions and a response of a random length, as a batch of the update
has (the rest of the row padding: masked keys).

    python docs/bench/epyc_zen5/eigen_fault_decoder_pair.py [--rows 32] [--length 337] [--block 128]
        [--layers N] [--cut mlp|norm|residual|rope ...] [--random-weights] [--lengths] [--runs 1] [--seed 0] [--plain-options]
        [--dump-hlo FILE]
"""
import argparse
import json
import os
import sys
import threading

OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE",
           "xla_disable_hlo_passes": "tree_reduction_rewriter"}
CUTS = {"mlp": "no MLP half (x passes through)", "norm": "no RMS norms (identity, weights unused)",
        "residual": "the attention's output replaces the residual stream (no skip connection)",
        "rope": "no rotary embedding (q and k as projected)"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="rows a device")
    ap.add_argument("--length", type=int, default=337, help="positions a row (the update batch's 81 + 256)")
    ap.add_argument("--block", type=int, default=128, help="model.attention_block (0: the whole score matrix)")
    ap.add_argument("--layers", type=int, default=0, help="only the first N decoder layers (0: all 30)")
    ap.add_argument("--cut", action="append", default=[], choices=sorted(CUTS),
                    help="leave a part out of every layer (repeatable): " + "; ".join(f"{k}: {v}" for k, v in CUTS.items()))
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--lengths", action="store_true", help="left-padded 81-position prompts, random response lengths")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-options", action="store_true", help="XLA's defaults (the control: no Eigen products)")
    ap.add_argument("--dump-hlo", default="", help="write device 0's optimised XLA program (HLO text) here")
    ap.add_argument("--model", default=os.path.join(ROOT, "runs", "bench_models", "smollm2"))
    args = ap.parse_args()
    if min(args.rows, args.length, args.runs) < 1 or min(args.block, args.layers) < 0 or (args.lengths and args.length <= 81):
        ap.error("--rows, --length and --runs must be >= 1, --block and --layers >= 0, and --lengths needs --length > 81")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model}: no config.json (`python scripts/bench_step.py --model smollm2` writes it)")

    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from flax import nnx

    from stare_jax.models import from_pretrained
    from stare_jax.models.decoder import LayerStack, positions_from_mask

    import stare_jax.models.decoder as decoder

    if "mlp" in args.cut:  # diagnostic cuts: the module's functions replaced before anything is traced
        decoder.mlp_residual = lambda cfg, p, x, dtype: x
    if "norm" in args.cut:
        decoder.rms_norm = lambda x, w, eps: x
    if "residual" in args.cut:
        residual = decoder.attention_residual
        decoder.attention_residual = lambda p, x, attn, dtype: residual(p, x, attn, dtype) - x
    if "rope" in args.cut:
        decoder.apply_rope = lambda x, cos, sin: x
    if args.layers:  # programs traced from here run only the first N layers of the stack
        arrays = LayerStack.arrays
        LayerStack.arrays = lambda self: {k: v[:args.layers] for k, v in arrays(self).items()}

    rng = np.random.default_rng(args.seed)
    programs = []
    for i, device in enumerate(jax.devices()[:2]):
        mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
        model = from_pretrained(args.model, mesh=mesh, load_tokenizer=False, attention_block=args.block).model
        graphdef, state = nnx.split(model)
        if args.random_weights:  # the same shapes at random: norms near 1, the rest N(0, 0.02)
            leaves, tree = jax.tree.flatten_with_path(state)
            new = [np.ones(x.shape, np.float32) + 0.1 * rng.standard_normal(x.shape).astype(np.float32)
                   if "norm" in jax.tree_util.keystr(p) else 0.02 * rng.standard_normal(x.shape).astype(np.float32)
                   for p, x in leaves]
            state = jax.tree.unflatten(tree, [jax.device_put(n, x.sharding) for n, (_, x) in zip(new, leaves)])
        vocab = model.config.vocab_size
        ids = rng.integers(0, vocab, (args.rows, args.length)).astype(np.int32)
        mask = np.ones_like(ids)
        if args.lengths:  # [pad.. prompt(81)] [response(random length) pad..]
            prompt_len = rng.integers(20, 82, args.rows)
            response_len = rng.integers(1, args.length - 81 + 1, args.rows)
            pos = np.arange(args.length)[None]
            mask = (((pos >= 81 - prompt_len[:, None]) & (pos < 81)) |
                    ((pos >= 81) & (pos < 81 + response_len[:, None]))).astype(np.int32)
        ids, mask = jax.device_put(ids, device), jax.device_put(mask, device)

        def hidden(state, ids, mask, graphdef=graphdef, mesh=mesh):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return nnx.merge(graphdef, state).hidden_states(ids, positions_from_mask(mask), mask)[0]

        fn = jax.jit(hidden, compiler_options=None if args.plain_options else OPTIONS)
        if args.dump_hlo and i == 0:
            with open(args.dump_hlo, "w") as f:
                f.write(fn.lower(state, ids, mask).compile().as_text())
        programs.append((lambda fn=fn, state=state, ids=ids, mask=mask: np.asarray(fn(state, ids, mask)),
                         np.asarray(mask) > 0))
        programs[-1][0]()  # compiled and run once

    for run in range(args.runs):
        at_once = [None, None]

        def call(i):
            at_once[i] = programs[i][0]()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone = [program() for program, _ in programs]
        devices = []
        for (a, b), (_, valid) in zip(zip(at_once, alone), programs):
            diff = np.where(valid, np.abs(a - b).max(-1), 0.0)
            off = diff > 1e-3
            devices.append({"identical": bool(np.array_equal(a, b)), "finite": bool(np.isfinite(a).all() and np.isfinite(b).all()),
                            "rows_off": np.nonzero(off.any(1))[0].tolist(),
                            "positions_off": int(off.sum()), "max_difference": float(diff.max())})
        print(json.dumps({"run": run, "rows": args.rows, "length": args.length, "block": args.block,
                          "layers": args.layers or model.config.num_layers, "cut": args.cut,
                          "random_weights": args.random_weights, "lengths": args.lengths,
                          "options": None if args.plain_options else OPTIONS, "devices": devices}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
