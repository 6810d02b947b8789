"""STARE token weights and its closed-loop entropy controller (DESIGN.md steps 1-5, contract 1).

Per update step:

    s_t = -log pi(o_t)                                  (stop-gradient; it only selects)
    T+ = {valid t : A_t > 0},  T- = {valid t : A_t < 0}  (A = 0 is in neither)
    L+ = top-k of T+ by s, k = max(1, ceil(P |T+| - 1e-6)); L- likewise in T- with P- (default P,
         as in the paper; a separate P- is this project's extension); empty if the set is
    w_t = W on L+, else 1                                (variant O1)
    w_t = W on L+, M on L-, else 1                       (variant C2)
    all w_t = 1 when the gate is off                     (exactly GRPO)

Controller (a pure function of its state; the state lives in the train state):

    gate_on = H_bar < H_tgt
    adaptive:  W <- clip(W + alpha sgn(H_tgt - H_bar), 1, w_max)
               M <- clip(M - alpha sgn(H_tgt - H_bar), m_min, 1)

A non-finite H_bar (NaN or inf entropy) leaves the whole controller state unchanged: the gate,
W and M keep their last values instead of turning NaN (which would make every later step
non-finite); `prepare_step` reports such steps as the metric `stare_entropy_nonfinite`.

Order within a step: `new = controller_update(state, H_bar, settings)`, then this step's weights
use `new.gate_on`, `new.w`, `new.m`.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from stare_jax.rl.selection import select_top_fraction
from stare_jax.rl.settings import StareSettings

SELECTION_SCOPES = ("global", "microbatch")


def _weights_o1(lplus: jax.Array, lminus: jax.Array, w, m) -> jax.Array:
    """O1: w = W on L+, 1 elsewhere (T- untouched)."""
    return jnp.where(lplus, jnp.float32(w), jnp.float32(1.0))


def _weights_c2(lplus: jax.Array, lminus: jax.Array, w, m) -> jax.Array:
    """C2: w = W on L+, M on L-, 1 elsewhere."""
    out = jnp.where(lplus, jnp.float32(w), jnp.float32(1.0))
    return jnp.where(lminus, jnp.float32(m), out)


VARIANTS: dict[str, Callable] = {"O1": _weights_o1, "C2": _weights_c2}


def stare_sets(log_probs: jax.Array, advantages: jax.Array, mask: jax.Array, *, top_p_ratio: float,
               selection_scope: str = "global", num_microbatches: int = 1,
               top_p_ratio_minus: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(L+, L-) boolean masks [B, T]: the top-P-by-surprisal tokens of T+ and the top-P- of T-
    (P- = `top_p_ratio_minus`; 0 means P).

    `selection_scope="global"` ranks over the whole array; `"microbatch"` splits the leading axis
    into `num_microbatches` contiguous equal chunks and selects inside each (the reference code's
    per-GPU, per-micro-batch selection).
    """
    if selection_scope not in SELECTION_SCOPES:
        raise ValueError(f"selection_scope must be one of {SELECTION_SCOPES}, got {selection_scope!r}")
    groups = 1 if selection_scope == "global" else int(num_microbatches)
    if log_probs.shape[0] % groups:
        raise ValueError(f"{log_probs.shape[0]} rows cannot be split into {groups} micro-batches")
    surprisal = -jax.lax.stop_gradient(log_probs).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, surprisal.shape)
    t_plus = valid & (adv > 0)
    t_minus = valid & (adv < 0)
    lplus = select_top_fraction(surprisal, t_plus, top_p_ratio, num_groups=groups)
    lminus = select_top_fraction(surprisal, t_minus, top_p_ratio_minus or top_p_ratio, num_groups=groups)
    return lplus, lminus


def stare_weights(log_probs: jax.Array, advantages: jax.Array, mask: jax.Array, *, top_p_ratio: float,
                  w, m, variant: str, gate_on, selection_scope: str = "global",
                  num_microbatches: int = 1, top_p_ratio_minus: float = 0.0) -> jax.Array:
    """STARE token weights, float32 [B, T] (contract 1).

    `advantages` is per token [B, T] (or per sequence [B]); `w`, `m`, `gate_on` may be traced
    scalars. With the gate off every weight is 1. See the module docstring for the rule;
    `top_p_ratio_minus` (0: `top_p_ratio`) sizes L- separately.
    """
    weights, _, _ = stare_weights_and_sets(
        log_probs, advantages, mask, top_p_ratio=top_p_ratio, w=w, m=m, variant=variant, gate_on=gate_on,
        selection_scope=selection_scope, num_microbatches=num_microbatches, top_p_ratio_minus=top_p_ratio_minus)
    return weights


def stare_weights_and_sets(log_probs, advantages, mask, *, top_p_ratio: float, w, m, variant: str, gate_on,
                           selection_scope: str = "global", num_microbatches: int = 1,
                           top_p_ratio_minus: float = 0.0):
    """(weights, L+, L-) — `stare_weights` plus the selected sets (for metrics).

    The sets are reported whether or not the gate is on; the weights are all 1 when it is off.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    lplus, lminus = stare_sets(log_probs, advantages, mask, top_p_ratio=top_p_ratio,
                               selection_scope=selection_scope, num_microbatches=num_microbatches,
                               top_p_ratio_minus=top_p_ratio_minus)
    weights = VARIANTS[variant](lplus, lminus, w, m)
    weights = jnp.where(jnp.asarray(gate_on, bool), weights, jnp.float32(1.0)).astype(jnp.float32)
    return weights, lplus, lminus


@flax.struct.dataclass
class ControllerState:
    """The STARE controller's state: current W, M, gate and the last H_bar (float32 / bool scalars)."""

    w: jax.Array
    m: jax.Array
    gate_on: jax.Array
    last_entropy: jax.Array


def init_controller(settings: StareSettings) -> ControllerState:
    """Initial controller state: W, M from the config, gate off, last entropy NaN (none seen yet)."""
    return ControllerState(w=jnp.float32(settings.w), m=jnp.float32(settings.m), gate_on=jnp.bool_(False),
                           last_entropy=jnp.float32(jnp.nan))


def controller_update(state: ControllerState, entropy, settings: StareSettings) -> ControllerState:
    """One controller step from this step's pre-update token-mean entropy H_bar.

    gate_on = H_bar < H_tgt (always off when STARE is disabled); with `adaptive`,
    W <- clip(W + alpha sgn(H_tgt - H_bar), 1, w_max) and M <- clip(M - alpha sgn(H_tgt - H_bar), m_min, 1).
    A non-finite H_bar returns `state` unchanged (every field, `last_entropy` included).
    """
    h = jnp.asarray(entropy, jnp.float32)
    ok = jnp.isfinite(h)
    gate = (h < settings.target_entropy) if settings.enabled else jnp.bool_(False)
    w, m = state.w, state.m
    if settings.enabled and settings.adaptive:
        direction = jnp.sign(jnp.float32(settings.target_entropy) - h)
        w = jnp.clip(w + settings.alpha * direction, 1.0, settings.w_max)
        m = jnp.clip(m - settings.alpha * direction, settings.m_min, 1.0)
    new = ControllerState(w=jnp.asarray(w, jnp.float32), m=jnp.asarray(m, jnp.float32),
                          gate_on=jnp.asarray(gate, bool), last_entropy=h)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, state)
