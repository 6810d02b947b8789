"""Reading a `jax.profiler.trace` of XLA executions (CPU threads or accelerator devices): each op's
own time, by op kind and by output shape (shared by the benchmarks' `--profile` options)."""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
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
    found = glob.glob(os.path.join(latest, "*.xplane.pb")) or glob.glob(os.path.join(latest, "*.xplane.pb.gz"))
    if not found:
        raise SystemExit(f"no *.xplane.pb in {latest} (was the trace written?)")
    if found[0].endswith(".gz"):  # a trace kept with the benchmark's outputs
        with gzip.open(found[0]) as f:
            return events_from_planes(ProfileData.from_serialized_xspace(f.read()).planes)
    return events_from_planes(ProfileData.from_file(found[0]).planes)


#: the line of an accelerator's XSpace plane that holds one event per HLO op run on the device
DEVICE_OPS_LINE = "XLA Ops"


def events_from_planes(planes) -> list[tuple[str, str, float, float]]:
    """(thread, op name, start us, duration us) of a trace's planes. XLA:CPU runs ops on host
    threads, so on the CPU these are the `/host:CPU` planes' events; on a GPU or TPU the host
    planes hold only launches, and the ops are on each `/device:` plane (one "thread" per line):
    its "XLA Ops" line where the profiler writes one (one event per HLO op), else its kernel
    streams ("Stream #N(...)" lines, JAX 0.11 on CUDA), each kernel named by the HLO instruction in
    its `hlo_op` stat (see `_stream_op_events`). On a GPU, XLA's command buffers (CUDA graphs) hide
    the ops inside one graph launch: trace with `--xla_gpu_enable_command_buffer=` in XLA_FLAGS
    (bench_update.py's --profile sets it)."""
    planes = list(planes)  # ProfileData.planes is an iterator
    device = [p for p in planes if p.name.startswith("/device:")]
    ops = [(f"{plane.name} {line.name}", e.name, e.start_ns / 1e3, e.duration_ns / 1e3)
           for plane in device for line in plane.lines if line.name == DEVICE_OPS_LINE for e in line.events]
    if ops:
        return ops
    streams = [ev for plane in device for line in plane.lines if line.name.startswith("Stream")
               for ev in _stream_op_events(f"{plane.name} {line.name}", line.events)]
    if streams:
        return streams
    return [(line.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3)
            for plane in planes if plane.name.startswith("/host:CPU")
            for line in plane.lines for e in line.events]


def _stream_op_events(thread: str, events) -> list[tuple[str, str, float, float]]:
    """One event per HLO instruction execution on a GPU kernel stream: each kernel (or memset /
    copy) is named by its `hlo_op` stat (e.g. "custom-call.5" for a cuBLAS product, whose execution
    is a memset and a kernel), and consecutive events of one instruction are one execution whose
    duration is the sum of theirs (the device's busy time, launch gaps left out) and whose start is
    the first's. Events without an `hlo_op` keep their own name."""
    out: list[list] = []
    for e in sorted(events, key=lambda e: e.start_ns):
        op = next((v for k, v in e.stats if k == "hlo_op"), None)
        name = op or e.name
        if op and out and out[-1][1] == name:
            out[-1][3] += e.duration_ns / 1e3
        else:
            out.append([thread, name, e.start_ns / 1e3, e.duration_ns / 1e3])
    return [tuple(x) for x in out]


#: marks the "threads" of `_stream_op_events`: a GPU stream's kernels never nest, though with
#: programmatic dependent launch (XLA's `xla.pdl_launch`) a kernel may start before the one ahead
#: of it ends
STREAM_THREAD = " Stream #"


def _by_thread(events) -> dict[str, list[dict]]:
    """Events per thread in start order, each with its self time ("self": duration minus the
    events nested in it on the same thread, i.e. starting and ending inside it; on a GPU stream,
    where nothing nests, the duration), in us."""
    by_thread = collections.defaultdict(list)
    for thread, name, start, dur in events:
        by_thread[thread].append({"name": name, "ts": start, "dur": dur})
    for name, thread in by_thread.items():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        flat = STREAM_THREAD in name
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            e["self"] = e["dur"]
            if stack and not flat and e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"]:
                stack[-1]["self"] -= e["dur"]
            stack.append(e)
    return by_thread


