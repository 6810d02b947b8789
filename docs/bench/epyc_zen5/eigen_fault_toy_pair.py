"""Toy form of Eigen's fault check (docs/performance.md, "Eigen's fault on the Zen 5 host"): two
single-device programs of SmolLM2-135M's layer shapes (RMSNorm, q/k/v and o products, per-row causal
attention over 256-token rows with the whole [256, 256] matrix, SwiGLU MLP; random weights; a scan over
LAYERS layers on TOKENS tokens) compiled with Eigen's products and YNNPACK's reductions, run at once from
two threads and then one after the other, three times; prints whether each device's output at once is
bit-identical to its output alone. BLOCK > 0: the attention is stare_jax's grouped_causal_attention in
blocks of BLOCK positions, its prompt keys and values random, or with `prompts` those of 81-token prompts
(one per 8 rows) run through the same layers; with `rope` the inputs are token ids gathered from a
[49152, 576] embedding table and q and k turn by stare_jax's apply_rope; with `weights` (and `rope`) the
layers and the embedding are SmolLM2-135M's trained ones from runs/bench_models/smollm2.
Usage: python eigen_fault_toy_pair.py [LAYERS [TOKENS [BLOCK [prompts] [rope] [weights]]]]"""
import json, sys, threading, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
import numpy as np

OPTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE", "xla_disable_hlo_passes": "tree_reduction_rewriter"}
L = int(sys.argv[1]) if len(sys.argv) > 1 else 30
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
D, F, QKV = 576, 1536, 960
BLOCK = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if T % 2048:
    print("eigen_fault_toy_pair.py: error: TOKENS must be a multiple of 2048 (rows of 256, groups of 8 rows)",
          file=sys.stderr)
    sys.exit(2)
