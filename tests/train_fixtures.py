"""Reward functions for the end-to-end trainer tests (imported by spec in the verifier workers)."""

import math
import time

from stare_jax.tasks.countdown import score


def raise_sometimes(response: str, ground_truth: str) -> float:
    """The countdown score, but raises on every response of even length."""
    if len(response) % 2 == 0:
        raise ValueError("verifier bug")
    return score(response, ground_truth)


def hang_sometimes(response: str, ground_truth: str) -> float:
    """The countdown score, but hangs on responses of length 3 (mod 4)."""
    if len(response) % 4 == 3:
        time.sleep(600)
    return score(response, ground_truth)


def nan_sometimes(response: str, ground_truth: str) -> float:
    """NaN on responses of odd length, else the countdown score."""
    return math.nan if len(response) % 2 else score(response, ground_truth)


def overflow_reward(response: str, ground_truth: str) -> float:
    """Finite rewards so large (+-3e38) that float32 group statistics overflow: a non-finite loss."""
    return 3e38 if len(response) % 2 else -3e38


def length_parity(response: str, ground_truth: str) -> float:
    """1.0 when the response has an even number of characters: rewards with spread whatever the model
    writes, so a short run of a real model has non-zero advantages."""
    return float(len(response) % 2 == 0)


def slow_reward(response: str, ground_truth: str) -> float:
    """The countdown score after STARE_TEST_REWARD_DELAY seconds (default 0.02): a step of 16
    responses then takes ~0.3 s or more, long enough to signal a process inside it."""
    import os

    time.sleep(float(os.environ.get("STARE_TEST_REWARD_DELAY", "0.02")))
    return score(response, ground_truth)
