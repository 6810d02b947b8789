"""The update's log-probs against the sampler's (`stare_jax.rl.policy_agreement`): an on-policy
step whose approx_kl is far above rounding gets one warning from the trainer, naming the step."""

import json
import logging
import math

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax import parallel
from stare_jax.rl.policy_agreement import (DISAGREEMENT_APPROX_KL, FULL_FLOAT32_APPROX_KL, disagreement_bound,
                                           disagreement_line)
from stare_jax.rl.update import make_update_step, response_token_stats
from tests.test_rl_update import (R, fresh_state, make_batch, make_config, mesh8,  # noqa: F401 (a fixture)
                                  model_stats_batch, params_of)
from tests.test_train_e2e import _config


def test_only_a_disagreement_far_above_rounding_is_reported():
    assert disagreement_line({"sampler_approx_kl": 3e-9}) is None
    assert disagreement_line({"sampler_approx_kl": 0.0027}) is None  # bfloat16's rounding (H100 recipe)
    assert disagreement_line({"sampler_approx_kl": DISAGREEMENT_APPROX_KL}) is None
    line = disagreement_line({"sampler_approx_kl": 0.267, "approx_kl": 0.0})
    assert line.startswith("the update's log-probs disagree with the sampler's") and "sampler_approx_kl 0.267" in line
    assert "model.cpu_gemm=ynnpack" in line and "\n" not in line
    assert disagreement_line({"sampler_approx_kl": math.nan}) is None  # a skipped step: nonfinite_skipped
    assert disagreement_line({"approx_kl": 0.267}) is None  # later mini-batches' drift is not a disagreement


def test_full_float32_phases_are_held_to_a_tighter_bound():
    """Both phases in full float32 (a float32 model on a CPU, or full-float32 products elsewhere)
    round to 3e-9 at most, so a disagreement of 0.0197 (a wrong program seen on a CPU) is reported
    there; bfloat16, TF32 and a TPU's default products keep the 0.05 bound."""
    assert disagreement_bound("float32", "default", "cpu") == FULL_FLOAT32_APPROX_KL == 1e-3
    assert disagreement_bound("float32", "float32", "gpu") == FULL_FLOAT32_APPROX_KL
    for args in (("bfloat16", "default", "cpu"), ("float32", "default", "gpu"), ("float32", "tensorfloat32", "gpu"),
                 ("float32", "default", "tpu"), ("bfloat16", "float32", "gpu")):
        assert disagreement_bound(*args) == DISAGREEMENT_APPROX_KL, args
    assert disagreement_line({"sampler_approx_kl": 0.0197}) is None
    line = disagreement_line({"sampler_approx_kl": 0.0197}, FULL_FLOAT32_APPROX_KL)
    assert "sampler_approx_kl 0.0197 (rounding gives < 0.001)" in line and "\n" not in line
    assert disagreement_line({"sampler_approx_kl": 3e-9}, FULL_FLOAT32_APPROX_KL) is None


def _k3(log_probs, old, mask):
    d = log_probs - old
    return float(np.sum(np.where(mask > 0, np.expm1(d) - d, 0.0)) / np.sum(mask > 0))


def test_both_update_paths_report_the_pre_update_policy_against_the_sampler(mesh8):
    """`sampler_approx_kl` is the same figure on the one-pass path (where it is the on-policy approx_kl)
    and on the path with several optimizer steps (computed from the no-grad first pass, whose own
    approx_kl measures the drift from that pass instead); a sampler whose log-probs are off by one
    nat reads (e - 1) - 1 = 0.718 on both."""
    batch = make_batch()
    one = make_update_step(make_config(), mesh8, fresh_state(make_config(), mesh8), donate=False)
    ts = fresh_state(make_config(), mesh8)
    state0 = nnx.state(ts)
    log_probs = np.asarray(response_token_stats(ts.model, batch["input_ids"], batch["attention_mask"], R,
                                                vocab_chunk=16).log_probs)
    for old in (log_probs, log_probs - 1.0):
        b = dict(batch, old_log_probs=old.astype(np.float32))
        want = _k3(log_probs, b["old_log_probs"], batch["response_mask"])
        _, m_one = one.apply(state0, parallel.shard_batch(b, mesh8), jax.random.key(0))
        assert float(m_one["sampler_approx_kl"]) == float(m_one["approx_kl"])
        config = make_config(**{"update.ppo_epochs": 2, "update.num_minibatches": 2})
        many = make_update_step(config, mesh8, fresh_state(config, mesh8), donate=False)
        _, m_many = many.apply(state0, parallel.shard_batch(b, mesh8), jax.random.key(0))
        for m in (m_one, m_many):
            np.testing.assert_allclose(float(m["sampler_approx_kl"]), want, rtol=1e-3, atol=1e-6)
    assert abs(want - (np.e - 2)) < 1e-6


