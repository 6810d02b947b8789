"""Grouped rollouts with a KV cache: `generate` (contract 7 of DESIGN.md).

One jitted pure function (`grouped_rollout`) does the whole rollout on device:

1. prefill: the B left-padded prompts run once through the decoder in one call, which fills
   the prompt part of the cache; only the last position's logits are projected to the vocabulary;
2. grouping: each prompt gets G response rows (rows i*G .. i*G+G-1 answer prompt i). The rows
   of a group share their prompt's keys/values (see `stare_jax.rollout.decode`); each row has
   its own preallocated response cache of R slots;
3. decode: `lax.while_loop`s sample one token per row per step, record it with its
   temperature-1 log-prob, and feed it back; they stop as soon as every row has produced an
   EOS, or after R tokens. The R response slots are split into `decode_segments` blocks with one
   loop each, and the loop of block j attends only to blocks 0..j: on average the steps read
   about (1 + 1/segments)/2 of the response cache instead of all of it (decode is bound by
   reading the cache once responses are long);
4. compaction (`compact_min_rows` > 0, `rollout.compact_min_rows`): the decode batch shrinks as
   responses end. The loops run in stages of N, N/2, N/4, ... rows (`decode_stages`); a stage's
   loops stop once at most the next stage's row count is live, and the live rows' response caches,
   last tokens and prompt lengths are gathered into that smaller batch, each row with its own copy
   of its prompt's keys/values (a group's rows no longer sit together). Outputs stay in response
   order: each stage writes its rows' tokens through an index of their responses. Every stage is
   its own set of loops in the compiled program (shapes stay static, nothing recompiles for new
   lengths); `compaction_schedule` replays on the host which stage ran how many steps.

The model enters as (graphdef, state): the graphdef and the `RolloutSpec` are static, the
parameters are ordinary arguments, so new parameter values after an optimizer step reuse the
compiled function; one compilation exists per (model structure, spec, prompt shape). The cache
is created inside the jitted function and updated in place by the loop; it never crosses the
function boundary, so there is no cache buffer to copy in, donate or copy out.

Randomness: one uniform number per row and step, drawn up front as an [R, N] array from `rng`
(see `sampling.choose_tokens`). With the default partitionable threefry the numbers depend only
on the key and the shape, not on the sharding, so a mesh gives the rollouts of one device.

`generate(..., slots=S)` runs the slot-refilling sampler of `stare_jax.rollout.slots` instead: S
decode rows that each take the next pending response when theirs ends. It draws the same
uniform for response r at token t, so it samples the same responses for the same key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stare_jax import gpu_gemm as gpu_gemm_lib, parallel
from stare_jax.models.decoder import Decoder, positions_from_mask, rope_table
from stare_jax.rollout.decode import PromptCache, decode_step, empty_response_cache, layer_params, prompt_cache
from stare_jax.rl.logprobs import naive_token_stats
from stare_jax.rollout.sampling import SamplingParams, choose_tokens, token_log_probs, uniforms_at


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "attention_mask", "response_ids", "response_mask", "log_probs",
                                "truncated", "entropy", "pi2_dev"],
                   meta_fields=["prompt_len"])
@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """G responses per prompt, rows ordered group by group (N = B*G, R = max_new_tokens).

    tokens         int32 [N, P+R]  prompt ids (as given, padding included) then response ids
    attention_mask int32 [N, P+R]  prompt mask then response mask
    response_ids   int32 [N, R]    sampled ids; the pad id after the first EOS
    response_mask  int32 [N, R]    1 up to and including the first EOS, 0 after
    log_probs      f32   [N, R]    log softmax(logits)[token] at temperature 1; 0 where masked
    truncated      bool  [N]       no EOS within R tokens
    prompt_len     int             P (static)
    entropy        f32   [N, R]    with `token_stats`: the entropy of softmax(logits) at temperature 1
                                   at each response position; 0 where masked (else None)
    pi2_dev        f32   [N, R]    with `token_stats`: Q = sum_j pi_j^2 (s_j - H) there (else None)
    """

    tokens: jax.Array
    attention_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    log_probs: jax.Array
    truncated: jax.Array
    prompt_len: int
    entropy: jax.Array | None = None
    pi2_dev: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """The static description of a rollout (hashable: one compilation per spec and shape).

    `mesh`, when set, splits the rows over its ("data", "fsdp") axes.
    """

    group_size: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    sampling: SamplingParams
    mesh: Mesh | None = None
    decode_segments: int = 1
    slots: int = 0  # 0: the grouped static sampler; S > 0: S refilled decode slots (`rollout.slots`)
    feature_major: bool = False  # decode layers feature-major (`decode` module docstring; the CPU default)
    compact_min_rows: int = 0  # static sampler: halve the decode batch down to this many rows (0: off)
    compiler_options: tuple = ()  # (name, value) XLA options of the jitted rollout (`model.gpu_gemm`)
    token_stats: bool = False  # also record each position's entropy and Q (`RolloutResult`; `ppo.old_stats`)


def auto_segments(max_new_tokens: int) -> int:
    """Default number of decode loops: one per 32 response slots, at most 4 (each loop is another
    copy of the decode step in the compiled program; measured on CPU, 4 loops make 128-token
    rollouts ~15% faster and leave 64-token ones unchanged)."""
    return max(1, min(4, max_new_tokens // 32))


def segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """Splits response slots [0, length) into at most `segments` consecutive blocks of equal size
    (the last may be shorter): [(start, end), ...]."""
    size = -(-length // max(1, min(segments, length)))
    return [(a, min(a + size, length)) for a in range(0, length, size)]


def generate(policy, prompt_ids, prompt_mask, *, rng: jax.Array | None, group_size: int, max_new_tokens: int,
             eos_ids=(), temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
             pad_id: int | None = None, mesh: Mesh | None = None,
             decode_segments: int | None = None, slots: int = 0, stop_lengths=None,
             num_groups: int | None = None, decode_layout: str = "auto", compact_min_rows: int = 0,
             gpu_gemm: str = "auto", token_stats: bool = False) -> RolloutResult:
    """Samples `group_size` responses of up to `max_new_tokens` tokens for each left-padded prompt.

    `policy` is a `stare_jax.models.Policy` or a bare `Decoder`; `prompt_ids`/`prompt_mask` are
    [B, P] with at least one real token per row. Sampling uses softmax(logits / temperature)
    restricted to the top-k tokens (0 = off) and the top-p nucleus (1.0 = off), or the argmax
    when `greedy`. A response ends at its first token in `eos_ids` (kept, masked 1) and is
    padded with `pad_id` (default: the model's pad id, else the first EOS id, else 0) after it.
    All randomness comes from `rng` (unused when greedy), so a key determines the rollout.
    `decode_segments` splits the decode loop (see `grouped_rollout`; default `auto_segments`); it
    changes speed, not results beyond floating-point rounding.

    With a mesh (`mesh=`, else `Policy.mesh`, else the one the parameters live on) the B*G rows
    are split over the ("data", "fsdp") axes, whose size must divide B*G. A slot rollout, or a
    static one whose rows can end early (EOS ids or `stop_lengths`), runs one loop per device where
    those shards divide the B prompts and the weights are not FSDP-sharded (`rollout_shards`): each
    device decodes the rows it holds until they are done, and no decode step moves rows or reduces
    their done flags across devices.

    `slots=S > 0` decodes with S slots that are refilled with the next pending response as soon
    as theirs ends (`stare_jax.rollout.slots`; at most B*G are used) instead of B*G rows in
    lockstep until the longest response ends: the same responses for the same key (randomness
    belongs to the response, not the slot), in the same layout; `decode_segments` splits its loop
    too (by the busy slots' furthest position, see `slots.slot_rollout`).
    `stop_lengths` (int [B*G], optional, traced: new values do not recompile) ends response r after
    at most `stop_lengths[r]` tokens as if by EOS: its last token is replaced by the first EOS id
    (when there is one) and it counts as finished, not truncated. Benchmarks and tests use it to
    set response lengths independently of the model.
    `num_groups` (slots only; traced) generates only that many prompts' groups, the rest come back
    empty (response mask 0): what dynamic sampling asks for when it needs only a few more groups.
    Which ones: `generated_groups` (the first ones, or each device's first ones where every batch
    shard runs its own slot loop, `slots.slot_rollout`).
    `decode_layout` (`rollout.decode_layout`): "features" runs the decode layers feature-major
    (`stare_jax.rollout.decode`), "rows" row-major, "auto" feature-major when the parameters live on
    CPU (where XLA's skinny matmuls are faster that way) and row-major elsewhere. The layouts
    differ in floating-point rounding only.
    `compact_min_rows` (`rollout.compact_min_rows`; static batch only, 0 = off): once at most half
    of the decode rows are live, the live ones move into a batch of half the rows (their keys and
    values gathered, their prompts' keys/values copied per row), and so on down to this many rows,
    so a batch whose responses mostly ended early stops paying for the finished rows. The same
    responses for the same key (the randomness belongs to the response); rounding may differ.
    `gpu_gemm` (`model.gpu_gemm`): which kernels a GPU runs the rollout's products with
    (`stare_jax.gpu_gemm`; "auto" keeps full-float32 products on Triton GEMMs without the
    autotuner's search); nothing off a GPU.
    `token_stats`: the result also holds each response position's entropy H and Q = sum_j pi_j^2
    (s_j - H) of the policy at temperature 1 (`rl.logprobs.naive_token_stats`), the pre-update
    statistics a multi-step update reads instead of recomputing them (`ppo.old_stats`); the tokens
    and log-probs are the same either way.
    """
    model = getattr(policy, "model", policy)
    if not isinstance(model, Decoder):
        raise TypeError(f"policy must be a Policy or a Decoder, got {type(policy).__name__}")
    graphdef, state = nnx.split(model)
    mesh = mesh or getattr(policy, "mesh", None) or _mesh_of(state)
    eos_ids = tuple(int(e) for e in (eos_ids if isinstance(eos_ids, (tuple, list)) else (eos_ids,)))
    if pad_id is None:
        pad_id = model.config.pad_token_id
        pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
    if np.ndim(prompt_ids) != 2 or np.shape(prompt_ids) != np.shape(prompt_mask) or np.shape(prompt_ids)[1] < 1:
        raise ValueError(f"prompt_ids and prompt_mask must both be [B, P] with P >= 1, got shapes "
                         f"{np.shape(prompt_ids)} and {np.shape(prompt_mask)}")
    rows = np.shape(prompt_ids)[0] * int(group_size)
    spec = rollout_spec(model.dtype, state, rows=rows, group_size=group_size,
                        max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, temperature=temperature,
                        top_p=top_p, top_k=top_k, greedy=greedy, mesh=mesh, decode_segments=decode_segments,
                        slots=slots, decode_layout=decode_layout, compact_min_rows=compact_min_rows,
                        gpu_gemm=gpu_gemm, token_stats=token_stats)
    if stop_lengths is not None and np.shape(stop_lengths) != (rows,):
        raise ValueError(f"stop_lengths must have one entry per response, shape ({rows},), got "
                         f"{np.shape(stop_lengths)}")
    if mesh is not None and rows % parallel.batch_divisor(mesh):
        raise ValueError(f"batch * group_size = {rows} rows is not divisible by the {parallel.batch_divisor(mesh)} "
                         f"batch shards of the mesh (data x fsdp of {dict(mesh.shape)})")
    if rng is None:
        if not greedy:
            raise ValueError("rng is required unless greedy=True")
        rng = jax.random.key(0)
    if num_groups is not None and not spec.slots:
        raise ValueError("num_groups needs the slot sampler (slots > 0): the static batch decodes every row")
    if num_groups is not None and not 0 <= int(num_groups) <= np.shape(prompt_ids)[0]:
        raise ValueError(f"num_groups must be in [0, {np.shape(prompt_ids)[0]}], got {num_groups}")
    inputs = (jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32), rng)
    if stop_lengths is not None or num_groups is not None:
        inputs = (*inputs, None if stop_lengths is None else jnp.asarray(stop_lengths, jnp.int32))
    if num_groups is not None:
        inputs = (*inputs, jnp.int32(num_groups))
    if mesh is not None:
        inputs = jax.device_put(inputs, parallel.replicated(mesh))
    return _compiled_rollout(graphdef, spec)(state, *inputs)


def generated_groups(num_groups: int, prompts: int, *, group_size: int, slots: int, mesh: Mesh | None) -> np.ndarray:
    """bool [prompts]: the groups `generate(..., slots=slots, num_groups=num_groups, mesh=mesh)`
    generates for `prompts` prompts of `group_size` responses (`slots.wanted_groups`: the first
    `num_groups`, or each batch shard's first ones when every shard runs its own loop)."""
    from stare_jax.rollout.slots import wanted_groups

    return wanted_groups(int(num_groups), prompts, rollout_shards(mesh, prompts, group_size, slots))


def rollout_spec(dtype, state, *, rows: int, group_size: int, max_new_tokens: int, eos_ids: tuple[int, ...],
                 pad_id: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 mesh: Mesh | None = None, decode_segments: int | None = None, slots: int = 0,
                 decode_layout: str = "auto", compact_min_rows: int = 0, gpu_gemm: str = "auto",
                 token_stats: bool = False) -> RolloutSpec:
    """The `RolloutSpec` that `generate` compiles for `rows` = prompts x `group_size` responses of a
    policy whose parameters are `state` (arrays or abstract values: they only name the platform) in
    compute `dtype`: the slot sampler with min(slots, rows) slots when `slots` > 0 (it refills rows
    instead of compacting them), else the static one compacting down to `compact_min_rows`; the
    decode layout, the GPU GEMM options and `token_stats` as `generate` documents. The dry run builds its sampler
    from the same function, so what it compiles is what a run would. Raises ValueError for counts
    out of range."""
    options = gpu_gemm_lib.compiler_options("rollout", gpu_gemm, platform=parallel.platform_of(state), dtype=dtype)
    spec = RolloutSpec(group_size=int(group_size), max_new_tokens=int(max_new_tokens), eos_ids=tuple(eos_ids),
                       pad_id=int(pad_id), sampling=SamplingParams(float(temperature), int(top_k), float(top_p),
                                                                   bool(greedy)), mesh=mesh,
                       decode_segments=int(auto_segments(max_new_tokens) if decode_segments is None
                                           else decode_segments),
                       feature_major=feature_major_decode(decode_layout, state),
                       compact_min_rows=_count(compact_min_rows, "compact_min_rows"),
                       compiler_options=tuple(sorted(options.items())), token_stats=bool(token_stats))
    if spec.group_size < 1 or spec.max_new_tokens < 1 or spec.decode_segments < 1:
        raise ValueError(f"group_size, max_new_tokens and decode_segments must be >= 1, got {group_size}, "
                         f"{max_new_tokens} and {spec.decode_segments}")
    if _count(slots, "slots"):
        spec = dataclasses.replace(spec, slots=min(int(slots), int(rows)), compact_min_rows=0)
    return spec


def describe(spec: RolloutSpec, prompts: int) -> str:
    """What `generate` runs for `prompts` prompts under `spec`, in words (the dry run's report line):
    the static batch (compacting down to `compact_min_rows` rows when set) or the slot sampler with
    its slots, whether each batch shard of the mesh runs its own loop (`rollout_shards`), and, on a
    mesh that splits the weights over `fsdp`, that every decode step gathers them."""
    shards = rollout_shards(spec.mesh, prompts, spec.group_size, spec.slots, early_stop=bool(spec.eos_ids))
    each = prompts // shards
    prompts_each = f"{each} prompt{'s' if each != 1 else ''} each"
    fsdp = 1 if spec.mesh is None else spec.mesh.shape["fsdp"]
    gathers = (f"; the weights split over fsdp={fsdp} are gathered in every decode step (mesh.rollout_devices "
               f"decodes on a copy gathered once per rollout)") if fsdp > 1 else ""
    if not spec.slots:
        compacting = f", compacting down to {spec.compact_min_rows} rows" if spec.compact_min_rows else ""
        loops = f", one loop per device ({prompts_each})" if shards > 1 else ""
        return f"grouped_rollout{compacting}{loops}: prefill + KV-cache decode{gathers}"
    loops = f", one loop per device ({spec.slots // shards} slots over {prompts_each})" if shards > 1 else ""
    return f"slot_rollout: {spec.slots} refilled decode slots{loops}{gathers}"


@functools.lru_cache(maxsize=64)
def _compiled_rollout(graphdef, spec: RolloutSpec, with_steps: bool = False):
    """The jitted rollout for one model structure and spec (jit caches per input shape):
    `grouped_rollout`, or `slots.slot_rollout` when `spec.slots`. `with_steps` makes it return
    (result, int32 [2]): the static sampler's decode steps and rows stepped, the slot sampler's
    decode steps and those of them on shared prompts."""
    out_shardings = None if spec.mesh is None else NamedSharding(spec.mesh, P(parallel.BATCH_AXES))
    if not spec.slots:
        if with_steps and out_shardings is not None:
            out_shardings = (out_shardings, parallel.replicated(spec.mesh))
        return jax.jit(functools.partial(grouped_rollout, graphdef, spec=spec, with_steps=with_steps),
                       out_shardings=out_shardings, compiler_options=dict(spec.compiler_options) or None)
    from stare_jax.rollout.slots import slot_rollout

    if with_steps and out_shardings is not None:
        out_shardings = (out_shardings, parallel.replicated(spec.mesh))
    return jax.jit(functools.partial(slot_rollout, graphdef, spec=spec, with_steps=with_steps),
                   out_shardings=out_shardings, compiler_options=dict(spec.compiler_options) or None)


trace_count = 0  # times `grouped_rollout` has been traced (compiled); tests check that calls reuse it


def grouped_rollout(graphdef, state, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
                    stop_lengths: jax.Array | None = None, *, spec: RolloutSpec, with_steps: bool = False):
    """Pure rollout of `nnx.merge(graphdef, state)`: prefill the [B, P] prompts once, then decode
    up to R tokens for each of the G rows per prompt (response r stops after at most
    `stop_lengths[r]` tokens, see `generate`). Jit it with `graphdef` and `spec` static.
    `with_steps`: returns (result, int32 [2]: decode steps, rows stepped summed over them), which
    `compaction_schedule` replays on the host.

    A rollout whose rows can end early (EOS ids or stop lengths) on a mesh of several batch shards
    that divide the prompts (and do not split the weights) runs one loop per device
    (`rollout_shards`): each device stops when its own rows are done and, compacting, compacts its
    own rows, so no decode step reduces or gathers anything across devices; the steps are then the
    longest device loop's and the rows stepped the devices' sum."""
    global trace_count
    trace_count += 1
    B = prompt_ids.shape[0]
    G, R = spec.group_size, spec.max_new_tokens
    N = B * G
    shards = rollout_shards(spec.mesh, B, G, early_stop=bool(spec.eos_ids) or stop_lengths is not None)
    if shards > 1:
        local_spec = dataclasses.replace(spec, mesh=None, compact_min_rows=-(-spec.compact_min_rows // shards))

        def loop(model, shard, rng, prompt_ids, prompt_mask, stop_lengths):
            n = N // shards
            uniforms = None
            if not spec.sampling.greedy:  # this device's columns of the [R, N] array
                t, r = jnp.meshgrid(jnp.arange(R, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32), indexing="ij")
                uniforms = uniforms_at(rng, (R, N))(t, shard * n + r)
            result, steps = _grouped_loop(model, prompt_ids, prompt_mask, uniforms, stop_lengths, spec=local_spec,
                                          with_steps=with_steps)
            if not with_steps:
                return result, jnp.zeros((2,), jnp.int32)
            return result, jnp.stack([jax.lax.pmax(steps[0], parallel.BATCH_AXES),
                                      jax.lax.psum(steps[1], parallel.BATCH_AXES)])

        result, steps = shard_loops(graphdef, spec.mesh, loop, state, rng, prompt_ids, prompt_mask, stop_lengths)
        return (result, steps) if with_steps else result
    model: Decoder = nnx.merge(graphdef, state)
    uniforms = None if spec.sampling.greedy else _constraint(spec.mesh, P(None, parallel.BATCH_AXES))(
        jax.random.uniform(rng, (R, N), jnp.float32))
    result, steps = _grouped_loop(model, prompt_ids, prompt_mask, uniforms, stop_lengths, spec=spec,
                                  with_steps=with_steps)
    return (result, steps) if with_steps else result


def shard_loops(graphdef, mesh: Mesh, loop, state, rng, *row_inputs):
    """Runs a rollout once per batch shard of `mesh`, in one `jax.shard_map` over its batch axes:
    `loop(model, shard, rng, *local row inputs)` -> (RolloutResult of the shard's rows, int32 [2]
    steps, already reduced over the shards), where `shard` is the device's index along the batch
    axes, the model is `graphdef` merged with the whole `state` (replicated over the batch axes,
    the `tensor` axis left to the compiler) and without its mesh (no sharding constraint may name
    the manual axes), and each of `row_inputs` (None: absent) is split along its leading axis.
    Returns the result with its rows split over the batch axes, and the steps."""
    rows = P(parallel.BATCH_AXES)

    def local(state, rng, *inputs):
        model: Decoder = nnx.merge(graphdef, state)
        model.mesh = None
        return loop(model, jax.lax.axis_index(parallel.BATCH_AXES), rng, *inputs)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *(None if x is None else rows for x in row_inputs)),
                         out_specs=(rows, P()), axis_names=set(parallel.BATCH_AXES),
                         check_vma=False)(state, rng, *row_inputs)


def rollout_shards(mesh: Mesh | None, prompts: int, group_size: int, slots: int = 0, early_stop: bool = False) -> int:
    """How many independent loops a rollout of `prompts` x `group_size` responses runs on `mesh`:
    one per batch shard (D = data x fsdp > 1) where D divides the prompts, the weights are not split
    over `fsdp` (each loop takes them whole; rollout meshes, `mesh.rollout_devices`, are purely
    data-parallel) and one program over the mesh would hold a collective in its loop: the slot
    sampler with a multiple of D slots (its queue moves rows, `slots.slot_rollout`), or the static
    one whose rows can end early (`early_stop`: EOS ids or stop lengths), whose loop condition would
    otherwise reduce the rows' done flags over the devices in every decode step and whose
    compaction (`compact_min_rows`, only then) would move rows; else 1, one program over the mesh
    (the static batch of a fixed trip count holds no collective in its loop)."""
    if mesh is None or mesh.shape["fsdp"] > 1:
        return 1
    shards = parallel.batch_divisor(mesh)
    if shards == 1 or prompts % shards:
        return 1
    if slots:
        return shards if min(slots, prompts * group_size) % shards == 0 else 1
    return shards if early_stop else 1


def _grouped_loop(model: Decoder, prompt_ids: jax.Array, prompt_mask: jax.Array, uniforms: jax.Array | None,
                  stop_lengths: jax.Array | None, *, spec: RolloutSpec, with_steps: bool
                  ) -> tuple[RolloutResult, jax.Array | None]:
    """The static sampler's prefill and decode loops (`grouped_rollout`) with the [R, N] sampling
    uniforms given (None: greedy): (result, int32 [2] decode steps and rows stepped when
    `with_steps`, else None)."""
    B, prompt_len = prompt_ids.shape
    G, R = spec.group_size, spec.max_new_tokens
    N = B * G
    rows = _constraint(spec.mesh, P(parallel.BATCH_AXES))
    kv_sharding = lambda n: _constraint(spec.mesh, _kv_spec(model, spec.mesh, n))
    repeat = lambda x: jnp.repeat(x, G, axis=0, total_repeat_length=N)

    hidden, prefill = model.hidden_states(prompt_ids, positions_from_mask(prompt_mask), prompt_mask,
                                          cache=model.init_cache(B, prompt_len), cache_index=0)
    prompt = prompt_cache(prefill, prompt_mask)
    prompt = prompt._replace(layers=[tuple(map(kv_sharding(B), kv)) for kv in prompt.layers])
    first_logits = rows(repeat(model.logits(hidden[:, -1])))
    prompt_mask = rows(repeat(prompt_mask))
    prompt_lengths = prompt_mask.sum(axis=1)
    stop_lengths = None if stop_lengths is None else rows(stop_lengths)
    layers = layer_params(model, spec.feature_major)
    rope = rope_table(model.config, prompt_len + R)  # built once, outside the decode loops

    outputs = (rows(jnp.zeros((N,), bool)), rows(jnp.full((N, R), spec.pad_id, jnp.int32)),
               rows(jnp.zeros((N, R), jnp.int32)),
               *(rows(jnp.zeros((N, R), jnp.float32)) for _ in range(1 + 2 * spec.token_stats)))
    whole = _Stage(None, prompt, prompt_lengths)
    outputs, token = _record(spec, uniforms, stop_lengths, whole, outputs, 0, first_logits)

    # Token t (t >= 1) is sampled after feeding token t-1 into response slot t-1. The slots are
    # split into blocks, one while loop per block: the loop of block j writes block j and attends
    # to blocks 0..j only, so early steps do not read the empty tail of the cache. With compaction
    # every stage has its loops over the blocks (`decode_stages`): a stage's loop also stops once
    # at most the next stage's row count is live, and the live rows move into the smaller batch.
    segments = segment_bounds(R, spec.decode_segments)
    blocks = [[tuple(map(kv_sharding(N), kv)) for kv in empty_response_cache(model, N, end - start)]
              for start, end in segments]                                     # [segment][layer] (k, v)
    early_stop = bool(spec.eos_ids) or stop_lengths is not None
    stages = decode_stages(N, spec.compact_min_rows if early_stop else 0,
                           1 if spec.mesh is None else parallel.batch_divisor(spec.mesh))
    # with_steps: [decode steps, rows stepped] ride in the loop carry; otherwise nothing is counted
    stage, t, steps = whole, jnp.int32(1), jnp.zeros((2,), jnp.int32) if with_steps else None
    for s, n in enumerate(stages):
        following = stages[s + 1] if s + 1 < len(stages) else 0
        for j, (start, end) in enumerate(segments):
            past = [[blocks[i][layer] for i in range(j)] for layer in range(len(layers))]

            def keep_going(c, end=end, following=following):
                t, _, _, (done, *_), _ = c
                go = (t < R) & (t <= end)
                if early_stop:  # nothing stops a row early otherwise: a fixed trip count
                    go = go & ~jnp.all(done)
                if following:  # a smaller batch holds every live row: compact
                    go = go & (N - done.sum(dtype=jnp.int32) > following)
                return go

            def step(c, start=start, past=past, stage=stage, n=n):
                """Feeds token t-1 (slot t-1 of the response, t-1-start of this block) and records token t."""
                t, block, token, outputs, steps = c
                logits, block = decode_step(model, layers, stage.prompt, block, token, stage.prompt_lengths + t - 1,
                                            t - 1 - start, past=past, rope=rope)
                outputs, token = _record(spec, uniforms, stop_lengths, stage, outputs, t, logits)
                return t + 1, block, token, outputs, None if steps is None else steps + jnp.array([1, n], jnp.int32)

            t, blocks[j], token, outputs, steps = jax.lax.while_loop(keep_going, step,
                                                                     (t, blocks[j], token, outputs, steps))
        if following:
            stage, keep = _compact(stage, outputs[0], following, N, G, prompt, prompt_lengths,
                                   kv_sharding(following))
            take = lambda x: rows(jnp.take(x, keep, axis=0, mode="clip"))  # noqa: E731
            token = take(token)
            blocks = [[tuple(kv_sharding(following)(jnp.take(a, keep, axis=0, mode="clip")) for a in kv)
                       for kv in segment] for segment in blocks]
    done, ids, mask, logps, *stats = outputs
    result = RolloutResult(tokens=jnp.concatenate([rows(repeat(prompt_ids)), ids], axis=1),
                           attention_mask=jnp.concatenate([prompt_mask, mask], axis=1),
                           response_ids=ids, response_mask=mask, log_probs=logps, truncated=~done,
                           prompt_len=prompt_len, **dict(zip(("entropy", "pi2_dev"), stats)))
    return result, steps


def decode_stages(rows: int, min_rows: int, divisor: int = 1) -> list[int]:
    """Decode batch sizes of a compacting static rollout of `rows` responses: rows, rows/2, ...
    while the half is whole, at least `min_rows` and divisible by `divisor` (the mesh's batch
    shards); [rows] when `min_rows` is 0 (compaction off)."""
    stages = [rows]
    while min_rows and stages[-1] % 2 == 0 and stages[-1] // 2 >= min_rows and (stages[-1] // 2) % divisor == 0:
        stages.append(stages[-1] // 2)
    return stages


def compaction_schedule(lengths, stages: list[int], shards: int = 1) -> dict:
    """Replays a (compacting) static rollout on the host from its response lengths (int [N],
    tokens per response incl. EOS; token 0 comes from the prefill, so a response of length L is
    live for decode steps 1 .. L-1): before step t the batch moves to the smallest of `stages`
    (`decode_stages`) that holds every live row. Returns {"decode_steps", "row_steps" (rows stepped,
    summed over the steps), "busy_row_steps", "idle_share", "stages": [[rows, steps], ...]}.
    `shards` > 1 replays the per-device loops (`rollout_shards`): shard d compacts its contiguous
    N / shards responses through stages / shards rows by itself; the longest shard sets
    "decode_steps", "row_steps" sums what the shards stepped, and "stages" lists each shard's."""
    lengths = np.asarray(lengths, np.int64)
    if shards > 1:
        if len(lengths) % shards or any(n % shards for n in stages):
            raise ValueError(f"{shards} shards must divide the {len(lengths)} responses and the stages {stages}")
        parts = [compaction_schedule(part, [n // shards for n in stages]) for part in np.split(lengths, shards)]
        row_steps, busy = sum(p["row_steps"] for p in parts), sum(p["busy_row_steps"] for p in parts)
        return {"decode_steps": max(p["decode_steps"] for p in parts), "row_steps": row_steps,
                "busy_row_steps": busy, "idle_share": 0.0 if row_steps == 0 else 1.0 - busy / row_steps,
                "stages": [p["stages"] for p in parts]}
    stage, row_steps, per_stage = 0, 0, [0] * len(stages)
    for t in range(1, int(lengths.max(initial=0))):
        live = int((lengths > t).sum())
        while stage + 1 < len(stages) and live <= stages[stage + 1]:
            stage += 1
        per_stage[stage] += 1
        row_steps += stages[stage]
    busy = int(np.maximum(lengths - 1, 0).sum())
    return {"decode_steps": sum(per_stage), "row_steps": row_steps, "busy_row_steps": busy,
            "idle_share": 0.0 if row_steps == 0 else 1.0 - busy / row_steps,
            "stages": [[n, k] for n, k in zip(stages, per_stage)]}


class _Stage(NamedTuple):
    """The rows a decode stage runs: `index` [n] their responses (None: all, in order; the
    out-of-range index N marks an empty row), with their prompts' keys/values (`PromptCache`, one
    per group at the first stage, one per row after a compaction) and prompt lengths [n]."""

    index: jax.Array | None
    prompt: PromptCache
    prompt_lengths: jax.Array


def _record(spec: RolloutSpec, uniforms, stop_lengths, stage: _Stage, outputs, t, logits):
    """Chooses token t of each of the stage's rows from `logits` [n, V] and writes it into the
    output buffers (done [N], ids, mask and the `token_floats` [N, R], response-major); returns
    (outputs, tokens)."""
    done, ids, mask, *floats = outputs
    index = stage.index
    pick = (lambda x: x) if index is None else (lambda x: jnp.take(x, index, axis=0, mode="clip"))  # noqa: E731
    token = choose_tokens(logits, None if uniforms is None else pick(uniforms[t]), spec.sampling)
    token, ends = finish_tokens(token, t, None if stop_lengths is None else pick(stop_lengths), spec.eos_ids)
    live = ~done if index is None else ~jnp.take(done, index, axis=0, mode="fill", fill_value=True)
    token = jnp.where(live, token, spec.pad_id)
    values = [jnp.where(live, v, 0.0) for v in token_floats(spec, logits, token)]
    if index is None:
        outputs = (done | (live & ends), ids.at[:, t].set(token), mask.at[:, t].set(live.astype(jnp.int32)),
                   *(f.at[:, t].set(v) for f, v in zip(floats, values)))
    else:  # empty rows (index N) are dropped; finished rows write what the static batch writes
        outputs = (done.at[index].set(~live | ends, mode="drop"), ids.at[index, t].set(token, mode="drop"),
                   mask.at[index, t].set(live.astype(jnp.int32), mode="drop"),
                   *(f.at[index, t].set(v, mode="drop") for f, v in zip(floats, values)))
    return outputs, token


def token_floats(spec: RolloutSpec, logits: jax.Array, token: jax.Array) -> tuple[jax.Array, ...]:
    """What a rollout records per row for the chosen `token` [n] from `logits` [n, V], float32 [n]
    each: its log-prob at temperature 1, and with `spec.token_stats` also the entropy and Q of the
    row's distribution at temperature 1 (`rl.logprobs.naive_token_stats` of the step's logits)."""
    logp = token_log_probs(logits, token)
    if not spec.token_stats:
        return (logp,)
    stats = naive_token_stats(logits, token)
    return logp, stats.entropy, stats.pi2_dev


def _compact(stage: _Stage, done: jax.Array, rows: int, N: int, G: int, prompt: PromptCache,
             prompt_lengths: jax.Array, kv_sharding) -> tuple[_Stage, jax.Array]:
    """The next stage's `rows` rows: the current stage's live rows in order, then empty ones, with
    per-row copies of their prompts' keys/values (placed by `kv_sharding`). Returns (the stage,
    positions [rows] of its rows in the current stage, to gather caches with)."""
    current = jnp.arange(N, dtype=jnp.int32) if stage.index is None else stage.index
    live = ~jnp.take(done, current, axis=0, mode="fill", fill_value=True)
    keep = jnp.nonzero(live, size=rows, fill_value=current.shape[0])[0].astype(jnp.int32)
    index = jnp.take(current, keep, axis=0, mode="fill", fill_value=N)
    group = jnp.minimum(index, N - 1) // G
    per_row = lambda x: jnp.take(x, group, axis=0)  # noqa: E731
    prompt = PromptCache([(kv_sharding(per_row(k)), kv_sharding(per_row(v))) for k, v in prompt.layers],
                         per_row(prompt.bias))
    return _Stage(index, prompt, jnp.take(prompt_lengths, jnp.minimum(index, N - 1), axis=0)), keep


def _count(value, name: str) -> int:
    """`value` as an int >= 0, else a ValueError naming `name`."""
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def finish_tokens(token: jax.Array, t, stop_lengths: jax.Array | None, eos_ids: tuple[int, ...]
                  ) -> tuple[jax.Array, jax.Array]:
    """(token, ends) for tokens chosen at index `t` of their responses: `ends` is true where the
    token is an EOS or the response reaches its stop length (t + 1 >= stop_lengths, per row),
    where the token becomes the first EOS id (if any). Shared by the static and slot samplers."""
    if stop_lengths is None:
        return token, _is_eos(token, eos_ids)
    forced = t + 1 >= stop_lengths
    if eos_ids:
        token = jnp.where(forced, eos_ids[0], token)
    return token, forced | _is_eos(token, eos_ids)


def _is_eos(token: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """True where `token` is one of `eos_ids` (never when there are none)."""
    hit = jnp.zeros(token.shape, bool)
    for e in eos_ids:
        hit = hit | (token == e)
    return hit


DECODE_LAYOUTS = ("auto", "rows", "features")


def feature_major_decode(decode_layout: str, state) -> bool:
    """Whether `decode_layout` (one of `DECODE_LAYOUTS`) decodes feature-major for parameters `state`."""
    if decode_layout not in DECODE_LAYOUTS:
        raise ValueError(f"decode_layout must be one of {DECODE_LAYOUTS}, got {decode_layout!r}")
    return decode_layout == "features" or (decode_layout == "auto" and parallel.platform_of(state) == "cpu")


def _mesh_of(state) -> Mesh | None:
    """The mesh the parameters are sharded on, if any."""
    for leaf in jax.tree_util.tree_leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def _kv_spec(model: Decoder, mesh: Mesh | None, rows: int) -> P:
    """Sharding of one layer's keys or values [rows, K, S, hd]: rows over the batch axes and KV
    heads over `tensor`, each where the mesh divides them."""
    if mesh is None:
        return P()
    batch = parallel.BATCH_AXES if rows % parallel.batch_divisor(mesh) == 0 else None
    heads = "tensor" if model.config.num_kv_heads % mesh.shape["tensor"] == 0 else None
    return P(batch, heads, None, None)


def _constraint(mesh: Mesh | None, spec: P):
    """x -> x constrained to `spec` on `mesh` (the identity without a mesh)."""
    if mesh is None:
        return lambda x: x
    sharding = NamedSharding(mesh, spec)
    return lambda x: jax.lax.with_sharding_constraint(x, sharding)


__all__ = ["RolloutResult", "RolloutSpec", "compaction_schedule", "decode_stages", "describe", "finish_tokens",
           "generate", "generated_groups", "grouped_rollout", "rollout_shards", "rollout_spec", "shard_loops"]
