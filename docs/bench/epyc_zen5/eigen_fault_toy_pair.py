"""Toy form of Eigen's fault check (docs/performance.md, "Eigen's fault on the Zen 5 host"): two
single-device programs of SmolLM2-135M's layer shapes (RMSNorm, q/k/v and o products, per-row causal
attention over 256-token rows with the whole [256, 256] matrix, SwiGLU MLP; random weights; a scan over
LAYERS layers on TOKENS tokens) compiled with Eigen's products and YNNPACK's reductions, run at once from
two threads and then one after the other, three times; prints whether each device's output at once is
bit-identical to its output alone.

BLOCK > 0: the attention is stare_jax's grouped_causal_attention in blocks of BLOCK positions, its prompt
keys and values random, or with `prompts` those of 81-token prompts (one per 8 rows) run through the same
layers; with `rope` the inputs are token ids gathered from a [49152, 576] embedding table and q and k
turn by stare_jax's apply_rope; with `weights` the layers (and with `rope` the embedding) are
SmolLM2-135M's trained ones from runs/bench_models/smollm2 (`scripts/bench_step.py --model smollm2`
writes it).

Usage: python eigen_fault_toy_pair.py [LAYERS [TOKENS [BLOCK [prompts] [rope] [weights]]]]"""
import json
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from stare_jax.models.blockwise_attention import grouped_causal_attention  # noqa: E402
from stare_jax.models.decoder import apply_rope  # noqa: E402

OPTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE",
        "xla_disable_hlo_passes": "tree_reduction_rewriter"}
L = int(sys.argv[1]) if len(sys.argv) > 1 else 30
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
BLOCK = int(sys.argv[3]) if len(sys.argv) > 3 else 0
PROMPTS, ROPE, WEIGHTS = ("prompts" in sys.argv[4:], "rope" in sys.argv[4:], "weights" in sys.argv[4:])
if T % 2048 or L < 1 or BLOCK < 0 or (PROMPTS and not BLOCK):
    print("eigen_fault_toy_pair.py: error: TOKENS must be a multiple of 2048 (rows of 256, groups of 8 rows), "
          "LAYERS >= 1, BLOCK >= 0, and `prompts` needs BLOCK > 0", file=sys.stderr)
    sys.exit(2)
D, F, R, P = 576, 1536, 256, 81  # hidden, MLP, response row, prompt length
ROWS, GROUPS = T // R, T // R // 8
lengths = np.random.default_rng(1).integers(1, R + 1, ROWS)
lengths[0] = 28
VALID = jnp.asarray((np.arange(R)[None] < lengths[:, None]).astype(np.float32))


def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w


def mlp(h, p):
    b = rms(h, p["n2"])
    return h + (jax.nn.silu(b @ p["g"]) * (b @ p["u"])) @ p["d"]


def layer(carry, p, cos=None, sin=None):
    h, hp = carry
    qkv = rms(h, p["n1"]) @ p["qkv"]
    q, k, v = qkv[:, :D].reshape(ROWS, R, 9, 64), qkv[:, D:D + 192].reshape(ROWS, R, 3, 64), qkv[:, D + 192:].reshape(ROWS, R, 3, 64)
    if ROPE:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if BLOCK:
        if PROMPTS:  # the prompts through the same layer; their keys and values are the first key block
            qkvp = rms(hp, p["n1"]) @ p["qkv"]
            kp, vp = qkvp[:, D:D + 192].reshape(GROUPS, P, 3, 64), qkvp[:, D + 192:].reshape(GROUPS, P, 3, 64)
            hp = mlp(hp + qkvp[:, :D] @ p["o"], p)
        else:
            kp, vp = jnp.tanh(p["kp"]), jnp.tanh(p["vp"])
        att = grouped_causal_attention(q, kp, vp, jnp.ones((GROUPS, P), jnp.float32), k, v, VALID, BLOCK)
    else:
        k, v = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
        scores = jnp.where(jnp.tril(jnp.ones((R, R), bool)), jnp.einsum("brhd,bshd->bhrs", q, k) / 8.0, -1e30)
        att = jnp.einsum("bhrs,bshd->brhd", jax.nn.softmax(scores, -1), v)
    return (mlp(h + att.reshape(T, D) @ p["o"], p), hp), None


