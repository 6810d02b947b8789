"""Countdown task (generator, safe parser, verifier, solver) and the embedded HF model directory."""

import json
import os
import time
from fractions import Fraction

import numpy as np
import pytest

from stare_jax.tasks import countdown as cd


# --------------------------------------------------------------------------- countdown


def test_generator_deterministic_and_solvable():
    cfg = cd.CountdownConfig()
    a = cd.generate_problems(7, 60, config=cfg)
    b = cd.generate_problems(7, 60, config=cfg)
    assert a == b
    assert a != cd.generate_problems(8, 60, config=cfg)
    assert a != cd.generate_problems(7, 60, config=cfg, split="test")
    for problem, reference in a:
        assert cfg.min_numbers <= len(problem.numbers) <= cfg.max_numbers
        assert all(1 <= n <= cfg.max_number for n in problem.numbers)
        assert cfg.min_target <= problem.target <= cfg.max_target
        assert problem.target not in problem.numbers
        assert cd.score(reference, problem) == 1.0
        assert cd.score(reference, problem.ground_truth) == 1.0
        assert len(problem.prompt) <= 20 and len(reference) <= 24
        assert cd.parse_problem(problem.prompt) == problem


def test_generator_difficulty_knobs():
    cfg = cd.CountdownConfig(min_numbers=5, max_numbers=5, max_number=20, min_target=50, max_target=200,
                             min_solutions=1)
    for problem, reference in cd.generate_problems(0, 10, config=cfg):
        assert len(problem.numbers) == 5 and max(problem.numbers) <= 20
        assert 50 <= problem.target <= 200
        assert cd.is_correct(reference, problem)
    with pytest.raises(ValueError):
        cd.CountdownConfig(min_numbers=4, max_numbers=3).validate()


def test_multiple_solutions_common():
    problems = cd.generate_problems(1, 40)
    counts = [cd.count_solutions(p, limit=3) for p, _ in problems]
    assert all(c >= 2 for c in counts)  # min_solutions=2 by default
    raw = cd.generate_problems(1, 40, config=cd.CountdownConfig(min_numbers=4, max_numbers=4, min_solutions=1))
    several = sum(cd.count_solutions(p, limit=2) >= 2 for p, _ in raw)
    assert several >= 0.75 * len(raw)
    for p, _ in problems[:10]:
        for s in cd.solutions(p, limit=5):
            assert cd.score(s, p) == 1.0


def test_verifier_hand_cases():
    p = "3 5 7 2=24"
    assert cd.score("(7-3)*(5+2)-4", p) == 0.0  # uses 4, not given
    assert cd.score("(3+5)*(7-2-2)", p) == 0.0  # 2 used twice
    assert cd.score("3*(5+7-2*2)", "3 5 7 2 2=24") == 1.0  # duplicated number may be used twice
    assert cd.score("(3+5)*(7-2)", p) == 0.0  # = 40
    assert cd.score("(7-5)*(3*2)*2", p) == 0.0
    assert cd.score("(5+7)*2", p) == 1.0  # at most once: 3 unused is fine
    assert cd.score(" (5 + 7) * 2 \n", p) == 1.0
    assert cd.score("((5+7))*2", p) == 1.0
    assert cd.score("2*(5+7)", p + ":") == 1.0
    assert cd.score("(5+7)*2=24", p) == 0.0  # trailing text
    assert cd.score("24", p) == 0.0
    assert cd.score("7*3+5-2", p) == 1.0
    assert cd.score("3/(7-5)*2*7", "3 7 5 2 7=21") == 1.0  # exact fractions
    assert cd.score("(3/2)*2*7", "3 2 2 7=21") == 1.0
    assert cd.score("7/3*3", "7 3 3=7") == 1.0
    assert cd.score("", p) == 0.0
    assert cd.parse_expression("7/3*3") == (Fraction(7), [7, 3, 3])
    assert cd.canonical_form("(3+5)*2") == cd.canonical_form("2*(5+3)")
    assert cd.canonical_form("3-5+7") == cd.canonical_form("7+3-5")
    assert cd.canonical_form("8/(4/2)") != cd.canonical_form("8/4/2")
    with pytest.raises(ValueError):
        cd.parse_problem("hello")


