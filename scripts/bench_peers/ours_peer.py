"""Bench worker for stare-jax: one full GRPO step per command through the trainer's own code path.

Rollout and reward are `stare_jax.trainer.collect_batch` (the jitted KV-cache sampler, then the
isolated reward pool), the update is `stare_jax.rl.make_update_step` (one jitted forward + backward +
AdamW with STARE weights inside), exactly as `stare_jax.train` runs them. The workload's `loss`
("stare" or "grpo") picks the loss registry entry; STARE runs the quickstart's adaptive C2 setting
(controller update included), the most expensive variant, with one selection fraction for L+ and L-
(P = 0.05; the quickstart's larger P- = 0.25 changes which tokens L- holds, not the selection's cost).

With `paired_grpo` in the workload the worker also keeps a second train state with the plain GRPO
loss and times its update on the same batch right after (every other step: right before) the
STARE update, reporting it as `grpo_update_s`: STARE's overhead without the noise between
processes. `paired_setting` (config overrides, e.g. {"model.vocab_chunk": 1024}) does the same for
a second update built with those overrides, reported as `paired_update_s`: two settings of the
update compared on the same batches, alternating in one process; each update arranges the batch
for its own micro-batches (`UpdateStep.arrange`), and the sampler records the entropy and Q that
either reads (`ppo.old_stats`). See common.py for the protocol.

The real-model workload (common.is_real) loads the pretrained directory with its own tokenizer,
left-pads the chat-templated prompts, stops each response at the model's EOS ids, scores with
`common.real_reward` and reports each response's length (`response_lens`) with the step, for the
driver's FLOPs and roofline; `slots` > 0 runs the slot-refilling sampler (rollout.slots) and
`pack_tokens` > 0 the update on packed responses (ppo.pack_tokens; the batch arranged and the
packed layout computed on the host, as the trainer does), reporting each step's capacity and the
XLA compilations it triggered. Each step also reports the STARE update's kernel CPU time and minor
page faults (`update_sys_s`, `update_minor_faults`) and whether oneTBB's cache was emptied before
the update because its program differs from the previous step's (`cache_emptied_at_switch`). Like
`python -m stare_jax.train`, the worker re-executes itself with oneTBB's malloc on a CPU host
(`stare_jax.allocator`; STARE_JAX_MALLOC=system in the driver's environment keeps glibc's, which maps
every execution's temporaries afresh) and reports which one served it (`malloc`).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common  # noqa: E402


def bench_config(workload: dict):
    """The stare-jax config of the workload: one generation of prompts x group, no dynamic sampling,
    no KL, one optimizer step per batch, compute in the workload's dtype (float32 by default)."""
    from stare_jax.config import default_config

    w = workload
    c = default_config()
    c.seed = w["seed"]
    c.model.path = w["checkpoint"]
    real = common.is_real(w)
    c.model.scan_layers = real  # unrolled layers: faster at the synthetic depths on CPU; scanned at 30 layers
    c.model.remat = real  # 64 x ~340 tokens x 30 layers of activations need rematerialisation (as TRL's checkpointing)
    c.model.remat_saves = w.get("remat_saves", "nothing")
    c.model.remat_saves_layers = w.get("remat_saves_layers", -1)
    c.mesh.cpu_devices = w.get("cpu_devices", 0)  # on CPU: one JAX device per core, rows split over them
    c.mesh.rollout_devices = w.get("rollout_devices", 0)  # 0: decode on the update's mesh
    c.data.prompt_batch_size = w["num_prompts"]
    c.data.max_prompt_len = w["prompt_len"]
    c.rollout.group_size = w["group_size"]
    c.rollout.max_new_tokens = w["new_tokens"]
    c.rollout.temperature = w["temperature"]
    c.dynamic_sampling.enabled = False
    c.reward.name = "common:real_reward" if real else "common:reward"
    c.rollout.slots = w.get("slots", 0)
    c.rollout.compact_min_rows = w.get("compact_min_rows", 0)
    c.ppo.pack_tokens = w.get("pack_tokens", 0)
    c.ppo.pack_buckets = w.get("pack_buckets", "linear")
    if w.get("vocab_chunk"):  # None: the config default
        c.model.vocab_chunk = w["vocab_chunk"]
    c.model.vocab_keep_logits_mb = w.get("keep_logits_mb", 0)  # 0: the backward recomputes the logits
    c.reward.num_workers = 1
    c.optim.lr = w["learning_rate"]
    c.model.dtype = w.get("dtype", "float32")  # compute dtype; parameters and optimizer state stay float32
    c.model.matmul_precision = w.get("matmul_precision", "default")  # float32 products (TF32 or not on a GPU)
    c.model.gpu_gemm = w.get("gpu_gemm", "auto")  # a GPU's kernels per phase (stare_jax.gpu_gemm)
    c.model.cpu_gemm = w.get("cpu_gemm", "auto")  # XLA:CPU's kernels for the update's products (stare_jax.cpu_gemm)
    c.loss.name = w["loss"]
    c.stare.enabled = w["loss"] == "stare"
    c.stare.variant, c.stare.adaptive, c.stare.top_p_ratio = "C2", True, 0.05
    return c


