"""The jitted, mesh-sharded RL update step: `(train_state, batch, rng) -> (train_state, metrics)`.

Batch (global arrays, leading axis N = prompts * G, group by group):

    input_ids       [N, P + R] int32   left-padded prompt (P) then response (R)
    attention_mask  [N, P + R]
    response_mask   [N, R]             1 on real response tokens
    old_log_probs   [N, R]             behaviour log-probs (sampler, temperature 1)
    rewards         [N]                float32
    old_entropy     [N, R]             optional: the sampler's entropy at each position (temperature 1)
    old_pi2_dev     [N, R]             optional: the sampler's Q = sum_j pi_j^2 (s_j - H) there

One step:

 1. A = group_advantages(rewards) (broadcast over each response's tokens).
 2. The pre-update policy's log-probs, entropy and Q = sum_j pi_j^2 (s_j - H) per response token,
    chunked over the vocabulary (`logprobs.token_stats`), float32.
 3. Over the whole batch in group order (`shape_batch`): the method's per-token advantage
    (`losses.ADVANTAGE_RULES`: HAPO, EntroAdv, W-REINFORCE; GRPO's A otherwise), the
    polarity-entropy quadrants and the `loss.quadrants` keep mask. Then H_bar = token mean of the
    entropy over all response tokens (stop-gradient); controller <- controller_update(controller,
    H_bar); STARE weights from the pre-update surprisal with the new gate / W / M (global selection
    by default), times the keep mask; quadrant diagnostics of both kinds.
 4. For each of `ppo_epochs` x `num_minibatches` optimizer steps: the registry loss
    (`losses.policy_loss`), its gradient accumulated over `grad_accum` micro-batches with exact
    aggregation over the mini-batch, then clip_by_global_norm + AdamW.
 5. Non-finite guard: an optimizer step whose loss or gradient norm is not finite is skipped
    (parameters and optimizer state unchanged); if any step of the batch was skipped the
    controller state is left as it was. `nonfinite_skipped` counts the skipped steps.
    Disagreement guard (`reject_above`, set by `UpdateStep(reject_disagreement=True)` on the
    programs that run XLA:CPU's Eigen products, the kernels seen computing wrong values:
    `stare_jax.cpu_gemm`; for on-policy batches, whose rounding reads ~1e-9): when the
    pre-update forward's `sampler_approx_kl` (point 6) is above the bound, the whole step is a
    no-op (every optimizer step, the controller and the step counter unchanged) and
    `disagreement_rejected` reads 1, so the caller can run the same batch again on other kernels
    with nothing of the wrong forward applied (`stare_jax.trainer`).
 6. `sampler_approx_kl`: the token mean of (r - 1) - log r with r = pi_theta_old(o_t) / mu(o_t),
    the pre-update policy's probability of each sampled token over the sampler's (`old_log_probs`):
    rounding (~0) unless the two phases compute different policies (`rl/policy_agreement.py`).

Paths. With a single optimizer step and no accumulation (the paper's on-policy setting) everything
happens in one forward + backward: entropy, selection and diagnostics come from the same forward
(stop-gradient) and the old log-probs are the batch's. Otherwise the whole batch's pre-update
statistics are needed before the first micro-batch's loss. With `update.old_stats = "sampler"` (the
default) they are the sampler's: the behaviour log-probs and the batch's `old_entropy` /
`old_pi2_dev` (`rollout.generate(token_stats=True)`), the same policy's values up to the rounding
of two programs (`rl/policy_agreement.py`), so the update runs no extra forward; its
`sampler_approx_kl` is then the first optimizer step's `approx_kl` (every micro-batch of the first
mini-batch, at the pre-update parameters). With "recompute", or a batch without those two arrays,
a first no-grad pass over the batch (micro-batch by micro-batch) gives them, and with several
optimizer steps per batch also the old log-probs (the behaviour log-probs are then not used): one
forward more, 1.25x the update's work under rematerialisation. Selection rules of the loss
registry (forking tokens, Clip-Cov, KL-Cov) see the pre-update statistics of their mini-batch.

Shared prompts. The G rows of a group hold the same prompt, so with `ppo.share_prompt` (the
default) each forward runs a prompt once and lets its G responses attend to it
(`Decoder.grouped_hidden_states`): the same values as the forward over every row, with the prompt
tokens' share of the compute divided by G (by G / K per micro-batch, when K divides G).

Packed responses. With `ppo.pack_tokens` = M > 0 every forward of the step runs on packed
responses (`models.packing`): each row's tokens up to its last real one, gathered per batch shard
into a buffer of static capacity (the largest shard's count rounded up to a bucket of M:
`ppo.pack_buckets`, its multiples or a geometric ladder for chips where compiling costs more than
padding), so projections, MLPs, norms and the vocabulary pass skip the padding after the
responses' ends; attention moves its inputs onto the [N, R] grid and its output back (gathers
both ways, gradients too). Same values up to float32 rounding; one compilation per capacity bucket.

Micro-batch k of the K = num_minibatches * grad_accum micro-batches is the strided row set
{i K + k}, so that with the batch sharded contiguously over (data, fsdp) every micro-batch is spread
over all devices without communication. `stare.selection_scope="microbatch"` selects per
micro-batch per batch shard (the reference code's per-GPU micro-batches).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stare_jax import cpu_gemm, gpu_gemm, parallel
from stare_jax.models.decoder import attention_block_for, positions_from_mask
from stare_jax.models.packing import (Packing, balanced_group_order, balanced_micro_order, block_count, gather_packed, packed_capacity,
                                      packed_rows_and_columns, scatter_packed)
from stare_jax.rl.advantages import group_advantages
from stare_jax.rl.diagnostics import polarity_entropy_diagnostics, polarity_entropy_quadrants, quadrant_diagnostics
from stare_jax.rl.logprobs import TokenStats, token_stats
from stare_jax.rl.losses import (ADVANTAGE_RULES, BatchView, LossContext, ScopeView, policy_loss, quadrant_keep,
                                 token_advantages)
from stare_jax.rl.policy_agreement import FULL_FLOAT32_APPROX_KL
from stare_jax.rl.settings import RLSettings
from stare_jax.rl.stare import ControllerState, controller_update, stare_weights_and_sets
from stare_jax.rl.train_state import TrainState, learning_rate_schedule, train_state_shardings

# Which kernels run the update's products on a CPU is `model.cpu_gemm`'s (`stare_jax.cpu_gemm`:
# Eigen's products with YNNPACK's reductions by default; Eigen's with XLA's own reductions computed
# wrong rows, so no setting gives that pair). XLA's tree-reduction rewrite stays
# off: it turns every reduction longer than 32 into a windowed tree reduction and a second pass (for
# the rounding of long float sums); the update's long sums are matmuls (`decoder.column_sum`) or
# vectorised row sums, and without the rewrite its row maxima and sums ran 2-8x faster in isolation
# (a [6,144, 1,024] row maximum 0.34-0.65 against 2.7 ms) and the update 1.02-1.03x
# (docs/performance.md, "XLA's tree reductions off in the update"). Only the CPU backend reads
# these options (and the dry run, which uses CPU compiles to stand in for TPU/GPU ones, leaves
# them out).
CPU_UPDATE_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}


def cpu_update_compiler_options(cpu_gemm_choice: str = "auto", remat: str = "none", reference: bool = False,
                                dtype=np.float32, blockwise: bool = False) -> dict:
    """The XLA options the update step compiles with on a CPU mesh: `CPU_UPDATE_COMPILER_OPTIONS`
    and those of `model.cpu_gemm = cpu_gemm_choice` for a model computing in `dtype` and
    rematerialising under `remat`, with a frozen reference model's forward in the step when
    `reference` and attention in blocks when `blockwise` (`stare_jax.cpu_gemm`)."""
    return {**CPU_UPDATE_COMPILER_OPTIONS,
            **cpu_gemm.compiler_options("update", cpu_gemm_choice, platform="cpu", remat=remat, reference=reference,
                                        dtype=dtype, blockwise=blockwise)}


def rows_per_shared_prompt(settings: RLSettings) -> int:
    """Rows of a group in each of the update's K micro-batches (micro-batch k = rows {i K + k}), whose
    shared prompt runs through the forward once (`Decoder.grouped_hidden_states`): G / K when
    `update.share_prompt` and K divides the group size G, else 1 (every row on its own)."""
    G, K = settings.group_size, settings.num_micro
    return G // K if settings.share_prompt and G % K == 0 else 1


BATCH_NDIMS = {"input_ids": 2, "attention_mask": 2, "response_mask": 2, "old_log_probs": 2, "rewards": 1}
SAMPLER_STATS_NDIMS = {"old_entropy": 2, "old_pi2_dev": 2}  # read when `RLSettings.takes_sampler_stats`


def response_token_stats(model, input_ids, attention_mask, response_len: int, *, vocab_chunk: int,
                         with_pi2: bool = False, temperature: float = 1.0, group_size: int = 1,
                         packing: Packing | None = None, keep_logits_mb: float = 0) -> TokenStats:
    """Per response token [N, R]: log pi(o_t), entropy H_t (and Q_t), from the decoder's final hidden
    states at positions P-1 .. P+R-2 and its [D, V] output matrix, chunked over the vocabulary.

    With `group_size` G > 1 the rows come in groups of G that share one prompt (rows i*G .. i*G+G-1
    hold the same prompt columns), and each prompt runs through the decoder once
    (`Decoder.grouped_hidden_states`) instead of G times.

    With `packing` (static; `UpdateStep.packing` of the batch) the responses run packed
    (`Decoder.packed_grouped_hidden_states`): the decoder and the vocabulary pass see only each
    row's tokens up to its last real one, and the statistics are scattered back onto [N, R] (zeros
    after each row's end). `keep_logits_mb`: `logprobs.token_stats`' bound on kept logits.
    """
    N, L = input_ids.shape
    P_len = L - response_len
    if P_len < 1:
        raise ValueError("input_ids must hold at least one prompt token before the response")
    if packing is not None:
        return _packed_response_token_stats(model, input_ids, attention_mask, response_len, packing,
                                            vocab_chunk=vocab_chunk, with_pi2=with_pi2, temperature=temperature,
                                            group_size=group_size, keep_logits_mb=keep_logits_mb)
    if group_size > 1:
        prompts = functools.partial(_group_prompts, group_size=group_size, prompt_len=P_len)
        prompt_hidden, response_hidden = model.grouped_hidden_states(
            prompts(input_ids), prompts(attention_mask), input_ids[:, P_len:], attention_mask[:, P_len:])
        last_prompt = jnp.repeat(prompt_hidden[:, -1:], group_size, axis=0, total_repeat_length=N)
        h = jnp.concatenate([last_prompt, response_hidden[:, :-1]], axis=1)
    else:
        hidden, _ = model.hidden_states(input_ids, positions_from_mask(attention_mask), attention_mask)
        h = hidden[:, P_len - 1:L - 1]
    return token_stats(h, model.output_embedding(), input_ids[:, P_len:], chunk_size=vocab_chunk,
                       temperature=temperature, compute_dtype=model.dtype, with_pi2=with_pi2,
                       partials=parallel.partial_sum_sharding(model.mesh), keep_logits_mb=keep_logits_mb,
                       row_shards=_row_shards(model))


def _row_shards(model) -> int:
    """The devices a batch's rows are split over on `model`'s mesh (data x fsdp; 1 without a mesh)."""
    mesh = getattr(model, "mesh", None)
    return 1 if mesh is None else parallel.batch_divisor(mesh)


def _group_prompts(x: jax.Array, *, group_size: int, prompt_len: int) -> jax.Array:
    """The prompt columns [B, P] of rows [N, P + R] that come in groups of `group_size` sharing one
    prompt (each group's first row)."""
    return x.reshape(x.shape[0] // group_size, group_size, x.shape[1])[:, 0, :prompt_len]


def _packed_response_token_stats(model, input_ids, attention_mask, response_len: int, packing: Packing, *,
                                 vocab_chunk: int, with_pi2: bool, temperature: float, group_size: int,
                                 keep_logits_mb: float) -> TokenStats:
    """`response_token_stats` on packed responses. The token at packed entry j (row r, column c) is
    predicted by the hidden state of entry j - 1 (the same row's column c - 1: kept positions are
    a prefix of each row, packed row-major) or, at c = 0, by the last prompt position of r's group."""
    N, L = input_ids.shape
    R, P_len = response_len, L - response_len
    prompts = functools.partial(_group_prompts, group_size=group_size, prompt_len=P_len)
    responses = input_ids[:, P_len:]
    prompt_hidden, packed_hidden, index, inverse = model.packed_grouped_hidden_states(
        prompts(input_ids), prompts(attention_mask), responses, attention_mask[:, P_len:], packing)
    row, col = packed_rows_and_columns(index, N, R)
    previous = jnp.concatenate([jnp.zeros_like(packed_hidden[:, :1]), packed_hidden[:, :-1]], axis=1)
    last_prompt = jnp.take(prompt_hidden[:, -1], row // group_size, axis=0)  # [S, C, D]
    h = model.constrain_batch(jnp.where((col == 0)[..., None], last_prompt, previous))
    stats = token_stats(h, model.output_embedding(), gather_packed(responses, index, inverse), chunk_size=vocab_chunk,
                        temperature=temperature, compute_dtype=model.dtype, with_pi2=with_pi2,
                        partials=parallel.partial_sum_sharding(model.mesh), keep_logits_mb=keep_logits_mb,
                        row_shards=_row_shards(model))
    grid = lambda x: None if x is None else model.constrain_batch(scatter_packed(x, index, N, R, inverse))  # noqa: E731
    return TokenStats(log_probs=grid(stats.log_probs), entropy=grid(stats.entropy), pi2_dev=grid(stats.pi2_dev))


@flax.struct.dataclass
class Prepared:
    """What step 3 produces: token weights, the new controller state and its metrics."""

    weights: jax.Array
    controller: ControllerState
    metrics: dict


def shape_batch(settings: RLSettings, advantages, rewards, log_probs, entropy, mask):
    """(advantages [N, R], quadrants, keep) of a whole batch in group order, all stop-gradient.

    `advantages` is the method's per-token advantage (`losses.token_advantages`; GRPO's `advantages`
    itself for methods without an advantage rule), `quadrants` the polarity-entropy masks
    (`diagnostics.polarity_entropy_quadrants`) and `keep` the `loss.quadrants` 0/1 mask (None: all
    tokens). Without `rewards` ([N]) only methods that need neither are possible: (advantages,
    None, None).
    """
    s = settings.loss
    if rewards is None:
        if s.name in ADVANTAGE_RULES or s.quadrants:
            raise ValueError(f"loss.name={s.name!r} / loss.quadrants={s.quadrants!r} need the batch's rewards")
        return advantages, None, None
    sg = jax.lax.stop_gradient
    rewards = jnp.asarray(rewards, jnp.float32)
    entropy = sg(entropy)
    quadrants = polarity_entropy_quadrants(rewards, entropy, mask, group_size=settings.group_size)
    batch = BatchView(advantages=advantages, rewards=rewards, entropy=entropy, log_probs=sg(log_probs), mask=mask,
                      group_size=settings.group_size)
    return token_advantages(s, batch), quadrants, quadrant_keep(s, quadrants)


def prepare_step(settings: RLSettings, controller: ControllerState, log_probs, entropy, pi2_dev, advantages, mask,
                 *, selection_groups: int = 1, quadrants: dict | None = None, keep=None) -> Prepared:
    """H_bar, controller update, STARE weights and diagnostics from pre-update statistics [M, R].

    `selection_groups` is the micro-batch count for `selection_scope="microbatch"` (rows are split
    into that many contiguous chunks). `quadrants` / `keep` (from `shape_batch`, same row order)
    add the polarity-entropy metrics and multiply the weights by the keep mask. Metrics: `entropy`
    (H_bar), `stare_gate_on`, `stare_w`, `stare_m`, `stare_lplus_frac` / `stare_lminus_frac`
    (fraction of valid tokens selected into L+ / L- this step; 0 when the gate is off or STARE is
    disabled), `stare_entropy_nonfinite` (1 when H_bar was not finite and the controller was left
    unchanged), the surprisal quadrant diagnostics and `pe_quad_*` (with `quadrants`).
    """
    sg = jax.lax.stop_gradient
    log_probs, entropy = sg(log_probs), sg(entropy)
    valid = mask > 0
    count = jnp.maximum(valid.sum(), 1).astype(jnp.float32)
    h_bar = jnp.sum(jnp.where(valid, entropy, 0.0)) / count
    new = controller_update(controller, h_bar, settings.stare)
    st = settings.stare
    if st.enabled:
        weights, lplus, lminus = stare_weights_and_sets(
            log_probs, advantages, mask, top_p_ratio=st.top_p_ratio, w=new.w, m=new.m, variant=st.variant,
            gate_on=new.gate_on, selection_scope=st.selection_scope, num_microbatches=selection_groups,
            top_p_ratio_minus=st.top_p_ratio_minus)
        lplus, lminus = lplus & new.gate_on, lminus & new.gate_on
    else:
        weights = jnp.ones_like(log_probs)
        lplus = lminus = jnp.zeros(log_probs.shape, bool)
    if keep is not None:
        weights = weights * keep
    metrics = {
        "entropy": h_bar,
        "stare_gate_on": new.gate_on.astype(jnp.float32),
        "stare_w": new.w,
        "stare_m": new.m,
        "stare_lplus_frac": lplus.sum().astype(jnp.float32) / count,
        "stare_lminus_frac": lminus.sum().astype(jnp.float32) / count,
        "stare_entropy_nonfinite": 1.0 - jnp.isfinite(h_bar).astype(jnp.float32),
    }
    metrics.update(quadrant_diagnostics(log_probs, entropy, pi2_dev, advantages, weights, mask))
    if quadrants is not None:
        metrics.update(polarity_entropy_diagnostics(quadrants, advantages, weights, mask))
    return Prepared(weights=weights, controller=new, metrics=metrics)


def single_pass_loss_and_grad(settings: RLSettings, model, controller: ControllerState, *, input_ids,
                              attention_mask, response_mask, old_log_probs, advantages, rng,
                              ref_log_probs=None, selection_groups: int = 1, prompt_groups: int = 1,
                              rewards=None, packing: Packing | None = None):
    """One forward + backward over a whole batch (the on-policy path).

    Returns (loss, grads, metrics, prepared) where grads is an nnx.State of the model's Params,
    `advantages` is GRPO's per token [N, R] (rows group by group, `rewards` [N] beside them: the
    method's advantage rule and the quadrants need them) and entropy / advantage shaping / selection
    / diagnostics come from the same forward, stop-gradient; `prompt_groups` > 1 runs each shared
    prompt once and `packing` runs the responses packed (`response_token_stats`). Pure: the model
    is not modified.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    R = response_mask.shape[1]
    mask = response_mask.astype(jnp.float32)
    old = old_log_probs.astype(jnp.float32)
    sg = jax.lax.stop_gradient

    def loss_fn(p):
        m = nnx.merge(graphdef, p, rest)
        stats = response_token_stats(m, input_ids, attention_mask, R, vocab_chunk=settings.vocab_chunk, with_pi2=True,
                                     group_size=prompt_groups, packing=packing,
                                     keep_logits_mb=settings.vocab_keep_logits_mb)
        adv, quadrants, keep = shape_batch(settings, advantages, rewards, stats.log_probs, stats.entropy, mask)
        prep = prepare_step(settings, controller, stats.log_probs, stats.entropy, stats.pi2_dev, adv, mask,
                            selection_groups=selection_groups, quadrants=quadrants, keep=keep)
        view = ScopeView(log_probs=sg(stats.log_probs)[None], old_log_probs=old[None], advantages=adv[None],
                         mask=mask[None], entropy=sg(stats.entropy)[None])
        ctx = LossContext(log_probs=stats.log_probs, old_log_probs=old, advantages=adv, mask=mask,
                          entropy=stats.entropy, token_weights=sg(prep.weights), rng=rng, view=view,
                          index=jnp.int32(0), settings=settings.loss, ref_log_probs=ref_log_probs)
        loss, metrics = policy_loss(ctx)
        return loss, (metrics, prep)

    (loss, (metrics, prep)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, metrics, prep


def _approx_kl(log_probs, old_log_probs, mask) -> jax.Array:
    """Token mean over `mask` of (r - 1) - log r, r = exp(log_probs - old_log_probs) (k3 of KL(old || new))."""
    d = log_probs - old_log_probs
    return jnp.sum(jnp.where(mask > 0, jnp.expm1(d) - d, 0.0)) / jnp.maximum(jnp.sum(mask > 0), 1)


def _to_micro(x: jax.Array, K: int) -> jax.Array:
    """[N, ...] -> [K, N/K, ...] with micro-batch k = rows {i K + k}."""
    n = x.shape[0] // K
    return jnp.swapaxes(x.reshape((n, K) + x.shape[1:]), 0, 1)


def _from_micro(x: jax.Array) -> jax.Array:
    """Inverse of `_to_micro`: [K, N/K, ...] -> [N, ...] in the original row order."""
    return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _constrain_micro(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Keeps the per-micro-batch row axis (axis 1) sharded over the batch axes."""
    if mesh.size == 1 or x.shape[1] % parallel.batch_divisor(mesh):
        return x
    spec = P(None, parallel.BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _tree_where(pred, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def _update_pure(settings: RLSettings, mesh: Mesh, graphdef, state, batch: dict, rng, packing: Packing | None = None,
                 *, reject_above: float | None = None):
    """The whole update step on pure state (see the module docstring); `packing` (static) runs every
    forward over packed responses; `reject_above` (static) is the disagreement guard's bound on
    `sampler_approx_kl` (None: no guard). Traced with `mesh` as the abstract mesh of the trace, which
    `parallel.replicated_in_trace` reads (token selection gathers its scores once, outside its loop)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return _update_body(settings, mesh, graphdef, state, batch, rng, packing, reject_above)


def _agrees(approx_kl, bound: float | None):
    """False where the disagreement guard rejects a step: `approx_kl` above `bound` (a non-finite
    value is left to the non-finite guard); always True without a bound."""
    return jnp.bool_(True) if bound is None else jnp.logical_not(approx_kl > bound)


def _update_body(settings: RLSettings, mesh: Mesh, graphdef, state, batch: dict, rng, packing: Packing | None,
                 reject_above: float | None = None):
    """`_update_pure` inside its mesh context."""
    ts = nnx.merge(graphdef, state)
    controller = ts.controller.get()
    ids = batch["input_ids"].astype(jnp.int32)
    am = batch["attention_mask"].astype(jnp.int32)
    mask = batch["response_mask"].astype(jnp.float32)
    behaviour = batch["old_log_probs"].astype(jnp.float32)
    N, R = mask.shape
    K, mb, acc, U = settings.num_micro, settings.num_minibatches, settings.grad_accum, settings.num_updates
    if N % K:
        raise ValueError(f"batch of {N} sequences cannot be split into {K} micro-batches "
                         f"(update.num_minibatches x update.grad_accum)")
    n = N // K
    groups = 1
    if settings.stare.selection_scope == "microbatch":
        groups = K * parallel.batch_divisor(mesh)
        if N % groups:
            raise ValueError(f"selection_scope='microbatch' needs N={N} divisible by micro-batches x batch shards "
                             f"= {groups}")

    shared = rows_per_shared_prompt(settings)

    adv_seq = group_advantages(batch["rewards"], settings.group_size, scale=settings.advantage_scale,
                               eps=settings.advantage_eps)
    adv = jnp.broadcast_to(adv_seq[:, None], (N, R))
    rng_loss = jax.random.fold_in(rng, 1)

    def micro(x):
        return _constrain_micro(_to_micro(x, K), mesh)

    ids_k, am_k, mask_k, beh_k = micro(ids), micro(am), micro(mask), micro(behaviour)
    ref_k = None
    if settings.loss.uses_reference:
        def ref_lp(xs):
            s = response_token_stats(ts.ref_model, xs[0], xs[1], R, vocab_chunk=settings.vocab_chunk, group_size=shared,
                                     packing=packing)
            return jax.lax.stop_gradient(s.log_probs)
        ref_k = jax.lax.map(ref_lp, (ids_k, am_k))

    lr_metric = learning_rate_schedule(settings.optim)(ts.optimizer.step[...])

    def apply_grads(st, grads, loss, agree):
        """clip + AdamW on `st`, unless loss or grad norm is non-finite or the disagreement guard
        rejected the step (`agree` False; then `st` unchanged). Returns (st, gnorm, finite)."""
        gnorm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)

        def do(s):
            t = nnx.merge(graphdef, s)
            t.optimizer.update(t.model, grads)
            return nnx.state(t)

        return jax.lax.cond(ok & agree, do, lambda s: s, st), gnorm, ok

    if K == 1 and U == 1:
        loss, grads, metrics, prep = single_pass_loss_and_grad(
            settings, ts.model, controller, input_ids=ids, attention_mask=am, response_mask=mask,
            old_log_probs=behaviour, advantages=adv, rng=rng_loss,
            ref_log_probs=None if ref_k is None else ref_k[0], selection_groups=groups, prompt_groups=shared,
            rewards=batch["rewards"], packing=packing)
        agree = _agrees(metrics["approx_kl"], reject_above)
        state, gnorm, ok = apply_grads(state, grads, loss, agree)
        metrics = {**metrics, "loss": loss, "grad_norm": gnorm, "nonfinite_skipped": 1.0 - ok.astype(jnp.float32),
                   "sampler_approx_kl": metrics["approx_kl"]}  # old log-probs = the sampler's, parameters = theta_old
        all_ok = ok
    else:
        graphdef_m, params0, rest0 = nnx.split(ts.model, nnx.Param, ...)
        from_sampler = "old_entropy" in batch

        def pre(xs):
            m = nnx.merge(graphdef_m, params0, rest0)
            s = response_token_stats(m, xs[0], xs[1], R, vocab_chunk=settings.vocab_chunk, with_pi2=True,
                                     group_size=shared, packing=packing)
            return jax.tree_util.tree_map(jax.lax.stop_gradient, (s.log_probs, s.entropy, s.pi2_dev))

        if from_sampler:  # the sampler's statistics: no pre-pass (module docstring)
            lp0, ent0, pi2_0 = beh_k, micro(batch["old_entropy"].astype(jnp.float32) * mask), \
                micro(batch["old_pi2_dev"].astype(jnp.float32) * mask)
        else:
            lp0, ent0, pi2_0 = jax.lax.map(pre, (ids_k, am_k))  # [K, n, R]
        flat = lambda x: x.reshape((K * n,) + x.shape[2:])  # noqa: E731  (micro-batch-major rows)
        shaped_adv, quadrants, keep = shape_batch(settings, adv, batch["rewards"], _from_micro(lp0), _from_micro(ent0),
                                                  mask)  # group order
        adv_k = micro(shaped_adv)
        if quadrants is not None:
            quadrants = {q: flat(micro(v)) for q, v in quadrants.items()}
        prep = prepare_step(settings, controller, flat(lp0), flat(ent0), flat(pi2_0), flat(adv_k), flat(mask_k),
                            selection_groups=groups, quadrants=quadrants,
                            keep=None if keep is None else flat(micro(keep)))
        old_k = lp0 if U > 1 else beh_k
        by_mb = lambda x: x.reshape((mb, acc) + x.shape[1:])  # noqa: E731
        w_k = prep.weights.reshape(K, n, R)
        data = {"ids": ids_k, "am": am_k, "mask": mask_k, "adv": adv_k, "old": old_k, "w": w_k, "lp0": lp0,
                "ent0": ent0}
        if ref_k is not None:
            data["ref"] = ref_k
        data = {k: by_mb(v) for k, v in data.items()}

        def micro_loss(params, rest, d, view, j, key):
            m = nnx.merge(graphdef_m, params, rest)
            stats = response_token_stats(m, d["ids"], d["am"], R, vocab_chunk=settings.vocab_chunk, group_size=shared,
                                         packing=packing, keep_logits_mb=settings.vocab_keep_logits_mb)
            ctx = LossContext(log_probs=stats.log_probs, old_log_probs=d["old"], advantages=d["adv"], mask=d["mask"],
                              entropy=stats.entropy, token_weights=d["w"], rng=key, view=view, index=j,
                              settings=settings.loss, ref_log_probs=d.get("ref"))
            return policy_loss(ctx)

        # the disagreement guard: with the sampler's statistics the first optimizer step's forwards
        # give sampler_approx_kl, so that step decides (and the later ones follow it); with the
        # pre-pass it is known before the first
        pre_kl = None if from_sampler else _approx_kl(lp0, beh_k, mask_k)
        agree0 = jnp.bool_(True) if from_sampler else _agrees(pre_kl, reject_above)

        def one_update(carry, u):
            st, agree = carry
            i = u % mb
            d_mb = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), data)
            view = ScopeView(log_probs=d_mb["lp0"], old_log_probs=d_mb["old"], advantages=d_mb["adv"],
                             mask=d_mb["mask"], entropy=d_mb["ent0"])
            t = nnx.merge(graphdef, st)
            _, params, rest = nnx.split(t.model, nnx.Param, ...)
            key = jax.random.fold_in(rng_loss, u)

            def accumulate(carry, j):
                g_sum, l_sum, m_sum = carry
                d_j = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False), d_mb)
                (l_j, m_j), g_j = jax.value_and_grad(micro_loss, has_aux=True)(params, rest, d_j, view, j, key)
                add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)  # noqa: E731
                return (add(g_sum, g_j), l_sum + l_j, add(m_sum, m_j)), None

            metric_shapes = jax.eval_shape(lambda: micro_loss(params, rest, jax.tree_util.tree_map(
                lambda x: x[0], d_mb), view, jnp.int32(0), key)[1])
            zeros = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.float32(0.0),
                     jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
            (grads, loss, metrics), _ = jax.lax.scan(accumulate, zeros, jnp.arange(acc, dtype=jnp.int32))
            if from_sampler:
                agree = jnp.where(u == 0, _agrees(metrics["approx_kl"], reject_above), agree)
            st, gnorm, ok = apply_grads(st, grads, loss, agree)
            return (st, agree), ({**metrics, "loss": loss, "grad_norm": gnorm}, ok)

        (state, agree), (per_update, oks) = jax.lax.scan(one_update, (state, agree0), jnp.arange(U, dtype=jnp.int32))
        metrics = jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), per_update)
        metrics["nonfinite_skipped"] = U - oks.sum().astype(jnp.float32)
        # the first optimizer step's forwards ran at the pre-update parameters against the sampler's log-probs
        metrics["sampler_approx_kl"] = per_update["approx_kl"][0] if from_sampler else pre_kl
        all_ok = jnp.all(oks)

    ts = nnx.merge(graphdef, state)
    ts.controller.set(_tree_where(all_ok & agree, prep.controller, controller))
    ts.step[...] = ts.step[...] + agree.astype(ts.step[...].dtype)  # a rejected step is a no-op, counter included
    if reject_above is not None:
        metrics["disagreement_rejected"] = 1.0 - agree.astype(jnp.float32)
    metrics.update(prep.metrics)
    metrics["advantage_mean"] = jnp.mean(adv_seq)
    metrics["advantage_std"] = jnp.std(adv_seq)
    metrics["lr"] = lr_metric
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return nnx.state(ts), metrics


class UpdateStep:
    """The jitted update step of a train state structure on a mesh.

    `step(train_state, batch, rng) -> (train_state, metrics)` updates the NNX train state in place
    (its arrays are donated) and returns it with a dict of float32 scalar metrics.
    `step.apply(state, batch, rng)` is the same on the pure state (`nnx.state(train_state)`), and
    `step.lower(state, batch, rng)` lowers it (arguments may be abstract `jax.ShapeDtypeStruct`s).

    With `update.pack_tokens` > 0 the step runs on packed responses (`models.packing`); the packed
    capacity is part of the compiled shape and comes from the batch's masks on the host
    (`step.packing(batch)`), so a caller that holds the batch in host memory runs
    `batch, packing = step.arrange(host_batch)` (which also evens out the shards' token counts)
    and passes `packing=packing`: the step then reads nothing back from the devices.

    With several micro-batches or optimizer steps and `update.old_stats = "sampler"` the step reads
    the batch's `old_entropy` and `old_pi2_dev` too (`SAMPLER_STATS_NDIMS`); a batch without them
    runs a second compiled program that recomputes them in a pre-pass.
    """

    def __init__(self, settings: RLSettings, mesh: Mesh, train_state: TrainState, *, donate: bool = True,
                 cpu_options: bool = True, reject_disagreement: bool = False):
        if settings.loss.uses_reference and train_state.ref_model is None:
            raise ValueError(f"loss.kl_type={settings.loss.kl_type!r} needs a train state with a reference model")
        self.settings = settings
        self.mesh = mesh
        self.graphdef, state = nnx.split(train_state)
        self.state_shardings = train_state_shardings(state, mesh)
        self.batch_ndims = {**BATCH_NDIMS, **(SAMPLER_STATS_NDIMS if settings.takes_sampler_stats else {})}
        self.batch_shardings = {k: parallel.batch_sharding(mesh, nd) for k, nd in self.batch_ndims.items()}
        replicated = parallel.replicated(mesh)
        platform = mesh.devices.flat[0].platform
        dtype = getattr(train_state.model, "dtype", np.float32)

        def step_options(blockwise: bool) -> dict:
            options = (cpu_update_compiler_options(settings.cpu_gemm, cpu_gemm.remat_policy(train_state.model),
                                                   reference=settings.loss.uses_reference, dtype=dtype,
                                                   blockwise=blockwise)
                       if cpu_options and platform == "cpu" else {})
            return {**options, **gpu_gemm.compiler_options("update", settings.gpu_gemm, platform=platform, dtype=dtype)}

        # the XLA options the step compiles with (`model.cpu_gemm` / `gpu_gemm`) for batches whose
        # attention runs whole; `options_for` gives a batch's
        self.compiler_options = step_options(False)
        self._blockwise_options = step_options(True)
        self.attention_block = int(getattr(train_state.model, "attention_block", 0))

        def jits(options):
            # programs on Eigen's products carry the disagreement guard (module docstring, point 5)
            bound = FULL_FLOAT32_APPROX_KL if reject_disagreement and cpu_gemm.uses_eigen_products(options) else None
            fn = functools.partial(_update_pure, settings, mesh, self.graphdef, reject_above=bound)
            jit = lambda keys: jax.jit(  # noqa: E731
                fn, in_shardings=(self.state_shardings, {k: self.batch_shardings[k] for k in keys}, replicated),
                out_shardings=(self.state_shardings, replicated), static_argnums=(3,),
                donate_argnums=(0,) if donate else (), compiler_options=options or None)
            with_stats = jit(self.batch_ndims)
            # a batch without the sampler's statistics still runs, with the pre-pass (module docstring)
            return with_stats, (jit(BATCH_NDIMS) if settings.takes_sampler_stats else with_stats)

        self.jitted, self._without_stats = jits(self.compiler_options)
        self._blockwise_jits = (jits(self._blockwise_options) if self._blockwise_options != self.compiler_options
                                else (self.jitted, self._without_stats))

    def _batch(self, batch: dict) -> dict:
        missing = [k for k in BATCH_NDIMS if k not in batch]
        if missing:
            raise KeyError(f"batch is missing {missing}; needs {list(BATCH_NDIMS)}")
        keys = self.batch_ndims if all(k in batch for k in self.batch_ndims) else BATCH_NDIMS
        return {k: batch[k] for k in keys}

    def blockwise(self, batch: dict) -> bool:
        """Whether `batch`'s sequences (prompt + response columns) are longer than the model's
        `attention_block`, so that some attention of its update may run in blocks."""
        return attention_block_for(self.attention_block, np.shape(batch["input_ids"])[1]) > 0

    def options_for(self, batch: dict) -> dict:
        """The XLA options `batch`'s update compiles with: `compiler_options`, or with attention in
        blocks those of `cpu_gemm.compiler_options(blockwise=True)` (no Eigen products)."""
        return self._blockwise_options if self.blockwise(batch) else self.compiler_options

    def _jitted_for(self, batch: dict):
        """The jitted step for a batch from `_batch`: with the sampler's statistics or without, on
        the options of `options_for`."""
        with_stats, without = self._blockwise_jits if self.blockwise(batch) else (self.jitted, self._without_stats)
        return with_stats if len(batch) == len(self.batch_ndims) else without

    def packing(self, batch: dict) -> Packing | None:
        """The packed layout of a batch (None without packing): capacity from
        `packing.packed_capacity` over the update's micro-batches and row blocks, counted on the
        response part of the attention mask, as the device keeps it."""
        s = self.settings
        if not s.pack_tokens:
            return None
        R = np.shape(batch["response_mask"])[1]
        return self._packing_of(parallel.to_host(batch["attention_mask"])[:, -R:])

    def _packing_of(self, mask: np.ndarray) -> Packing:
        s = self.settings
        shards = block_count(self.mesh, mask.shape[0] // s.num_micro)
        return Packing(packed_capacity(mask, shards=shards, multiple=s.pack_tokens, micro_batches=s.num_micro,
                                       buckets=s.pack_buckets), shards)

    def arrange(self, batch: dict) -> tuple[dict, Packing | None]:
        """Host side, before sharding: (batch, packing) for a host batch. With packing, whole groups
        are reordered so that the row blocks of the batch shards hold even token counts
        (`packing.balanced_group_order`; the update is the same up to float rounding in any group
        order) and the packed layout is computed from the reordered mask. With several
        micro-batches of one mini-batch and global selection, rows also move inside their groups
        so that the micro-batches hold even token counts (`packing.balanced_micro_order`: the
        same rows in the one mini-batch, whose loss is a sum over its micro-batches; the rows of a
        group are exchangeable). Without packing: (batch, None)."""
        s = self.settings
        if not s.pack_tokens:
            return batch, None
        R = np.shape(batch["response_mask"])[1]
        mask = np.asarray(batch["attention_mask"])[:, -R:]
        N = mask.shape[0]
        order = balanced_group_order(mask, s.group_size, block_count(self.mesh, N))
        if s.num_micro > 1 and s.num_minibatches == 1 and s.stare.selection_scope == "global" and N % s.num_micro == 0:
            order = order[balanced_micro_order(mask[order], s.group_size, s.num_micro,
                                               block_count(self.mesh, N // s.num_micro))]
        if not np.array_equal(order, np.arange(len(order))):
            batch = {k: np.asarray(v)[order] for k, v in batch.items()}
        return batch, self.packing(batch)

    def full_packing(self, num_rows: int, response_len: int) -> Packing | None:
        """The largest packed layout of [num_rows, response_len] batches (every position kept)."""
        if not self.settings.pack_tokens:
            return None
        return self._packing_of(np.ones((num_rows, response_len), np.int32))

    def apply(self, state, batch: dict, rng, packing: Packing | None = None) -> tuple[Any, dict]:
        """Pure form: (new state, metrics) from the pure train state."""
        if packing is None:
            packing = self.packing(batch)
        batch = self._batch(batch)
        return self._jitted_for(batch)(state, batch, rng, packing)

    def lower(self, state, batch: dict, rng, packing: Packing | None = None):
        """`jax.jit(...).lower` of the step (for compiled memory / cost analysis); packed steps lower
        at their largest capacity unless `packing` is given."""
        if packing is None:
            packing = self.full_packing(*batch["response_mask"].shape)
        batch = self._batch(batch)
        return self._jitted_for(batch).lower(state, batch, rng, packing)

    def __call__(self, train_state: TrainState, batch: dict, rng,
                 packing: Packing | None = None) -> tuple[TrainState, dict]:
        new_state, metrics = self.apply(nnx.state(train_state), batch, rng, packing)
        nnx.update(train_state, new_state)
        return train_state, metrics


def make_update_step(config, mesh: Mesh | None, train_state: TrainState, *, donate: bool = True,
                     cpu_options: bool = True, reject_disagreement: bool = False) -> UpdateStep:
    """Builds the jitted update step for `train_state`'s structure (real or `nnx.eval_shape`d).

    `config` is the ml_collections config (or an `RLSettings`); `mesh=None` uses one device.
    `cpu_options=False` compiles without `CPU_UPDATE_COMPILER_OPTIONS` and `model.cpu_gemm`'s
    options (`stare_jax.cpu_gemm`) on a CPU mesh. On a GPU the
    products' kernels follow `model.gpu_gemm` (`stare_jax.gpu_gemm`), with the float32 products'
    precision read when the step is built (inside the run's `precision.matmul_precision`).
    `reject_disagreement=True` (for batches the sampler drew from the train state's own policy, as
    the trainer's are) puts the disagreement guard (module docstring, point 5) into the programs
    that run Eigen's products.
    """
    settings = config if isinstance(config, RLSettings) else RLSettings.from_config(config)
    if mesh is None:
        mesh = parallel.make_mesh(devices=jax.devices()[:1])
    return UpdateStep(settings, mesh, train_state, donate=donate, cpu_options=cpu_options,
                      reject_disagreement=reject_disagreement)