def test_the_trainer_warns_once_when_the_sampler_and_the_update_disagree(tiny_model, tmp_path, monkeypatch, caplog):
    from stare_jax import trainer

    real_collect = trainer.collect_batch

    def collect_with_shifted_log_probs(*args, **kwargs):  # a sampler that reports other log-probs: off by
        # 0.2 nat, sampler_approx_kl (e^0.2 - 1) - 0.2 = 0.0214, under the 0.05 bound but above the
        # full-float32 one that this float32 model on a CPU is held to
        batch, metrics = real_collect(*args, **kwargs)
        batch = dict(batch, old_log_probs=np.asarray(batch["old_log_probs"]) - 0.2)
        return batch, metrics

    model, data = tiny_model
    config = _config(model, data, **{"total_steps": 2, "checkpoint_every": 2})
    with caplog.at_level(logging.WARNING, logger="stare_jax.trainer"):
        trainer.train(config, str(tmp_path / "agree"))
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]  # the real sampler agrees
    monkeypatch.setattr(trainer, "collect_batch", collect_with_shifted_log_probs)
    caplog.clear()
    three = _config(model, data, **{"total_steps": 3, "checkpoint_every": 1})
    with caplog.at_level(logging.WARNING, logger="stare_jax.trainer"):
        trainer.train(three, str(tmp_path / "disagree"))
    warned = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 0: the update's log-probs disagree"), warned
    assert "(rounding gives < 0.001)" in warned[0], warned
    # On a CPU with Eigen's products (model.cpu_gemm = "auto") the update is rebuilt on XLA's defaults
    # after the disagreeing step, once, recorded in that step's row; the next step's compilation is
    # not reported as a shape change, and the run ends
    messages = [r.getMessage() for r in caplog.records]
    rebuilt = [m for m in messages if "rebuilt on XLA:CPU's default kernels" in m]
    assert len(rebuilt) == 1 and rebuilt[0].startswith("step 0: the update step is rebuilt"), messages
    assert "a resumed one included" in rebuilt[0] and not [m for m in messages if "shapes changed" in m], messages
    rows = [json.loads(line) for line in open(tmp_path / "disagree" / "metrics.jsonl")]
    # later steps' sampler disagrees again: on the rebuilt update (no Eigen's products) nothing more is rebuilt
    assert [r.get("cpu_gemm_fallback") for r in rows] == [1, None, None] and rows[1]["compilations"] == 0
    assert rows[1]["sampler_approx_kl"] > 1e-3  # (the rebuilt update compiled in step 0, which ran on it)
    # The disagreeing step on Eigen's products was left undone by the update's guard and ran again
    # on XLA's defaults: the run equals one on XLA's defaults from its start, metric for metric
    assert "; the step, left undone, runs again on them" in rebuilt[0]
    assert rows[0]["eigen_sampler_approx_kl"] == pytest.approx(math.expm1(0.2) - 0.2, rel=1e-3)
    assert "disagreement_rejected" not in rows[0]
    trainer.train(_config(model, data, **{"total_steps": 3, "checkpoint_every": 1, "model.cpu_gemm": "ynnpack"}),
                  str(tmp_path / "defaults"))
    defaults = [json.loads(line) for line in open(tmp_path / "defaults" / "metrics.jsonl")]
    for got, want in zip(rows, defaults, strict=True):
        for key in ("loss", "sampler_approx_kl", "entropy", "grad_norm", "stare_w"):
            assert got[key] == want[key], (key, got[key], want[key])
    agree_rows = [json.loads(line) for line in open(tmp_path / "agree" / "metrics.jsonl")]
    assert not any("cpu_gemm_fallback" in r for r in agree_rows)
    # Stopped after step 1 and resumed, the run keeps the fallback (kept in its checkpoints) and
    # continues as the uninterrupted one did: step 2 on the same kernels, nothing rebuilt again
    trainer.train(_config(model, data, **{"total_steps": 2, "checkpoint_every": 1}), str(tmp_path / "resumed"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stare_jax.trainer"):
        trainer.train(three, str(tmp_path / "resumed"))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("the update runs on XLA:CPU's default kernels (model.cpu_gemm=ynnpack), as it has "
                            "since step 0's disagreement") for m in messages), messages
    assert not [m for m in messages if "rebuilt on XLA:CPU's default kernels" in m], messages
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [r.get("cpu_gemm_fallback") for r in resumed] == [1, None, None]
    for key in ("loss", "sampler_approx_kl", "entropy", "grad_norm"):
        assert resumed[2][key] == rows[2][key], (key, resumed[2][key], rows[2][key])
    # With the sequences longer than model.attention_block the update compiles without Eigen's
    # products (cpu_gemm.compiler_options(blockwise=True)): a disagreement is warned, nothing rebuilt
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stare_jax.trainer"):
        trainer.train(_config(model, data, **{"total_steps": 1, "checkpoint_every": 1, "model.attention_block": 4}),
                      str(tmp_path / "blocks"))
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "disagree" in m] and not [m for m in messages if "rebuilt" in m], messages
    assert not any("cpu_gemm_fallback" in json.loads(line) for line in open(tmp_path / "blocks" / "metrics.jsonl"))


