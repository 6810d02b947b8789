"""Math prompt files (JSONL/JSON/parquet), TFDS builders, and the grain prompt pipeline."""

import json

import numpy as np
import pytest

from stare_jax.data import builders, pipeline, records
from stare_jax.data.records import DataFormatError

DAPO_Q = ("Solve the following math problem step by step. The last line of your response should be of the form "
          "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $1+1$?\n\n"
          "Remember to put your answer on its own line after \"Answer:\"")


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _math_rows(n, offset=0):
    return [{"problem": f"Compute {i} + {i}.", "answer": str(2 * i)} for i in range(offset, offset + n)]


# --------------------------------------------------------------------------- records


def test_dataset_layouts(tmp_path):
    dapo = _jsonl(tmp_path / "dapo.jsonl", [{
        "data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_Q}],
        "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a"}}])
    gsm = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": "Tom has 3 apples...", "answer": "3 + 4 = 7\n#### 1,007"}])
    math500 = _jsonl(tmp_path / "math500.jsonl", [{
        "problem": "Find x.", "solution": "So $x=\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
        "subject": "Algebra", "level": 2}])
    math_sol = _jsonl(tmp_path / "math.jsonl", [{
        "problem": "Find y.", "solution": "First \\boxed{1}, finally $y = \\boxed{\\{1, \\sqrt{2}\\}}$."}])
    aime = _jsonl(tmp_path / "aime.jsonl", [{"ID": "2024-I-1", "Problem": "Every morning...", "Answer": 204}])
    (rec,) = records.read_records(dapo)
    assert rec["question"] == "What is $1+1$?" and rec["ground_truth"] == "2"
    assert rec["source"] == f"{dapo}: line 1"
    assert next(records.read_records(gsm))["ground_truth"] == "1007"
    assert next(records.read_records(math500))["ground_truth"] == "\\frac{1}{2}"
    assert next(records.read_records(math_sol))["ground_truth"] == "\\{1, \\sqrt{2}\\}"
    aime_rec = next(records.read_records(aime))
    assert aime_rec["question"] == "Every morning..." and aime_rec["ground_truth"] == "204"


def test_parquet_and_json_array(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"Q{i}"}],
             "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(3)]
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = list(records.read_records(path))
    assert [(r["question"], r["ground_truth"]) for r in got] == [("Q0", "0"), ("Q1", "1"), ("Q2", "2")]
    assert got[2]["source"] == f"{path}: row 3"
    arr = tmp_path / "list.json"
    arr.write_text(json.dumps([{"question": "a", "ground_truth": "1"}, {"question": "b", "ground_truth": 2.5}]))
    assert [r["ground_truth"] for r in records.read_records(str(arr))] == ["1", "2.5"]


def test_record_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataFormatError, match=f"{empty}.*empty"):
        list(records.read_records(str(empty)))
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty.parquet"):
        list(records.read_records(str(tmp_path / "empty.parquet")))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, "", '{"question": "b", "answer": '])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl: line 3: malformed JSON"):
        list(records.read_records(bad))
    missing = _jsonl(tmp_path / "missing.jsonl", [{"question": "a", "answer": "1"}, {"text": "b", "label": 1}])
    with pytest.raises(DataFormatError, match=r"missing\.jsonl: line 2: no usable question or answer.*\['label', 'text'\]"):
        list(records.read_records(missing))
    no_box = _jsonl(tmp_path / "nobox.jsonl", [{"problem": "a", "solution": "no box here"}])
    with pytest.raises(DataFormatError, match=r"nobox\.jsonl: line 1: no usable answer.*\['problem', 'solution'\]"):
        list(records.read_records(no_box))
    not_obj = _jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DataFormatError, match="line 1: expected a JSON object"):
        list(records.read_records(not_obj))
    with pytest.raises(DataFormatError, match="no such file"):
        list(records.read_records(str(tmp_path / "nope.jsonl")))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match="unsupported file type"):
        list(records.read_records(str(tmp_path / "x.csv")))


# --------------------------------------------------------------------------- TFDS builders


def test_countdown_builder(tmp_path):
    import tensorflow_datasets as tfds
    from stare_jax.tasks import countdown as cd

    kw = dict(seed=3, train_size=60, test_size=20)
    train = builders.countdown_source(str(tmp_path), "train", **kw)
    test = builders.countdown_source(str(tmp_path), "test", **kw)
    assert len(train) == 60 and len(test) == 20
    name = builders.countdown_builder(str(tmp_path), **kw).builder_config.name
    again = tfds.data_source(f"stare_countdown/{name}", split="train", data_dir=str(tmp_path))
    assert [again[i]["question"] for i in range(60)] == [train[i]["question"] for i in range(60)]
    keys = lambda src: {(tuple(sorted(cd.parse_problem(r["ground_truth"].decode()).numbers)),
                         cd.parse_problem(r["ground_truth"].decode()).target) for r in src}
    assert not keys(train) & keys(test)
    for i in range(len(test)):
        r = test[i]
        assert cd.score(r["solution"].decode(), r["ground_truth"].decode()) == 1.0
        assert r["question"].decode() == r["ground_truth"].decode() + ":"


