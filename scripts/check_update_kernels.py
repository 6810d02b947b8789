"""Checks the update's decoder forward on the real-model batch under other XLA:CPU compiler options.

The update step's forward (`Decoder.grouped_hidden_states`: each group's prompt once, its
responses after it) runs on the fixed real-model batch of `scripts/bench_update.py` on the host's
data-parallel CPU mesh, each option set compiled once: once with XLA:CPU's YNNPACK products
(`update.CPU_UPDATE_COMPILER_OPTIONS` alone, `model.cpu_gemm = "ynnpack"`: the reference) and
`--calls` times with `--options`. It prints one JSON line: for each call, the rows whose final
hidden states differ from the reference by more than `--tolerance` at a response position, the
largest difference and how many response positions differ (with the first and last, counted row-major
over the rows and their response positions); and whether the calls agree with each other. The default `--options` are the
update's shipped ones for the batch (`model.cpu_gemm = "auto"`: Eigen's products, YNNPACK's
reductions; XLA's defaults where the sequences are longer than `model.attention_block`, whose
blocks met the fault: `--attention-block 32 --options '{"xla_cpu_experimental_ynn_fusion_type":
"LIBRARY_FUSION_TYPE_REDUCE", "xla_disable_hlo_passes": "tree_reduction_rewriter"}'` shows it). `--options
'{"xla_cpu_experimental_ynn_fusion_type": "", "xla_disable_hlo_passes": "tree_reduction_rewriter"}'`
(`EIGEN_MATMULS`: Eigen's products and XLA's own reductions) reproduces the fault of
docs/performance.md, "Eigen's matmuls in the update gave wrong results on two CPU devices": wrong
hidden states for the first ~512 positions of each device's rows, different from call to call, on
two devices and SmolLM2's 30 layers.

    python scripts/bench_update.py --reps 1          # writes runs/bench_update_batch.pkl once
    python scripts/check_update_kernels.py [--options JSON] [--layers N] [--rows N] [--calls 2]

`--per-device-programs` also compiles the option set under test as one single-device program per
device (each on its own copy of the model and its own rows) and runs them from one thread each at
once, then one after the other: the fault of the section "Eigen's fault between two programs running
at once" shows in the first and not in the second. Each device's output of the two runs is also compared
with the other (`at_once_vs_one_after_another`: the same compiled programs, so any difference is the
fault, with no reference needed; where they differ, how far the wrong values are from each other device's
output alone at the same rows and positions). `--program-layers L0,L1,...` runs only the first Li layers in device
i's program (0: all), to find which part of each side the fault needs.

`--layers N` runs only the first N layers, `--rows N` only the first N rows of the batch (whole
groups of 8), `--cpu-devices 1` one device with every core, `--attention-block N` sets
`model.attention_block` (the batch's 81-token prompts attend in blocks when N < 81, its responses of
up to 256 positions in `grouped_causal_attention`'s blocks when N is below their length),
`--response-positions N` keeps only the first N response positions of every row (a shorter
[rows x N] response layout), `--ungrouped` runs the forward of whole sequences
(`ppo.share_prompt = false`: each row's prompt again before its response, `Decoder.hidden_states`,
causal attention in blocks of the whole sequence when it is longer than the block),
`--full-masks` makes every position a real token (no left padding, no masked key),
`--unrolled-layers` unrolls the layers (`model.scan_layers = False`: no loop carries the hidden
states from one layer to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "bench_peers"))

import common  # noqa: E402

#: Eigen's products with XLA's own reductions: the pair that computed wrong rows (the module docstring)
EIGEN_MATMULS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_experimental_xnn_fusion_type": "",
                 "xla_disable_hlo_passes": "tree_reduction_rewriter"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="",
                    help="XLA compiler options under test, a JSON object (default: the update's shipped ones, "
                         "`model.cpu_gemm = \"auto\"`, for this batch and attention block)")
    ap.add_argument("--calls", type=int, default=2, help="calls of the program under test")
    ap.add_argument("--layers", type=int, default=0, help="run only the first N decoder layers (0: all)")
    ap.add_argument("--rows", type=int, default=0, help="only the first N rows of the batch (0: all; whole groups)")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest difference counted as equal")
    ap.add_argument("--cpu-devices", type=int, default=0, help="JAX CPU devices (0: one per core)")
    ap.add_argument("--attention-block", type=int, default=None,
                    help="model.attention_block (default: the config's); below the prompts' (responses') "
                         "length their attention runs in blocks")
    ap.add_argument("--per-device-programs", action="store_true",
                    help="also run the options under test as one single-device program per device, at once and "
                         "one after the other")
    ap.add_argument("--program-layers", default="",
                    help="with --per-device-programs: comma-separated layer counts, one per device's program "
                         "(0: all layers; default: all on every device)")
    ap.add_argument("--response-positions", type=int, default=0,
                    help="keep only the first N response positions of every row (0: all 256)")
    ap.add_argument("--ungrouped", action="store_true",
                    help="the forward of whole sequences (ppo.share_prompt = false): every row's prompt and response "
                         "as one sequence, plain causal attention")
    ap.add_argument("--full-masks", action="store_true",
                    help="every position a real token (attention and response masks all ones; no left padding)")
    ap.add_argument("--unrolled-layers", action="store_true",
                    help="model.scan_layers = False: the layers unrolled into one program, no while loop over them")
    ap.add_argument("--model-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_models"))
    ap.add_argument("--batch-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_update_batch.pkl"))
    args = ap.parse_args()
    try:
        options = json.loads(args.options) if args.options else None  # None: the shipped ones, in `check`
    except json.JSONDecodeError as e:
        ap.error(f"--options: not JSON: {e}")
    if options is not None and not isinstance(options, dict):
        ap.error("--options must be a JSON object")
    if args.calls < 1 or args.layers < 0 or args.rows < 0 or (args.attention_block or 0) < 0:
        ap.error("--calls must be >= 1, --layers, --rows and --attention-block >= 0")
    if args.per_device_programs and args.cpu_devices == 1:
        ap.error("--per-device-programs needs more than one CPU device (--cpu-devices 0 or >= 2)")
    try:
        args.program_layers = [int(n) for n in args.program_layers.split(",")] if args.program_layers else []
    except ValueError:
        ap.error(f"--program-layers must be comma-separated integers, got {args.program_layers!r}")
    if args.program_layers and (not args.per_device_programs or min(args.program_layers) < 0):
        ap.error("--program-layers needs --per-device-programs and counts >= 0")
    if args.program_layers:
        from stare_jax.distributed import cpu_devices_per_core
        devices = args.cpu_devices or cpu_devices_per_core(common.REAL["num_prompts"])
        if len(args.program_layers) != devices:
            ap.error(f"--program-layers names {len(args.program_layers)} programs for {devices} devices")
    if not 0 <= args.response_positions <= common.REAL["new_tokens"]:
        ap.error(f"--response-positions must be between 0 and {common.REAL['new_tokens']}")
    if args.rows % common.REAL["group_size"]:
        ap.error(f"--rows must be a multiple of the group size {common.REAL['group_size']}")
    if not os.path.exists(args.batch_cache):
        ap.error(f"--batch-cache {args.batch_cache} does not exist: run `python scripts/bench_update.py --reps 1` "
                 "once to write it")
    print(json.dumps(check(args, options)))


def check(args, options: dict | None) -> dict:
    """Runs the reference and the option set under test (None: the update's shipped options for this
    batch and `model.attention_block`, `UpdateStep.options_for`); returns the comparison (see the
    module doc)."""
    import bench_step
    import ours_peer

    from stare_jax.distributed import cpu_devices_per_core

    workload = bench_step.real_workload("smollm2", args.model_cache, common.REAL["new_tokens"])
    workload.update(loss="stare", pack_tokens=0, cpu_devices=args.cpu_devices or cpu_devices_per_core(
        workload["num_prompts"]))
    config = ours_peer.bench_config(workload)
    if args.attention_block is not None:
        config.model.attention_block = args.attention_block
    if args.unrolled_layers:
        config.model.scan_layers = False
    from stare_jax import distributed, parallel
    distributed.initialize(config)
    import threading

    import jax
    import numpy as np
    from flax import nnx

    from stare_jax.models.decoder import LayerStack, positions_from_mask
    from stare_jax.rl.update import CPU_UPDATE_COMPILER_OPTIONS, _group_prompts, cpu_update_compiler_options

    with open(args.batch_cache, "rb") as f:
        batch = pickle.load(f)
    group = workload["group_size"]
    if args.rows:
        batch = {k: np.asarray(v)[:args.rows] for k, v in batch.items()}
    if args.full_masks:  # the padding's token ids become real tokens: no masked key anywhere
        batch = dict(batch, attention_mask=np.ones_like(batch["attention_mask"]),
                     response_mask=np.ones_like(batch["response_mask"]))
    if args.response_positions:  # every row's prompt and its first N response positions (the forward reads no more)
        end = np.shape(batch["input_ids"])[1] - np.shape(batch["response_mask"])[1] + args.response_positions
        batch = {"input_ids": np.asarray(batch["input_ids"])[:, :end],
                 "attention_mask": np.asarray(batch["attention_mask"])[:, :end],
                 "response_mask": np.asarray(batch["response_mask"])[:, :args.response_positions]}
    arrays = LayerStack.arrays

    def cut_layers(n):
        """Makes programs traced from now on run only the first n decoder layers (0: all)."""
        LayerStack.arrays = (lambda self: {k: v[:n] for k, v in arrays(self).items()}) if n else arrays

    cut_layers(args.layers)
    mesh = parallel.mesh_from_config(config.mesh)
    model = ours_peer.load_policy(workload, config, mesh).model
    if options is None:  # as `UpdateStep.options_for`: no Eigen products where attention may run in blocks
        options = cpu_update_compiler_options(blockwise=model.self_attention_block(np.shape(batch["input_ids"])[1]) > 0)
    R = np.shape(batch["response_mask"])[1]
    positions = np.asarray(batch["response_mask"]) > 0

    def compiled(model, mesh, opts, ids, mask):
        """The decoder's final hidden states of (ids, mask) on `mesh` under `opts`, compiled once,
        as a function of no arguments returning a host array."""
        graphdef, state = nnx.split(model)

        def hidden(state, ids, mask):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                m = nnx.merge(graphdef, state)
                if args.ungrouped:  # every row's prompt again, the response positions' hidden states
                    return m.hidden_states(ids, positions_from_mask(mask), mask)[0][:, -R:]
                prompts = lambda x: _group_prompts(x, group_size=group, prompt_len=ids.shape[1] - R)  # noqa: E731
                return m.grouped_hidden_states(prompts(ids), prompts(mask), ids[:, -R:], mask[:, -R:])[1]

        fn = jax.jit(hidden, compiler_options=opts or None)
        return lambda: np.asarray(fn(state, ids, mask))

    def differing(got, reference, where):
        """[rows, R]: the response positions whose hidden states differ by more than the tolerance."""
        return where & (np.abs(got - reference).max(axis=-1) > args.tolerance)

    def compare(got, reference, where=positions):
        diff = np.where(where, np.abs(got - reference).max(axis=-1), 0.0)
        off = np.flatnonzero(differing(got, reference, where))  # row-major over (row, position)
        return {"rows_off": np.nonzero(diff.max(axis=1) > args.tolerance)[0].tolist(), "max_difference": float(diff.max()),
                "positions_off": {"count": int(off.size), "first": int(off[0]), "last": int(off[-1])} if off.size else None}

    sharded = parallel.shard_batch(batch, mesh)
    reference = compiled(model, mesh, dict(CPU_UPDATE_COMPILER_OPTIONS), sharded["input_ids"], sharded["attention_mask"])()
    under_test = compiled(model, mesh, options, sharded["input_ids"], sharded["attention_mask"])
    calls, first = [], None
    for _ in range(args.calls):
        got = under_test()
        calls.append(compare(got, reference))
        first = got if first is None else first
        calls[-1]["equals_first_call"] = bool(np.array_equal(got, first))
    all_layers = args.layers or model.config.num_layers  # what the reference and the calls ran
    result = {"options": options, "reference_options": CPU_UPDATE_COMPILER_OPTIONS, "calls": calls,
              "rows": int(positions.shape[0]), "layers": all_layers,
              "attention_block": model.attention_block, "scan_layers": config.model.scan_layers,
              "response_positions": R, "grouped": not args.ungrouped, "full_masks": args.full_masks,
              "devices": jax.device_count(), "host_cpu": common.host_cpu()}
    if args.per_device_programs:
        devices = list(mesh.devices.flat)
        layers = args.program_layers or [0] * len(devices)  # as many as devices (checked in main)
        rows = positions.shape[0] // len(devices)  # the data axis holds each device's rows contiguously
        programs = []
        for i, device in enumerate(devices):
            mesh1 = jax.sharding.Mesh(np.array([device]).reshape((1,) * len(mesh.axis_names)), mesh.axis_names)
            part = {k: jax.device_put(np.asarray(batch[k])[i * rows:(i + 1) * rows], device)
                    for k in ("input_ids", "attention_mask")}
            program = compiled(ours_peer.load_policy(workload, config, mesh1).model, mesh1, options,
                               part["input_ids"], part["attention_mask"])
            cut_layers(layers[i] or args.layers)
            program()  # traced, compiled and run once before the two forms
            cut_layers(args.layers)
            programs.append(program)
        outputs = [None] * len(programs)

        def run(i):
            outputs[i] = programs[i]()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(programs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        at_once_outputs = list(outputs)
        for i in range(len(programs)):
            run(i)
        program_layers = [n or all_layers for n in layers]
        per_device = {"program_layers": program_layers}
        if all(n == all_layers for n in program_layers):  # as the reference
            per_device.update(at_once=compare(np.concatenate(at_once_outputs), reference),
                              one_after_another=compare(np.concatenate(outputs), reference))
        per_device["at_once_vs_one_after_another"] = []
        for i, (a, b) in enumerate(zip(at_once_outputs, outputs)):  # rows_off within each device's rows
            where = positions[i * rows:(i + 1) * rows]
            entry = compare(a, b, where) | {"identical": bool(np.array_equal(a, b))}
            off = differing(a, b, where)
            if off.any():  # are the wrong values another device's, at the same row and position?
                entry["off_values_vs_other_devices_alone"] = {
                    str(j): float(np.abs(a - outputs[j])[off].max()) for j in range(len(outputs)) if j != i}
            per_device["at_once_vs_one_after_another"].append(entry)
        result["per_device_programs"] = per_device
    return result


if __name__ == "__main__":
    main()
