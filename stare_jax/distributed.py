"""Multi-host start-up (JAX multi-controller): every host runs the same program.

On Cloud TPU pod slices `jax.distributed.initialize()` discovers its peers by itself; on CPU/GPU
clusters the coordinator address, process count and id come from the config (or the
STARE_COORDINATOR / STARE_NUM_PROCESSES / STARE_PROCESS_ID environment variables).
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)
_initialized = False


def _on_tpu_pod() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(config) -> None:
    """Calls `jax.distributed.initialize` once when the run spans several processes; no-op otherwise."""
    global _initialized
    if _initialized:
        return
    d = config.distributed
    address = d.coordinator_address or os.environ.get("STARE_COORDINATOR", "")
    num = int(os.environ.get("STARE_NUM_PROCESSES", d.num_processes))
    pid = int(os.environ.get("STARE_PROCESS_ID", d.process_id))
    if address and num > 1:
        if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
            # CPU collectives across processes need gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=num, process_id=pid)
        log.info("process %d/%d joined %s (%d global devices)", pid, num, address, jax.device_count())
    elif _on_tpu_pod():
        jax.distributed.initialize()
        log.info("TPU pod: process %d/%d", jax.process_index(), jax.process_count())
    _initialized = True


def is_main_process() -> bool:
    """True on the process that writes logs, metrics and exports."""
    return jax.process_index() == 0