def test_building_a_dataset_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    """TFDS makes an empty `tmp*tfds` directory whenever a builder is constructed for a directory
    not yet prepared and never removes it; the builders construct theirs inside a private
    temporary directory that goes afterwards, and Python's own temporary directory is restored."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    builders.countdown_source(str(tmp_path / "a"), "train", seed=0, train_size=8, test_size=2)
    builders.arith_source(str(tmp_path / "b"), "train", seed=0, train_size=8, test_size=2)
    builders.math_source(str(tmp_path / "c"), "train",
                         splits={"train": [_jsonl(tmp_path / "m.jsonl", _math_rows(3))]}, name="m")
    assert tempfile.tempdir == str(tmp) and list(tmp.iterdir()) == []


def test_math_builder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow_datasets as tfds

    a = _jsonl(tmp_path / "a.jsonl", _math_rows(5))
    b = str(tmp_path / "b.parquet")
    pq.write_table(pa.Table.from_pylist(_math_rows(4, offset=10)), b)
    t = _jsonl(tmp_path / "t.jsonl", [{"question": "Q?", "answer": "#### 9"}])
    splits = {"train": [a, b], "test": t}
    data_dir = str(tmp_path / "tfds")
    src = builders.math_source(data_dir, "train", splits=splits, name="mine")
    assert len(src) == 9
    got = sorted((r["question"].decode(), r["ground_truth"].decode()) for r in (src[i] for i in range(9)))
    want = sorted((r["problem"], r["answer"]) for r in _math_rows(5) + _math_rows(4, offset=10))
    assert got == want
    test = tfds.data_source("stare_math_prompts/mine", split="test", data_dir=data_dir)
    assert len(test) == 1 and test[0]["ground_truth"] == b"9"
    # Same name, different contents: refused instead of silently reusing stale data.
    _jsonl(tmp_path / "a.jsonl", _math_rows(6))
    with pytest.raises(DataFormatError, match="different source files"):
        builders.math_source(data_dir, "train", splits=splits, name="mine")
    # A bad file fails the build with its name and line.
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "x", "answer": "1"}, "{oops"])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl: line 2"):
        builders.math_source(data_dir, "train", splits={"train": [bad]})


# --------------------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def char_tok():
    from stare_jax.tasks import embedded
    return embedded.build_char_tokenizer()


def _countdown_records(n, seed=0):
    from stare_jax.tasks import countdown as cd
    return [{"question": p.prompt.encode(), "ground_truth": p.ground_truth.encode()}
            for p, _ in cd.generate_problems(seed, n, config=cd.CountdownConfig(min_solutions=1))]


def _iter(src, tok, **kw):
    args = dict(tokenizer=tok, batch_size=4, max_prompt_len=16, seed=0, process_index=0, process_count=1,
                prompt_style="plain")
    args.update(kw)
    return pipeline.make_prompt_iterator(src, **args)


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_prompt_batches(char_tok):
    src = _countdown_records(10)
    it = _iter(src, char_tok)
    batch = next(it)
    assert batch["prompt_ids"].dtype == np.int32 and batch["prompt_ids"].shape == (4, 16)
    assert batch["prompt_mask"].dtype == np.int32 and batch["prompt_mask"].shape == (4, 16)
    for row in range(4):
        ids, mask, i = batch["prompt_ids"][row], batch["prompt_mask"][row], int(batch["index"][row])
        n = int(mask.sum())
        assert (mask[:16 - n] == 0).all() and (mask[16 - n:] == 1).all()  # left-padded
        assert (ids[:16 - n] == char_tok.pad_token_id).all() and ids[16 - n] == char_tok.bos_token_id
        assert char_tok.decode(ids[16 - n:], skip_special_tokens=True) == src[i]["question"].decode()
        assert batch["ground_truth"][row] == src[i]["ground_truth"].decode()
        assert batch["prompt_len"][row] == n and not batch["truncated"][row]


def test_iterator_deterministic_and_epochs(char_tok):
    src = _countdown_records(12)
    a = [b["index"].tolist() for b in _take(_iter(src, char_tok, seed=5), 9)]
    b = [b["index"].tolist() for b in _take(_iter(src, char_tok, seed=5), 9)]
    c = [b["index"].tolist() for b in _take(_iter(src, char_tok, seed=6), 9)]
    assert a == b and a != c
    flat = sum(a, [])
    epochs = [flat[k * 12:(k + 1) * 12] for k in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)  # each epoch sees every record once
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    unshuffled = sum([b["index"].tolist() for b in _take(_iter(src, char_tok, shuffle=False), 3)], [])
    assert unshuffled == list(range(12))


def test_host_sharding_slices_the_same_global_batches(char_tok):
    src = _countdown_records(21)
    single = [b["index"].tolist() for b in _take(_iter(src, char_tok, batch_size=10, process_index=0,
                                                        process_count=1, seed=1), 4)]
    per_host = [[b["index"].tolist() for b in _take(_iter(src, char_tok, batch_size=5, process_index=pi,
                                                          process_count=2, seed=1), 4)] for pi in range(2)]
    for b in range(4):
        assert not set(per_host[0][b]) & set(per_host[1][b])          # hosts read disjoint rows
        assert per_host[0][b] + per_host[1][b] == single[b]           # ... of the same global batch
    assert list(pipeline.host_indices(21, 1, 2)) == list(range(1, 20, 2))
    with pytest.raises(ValueError):
        _iter(src, char_tok, process_index=2, process_count=2)


def test_exact_resume(char_tok):
    src = _countdown_records(13)
    it = _iter(src, char_tok, seed=9)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 6)
    fresh = _iter(src, char_tok, seed=9)
    fresh.set_state(state)
    for want, got in zip(expected, _take(fresh, 6)):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])


def test_resume_through_orbax(char_tok, tmp_path):
    import grain
    import orbax.checkpoint as ocp

    src = _countdown_records(13)
    it = _iter(src, char_tok, seed=2)
    _take(it, 3)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = [b["index"].tolist() for b in _take(it, 4)]
    fresh = _iter(src, char_tok, seed=2)
    mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    assert [b["index"].tolist() for b in _take(fresh, 4)] == expected
    mngr.close()


def test_truncation(char_tok):
    src = [{"question": "1 2 3 4 5 6 7 8 9=45:", "ground_truth": "1 2 3 4 5 6 7 8 9=45"}]
    batch = next(_iter(src, char_tok, batch_size=2, max_prompt_len=8))
    assert batch["truncated"].all() and (batch["prompt_len"] == 22).all() and batch["prompt_mask"].all()
    assert char_tok.decode(batch["prompt_ids"][0]) == src[0]["question"][-8:]
    with pytest.raises(ValueError, match="record 0: prompt has 22 tokens"):
        next(_iter(src, char_tok, batch_size=2, max_prompt_len=8, truncation="error"))


def test_math_prompt_format():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", eos_token="<|end|>")
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = pipeline.format_prompt("What is 1+1?", tok, style="math")
    assert text == "<|user|>What is 1+1?\n" + pipeline.MATH_INSTRUCTION + "<|end|><|assistant|>"
    assert pipeline.format_prompt("3 4=7:", tok, style="plain") == "3 4=7:"
    assert pipeline.format_prompt("Q", None, style="math") == "Q\n" + pipeline.MATH_INSTRUCTION
    batch = next(pipeline.make_prompt_iterator(
        [{"question": "What is 1+1?", "ground_truth": "2"}], tokenizer=tok, batch_size=1, max_prompt_len=128,
        seed=0, process_index=0, process_count=1, prompt_style="math"))
    n = int(batch["prompt_mask"].sum())
    assert tok.decode(batch["prompt_ids"][0, -n:]) == text
    assert batch["ground_truth"].tolist() == ["2"]


def test_eval_iterator(char_tok):
    src = _countdown_records(11)
    per_host = [list(pipeline.make_eval_iterator(src, tokenizer=char_tok, batch_size=4, max_prompt_len=16,
                                                 process_index=pi, process_count=2, prompt_style="plain"))
                for pi in range(2)]
    assert len(per_host[0]) == len(per_host[1]) == pipeline.eval_num_batches(11, 4, 2) == 2
    seen = []
    for batches in per_host:
        for b in batches:
            assert b["prompt_ids"].shape == (4, 16) and b["valid"].dtype == bool
            seen += b["index"][b["valid"]].tolist()
            assert (b["index"][~b["valid"]] == -1).all()
    assert sorted(seen) == list(range(11))
    again = list(pipeline.make_eval_iterator(src, tokenizer=char_tok, batch_size=4, max_prompt_len=16,
                                             process_index=0, process_count=2, prompt_style="plain"))
    assert [b["index"].tolist() for b in again] == [b["index"].tolist() for b in per_host[0]] == \
        [[0, 2, 4, 6], [8, 10, -1, -1]]


def test_pipeline_over_tfds_source(char_tok, tmp_path):
    src = builders.countdown_source(str(tmp_path), "train", seed=0, train_size=16, test_size=4)
    batch = next(_iter(src, char_tok, batch_size=8))
    from stare_jax.tasks import countdown as cd
    for gt in batch["ground_truth"]:
        cd.parse_problem(gt)
    assert batch["prompt_mask"].sum(1).min() > 5