SKIPPED_EVENTS = ("$", "ThunkExecutor", "ThreadpoolListener", "end:", "PjitFunction", "Common", "Wait",
                  "Rendezvous", "ParseArguments", "Handle", "Allocate", "PythonRef")


def op_seconds_per_device(events, devices: int, matmuls=()) -> dict[str, float]:
    """Self time (s) per XLA op kind of `trace_events`, divided by `devices`: each event's duration
    minus that of the events nested in it on the same thread, summed by kind ("dot", "fusion",
    "while" (a loop's own time), "reduce-window", ...). Instructions named in `matmuls` (the keys of
    `dot_flops`: on a GPU, cuBLAS custom calls and Triton gemm fusions) are "dot" too."""
    matmuls = set(matmuls)
    kinds: collections.Counter = collections.Counter()
    for thread in _by_thread(events).values():
        for e in thread:
            name = e["name"]
            if name.startswith(SKIPPED_EVENTS):
                continue
            base = name.split(".")[0].removeprefix("wrapped_")
            kinds["dot" if name in matmuls else "fusion" if "fusion" in base else base] += e["self"]
    return {k: round(v / 1e6 / devices, 4) for k, v in kinds.most_common() if v / 1e6 / devices >= 1e-4}


def async_tails(events) -> dict[str, float]:
    """Time (us, all threads together) that an op ran after its own event ended: {op name: us}.

    XLA:CPU runs some instructions asynchronously (large Eigen dots: the op's event covers the
    launch and the calling thread's first share, Eigen's tasks then finish the product on every
    thread of the pool, and an `end: <name>` event marks its completion). Between the op's event
    and its end marker the pool's threads run those tasks with no op event of their own, so a
    per-event sum misses them. Counted here: on every thread that runs ops, each stretch with no
    op event that lies inside such a window (the op event's end .. its `end:` marker), shared
    equally between the windows open at that moment. Control flow (`CONTROL_OPS`), whose events
    span their bodies' ops, neither fills a stretch nor opens a window. Stretches inside no window
    are idle time (`idle_us_by_thread`). On a single device whose ops use both threads, the helper
    thread's stretches also go to whichever window is open: read the tails of non-matmul
    instructions with that in mind."""
    return _gaps(events)[0]


def idle_us_by_thread(events) -> dict[str, float]:
    """Per thread that runs ops: the time between its first and last op event in which it ran no
    op event (control flow's own events, `CONTROL_OPS`, aside) and no asynchronous op
    (`async_tails`) was in flight, in us."""
    return _gaps(events)[1]


#: instructions whose event spans their body's ops (a loop's `end:` marker comes after its last trip)
CONTROL_OPS = ("while", "conditional", "call")


