"""Prompt-length buckets and the dynamic-sampling buffer that joins batches of different buckets."""

import numpy as np
import pytest

from stare_jax.data.buckets import bucket_length, trim_to_bucket
from stare_jax.dynamic_sampling import GroupBuffer


@pytest.mark.parametrize("longest,multiple,max_len,expected", [
    (10, 16, 64, 16), (16, 16, 64, 16), (17, 16, 64, 32), (0, 16, 64, 16), (60, 16, 56, 56), (5, 0, 24, 24)])
def test_bucket_length(longest, multiple, max_len, expected):
    assert bucket_length(longest, multiple, max_len) == expected


def test_trim_keeps_every_prompt_token_and_drops_only_padding():
    P = 12
    lengths = np.array([3, 7, 5])
    mask = (np.arange(P)[None] >= P - lengths[:, None]).astype(np.int32)
    ids = np.where(mask > 0, np.arange(1, P + 1)[None] * 10 + np.arange(3)[:, None], 0)
    t_ids, t_mask = trim_to_bucket(ids, mask, 4)
    assert t_ids.shape == (3, 8)
    np.testing.assert_array_equal(t_mask.sum(axis=1), lengths)
    np.testing.assert_array_equal(t_ids, ids[:, 4:])
    assert trim_to_bucket(ids, mask, 0)[0].shape == (3, P)


def test_group_buffer_left_pads_batches_of_different_buckets():
    G = 2
    buf = GroupBuffer(3, G, left_padded=("input_ids", "attention_mask"))
    narrow = {"input_ids": np.full((4, 5), 7), "attention_mask": np.ones((4, 5), int), "rewards": np.arange(4.0)}
    wide = {"input_ids": np.full((4, 9), 8), "attention_mask": np.ones((4, 9), int), "rewards": 10 + np.arange(4.0)}
    buf.add(narrow, np.array([True, False]))
    buf.add(wide, np.array([True, True]))
    out = buf.take()
    assert out["input_ids"].shape == (6, 9) and out["attention_mask"].shape == (6, 9)
    np.testing.assert_array_equal(out["attention_mask"][:2, :4], 0)   # the narrow rows' new padding
    np.testing.assert_array_equal(out["input_ids"][:2, 4:], 7)
    np.testing.assert_array_equal(out["rewards"], [0, 1, 10, 11, 12, 13])