ROPE = "rope" in sys.argv[4:]  # embedding gather from a [49152, 576] table and RoPE on q and k
PROMPTS = "prompts" in sys.argv[4:]  # and sys.argv[4] == "prompts"  # the prompts through the layers, their keys and values the first key block  # > 0: grouped_causal_attention in blocks of BLOCK
_lens = np.random.default_rng(1).integers(1, 257, T // 256); _lens[0] = 28
VALID = jnp.asarray((np.arange(256)[None] < _lens[:, None]).astype(np.float32))

def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

def layer(carry, p):
    h, hp = carry
    ap_ = rms(hp, p["n1"])
    qkvp = ap_ @ p["qkv"]
    Bp = hp.shape[0] // 81
    kp_ = qkvp[:, D:D + 192].reshape(Bp, 81, 3, 64)
    vp_ = qkvp[:, D + 192:].reshape(Bp, 81, 3, 64)
    hp = hp + qkvp[:, :D] @ p["o"]
    bp = rms(hp, p["n2"])
    hp = hp + (jax.nn.silu(bp @ p["g"]) * (bp @ p["u"])) @ p["d"]
    a = rms(h, p["n1"])
    qkv = a @ p["qkv"]
    R = 256
    q = qkv[:, :D].reshape(-1, R, 9, 64)
    if ROPE:
        from stare_jax.models.decoder import apply_rope
        cos, sin = COSSIN
        q = apply_rope(q, cos, sin)
        qkv = qkv.at[:, D:D + 192].set(apply_rope(qkv[:, D:D + 192].reshape(-1, R, 3, 64), cos, sin).reshape(-1, 192))
    k = jnp.repeat(qkv[:, D:D + 192].reshape(-1, R, 3, 64), 3, axis=2)
    v = jnp.repeat(qkv[:, D + 192:].reshape(-1, R, 3, 64), 3, axis=2)
    if BLOCK:
        from stare_jax.models.blockwise_attention import grouped_causal_attention
        N = q.shape[0]
        kr, vr = qkv[:, D:D + 192].reshape(N, R, 3, 64), qkv[:, D + 192:].reshape(N, R, 3, 64)
        kp, vp = (kp_, vp_) if PROMPTS else (jnp.tanh(p["kp"]), jnp.tanh(p["vp"]))
        att = grouped_causal_attention(q, kp, vp, jnp.ones(kp.shape[:2], jnp.float32), kr, vr,
                                       VALID[:N], BLOCK).reshape(-1, D)
    else:
        sc = jnp.einsum("brhd,bshd->bhrs", q, k) / 8.0
        sc = jnp.where(jnp.tril(jnp.ones((R, R), bool)), sc, -1e30)
        att = jnp.einsum("bhrs,bshd->brhd", jax.nn.softmax(sc, -1), v).reshape(-1, D)
    h = h + att @ p["o"]
    b = rms(h, p["n2"])
    g, u = b @ p["g"], b @ p["u"]
    return (h + (jax.nn.silu(g) * u) @ p["d"], hp), None

def fwd(params, x, xp):
    if ROPE:  # x holds token ids here
        x = jnp.take(params.pop("embed"), x, axis=0)
        global COSSIN
        pos = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (x.shape[0] // 256, 256))
        ang = pos.astype(jnp.float32)[..., None] * (1.0 / 100000.0 ** (jnp.arange(32) / 32.0))
        COSSIN = (jnp.cos(ang), jnp.sin(ang))
    (h, hp), _ = jax.lax.scan(layer, (x, xp), params)
    return rms(h, jnp.ones((D,), jnp.float32))

WEIGHTS = "weights" in sys.argv[4:]  # SmolLM2's trained weights (runs/bench_models/smollm2, bench_step.py writes it)


def trained(L):
    from safetensors.numpy import load_file
    w = load_file("runs/bench_models/smollm2/model.safetensors")
    lay = lambda name: np.stack([w[f"model.layers.{i}.{name}"] for i in range(L)])  # noqa: E731
    t = lambda name: lay(name).transpose(0, 2, 1)  # noqa: E731  [out, in] -> [in, out]
    return {"n1": lay("input_layernorm.weight"), "n2": lay("post_attention_layernorm.weight"),
            "qkv": np.concatenate([t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                                   t("self_attn.v_proj.weight")], axis=-1),
            "o": t("self_attn.o_proj.weight"), "g": t("mlp.gate_proj.weight"), "u": t("mlp.up_proj.weight"),
            "d": t("mlp.down_proj.weight")}, w["model.embed_tokens.weight"]


rng = np.random.default_rng(0)
def params():
    s = lambda *sh: (rng.standard_normal(sh) / np.sqrt(sh[-2])).astype(np.float32)
    return {"n1": np.ones((L, D), np.float32), "n2": np.ones((L, D), np.float32), "qkv": s(L, D, QKV),
            "o": s(L, D, D), "g": s(L, D, F), "u": s(L, D, F), "d": s(L, F, D),
            "kp": s(L, (T // 256) // 8, 81, 3, 64), "vp": s(L, (T // 256) // 8, 81, 3, 64)}
devs = jax.devices()
progs = []
for i, dev in enumerate(devs):
    p = params()
    if WEIGHTS:
        layers, embed = trained(L)
        p.update(layers)
    p = jax.device_put(p, dev)
    if ROPE:
        p["embed"] = jax.device_put(embed if WEIGHTS else rng.standard_normal((49152, D)).astype(np.float32), dev)
        x = jax.device_put(rng.integers(0, 49152, T).astype(np.int32), dev)
    else:
        x = jax.device_put(rng.standard_normal((T, D)).astype(np.float32), dev)
    xp = jax.device_put(rng.standard_normal(((T // 256) // 8 * 81, D)).astype(np.float32), dev)
    f = jax.jit(fwd, compiler_options=OPTS)
    progs.append(lambda f=f, p=p, x=x, xp=xp: np.asarray(f(p, x, xp)))
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
print(json.dumps({"layers": L, "tokens": T, "attention_block": BLOCK, "prompts": PROMPTS, "rope": ROPE, "weights": WEIGHTS, "results": res}))
