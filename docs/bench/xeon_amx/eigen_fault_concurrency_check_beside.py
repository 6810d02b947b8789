"""Ad hoc, the second form of eigen_fault_concurrency_check.py (same setup): device 0's Eigen program beside
the model's forward on device 1 with and without attention blocks, on YNNPACK's or Eigen's products."""
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
for _ in range(0):
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
f0, st0, ids0, mask0 = progs[0]
half = rows
def report0(tag, got):
    diff = np.where(positions[:half], np.abs(got - ref[:half]).max(axis=-1), 0.0)
    print(json.dumps({"form": tag, "rows_off": np.nonzero(diff.max(axis=1) > 1e-3)[0].tolist(), "max_difference": float(diff.max())}), flush=True)
d1 = devs[1]
m1 = Mesh(np.array([d1]).reshape((1,) * len(mesh.axis_names)), mesh.axis_names)
_, st1, ids1, mask1 = progs[1]
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