def forward(params, embed, x, xp):
    cos = sin = None
    if ROPE:  # x holds token ids
        x = jnp.take(embed, x, axis=0)
        angles = jnp.arange(R, dtype=jnp.float32)[:, None] / 100000.0 ** (jnp.arange(32) / 32.0)
        cos, sin = (jnp.broadcast_to(f(angles), (ROWS, R, 32)) for f in (jnp.cos, jnp.sin))
    (h, _), _ = jax.lax.scan(lambda c, p: layer(c, p, cos, sin), (x, xp), params)
    return rms(h, jnp.ones((D,), jnp.float32))


def trained():
    """SmolLM2's first L layers as [L, in, out] arrays of the toy's names, and its embedding."""
    from safetensors.numpy import load_file
    w = load_file("runs/bench_models/smollm2/model.safetensors")
    stack = lambda name: np.stack([w[f"model.layers.{i}.{name}"] for i in range(L)])  # noqa: E731
    t = lambda name: stack(name).transpose(0, 2, 1)  # noqa: E731  [out, in] -> [in, out]
    return {"n1": stack("input_layernorm.weight"), "n2": stack("post_attention_layernorm.weight"),
            "qkv": np.concatenate([t(f"self_attn.{n}_proj.weight") for n in "qkv"], axis=-1),
            "o": t("self_attn.o_proj.weight"), "g": t("mlp.gate_proj.weight"), "u": t("mlp.up_proj.weight"),
            "d": t("mlp.down_proj.weight")}, w["model.embed_tokens.weight"]


rng = np.random.default_rng(0)


def random_params():
    s = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)  # noqa: E731
    return {"n1": np.ones((L, D), np.float32), "n2": np.ones((L, D), np.float32), "qkv": s(L, D, 960),
            "o": s(L, D, D), "g": s(L, D, F), "u": s(L, D, F), "d": s(L, F, D),
            "kp": s(L, GROUPS, P, 3, 64), "vp": s(L, GROUPS, P, 3, 64)}, None


programs = []
for device in jax.devices():
    params, embed = random_params()
    if WEIGHTS:
        layers, embed = trained()
        params.update(layers)
    if ROPE:
        embed = embed if embed is not None else rng.standard_normal((49152, D)).astype(np.float32)
        x = rng.integers(0, 49152, T).astype(np.int32)
    else:
        x = rng.standard_normal((T, D)).astype(np.float32)
    xp = rng.standard_normal((GROUPS * P, D)).astype(np.float32)
    args = jax.device_put((params, embed, x, xp), device)
    f = jax.jit(forward, compiler_options=OPTS)
    programs.append(lambda f=f, args=args: np.asarray(f(*args)))
    programs[-1]()  # compiled and run once before the two forms

outputs = [None, None]


def run(i):
    outputs[i] = programs[i]()


results = []
for rep in range(3):
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    at_once, seconds = list(outputs), time.time() - start
    for i in range(2):
        run(i)
    devices = []
    for i in range(2):
        diff = np.abs(at_once[i] - outputs[i]).max(-1)
        off = np.flatnonzero(diff > 0)
        devices.append({"identical": bool(np.array_equal(at_once[i], outputs[i])), "tokens_off": int(off.size),
                        "first": int(off[0]) if off.size else None, "last": int(off[-1]) if off.size else None,
                        "max": float(diff.max())})
    results.append({"rep": rep, "at_once_s": round(seconds, 2), "devices": devices})
print(json.dumps({"layers": L, "tokens": T, "attention_block": BLOCK, "prompts": PROMPTS, "rope": ROPE,
                  "weights": WEIGHTS, "results": results}))
