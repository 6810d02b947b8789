"""TFDS builders (array_record) and the grain input pipeline of prompts.

Submodules: `records` (local JSONL/JSON/parquet math files -> records), `builders` (TFDS
builders: generated countdown problems and arithmetic word problems, math prompt files), `pipeline` (prompt formatting,
tokenization, the checkpointable training iterator and the evaluation iterator).
"""

from stare_jax.data.builders import (ArithBuilderConfig, CountdownBuilderConfig, MathPromptsConfig, StareArith,
                                     StareCountdown, StareMathPrompts, arith_builder, arith_source, countdown_builder,
                                     countdown_source, math_builder, math_source, prepare)
from stare_jax.data.pipeline import (MATH_INSTRUCTION, PromptEncoder, eval_num_batches, format_prompt,
                                     host_indices, make_eval_iterator, make_prompt_dataset, make_prompt_iterator)
from stare_jax.data.records import DataFormatError, normalize_record, read_raw_records, read_records

__all__ = ["ArithBuilderConfig", "StareArith", "arith_builder", "arith_source", "CountdownBuilderConfig", "MathPromptsConfig", "StareCountdown", "StareMathPrompts", "countdown_builder",
           "countdown_source", "math_builder", "math_source", "prepare", "MATH_INSTRUCTION", "PromptEncoder",
           "eval_num_batches", "format_prompt", "host_indices", "make_eval_iterator", "make_prompt_dataset",
           "make_prompt_iterator", "DataFormatError", "normalize_record", "read_raw_records", "read_records"]
