"""Grouped rollouts: the jitted KV-cache sampler."""
