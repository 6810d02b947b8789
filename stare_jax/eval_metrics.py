"""Sampling-based evaluation metrics: avg@n and the unbiased pass@k estimator."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def summarize(correct: np.ndarray, ks: Sequence[int] | None = None) -> dict[str, float]:
    """Metrics of a [num_prompts, n] 0/1 correctness matrix: avg@n (mean over all samples) and the
    mean over prompts of pass@k for k in `ks` (default: powers of two up to n, and n)."""
    correct = np.asarray(correct, dtype=np.float64)
    num, n = correct.shape
    if ks is None:
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if k <= n})
    c = correct.sum(axis=1).astype(int)
    out = {f"avg@{n}": float(correct.mean()) if num else 0.0, "num_prompts": num, "n": n,
           "num_correct": [int(ci) for ci in c]}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(ci), k) for ci in c])) if num else 0.0
    return out
