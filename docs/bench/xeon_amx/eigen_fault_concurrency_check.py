"""Ad hoc (kept as the record of docs/performance.md, "Eigen's fault between two programs running at once"): the
fault's program as two single-device executables, run at once or one after the other, and beside other work.

Run from the repository root after `python scripts/bench_update.py --reps 1` (the batch cache); ~7 min on 2 cores (every form of
runs 2-4 of the raw file in one go)."""
import json, os, pickle, sys, threading, time
sys.argv = [sys.argv[0]]
ROOT = os.getcwd(); HERE = os.path.join(ROOT, "scripts"); sys.path.insert(0, HERE); sys.path.insert(0, HERE + "/bench_peers")
import common, bench_step, ours_peer
from stare_jax.distributed import cpu_devices_per_core
OPTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE", "xla_disable_hlo_passes": "tree_reduction_rewriter"}
workload = bench_step.real_workload("smollm2", os.path.join(ROOT, "runs", "bench_models"), common.REAL["new_tokens"])
workload.update(loss="stare", pack_tokens=0, cpu_devices=cpu_devices_per_core(workload["num_prompts"]))
config = ours_peer.bench_config(workload); config.model.attention_block = 128
from stare_jax import distributed, parallel
distributed.initialize(config)
import jax, numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from stare_jax.rl.update import CPU_UPDATE_COMPILER_OPTIONS, _group_prompts
batch = pickle.load(open(os.path.join(ROOT, "runs", "bench_update_batch.pkl"), "rb"))
group = workload["group_size"]
mesh = parallel.mesh_from_config(config.mesh)
model = ours_peer.load_policy(workload, config, mesh).model
graphdef, state = nnx.split(model)
R = np.shape(batch["response_mask"])[1]
positions = np.asarray(batch["response_mask"]) > 0
def make_hidden(m_, graphdef=graphdef):
    def hidden(state, ids, mask):
        with jax.sharding.use_abstract_mesh(m_.abstract_mesh):
            m = nnx.merge(graphdef, state)
            prompts = lambda x: _group_prompts(x, group_size=group, prompt_len=ids.shape[1] - R)
            return m.grouped_hidden_states(prompts(ids), prompts(mask), ids[:, -R:], mask[:, -R:])[1]
    return hidden
sharded = parallel.shard_batch(batch, mesh)
ref = np.asarray(jax.jit(make_hidden(mesh), compiler_options=dict(CPU_UPDATE_COMPILER_OPTIONS))(state, sharded["input_ids"], sharded["attention_mask"]))
def report(tag, got):
    diff = np.where(positions, np.abs(got - ref).max(axis=-1), 0.0)
    print(json.dumps({"form": tag, "rows_off": np.nonzero(diff.max(axis=1) > 1e-3)[0].tolist(), "max_difference": float(diff.max())}), flush=True)
spmd = jax.jit(make_hidden(mesh), compiler_options=OPTS)
for _ in range(2):
    report("one SPMD program on 2 devices", np.asarray(spmd(state, sharded["input_ids"], sharded["attention_mask"])))
devs = jax.devices(); n = len(devs); rows = positions.shape[0] // n
progs = []
for i, d in enumerate(devs):
    m1 = Mesh(np.array([d]).reshape((1,) * len(mesh.axis_names)), mesh.axis_names)
    gd_i, st = nnx.split(ours_peer.load_policy(workload, config, m1).model)
    ids = jax.device_put(np.asarray(batch["input_ids"])[i*rows:(i+1)*rows], d)
    mask = jax.device_put(np.asarray(batch["attention_mask"])[i*rows:(i+1)*rows], d)
    f = jax.jit(make_hidden(m1, gd_i), compiler_options=OPTS)
    f(st, ids, mask).block_until_ready()  # compile and warm each
    progs.append((f, st, ids, mask))