def _gaps(events) -> tuple[dict[str, float], dict[str, float]]:
    """(`async_tails`, `idle_us_by_thread`) of `trace_events`."""
    pending: dict[str, list[float]] = collections.defaultdict(list)
    windows = []
    for _, name, start, dur in sorted(events, key=lambda e: e[2]):
        if name.startswith("end: "):
            opened = pending.get(name[5:])
            if opened:
                t0 = opened.pop(0)
                if start > t0:
                    windows.append((t0, start, name[5:]))
        elif not name.startswith(SKIPPED_EVENTS) and name.split(".")[0] not in CONTROL_OPS:
            pending[name].append(start + dur)
    windows.sort()
    tails: collections.Counter = collections.Counter()
    idle: dict[str, float] = {}
    by_thread = collections.defaultdict(list)
    for thread, name, start, dur in events:
        if not name.startswith(SKIPPED_EVENTS) and name.split(".")[0] not in CONTROL_OPS:
            by_thread[thread].append((start, start + dur))
    for thread, spans in by_thread.items():
        spans.sort()
        gaps, end = [], spans[0][1]
        for a, b in spans[1:]:
            if a > end:
                gaps.append((end, a))
            end = max(end, b)
        idle_us, i, active = 0.0, 0, []
        for g0, g1 in gaps:
            while i < len(windows) and windows[i][0] < g1:
                active.append(windows[i])
                i += 1
            active = [w for w in active if w[1] > g0]
            # split [g0, g1) at every window boundary inside it; each piece goes to the windows open over it
            cuts = sorted({g0, g1, *(t for w in active for t in w[:2] if g0 < t < g1)})
            for c0, c1 in zip(cuts, cuts[1:]):
                inside = [w[2] for w in active if w[0] <= c0 and w[1] >= c1]
                if inside:
                    for name in inside:
                        tails[name] += (c1 - c0) / len(inside)
                else:
                    idle_us += c1 - c0
        idle[thread] = idle_us
    return dict(tails), idle


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
        # a tuple's first element stands for it (a GPU library matmul's result beside its workspace)
        shapes.update((n, sh.removeprefix("(").rstrip(",")) for n, sh in re.findall(r"%([\w.\-]+) = (\S+) ", text))
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
    return [[k, shape, round(v / devices, 5)] for (k, shape), v in sums.most_common(top)]


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
                  top: int = 25, exclude: tuple[str, ...] = (), matmuls=()) -> list[list]:
    """The `top` compiled instructions by self time per device: [name, output shape, origin
    (`hlo_op_origins`), seconds]; instructions whose base name (before the first ".", e.g.
    "fusion", "reduce-window", "dot") is in `exclude` are left out, and with "dot" in `exclude` also
    those named in `matmuls` (`dot_flops`' keys: a GPU's library matmuls and gemm fusions)."""
    matmuls = set(matmuls) if "dot" in exclude else set()
    rows = []
    for name, s in self_seconds_by_op(events).items():
        if name.startswith(SKIPPED_EVENTS) or name not in shapes:
            continue
        base = name.split(".")[0].removeprefix("wrapped_")
        if base in exclude or name in matmuls:
            continue
        rows.append([name, shapes[name], origins.get(name, ""), round(s / devices, 5)])
    rows.sort(key=lambda r: -r[3])
    return rows[:top]


#: custom-call targets of XLA:GPU's library matmuls (cuBLAS, cuBLASLt, cuDNN)
GPU_MATMUL_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")


