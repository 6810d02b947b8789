"""Embedded synthetic tasks (countdown) and the tiny character-level model that learns them."""

from stare_jax.tasks.countdown import (CountdownConfig, CountdownProblem, count_solutions, generate_problem,
                                       generate_problems, is_correct, parse_problem, score, solutions)
from stare_jax.tasks.embedded import build_char_tokenizer, create_embedded_model

__all__ = ["CountdownConfig", "CountdownProblem", "count_solutions", "generate_problem", "generate_problems",
           "is_correct", "parse_problem", "score", "solutions", "build_char_tokenizer", "create_embedded_model"]