def with_overrides(config, overrides: dict):
    """`stare_jax.config.with_overrides`: a copy of `config` with the dotted-key `overrides` set."""
    from stare_jax.config import with_overrides as copy_with

    return copy_with(config, overrides)


def load_policy(workload: dict, config, mesh, *, load_tokenizer: bool = False):
    """The workload's checkpoint as the policy `config` asks for (compute dtype, rematerialisation and
    what it keeps, scanned layers: `trainer.policy_options`, as the trainer builds it), on `mesh`."""
    from stare_jax.models import from_pretrained
    from stare_jax.trainer import policy_options

    return from_pretrained(workload["checkpoint"], load_tokenizer=load_tokenizer, mesh=mesh, **policy_options(config))


def fixed_rollout(workload: dict, sampler, mesh):
    """A closure that decodes the synthetic workload's prompts x group with `sampler` on `mesh` (EOS
    off, the workload's seed as key, so every call gives the same responses) and blocks until done."""
    import jax
    import numpy as np

    from stare_jax.rollout import generate

    ids, _, _ = common.prompts(workload)
    key = jax.random.key(workload["seed"])

    def rollout():
        out = generate(sampler, ids, np.ones_like(ids), rng=key, group_size=workload["group_size"],
                       max_new_tokens=workload["new_tokens"], eos_ids=(), mesh=mesh)
        jax.block_until_ready(out.response_ids)
        return out

    return rollout


def update_batch(workload: dict, out, mesh) -> dict:
    """The update's batch from a rollout's output `out`, with seeded uniform rewards, sharded on `mesh`."""
    import numpy as np

    from stare_jax import parallel

    rewards = np.random.RandomState(workload["seed"]).rand(out.response_ids.shape[0]).astype(np.float32)
    return parallel.shard_batch({"input_ids": np.asarray(out.tokens), "attention_mask": np.asarray(out.attention_mask),
                                 "response_mask": np.asarray(out.response_mask),
                                 "old_log_probs": np.asarray(out.log_probs), "rewards": rewards}, mesh)


