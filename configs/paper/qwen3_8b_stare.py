"""STARE-O1 on Qwen3-8B, short chain of thought (prompt 1024 + response 3072 tokens).

Everything as in the paper's main setting (configs/paper/qwen2_5_math_7b_stare.py): lr 1e-6 constant
AdamW, clip 1.0, 64 prompts x 8 responses, on-policy, DAPO dynamic sampling, no KL, no entropy bonus,
STARE top 10%, W 1.1, H_tgt 0.3. The architecture preset is Qwen/Qwen3-8B (Qwen3-8B-Base has the
same shapes). Qwen3's thinking mode writes long answers: raise rollout.max_new_tokens (the model has
40960 positions) and check memory with the dry run.

Target: 64 devices, e.g. a TPU v5p-128 slice (64 chips, 95 GiB each). Check before launching:

    python -m stare_jax.dryrun --config configs/paper/qwen3_8b_stare.py --devices 64 --chip v5p
"""

import os

from stare_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(__file__), "qwen2_5_math_7b_stare.py"))
    c.model.preset = "qwen3-8b"
    c.model.remat = True
    c.model.vocab_chunk = 16384            # 151,936-token vocabulary in 10 chunks

    # 512 responses over 64 batch shards = 8 rows per device; 8 micro-batches of 1 row per device
    # (32 heads x 4096^2 float32 attention scores = 2 GiB per layer and row).
    c.ppo.grad_accum = 8

    # Mesh: pure FSDP over 64 devices. Parameters + AdamW (8.2B x 12 bytes = 98 GB) are 1.4 GiB per device.
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    return c
