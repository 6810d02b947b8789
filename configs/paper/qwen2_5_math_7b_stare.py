"""STARE-O1 on Qwen2.5-Math-7B, short chain of thought: the paper's main setting.

Target: 64 devices, e.g. a TPU v5p-128 slice (64 chips, 95 GiB each). Check a change before
launching with the dry run (no weights needed; figures in docs/dryrun.md):

    python -m stare_jax.dryrun --config configs/paper/qwen2_5_math_7b_stare.py --devices 64 --chip v5p

Train (every host runs the same command on a pod slice):

    python -m stare_jax.train --config configs/paper/qwen2_5_math_7b_stare.py --workdir gs://BUCKET/runs/q7b-stare \
        --config.model.path=/data/Qwen2.5-Math-7B --config.data.train_files=/data/dapo-math-17k.parquet \
        --config.data.eval_files=/data/aime24.jsonl,/data/math500.jsonl

The other paper configs load this file and change only what differs (model, lengths, mesh, STARE
variant), so the hyper-parameters below are the paper defaults for all of them.
"""

from stare_jax.config import default_config


def get_config():
    c = default_config()
    c.model.path = ""                      # set on the command line: a local HF directory
    c.model.preset = "qwen2.5-math-7b"     # architecture for dry runs (stare_jax.models.presets)
    c.model.dtype = "bfloat16"             # bf16 compute; log-softmax / entropy stay float32
    c.model.param_dtype = "float32"        # fp32 master weights and Adam moments
    c.model.remat = True                   # 4096-token rows: recompute each layer in the backward pass
    c.model.vocab_chunk = 16384            # 152,064-token vocabulary in 10 chunks

    # --- data and rollout: 64 prompts x 8 responses, prompt 1024 + response 3072 = the model's 4096 positions
    c.data.name = "math"
    c.data.prompt_batch_size = 64
    c.data.max_prompt_len = 1024
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 3072
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.dynamic_sampling.enabled = True      # DAPO dynamic sampling: keep groups with reward spread,
    c.dynamic_sampling.max_num_gen_batches = 10  # refilled from up to 10 generation batches
    c.reward.name = "math"
    c.reward.num_workers = 16
    c.reward.timeout_s = 10.0

    # --- objective: clipped surrogate (clip-higher 0.2 / 0.28, dual-clip 10), token-mean, no KL, no entropy bonus
    c.loss.name = "stare"
    c.loss.agg = "token-mean"
    c.loss.kl_type = "none"
    c.loss.kl_coef = 0.0
    c.loss.entropy_coef = 0.0
    c.advantage.scale = "group"
    c.stare.enabled = True
    c.stare.variant = "O1"                 # W on L+ only
    c.stare.top_p_ratio = 0.1
    c.stare.w = 1.1
    c.stare.m = 0.9                        # used by variant C2 only
    c.stare.target_entropy = 0.3
    c.stare.adaptive = False
    c.stare.selection_scope = "global"

    # --- optimizer: constant lr 1e-6 AdamW (0.9, 0.999), wd 0.01, global-norm clip 1.0
    c.optim.lr = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.optim.warmup_steps = 0
    c.ppo.epochs = 1                       # one optimizer step per batch: on-policy
    c.ppo.num_minibatches = 1
    # 512 responses = 8 rows per device; 8 micro-batches of 1 row per device bound the activation
    # memory of the backward pass (the token-mean stays exact over the whole batch).
    c.ppo.grad_accum = 8

    c.total_steps = 500
    c.checkpoint_every = 20
    c.test_freq = 20
    c.eval.n = 32                          # avg@32 on AIME/AMC; use --n 4 for MATH-500-sized sets
    c.eval.temperature = 1.0
    c.eval.top_p = 0.7
    c.eval.max_prompts = 512

    # --- mesh: pure FSDP over all 64 devices. Parameters + AdamW state (7.6B x 12 bytes = 91 GB) are
    # split 64 ways (1.4 GiB per device); the batch is split over the same axis (8 rows per device).
    # Tensor parallelism is not needed at this size; mesh.tensor=4 (4 KV heads) is the option if
    # per-row activations ever dominate.
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
