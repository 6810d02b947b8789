"""TFDS builders (array_record, no TensorFlow needed) for the countdown task and math prompt files.

Both write records with (at least) the text features `question`, `ground_truth` and `source`:

- `stare_countdown`: generated countdown problems; `question` is the plain prompt ("3 5 7 2=24:"),
  `ground_truth` the problem ("3 5 7 2=24"), plus the reference `solution` and the `target`. The
  test split is generated first and train problems equal to a test problem are skipped, so the
  splits are disjoint.
- `stare_math_prompts`: questions and reference answers read from local JSONL/JSON/parquet files
  (DAPO-Math-17k, GSM8K, MATH-500, AIME, ...; see `stare_jax.data.records`), one split per list
  of files.

Typical use (building is idempotent and fast when already built):

    src = countdown_source(data_dir, "train", seed=0, train_size=10_000, test_size=500)
    src = math_source(data_dir, "train", name="dapo", splits={"train": ["dapo.parquet"]})
    len(src), src[0]  # random access: {"question": b"...", "ground_truth": b"...", ...}

Text features come back as `bytes`; `stare_jax.data.pipeline` decodes them. With several
processes, build once (process 0 on a shared filesystem, then synchronise) or per host on local disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from stare_jax.data.records import DataFormatError, read_records
from stare_jax.tasks import arithmetic, countdown
from stare_jax.writers import quiet_known_notices

FILE_FORMAT = "array_record"
_FINGERPRINT_FILE = "stare_sources.json"


quiet_known_notices()  # TFDS's "Using custom data configuration" at every start (stare_jax.writers)


# --------------------------------------------------------------------------- countdown


@dataclasses.dataclass(eq=False)
class CountdownBuilderConfig(tfds.core.BuilderConfig):
    """Sizes, seed and difficulty of a generated countdown dataset."""

    seed: int = 0
    train_size: int = 10_000
    test_size: int = 500
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 9
    min_target: int = 2
    max_target: int = 50
    min_solutions: int = 2

    def task_config(self) -> countdown.CountdownConfig:
        """The generator knobs as a `CountdownConfig`."""
        return countdown.CountdownConfig(
            min_numbers=self.min_numbers, max_numbers=self.max_numbers, max_number=self.max_number,
            min_target=self.min_target, max_target=self.max_target, min_solutions=self.min_solutions).validate()


class StareCountdown(tfds.core.GeneratorBasedBuilder):
    """Generated countdown problems: splits `train` and `test` (disjoint)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [CountdownBuilderConfig(name="default")]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Countdown: reach the target with + - * / using each number at most once.",
            features=tfds.features.FeaturesDict({
                "question": tfds.features.Text(),
                "ground_truth": tfds.features.Text(),
                "solution": tfds.features.Text(),
                "source": tfds.features.Text(),
                "target": np.int32,
            }),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        test, train = countdown_splits(self.builder_config)
        return {"train": self._generate_examples(train, "train"), "test": self._generate_examples(test, "test")}

    def _generate_examples(self, items, split):
        for i, (problem, solution) in items:
            yield f"{split}-{i}", {"question": problem.prompt, "ground_truth": problem.ground_truth,
                                   "solution": solution, "source": f"countdown/{split}/{i}",
                                   "target": np.int32(problem.target)}


def countdown_splits(cfg: CountdownBuilderConfig):
    """(test, train) lists of (generator index, (problem, reference answer)), train minus test."""
    task = cfg.task_config()
    test = [(i, countdown.generate_problem(cfg.seed, i, config=task, split="test")) for i in range(cfg.test_size)]
    held_out = {(tuple(sorted(p.numbers)), p.target) for _, (p, _) in test}
    train = []
    i = 0
    while len(train) < cfg.train_size:
        item = countdown.generate_problem(cfg.seed, i, config=task, split="train")
        if (tuple(sorted(item[0].numbers)), item[0].target) not in held_out:
            train.append((i, item))
        i += 1
        if i > 20 * cfg.train_size + 1000:
            raise ValueError(f"countdown: cannot find {cfg.train_size} training problems outside the test "
                             f"split with {task}; widen the difficulty knobs")
    return test, train


def countdown_builder(data_dir: str, *, seed: int = 0, train_size: int = 10_000, test_size: int = 500,
                      task: countdown.CountdownConfig = countdown.CountdownConfig(),
                      name: str | None = None) -> StareCountdown:
    """The (un-prepared) countdown builder for these settings; the config name defaults to one
    derived from them, so different settings never share a directory."""
    knobs = dataclasses.asdict(task)
    if name is None:
        digest = _digest({"seed": seed, "train": train_size, "test": test_size, **knobs})
        name = f"s{seed}_n{train_size}_t{test_size}_{digest[:8]}"
    cfg = CountdownBuilderConfig(name=name, seed=seed, train_size=train_size, test_size=test_size, **knobs)
    with _private_tempdir():
        return StareCountdown(data_dir=os.path.abspath(data_dir), config=cfg, file_format=FILE_FORMAT)


