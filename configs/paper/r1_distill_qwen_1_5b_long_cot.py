"""STARE-O1 on DeepSeek-R1-Distill-Qwen-1.5B, long chain of thought (8k-token responses).

Same hyper-parameters as the paper's main setting (configs/paper/qwen2_5_math_7b_stare.py: lr 1e-6
constant AdamW, clip 1.0, 64 prompts x 8 responses, on-policy, DAPO dynamic sampling, no KL, no
entropy bonus, STARE top 10%, W 1.1, H_tgt 0.3); only the model, the lengths, the micro-batching and
the mesh differ.

Target: 16 devices, e.g. a TPU v5p-32 slice (16 chips, 95 GiB each). Check before launching:

    python -m stare_jax.dryrun --config configs/paper/r1_distill_qwen_1_5b_long_cot.py --devices 16 --chip v5p

For 16k-token responses add --config.rollout.max_new_tokens=16384 (and see docs/dryrun.md for
its memory).
"""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "qwen2_5_math_7b_stare.py"))
    c.model.preset = "deepseek-r1-distill-qwen-1.5b"
    c.model.remat = True                   # 9216-token rows: recompute each layer in the backward pass
    c.model.vocab_chunk = 16384            # 151,936-token vocabulary in 10 chunks

    # Long CoT: prompt 1024 + response 8192 tokens (the model has 131072 positions).
    c.data.max_prompt_len = 1024
    c.rollout.max_new_tokens = 8192
    c.data.prompt_batch_size = 64          # paper: 64 prompts x 8 responses
    c.rollout.group_size = 8

    # 512 responses over 16 batch shards = 32 rows per device. The attention scores of one 9216-token
    # row are 12 heads x 9216^2 float32 = 4 GiB per layer, so the backward pass runs one row per
    # device at a time: 32 micro-batches, the token-mean still exact over the whole batch.
    c.ppo.grad_accum = 32

    # Mesh: pure FSDP over the 16 devices. Parameters + AdamW (1.8B x 12 bytes = 21 GB) are 1.3 GiB per
    # device; the rest of the memory goes to activations and the rollout's KV cache
    # (512 rows x 8192 slots x 2 KV heads x 128 x 2 (k, v) x 28 layers x 2 bytes = 30 GB, 1.9 GiB per device).
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    c.eval.n = 16                          # long responses: fewer samples per evaluation prompt
    c.eval.max_prompts = 256
    return c
