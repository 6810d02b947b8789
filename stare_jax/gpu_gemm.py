"""Which kernels a GPU runs each phase's matrix products with (`model.gpu_gemm`): per-program XLA options.

XLA:GPU emits most products as Triton GEMMs, tuned by its GEMM autotuner, or calls cuBLAS. On an
NVIDIA H200 (docs/performance.md, "On a GPU: NVIDIA H200, a fourth lent session") full-float32
products (`model.matmul_precision = "float32"`) as Triton GEMMs ran at 26.9 TFLOP/s without the
autotuner against PyTorch's 50.6 (cuBLAS), and with it the autotuner's search kept a `--large`
worker compiling past ~125 s. With Triton GEMMs off every product is a cuBLAS call with cuBLAS's
own choice of kernel (48-49 TFLOP/s, compiled in seconds): the float32 update ran 4.1x faster
(0.035 against 0.144 s), while the rollout, whose thin decode products XLA fuses with their
neighbours as Triton kernels, ran 1.37x slower on cuBLAS (0.174 against 0.127 s). In bfloat16
cuBLAS changed nothing in the update (0.0097 s against 0.0098 s with XLA's default Triton GEMMs at
an earlier commit) and slowed the rollout (0.091 against 0.082 s).

`model.gpu_gemm`:

    auto    (default) with float32 compute and full-float32 products on a GPU: the update's program
            on cuBLAS (`CUBLAS`), the rollout's on Triton GEMMs without the autotuner's search
            (`UNTUNED_TRITON`), each the faster measured choice for its phase; otherwise XLA's own
    xla     XLA's own choice everywhere (its defaults, or what XLA_FLAGS says)
    cublas  every product of both phases on cuBLAS (what `scripts/gpu_figures.sh`'s NAME_cublas
            jobs run through XLA_FLAGS)

The options are set per jitted program (`jax.jit(..., compiler_options=...)`), so the two phases of
one process can differ, and they override XLA_FLAGS for those programs; "xla" leaves XLA_FLAGS in
charge. Off a GPU every choice gives no options: they name GPU kernels only. The kernel choice
changes floating-point rounding, not the computation.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from stare_jax.config import GPU_GEMM_CHOICES as CHOICES

PHASES = ("update", "rollout")

#: every product a cuBLAS call, with cuBLAS's heuristic kernel (no XLA autotuning), as PyTorch's are
CUBLAS: dict[str, Any] = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
#: XLA's Triton GEMMs (fused with their neighbours) in their default configurations, no autotuner search
UNTUNED_TRITON: dict[str, Any] = {"xla_gpu_autotune_level": 0}

_FULL_FLOAT32 = ("float32", "highest")


def full_float32_products() -> bool:
    """Whether float32 products traced now run at full float32 precision: `jax.default_matmul_precision`
    is "float32" or "highest" (what `model.matmul_precision = "float32"` sets for a run's programs)."""
    precision = jax.config.jax_default_matmul_precision
    return precision is not None and str(precision).lower().rsplit(".", 1)[-1] in _FULL_FLOAT32


def compiler_options(phase: str, choice: str, *, platform: str, dtype,
                     full_float32: bool | None = None) -> dict[str, Any]:
    """The XLA compiler options for `phase` ("update" or "rollout") under `model.gpu_gemm = choice`
    on devices of `platform` with compute dtype `dtype` (see the module docstring); {} for XLA's own
    choice. `full_float32` defaults to `full_float32_products()`, read now."""
    if choice not in CHOICES:
        raise ValueError(f"model.gpu_gemm must be one of {', '.join(CHOICES)}, got {choice!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if platform != "gpu" or choice == "xla":
        return {}
    if choice == "cublas":
        return dict(CUBLAS)
    if full_float32 is None:
        full_float32 = full_float32_products()
    if np.dtype(dtype) != np.float32 or not full_float32:
        return {}
    return dict(CUBLAS if phase == "update" else UNTUNED_TRITON)
