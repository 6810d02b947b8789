"""Reading math prompt datasets from local JSONL / JSON / parquet files into uniform records.

Every record becomes `{"question": str, "ground_truth": str, "source": "file:line"}`. Field names
are matched liberally (case-insensitively):

- question: `question`, `problem`, `prompt`, `query`, `input`. A chat-style list of messages (as
  DAPO-Math-17k's `prompt`) gives the content of its last user message; DAPO's own instruction
  wrapper ("Solve the following math problem step by step ... Remember to put your answer on its
  own line after "Answer:"") is removed, since prompts get the `\\boxed{}` instruction instead.
- ground truth, first found of: `reward_model.ground_truth` (DAPO), `ground_truth`, `answer`,
  `final_answer`, `expected_answer`, `target`, `solution`. GSM8K answers (`... #### 42`) give the
  text after `####`; a MATH-style solution (or any answer containing `\\boxed{}`) gives the content
  of its last `\\boxed{}`; numbers are written as strings.

Errors are `DataFormatError` naming the file and line (row, for parquet), e.g. an empty file,
malformed JSON, or a record missing the fields (with the fields it has).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from stare_jax.rewards.extract import gsm8k_final_answer, last_boxed

QUESTION_KEYS = ("question", "problem", "prompt", "query", "input")
ANSWER_KEYS = ("ground_truth", "answer", "final_answer", "expected_answer", "target", "solution")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")

_DAPO_PREFIX = "Solve the following math problem step by step."
_DAPO_SUFFIX = "Remember to put your answer on its own line after"


class DataFormatError(ValueError):
    """A dataset file is empty, malformed, or a record lacks the needed fields."""


def read_raw_records(path: str) -> Iterator[tuple[str, dict]]:
    """Yields (location, raw record dict) of a .jsonl/.json/.parquet file; the location is
    "line N" (JSONL), "record N" (a JSON array) or "row N" (parquet), 1-based.

    Raises DataFormatError for a missing or empty file, a malformed JSON line, or a record that
    is not an object.
    """
    if not os.path.isfile(path):
        raise DataFormatError(f"{path}: no such file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataFormatError(f"{path}: unsupported file type {suffix!r}; expected one of {SUPPORTED_SUFFIXES}")
    count = 0
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataFormatError(f"{path}: cannot read parquet: {e}") from e
        for row, rec in enumerate(table.to_pylist(), 1):
            count += 1
            yield f"row {row}", rec
    else:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if suffix == ".json" and head.startswith("["):
                try:
                    records = json.load(f)
                except json.JSONDecodeError as e:
                    raise DataFormatError(f"{path}: line {e.lineno}: malformed JSON ({e.msg})") from e
                for i, rec in enumerate(records, 1):
                    if not isinstance(rec, dict):
                        raise DataFormatError(f"{path}: record {i}: expected a JSON object, got {type(rec).__name__}")
                    count += 1
                    yield f"record {i}", rec
            else:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataFormatError(f"{path}: line {line_no}: malformed JSON ({e.msg})") from e
                    if not isinstance(rec, dict):
                        raise DataFormatError(
                            f"{path}: line {line_no}: expected a JSON object, got {type(rec).__name__}")
                    count += 1
                    yield f"line {line_no}", rec
    if count == 0:
        raise DataFormatError(f"{path}: the file is empty (no records)")


def _lower_keys(rec: dict) -> dict[str, Any]:
    return {str(k).lower(): v for k, v in rec.items()}


def _question_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m for m in value if str(m.get("role", "user")).lower() == "user"]
        msg = (users or list(value))[-1]
        content = msg.get("content")
        return content if isinstance(content, str) else None
    return None


def strip_dapo_wrapper(question: str) -> str:
    """Removes DAPO-Math-17k's answer-format instruction around the problem, if present."""
    q = question.strip()
    if q.startswith(_DAPO_PREFIX):
        first_break = q.find("\n\n")
        if first_break >= 0:
            q = q[first_break + 2:]
        last = q.rfind(_DAPO_SUFFIX)
        if last >= 0:
            q = q[:last]
    return q.strip()


def _answer_text(key: str, value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return _answer_text(key, value[0])
    if not isinstance(value, str) or not value.strip():
        return None
    if key == "solution" or "\\boxed" in value or "\\fbox" in value:
        return last_boxed(value)
    gsm = gsm8k_final_answer(value)
    return gsm if gsm is not None else value.strip()


def normalize_record(raw: dict, where: str) -> dict[str, str]:
    """A raw record -> {"question", "ground_truth", "source"}; `where` ("file: line 3") names it in errors."""
    rec = _lower_keys(raw)
    question = None
    for k in QUESTION_KEYS:
        if k in rec:
            question = _question_text(rec[k])
            if question is not None:
                question = strip_dapo_wrapper(question)
                break
    answer = None
    rm = rec.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") not in (None, ""):
        answer = _answer_text("ground_truth", rm["ground_truth"])
    if answer is None:
        for k in ANSWER_KEYS:
            if k in rec and rec[k] not in (None, ""):
                answer = _answer_text(k, rec[k])
                if answer is not None:
                    break
    missing = [name for name, v in (("question", question), ("answer", answer)) if not v]
    if missing:
        raise DataFormatError(
            f"{where}: no usable {' or '.join(missing)} field (question from one of {list(QUESTION_KEYS)}, "
            f"answer from reward_model.ground_truth or one of {list(ANSWER_KEYS)}, a 'solution' needing a "
            f"\\boxed{{}}); the record has fields {sorted(raw)}")
    return {"question": question, "ground_truth": answer, "source": where}


def read_records(path: str) -> Iterator[dict[str, str]]:
    """Normalised records of one file (see the module doc), in file order."""
    for location, raw in read_raw_records(path):
        yield normalize_record(raw, f"{path}: {location}")
