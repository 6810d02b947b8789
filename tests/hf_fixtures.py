"""Builders of tiny, randomly initialised Hugging Face checkpoints (with torch) for parity tests."""

from __future__ import annotations

import numpy as np

VOCAB = 97

# name -> (family, tied embeddings, extra config)
KINDS = {
    "llama": ("llama", False, dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", True, {}),
    "qwen3": ("qwen3", False, dict(head_dim=16)),
}


def hf_model(name: str, seed: int = 0):
    """A tiny torch model of family `name` with GQA (4 heads, 2 KV heads), perturbed norms/biases."""
    import torch
    import transformers

    family, tied, extra = KINDS[name]
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-trivial norms and biases
    return model


def make_checkpoint(path: str, name: str, seed: int = 0) -> str:
    """Saves `hf_model(name)` to `path` and returns the path."""
    hf_model(name, seed).save_pretrained(path)
    return path


def left_padded_batch(lengths=(9, 5, 2), total=9, seed=0, vocab=VOCAB):
    """(input_ids, attention_mask, position_ids) of a left-padded batch with the given lengths."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(3, vocab, (len(lengths), total))
    mask = np.zeros((len(lengths), total), np.int64)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    ids = np.where(mask > 0, ids, 0)
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    return ids, mask, pos


def torch_logits(model, ids, mask, pos):
    """Reference float32 logits from the torch model with explicit positions."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.float().numpy()
