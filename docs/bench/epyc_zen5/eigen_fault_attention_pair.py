"""Eigen's fault, the attention half of a layer alone (docs/performance.md, "Eigen's fault reproduced with the
decoder alone"): a scan over LAYERS layers of x += (causal_attention(x W_qkv) in blocks of BLOCK) W_o, on ROWS x
LENGTH positions of width 576 (9 query heads, 3 KV heads of 64), random weights and inputs, compiled as one
single-device program per CPU device with Eigen's products and YNNPACK's reductions, run from two threads at
once and then one after the other, RUNS times; prints one JSON line a run: each device's output at once against
its output alone (bit-identical or not, the rows that differ). No norms, no rotary embedding, no MLP: the
decoder-alone script's `--cut mlp --cut norm --cut rope` form written out, with only stare-jax's
`blockwise_attention.causal_attention` (plain JAX) imported.

    python docs/bench/epyc_zen5/eigen_fault_attention_pair.py [--rows 64] [--length 337] [--block 128]
        [--layers 30] [--runs 2] [--plain-options]
"""
import argparse
import json
import threading

OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE",
           "xla_disable_hlo_passes": "tree_reduction_rewriter"}
D, H, K, HD = 576, 9, 3, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=337)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-options", action="store_true", help="XLA's defaults (the control)")
    args = ap.parse_args()
    if min(args.rows, args.length, args.block, args.layers, args.runs) < 1:
        ap.error("every count must be >= 1")

    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import numpy as np

    from stare_jax.models.blockwise_attention import causal_attention

    def forward(w_qkv, w_o, x):
        valid = jnp.ones(x.shape[:2], jnp.float32)

        def layer(x, w):
            qkv = x @ w[0]
            B, T, _ = x.shape
            q = qkv[..., :H * HD].reshape(B, T, H, HD)
            k = qkv[..., H * HD:(H + K) * HD].reshape(B, T, K, HD)
            v = qkv[..., (H + K) * HD:].reshape(B, T, K, HD)
            attn = causal_attention(q, k, v, valid, args.block)
            return x + attn.reshape(B, T, H * HD) @ w[1], None

        return jax.lax.scan(layer, x, (w_qkv, w_o))[0]

    rng = np.random.default_rng(args.seed)
    programs = []
    for device in jax.devices()[:2]:
        put = lambda a: jax.device_put(a.astype(np.float32), device)  # noqa: E731
        w_qkv = put(0.02 * rng.standard_normal((args.layers, D, (H + 2 * K) * HD)))
        w_o = put(0.02 * rng.standard_normal((args.layers, H * HD, D)))
        x = put(rng.standard_normal((args.rows, args.length, D)))
        fn = jax.jit(forward, compiler_options=None if args.plain_options else OPTIONS)
        programs.append(lambda fn=fn, w_qkv=w_qkv, w_o=w_o, x=x: np.asarray(fn(w_qkv, w_o, x)))
        programs[-1]()  # compiled and run once

    for run in range(args.runs):
        at_once = [None, None]

        def call(i):
            at_once[i] = programs[i]()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone = [program() for program in programs]
        devices = []
        for a, b in zip(at_once, alone):
            diff = np.abs(a - b).max(-1)
            devices.append({"identical": bool(np.array_equal(a, b)), "finite": bool(np.isfinite(a).all()),
                            "rows_off": np.nonzero((diff > 1e-3).any(1))[0].tolist(),
                            "positions_off": int((diff > 1e-3).sum()), "max_difference": float(diff.max())})
        print(json.dumps({"run": run, "rows": args.rows, "length": args.length, "block": args.block,
                          "layers": args.layers, "options": None if args.plain_options else OPTIONS,
                          "devices": devices}), flush=True)


if __name__ == "__main__":
    main()
