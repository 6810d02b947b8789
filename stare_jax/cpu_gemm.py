"""Which kernels XLA:CPU runs the update's matrix products with (`model.cpu_gemm`): per-program options.

XLA:CPU (jaxlib 0.10.2) hands each product and each reduction to a YNNPACK fusion by default
(`xla_cpu_experimental_ynn_fusion_type` = LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT and
LIBRARY_FUSION_TYPE_REDUCE); whatever it leaves out runs in its own kernels (Eigen's contraction
for products, XLA's emitted loops for reductions). On the update's shapes Eigen's products are the
faster ones: the real model's update on a fixed batch (SmolLM2-135M, 64 responses, two CPU devices)
took 76.2 and 87.2 s with them against 102.0 and 94.4 s on YNNPACK's, four processes alternating on
the Zen 4 host (docs/performance.md, "Eigen's products with YNNPACK's reductions").

With both kinds taken from YNNPACK (the option set to "") that update computed wrong hidden
states: the first ~512 positions of each device's rows, off by up to 78 and different from call
to call (docs/performance.md, "Eigen's matmuls in the update gave wrong results on two CPU
devices"). The fault needs Eigen's products and XLA's own reductions in one program: with the
reductions left to YNNPACK (`EIGEN_PRODUCTS`) the same check (`scripts/check_update_kernels.py`,
all 30 layers and 23 or 27 of them, three calls each) gives the reference values to 6e-5 in every
call, as does YNNPACK's products with XLA's reductions, and the whole update's metrics equal
YNNPACK's to float rounding (relative 1.1e-5 at most), bit-identical between processes.

The same pair met a fault again in a program not checked before: with `model.remat_saves =
"projections"` (every layer's projection outputs kept for the backward) the real model's update on
two CPU devices (Zen 5 host, 2026-12-04) reported token entropies of mean 2.854-2.858 against 2.792
and an approx_kl of 0.27-0.28 against 3e-9 on the on-policy batch, different from process to
process (gradients and loss still equal to YNNPACK's); on one device, or with YNNPACK's products,
every metric agreed. So "auto" keeps Eigen's products only for the update programs they were
checked on (`EIGEN_CHECKED_REMAT`) and gives the rest to YNNPACK, on which that program ran 3-4 %
slower than on the faulty pair and as fast as the default remat (docs/performance.md, "`model.remat_saves =
"projections"` computed wrong metrics on Eigen's products").

A third program met it (Zen 4 host, 2026-12-05): the update with a KL term to a frozen reference
model (`loss.kl_type = "k3"`), whose step runs the reference's forward too, read a first-update
`sampler_approx_kl` of 0.421 on two CPU devices with Eigen's products against 2.8e-9 on YNNPACK's,
while every other update variant read 3e-11 to 3e-9 (docs/performance.md, "Every update path on
Eigen's products, checked on the Zen 4 host"). So "auto" leaves an update with a reference model
to XLA's defaults as well (`reference=True`).

Every other update variant was checked right on Eigen's products by the same figure, one setting
at a time (Zen 4 host, code of 03028d3 and 9743f7f): each loss of the registry, STARE's C2 and
adaptive variants, `loss.agg`, `loss.quadrants`, micro-batches, minibatches, epochs, the unshared
prompt and `remat_saves = "mlp"`, all at 3e-11 to 3e-9 (docs/performance.md, "The rest of the
method family, checked the same way").

Eigen's products are float32 ones: a bfloat16 update (`model.dtype`) on them ran at Eigen's
float32 rate (bf16 x bf16 products at 240 GFLOP/s on an Intel Xeon with AMX, 2 cores), where
YNNPACK's bf16 kernels (`stare_jax.models.products`) ran at 820-1,550 GFLOP/s; and the real
model's bfloat16 update on them (code of e524b13, two CPU devices, that host) read a first-update
`sampler_approx_kl` of 0.68 in two processes against 7.1e-4 for the same batch on YNNPACK's
(docs/performance.md, "bfloat16 products on a CPU with AMX"). So "auto" leaves a bfloat16 update
to XLA's defaults.

A fifth program met it (Intel Xeon with AMX, 2026-12-06): the two-loop program of `remat_saves =
"mlp"` in only the last layers (`model.remat_saves_layers`, "nothing+mlp"), checked right on the
Zen 4 host with 15 of 30 layers (2.9e-9, code of 0fd1057), read a first-update `sampler_approx_kl`
of 0.0197 with the last 8 layers in one of four processes on the real model's batch (2.98e-9 in
the other three, 2.94e-9 on YNNPACK's products; the state after two updates bit-identical to a
right process's: the reported log-probs were wrong, not the step). So "auto" leaves that program to
XLA's defaults as well (docs/performance.md, "The MLP's outputs kept in the last layers on
Eigen's products, oneDNN's fusions, and the bfloat16 update's account").

A sixth program met it (Intel Xeon with AMX, 2026-12-07): the real model's update forward with the
grouped responses' attention in flash blocks (`blockwise_attention.grouped_causal_attention`,
`model.attention_block` below the response length) computed wrong hidden states for the first two
rows of each device, off by up to 41 and different from call to call (`python
scripts/check_update_kernels.py --attention-block 32 --calls 2`; docs/performance.md, "The grouped
update's responses in blocks"). So "auto" leaves every update program whose sequences are longer
than `model.attention_block` (where any attention may run in blocks: `blockwise`) to XLA's defaults.

A seventh met it on the Zen 4 host (2026-12-08) with nothing but another packed capacity: the real
model's default update (whole-layer remat, the checked program) at `ppo.pack_tokens = 256`, whose
fixed batch packs into 5,888 entries a device, read a first-update `sampler_approx_kl` of 0.3179 in
three processes (the same value each time) against 2.8e-9 on YNNPACK's products at that capacity and
2.9e-9 on Eigen's at 6,144, 5,632 and 4,608; its loss agreed with YNNPACK's to 1e-7, so the step was
right and the reported log-probs wrong (docs/performance.md, "Even blocks, a finer packing
multiple, and a disagreeing step left undone"). Every capacity is a program of its own, so no list
of checked programs covers them all: the trainer's update carries a guard instead
(`rl.update`, `reject_disagreement`): a step on Eigen's products whose `sampler_approx_kl` is above
the full-float32 bound is left undone, and the trainer runs it again on XLA's defaults, which it
keeps for the rest of the run (`rl.policy_agreement`).

`model.cpu_gemm`:

    auto     (default) the update's products on Eigen, its reductions on YNNPACK
             (`EIGEN_PRODUCTS`), where the update computes in float32, its rematerialisation is one
             Eigen's products were checked on (`EIGEN_CHECKED_REMAT`), it runs no reference
             model and no attention in blocks, else XLA's defaults; the rollout on XLA's
             defaults (its decode products are thin)
    ynnpack  XLA:CPU's defaults in both phases (YNNPACK's products and reductions), as every run
             before this setting

The options are set per jitted program (`jax.jit(..., compiler_options=...)`) and override
XLA_FLAGS for those programs. Off a CPU every choice gives no options. The kernel choice changes
floating-point rounding, not the computation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stare_jax.config import CPU_GEMM_CHOICES as CHOICES
from stare_jax.config import with_overrides

PHASES = ("update", "rollout")

#: products in XLA:CPU's own (Eigen) kernels, reductions in YNNPACK fusions (the module docstring)
EIGEN_PRODUCTS: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


#: the update's rematerialisation policies (`model.remat_saves` of a rematerialised model; "none":
#: no rematerialisation) whose programs were checked right with Eigen's products on two CPU devices
#: (the module docstring): the real model's whole-layer and "mlp" remat, the synthetic workloads and
#: the tests' models without it; not "mlp" in only the last layers (`remat_policy`'s "nothing+mlp")
EIGEN_CHECKED_REMAT = ("none", "nothing", "mlp")


def uses_eigen_products(options: dict[str, Any]) -> bool:
    """Whether a program compiled with XLA `options` runs its products on Eigen's kernels
    (`EIGEN_PRODUCTS` among them)."""
    return all(options.get(k) == v for k, v in EIGEN_PRODUCTS.items())


def with_choice(config, choice: str):
    """A copy of `config` with `model.cpu_gemm = choice` (the trainer's fallback off Eigen's products
    after its update disagreed with the sampler: `stare_jax.rl.policy_agreement`)."""
    if choice not in CHOICES:
        raise ValueError(f"model.cpu_gemm must be one of {', '.join(CHOICES)}, got {choice!r}")
    return with_overrides(config, {"model.cpu_gemm": choice})


def remat_policy(model) -> str:
    """The rematerialisation policy of `model`'s layers, as `EIGEN_CHECKED_REMAT` names it: "none"
    without `remat`; its `remat_saves` when every layer keeps it (`Decoder.saving_layers` equal to
    the depth; "nothing" when none does); "nothing+S" when only the last layers keep S (two layer
    loops in the program)."""
    if not getattr(model, "remat", False):
        return "none"
    saves, keep = str(model.remat_saves), model.saving_layers
    if keep == 0:
        return "nothing"
    return saves if keep == model.config.num_layers else f"nothing+{saves}"


def compiler_options(phase: str, choice: str, *, platform: str, remat: str = "none",
                     reference: bool = False, dtype: Any = "float32", blockwise: bool = False) -> dict[str, Any]:
    """The XLA compiler options for `phase` ("update" or "rollout") under `model.cpu_gemm = choice`
    on devices of `platform`, for an update computing in `dtype` (`model.dtype`) whose layers
    rematerialise under `remat` (`remat_policy`), which runs a frozen reference model's forward
    when `reference` (`loss.kl_type`) and attention in blocks when `blockwise` (sequences longer
    than `model.attention_block`; both unchecked or faulty, see the module docstring); {} for XLA's
    defaults."""
    if choice not in CHOICES:
        raise ValueError(f"model.cpu_gemm must be one of {', '.join(CHOICES)}, got {choice!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if (platform != "cpu" or choice == "ynnpack" or phase == "rollout" or remat not in EIGEN_CHECKED_REMAT
            or reference or blockwise or np.dtype(dtype) != np.float32):
        return {}
    return dict(EIGEN_PRODUCTS)
