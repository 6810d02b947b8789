"""The persistent compilation cache (`compilation_cache_dir`): a later run loads the programs an
earlier one compiled, trains identically, and a kill mid-write never leaves a partial entry."""

import os

import pytest

from stare_jax import compilation
from stare_jax.writers import read_jsonl
from tests.e2e_helpers import comparable, run_train, tiny_overrides


def test_cache_entries_are_renamed_into_place_so_a_failed_write_leaves_none(tmp_path, monkeypatch):
    from jax._src import lru_cache

    compilation._make_writes_atomic(str(tmp_path))
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("a", b"x" * 1000)
    assert (tmp_path / "a-cache").read_bytes() == b"x" * 1000
    assert sorted(os.listdir(tmp_path)) == ["a-cache"]

    def die(src, dst):  # the process dies between writing the entry and publishing it
        raise KeyboardInterrupt

    monkeypatch.setattr(compilation.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        cache.put("b", b"y" * 1000)
    assert sorted(os.listdir(tmp_path)) == ["a-cache"]  # no entry "b", no temporary file
    assert cache.get("b") is None


def test_a_second_run_loads_the_first_runs_programs_and_trains_the_same(tiny_model, tmp_path):
    model, data = tiny_model
    cache = str(tmp_path / "xla")
    overrides = tiny_overrides(model, data, total_steps=2, checkpoint_every=2, compilation_cache_dir=cache)
    first = run_train(str(tmp_path / "a"), overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    entries = [f for f in os.listdir(cache) if f.endswith("-cache")]
    assert entries and not [f for f in os.listdir(cache) if f.endswith(".tmp")]
    assert "from the compilation cache" not in first.stderr
    second = run_train(str(tmp_path / "b"), overrides)
    assert second.returncode == 0, second.stderr[-3000:]
    line = [x for x in second.stderr.splitlines() if "from the compilation cache" in x]
    assert len(line) == 1 and f"compilation cache {cache}" in line[0], second.stderr[-3000:]
    assert int(line[0].split("loaded ")[1].split(" XLA")[0]) >= 2  # at least the rollout and the update
    rows = read_jsonl(os.path.join(str(tmp_path / "b"), "metrics.jsonl"))
    assert rows[0]["compilations"] > 0  # a loaded program still counts as built for this process
    assert comparable(rows) == comparable(read_jsonl(os.path.join(str(tmp_path / "a"), "metrics.jsonl")))


def test_a_cache_dir_that_is_a_file_is_refused_with_one_line(tiny_model, tmp_path):
    model, data = tiny_model
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_train(str(tmp_path / "run"), tiny_overrides(model, data, total_steps=1,
                                                         compilation_cache_dir=str(blocker)))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "compilation_cache_dir" in r.stderr