def dot_flops(hlo_texts) -> dict[str, float]:
    """{matmul instruction name: FLOPs of one execution} of optimised HLO module texts: 2 x the
    output's elements x the product of the contracting dimensions. Counted: every `dot` instruction
    (XLA:CPU's Eigen matmuls), every XLA:CPU YNNPACK/XNNPACK fusion ("ynn_fusion...",
    "xnn_fusion...") whose computation holds a dot (the products XLA:CPU hands to YNNPACK, most of
    a CPU update's matmul time; a library fusion without a dot, such as a YNNPACK reduction, is not
    a matmul), and on a GPU every library matmul custom call (`GPU_MATMUL_TARGETS`; the output is
    the tuple's first element, the contracting dimensions those of its `dot_dimension_numbers`) and
    every Triton gemm fusion ("gemm_fusion..."). A fusion counts the FLOPs of the dots in the
    computation it calls as its own; those dots never run alone and are not counted apart."""
    flops: dict[str, float] = {}
    for text in hlo_texts:
        shapes = hlo_output_shapes([text])
        for name, out, lhs, dims in re.findall(
                r"%([\w.\-]+) = (\S+) dot\(%([\w.\-]+), %[\w.\-]+\)[^\n]*?lhs_contracting_dims=\{([\d,]*)\}", text):
            f = _product_flops(_dims(out), _dims(shapes.get(lhs, "")), [int(x) for x in dims.split(",") if x])
            if f is not None:
                flops[name] = f
        for name, out, operands, target, config in re.findall(
                r"%([\w.\-]+) = \((\S+), [^\n]*?custom-call\(([^)]*)\), custom_call_target=\"([^\"]+)\"([^\n]*)", text):
            if target not in GPU_MATMUL_TARGETS:
                continue
            args = re.findall(r"%([\w.\-#]+)", operands)
            lhs_c = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', config)
            rhs_c = re.search(r'"rhs_contracting_dimensions":\[([^\]]*)\]', config)
            if len(args) < 2 or not lhs_c or not rhs_c:
                continue
            f = _product_flops(_dims(out), _dims(shapes.get(args[0], "")),
                               [int(x) for x in re.findall(r"\d+", lhs_c.group(1))])
            if f is None:  # the left operand is a tuple element (no instruction of its own): the right's
                f = _product_flops(_dims(out), _dims(shapes.get(args[1], "")),
                                   [int(x) for x in re.findall(r"\d+", rhs_c.group(1))])
            if f is not None:
                flops[name] = f
        bodies = dict(re.findall(r"\n%([\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, flags=re.S))
        for name, called in re.findall(r"%((?:gemm|ynn|xnn)_fusion[\w.\-]*) = [^\n]*? fusion\([^\n]*?calls=%([\w.\-]+)", text):
            inner = [d for d in re.findall(r"%([\w.\-]+) = \S+ dot\(", bodies.get(called, "")) if d in flops]
            if inner:  # the fusion runs as one kernel: its dots are counted as its own
                flops[name] = sum(flops.pop(d) for d in inner)
    return flops


def _product_flops(out_dims, lhs_dims, contracting) -> float | None:
    """2 x output elements x contracted elements; None if a shape is unknown."""
    if out_dims is None or lhs_dims is None or any(d >= len(lhs_dims) for d in contracting):
        return None
    contracted = 1
    for d in contracting:
        contracted *= lhs_dims[d]
    elements = 1
    for d in out_dims:
        elements *= d
    return 2.0 * elements * contracted


def _dims(shape: str) -> list[int] | None:
    """[d0, d1, ...] of an HLO array shape such as f32[6144,576]{1,0}; None if it is not one."""
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else None


def executed_dot_flops(events, flops: dict[str, float]) -> float:
    """FLOPs of every `dot` execution in `trace_events` (one event per execution, loop trips
    included), from `dot_flops`; all threads together."""
    return sum(flops.get(name, 0.0) for _, name, _, _ in events)


def matmuls_by_origin(events, flops: dict[str, float], origins: dict[str, str], devices: int,
                      shapes: dict[str, str] | None = None, top: int = 40,
                      tails: dict[str, float] | None = None) -> list[list]:
    """The traced `dot` executions grouped by where they came from: [group, TFLOP per device,
    seconds per device, GFLOP/s], the `top` groups by time. A group is the dot's pass ("fwd",
    "bwd" inside `transpose(jvp(...))`, "remat" for a rematerialised forward inside the backward),
    the JAX operation of its metadata (an einsum spec or `dot_general`) and, with `shapes`, its
    output shape. `tails`: each dot's asynchronous time in us (`async_tails`), added to its own."""
    totals = self_seconds_by_op(events)
    tails = tails or {}
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
        g[1] += (totals.get(name, 0.0) + tails.get(name, 0.0) / 1e6) / devices
    rows = [[k, round(v[0] / 1e12, 3), round(v[1], 4), round(v[0] / max(v[1], 1e-9) / 1e9, 1)] for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def seconds_by_origin(events, origins: dict[str, str], devices: int, exclude=(), top: int = 20) -> list[list]:
    """Self time per device of the traced instructions not in `exclude` (e.g. the matmuls), grouped
    by pass ("fwd", "bwd", "remat" as in `matmuls_by_origin`) and the JAX operation their metadata
    names ("convert_element_type", "scatter-add", ...; "?" without metadata): [group, seconds,
    executions], the `top` groups by time."""
    exclude = set(exclude)
    counts: collections.Counter = collections.Counter(name for _, name, _, _ in events)
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, sec in self_seconds_by_op(events).items():
        if name in exclude or name.startswith(SKIPPED_EVENTS):
            continue
        origin = re.sub(r"\s*\([^()]*\)$", "", origins.get(name, ""))  # "op_name (file:line)" -> op_name
        phase = "remat" if "rematted_computation" in origin else ("bwd" if "transpose(" in origin else "fwd")
        g = groups[f"{phase} {origin.split('/')[-1] or '?'}" if origin else "?"]
        g[0] += sec / devices
        g[1] += counts[name]
    rows = [[k, round(v[0], 5), v[1]] for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def summarize(trace_dir: str, hlo_texts: list[str], devices: int = 1, top: int = 15) -> dict:
    """`summarize_events` of the trace in `trace_dir`."""
    return summarize_events(trace_events(trace_dir), hlo_texts, devices, top)


def summarize_events(events, hlo_texts: list[str], devices: int = 1, top: int = 15) -> dict:
    """Where a traced program's device time went: executions and busy time (the sum of their own
    times) per device, time by op kind, the matmuls' executions, executed TFLOP and rate (from the
    optimised HLO's shapes; unrounded too, `executed_matmul_flops_per_device`), the matmuls by origin
    and the other instructions by JAX operation, and the costliest instructions, all and non-matmul.
    The matmuls' time (`matmul_s`, and per origin) includes their asynchronous tails (`async_tails`:
    `matmul_async_tail_s` of it); `idle_s` is each op thread's time with nothing running, per device."""
    flops, shapes, origins = dot_flops(hlo_texts), hlo_output_shapes(hlo_texts), hlo_op_origins(hlo_texts)
    totals = self_seconds_by_op(events)
    busy = sum(totals.values()) / devices
    tails, idle = _gaps(events)
    matmul_tails_s = sum(us for n, us in tails.items() if n in flops) / 1e6 / devices
    matmul_s = sum(s for n, s in totals.items() if n in flops) / devices + matmul_tails_s
    executed = executed_dot_flops(events, flops) / devices
    return {"executions": len(events), "busy_s": round(busy, 5),
            "async_tail_s": round(sum(tails.values()) / 1e6 / devices, 5),
            "matmul_async_tail_s": round(matmul_tails_s, 5),
            "idle_s": round(sum(idle.values()) / 1e6 / devices, 5),
            "span_s": round((max(e[2] + e[3] for e in events) - min(e[2] for e in events)) / 1e6, 5) if events else 0.0,
            "op_seconds_per_device": op_seconds_per_device(events, devices, flops),
            "matmul_executions": sum(1 for e in events if e[1] in flops), "matmul_s": round(matmul_s, 5),
            "executed_matmul_tflop": round(executed / 1e12, 3), "executed_matmul_flops_per_device": executed,
            "matmul_tflop_per_s": round(executed / max(matmul_s, 1e-12) / 1e12, 1),
            "matmuls_by_origin": matmuls_by_origin(events, flops, origins, devices, shapes, top=top, tails=tails),
            "non_matmul_by_origin": seconds_by_origin(events, origins, devices, exclude=flops, top=top),
            "costliest_ops": costliest_ops(events, shapes, origins, devices, top=top),
            "costliest_non_matmul_ops": costliest_ops(events, shapes, origins, devices, top=top, exclude=("dot",),
                                                      matmuls=flops)}


def main(argv=None) -> int:
    """`python scripts/bench_peers/profile_ops.py TRACE_DIR HLO_FILE...`: `summarize` as one JSON
    object (HLO files: the optimised module texts, `--xla_dump_hlo_as_text`, plain or gzipped)."""
    ap = argparse.ArgumentParser(description=summarize.__doc__.split(".")[0])
    ap.add_argument("trace_dir", help="the directory given to jax.profiler.start_trace")
    ap.add_argument("hlo", nargs="+", help="optimised HLO module texts (*after_optimizations.txt[.gz])")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    texts = []
    for path in a.hlo:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            texts.append(f.read())
    print(json.dumps(summarize(a.trace_dir, texts, a.devices, a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