def countdown_source(data_dir: str, split: str, **kwargs):
    """Builds (once) and returns the random-access data source of a countdown split.
    `kwargs` are those of `countdown_builder`."""
    return prepare(countdown_builder(data_dir, **kwargs)).as_data_source(split=split)


# --------------------------------------------------------------------------- arithmetic word problems


@dataclasses.dataclass(eq=False)
class ArithBuilderConfig(tfds.core.BuilderConfig):
    """Sizes, seed and difficulty of a generated arithmetic word-problem dataset."""

    seed: int = 0
    train_size: int = 10_000
    test_size: int = 128
    min_ops: int = 1
    max_ops: int = 1
    max_number: int = 9
    ops: str = "+-"
    word_frac: float = 1.0
    distractors: int = 0

    def task_config(self) -> arithmetic.ArithConfig:
        """The generator knobs as an `ArithConfig`."""
        return arithmetic.ArithConfig(min_ops=self.min_ops, max_ops=self.max_ops, max_number=self.max_number,
                                      ops=self.ops, word_frac=self.word_frac, distractors=self.distractors).validate()


class StareArith(tfds.core.GeneratorBasedBuilder):
    """Generated arithmetic word problems: splits `train` and `test` (no question text in both)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [ArithBuilderConfig(name="default")]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Arithmetic word problems (GSM-style, generated from templates); integer answers.",
            features=tfds.features.FeaturesDict({
                "question": tfds.features.Text(),
                "ground_truth": tfds.features.Text(),
                "expression": tfds.features.Text(),
                "source": tfds.features.Text(),
            }),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        test, train = arith_splits(self.builder_config)
        return {"train": self._generate_examples(train, "train"), "test": self._generate_examples(test, "test")}

    def _generate_examples(self, items, split):
        for i, problem in items:
            yield f"{split}-{i}", {"question": problem.question, "ground_truth": problem.ground_truth,
                                   "expression": problem.expression, "source": f"arith/{split}/{i}"}


def arith_splits(cfg: ArithBuilderConfig):
    """(test, train) lists of (generator index, problem); training problems whose question text is a
    test question are skipped, so no held-out question is trained on."""
    task = cfg.task_config()
    test, seen = [], set()
    i = 0
    while len(test) < cfg.test_size:  # distinct held-out questions
        p = arithmetic.generate_problem(cfg.seed, i, config=task, split="test")
        if p.question not in seen:
            seen.add(p.question)
            test.append((i, p))
        i += 1
        if i > 50 * cfg.test_size + 1000:
            raise ValueError(f"arith: cannot find {cfg.test_size} distinct test problems with {task}")
    train = []
    i = 0
    while len(train) < cfg.train_size:
        p = arithmetic.generate_problem(cfg.seed, i, config=task, split="train")
        if p.question not in seen:
            train.append((i, p))
        i += 1
        if i > 20 * cfg.train_size + 1000:
            raise ValueError(f"arith: cannot find {cfg.train_size} training problems outside the test split "
                             f"with {task}; widen the difficulty knobs")
    return test, train


def arith_builder(data_dir: str, *, seed: int = 0, train_size: int = 10_000, test_size: int = 128,
                  task: arithmetic.ArithConfig = arithmetic.ArithConfig(), name: str | None = None) -> StareArith:
    """The (un-prepared) arithmetic builder for these settings (config name derived from them)."""
    knobs = dataclasses.asdict(task.validate())
    if name is None:
        digest = _digest({"seed": seed, "train": train_size, "test": test_size, **knobs})
        name = f"s{seed}_n{train_size}_t{test_size}_{digest[:8]}"
    cfg = ArithBuilderConfig(name=name, seed=seed, train_size=train_size, test_size=test_size, **knobs)
    with _private_tempdir():
        return StareArith(data_dir=os.path.abspath(data_dir), config=cfg, file_format=FILE_FORMAT)


def arith_source(data_dir: str, split: str, **kwargs):
    """Builds (once) and returns the random-access data source of an arithmetic split
    (`kwargs` are those of `arith_builder`)."""
    return prepare(arith_builder(data_dir, **kwargs)).as_data_source(split=split)


# --------------------------------------------------------------------------- math prompts


@dataclasses.dataclass(eq=False)
class MathPromptsConfig(tfds.core.BuilderConfig):
    """Which local files make which split: `splits` is a tuple of (split name, (paths...))."""

    splits: tuple = ()


class StareMathPrompts(tfds.core.GeneratorBasedBuilder):
    """Math questions with reference answers from local JSONL/JSON/parquet files."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS: list = []

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Math prompts (question, ground_truth) read from local files.",
            features=tfds.features.FeaturesDict({
                "question": tfds.features.Text(),
                "ground_truth": tfds.features.Text(),
                "source": tfds.features.Text(),
            }),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        splits = dict(self.builder_config.splits)
        if not splits:
            raise DataFormatError("stare_math_prompts: no files given (splits is empty)")
        # Read everything first: format errors surface before any file is written.
        return {split: self._generate_examples(_read_split(files)) for split, files in splits.items()}

    def _generate_examples(self, records):
        for key, rec in records:
            yield key, rec


