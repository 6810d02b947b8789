"""Benchmark worker for google-tunix 0.1.7: one full GRPO step of `GRPOLearner` per "step" command.

    python scripts/bench_peers/tunix_peer.py '<workload json>'

Protocol, workload, tokenizer, prompts and reward come from `common.py`. How the workload maps to tunix:

- model: `tunix.models.qwen2.Qwen2` with a `ModelConfig` of the workload's shape (tied embeddings,
  q/k/v bias, rope theta 10000, rms eps 1e-6, float32 params and compute), loaded from the HF
  safetensors directory `workload["checkpoint"]` with tunix's own `create_model_from_safe_tensors`.
- mesh: one CPU device as a 1x1 ("fsdp", "tp") mesh shared by actor and rollout, so the vanilla
  sampler reads the trainer's weights in place (no weight sync, no rollout/train overlap).
- rollout: the default "vanilla" engine (`tunix.generate.Sampler`), `RolloutConfig` with
  `max_tokens_to_generate=new_tokens`, `max_prompt_length=prompt_len`, `kv_cache_size=prompt_len +
  new_tokens`, temperature from the workload, top_p 1, top_k None, seed = workload seed. EOS never
  stops generation: `eos_tokens=[vocab_size]` is an id the model cannot sample (every response is
  checked to have exactly new_tokens tokens). The bench tokenizer has no BOS (as Qwen2's); tunix's
  sampler would otherwise prepend one and pad the prompts to the next power of two.
- algorithm: `GRPOConfig(num_generations=group_size, num_iterations=1, beta=0.0)`: no reference
  model, no KL, no old-policy log-prob pass; optax.adamw(learning_rate). The batch sizes are left
  at tunix's defaults, which for a dataset batch of num_prompts prompts means one rollout of
  num_prompts x group_size sequences, one micro-batch and one optimizer update per step.
- data: each batch is the num_prompts fixed prompt texts (no chat template) as a numpy array plus
  their ground truths in the "answer" column, which tunix passes to the reward fn as a keyword.
- no checkpointing, no metrics logging backends, no eval.

Timing. `learner.train` runs once over a generator that blocks on the next stdin command before
yielding each batch; tunix asks for the next batch only after the previous step's update (and its
bookkeeping) has finished, so a step is timed from one yield to the next request, after waiting
for the actor's parameters to be ready. `rollout_s` is `_generate_and_compute_advantage`
(generation, decoding, reward, advantages; its outputs waited for), `reward_s` the reward fn's own
time, `update_s` the rest. Two untimed warm-up steps compile everything before "ready".
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen2 import model as qwen2_model  # noqa: E402
from tunix.models.qwen2 import params as qwen2_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

WARMUP_STEPS = 2


def finish_step(clock: common.StepClock, model: nnx.Module) -> dict:
    """Waits for the model's parameters (the step's update), then the clock's report of the step."""
    jax.block_until_ready(nnx.state(model, nnx.Param))
    return clock.report()


