"""Our update step after an interlude: why does it slow down when another process ran in between?

`bench_step.py`'s alternating protocol runs TRL's step between two of ours; on the Intel Xeon with
AMX our `--large` update then took 1.2-1.4x as long as back to back, TRL's did not. This script
isolates the cause in one process: it builds the workload's STARE update (as `bench_stare_overhead`
does) and, for `--rounds` rounds, runs each interlude in turn (rotating their order), then one
rollout and one update, timing both:

    none      nothing (0.3 s pause), as `--protocol blocks`
    idle      the process sleeps `--gap` seconds, nothing else runs
    compute   a neighbour process multiplies 1024^2 float32 matrices for `--gap` seconds
              (PyTorch from `--peer-python` if given, else numpy), small working set
    memory    a neighbour process allocates a fresh `--memory-gb` GiB buffer each round and
              streams over it for `--gap` seconds (DRAM bandwidth, evicts the cache, churns pages)
    trl       TRL's worker runs one full GRPO step of the same workload (needs `--peer-python`)

Per interlude it reports the median update and rollout seconds, the update's process CPU time and
its kernel part (`update_sys_s`: page faults are handled there), its minor page faults and context
switches (getrusage deltas), and the compiled update's temporary memory per device
(`update_temp_mb_per_device`, XLA's memory analysis), so a slowdown can be told apart as more work
(CPU time), waiting (wall >> CPU) or fresh pages (faults). One JSON line:

    python scripts/bench_neighbour.py --large --rounds 4 [--peer-python .bench-venv/bin/python]
        [--interludes none,idle,compute,memory,trl] [--gap 9] [--rollout-devices 1] [--heap-limit-mb 16]

`--heap-limit-mb M` compiles the update with XLA's temporaries split into heaps of at most M MiB
(`xla_multiheap_size_constraint_per_heap`), small enough for glibc to serve from its arenas.

`--page-cost` measures instead what a first touch of fresh memory costs on this host: it maps
`--memory-gb` GiB, writes it twice and reports (first - second write) / pages in microseconds per
4 KiB page, after each of several idle pauses (a VM that hands freed memory back to its host, such
as Firecracker with free page reporting, makes that cost depend on how long the memory was free):

    python scripts/bench_neighbour.py --page-cost [--memory-gb 1.2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import checkpoint  # noqa: E402
import common  # noqa: E402
import ours_peer  # noqa: E402

INTERLUDES = ("none", "idle", "compute", "memory", "trl")

# A neighbour that burns for the number of seconds it reads on each stdin line, then answers "done".
BURNER = r"""
import sys, time
kind, gb = sys.argv[1], float(sys.argv[2])
try:
    import torch
    mm = lambda a, b: a @ b
    a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)
except ImportError:
    import numpy as np
    a = np.random.rand(1024, 1024).astype(np.float32); b = a.copy()
    mm = lambda x, y: x @ y
