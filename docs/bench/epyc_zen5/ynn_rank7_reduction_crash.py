"""The pinned jaxlib's YNNPACK rank-7 reduction crash (jax-ml/jax#40412, #39257: new in 0.10.2, 0.10.1 right;
docs/performance.md, "Eigen's fault is a regression of jaxlib 0.6.2"): jnp.sum(a * b, axis) for random float32 a
and b of each shape below, each in its own subprocess (a crash kills only it), under XLA's defaults and under
XLA_FLAGS that keep YNNPACK off reductions; prints one JSON line per case with the subprocess's exit status
(-11: SIGSEGV). The shapes: #40412's two, and the quickstart update's rank-7 product-sum.

    python docs/bench/epyc_zen5/ynn_rank7_reduction_crash.py
"""
import importlib.metadata
import json
import os
import subprocess
import sys

CASES = [((3, 1, 2, 2, 8, 8, 8), 3), ((1, 3, 2, 2, 8, 8, 8), 3), ((16, 2, 1, 8, 2, 24, 16), 6)]
FLAGS = ["", "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"]
CHILD = """
import sys, jax, jax.numpy as jnp
shape, axis = tuple(int(s) for s in sys.argv[1].split(",")), int(sys.argv[2])
a = jax.random.normal(jax.random.PRNGKey(0), shape, dtype=jnp.float32)
b = jax.random.normal(jax.random.PRNGKey(1), shape, dtype=jnp.float32)
jax.jit(lambda a, b: jnp.sum(a * b, axis=axis))(a, b).block_until_ready()
"""


def main():
    for flags in FLAGS:
        for shape, axis in CASES:
            env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
            try:
                status = subprocess.run([sys.executable, "-c", CHILD, ",".join(map(str, shape)), str(axis)], env=env,
                                        capture_output=True, timeout=120).returncode
            except subprocess.TimeoutExpired:
                status = "timeout (a hang)"
            print(json.dumps({"jaxlib": importlib.metadata.version("jaxlib"), "xla_flags": flags, "shape": shape,
                              "axis": axis, "exit_status": status}), flush=True)


if __name__ == "__main__":
    main()
