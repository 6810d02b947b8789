"""The pinned jaxlib's YNNPACK column-reduction fault (jax-ml/jax#39103: new in 0.10.2, 0.10.1 is right; docs/performance.md,
"Eigen's fault is a regression of jaxlib 0.6.2"): sum over axis 0 of (m @ x.T) ** 2 for x of N rows and D columns, compiled with
XLA's defaults (the product, the square and the reduction in one YNNPACK fusion) against the same program with
YNNPACK's fusions off; prints one JSON line per (D, N): the output positions that differ by more than 1e-4 of their
magnitude. Plain JAX, random inputs; a few seconds.

    python docs/bench/epyc_zen5/ynn_column_reduction_fault.py
"""
import importlib.metadata
import json

import jax
import jax.numpy as jnp
import numpy as np

WIDTHS = (3, 4, 64, 576)
LENGTHS = (32767, 32768, 32769, 32784, 40000, 65535, 65537)


def main():
    for d in WIDTHS:
        for n in LENGTHS:
            rng = np.random.default_rng(d * 100003 + n)
            x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
            m = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)

            def f(x):
                return jnp.sum((m @ x.T) ** 2, 0)

            fused = np.asarray(jax.jit(f).lower(x).compile()(x))
            plain = np.asarray(jax.jit(f).lower(x).compile({"xla_cpu_experimental_ynn_fusion_type": ""})(x))
            off = np.nonzero(np.abs(fused - plain) > 1e-4 * (np.abs(plain) + 1))[0]
            print(json.dumps({"jaxlib": importlib.metadata.version("jaxlib"), "width": d, "rows": n,
                              "positions_off": len(off), "first_off": int(off[0]) if len(off) else None,
                              "last_off": int(off[-1]) if len(off) else None,
                              "max_relative_difference": float(np.max(np.abs(fused - plain) / (np.abs(plain) + 1)))}),
                  flush=True)


if __name__ == "__main__":
    main()