import numpy as np
print("ready", flush=True)
for line in sys.stdin:
    end = time.perf_counter() + float(line)
    if kind == "compute":
        while time.perf_counter() < end:
            mm(a, b)
    else:
        buf = np.ones(int(gb * 2**30) // 4, np.float32)  # fresh pages each round
        while time.perf_counter() < end:
            buf += 1.0
        del buf
    print("done", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_synthetic_workload_flags(ap)
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (each interlude once per round)")
    ap.add_argument("--interludes", default="none,idle,compute,memory",
                    help=f"comma-separated, of {','.join(INTERLUDES)}")
    ap.add_argument("--gap", type=float, default=9.0, help="seconds of the idle/compute/memory interludes")
    ap.add_argument("--memory-gb", type=float, default=2.0, help="the memory neighbour's buffer (GiB)")
    ap.add_argument("--peer-python", default=None, help="python with torch (and TRL, for the trl interlude)")
    ap.add_argument("--rollout-devices", type=int, default=0, help="as bench_step's flag (0: the update's mesh)")
    ap.add_argument("--heap-limit-mb", type=int, default=0,
                    help="compile the update with XLA's temporaries split into heaps of at most this many MiB "
                         "(xla_multiheap_size_constraint_per_heap; 0: the update's shipped options)")
    ap.add_argument("--page-cost", action="store_true", help="only measure the first-touch cost of fresh pages")
    ap.add_argument("--pauses", default="0,0.5,1,2,3,5,10,0,10,0", help="--page-cost: idle seconds before each probe")
    args = ap.parse_args()
    if args.page_cost:
        try:
            pauses = [float(p) for p in args.pauses.split(",")]
        except ValueError:
            ap.error(f"--pauses: got {args.pauses!r}; allowed: comma-separated seconds")
        print(json.dumps({"memory_gb": args.memory_gb, "host_cpu": common.host_cpu(),
                          "first_touch_us_per_page": fresh_page_cost(args.memory_gb, pauses)}))
        return
    interludes = [s for s in args.interludes.split(",") if s]
    bad = [s for s in interludes if s not in INTERLUDES]
    if bad or not interludes:
        ap.error(f"--interludes: unknown {bad}; choose from {','.join(INTERLUDES)}")
    if "trl" in interludes and not args.peer_python:
        ap.error("the trl interlude needs --peer-python (an environment with TRL: requirements-bench.txt)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from stare_jax.distributed import cpu_devices_per_core

    workload = dict(common.SYNTHETIC[common.synthetic_workload_name(args)])
    workload["cpu_devices"] = cpu_devices_per_core(workload["num_prompts"])
    workload["rollout_devices"] = args.rollout_devices
    with tempfile.TemporaryDirectory() as tmp:
        workload["checkpoint"] = os.path.join(tmp, "model")
        checkpoint.write_synthetic_checkpoint(workload["checkpoint"], common.synthetic_workload_name(args))
        print(json.dumps(measure(workload, interludes, args)))


def fresh_page_cost(gb: float, pauses=(0, 0.5, 1, 2, 3, 5, 10, 0, 10, 0)) -> list[dict]:
    """Microseconds per 4 KiB page that the first write of freshly mapped memory costs over a second
    write of the same memory, after each idle pause (seconds): [{"pause_s", "us_per_page"}, ...]."""
    import numpy as np

    n = int(gb * 2**30) // 4

    def once() -> float:
        t = time.perf_counter()
        a = np.empty(n, np.float32)
        a.fill(1.0)  # faults every page in
        first = time.perf_counter() - t
        t = time.perf_counter()
        a.fill(2.0)
        second = time.perf_counter() - t
        del a  # glibc unmaps it (above its mmap threshold)
        return (first - second) / (n * 4 / 4096) * 1e6

    once()
    out = []
    for pause in pauses:
        time.sleep(pause)
        out.append({"pause_s": pause, "us_per_page": round(once(), 3)})
    return out


class Neighbours:
    """The interludes' neighbour processes, started once and idle between their turns."""

    def __init__(self, interludes, workload, args):
        self.procs, self.trl = {}, None
        ours = os.environ.pop("GLIBC_TUNABLES", None)  # the neighbours run with glibc's defaults
        try:
            self._start(interludes, workload, args)
        finally:
            if ours is not None:
                os.environ["GLIBC_TUNABLES"] = ours

    def _start(self, interludes, workload, args):
        python = args.peer_python or sys.executable
        for kind in ("compute", "memory"):
            if kind in interludes:
                p = subprocess.Popen([python, "-c", BURNER, kind, str(args.memory_gb)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=dict(os.environ))
                assert p.stdout.readline().strip() == "ready"
                self.procs[kind] = p
        if "trl" in interludes:
            from bench_step import Worker

            self.trl = Worker("trl", "trl_peer.py", args.peer_python, dict(workload, loss="grpo"))
            self.trl.step()  # TRL's own warm-up, untimed

    def run(self, kind: str, gap: float) -> None:
        """Runs one interlude (blocking)."""
        if kind == "none":
            time.sleep(0.3)
        elif kind == "idle":
            time.sleep(gap)
        elif kind == "trl":
            self.trl.step()
        else:
            p = self.procs[kind]
            p.stdin.write(f"{gap}\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"

    def close(self) -> None:
        """Ends the neighbour processes."""
        for p in self.procs.values():
            p.stdin.close()
            p.wait()
        if self.trl is not None:
            self.trl.close()


def measure(workload: dict, interludes: list[str], args) -> dict:
    """Times rollout + update after each interlude, `args.rounds` times, rotating the order."""
    import jax
    from flax import nnx

    from stare_jax import compilation, distributed, parallel
    from stare_jax.rl import create_train_state, make_update_step

    if args.heap_limit_mb:
        from stare_jax.rl import update as update_lib

        update_lib.CPU_UPDATE_COMPILER_OPTIONS = dict(update_lib.CPU_UPDATE_COMPILER_OPTIONS,
                                                      xla_multiheap_size_constraint_per_heap=args.heap_limit_mb * 2**20)
    config = ours_peer.bench_config(workload)
    distributed.initialize(config)
    compilation.use_persistent_cache(config.compilation_cache_dir)  # $STARE_COMPILATION_CACHE_DIR if set
    mesh = parallel.mesh_from_config(config.mesh)
    policy = ours_peer.load_policy(workload, config, mesh)
    state = create_train_state(policy.model, config, mesh=mesh)
    step = make_update_step(config, mesh, state)
    params = nnx.state(state)
    rollout_mesh = parallel.rollout_mesh(mesh, config.mesh.rollout_devices)
    sampler = ours_peer.load_policy(workload, config, rollout_mesh)
    key = jax.random.key(workload["seed"])
    rollout = ours_peer.fixed_rollout(workload, sampler, rollout_mesh)
    batch = ours_peer.update_batch(workload, rollout(), mesh)

    # The update step as the trainer jits it, compiled once here: the same executable is timed and
    # gives XLA's memory analysis of its temporaries.
    args_batch = step._batch(batch)
    compiled = step.jitted.lower(params, args_batch, key, None).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes

    def update():
        nonlocal params
        u0, t, c = common.rusage(), time.perf_counter(), time.process_time()
        params, metrics = compiled(params, args_batch, key)
        jax.block_until_ready(metrics)
        wall, cpu, used = time.perf_counter() - t, time.process_time() - c, common.usage_since(u0)
        return {"update_s": wall, "update_cpu_s": cpu, "update_sys_s": used.pop("sys_s"), **used}

    update()
    neighbours = Neighbours(interludes, workload, args)
    rows = {k: [] for k in interludes}
    try:
        for r in range(args.rounds):
            order = interludes[r % len(interludes):] + interludes[:r % len(interludes)]
            for kind in order:
                neighbours.run(kind, args.gap)
                t = time.perf_counter()
                rollout()
                row = {"rollout_s": time.perf_counter() - t, **update()}
                rows[kind].append(row)
                print(json.dumps({"round": r, "interlude": kind, **{k: round(v, 3) for k, v in row.items()}}),
                      file=sys.stderr, flush=True)
    finally:
        neighbours.close()
    med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    summary = {kind: {k: med([row[k] for row in rs]) for k in rs[0]} for kind, rs in rows.items()}
    base = summary[interludes[0]]["update_s"]
    for kind in summary:
        summary[kind]["update_vs_first"] = round(summary[kind]["update_s"] / base, 3)
    return {"shape": {k: workload[k] for k in ("hidden_size", "num_layers", "new_tokens")}, "rounds": args.rounds,
            "update_temp_mb_per_device": round(temp / 2**20, 1), "heap_limit_mb": args.heap_limit_mb,
            "gap_s": args.gap, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "devices": jax.device_count(), "rollout_devices": args.rollout_devices,
            "interludes": summary, "per_round": rows, "host_cpu": common.host_cpu()}


if __name__ == "__main__":
    main()