@pytest.mark.parametrize("bad", [
    "__import__('os').system('true')", "os.system", "(3).__class__", "2**10000", "2**", "9**9**9", "a", "x+1",
    "1e5", "1.5*2", "-3+5", "+3", "3+", "(3+5", "3+5)", "()", "3 5", "1/0", "6/(3-3)", "99999",
    "(" * 20 + "1" + ")" * 20, "1+" * 40 + "1", "1" * 100, "9999*9999*9999", "3\x00", "３+5",
])
def test_parser_rejects(bad):
    t = time.perf_counter()
    with pytest.raises(cd.ParseError):
        cd.parse_expression(bad)
    assert cd.score(bad, "3 5 7 2=24") == 0.0
    assert time.perf_counter() - t < 0.1


def test_parser_non_string():
    with pytest.raises(cd.ParseError):
        cd.parse_expression(None)  # type: ignore[arg-type]
    assert cd.score(None, "3 5=8") == 0.0  # type: ignore[arg-type]


# --------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory):
    from stare_jax.tasks import embedded
    path = str(tmp_path_factory.mktemp("emb") / "model")
    return embedded.create_embedded_model(path, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64, seed=3)


def test_char_tokenizer_round_trip(embedded_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    assert not getattr(tok, "chat_template", None)
    assert len(tok) == 4 + len(cd.ALPHABET)
    for p, ref in cd.generate_problems(0, 20):
        for text in (p.prompt, ref, p.prompt + ref):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == len(text)
            assert tok.decode(ids) == text
        with_special = tok.encode(p.prompt)
        assert with_special[0] == tok.bos_token_id and len(with_special) == len(p.prompt) + 1
        assert tok.decode(with_special + [tok.eos_token_id], skip_special_tokens=True) == p.prompt
    assert tok.encode("(3+5)*2", add_special_tokens=False) == [4 + cd.ALPHABET.index(c) for c in "(3+5)*2"]


def test_embedded_model_round_trip(embedded_dir):
    import transformers
    from stare_jax.models import from_pretrained
    from stare_jax.tasks import embedded

    with open(os.path.join(embedded_dir, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["Qwen2ForCausalLM"]
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]) == \
        (32, 2, 4, 2)
    assert transformers.AutoConfig.from_pretrained(embedded_dir).model_type == "qwen2"
    policy = from_pretrained(embedded_dir)
    assert policy.config.vocab_size == len(policy.tokenizer) == hf["vocab_size"]
    assert policy.config.eos_token_ids == (2,)
    ids, mask, _ = embedded.sft_batch(policy.tokenizer, [("3 5 7 2=24:", "(5+7)*2"), ("1 2=3:", "1+2")], 16)
    assert mask[1].sum() == 1 + 6 + 3 + 1 and ids[1, -1] == 2
    logits = np.asarray(policy(ids, mask))
    assert logits.shape == (2, 16, policy.config.vocab_size) and np.isfinite(logits).all()
    # Idempotent: a second call with the same arguments does nothing.
    mtime = os.path.getmtime(os.path.join(embedded_dir, "model.safetensors"))
    assert embedded.create_embedded_model(embedded_dir, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=64, seed=3) == embedded_dir
    assert os.path.getmtime(os.path.join(embedded_dir, "model.safetensors")) == mtime
    with pytest.raises(ValueError, match="different arguments"):
        embedded.create_embedded_model(embedded_dir, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=64, seed=4)


def test_embedded_refuses_foreign_dir(tmp_path):
    from stare_jax.tasks import embedded
    (tmp_path / "x.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        embedded.create_embedded_model(str(tmp_path))
    assert (tmp_path / "x.txt").read_text() == "mine"


def test_embedded_warmup_lowers_loss(tmp_path):
    """A few supervised steps run and the model still round-trips (the warm start path)."""
    import jax.numpy as jnp
    import optax
    from stare_jax.models import from_pretrained
    from stare_jax.tasks import embedded

    kw = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    cold = from_pretrained(embedded.create_embedded_model(str(tmp_path / "cold"), **kw))
    warm = from_pretrained(embedded.create_embedded_model(str(tmp_path / "warm"), warmup_steps=30,
                                                          warmup_batch_size=32, warmup_lr=1e-2, **kw))
    pairs = [(p.prompt, r) for p, r in cd.generate_problems(5, 32, split="test")]
    ids, mask, lm = embedded.sft_batch(cold.tokenizer, pairs, 32)

    def loss(policy):
        logits = jnp.asarray(policy(ids[:, :-1], mask[:, :-1]))
        ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]))
        return float((ce * lm[:, 1:]).sum() / lm[:, 1:].sum())

    assert loss(warm) < loss(cold) - 0.5
