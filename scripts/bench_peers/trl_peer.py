"""Benchmark worker for Hugging Face TRL: one full `GRPOTrainer` step (rollout, reward, one optimizer
update) per `{"cmd": "step"}` on stdin, timed and reported with the protocol of `common.py`.

Run by `scripts/bench_step.py` in the peers' environment (requirements-bench.txt):

    python scripts/bench_peers/trl_peer.py '<workload json>'

How the workload maps onto TRL (trl 1.16, transformers generation, PyTorch on CPU, float32):

- model: `workload["checkpoint"]` loaded with `AutoModelForCausalLM` in float32; the tokenizer is
  `common.build_tokenizer()` (word level, so each prompt text is exactly `prompt_len` ids).
- data: the `num_prompts` plain-text prompts of `common.prompts` with a `ground_truth` column, repeated
  so that an epoch lasts many steps; `shuffle_dataset=False` makes every generation batch exactly those
  prompts, each sampled `num_generations=group_size` times.
- one trainer step = one generation of `num_prompts * group_size` sequences = one optimizer update:
  `per_device_train_batch_size` is the whole batch, `gradient_accumulation_steps=steps_per_generation=
  num_iterations=1`.
- every response has exactly `new_tokens` tokens: `max_completion_length=new_tokens` and
  `min_new_tokens=new_tokens` (EOS, which TRL always adds to the stop ids, is never sampled).
  The rollout wrapper checks the prompt and completion masks on every step.
- loss: TRL's default (`loss_type="dapo"`, clip 0.2), `beta=0` (no reference model). Being fully
  on-policy, TRL skips the old-log-prob forward pass (the ratio is exp(logp - logp.detach())).
- optimizer: transformers' default AdamW (`adamw_torch_fused` on torch >= 2.8) at a constant
  `learning_rate`, with our optimizer's weight decay 0.01 and gradient clip 1.0.

The real-model workload (common.is_real): the pretrained directory's model and its own tokenizer,
the chat-templated prompt texts, no `min_new_tokens` (EOS ends each response where the model puts
it, up to `new_tokens`), `common.real_reward`; the rollout check then asks for 1..new_tokens
completion tokens per row and reports each row's length.

Timing: `trainer.train()` runs with an effectively unbounded `max_steps`; a callback blocks in
`on_step_end` (after the optimizer step) until the next command arrives. The first step is an untimed
warm-up, after which the worker prints ready. `rollout_s` is the time in TRL's
`_generate_and_score_completions` (generation, decoding, reward, advantages), `reward_s` the time in
the reward function, `update_s` the rest of the step (loss forward/backward, clipping, AdamW, the
trainer's bookkeeping and fetching the next batch).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / trl: nothing may come from the hub

import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, PrinterCallback, ProgressCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

# Repeats of the prompt set in the dataset: one epoch is this many steps (the trainer starts a new epoch
# after it, which costs next to nothing).
DATASET_REPEATS = 1000
MAX_STEPS = 10**9


def grpo_config(workload: dict, output_dir: str) -> GRPOConfig:
    """The TRL options that reproduce the workload (see the module docstring)."""
    w = workload
    batch = w["num_prompts"] * w["group_size"]
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=w.get("dtype", "float32") == "bfloat16",  # TRL's default is bf16 autocast; float32 unless asked
        gradient_checkpointing=common.is_real(w),  # TRL defaults to on; on for the real model, as stare-jax's remat
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=w["group_size"],
        num_iterations=1,
        shuffle_dataset=False,             # every step sees exactly the workload's prompts
        max_completion_length=w["new_tokens"],
        generation_kwargs=None if common.is_real(w) else {"min_new_tokens": w["new_tokens"]},
        temperature=w["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=w["learning_rate"],
        lr_scheduler_type="constant",      # default "linear" would decay towards 0 over max_steps
        warmup_steps=0,
        weight_decay=0.01,                 # stare-jax optim.weight_decay (max_grad_norm=1.0 is the default)
        max_steps=MAX_STEPS,
        seed=w["seed"],
        dataloader_num_workers=0,
        logging_strategy="no",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def train_dataset(workload: dict, tokenizer) -> datasets.Dataset:
    """The workload's prompts (plain text) with their ground truths, repeated DATASET_REPEATS times;
    checks that the tokenizer turns each text back into exactly its prompt_len ids."""
    if common.is_real(workload):
        texts, truths = workload["prompt_texts"], workload["ground_truths"]
        return datasets.Dataset.from_dict({"prompt": texts * DATASET_REPEATS, "ground_truth": truths * DATASET_REPEATS})
    ids, texts, truths = common.prompts(workload)
    if tokenizer(texts)["input_ids"] != ids.tolist():
        raise RuntimeError("the bench tokenizer does not map the prompt texts back to their ids")
    return datasets.Dataset.from_dict({"prompt": texts * DATASET_REPEATS, "ground_truth": truths * DATASET_REPEATS})


def reward_func(clock: common.StepClock):
    """A TRL reward function applying `common.reward` to each completion, timed into `clock`."""
    def bench_reward(completions, ground_truth, **kwargs):
        return clock.score(completions, ground_truth)
    return bench_reward


def time_rollout(trainer: GRPOTrainer, workload: dict, clock: common.StepClock) -> None:
    """Wraps the trainer's `_generate_and_score_completions` to time it into `clock`, count the
    generated tokens and check that the batch has the workload's exact shape without padding."""
    generate_and_score = trainer._generate_and_score_completions
    w = workload
    batch = w["num_prompts"] * w["group_size"]

    def timed(inputs):
        start = time.perf_counter()
        out = generate_and_score(inputs)
        clock.rollout_s += time.perf_counter() - start
        prompt_mask, completion_mask = out["prompt_mask"], out["completion_mask"]
        if common.is_real(w):
            lens = completion_mask.sum(dim=1)
            if (completion_mask.shape[0] != batch or completion_mask.shape[1] > w["new_tokens"] or int(lens.min()) < 1
                    or len(torch.unique(out["prompt_ids"], dim=0)) != w["num_prompts"]):
                raise RuntimeError(f"rollout batch is not {w['num_prompts']} prompts x {w['group_size']} responses of "
                                   f"1..{w['new_tokens']} tokens: completion mask {tuple(completion_mask.shape)}, "
                                   f"lengths {lens.tolist()}")
            clock.tokens += int(lens.sum())
            return out
        if (tuple(prompt_mask.shape) != (batch, w["prompt_len"]) or not bool(prompt_mask.all())
                or tuple(completion_mask.shape) != (batch, w["new_tokens"]) or not bool(completion_mask.all())
                or len(torch.unique(out["prompt_ids"], dim=0)) != w["num_prompts"]):
            raise RuntimeError(f"rollout batch is not {w['num_prompts']} prompts x {w['group_size']} x "
                               f"({w['prompt_len']} + {w['new_tokens']}) tokens: prompt mask "
                               f"{tuple(prompt_mask.shape)}, completion mask {tuple(completion_mask.shape)}, "
                               f"{int(completion_mask.sum())} completion tokens")
        clock.tokens += int(completion_mask.sum())
        return out

    trainer._generate_and_score_completions = timed


