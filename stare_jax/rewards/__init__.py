"""Verifiable reward functions and the isolated verifier pool."""
