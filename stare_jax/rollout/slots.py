"""Slot-refilling (continuous-batching) rollouts: `generate(..., slots=S)`.

The static sampler (`sampler.grouped_rollout`) decodes all N = B*G responses in lockstep and
keeps stepping every row until the longest response ends: with lengths that vary 10x inside a
batch most row-steps are spent on finished responses. Here a fixed number S of decode *slots*
does the work. Each slot holds one response at a time, with its own prompt, position and KV
cache; when its response ends (EOS, stop length or R tokens) the slot takes the next pending
response in response order (the rest of the same group, then the next prompt's) in the same
decode step, so no slot idles while responses are pending. One jitted `lax.while_loop` runs
until every response has ended; every shape is static (S, R, P, B, N), so outcomes with other
lengths reuse the compiled program.

Same responses as the static sampler for the same key: randomness belongs to the response, not
the slot. Response r's token t uses uniforms[t, r] of the [R, N] array the static sampler draws,
whichever slot decodes it and whenever; each step computes only its S slots' numbers
(`sampling.uniforms_at`, bit for bit those of the array). The math of a step is
the static decode step's (`decode.decode_step`, with one prompt per row and a per-row cache
slot), so greedy and sampled tokens agree and log-probs agree to float rounding.

Design, and why (reasoned for CPU and GPU, where decode is bound by reading weights and KV):

* Prefill once, up front. The B prompts run through the decoder in one batched call, as in the
  static sampler; the result is the shared prompt cache [B, K, P, hd] per layer and each
  prompt's last-position logits. Every response's *first* token depends only on those logits
  and its own uniform, so all N first tokens (and log-probs) are chosen in that one batched
  step. A refilled slot therefore never runs a prefill inside the loop: it starts decoding at
  once from its precomputed first token, and a response whose first token ends it never takes a
  slot at all. Re-running a prompt's prefill per refill (batched over the refilled slots) would
  cost P tokens of compute per response instead of P per prompt, and a batched prefill needs a
  fixed number of prefill rows per step (idle work, or slots waiting for a prefill lane).
* Each slot keeps its own copy of its prompt's keys/values [S, K, P, hd], copied from the shared
  prompt cache when the slot is refilled. The alternative, gathering the prompt keys of every
  slot from the shared cache inside every decode step, writes and re-reads S*P keys per layer
  per step (XLA materialises the gather before the matmul on CPU and GPU); the per-slot copy is
  read once per step and written once per response. Scoring every slot against all B prompts
  and masking avoids copies but costs S*B*P instead of S*P multiply-adds per step, which grows
  with the batch and is compute-bound on CPU. Against the static sampler's shared group prompt
  the per-slot copy reads S*P instead of B*P prompt keys per step: small next to the S*R
  response cache when responses are long and skewed, which is where refilling pays.
* Slot groups share a prompt while they can. When S is a multiple of G, slots s*G .. s*G+G-1
  form a group that also keeps one shared copy of the prompt its leading slot holds
  ([S/G, K, P, hd] per layer, written with the leading slot's refills). While every busy slot
  answers the prompt of its group's leading slot (`aligned`: always in the first wave, and
  whenever whole groups end together, as on equal lengths), a step attends to the shared copies
  with the static sampler's grouped attention, reading S/G*P prompt keys instead of S*P; once a
  refill breaks that, the per-slot copies serve until the next block loop checks again. Each
  block therefore has two loops, the shared one first (twice the loop bodies to compile). On
  equal lengths this took the slot sampler from 0.87x to 0.98-1.00x the static sampler's tokens/s
  on the benchmark's small model, where the prompt keys are a sixth of the keys read per step.
* A decode step refills at most `REFILL_LANES` slots (the first free ones, in slot order), with
  one gather of those lanes' prompts and one in-place scatter into the slot caches (mode="drop"
  for unused lanes): a fixed, small cost per step. Slots beyond that wait a step (only when more
  than `REFILL_LANES` responses end together while others are pending). The earlier design, a
  while loop of ceil(refills / lanes) trips, made the loop carry the slot caches through a
  nested loop: on CPU a decode step cost 1.4-1.7x the static sampler's on equal lengths even
  with zero trips, against 1.1x without it; a masked select over all slots under a `cond`
  rewrites S*P keys per refill step, tens of ms per step at real-model size.
* The response cache is [S, K, hd, R] / [S, K, R, hd] per layer (the static layout, one row per
  slot), split into `decode_segments` blocks of columns as the static sampler's; the new
  key/value of each slot is scattered into its own column of the block holding it, and a
  per-slot mask hides columns beyond the slot's position, so a refilled slot needs no zeroing:
  stale columns of the previous response are masked until overwritten. One while loop per block:
  the loop of block j runs while the busy slots' furthest position lies in block j and reads
  blocks 0..j only; the block loops sit inside an outer loop that starts over from the first
  block when refills have brought every busy slot below the current one. Slots sit at different
  positions, so this is coarser than for the static batch (the furthest slot sets the blocks all
  slots read); on equal lengths it reads what the static sampler reads (docs/performance.md).
* Bookkeeping per step is O(S) integer work on device: which slots ended, a cumsum that hands the
  free slots the next entries of a queue of pending responses, the per-slot gather of uniforms
  (u(t_s, r_s), hashed per slot) and a scatter of S tokens and log-probs into the [N, R] outputs. No host
  round trip: the loop's only condition is "any slot busy".
* With a mesh each batch shard (D of them) runs its own loop when D divides the prompts and the
  slots and the weights are not FSDP-sharded (`sampler.rollout_shards`; one `shard_map`): device
  d prefills its B / D prompts and decodes their responses, rows d N / D onwards of the result,
  with S / D slots; its prompt cache, queue and [N / D, R] outputs are its own, and no collective
  runs inside the loop. This is the static sampler's split of rows (a device decodes the rows it
  holds) with refilling inside each device; a device whose responses end first idles until the
  last device's end, as a static device does; with `num_groups` the wanted groups are spread
  over the devices, each device's first ones (`wanted_groups`). Otherwise one loop serves a
  shared queue: the slots are split over the batch axes (when S divides), the prompt cache and
  the [N, R] outputs are replicated (refills gather any prompt; writes go to any response), and
  every step gathers the slots' tokens and reduces the loop's condition over the devices. KV
  heads follow the `tensor` axis in both, as in the static sampler.

Idle slot-steps remain only at the end (fewer pending responses than slots) and for slots beyond
the responses left; `schedule` replays the slot assignment on the host from the response lengths
(decode steps and idle share), for benchmarks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from stare_jax import parallel
from stare_jax.models.decoder import Decoder, positions_from_mask, rope_table
from stare_jax.rollout import sampler
from stare_jax.rollout.decode import PromptCache, decode_step_rows, empty_response_cache, layer_params, prompt_cache
from stare_jax.rollout.sampler import RolloutResult, RolloutSpec, finish_tokens, token_floats
from stare_jax.rollout.sampling import choose_tokens, uniforms_at

REFILL_LANES = 8  # slots whose prompt keys/values one trip of the refill loop copies

trace_count = 0  # times `slot_rollout` has been traced (compiled)


def slot_rollout(graphdef, state, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
                 stop_lengths: jax.Array | None = None, num_groups: jax.Array | None = None, *,
                 spec: RolloutSpec, with_steps: bool = False):
    """Pure slot-refilling rollout of `nnx.merge(graphdef, state)` with `spec.slots` decode slots:
    the `RolloutResult` of `sampler.grouped_rollout` for the same arguments (rows group by group),
    and with `with_steps` also int32 [2]: the decode steps the loop ran, and how many of them read
    the slot groups' shared prompts (`aligned`); per device, the longest device loop's counts.
    Jit it with `graphdef`, `spec` and `with_steps` static.

    `num_groups` (int32 scalar, traced) generates only that many groups (`wanted_groups`: the first
    ones, or with a loop per device each device's first ones): the responses of the other groups
    never take a slot and come back empty (response mask 0, not truncated), so the loop ends as
    soon as the wanted groups are complete; the generated ones are those of a full rollout with the
    same key.

    With a mesh whose D batch shards divide both the B prompts and the slots (and do not split the
    weights), each device runs its own loop (`sampler.rollout_shards`): S / D slots over its own
    B / D prompts' responses, the rows it holds of the result."""
    global trace_count
    trace_count += 1
    B = prompt_ids.shape[0]
    shards = sampler.rollout_shards(spec.mesh, B, spec.group_size, spec.slots)
    wanted = None if num_groups is None else wanted_groups(num_groups, B, shards, xp=jnp)
    if shards > 1:
        return _device_loops(graphdef, state, prompt_ids, prompt_mask, rng, stop_lengths, wanted, spec=spec,
                             with_steps=with_steps)
    model: Decoder = nnx.merge(graphdef, state)
    result, steps = _slot_loop(model, prompt_ids, prompt_mask, rng, stop_lengths, wanted, spec=spec)
    return (result, steps) if with_steps else result


def wanted_groups(num_groups, prompts: int, shards: int = 1, xp=np):
    """bool [prompts]: the groups a rollout limited to `num_groups` groups generates (`xp` = np on
    the host, jnp for a traced count). One loop (`shards` 1): the first `num_groups`. A loop per
    batch shard (`sampler.rollout_shards`): shard d's first k_d of its prompts / shards groups,
    k_d = num_groups // shards, one more for the first num_groups % shards shards, so every device
    has work while any does."""
    group = xp.arange(prompts)
    if shards == 1:
        return group < num_groups
    block = prompts // shards
    shard = group // block
    return group % block < num_groups // shards + (shard < num_groups % shards)


def _device_loops(graphdef, state, prompt_ids, prompt_mask, rng, stop_lengths, wanted, *, spec: RolloutSpec,
                  with_steps: bool):
    """The slot rollout as one `jax.shard_map` over the mesh's batch axes: device d decodes the
    responses of its own B / D prompts (rows d N / D .. (d + 1) N / D - 1, whole groups) with S / D
    slots and writes only those rows, so the [N, R] outputs, the prompt cache and the refill queue
    are split D ways instead of replicated, and no collective runs inside the decode loop (each
    device's loop ends when its own responses have). Response r still takes uniforms u(t, r) of
    the global [R, N] array, so the responses are the single-device ones. The weights enter
    replicated over the batch axes (as they are: `sampler.rollout_shards` excludes FSDP); the
    `tensor` axis stays automatic. Idle slots: a device whose responses end first waits for the
    others."""
    B = prompt_ids.shape[0]
    shards, N = parallel.batch_divisor(spec.mesh), B * spec.group_size
    local_spec = dataclasses.replace(spec, mesh=None, slots=min(spec.slots, N) // shards)

    def loop(model, shard, rng, prompt_ids, prompt_mask, stop_lengths, wanted):
        result, steps = _slot_loop(model, prompt_ids, prompt_mask, rng, stop_lengths, wanted, spec=local_spec,
                                   offset=shard * (N // shards), total=N)
        return result, jax.lax.pmax(steps, parallel.BATCH_AXES)

    result, steps = sampler.shard_loops(graphdef, spec.mesh, loop, state, rng, prompt_ids, prompt_mask, stop_lengths,
                                        wanted)
    return (result, steps) if with_steps else result


def _slot_loop(model: Decoder, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
               stop_lengths: jax.Array | None, chosen: jax.Array | None, *, spec: RolloutSpec,
               offset=0, total: int | None = None) -> tuple[RolloutResult, jax.Array]:
    """The slot loop over the B prompts' responses (`slot_rollout`): (result, steps); `chosen` (bool
    [B], optional) limits it to those prompts' groups. Response r of these is response `offset` + r
    of a rollout of `total` responses (default B G) for its sampling uniforms, so a device's share
    of a larger rollout draws what the whole one would."""
    B, prompt_len = prompt_ids.shape
    G, R = spec.group_size, spec.max_new_tokens
    N = B * G
    S = min(spec.slots, N)
    lanes = min(S, REFILL_LANES)
    mesh = spec.mesh
    slot_rows = sampler._constraint(mesh, P(parallel.BATCH_AXES)) if mesh is not None and \
        S % parallel.batch_divisor(mesh) == 0 else (lambda x: x)
    replicated = sampler._constraint(mesh, P())
    kv = lambda rows_split: sampler._constraint(mesh, _kv_spec(model, mesh, rows_split))  # noqa: E731
    slot_kv = kv(mesh is not None and S % parallel.batch_divisor(mesh) == 0)

    # Prefill the B prompts once; choose every response's first token in one batched step.
    hidden, prefill = model.hidden_states(prompt_ids, positions_from_mask(prompt_mask), prompt_mask,
                                          cache=model.init_cache(B, prompt_len), cache_index=0)
    prompt = prompt_cache(prefill, prompt_mask)
    prompt = PromptCache([tuple(map(kv(False), layer)) for layer in prompt.layers], replicated(prompt.bias))
    prompt_lengths = prompt_mask.sum(axis=1)
    first_logits = jnp.repeat(model.logits(hidden[:, -1]), G, axis=0, total_repeat_length=N)
    uniforms = None if spec.sampling.greedy else uniforms_at(rng, (R, N if total is None else total))  # u(t, r), drawn as the static sampler draws
    stop = None if stop_lengths is None else replicated(stop_lengths.astype(jnp.int32))
    first = choose_tokens(first_logits, None if uniforms is None else
                          replicated(uniforms(jnp.zeros((N,), jnp.int32), offset + jnp.arange(N, dtype=jnp.int32))), spec.sampling)
    first, first_ends = finish_tokens(first, 0, stop, spec.eos_ids)
    first_floats = token_floats(spec, first_logits, first)  # log-probs (and entropy, Q with token_stats)
    wanted = jnp.ones((N,), bool) if chosen is None else jnp.repeat(chosen, G, total_repeat_length=N)
    single = first_ends | (R == 1) | ~wanted
    ids = replicated(jnp.full((N, R), spec.pad_id, jnp.int32).at[:, 0].set(jnp.where(wanted, first, spec.pad_id)))
    floats = tuple(replicated(jnp.zeros((N, R), jnp.float32).at[:, 0].set(jnp.where(wanted, v, 0.0)))
                   for v in first_floats)
    lengths = jnp.where(single & wanted, 1, 0).astype(jnp.int32)  # 0 while unfinished (and for unwanted groups)
    done = first_ends & wanted                                       # ended by EOS or stop length (not truncated)
    # Responses that need decode steps, in response order (padded with N).
    queue = jnp.nonzero(~single, size=N, fill_value=N)[0].astype(jnp.int32)
    pending = jnp.sum(~single).astype(jnp.int32)

    def assign(resp, t, token, plen, next_q, cap):
        """Hands the first `cap` free slots (resp == N) the next queued responses, in slot order."""
        free = resp >= N
        rank = jnp.cumsum(free)
        pos = next_q + rank - 1
        take = free & (pos < pending) & (rank <= cap)
        new = queue[jnp.clip(pos, 0, N - 1)]
        new_c = jnp.minimum(new, N - 1)
        resp = jnp.where(take, new, resp)
        t = jnp.where(take, 1, t)                        # token 0 is already chosen
        token = jnp.where(take, first[new_c], token)
        plen = jnp.where(take, prompt_lengths[new_c // G], plen)
        return (resp, t, token, plen, next_q + jnp.sum(take).astype(jnp.int32)), take, new_c // G

    def refills(take, source):
        """The (slot, prompt) pairs of this step's refills, `lanes` of them (unused lanes: slot S)."""
        dst = jnp.nonzero(take, size=lanes, fill_value=S)[0].astype(jnp.int32)
        return dst, source[jnp.minimum(dst, S - 1)].astype(jnp.int32)

    def copy_prompts(slot_prompt: PromptCache, dst, src):
        """Copies prompt src[l]'s keys/values into slot dst[l] (dst == S: a dropped write)."""
        layers = [(k.at[dst].set(pk[src], mode="drop"), v.at[dst].set(pv[src], mode="drop"))
                  for (k, v), (pk, pv) in zip(slot_prompt.layers, prompt.layers)]
        return PromptCache(layers, slot_prompt.bias.at[dst].set(prompt.bias[src], mode="drop"))

    def copy_group_prompts(group_prompt: PromptCache, dst, src):
        """Copies prompt src[l] into the shared prompt of slot group dst[l] / G where slot dst[l]
        leads its group (dst[l] % G == 0); other lanes are dropped writes."""
        lead = jnp.where(dst % G == 0, dst // G, S)
        return copy_prompts(group_prompt, lead, src)

    def aligned(c) -> jax.Array:
        """Whether every busy slot decodes a response of the prompt its group's leading slot holds
        (`held`: each slot's prompt, the refills still to be written included): then the G slots
        of a group can share its prompt's keys, as the static sampler's rows do."""
        resp, held = c[0][0], c[1][2]
        return jnp.all((resp >= N) | (held == held[(jnp.arange(S) // G) * G]))

    # Initial fill: slots take the first S queued responses (prompt keys gathered directly).
    idle = jnp.full((S,), N, jnp.int32)
    zeros, ones = jnp.zeros((S,), jnp.int32), jnp.ones((S,), jnp.int32)
    (resp, t, token, plen, next_q), _, source = assign(idle, ones, zeros, zeros, jnp.int32(0), S)
    slot_prompt = PromptCache([(slot_kv(pk[source]), slot_kv(pv[source])) for pk, pv in prompt.layers],
                              slot_rows(prompt.bias[source]))
    # Slot groups of G share their leading slot's prompt while `aligned` (see the design note).
    # With a mesh a group's row sits on the device of its slots when every device holds whole groups.
    share = G > 1 and S % G == 0
    group_prompt = None
    if share:
        lead = source[::G]
        split_groups = mesh is not None and S % (G * parallel.batch_divisor(mesh)) == 0
        group_kv, group_rows = kv(split_groups), (slot_rows if split_groups else replicated)
        group_prompt = PromptCache([(group_kv(pk[lead]), group_kv(pv[lead])) for pk, pv in prompt.layers],
                                   group_rows(prompt.bias[lead]))
    bounds = sampler.segment_bounds(R, spec.decode_segments)
    starts = tuple(a for a, _ in bounds)
    empty = [empty_response_cache(model, S, end - start) for start, end in bounds]   # [block][layer]
    blocks = [[tuple(map(slot_kv, block[i])) for block in empty] for i in range(model.config.num_layers)]
    layers = layer_params(model, spec.feature_major)
    rope = rope_table(model.config, prompt_len + R)

    def step(c, used: int, shared: bool):
        """One decode step of every slot (its response's columns in the first `used` blocks): feed
        its last token, choose the next one of its response, record it, end finished responses
        and refill their slots. `shared`: the slots attend to their group's shared prompt (only
        while `aligned`), else each to its own copy."""
        (resp, t, token, plen, next_q), (slot_prompt, group_prompt, held, dst, src), blocks, outputs, steps = c
        ids, floats, lengths, done = outputs
        # The previous step's refills, written first so that the update happens in place (a write
        # after this step's reads made XLA copy the slot caches every step).
        slot_prompt = copy_prompts(slot_prompt, dst, src)
        if share:
            group_prompt = copy_group_prompts(group_prompt, dst, src)
        busy = resp < N
        r = jnp.minimum(resp, N - 1)
        index = jnp.minimum(t, R - 1)                    # the token being chosen (t >= 1 when busy)
        # Feed token t-1 at cache column t-1 (idle slots compute on whatever they hold; unrecorded).
        logits, blocks = decode_step_rows(model, layers, group_prompt if shared else slot_prompt, blocks,
                                          starts[:used], token, plen + t - 1, jnp.clip(t - 1, 0, R - 1), rope=rope)
        new = choose_tokens(logits, None if uniforms is None else uniforms(index, offset + r), spec.sampling)
        new, ends = finish_tokens(new, index, None if stop is None else stop[r], spec.eos_ids)
        row = jnp.where(busy, resp, N)                   # N: dropped write
        ids = ids.at[row, index].set(new, mode="drop")
        floats = tuple(f.at[row, index].set(v, mode="drop") for f, v in zip(floats, token_floats(spec, logits, new)))
        ended = busy & (ends | (index + 1 >= R))
        lengths = lengths.at[jnp.where(ended, resp, N)].set(index + 1, mode="drop")
        done = done.at[jnp.where(busy & ends, resp, N)].set(True, mode="drop")
        slots, take, source = assign(jnp.where(ended, N, resp), t + 1, new, plen, next_q, lanes)
        dst, src = refills(take, source)
        held = held.at[dst].set(src, mode="drop")        # as the next step's copies will leave them
        return (slots, (slot_prompt, group_prompt, held, dst, src), blocks,
                (ids, floats, lengths, done), steps + jnp.array([1, int(shared)], jnp.int32))

    def furthest(c):
        """The furthest column a busy slot writes next (-1 when none is busy)."""
        resp, t = c[0][0], c[0][1]
        return jnp.max(jnp.where(resp < N, t - 1, -1))

    def in_block(c, j: int):
        """Loop j goes on while some slot is busy and the furthest lies in block j, or below it
        for the first loop (after refills every busy slot may be back at lower columns: the
        block loops then start over from the first, `sweep`)."""
        col = furthest(c)
        start, end = bounds[j]
        return (col >= 0) & (col < end) & ((col >= start) | (j == 0))

    def sweep(carry):
        """Runs the block loops in order: loop j reads blocks 0..j only."""
        for j in range(len(bounds)):
            used = j + 1
            rest = [layer[used:] for layer in carry[2]]
            inner = (*carry[:2], [layer[:used] for layer in carry[2]], *carry[3:])
            if share:  # shared prompts while aligned, then per-slot copies for the rest of the block
                inner = jax.lax.while_loop(lambda c, j=j: in_block(c, j) & aligned(c),
                                           lambda c, used=used: step(c, used, True), inner)
            inner = jax.lax.while_loop(lambda c, j=j: in_block(c, j), lambda c, used=used: step(c, used, False), inner)
            carry = (*inner[:2], [a + b for a, b in zip(inner[2], rest)], *inner[3:])
        return carry

    # One loop per block of columns, as the static sampler's `decode_segments`, inside a loop that
    # starts over from the first block whenever the busy slots' furthest column falls below the
    # current block (refills restart slots at column 0).
    no_refill = (jnp.full((lanes,), S, jnp.int32), jnp.zeros((lanes,), jnp.int32))
    carry = ((resp, t, token, plen, next_q), (slot_prompt, group_prompt, source) + no_refill, blocks,
             (ids, floats, lengths, done), jnp.zeros((2,), jnp.int32))
    carry = sweep(carry) if len(bounds) == 1 else jax.lax.while_loop(lambda c: furthest(c) >= 0, sweep, carry)
    _, _, _, (ids, (logps, *stats), lengths, done), steps = carry
    rows = sampler._constraint(mesh, P(parallel.BATCH_AXES))
    mask = (jnp.arange(R)[None, :] < lengths[:, None]).astype(jnp.int32)
    repeat = lambda x: jnp.repeat(x, G, axis=0, total_repeat_length=N)  # noqa: E731
    result = RolloutResult(tokens=rows(jnp.concatenate([repeat(prompt_ids), ids], axis=1)),
                           attention_mask=rows(jnp.concatenate([repeat(prompt_mask), mask], axis=1)),
                           response_ids=rows(ids), response_mask=rows(mask), log_probs=rows(logps),
                           truncated=rows(~done & wanted), prompt_len=prompt_len,
                           **{k: rows(v) for k, v in zip(("entropy", "pi2_dev"), stats)})
    return result, steps


def _kv_spec(model: Decoder, mesh, rows_split: bool) -> P:
    """Sharding of one layer's [rows, K, ., .] keys or values: rows over the batch axes when
    `rows_split`, KV heads over `tensor` where it divides them."""
    if mesh is None:
        return P()
    heads = "tensor" if model.config.num_kv_heads % mesh.shape["tensor"] == 0 else None
    return P(parallel.BATCH_AXES if rows_split else None, heads, None, None)


def schedule(lengths, slots: int, shards: int = 1) -> dict:
    """Replays the slot assignment of `slot_rollout` on the host from the response lengths (int
    [N], tokens per response incl. EOS): {"decode_steps", "slot_steps", "busy_slot_steps",
    "idle_share"} of the slot sampler with `slots` slots, and the same for the static sampler
    ("static_decode_steps", ...: N rows until the longest response ends). Token 0 of every
    response comes from the prefill, so a response of length L is busy for L - 1 decode steps.
    `shards` > 1 replays the per-device loops (`sampler.rollout_shards`): shard d runs slots /
    shards slots over its contiguous N / shards responses, the longest shard sets the decode steps,
    and a shard's slots idle while it waits for the others."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    s = min(int(slots), n)
    if shards > 1 and (n % shards or s % shards):
        raise ValueError(f"{shards} shards must divide the {n} responses and the {s} slots")
    work = lengths - 1
    steps = max((_loop_steps(part, s // shards) for part in np.split(work, shards)), default=0)
    busy = int(work.sum())
    static_steps = int(work.max()) if n else 0
    share = lambda total: 0.0 if total == 0 else 1.0 - busy / total  # noqa: E731
    return {"decode_steps": steps, "slot_steps": steps * s, "busy_slot_steps": busy,
            "idle_share": share(steps * s), "static_decode_steps": static_steps,
            "static_slot_steps": static_steps * n, "static_idle_share": share(static_steps * n)}


def _loop_steps(work: np.ndarray, s: int) -> int:
    """Decode steps of one slot loop with `s` slots over responses needing `work` steps each."""
    queue = [int(w) for w in work if w > 0]
    remaining = np.zeros(s, np.int64)                 # decode steps left per slot (0: free)
    fill = min(s, len(queue))
    remaining[:fill] = queue[:fill]
    q, steps = fill, 0
    lanes = min(s, REFILL_LANES)
    while (remaining > 0).any() or q < len(queue):
        steps += 1
        remaining = np.maximum(remaining - 1, 0)
        # the first `lanes` free slots take the next responses, in slot order
        for i in np.flatnonzero(remaining == 0)[:lanes]:
            if q < len(queue):
                remaining[i] = queue[q]
                q += 1
    return steps


__all__ = ["REFILL_LANES", "schedule", "slot_rollout", "wanted_groups"]