class CountingCluster(rl_cluster_lib.RLCluster):
    """RLCluster that records each response's length and checks that the sampler saw the workload's
    prompt ids unpadded and generated exactly `new_tokens` tokens per response."""

    def __init__(self, *, clock: common.StepClock, prompt_ids: np.ndarray, new_tokens: int, **kwargs):
        super().__init__(**kwargs)
        self._clock = clock
        self._prompt_ids = prompt_ids
        self._new_tokens = new_tokens

    def generate(self, *args, **kwargs) -> base_rollout.RolloutOutput:
        out = super().generate(*args, **kwargs)
        lengths = [len(t) for t in out.tokens]
        if any(n != self._new_tokens for n in lengths):
            raise RuntimeError(f"responses must have {self._new_tokens} tokens, got lengths {sorted(set(lengths))}")
        expected = np.repeat(self._prompt_ids, len(lengths) // len(self._prompt_ids), axis=0)
        if not np.array_equal(out.left_padded_prompt_tokens, expected):
            raise RuntimeError("the sampler's prompt tokens differ from the workload's prompt ids")
        self._clock.tokens += sum(lengths)
        return out


class TimedGRPOLearner(grpo_learner.GRPOLearner):
    """GRPOLearner whose rollout phase (generate, reward, advantages) is timed on `clock`."""

    def __init__(self, *, clock: common.StepClock, **kwargs):
        super().__init__(**kwargs)
        self._clock = clock

    def _generate_and_compute_advantage(self, training_input, mode=rl_cluster_lib.Mode.TRAIN):
        t0 = time.perf_counter()
        example = jax.block_until_ready(super()._generate_and_compute_advantage(training_input, mode))
        self._clock.rollout_s += time.perf_counter() - t0
        return example


def make_reward_fn(clock: common.StepClock):
    """A tunix reward fn scoring completions with `common.reward` against the "answer" column."""

    def reward_fn(prompts, completions, answer, **kwargs):
        return clock.score(completions, answer)

    return reward_fn


def load_model(workload: dict, mesh: jax.sharding.Mesh) -> qwen2_model.Qwen2:
    """Tunix's Qwen2 with the workload's shape, weights from the HF checkpoint directory."""
    w = workload
    config = qwen2_model.ModelConfig(
        num_layers=w["num_layers"], vocab_size=w["vocab_size"], embed_dim=w["hidden_size"],
        hidden_dim=w["intermediate_size"], num_heads=w["num_heads"], head_dim=w["hidden_size"] // w["num_heads"],
        num_kv_heads=w["num_kv_heads"], rope_theta=10000, norm_eps=1e-6,
        use_tied_embedding=w["tie_word_embeddings"], dtype=jnp.float32, param_dtype=jnp.float32)
    return qwen2_params.create_model_from_safe_tensors(w["checkpoint"], config, mesh, dtype=jnp.float32)


def build_learner(workload: dict, clock: common.StepClock) -> TimedGRPOLearner:
    """The RL cluster (actor = rollout model on one 1x1 mesh) and the GRPO learner."""
    w = workload
    n = int(w.get("tunix_devices", 1))
    mesh = jax.make_mesh((n, 1), ("fsdp", "tp"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokenizer = common.build_tokenizer()
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=w["new_tokens"], max_prompt_length=w["prompt_len"],
        kv_cache_size=w["prompt_len"] + w["new_tokens"], temperature=w["temperature"], top_p=1.0, top_k=None,
        seed=w["seed"], eos_tokens=[w["vocab_size"]])
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(w["learning_rate"]), eval_every_n_steps=1 << 30, max_steps=1 << 30)
    cluster = CountingCluster(
        clock=clock, prompt_ids=common.prompts(w)[0], new_tokens=w["new_tokens"], actor=load_model(w, mesh), tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training_config,
            rollout_config=rollout_config))
    algo_config = grpo_learner.GRPOConfig(num_generations=w["group_size"], num_iterations=1, beta=0.0)
    return TimedGRPOLearner(clock=clock, rl_cluster=cluster, algo_config=algo_config,
                            reward_fns=make_reward_fn(clock))


def batches(workload: dict, learner: TimedGRPOLearner, clock: common.StepClock):
    """Yields the prompt batch for the warm-up steps, then once per "step" command, reporting each
    timed step when tunix asks for the next batch (or when the commands end)."""
    _, texts, truths = common.prompts(workload)

    def batch() -> dict:
        return {"prompts": np.array(texts), "answer": np.array(truths)}

    model = learner.rl_cluster.actor_trainer.model
    for _ in range(WARMUP_STEPS):
        clock.begin()
        yield batch()
    finish_step(clock, model)
    common.send({"ready": True, "framework": "tunix", "weights": "checkpoint", "warmup_steps": WARMUP_STEPS,
                 "weight_sync": learner.should_sync_weights, "async_rollout": learner.can_enable_async_rollout,
                 "matmul_peak_gflops": common.matmul_peak_gflops(common.jax_matmul)})
    for _ in common.commands():
        clock.begin()
        yield batch()
        common.send(finish_step(clock, model))


def main() -> None:
    workload = common.workload_from_argv()
    if int(workload.get("tunix_devices", 1)) > 1:  # before JAX's backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={int(workload['tunix_devices'])}")
    clock = common.StepClock()
    learner = build_learner(workload, clock)
    learner.train(batches(workload, learner, clock))


if __name__ == "__main__":
    main()
