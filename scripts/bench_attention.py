"""Causal attention, forward and backward, with the whole score matrix or in blocks.

`model.attention_block` decides how `Decoder.hidden_states` (and the grouped update's prompts)
attend: sequences longer than the block run `stare_jax.models.blockwise_attention.causal_attention`
(no [T, T] buffer), shorter ones the whole-matrix form. This script compiles jit(grad) of a
weighted sum of the attention's output for each length and form, reads XLA's temporary memory of
the compiled program, and times it, the forms alternating round by round in one process; one JSON
object per (length, form) with the host's CPU, then a summary line.

    python scripts/bench_attention.py [--lengths 1024,2048,4096] [--blocks 512,1024] [--rounds 5]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--batch 1] [--dtype float32]
        [--group G --prompt-length P]

With `--group G` it times the grouped update's response attention instead: `--batch` prompts of
`--prompt-length` positions, each with G responses of each length, the form kept below the block
(`models.attention.grouped_response_attention`, "kept": up to 8 causal blocks whose probabilities
the backward reuses) against `blockwise_attention.grouped_causal_attention` ("blockN": flash
blocks, probabilities recomputed). The default heads are SmolLM2-135M's (9 query, 3 key/value
heads of 64). A form is skipped where its block is not below the length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, os.path.dirname(HERE))


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: comma-separated integers >= 1")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096], help="sequence lengths T")
    ap.add_argument("--blocks", type=_ints, default=[512, 1024], help="block sizes of the blockwise form")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each form once a round)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--group", type=int, default=0, help="G > 0: the grouped update's response attention")
    ap.add_argument("--prompt-length", type=int, default=128, help="prompt positions with --group")
    args = ap.parse_args()
    if args.rounds < 1 or args.heads % args.kv_heads:
        ap.error("--rounds must be >= 1 and --heads a multiple of --kv-heads")
    if args.group < 0 or args.prompt_length < 1:
        ap.error("--group must be >= 0 and --prompt-length >= 1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import common
    from stare_jax.models.attention import grouped_response_attention
    from stare_jax.models.blockwise_attention import MASK_VALUE, causal_attention, grouped_causal_attention
    from stare_jax.models.decoder import _attend, causal_bias

    def whole(q, k, v, valid):
        return _attend(q, k, v, causal_bias(valid, q.shape[1]), q.dtype)

    def kept(q, k, v, valid):
        """The grouped update's form below the block: k, v = (prompt, response) pairs."""
        (kp, kr), (vp, vr), (prompt_valid, response_valid) = k, v, valid
        prompt_bias = jnp.where(prompt_valid > 0, 0.0, MASK_VALUE).astype(jnp.float32)
        response_bias = causal_bias(response_valid, q.shape[1])[:, 0, 0]
        return grouped_response_attention(q, kp, vp, kr, vr, prompt_bias, response_bias)

    def grouped_blocks(b):
        return lambda q, k, v, valid: grouped_causal_attention(q, k[0], v[0], valid[0], k[1], v[1], valid[1], b)

    dtype = jnp.dtype(args.dtype)
    rows = []
    for T in args.lengths:
        rs = np.random.default_rng(T)
        B, H, K, hd, G = args.batch, args.heads, args.kv_heads, args.head_dim, args.group
        array = lambda *shape: jnp.asarray(rs.normal(size=shape), dtype)  # noqa: E731
        if G:
            N, P = B * G, args.prompt_length
            q = array(N, T, H, hd)
            k, v = (array(B, P, K, hd), array(N, T, K, hd)), (array(B, P, K, hd), array(N, T, K, hd))
            valid = (jnp.ones((B, P), jnp.float32), jnp.ones((N, T), jnp.float32))
            weights = jnp.asarray(rs.normal(size=(N, T, H, hd)), jnp.float32)
            forms = {"kept": kept}
            forms.update({f"block{b}": grouped_blocks(b) for b in args.blocks if b < T})
        else:
            q, k, v = array(B, T, H, hd), array(B, T, K, hd), array(B, T, K, hd)
            valid = jnp.ones((B, T), jnp.float32)
            weights = jnp.asarray(rs.normal(size=(B, T, K, H // K, hd)), jnp.float32)
            forms = {"whole": whole}
            forms.update({f"block{b}": (lambda b: lambda *a: causal_attention(*a, b))(b) for b in args.blocks if b < T})
        programs, times = {}, {name: [] for name in forms}
        for name, attend in forms.items():
            loss = lambda q, k, v, attend=attend: (attend(q, k, v, valid) * weights).sum()  # noqa: E731
            start = time.perf_counter()
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
            programs[name] = (compiled, time.perf_counter() - start)
            jax.block_until_ready(compiled(q, k, v))  # warm-up
        reference = programs[next(iter(forms))][0](q, k, v)
        for r in range(args.rounds):
            order = list(forms) if r % 2 == 0 else list(reversed(forms))
            for name in order:
                start = time.perf_counter()
                jax.block_until_ready(programs[name][0](q, k, v))
                times[name].append(time.perf_counter() - start)
        for name in forms:
            compiled, compile_s = programs[name]
            grads = compiled(q, k, v)
            diff = max(float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max())
                       for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))
            row = dict(length=T, form=name, median_s=round(statistics.median(times[name]), 5),
                       times_s=[round(t, 5) for t in times[name]], compile_s=round(compile_s, 2),
                       temp_mib=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
                       reference=next(iter(forms)), max_grad_diff_vs_reference=diff, batch=B, heads=H, kv_heads=K,
                       head_dim=hd, dtype=args.dtype, **(dict(group=G, prompt_length=P) if G else {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(dict(summary=True, host_cpu=common.host_cpu(), cpu_count=os.cpu_count(), jax=jax.__version__,
                          device=str(jax.devices()[0].device_kind), rounds=args.rounds,
                          rows=[{k: r[k] for k in ("length", "form", "median_s", "temp_mib")} for r in rows])))


if __name__ == "__main__":
    main()