def _read_split(files: Sequence[str]) -> list[tuple[str, dict]]:
    out = []
    for fi, path in enumerate(files):
        for j, rec in enumerate(read_records(path)):
            out.append((f"{fi}-{j}", rec))
    return out


def math_builder(data_dir: str, *, splits: Mapping[str, Sequence[str] | str], name: str | None = None
                 ) -> StareMathPrompts:
    """The (un-prepared) builder for `splits` ({"train": [files], "test": [files]}).

    `name` (the TFDS config name) defaults to one derived from the files' contents. `prepare`
    refuses to reuse a built `name` whose source files changed.
    """
    norm = tuple((str(s), tuple(os.path.abspath(f) for f in ([fs] if isinstance(fs, str) else fs)))
                 for s, fs in sorted(splits.items()))
    for split, files in norm:
        if not files:
            raise DataFormatError(f"stare_math_prompts: split {split!r} has no files")
        for f in files:
            if not os.path.isfile(f):
                raise DataFormatError(f"{f}: no such file (split {split!r})")
    fp = _files_fingerprint(norm)
    if name is None:
        name = f"files_{fp[:12]}"
    cfg = MathPromptsConfig(name=name, splits=norm, description=f"sources sha1 {fp}")
    with _private_tempdir():
        return StareMathPrompts(data_dir=os.path.abspath(data_dir), config=cfg, file_format=FILE_FORMAT)


def math_source(data_dir: str, split: str, *, splits: Mapping[str, Sequence[str] | str], name: str | None = None):
    """Builds (once) and returns the random-access data source of a math prompts split."""
    return prepare(math_builder(data_dir, splits=splits, name=name)).as_data_source(split=split)


def _files_fingerprint(norm) -> str:
    h = hashlib.sha1()
    for split, files in norm:
        h.update(split.encode())
        for f in files:
            h.update(os.path.basename(f).encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- common


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _private_tempdir():
    """Runs the block with Python's temporary directory pointed at a private one, removed after.

    TFDS 4.9 makes an empty `tempfile.mkdtemp("tfds")` directory whenever a builder is constructed
    for a directory not yet prepared (`DatasetInfo.initialize_from_bucket` creates it before it
    finds GCS disabled) and never removes it: one left in /tmp by every new run's data build.
    `tempfile.tempdir` is process-wide, so this is for start-up: the trainer builds its datasets
    before it starts its reward workers."""
    old = tempfile.tempdir
    root = tempfile.mkdtemp(prefix="stare_jax_tfds_")
    tempfile.tempdir = root
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _quiet():
    from tensorflow_datasets.core.utils import tqdm_utils
    old = tqdm_utils._active
    tqdm_utils._active = False
    try:
        yield
    finally:
        tqdm_utils._active = old


def prepare(builder: tfds.core.GeneratorBasedBuilder, *, quiet: bool = True):
    """`download_and_prepare` in array_record format (a no-op when already built); returns the builder.

    For math prompts, a directory built from different file contents under the same name is an
    error (use another name or delete the directory).
    """
    fp_file = os.path.join(str(builder.data_path), _FINGERPRINT_FILE)
    want = getattr(builder.builder_config, "description", None)
    if isinstance(builder, StareMathPrompts) and os.path.isfile(fp_file):
        with open(fp_file) as f:
            have = json.load(f).get("description")
        if have != want:
            raise DataFormatError(
                f"{builder.data_path} was built from different source files ({have}, now {want}); "
                "pass another name or delete that directory")
    with _quiet() if quiet else contextlib.nullcontext():
        builder.download_and_prepare(file_format=FILE_FORMAT)
    if isinstance(builder, StareMathPrompts) and not os.path.isfile(fp_file):
        with open(fp_file, "w") as f:
            json.dump({"description": want, "splits": [list(s) for s in builder.builder_config.splits]}, f)
    return builder
