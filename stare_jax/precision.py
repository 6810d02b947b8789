"""The precision of float32 matrix products, fixed per run rather than left to the backend.

XLA's default precision differs by backend: full float32 on CPU, TF32 (a 10-bit mantissa) on NVIDIA
GPUs from Ampere on, bfloat16 passes on TPUs. A run that moves between backends, or that is
compared with PyTorch (whose float32 matmuls are full float32 unless TF32 is switched on), can name
the precision instead (`model.matmul_precision`); bfloat16 compute (`model.dtype`) is not affected.
"""

from __future__ import annotations

import contextlib

import jax

from stare_jax.config import MATMUL_PRECISIONS


def matmul_precision(name: str) -> contextlib.AbstractContextManager:
    """The context inside which jitted programs trace their float32 products at `name`: "default"
    leaves each backend its own (no context), "float32" and "tensorfloat32" set
    `jax.default_matmul_precision`, which dot products without an explicit precision then carry
    into the compiled program (and into its compilation-cache key)."""
    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {name!r}; allowed: {', '.join(MATMUL_PRECISIONS)}")
    if name == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)