def real_prompts(workload: dict, tokenizer):
    """(prompt batch, EOS ids, pad id) of the real-model workload with the model's own tokenizer:
    the chat-templated prompts left-padded with the pad id (else the first EOS id) and their
    ground truths, as `collect_batch` takes them."""
    import numpy as np

    eos_ids = tuple(workload["eos_token_ids"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    ids, mask = common.real_prompt_ids(workload, tokenizer, pad_id)
    return ({"prompt_ids": ids, "prompt_mask": mask, "ground_truth": np.asarray(workload["ground_truths"])},
            eos_ids, pad_id)


def synthetic_prompts(workload: dict):
    """(prompt batch, tokenizer, EOS ids, pad id) of a synthetic workload, as `real_prompts` gives
    the real one's: the fixed random prompts (no padding) with their ground truths, the bench
    tokenizer, EOS off."""
    import numpy as np

    ids, _, truths = common.prompts(workload)
    return ({"prompt_ids": ids, "prompt_mask": np.ones_like(ids), "ground_truth": np.asarray(truths)},
            common.build_tokenizer(), (), common.PAD_ID)


_T_START = time.perf_counter()


def stage(what: str) -> None:
    """Prints `[stare-jax worker] WHAT at Ns` (seconds since the worker started) to stderr, which the
    driver passes through: a run cut off during the worker's start shows which stage it reached."""
    print(f"[stare-jax worker] {what} at {time.perf_counter() - _T_START:.1f}s", file=sys.stderr, flush=True)


def main() -> None:
    workload = common.workload_from_argv()
    from stare_jax import compilation, distributed, precision

    config = bench_config(workload)
    distributed.initialize(config)  # applies mesh.cpu_devices before the first JAX operation
    compilation.use_persistent_cache(config.compilation_cache_dir)  # $STARE_COMPILATION_CACHE_DIR if set
    with precision.matmul_precision(config.model.matmul_precision):  # every program this worker compiles
        serve(workload, config)


def serve(workload: dict, config) -> None:
    """Builds the policy, sampler and update step of `config` and answers the driver's commands."""
    import jax
    import numpy as np

    from stare_jax import allocator, parallel
    from stare_jax.compilation import CompilationCounter
    from stare_jax.rewards import RewardPool
    from stare_jax.rl import create_train_state, make_update_step
    from stare_jax.rl.policy_agreement import disagreement_bound, disagreement_line
    from stare_jax.trainer import collect_batch

    mesh = parallel.mesh_from_config(config.mesh)
    real = common.is_real(workload)
    policy = load_policy(workload, config, mesh, load_tokenizer=real)
    stage(f"policy loaded on {jax.devices()[0].device_kind}")
    if real:
        tokenizer = policy.tokenizer
        prompts, eos_ids, pad_id = real_prompts(workload, tokenizer)
    else:
        prompts, tokenizer, eos_ids, pad_id = synthetic_prompts(workload)

    def batches():
        while True:
            yield prompts

    data_iter = batches()
    train_state = create_train_state(policy.model, config, mesh=mesh)
    update = make_update_step(config, mesh, train_state)
    paired, paired_key = None, None
    if workload.get("paired_grpo") or workload.get("paired_setting"):
        # A second train state (its own copy of the weights: updates donate their buffers) and the
        # plain GRPO update step (or the update under the paired setting), timed on the same
        # batches in the same process.
        if workload.get("paired_grpo"):
            other, paired_key = bench_config(dict(workload, loss="grpo")), "grpo_update_s"
        else:
            other, paired_key = with_overrides(config, workload["paired_setting"]), "paired_update_s"
        other_state = create_train_state(load_policy(workload, other, mesh).model, other, mesh=mesh)
        paired = [other_state, make_update_step(other, mesh, other_state)]
    # the sampler records the entropy and Q an update in several micro-batches reads (`ppo.old_stats`)
    token_stats = update.settings.takes_sampler_stats or (paired is not None and paired[1].settings.takes_sampler_stats)
    base_key = jax.random.key(config.seed)
    step = 0

    kernel = {}  # the last timed update's kernel CPU time and minor page faults (getrusage deltas)

    def timed_update(state, step_fn, batch, key, packing):
        u0, t0 = common.rusage(), time.perf_counter()
        state, out = step_fn(state, batch, key, packing=packing)
        jax.block_until_ready(out)
        wall, used = time.perf_counter() - t0, common.usage_since(u0)
        kernel.update(update_sys_s=used["sys_s"], update_minor_faults=used["minor_faults"])
        return state, out, wall

    compilations = CompilationCounter()
    agreement_bound = disagreement_bound(config.model.dtype, config.model.matmul_precision,
                                         mesh.devices.flat[0].platform)

    def one_step() -> dict:
        nonlocal train_state, step
        compilations.take()
        common.reset_peak_rss()  # step_peak_rss_mb: this step's resident peak, not the process's
        key = jax.random.fold_in(base_key, step)
        t0 = time.perf_counter()
        batch, metrics = collect_batch(config, train_state.model, tokenizer, data_iter, pool,
                                       jax.random.fold_in(key, 0), eos_ids=eos_ids, pad_id=pad_id, mesh=mesh,
                                       token_stats=token_stats)
        t1 = time.perf_counter()
        host_batch = batch
        batch, packing = update.arrange(batch)  # as the trainer does: groups balanced, layout from host memory
        sharded = parallel.shard_batch(batch, mesh)
        if paired is not None:  # the paired update's own arrangement (its micro-batches may differ), untimed
            paired_batch, paired_packing = paired[1].arrange(host_batch)
            paired_sharded = parallel.shard_batch(paired_batch, mesh)
        switched = allocator.release_cache_on_switch(packing)  # as the trainer: one program's temporaries cached
        paired_first = paired is not None and step % 2 == 1  # alternate which update runs first
        if paired_first:
            paired[0], _, paired_s = timed_update(paired[0], paired[1], paired_sharded, jax.random.fold_in(key, 1),
                                                  paired_packing)
        train_state, out, update_s = timed_update(train_state, update, sharded, jax.random.fold_in(key, 1), packing)
        update_kernel = dict(kernel)
        if paired is not None and not paired_first:
            paired[0], _, paired_s = timed_update(paired[0], paired[1], paired_sharded, jax.random.fold_in(key, 1),
                                                  paired_packing)
        step += 1
        lens = batch["response_mask"].sum(axis=1).astype(int)
        tokens = int(lens.sum())
        n = workload["num_prompts"] * workload["group_size"]
        expected = n * workload["new_tokens"]
        if (tokens > expected or len(lens) != n or lens.min() < 1) if real else tokens != expected:
            raise RuntimeError(f"generated {tokens} tokens in {len(lens)} responses, expected "
                               f"{'at most ' if real else ''}{expected} in {n}")
        result = {"rollout_s": t1 - t0, "reward_s": metrics["reward_s"], "update_s": update_s,
                  "step_s": t1 - t0 + update_s, "tokens": tokens, "loss": float(out["loss"]),
                  "peak_rss_mb": common.peak_rss_mb(), "step_peak_rss_mb": common.window_peak_rss_mb(),
                  **update_kernel}
        if "sampler_approx_kl" in out:  # the update's forward against the sampler, as the trainer checks it
            result["sampler_approx_kl"] = float(out["sampler_approx_kl"])
            disagreement = disagreement_line(result, agreement_bound)
            if disagreement:  # this step's figures are those of a program that computes wrong values
                result["policy_disagreement"] = disagreement
        result["compilations"] = compilations.take()  # > 0 after warm-up: a new packed capacity (or shape)
        result["cache_emptied_at_switch"] = switched
        if packing is not None:
            result["packed_capacity"] = packing.capacity
        if real:
            result["response_lens"] = lens.tolist()
            result["reward_mean"] = float(np.mean(batch["rewards"])) if "rewards" in batch else None
        if paired is not None:
            result[paired_key] = paired_s
        return result

    def matmul_peak() -> float:
        """XLA's matmul peak in the run's dtype on this host now (GFLOP/s)."""
        return common.matmul_peak_gflops(lambda n: common.jax_matmul(n, config.model.dtype), common.accelerator_sizes())

    allocator.release_cache_on_compile()  # as the trainer: a new program's one-off blocks leave before it runs
    # The probes run first, so that the warm-up step's programs, compiling after them, leave their
    # one-off blocks behind (the trainer's steady state); probed after the warm-up, they needed the
    # cache emptied again, and the first timed step then faulted every temporary in afresh.
    bandwidth = common.jax_copy_bandwidth_gbs()
    peak = matmul_peak()
    stage("bandwidth and matmul peak measured")
    with RewardPool(config.reward.name, num_workers=config.reward.num_workers,
                    timeout_s=config.reward.timeout_s) as pool:
        first = one_step()  # compiles the sampler and the update step
        stage(f"first step done (rollout {first['rollout_s']:.1f}s, update {first['update_s']:.1f}s, "
              "compilations included)")
        common.send({"ready": True, "framework": "stare-jax", "loss": workload["loss"],
                     "malloc": allocator.name(),
                     "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
                     "dtype": config.model.dtype, "matmul_precision": config.model.matmul_precision, "slots": config.rollout.slots,
                     # weight replicas a decode step reads: the rollout mesh's batch shards
                     "replicas": parallel.batch_divisor(parallel.rollout_mesh(mesh, config.mesh.rollout_devices)),
                     "memory_bandwidth_gbs": bandwidth, "matmul_peak_gflops": peak})
        for cmd in common.commands():  # "peak": the matmul peak read again (after the timed rounds)
            if cmd.get("cmd") == "peak":
                common.send({"matmul_peak_gflops": matmul_peak()})
            else:
                common.send(one_step())


if __name__ == "__main__":
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # oneTBB's malloc on CPU, as `python -m stare_jax.train` runs
    main()
