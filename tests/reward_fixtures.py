"""Importable reward functions that misbehave, for the RewardPool tests (spawned workers import
them by their "tests.reward_fixtures:NAME" spec)."""

import math
import os
import time


def echo_reward(response: str, ground_truth: str) -> float:
    """float(response): lets a test choose each score."""
    return float(response)


def raising_reward(response: str, ground_truth: str) -> float:
    """Always raises."""
    raise RuntimeError("verifier exploded")


def hanging_reward(response: str, ground_truth: str) -> float:
    """Sleeps (practically) forever."""
    time.sleep(3600)
    return 1.0


def spinning_reward(response: str, ground_truth: str) -> float:
    """A CPU-bound infinite loop (never releases the worker)."""
    x = 0
    while True:
        x += 1


def nan_reward(response: str, ground_truth: str) -> float:
    """NaN, inf or -inf depending on the response."""
    return {"nan": math.nan, "inf": math.inf}.get(response, -math.inf)


def string_reward(response: str, ground_truth: str):
    """Not a number."""
    return "1.0"


def exiting_reward(response: str, ground_truth: str) -> float:
    """Kills its own worker process."""
    os._exit(3)


def mixed_reward(response: str, ground_truth: str) -> float:
    """Dispatches on the response: 'ok:<x>', 'raise', 'hang', 'nan', 'str', 'exit'."""
    if response.startswith("ok:"):
        return float(response[3:])
    return {"raise": raising_reward, "hang": hanging_reward, "nan": nan_reward, "str": string_reward,
            "exit": exiting_reward}[response](response, ground_truth)


def math_verify_imported(response: str, ground_truth: str) -> float:
    """1.0 iff math-verify is imported in the worker that runs it (preloaded by its forkserver)."""
    import sys
    return float("math_verify" in sys.modules)
