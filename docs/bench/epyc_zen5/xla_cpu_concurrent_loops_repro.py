"""XLA:CPU computes wrong values when two executions of a program with nested while loops of batched products on
Eigen's kernels run at once in one process (docs/performance.md, "Eigen's fault is a regression of jaxlib 0.6.2").
A standalone reproducer for an upstream report: JAX and NumPy only, one CPU device, ~30 s.

The program: a lax.scan over 30 layers of x += f(x @ W_qkv) @ W_o, where f runs, for each of 3 query blocks i, a
fori_loop over key blocks 0..i of acc += (q_i k_j^T) v_j (batched over 16 rows and 3 heads), then tanh. It is
compiled once and run from two Python threads at once, then once alone; a deterministic program should give the
same bits each time. Exit status 1 when an output run at once differs from the one run alone.

    python xla_cpu_concurrent_loops_repro.py              # products on Eigen (YNNPACK off): wrong since jaxlib 0.6.2
    python xla_cpu_concurrent_loops_repro.py --defaults   # XLA's default options (the control)
"""
import importlib.metadata
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

ROWS, LENGTH, WIDTH, LAYERS, BLOCK, HEADS, HEAD_DIM = 16, 337, 576, 30, 128, 3, 64


def attention(q, k, v):
    """[B, T, HEADS*3, d] queries, [B, T, HEADS, d] keys and values -> causal blocks, no softmax, tanh."""
    B, T = q.shape[:2]
    nb = -(-T // BLOCK)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, nb * BLOCK - T), (0, 0), (0, 0)))  # noqa: E731
    qb = pad(q).reshape(B, nb, BLOCK, HEADS, 3, HEAD_DIM).transpose(1, 0, 3, 4, 2, 5)
    qb = qb.reshape(nb, B, HEADS, 3 * BLOCK, HEAD_DIM)
    kb = pad(k).reshape(B, nb, BLOCK, HEADS, HEAD_DIM).transpose(1, 0, 3, 2, 4)
    vb = pad(v).reshape(B, nb, BLOCK, HEADS, HEAD_DIM).transpose(1, 0, 3, 2, 4)
    outs = []
    for i in range(nb):
        def key_block(j, acc, q_i=qb[i]):
            s = jnp.einsum("bhmd,bhsd->bhms", q_i, kb[j]) * HEAD_DIM ** -0.5
            return acc + jnp.einsum("bhms,bhsd->bhmd", s, vb[j])
        outs.append(jnp.tanh(jax.lax.fori_loop(0, i + 1, key_block, jnp.zeros((B, HEADS, 3 * BLOCK, HEAD_DIM)))))
    o = jnp.stack(outs).reshape(nb, B, HEADS, 3, BLOCK, HEAD_DIM).transpose(1, 0, 4, 2, 3, 5)
    return o.reshape(B, nb * BLOCK, HEADS * 3 * HEAD_DIM)[:, :T]


def forward(w_qkv, w_o, x):
    def layer(x, w):
        qkv = x @ w[0]
        B, T, _ = x.shape
        q = qkv[..., :9 * HEAD_DIM].reshape(B, T, 9, HEAD_DIM)
        k = qkv[..., 9 * HEAD_DIM:12 * HEAD_DIM].reshape(B, T, HEADS, HEAD_DIM)
        v = qkv[..., 12 * HEAD_DIM:].reshape(B, T, HEADS, HEAD_DIM)
        return x + attention(q, k, v) @ w[1], None
    return jax.lax.scan(layer, x, (w_qkv, w_o))[0]


def main():
    defaults = "--defaults" in sys.argv[1:]
    rng = np.random.default_rng(0)
    w_qkv = jnp.asarray(0.02 * rng.standard_normal((LAYERS, WIDTH, 15 * HEAD_DIM)), jnp.float32)
    w_o = jnp.asarray(0.02 * rng.standard_normal((LAYERS, 9 * HEAD_DIM, WIDTH)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((ROWS, LENGTH, WIDTH)), jnp.float32)
    lowered = jax.jit(forward).lower(w_qkv, w_o, x)
    options = None
    if not defaults and tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) >= (0, 8):
        options = {"xla_cpu_experimental_ynn_fusion_type": ""}  # keep YNNPACK off the products (Eigen's take them)
    program = lowered.compile(options)
    at_once = [None, None]

    def run(i):
        at_once[i] = np.asarray(program(w_qkv, w_o, x))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = np.asarray(program(w_qkv, w_o, x))
    wrong = False
    for i, out in enumerate(at_once):
        rows = np.nonzero(np.abs(out - alone).max(axis=(1, 2)) > 1e-3)[0].tolist()
        print(f"jaxlib {importlib.metadata.version('jaxlib')}, {'defaults' if options is None else options}: "
              f"thread {i}: {'identical to' if np.array_equal(out, alone) else 'differs from'} the run alone; "
              f"rows off {rows}, largest difference {np.abs(out - alone).max():.3g}")
        wrong |= bool(rows)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
