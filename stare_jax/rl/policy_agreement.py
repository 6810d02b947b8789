"""Whether the update's forward computes the policy the sampler sampled from.

Before its first optimizer step the update's policy is the behaviour policy, so the ratio of the
update's probability of each sampled token to the sampler's, r_t = pi(o_t) / mu(o_t), is 1 up to
the rounding of two programs, and the update step's

    sampler_approx_kl = mean_t [(r_t - 1) - log r_t]   (token mean over the batch)

is ~0: 1e-9 to 1e-5 in float32 runs (3e-11 to 3e-9 where both phases compute in full float32 on
a CPU), at most 0.0027 in the H100's bfloat16 recipe (its on-policy `approx_kl`, the same figure:
docs/bench/h100/recipe_*_metrics.jsonl). A kernel that computes wrong
values reads far above that: XLA:CPU's Eigen products on two CPU devices gave 0.81 (wrong hidden
states, the section "Eigen's matmuls in the update gave wrong results on two CPU devices" of
docs/performance.md) and 0.27-0.28 under the "projections" rematerialisation
(stare_jax/cpu_gemm.py), with the loss and its gradients still plausible, and 0.0197 in one of four
processes with the MLP's outputs kept in the last 8 layers (Intel Xeon with AMX). The trainer
checks every step against `disagreement_bound` (0.05, or 1e-3 where both phases compute in full
float32) and warns once, so such a fault is seen on the first step, not in a study's curves; on a
CPU whose update runs Eigen's products it rebuilds the update on XLA's defaults for the rest of
the run (`stare_jax.cpu_gemm.with_choice`), a resumed run included (the step is kept in the
checkpoints' metadata as `cpu_gemm_fallback_step`). That step itself is not applied: the trainer's
update on Eigen's products carries the disagreement guard (`rl.update`, point 5 of its module
docstring), which leaves it undone, and the trainer runs the same batch again on the rebuilt update
(the row keeps the rejected figure as `eigen_sampler_approx_kl`), so the run goes on exactly as one
on XLA's defaults from that step would.
"""

from __future__ import annotations

import math

#: a sampler_approx_kl above this is a disagreement beyond any dtype's rounding (the module doc)
DISAGREEMENT_APPROX_KL = 0.05

#: the same where both phases compute in full float32 (`disagreement_bound`): their rounding reads
#: 3e-11 to 3e-9 on the CPU hosts, and a wrong program has read as little as 0.0197 (Eigen's products
#: with the MLP's outputs kept in the last 8 layers, Intel Xeon with AMX: docs/performance.md)
FULL_FLOAT32_APPROX_KL = 1e-3


def disagreement_bound(dtype, matmul_precision: str, platform: str) -> float:
    """The `sampler_approx_kl` above which the two phases disagree: `FULL_FLOAT32_APPROX_KL` for a
    model computing in float32 with full-float32 products (on a CPU, or `model.matmul_precision =
    "float32"`), else `DISAGREEMENT_APPROX_KL` (bfloat16, TF32 and a TPU's default products)."""
    full = str(dtype) == "float32" and (platform == "cpu" or matmul_precision == "float32")
    return FULL_FLOAT32_APPROX_KL if full else DISAGREEMENT_APPROX_KL


def disagreement_line(metrics: dict, bound: float = DISAGREEMENT_APPROX_KL) -> str | None:
    """A one-line warning when the update step's `sampler_approx_kl` is above `bound`
    (`disagreement_bound`), i.e. its forward's log-probs of the sampled tokens before the step
    disagree with the sampler's; None otherwise, and for a value that is not finite (a step the
    update skipped, counted by `nonfinite_skipped`)."""
    kl = metrics.get("sampler_approx_kl")
    if kl is None or not math.isfinite(kl) or kl <= bound:
        return None
    return (f"the update's log-probs disagree with the sampler's: sampler_approx_kl {kl:.3g} (rounding gives "
            f"< {bound:g}); a kernel computes wrong values (on a CPU try model.cpu_gemm=ynnpack or "
            f"mesh.cpu_devices=1) or the two phases see different models")
