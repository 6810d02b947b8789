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
  new_tokens`, temperature from the workload, top_p 1, top_k None, seed = workload seed + the index of the generation (a new sampling key every step, as the
  other participants draw; the seed is an argument of the compiled sampler, so nothing recompiles). EOS never
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

The real-model workload (`common.is_real`: a pretrained Llama checkpoint such as SmolLM2-135M-Instruct,
its own tokenizer, EOS enabled, up to new_tokens per response, `common.real_reward`) maps as follows;
mesh, algorithm, optimizer, batch sizes and timing are the synthetic path's:

- model: `tunix.models.llama3.model.Llama3` with a `ModelConfig` read from the checkpoint's
  config.json (num_hidden_layers, vocab_size, hidden_size, intermediate_size, attention / KV heads,
  head_dim, rope_theta, rms_norm_eps, tie_word_embeddings -> weight_tying), float32 as stored, loaded
  with `tunix.models.llama3.params.create_model_from_safe_tensors`. Checkpoints this class cannot
  express (not LlamaForCausalLM, rope scaling, attention / MLP biases, an activation other than silu)
  end the worker with one line on stderr naming the missing feature. tunix 0.1.7's llama3
  `Attention.block` calls `apply_rope` without `rope_theta`, so every llama3 model runs at the
  function's default theta 1e6 whatever its config says; the worker binds the module's `apply_rope`
  to the checkpoint's theta (SmolLM2: 1e5) so that tunix runs the checkpoint's model (same cost).
- tokenizer: `transformers.AutoTokenizer.from_pretrained(checkpoint)` behind `PromptTokenizer`, the
  encode / decode / bos_id / eos_id / pad_id object tunix's `TokenizerAdapter` accepts: encode adds
  no special tokens (the chat template has them) and bos_id is None, so the sampler prepends nothing;
  decode skips special tokens (as TRL's). Tunix takes its attention masks from `ids != pad_id`, in the
  prompt as in the completion, so the pad id must not occur inside a prompt: it is the tokenizer's
  pad id, else the first EOS id, else the first other special token absent from all prompts
  (SmolLM2: pad = EOS = <|im_end|>, which ends every chat turn inside the prompts, so tunix pads
  with <|endoftext|>, id 0). The padded prompts differ from the workload's contract only in that
  value; a response sampling the pad id mid-sequence (rare) has that token masked, as in any tunix run.
- rollout: `max_prompt_length=prompt_len` (the longest prompt, so no power-of-two padding),
  `max_tokens_to_generate=new_tokens`, `kv_cache_size=prompt_len + new_tokens`,
  `eos_tokens=eos_token_ids`: a response ends at its first EOS (the sampler's loop ends once every
  row has one), and tunix's completion is the tokens before the EOS, which it neither returns nor
  trains on. So `tokens` counts those completion tokens (EOS excluded); the step report adds
  `response_lens` (each response's completion length) and `eos_stops` (responses ended by an EOS:
  `tokens + eos_stops` are the tokens the sampler produced). Checked on every rollout: num_prompts x
  group_size rows, each prompt's ids as the workload's (left-padded to prompt_len), every completion
  0..new_tokens tokens (0: EOS first).
- data: the workload's chat-templated `prompt_texts`, `ground_truths` in the "answer" column.

Timing. `learner.train` runs once over a generator that blocks on the next stdin command before
yielding each batch; tunix asks for the next batch only after the previous step's update (and its
bookkeeping) has finished, so a step is timed from one yield to the next request, after waiting
for the actor's parameters to be ready. `rollout_s` is `_generate_and_compute_advantage`
(generation, decoding, reward, advantages; its outputs waited for), `reward_s` the reward fn's own
time, `update_s` the rest. Two untimed warm-up steps compile everything before "ready".
"""

from __future__ import annotations

import dataclasses
import functools
import json
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
from tunix.models.llama3 import model as llama3_model  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.models.qwen2 import model as qwen2_model  # noqa: E402
from tunix.models.qwen2 import params as qwen2_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

WARMUP_STEPS = 2

_APPLY_ROPE = llama3_model.apply_rope  # tunix's own, before `use_rope_theta` binds a theta to it


class UnsupportedModel(Exception):
    """The checkpoint needs something tunix's model or loader does not have (the message says what)."""


def finish_step(clock: common.StepClock, model: nnx.Module, cluster: "CountingCluster") -> dict:
    """Waits for the model's parameters (the step's update), then the clock's report of the step
    (on the real-model workload with each response's length and the number of EOS stops)."""
    jax.block_until_ready(nnx.state(model, nnx.Param))
    report = clock.report()
    if cluster.real:
        report.update(response_lens=list(cluster.lengths),
                      eos_stops=sum(n < cluster.new_tokens for n in cluster.lengths))
    return report


class CountingCluster(rl_cluster_lib.RLCluster):
    """RLCluster that records each response's length and checks each rollout: the sampler saw the
    workload's prompt ids (`prompt_ids`, left-padded) and generated exactly `new_tokens` tokens per
    response, or with `real` (EOS enabled) 0..new_tokens tokens in num_prompts x group_size rows."""

    def __init__(self, *, clock: common.StepClock, prompt_ids: np.ndarray, new_tokens: int, real: bool = False,
                 rows: int = 0, **kwargs):
        super().__init__(**kwargs)
        self._clock = clock
        self._prompt_ids = prompt_ids
        self.new_tokens = new_tokens
        self.real = real
        self._rows = rows
        self.lengths: list[int] = []  # this step's response lengths (cleared when a step begins)
        self._generations = 0

    def generate(self, *args, **kwargs) -> base_rollout.RolloutOutput:
        """tunix's generate with a new sampling seed per call (the workload's seed + the call's index,
        as the other participants draw new keys every step), then the checks; adds the completion
        tokens to the clock."""
        rollout = self.rollout
        if not getattr(rollout, "_reseeded", False):  # once: wrap the rollout's own generate
            generate = rollout.generate

            def reseeded(prompts, rollout_config, *a, **kw):
                return generate(prompts, dataclasses.replace(rollout_config, seed=rollout_config.seed + self._generations),
                                *a, **kw)
            rollout.generate, rollout._reseeded = reseeded, True
        out = super().generate(*args, **kwargs)
        self._generations += 1
        lengths = [len(t) for t in out.tokens]
        if self.real:
            if len(lengths) != self._rows or max(lengths) > self.new_tokens:
                raise RuntimeError(f"rollout must be {self._rows} responses of 0..{self.new_tokens} tokens, got "
                                   f"{len(lengths)} of lengths {lengths}")
        elif any(n != self.new_tokens for n in lengths):
            raise RuntimeError(f"responses must have {self.new_tokens} tokens, got lengths {sorted(set(lengths))}")
        expected = np.repeat(self._prompt_ids, len(lengths) // len(self._prompt_ids), axis=0)
        if not np.array_equal(out.left_padded_prompt_tokens, expected):
            raise RuntimeError("the sampler's prompt tokens differ from the workload's prompt ids")
        self._clock.tokens += sum(lengths)
        self.lengths += lengths
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


class PromptTokenizer:
    """The checkpoint's Hugging Face tokenizer as the encode / decode / bos_id / eos_id / pad_id object
    tunix's `TokenizerAdapter` accepts: no special tokens added and no BOS (the chat-templated texts
    carry theirs), `eos_ids[0]` as tunix's eos id, `pad_id` as its pad id."""

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int):
        self._tokenizer = tokenizer
        self._eos_ids = list(eos_ids)
        self._pad_id = pad_id

    def encode(self, text: str, **kwargs) -> list[int]:
        """The text's ids, without added special tokens."""
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids, **kwargs) -> str:
        """The ids' text, special tokens skipped."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def bos_id(self) -> None:
        """None: tunix's sampler then prepends no BOS."""
        return None

    def eos_id(self) -> int:
        """The workload's first EOS id (the rollout stops at all of them)."""
        return self._eos_ids[0]

    def pad_id(self) -> int:
        """The pad id tunix pads and masks with (absent from every prompt)."""
        return self._pad_id


def pick_pad_id(tokenizer, eos_ids: list[int], rows: list[list[int]]) -> int:
    """The tokenizer's pad id, else the first EOS id, else the first other special token id, taking
    the first of them that occurs in no prompt row (tunix masks every position holding the pad id)."""
    used = {i for row in rows for i in row}
    candidates = [tokenizer.pad_token_id, *eos_ids, *tokenizer.all_special_ids]
    for c in candidates:
        if c is not None and int(c) not in used:
            return int(c)
    raise UnsupportedModel(f"tunix.generate.Sampler masks prompt positions by `ids != pad_id`, and every candidate "
                           f"pad id {candidates} occurs inside the prompts")


def use_rope_theta(theta: float) -> None:
    """Makes tunix's llama3 attention apply RoPE with `theta` (0.1.7 drops ModelConfig.rope_theta)."""
    llama3_model.apply_rope = functools.partial(_APPLY_ROPE, rope_theta=theta)


def llama_config(checkpoint: str) -> llama3_model.ModelConfig:
    """Tunix's llama3 `ModelConfig` from the checkpoint's config.json; raises UnsupportedModel for
    what `tunix.models.llama3.model.Llama3` cannot express."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        c = json.load(f)
    where = "tunix.models.llama3.model.Llama3 (google-tunix 0.1.7)"
    archs = c.get("architectures") or [c.get("model_type")]
    if archs[0] != "LlamaForCausalLM":
        raise UnsupportedModel(f"{where} is the llama3 architecture only; the checkpoint is {archs[0]}")
    if c.get("rope_scaling") or (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise UnsupportedModel(f"{where} has no RoPE scaling; the checkpoint asks for "
                               f"{c.get('rope_scaling') or c.get('rope_parameters')}")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise UnsupportedModel(f"{where} has no attention / MLP biases; the checkpoint has them")
    if c.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{where} has only a SiLU MLP; the checkpoint's activation is {c['hidden_act']}")
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))
    return llama3_model.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]), rope_theta=theta,
        norm_eps=c["rms_norm_eps"], weight_tying=bool(c.get("tie_word_embeddings", False)))


def make_reward_fn(clock: common.StepClock):
    """A tunix reward fn scoring completions with the clock's reward (`common.reward` or
    `common.real_reward`) against the "answer" column."""

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


def load_llama(workload: dict, mesh: jax.sharding.Mesh) -> llama3_model.Llama3:
    """Tunix's Llama3 configured from the checkpoint's config.json, float32 weights from its safetensors."""
    config = llama_config(workload["checkpoint"])
    use_rope_theta(config.rope_theta)
    return llama3_params.create_model_from_safe_tensors(workload["checkpoint"], config, mesh, dtype=jnp.float32)


def build_learner(workload: dict, clock: common.StepClock) -> TimedGRPOLearner:
    """The RL cluster (actor = rollout model on one 1x1 mesh) and the GRPO learner."""
    w = workload
    real = common.is_real(w)
    n = int(w.get("tunix_devices", 1))
    mesh = jax.make_mesh((n, 1), ("fsdp", "tp"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    if real:
        from transformers import AutoTokenizer

        actor = load_llama(w, mesh)  # first: raises UnsupportedModel before anything else is loaded
        hf_tokenizer = AutoTokenizer.from_pretrained(w["checkpoint"])
        eos_ids = [int(i) for i in w["eos_token_ids"]]
        pad_id = pick_pad_id(hf_tokenizer, eos_ids,
                             [hf_tokenizer(t, add_special_tokens=False)["input_ids"] for t in w["prompt_texts"]])
        tokenizer = PromptTokenizer(hf_tokenizer, eos_ids, pad_id)
        prompt_ids = common.real_prompt_ids(w, hf_tokenizer, pad_id)[0]
    else:
        tokenizer = common.build_tokenizer()
        eos_ids = [w["vocab_size"]]
        prompt_ids = common.prompts(w)[0]
        actor = load_model(w, mesh)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=w["new_tokens"], max_prompt_length=w["prompt_len"],
        kv_cache_size=w["prompt_len"] + w["new_tokens"], temperature=w["temperature"], top_p=1.0, top_k=None,
        seed=w["seed"], eos_tokens=eos_ids)
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(w["learning_rate"]), eval_every_n_steps=1 << 30, max_steps=1 << 30)
    cluster = CountingCluster(
        clock=clock, prompt_ids=prompt_ids, new_tokens=w["new_tokens"], real=real,
        rows=w["num_prompts"] * w["group_size"], actor=actor, tokenizer=tokenizer,
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
    real = common.is_real(workload)
    if real:
        texts, truths = workload["prompt_texts"], workload["ground_truths"]
    else:
        _, texts, truths = common.prompts(workload)

    def batch() -> dict:
        return {"prompts": np.array(texts), "answer": np.array(truths)}

    cluster = learner.rl_cluster
    model = cluster.actor_trainer.model
    for _ in range(WARMUP_STEPS):
        clock.begin()
        cluster.lengths.clear()
        yield batch()
    finish_step(clock, model, cluster)
    ready = {"ready": True, "framework": "tunix", "weights": "checkpoint", "warmup_steps": WARMUP_STEPS,
             "weight_sync": learner.should_sync_weights, "async_rollout": learner.can_enable_async_rollout,
             "matmul_peak_gflops": common.matmul_peak_gflops(common.jax_matmul)}
    if real:
        tok = cluster.rollout.pad_id(), cluster.rollout.eos_id()
        ready.update(model="tunix.models.llama3", pad_id=tok[0], eos_id=tok[1],
                     rope_theta=float(model.config.rope_theta))
    common.send(ready)
    for _ in common.commands():
        clock.begin()
        cluster.lengths.clear()
        yield batch()
        common.send(finish_step(clock, model, cluster))


def main() -> None:
    """Builds the learner from the workload in argv and serves the driver's commands."""
    workload = common.workload_from_argv()
    if int(workload.get("tunix_devices", 1)) > 1:  # before JAX's backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={int(workload['tunix_devices'])}")
    if workload.get("matmul_precision", "default") != "default":  # as stare-jax's model.matmul_precision
        jax.config.update("jax_default_matmul_precision", workload["matmul_precision"])
    clock = common.StepClock(reward_fn=common.real_reward if common.is_real(workload) else common.reward)
    try:
        learner = build_learner(workload, clock)
    except UnsupportedModel as e:
        print(f"tunix_peer: cannot run the checkpoint: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    learner.train(batches(workload, learner, clock))


if __name__ == "__main__":
    main()