@pytest.mark.parametrize("overrides", [{}, {"update.grad_accum": 2},
                                       {"update.ppo_epochs": 2, "update.num_minibatches": 2,
                                        "update.old_stats": "recompute"}])
def test_the_disagreement_guard_leaves_a_disagreeing_step_undone(mesh8, overrides):
    """With `reject_disagreement` (the trainer's update) a step whose program runs Eigen's products
    and whose `sampler_approx_kl` is above the full-float32 bound is a no-op: parameters, optimizer
    state, controller and step counter as they were, `disagreement_rejected` 1, on the one-pass
    path, with the sampler's statistics and with the pre-pass; an agreeing batch steps as without
    the guard (to float rounding: another program), and a program on XLA's defaults has no guard."""
    config = make_config(**overrides)
    agreeing, shifted = model_stats_batch(config, mesh8), model_stats_batch(config, mesh8, shift=0.2)
    ts = fresh_state(config, mesh8)
    guarded = make_update_step(config, mesh8, ts, donate=False, reject_disagreement=True)
    plain = make_update_step(config, mesh8, ts, donate=False)
    state0 = nnx.state(ts)

    def apply(step, b):
        new_state, m = step.apply(state0, parallel.shard_batch(b, mesh8), jax.random.key(0))
        return {k: float(v) for k, v in m.items()}, nnx.merge(step.graphdef, new_state)

    m_ok, ts_ok = apply(guarded, agreeing)
    m_plain, ts_plain = apply(plain, agreeing)
    assert m_ok["disagreement_rejected"] == 0.0 and "disagreement_rejected" not in m_plain
    assert m_ok["sampler_approx_kl"] < 1e-6 and int(ts_ok.step[...]) == 1
    for got, want in zip(jax.tree_util.tree_leaves(params_of(ts_ok)), jax.tree_util.tree_leaves(params_of(ts_plain)),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)  # two programs: float rounding
    m_bad, ts_bad = apply(guarded, shifted)
    assert m_bad["disagreement_rejected"] == 1.0 and m_bad["nonfinite_skipped"] == 0.0
    assert m_bad["sampler_approx_kl"] == pytest.approx(math.expm1(0.2) - 0.2, rel=1e-3)
    for got, want in zip(jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(ts_bad))),
                         jax.tree_util.tree_leaves(nnx.to_pure_dict(state0)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # params, optimizer, controller, step
    m_applied, ts_applied = apply(plain, shifted)  # without the guard the same batch steps
    assert int(ts_applied.step[...]) == 1 and int(ts_applied.optimizer.step[...]) > 0
    defaults = make_config(**overrides, **{"model.cpu_gemm": "ynnpack"})
    m_defaults, _ = apply(make_update_step(defaults, mesh8, ts, donate=False, reject_disagreement=True), shifted)
    assert "disagreement_rejected" not in m_defaults
