"""Prompt-length buckets: pad each batch only as far as its longest prompt needs.

The pipeline left-pads every prompt to `data.max_prompt_len`. With `data.prompt_bucket_multiple`
M > 0 the trainer cuts the leading all-padding columns of each global batch down to the smallest
multiple of M that holds its longest prompt (never more than max_prompt_len), so short-prompt
batches run a shorter prefill and update. The jitted sampler and update step compile once per
bucket: at most ceil(max_prompt_len / M) shapes, and none again for batches within a bucket.
"""

from __future__ import annotations

import numpy as np


def bucket_length(longest: int, multiple: int, max_len: int) -> int:
    """The padded prompt length of a batch whose longest prompt has `longest` tokens:
    min(max_len, M * ceil(longest / M)), at least M (or max_len when M = 0, i.e. no buckets)."""
    if multiple <= 0:
        return max_len
    return min(max_len, multiple * max(1, -(-longest // multiple)))


def trim_to_bucket(prompt_ids: np.ndarray, prompt_mask: np.ndarray, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded [B, P] prompts cut to [B, bucket_length(longest, multiple, P)] by dropping leading
    columns, which are padding in every row (each prompt keeps all of its tokens)."""
    P = prompt_ids.shape[1]
    longest = int(np.asarray(prompt_mask).sum(axis=1).max()) if len(prompt_mask) else 0
    keep = bucket_length(longest, multiple, P)
    return prompt_ids[:, P - keep:], prompt_mask[:, P - keep:]