def torch_matmul(n: int, dtype: str = "float32"):
    """`common.matmul_peak_gflops`'s product for PyTorch: an n x n matmul of random `dtype` operands on
    the device the trainer uses (the CPU's BLAS, or the GPU with PyTorch's default TF32 setting)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device, getattr(torch, dtype))

    def product():
        out = a @ a
        if device == "cuda":
            torch.cuda.synchronize()
        return out
    return product


class CommandGate(TrainerCallback):
    """Blocks after each optimizer step until the driver's next command. After the first (warm-up)
    step it prints ready; after each later step, that step's timings. Stops training on exit / EOF."""

    def __init__(self, clock: common.StepClock):
        self.clock = clock
        self.commands = common.commands()
        self.warming_up = True
        self.train_start = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Notes when the warm-up step starts."""
        self.train_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        """Reports the step that just ended, then waits for the next command."""
        if self.warming_up:
            self.warming_up = False
            common.send({"ready": True, "framework": "trl", "torch_threads": torch.get_num_threads(),
                         "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                         "optimizer": args.optim, "warmup_s": time.perf_counter() - self.train_start,
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                         "dtype": args.bf16 and "bfloat16" or "float32",
                         "matmul_precision": torch.get_float32_matmul_precision(),
                         "matmul_peak_gflops": common.matmul_peak_gflops(
                             lambda n: torch_matmul(n, "bfloat16" if args.bf16 else "float32"),
                             (2048, 4096, 8192) if torch.cuda.is_available() else (512, 1024, 2048))})
        else:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels are done before its time is read
            common.send(self.clock.report())
        cmd = next(self.commands, None)
        if cmd is None:
            control.should_training_stop = True
            return control
        if cmd.get("cmd") != "step":
            raise SystemExit(f"trl_peer: unknown command {cmd!r}")
        self.clock.begin()
        return control


def set_matmul_precision(name: str) -> None:
    """PyTorch's float32 products as stare-jax's `model.matmul_precision` names them: "default" keeps
    PyTorch's own (full float32 unless TF32 is switched on), "float32" full precision, "tensorfloat32"
    TF32 on GPUs that have it."""
    if name == "default":
        return
    tf32 = name == "tensorfloat32"
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def main() -> None:
    """Builds the trainer from the workload in argv and serves the driver's commands."""
    workload = common.workload_from_argv()
    set_matmul_precision(workload.get("matmul_precision", "default"))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    real = common.is_real(workload)
    if real:
        tokenizer = transformers.AutoTokenizer.from_pretrained(workload["checkpoint"], padding_side="left")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = common.build_tokenizer()
    clock = common.StepClock(reward_fn=common.real_reward if real else common.reward)
    with tempfile.TemporaryDirectory(prefix="trl_peer_") as output_dir:
        model = AutoModelForCausalLM.from_pretrained(workload["checkpoint"], dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_func(clock), args=grpo_config(workload, output_dir),
                              train_dataset=train_dataset(workload, tokenizer), processing_class=tokenizer,
                              callbacks=[CommandGate(clock)])
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        time_rollout(trainer, workload, clock)
        trainer.train()


if __name__ == "__main__":
    main()
