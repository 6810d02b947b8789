"""Verifiable reward functions, their registry, and the isolated verifier pool.

    from stare_jax.rewards import RewardPool
    with RewardPool("countdown", num_workers=2, timeout_s=5.0) as pool:
        scores, stats = pool.score(responses, ground_truths)
"""

from stare_jax.rewards.extract import gsm8k_final_answer, last_boxed
from stare_jax.rewards.functions import (REGISTRY, countdown_reward, function_spec, get_reward_fn, load_function,
                                         math_reward, register_reward, resolve_spec)
from stare_jax.rewards.pool import RewardPool, RewardResult, RewardSpecError

__all__ = ["gsm8k_final_answer", "last_boxed", "REGISTRY", "countdown_reward", "function_spec", "get_reward_fn",
           "load_function", "math_reward", "register_reward", "resolve_spec", "RewardPool", "RewardResult",
           "RewardSpecError"]
