"""The prompt input pipeline: grain over a random-access source, host-sharded, tokenized, left-padded.

A *source* is anything with `__len__` and `__getitem__` returning a record dict with a `question`
and a `ground_truth` (str or bytes): a TFDS data source from `stare_jax.data.builders`, or a plain
list of dicts.

`make_prompt_iterator` (training) returns a grain `DatasetIterator`: infinite, shuffled per epoch,
deterministic in `seed`, each host reading its slice of every global batch (see `make_prompt_iterator`). Each
element is a batch dict:

    prompt_ids    int32 [B, P]   left-padded token ids (pad id on the left)
    prompt_mask   int32 [B, P]   1 on prompt tokens
    prompt_len    int32 [B]      tokens before padding/truncation
    truncated     bool  [B]      True where the prompt was cut to its last P tokens
    ground_truth  str   [B]      numpy unicode array, passed to the reward function
    question      str   [B]      the raw question
    index         int64 [B]      the record's index in the source

Its position is `it.get_state()` (a small JSON-able dict) and `it.set_state(state)` resumes
exactly; in an Orbax CheckpointManager pass `grain.checkpoint.CheckpointSave(it)` /
`grain.checkpoint.CheckpointRestore(it)` in the Composite (one file per process). The state is
valid only for an iterator built with the same arguments.

`make_eval_iterator` gives one pass over a split in a fixed order, with every process yielding
the same number of batches (the last ones padded, `valid` False on padding rows).

Prompt text (`format_prompt`): style "plain" uses the question as is (countdown); style "math"
appends `MATH_INSTRUCTION` to the question and applies the tokenizer's chat template as one user
turn when it has one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

import numpy as np

log = logging.getLogger(__name__)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_STYLES = ("plain", "math")
TRUNCATION_MODES = ("left", "error")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value.item())
    return str(value)


def format_prompt(question: str, tokenizer=None, *, style: str = "math",
                  instruction: str = MATH_INSTRUCTION) -> str:
    """The prompt text for `question`: as is for style "plain"; for "math", the question with
    `instruction` appended (after a newline), rendered by the tokenizer's chat template as a user
    turn with the generation prompt when it has a template."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")
    if style == "plain":
        return question
    content = f"{question.rstrip()}\n{instruction}" if instruction else question
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer defines a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


class PromptEncoder:
    """Turns source records into fixed-length left-padded token rows (pure; safe in threads).

    Chat-templated text is encoded without extra special tokens (the template has them); plain
    text with them (e.g. the BOS of the embedded character tokenizer).
    """

    def __init__(self, tokenizer, max_prompt_len: int, *, style: str = "math", truncation: str = "left",
                 instruction: str = MATH_INSTRUCTION):
        if style not in PROMPT_STYLES:
            raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        self.tokenizer = tokenizer
        self.max_prompt_len = int(max_prompt_len)
        self.style = style
        self.truncation = truncation
        self.instruction = instruction
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token id to pad prompts with")
        self.pad_id = int(pad)
        self.add_special = not (style == "math" and has_chat_template(tokenizer))
        self._encode = _fast_encoder(tokenizer, self.add_special)
        self._warned = 0

    def text(self, record: dict) -> str:
        """The formatted prompt text of a record."""
        return format_prompt(_text(record["question"]), self.tokenizer, style=self.style,
                             instruction=self.instruction)

    def encode(self, index: int, record: dict) -> dict[str, Any]:
        """One row: ids/mask [P] (left-padded), prompt_len, truncated, ground_truth, question, index."""
        try:
            question, ground_truth = record["question"], record["ground_truth"]
        except (KeyError, TypeError) as e:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise KeyError(f"record {index} lacks 'question'/'ground_truth' (has {fields})") from e
        ids = self._encode(self.text(record))
        n = len(ids)
        P = self.max_prompt_len
        truncated = n > P
        if truncated:
            if self.truncation == "error":
                raise ValueError(f"record {index}: prompt has {n} tokens, more than max_prompt_len={P} "
                                 "(raise max_prompt_len or use truncation='left')")
            if self._warned < 5:
                self._warned += 1
                log.warning("record %d: prompt of %d tokens truncated to its last %d", index, n, P)
            ids = ids[-P:]
        row = np.full((P,), self.pad_id, np.int32)
        mask = np.zeros((P,), np.int32)
        if ids:
            row[P - len(ids):] = ids
            mask[P - len(ids):] = 1
        return {"prompt_ids": row, "prompt_mask": mask, "prompt_len": np.int32(n), "truncated": np.bool_(truncated),
                "ground_truth": _text(ground_truth), "question": _text(question), "index": np.int64(index)}


