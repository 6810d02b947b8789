"""STARE's cost over plain GRPO, measured in one process: the two update steps alternate on one batch.

The rollout does not depend on the loss, so STARE's overhead is the difference of the update steps.
This script builds both (the bench workload's config with `loss.name` "stare" — adaptive C2, the
most expensive variant — and "grpo"), each on its own copy of the weights, feeds them the same
sampled batch, and alternates them for `--rounds` rounds (the order flips every round). Timing
them side by side in one process cancels most of the machine's drift, which dominates when the
two run in separate processes a few percent apart. Prints one JSON line:

    stare_update_s, grpo_update_s, rollout_s          medians (seconds)
    update_overhead     median over rounds of stare / grpo - 1 (wall time)
    update_cpu_overhead the same from process CPU time (immune to time stolen by a VM's host)
    step_overhead       (median stare - median grpo) / (rollout + median stare)

    python scripts/bench_stare_overhead.py [--large | --smoke] [--rounds 15] [--cpu-devices N] [--pe-metrics | --cpu-options]

With `--pe-metrics` the two alternating steps are STARE's with and without the polarity-entropy
metrics (`pe_quad_*`, issue 18): the second is the same step traced with
`diagnostics.polarity_entropy_diagnostics` returning nothing, so XLA drops the quadrant masks too.
The keys then read `with_update_s`, `without_update_s`, and the overheads are with / without - 1.

With `--cpu-options` the two are STARE's step compiled as the trainer compiles it on CPU
(`update.CPU_UPDATE_COMPILER_OPTIONS`: XLA's tree-reduction rewrite off) and with XLA:CPU's defaults
(`make_update_step(..., cpu_options=False)`): keys `shipped_update_s`, `defaults_update_s`, overheads
shipped / defaults - 1 (negative: the shipped options are the faster on this host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, os.path.dirname(HERE))

import checkpoint  # noqa: E402
import common  # noqa: E402
import ours_peer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_synthetic_workload_flags(ap)
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds (one update of each loss per round)")
    ap.add_argument("--cpu-devices", type=int, default=0, help="JAX CPU devices (0: one per core)")
    ap.add_argument("--pe-metrics", action="store_true",
                    help="time STARE's step with vs without the pe_quad_* metrics instead of STARE vs GRPO")
    ap.add_argument("--cpu-options", action="store_true",
                    help="time STARE's step with the shipped CPU compiler options vs XLA:CPU's defaults instead")
    args = ap.parse_args()
    if args.pe_metrics and args.cpu_options:
        ap.error("--pe-metrics and --cpu-options are different comparisons: pick one")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from stare_jax.distributed import cpu_devices_per_core

    workload = dict(common.SYNTHETIC[common.synthetic_workload_name(args)])
    workload["cpu_devices"] = args.cpu_devices or cpu_devices_per_core(workload["num_prompts"])
    with tempfile.TemporaryDirectory() as tmp:
        workload["checkpoint"] = os.path.join(tmp, "model")
        checkpoint.write_synthetic_checkpoint(workload["checkpoint"], common.synthetic_workload_name(args))
        print(json.dumps(measure(workload, args.rounds, pe_metrics=args.pe_metrics, cpu_options=args.cpu_options)))


def _without_pe_metrics():
    """Context in which a traced update step computes no polarity-entropy metrics."""
    from unittest import mock

    from stare_jax.rl import update

    return mock.patch.object(update, "polarity_entropy_diagnostics", lambda *a, **k: {})


def measure(workload: dict, rounds: int, pe_metrics: bool = False, cpu_options: bool = False) -> dict:
    """Builds both update steps on one sampled batch and times them alternately (see the module doc)."""
    import contextlib

    import jax
    from flax import nnx

    from stare_jax import compilation, distributed, parallel
    from stare_jax.rl import create_train_state, make_update_step

    if pe_metrics:  # the same STARE config twice; the second traced without the pe_quad_* metrics
        names = ("with", "without")
        configs = {n: ours_peer.bench_config(dict(workload, loss="stare")) for n in names}
        trace_ctx = {"with": contextlib.nullcontext, "without": _without_pe_metrics}
    elif cpu_options:  # the same STARE config twice; the second compiled without the CPU update options
        names = ("shipped", "defaults")
        configs = {n: ours_peer.bench_config(dict(workload, loss="stare")) for n in names}
        trace_ctx = {n: contextlib.nullcontext for n in names}
    else:
        names = ("stare", "grpo")
        configs = {loss: ours_peer.bench_config(dict(workload, loss=loss)) for loss in names}
        trace_ctx = {n: contextlib.nullcontext for n in names}
    first, second = names
    distributed.initialize(configs[first])
    compilation.use_persistent_cache(configs[first].compilation_cache_dir)  # $STARE_COMPILATION_CACHE_DIR if set
    mesh = parallel.mesh_from_config(configs[first].mesh)
    steps = {}
    for loss, config in configs.items():
        policy = ours_peer.load_policy(workload, config, mesh)
        state = create_train_state(policy.model, config, mesh=mesh)
        steps[loss] = [make_update_step(config, mesh, state, cpu_options=loss != "defaults"), nnx.state(state)]
    sampler = ours_peer.load_policy(workload, configs[first], mesh)  # the updates donate their weights
    key = jax.random.key(workload["seed"])
    rollout = ours_peer.fixed_rollout(workload, sampler, mesh)
    batch = ours_peer.update_batch(workload, rollout(), mesh)
    wall = {loss: [] for loss in steps}
    cpu = {loss: [] for loss in steps}
    rollout_s = []
    metric_keys = {}

    def timed(loss):
        step, state = steps[loss]
        time.sleep(0.3)
        t, c = time.perf_counter(), time.process_time()
        state, metrics = step.apply(state, batch, key)
        jax.block_until_ready(metrics)
        wall[loss].append(time.perf_counter() - t)
        cpu[loss].append(time.process_time() - c)
        steps[loss][1] = state
        metric_keys[loss] = set(metrics)

    for loss in steps:  # compile (traced inside the variant's context)
        with trace_ctx[loss]():
            timed(loss)
        wall[loss].clear()
        cpu[loss].clear()
    if pe_metrics:  # the two compiled steps really differ in their metrics
        has_pe = {n: any(k.startswith("pe_quad_") for k in metric_keys[n]) for n in names}
        assert has_pe == {"with": True, "without": False}, has_pe
    for r in range(rounds):
        for loss in ((first, second) if r % 2 == 0 else (second, first)):
            timed(loss)
        t = time.perf_counter()
        rollout()
        rollout_s.append(time.perf_counter() - t)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    a, b = med(wall[first]), med(wall[second])
    return {"shape": {k: workload[k] for k in ("hidden_size", "num_layers", "new_tokens")}, "rounds": rounds,
            "devices": jax.device_count(), "compared": f"{first} vs {second}" + (" pe_quad metrics" if pe_metrics else "")
            + (" CPU options" if cpu_options else ""),
            f"{first}_update_s": round(a, 4), f"{second}_update_s": round(b, 4), "rollout_s": round(med(rollout_s), 4),
            "update_overhead": round(med([x / y - 1 for x, y in zip(wall[first], wall[second])]), 4),
            "update_cpu_overhead": round(med([x / y - 1 for x, y in zip(cpu[first], cpu[second])]), 4),
            "step_overhead": round((a - b) / (med(rollout_s) + a), 4), "host_cpu": common.host_cpu()}


if __name__ == "__main__":
    main()