for mode in ("concurrent", "sequential", "concurrent"):
    outs = [None] * n
    def run(i):
        f, st, ids, mask = progs[i]; outs[i] = np.asarray(f(st, ids, mask))
    if mode == "concurrent":
        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        [t.start() for t in ts]; [t.join() for t in ts]
    else:
        for i in range(n): run(i)
    report(f"{n} single-device programs, {mode}", np.concatenate(outs))
# device 0's Eigen program beside other work on device 1
f0, st0, ids0, mask0 = progs[0]
half = rows
def ref0(): return ref[:half]
def report0(tag, got):
    diff = np.where(positions[:half], np.abs(got - ref[:half]).max(axis=-1), 0.0)
    print(json.dumps({"form": tag, "rows_off": np.nonzero(diff.max(axis=1) > 1e-3)[0].tolist(), "max_difference": float(diff.max())}), flush=True)
# (a) device 1 runs the same program compiled with the reference options (YNNPACK products)
d1 = devs[1]
m1 = Mesh(np.array([d1]).reshape((1,) * len(mesh.axis_names)), mesh.axis_names)
_, st1, ids1, mask1 = progs[1]
gd1 = nnx.graphdef(nnx.merge(*nnx.split(ours_peer.load_policy(workload, config, m1).model)))
g1 = jax.jit(make_hidden(m1, gd1), compiler_options=dict(CPU_UPDATE_COMPILER_OPTIONS)); g1(st1, ids1, mask1).block_until_ready()
# (b) device 1 runs plain float32 matmuls for about as long
a = jax.device_put(np.ones((2048, 2048), np.float32), d1)
mm = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda i, y: (y @ x) * 1e-3, x)); mm(a).block_until_ready()
b = jax.device_put(np.ones((6144, 576), np.float32), d1)
red = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, y: y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6) + 1e-3, x)); red(b).block_until_ready()
att = jax.device_put(np.ones((4, 9, 3, 256, 256), np.float32), d1)
smx = jax.jit(lambda x: jax.lax.fori_loop(0, 30, lambda i, y: jax.nn.softmax(y, -1) @ x + 1e-3 * y, x)); smx(att).block_until_ready()
for tag, other in (("beside YNNPACK's program on device 1", lambda: g1(st1, ids1, mask1).block_until_ready()),
                   ("beside RMS-norm reductions on device 1", lambda: red(b).block_until_ready()),
                   ("beside softmax and batched products on device 1", lambda: smx(att).block_until_ready()),
                   ("beside plain matmuls on device 1", lambda: mm(a).block_until_ready()),
                   ("alone", None)):
    out = [None]
    t0 = threading.Thread(target=lambda: out.__setitem__(0, np.asarray(f0(st0, ids0, mask0))))
    t1 = threading.Thread(target=other) if other else None
    t0.start(); t1 and t1.start(); t0.join(); t1 and t1.join()
    report0("device 0's Eigen program " + tag, out[0])
# run 4 of the raw file: the model forward on device 1 with and without attention blocks, either kernel
import copy
variants = []
for block, opts, tag in ((1024, dict(CPU_UPDATE_COMPILER_OPTIONS), "YNNPACK forward without attention blocks"),
                         (128, dict(CPU_UPDATE_COMPILER_OPTIONS), "YNNPACK forward with attention blocks"),
                         (1024, OPTS, "Eigen forward without attention blocks")):
    c = copy.deepcopy(config); c.model.attention_block = block
    gd, stv = nnx.split(ours_peer.load_policy(workload, c, m1).model)
    g = jax.jit(make_hidden(m1, gd), compiler_options=opts); g(stv, ids1, mask1).block_until_ready()
    variants.append((tag, lambda g=g, stv=stv: g(stv, ids1, mask1).block_until_ready()))
for tag, other in variants + variants:
    out = [None]
    t0 = threading.Thread(target=lambda: out.__setitem__(0, np.asarray(f0(st0, ids0, mask0))))
    t1 = threading.Thread(target=other)
    t0.start(); t1.start(); t0.join(); t1.join()
    report0("device 0's Eigen program beside " + tag + " on device 1", out[0])
