"""Eigen's fault, the attention half of a layer alone (docs/performance.md, "Eigen's fault reproduced with the
decoder alone"): a scan over LAYERS layers of x += (causal_attention(x W_qkv) in blocks of BLOCK) W_o, on ROWS x
LENGTH positions of width 576 (9 query heads, 3 KV heads of 64), random weights and inputs, compiled as one
single-device program per CPU device with Eigen's products and YNNPACK's reductions, run from two threads at
once and then one after the other, RUNS times; prints one JSON line a run: each device's output at once against
its output alone (bit-identical or not, the rows that differ). No norms, no rotary embedding, no MLP: the
decoder-alone script's `--cut mlp --cut norm --cut rope` form written out; stare-jax's
`blockwise_attention.causal_attention` (plain JAX) is imported for `--attention stare` only, so every other form
runs on jax alone (any release from 0.4.38 on: "Eigen's fault is a regression of jaxlib 0.6.2"), and each line
names the jaxlib it ran on.

    python docs/bench/epyc_zen5/eigen_fault_attention_pair.py [--rows 64] [--length 337] [--block 128]
        [--layers 30] [--runs 2] [--plain-options] [--attention stare|inline|no-softmax|scores-only|values-only]
        [--loops scan|static-keys|query-unrolled|unrolled] [--unroll-layers] [--device1-plain]
        [--same-device] [--options JSON]
"""
import argparse
import importlib.metadata
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
    ap.add_argument("--options", default="", help="a JSON object of XLA options in place of OPTIONS")
    ap.add_argument("--device1-plain", action="store_true",
                    help="device 1's program compiled with XLA's defaults (device 0's with Eigen's products)")
    ap.add_argument("--same-device", action="store_true",
                    help="one CPU device, both programs on it (two executions at once on one device)")
    ap.add_argument("--unroll-layers", action="store_true", help="a Python loop over the layers instead of lax.scan")
    ap.add_argument("--loops", default="scan", choices=("scan", "static-keys", "query-unrolled", "unrolled"),
                    help="the written-out attention's loops: scan (a scan over query blocks, a fori_loop over key "
                         "blocks 0..i), static-keys (the key loop over every block, a trip count known at compile "
                         "time), query-unrolled (a Python loop over the query blocks, each with its fori_loop over key blocks 0..i), "
                         "unrolled (both as Python loops over the blocks at or below the diagonal)")
    ap.add_argument("--attention", default="stare", choices=("stare", "inline", "no-softmax", "scores-only", "values-only"),
                    help="stare: blockwise_attention.causal_attention; inline: the same forward written out here (a scan "
                         "over query blocks, a fori_loop over key blocks, online softmax); no-softmax: acc += (q k^T) v "
                         "in the same loops; scores-only: the loops keep only the scores product (acc += s summed); "
                         "values-only: only the product with the values, of q_i repeated to C columns in place of the "
                         "scores (acc += [q_i q_i ...] v_j)")
    args = ap.parse_args()
    if min(args.rows, args.length, args.block, args.layers, args.runs) < 1:
        ap.error("every count must be >= 1")
    options = OPTIONS
    if args.options:
        try:
            options = json.loads(args.options)
        except ValueError as e:
            ap.error(f"--options: not JSON: {e}")
        if not isinstance(options, dict):
            ap.error("--options must be a JSON object")

    import jax

    if not args.same_device:  # one CPU device is the default (and jax < 0.4.36 has no such option)
        jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import numpy as np

    if args.attention == "stare":  # the only stare-jax import; every other form is JAX alone
        from stare_jax.models.blockwise_attention import causal_attention

    def inline_attention(q, k, v, C, mode):
        """[B, T, H, hd] -> [B, T, H, hd]: causal attention in blocks of C, one product per (row, KV head)."""
        B, T, _, _ = q.shape
        Q, nb = H // K, -(-T // C)
        pad = lambda a: jnp.pad(a, ((0, 0), (0, nb * C - T), (0, 0), (0, 0)))  # noqa: E731
        qh = pad(q).reshape(B, nb, C, K, Q, HD).transpose(1, 0, 3, 4, 2, 5).reshape(nb, B, K, Q * C, HD)
        kh = pad(k).reshape(B, nb, C, K, HD).transpose(1, 0, 3, 2, 4)
        vh = pad(v).reshape(B, nb, C, K, HD).transpose(1, 0, 3, 2, 4)
        query_pos = jnp.tile(jnp.arange(C), Q)

        def query_block(_, xs):
            i, q_i = xs

            def key_block(j, carry):
                m, l, acc = carry
                if mode == "values-only":
                    return m, l, acc + jnp.einsum("bkms,bksd->bkmd", jnp.tile(q_i, (1, 1, 1, -(-C // HD)))[..., :C], vh[j])
                s = jnp.einsum("bkmd,bksd->bkms", q_i, kh[j]) * HD ** -0.5
                if mode == "scores-only":
                    return m, l, acc + s.sum(-1, keepdims=True)
                if mode == "no-softmax":
                    return m, l, acc + jnp.einsum("bkms,bksd->bkmd", s, vh[j])
                allowed = (j * C + jnp.arange(C))[None, :] <= (i * C + query_pos)[:, None]
                s = jnp.where(allowed, s, -1e30)
                m_new = jnp.maximum(m, s.max(-1))
                e = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                return m_new, l * corr + e.sum(-1), acc * corr[..., None] + jnp.einsum("bkms,bksd->bkmd", e, vh[j])

            init = (jnp.full((B, K, Q * C), -jnp.inf), jnp.zeros((B, K, Q * C)), jnp.zeros((B, K, Q * C, HD)))
            if args.loops == "unrolled":  # i is a Python int here
                carry = init
                for j in range(i + 1):
                    carry = key_block(j, carry)
                m, l, acc = carry
            else:
                m, l, acc = jax.lax.fori_loop(0, nb if args.loops == "static-keys" else i + 1, key_block, init)
            # the cut modes' sums grow without a softmax's normalisation: tanh keeps 30 layers finite
            return None, acc / jnp.maximum(l, 1.0)[..., None] if mode == "inline" else jnp.tanh(acc)

        if args.loops in ("unrolled", "query-unrolled"):
            o = jnp.stack([query_block(None, (i, qh[i]))[1] for i in range(nb)])
        else:
            _, o = jax.lax.scan(query_block, None, (jnp.arange(nb), qh))
        return o.reshape(nb, B, K, Q, C, HD).transpose(1, 0, 4, 2, 3, 5).reshape(B, nb * C, H, HD)[:, :T]

    def forward(w_qkv, w_o, x):
        valid = jnp.ones(x.shape[:2], jnp.float32)

        def layer(x, w):
            qkv = x @ w[0]
            B, T, _ = x.shape
            q = qkv[..., :H * HD].reshape(B, T, H, HD)
            k = qkv[..., H * HD:(H + K) * HD].reshape(B, T, K, HD)
            v = qkv[..., (H + K) * HD:].reshape(B, T, K, HD)
            if args.attention == "stare":
                attn = causal_attention(q, k, v, valid, args.block)
            else:
                attn = inline_attention(q, k, v, args.block, args.attention)
            return x + attn.reshape(B, T, H * HD) @ w[1], None

        if args.unroll_layers:
            for n in range(w_qkv.shape[0]):
                x = layer(x, (w_qkv[n], w_o[n]))[0]
            return x
        return jax.lax.scan(layer, x, (w_qkv, w_o))[0]

    rng = np.random.default_rng(args.seed)
    programs = []
    for n, device in enumerate([jax.devices()[0]] * 2 if args.same_device else jax.devices()[:2]):
        put = lambda a: jax.device_put(a.astype(np.float32), device)  # noqa: E731
        w_qkv = put(0.02 * rng.standard_normal((args.layers, D, (H + 2 * K) * HD)))
        w_o = put(0.02 * rng.standard_normal((args.layers, H * HD, D)))
        x = put(rng.standard_normal((args.rows, args.length, D)))
        plain = args.plain_options or (args.device1_plain and n == 1)
        fn = jax.jit(forward, compiler_options=None if plain else options)
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
                          "layers": args.layers, "attention": args.attention,
                          "loops": args.loops, "unroll_layers": args.unroll_layers,
                          "device1_plain": args.device1_plain, "same_device": args.same_device, "options": None if args.plain_options else options,
                          "jaxlib": importlib.metadata.version("jaxlib"), "devices": devices}), flush=True)


if __name__ == "__main__":
    main()
