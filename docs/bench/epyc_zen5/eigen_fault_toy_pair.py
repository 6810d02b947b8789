"""Toy form of Eigen's fault check (docs/performance.md, "Eigen's fault on the Zen 5 host"): two
single-device programs of SmolLM2-135M's layer shapes (RMSNorm, q/k/v and o products, per-row causal
attention over 256-token rows with the whole [256, 256] matrix, SwiGLU MLP; random weights; a scan over
LAYERS layers on TOKENS tokens) compiled with Eigen's products and YNNPACK's reductions, run at once from
two threads and then one after the other, three times; prints whether each device's output at once is
bit-identical to its output alone.  Usage: python eigen_fault_toy_pair.py [LAYERS [TOKENS]]"""
import json, sys, threading, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
import numpy as np

OPTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE", "xla_disable_hlo_passes": "tree_reduction_rewriter"}
L = int(sys.argv[1]) if len(sys.argv) > 1 else 30
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
D, F, QKV = 576, 1536, 960

def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

def layer(h, p):
    a = rms(h, p["n1"])
    qkv = a @ p["qkv"]
    R = 256
    q = qkv[:, :D].reshape(-1, R, 9, 64)
    k = jnp.repeat(qkv[:, D:D + 192].reshape(-1, R, 3, 64), 3, axis=2)
    v = jnp.repeat(qkv[:, D + 192:].reshape(-1, R, 3, 64), 3, axis=2)
    sc = jnp.einsum("brhd,bshd->bhrs", q, k) / 8.0
    sc = jnp.where(jnp.tril(jnp.ones((R, R), bool)), sc, -1e30)
    att = jnp.einsum("bhrs,bshd->brhd", jax.nn.softmax(sc, -1), v).reshape(-1, D)
    h = h + att @ p["o"]
    b = rms(h, p["n2"])
    g, u = b @ p["g"], b @ p["u"]
    return h + (jax.nn.silu(g) * u) @ p["d"], None

def fwd(params, x):
    h, _ = jax.lax.scan(layer, x, params)
    return rms(h, jnp.ones((D,), jnp.float32))

rng = np.random.default_rng(0)
def params():
    s = lambda *sh: (rng.standard_normal(sh) / np.sqrt(sh[-2])).astype(np.float32)
    return {"n1": np.ones((L, D), np.float32), "n2": np.ones((L, D), np.float32), "qkv": s(L, D, QKV),
            "o": s(L, D, D), "g": s(L, D, F), "u": s(L, D, F), "d": s(L, F, D)}
devs = jax.devices()
progs = []
for i, dev in enumerate(devs):
    p = jax.device_put(params(), dev)
    x = jax.device_put(rng.standard_normal((T, D)).astype(np.float32), dev)
    f = jax.jit(fwd, compiler_options=OPTS)
    progs.append(lambda f=f, p=p, x=x: np.asarray(f(p, x)))
    progs[-1]()
out = [None, None]
def run(i): out[i] = progs[i]()
res = []
for rep in range(3):
    th = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    t0 = time.time()
    [t.start() for t in th]; [t.join() for t in th]
    at_once = list(out)
    dt = time.time() - t0
    for i in range(2): run(i)
    r = []
    for i in range(2):
        d = np.abs(at_once[i] - out[i]).max(-1)
        off = np.flatnonzero(d > 0)
        r.append({"identical": bool(np.array_equal(at_once[i], out[i])), "tokens_off": int(off.size),
                  "first": int(off[0]) if off.size else None, "last": int(off[-1]) if off.size else None, "max": float(d.max())})
    res.append({"rep": rep, "at_once_s": round(dt, 2), "devices": r})
print(json.dumps({"layers": L, "tokens": T, "results": res}))
