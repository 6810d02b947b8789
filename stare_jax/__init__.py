"""stare-jax: RL post-training of language models (GRPO) with STARE entropy control, in JAX/Flax."""

__version__ = "0.1.0"
