"""TFDS builders and the grain input pipeline."""
