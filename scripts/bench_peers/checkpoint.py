"""Writes the bench's random Qwen2 checkpoint with stare_jax (run in the main environment).

    python scripts/bench_peers/checkpoint.py OUT_DIR [--workload default|large|smoke]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common  # noqa: E402


def write_checkpoint(path: str, workload: dict) -> str:
    """Saves random Qwen2 weights of the workload's shape (seeded) as a HF directory at `path`, with no
    EOS id in its config (generation never stops early) and the bench tokenizer."""
    from stare_jax.models import ModelConfig, Policy, build_model, save_pretrained

    w = workload
    cfg = ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=w["vocab_size"], hidden_size=w["hidden_size"],
        intermediate_size=w["intermediate_size"], num_layers=w["num_layers"], num_heads=w["num_heads"],
        num_kv_heads=w["num_kv_heads"], head_dim=w["hidden_size"] // w["num_heads"], rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=w["tie_word_embeddings"], qkv_bias=True,
        max_position_embeddings=1024, bos_token_id=None, eos_token_ids=(), pad_token_id=common.PAD_ID)
    model = build_model(cfg, seed=w["seed"])
    save_pretrained(Policy(model=model, config=cfg, tokenizer=common.build_tokenizer()), path)
    return path


def write_synthetic_checkpoint(path: str, name: str) -> None:
    """Writes the random checkpoint of the synthetic workload `name` (a key of common.SYNTHETIC) at
    `path` in a child process of the main environment, as every benchmark driver does."""
    import subprocess

    subprocess.run([sys.executable, os.path.abspath(__file__), path, "--workload", name], check=True,
                   stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--workload", choices=sorted(common.SYNTHETIC), default="default")
    args = ap.parse_args()
    print(write_checkpoint(args.out_dir, common.SYNTHETIC[args.workload]))