def _fast_encoder(tokenizer, add_special: bool) -> Callable[[str], list[int]]:
    """A thread-safe `text -> ids` function: the Rust tokenizer (without truncation/padding)
    when there is one, else `tokenizer.encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_str(backend.to_str())
        tok.no_truncation()
        tok.no_padding()
        return lambda text: tok.encode(text, add_special_tokens=add_special).ids
    if hasattr(tokenizer, "encode"):
        return lambda text: list(tokenizer.encode(text, add_special_tokens=add_special))
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise TypeError(f"cannot encode text with {type(tokenizer).__name__}")


def _resolve_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
    return int(process_index), int(process_count)


def host_indices(num_records: int, process_index: int, process_count: int, *, drop_remainder: bool = True
                 ) -> range:
    """The source indices host `process_index` reads: every `process_count`-th, starting at its
    index; with `drop_remainder` all hosts get the same count (the last < process_count records
    are unused)."""
    stop = num_records - num_records % process_count if drop_remainder else num_records
    return range(process_index, stop, process_count)


class _EncodeBatch:
    """grain map: a batch of source indices -> the stacked encoded rows (a class, for a readable repr)."""

    def __init__(self, source, encoder: PromptEncoder):
        self.source = source
        self.encoder = encoder

    def __call__(self, indices):
        return _stack([self.encoder.encode(int(i), self.source[int(i)]) for i in np.asarray(indices)])


def make_prompt_dataset(source, *, tokenizer, batch_size: int, max_prompt_len: int, seed: int,
                        process_index: int | None = None, process_count: int | None = None,
                        prompt_style: str = "math", truncation: str = "left", shuffle: bool = True,
                        instruction: str = MATH_INSTRUCTION):
    """The grain `MapDataset` behind `make_prompt_iterator` (infinite, batched; see there)."""
    import grain

    pi, pc = _resolve_process(process_index, process_count)
    n = len(source)
    if n == 0:
        raise ValueError("the source has no records")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    encoder = PromptEncoder(tokenizer, max_prompt_len, style=prompt_style, truncation=truncation,
                            instruction=instruction)
    # One global order of records (shuffled per epoch); global batch b is local batches
    # b*pc .. b*pc + pc - 1, and host pi takes the pi-th. Every topology sees the same global
    # batches, so a run on 2 hosts x 2 devices trains on exactly the data of 1 host x 4 devices.
    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=int(seed) % 2 ** 32)  # reshuffled every epoch by repeat()
    ds = ds.repeat(None).batch(batch_size, drop_remainder=True)
    if pc > 1:
        ds = ds[pi::pc]
    return ds.map(_EncodeBatch(source, encoder))


def make_prompt_iterator(source, *, tokenizer, batch_size: int, max_prompt_len: int, seed: int,
                         process_index: int | None = None, process_count: int | None = None,
                         prompt_style: str = "math", truncation: str = "left", shuffle: bool = True,
                         instruction: str = MATH_INSTRUCTION, num_threads: int = 0,
                         prefetch_buffer_size: int = 4):
    """An endless, checkpointable iterator of host-local prompt batches (see the module doc).

    - `batch_size`: prompts per batch on this host; `max_prompt_len` P: the padded length.
    - `seed`: the shuffle seed (each epoch gets a different permutation derived from it);
      the same arguments give the same batches.
    - `process_index/process_count`: this host's shard (default: `jax.process_index/count()`):
      the records are put in one global (per-epoch shuffled) order, cut into global batches of
      `batch_size * process_count`, and host i takes the i-th slice of each, so the global batch
      sequence does not depend on the number of hosts.
    - `prompt_style`: "plain" (countdown) or "math" (chat template + boxed instruction).
    - `truncation`: "left" keeps the last P tokens of a longer prompt (flagged in `truncated`,
      logged for the first few) or "error" raises naming the record.
    - `num_threads`: grain read threads (0 = compute each batch when requested).

    Returns a grain `DatasetIterator`: `next(it)`, `it.get_state()`, `it.set_state(state)`.
    """
    import grain

    ds = make_prompt_dataset(source, tokenizer=tokenizer, batch_size=batch_size, max_prompt_len=max_prompt_len,
                             seed=seed, process_index=process_index, process_count=process_count,
                             prompt_style=prompt_style, truncation=truncation, shuffle=shuffle,
                             instruction=instruction)
    opts = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size if num_threads else 0)
    return iter(ds.to_iter_dataset(opts))


def make_eval_iterator(source, *, tokenizer, batch_size: int, max_prompt_len: int,
                       process_index: int | None = None, process_count: int | None = None,
                       prompt_style: str = "math", truncation: str = "left",
                       instruction: str = MATH_INSTRUCTION, limit: int | None = None) -> Iterator[dict]:
    """One pass over `source` (or its first `limit` records) in index order, host-sharded.

    Host `i` reads records `i, i + process_count, ...` (none dropped). Every host yields the same
    number of batches, ceil(ceil(n / process_count) / batch_size); rows past a host's records repeat
    its first row with `valid` False and `index` -1. Batches have the keys of
    `make_prompt_iterator` plus `valid` bool [B].
    """
    pi, pc = _resolve_process(process_index, process_count)
    n = len(source) if limit is None else min(limit, len(source))
    if n == 0:
        raise ValueError("the evaluation source is empty")
    encoder = PromptEncoder(tokenizer, max_prompt_len, style=prompt_style, truncation=truncation,
                            instruction=instruction)
    mine = list(host_indices(n, pi, pc, drop_remainder=False))
    num_batches = eval_num_batches(n, batch_size, pc)
    first = None
    for b in range(num_batches):
        rows, valid = [], []
        for j in mine[b * batch_size:(b + 1) * batch_size]:
            rows.append(encoder.encode(j, source[j]))
            valid.append(True)
        if first is None:
            first = rows[0] if rows else encoder.encode(0, source[0])
        while len(rows) < batch_size:
            rows.append({**first, "index": np.int64(-1), "ground_truth": "", "question": ""})
            valid.append(False)
        batch = _stack(rows)
        batch["valid"] = np.asarray(valid, bool)
        yield batch


def _stack(rows: Sequence[dict]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def eval_num_batches(num_records: int, batch_size: int, process_count: int = 1) -> int:
    """How many batches `make_eval_iterator` yields on every host."""
    per_host = _ceil_div(num_records, process_count)
    return _ceil_div(per_host, batch_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
