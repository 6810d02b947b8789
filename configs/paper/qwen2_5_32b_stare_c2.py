"""STARE-C2 on Qwen2.5-32B (base): W = 1.05 on L+ and M = 0.95 on L-, short chain of thought.

Everything else as in the paper's main setting (configs/paper/qwen2_5_math_7b_stare.py): lr 1e-6
constant AdamW, clip 1.0, 64 prompts x 8 responses, prompt 1024 + response 3072 tokens, on-policy,
DAPO dynamic sampling, no KL, no entropy bonus, top 10% by surprisal, H_tgt 0.3.

Target: 128 devices, e.g. a TPU v5p-256 slice (128 chips, 95 GiB each). Check before launching:

    python -m stare_jax.dryrun --config configs/paper/qwen2_5_32b_stare_c2.py --devices 128 --chip v5p
"""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "qwen2_5_math_7b_stare.py"))
    c.model.preset = "qwen2.5-32b"
    c.model.remat = True
    c.model.vocab_chunk = 16384            # 152,064-token vocabulary in 10 chunks

    c.stare.variant = "C2"                 # W on L+ and M on L-
    c.stare.w = 1.05
    c.stare.m = 0.95
    c.stare.m_min = 0.5

    # Mesh: 64-way FSDP x 2-way tensor parallelism on 128 devices. Parameters + AdamW (32.8B x 12
    # bytes = 393 GB) are 2.9 GiB per device. Not pure 128-way FSDP: the rollout's prefill splits the
    # 64 prompts over the batch shards (data x fsdp), and with 128 shards it cannot split them and runs
    # all 64 prompts on every device (the dry run measured 50 GiB per device for the rollout that
    # way, 20 GiB with fsdp=64 x tensor=2). Tensor=2 divides the 40 query / 8 KV heads, the MLP width
    # and the vocabulary.
    c.mesh.data = 1
    c.mesh.fsdp = 64
    c.mesh.tensor = 2

    # 512 responses over 64 batch shards = 8 rows per shard; 8 micro-batches of 1 row per shard
    # (40 heads / 2 x 4096^2 float32 attention scores = 1.25 GiB per layer and row per device).
    c.ppo.grad_accum = 8
    return c
