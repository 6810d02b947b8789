"""Grouped rollouts: the jitted KV-cache sampler (`generate`, contract 7 of DESIGN.md).

Modules: `sampler` (the public entry point and the jitted rollout), `slots` (the slot-refilling
rollout of `generate(..., slots=S)` and its host-side `schedule`), `decode` (one decode step
over the grouped KV cache), `sampling` (temperature / top-k / top-p / greedy token choice).
"""

from stare_jax.rollout.sampler import RolloutResult, RolloutSpec, generate, grouped_rollout
from stare_jax.rollout.sampling import SamplingParams, choose_tokens, filter_logits, token_log_probs

__all__ = ["RolloutResult", "RolloutSpec", "generate", "grouped_rollout", "SamplingParams", "choose_tokens",
           "filter_logits", "token_log_probs"]
