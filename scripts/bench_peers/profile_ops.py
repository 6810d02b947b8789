"""Reading a `jax.profiler.trace` of XLA executions (CPU threads or accelerator devices): each op's
own time, by op kind and by output shape (shared by the benchmarks' `--profile` options)."""

from __future__ import annotations

import collections
import glob
import os
import re


def trace_events(trace_dir: str) -> list[tuple[str, str, float, float]]:
    """Every op event of the latest `jax.profiler.trace` run in `trace_dir`, read from its XSpace
    (`*.xplane.pb`; the Perfetto JSON beside it stops at 1,000,000 events, which a real-model update
    exceeds two thirds of the way through): (thread, op name, start, duration), times in us. See
    `events_from_planes` for which events."""
    from jax.profiler import ProfileData

    runs = os.path.join(trace_dir, "plugins", "profile")
    latest = os.path.join(runs, sorted(os.listdir(runs))[-1])
    found = glob.glob(os.path.join(latest, "*.xplane.pb"))
    if not found:
        raise SystemExit(f"no *.xplane.pb in {latest} (was the trace written?)")
    return events_from_planes(ProfileData.from_file(found[0]).planes)


#: the line of an accelerator's XSpace plane that holds one event per HLO op run on the device
DEVICE_OPS_LINE = "XLA Ops"


def events_from_planes(planes) -> list[tuple[str, str, float, float]]:
    """(thread, op name, start us, duration us) of a trace's planes. XLA:CPU runs ops on host
    threads, so on the CPU these are the `/host:CPU` planes' events; on a GPU or TPU the host
    planes hold only launches, and the ops are the "XLA Ops" line of each `/device:` plane (one
    "thread" per device). On a GPU, XLA's command buffers (CUDA graphs) hide the ops inside one
    graph launch: trace with `--xla_gpu_enable_command_buffer=` in XLA_FLAGS (bench_update.py's
    --profile sets it)."""
    planes = list(planes)  # ProfileData.planes is an iterator
    device = [(f"{plane.name} {line.name}", e.name, e.start_ns / 1e3, e.duration_ns / 1e3)
              for plane in planes if plane.name.startswith("/device:")
              for line in plane.lines if line.name == DEVICE_OPS_LINE for e in line.events]
    if device:
        return device
    return [(line.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3)
            for plane in planes if plane.name.startswith("/host:CPU")
            for line in plane.lines for e in line.events]


def _by_thread(events) -> dict[str, list[dict]]:
    """Events per thread in start order, each with its self time ("self": duration minus the
    events nested in it on the same thread), in us."""
    by_thread = collections.defaultdict(list)
    for thread, name, start, dur in events:
        by_thread[thread].append({"name": name, "ts": start, "dur": dur})
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            e["self"] = e["dur"]
            if stack:
                stack[-1]["self"] -= e["dur"]
            stack.append(e)
    return by_thread


SKIPPED_EVENTS = ("$", "ThunkExecutor", "ThreadpoolListener", "end:", "PjitFunction", "Common", "Wait",
                  "Rendezvous", "ParseArguments", "Handle", "Allocate", "PythonRef")


def op_seconds_per_device(events, devices: int) -> dict[str, float]:
    """Self time (s) per XLA op kind of `trace_events`, divided by `devices`: each event's duration
    minus that of the events nested in it on the same thread, summed by kind ("dot", "fusion",
    "while" (a loop's own time), "reduce-window", ...)."""
    kinds: collections.Counter = collections.Counter()
    for thread in _by_thread(events).values():
        for e in thread:
            name = e["name"]
            if name.startswith(SKIPPED_EVENTS):
                continue
            base = name.split(".")[0].removeprefix("wrapped_")
            kinds["fusion" if "fusion" in base else base] += e["self"]
    return {k: round(v / 1e6 / devices, 2) for k, v in kinds.most_common() if v / 1e6 / devices >= 0.01}


def self_seconds_by_op(events) -> dict[str, float]:
    """Self time (s) of every op name of `trace_events` over all threads, not divided by devices."""
    totals: collections.Counter = collections.Counter()
    for thread in _by_thread(events).values():
        for e in thread:
            totals[e["name"]] += e["self"] / 1e6
    return dict(totals)


def hlo_output_shapes(hlo_texts) -> dict[str, str]:
    """{instruction name: output shape} from optimised HLO module texts (`--xla_dump_hlo_as_text`)."""
    shapes: dict[str, str] = {}
    for text in hlo_texts:
        shapes.update(re.findall(r"%([\w.\-]+) = (\S+) ", text))
    return shapes


def seconds_by_kind_and_shape(events, shapes: dict[str, str], devices: int, top: int = 15) -> list[list]:
    """The `top` (kind, output shape) pairs by self time per device: [kind, shape, seconds]. Kind is
    "ynn"/"xnn" for XNNPACK/YNNPACK fusions (matmuls and what they fuse), else the op's base name;
    host events and ops without a shape in `shapes` are left out."""
    sums: collections.Counter = collections.Counter()
    for name, s in self_seconds_by_op(events).items():
        if name.startswith(SKIPPED_EVENTS) or name not in shapes:
            continue
        base = name.split(".")[0].removeprefix("wrapped_")
        kind = base.split("_fusion")[0] if base in ("ynn_fusion", "xnn_fusion") else base
        sums[(kind, shapes[name])] += s
    return [[k, shape, round(v / devices, 3)] for (k, shape), v in sums.most_common(top)]


