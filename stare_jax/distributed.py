"""Multi-host start-up (JAX multi-controller): every host runs the same program.

On Cloud TPU pod slices `jax.distributed.initialize()` discovers its peers by itself; on CPU/GPU
clusters the coordinator address, process count and id come from the config (or the
STARE_COORDINATOR / STARE_NUM_PROCESSES / STARE_PROCESS_ID environment variables).

JAX is imported inside the functions that need it: `spans_processes` runs before the first JAX
import, so that a one-process run's bad input exits without paying for it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_initialized = False


def _on_tpu_pod() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def use_cpu_devices(n: int) -> None:
    """Makes the CPU backend expose `n` devices (`jax_num_cpu_devices`); must run before the first
    JAX operation. On a small CPU host, one device per core runs the two halves of a batch
    concurrently, which hides the per-operation overhead of small models (the rollout of
    `scripts/bench_rollout.py` is ~1.5x faster with 2 devices on 2 cores)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError as e:  # the backend already exists: keep what it has
        if len(jax.devices("cpu")) != n:
            raise RuntimeError(f"mesh.cpu_devices={n}: JAX was initialised before the setting could be applied "
                               f"({len(jax.devices('cpu'))} CPU devices)") from e


def cpu_devices_per_core(num_prompts: int) -> int:
    """One CPU device per core this process may use, at most `num_prompts` and dividing it (so a
    batch of prompts splits evenly over the devices)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(d for d in range(1, min(cores, num_prompts) + 1) if num_prompts % d == 0)


def spans_processes(config) -> bool:
    """Whether the run of `config` (and the STARE_* environment) spans several processes: a
    coordinator address with more than one process, or a Cloud TPU pod slice."""
    address = config.distributed.coordinator_address or os.environ.get("STARE_COORDINATOR", "")
    num = int(os.environ.get("STARE_NUM_PROCESSES", config.distributed.num_processes))
    return bool(address and num > 1) or _on_tpu_pod()


STARTUP_KEY = "stare_jax/startup_problem/"  # + process index, in the coordination service's store
STARTUP_AGREE_TIMEOUT_S = 120  # the processes have all joined by then; each only checks its paths


def agree_on_startup_problem(problem: str | None) -> str | None:
    """On a multi-process run, every process's start-up check (`problem`: its one-line error, or
    None) exchanged through the JAX coordination service's key-value store (no device program
    runs): this process's own problem, else the first other process's as "process P of N: LINE",
    else None. A check that fails on one host only (a path missing there) then stops every
    process with one line instead of leaving the others waiting for it in their first collective.
    Call after `initialize`; on one process it returns `problem`."""
    import jax

    if jax.process_count() <= 1:
        return problem
    from jax._src import distributed as jax_distributed  # the client: no public API exposes its store

    client = jax_distributed.global_state.client
    client.key_value_set(f"{STARTUP_KEY}{jax.process_index()}", problem or "")
    if problem:
        return problem
    for p in range(jax.process_count()):
        theirs = client.blocking_key_value_get(f"{STARTUP_KEY}{p}", STARTUP_AGREE_TIMEOUT_S * 1000)
        if theirs:
            return f"process {p} of {jax.process_count()}: {theirs}"
    return None


def initialize(config) -> None:
    """Applies `mesh.cpu_devices`, then calls `jax.distributed.initialize` once when the run spans
    several processes; no-op otherwise."""
    import jax

    global _initialized
    if _initialized:
        return
    cpu_devices = int(config.mesh.get("cpu_devices", 0) or 0)
    if cpu_devices:
        use_cpu_devices(cpu_devices)
    d = config.distributed
    address = d.coordinator_address or os.environ.get("STARE_COORDINATOR", "")
    num = int(os.environ.get("STARE_NUM_PROCESSES", d.num_processes))
    pid = int(os.environ.get("STARE_PROCESS_ID", d.process_id))
    if address and num > 1:
        if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
            # CPU collectives across processes need gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=num, process_id=pid, **_timeouts(d))
        log.info("process %d/%d joined %s (%d global devices)", pid, num, address, jax.device_count())
    elif _on_tpu_pod():
        jax.distributed.initialize(**_timeouts(d))
        log.info("TPU pod: process %d/%d", jax.process_index(), jax.process_count())
    _initialized = True


# What a collective's error says when a peer process of the run is gone: Gloo's TCP pairs (CPU
# collectives) see the dead process's sockets close; JAX's coordination service names tasks that
# stopped sending heartbeats.
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "heartbeat timeout",
                        "stopped sending heartbeats", "tasks are unhealthy")


def peer_failure_reason(e: BaseException) -> str | None:
    """The first line of the error in `e`'s cause/context chain that reports a lost peer process
    (`PEER_FAILURE_MARKERS`) on a multi-process run, shortened to 240 characters; else None."""
    import jax

    if jax.process_count() <= 1:
        return None
    seen: BaseException | None = e
    while seen is not None:
        text = str(seen)
        for marker in PEER_FAILURE_MARKERS:
            if marker in text:
                line = next((ln for ln in text.splitlines() if marker in ln), text.splitlines()[0])
                return f"{type(seen).__name__}: {line.strip()[:240]}"
        seen = seen.__cause__ or seen.__context__
    return None


def _timeouts(d) -> dict:
    """`jax.distributed.initialize`'s timeouts from the config's `distributed` section: how long a
    process waits for all of them to join, and after how many seconds without heartbeats the
    coordination service counts a process as dead and aborts the run (on GPU/TPU the only way a
    peer's death ends the others' collectives; JAX's defaults 300 s and 100 s)."""
    return {"initialization_timeout": int(d.initialization_timeout_s),
            "heartbeat_timeout_seconds": int(d.heartbeat_timeout_s)}


def is_main_process() -> bool:
    """True on the process that writes logs, metrics and exports."""
    import jax

    return jax.process_index() == 0