def hlo_op_origins(hlo_texts) -> dict[str, str]:
    """{instruction name: "op_name (file:line)"} from the `metadata` of optimised HLO module texts:
    the JAX operation and source line each compiled instruction came from (a fusion carries the
    metadata of its root)."""
    origins: dict[str, str] = {}
    for text in hlo_texts:
        for name, meta in re.findall(r"%([\w.\-]+) = [^\n]*?metadata=\{([^}]*)\}", text):
            op = re.search(r'op_name="([^"]*)"', meta)
            src = re.search(r'source_file="([^"]*)"', meta)
            line = re.search(r"source_line=(\d+)", meta)
            where = f"{os.path.basename(src.group(1))}:{line.group(1)}" if src and line else ""
            origins[name] = f"{op.group(1) if op else ''} ({where})".strip()
    return origins


def costliest_ops(events, shapes: dict[str, str], origins: dict[str, str], devices: int,
                  top: int = 25, exclude: tuple[str, ...] = ()) -> list[list]:
    """The `top` compiled instructions by self time per device: [name, output shape, origin
    (`hlo_op_origins`), seconds]; instructions whose base name (before the first ".", e.g.
    "fusion", "reduce-window", "dot") is in `exclude` are left out."""
    rows = []
    for name, s in self_seconds_by_op(events).items():
        if name.startswith(SKIPPED_EVENTS) or name not in shapes:
            continue
        base = name.split(".")[0].removeprefix("wrapped_")
        if base in exclude:
            continue
        rows.append([name, shapes[name], origins.get(name, ""), round(s / devices, 3)])
    rows.sort(key=lambda r: -r[3])
    return rows[:top]


def dot_flops(hlo_texts) -> dict[str, float]:
    """{dot instruction name: FLOPs of one execution} of optimised HLO module texts: 2 x the output's
    elements x the product of the left operand's contracting dimensions, for every `dot`
    instruction (XLA:CPU's Eigen matmuls; matmuls inside XNNPACK/YNNPACK fusions are not counted)."""
    flops: dict[str, float] = {}
    for text in hlo_texts:
        shapes = hlo_output_shapes([text])
        for name, out, lhs, dims in re.findall(
                r"%([\w.\-]+) = (\S+) dot\(%([\w.\-]+), %[\w.\-]+\)[^\n]*?lhs_contracting_dims=\{([\d,]*)\}", text):
            out_dims, lhs_dims = _dims(out), _dims(shapes.get(lhs, ""))
            if out_dims is None or lhs_dims is None:
                continue
            contracted = 1
            for d in (int(x) for x in dims.split(",") if x):
                contracted *= lhs_dims[d]
            elements = 1
            for d in out_dims:
                elements *= d
            flops[name] = 2.0 * elements * contracted
    return flops


def _dims(shape: str) -> list[int] | None:
    """[d0, d1, ...] of an HLO array shape such as f32[6144,576]{1,0}; None if it is not one."""
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else None


def executed_dot_flops(events, flops: dict[str, float]) -> float:
    """FLOPs of every `dot` execution in `trace_events` (one event per execution, loop trips
    included), from `dot_flops`; all threads together."""
    return sum(flops.get(name, 0.0) for _, name, _, _ in events)


def matmuls_by_origin(events, flops: dict[str, float], origins: dict[str, str], devices: int,
                      shapes: dict[str, str] | None = None, top: int = 40) -> list[list]:
    """The traced `dot` executions grouped by where they came from: [group, TFLOP per device,
    seconds per device, GFLOP/s], the `top` groups by time. A group is the dot's pass ("fwd",
    "bwd" inside `transpose(jvp(...))`, "remat" for a rematerialised forward inside the backward),
    the JAX operation of its metadata (an einsum spec or `dot_general`) and, with `shapes`, its
    output shape."""
    totals = self_seconds_by_op(events)
    counts: collections.Counter = collections.Counter(name for _, name, _, _ in events)
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, f in flops.items():
        origin = origins.get(name, "")
        op = origin.split(" (")[0].split("/")[-1] or "?"
        if op == "dot_general":  # name the product by the einsum around it, when there is one
            parts = origin.split(" (")[0].split("/")
            op = parts[-2] if len(parts) > 1 and "->" in parts[-2] else op
        phase = "remat" if "rematted_computation" in origin else ("bwd" if "transpose(" in origin else "fwd")
        g = groups[f"{phase} {op}" + (f" -> {shapes.get(name, '?').split('{')[0]}" if shapes else "")]
        g[0] += f * counts[name] / devices
        g[1] += totals.get(name, 0.0) / devices
    rows = [[k, round(v[0] / 1e12, 3), round(v[1], 2), round(v[0] / max(v[1], 1e-9) / 1e9, 1)] for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]
