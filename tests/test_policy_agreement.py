"""The update's log-probs against the sampler's (`stare_jax.rl.policy_agreement`): an on-policy
step whose approx_kl is far above rounding gets one warning from the trainer, naming the step."""

import logging
import math

import numpy as np

from stare_jax.rl.policy_agreement import DISAGREEMENT_APPROX_KL, disagreement_line
from tests.test_train_e2e import _config


def test_only_an_on_policy_update_far_above_rounding_is_a_disagreement():
    assert disagreement_line({"approx_kl": 3e-9}, num_updates=1) is None
    assert disagreement_line({"approx_kl": 0.0027}, num_updates=1) is None  # bfloat16's rounding (H100 recipe)
    assert disagreement_line({"approx_kl": DISAGREEMENT_APPROX_KL}, num_updates=1) is None
    line = disagreement_line({"approx_kl": 0.267}, num_updates=1)
    assert line.startswith("the update's log-probs disagree with the sampler's") and "approx_kl 0.267" in line
    assert "model.cpu_gemm=ynnpack" in line and "\n" not in line
    assert disagreement_line({"approx_kl": 0.267}, num_updates=4) is None  # later mini-batches move away
    assert disagreement_line({"approx_kl": math.nan}, num_updates=1) is None  # a skipped step: nonfinite_skipped
    assert disagreement_line({}, num_updates=1) is None


def test_the_trainer_warns_once_when_the_sampler_and_the_update_disagree(tiny_model, tmp_path, monkeypatch, caplog):
    from stare_jax import trainer

    real_collect = trainer.collect_batch

    def collect_with_shifted_log_probs(*args, **kwargs):  # a sampler that reports other log-probs
        batch, metrics = real_collect(*args, **kwargs)
        batch = dict(batch, old_log_probs=np.asarray(batch["old_log_probs"]) - 1.0)
        return batch, metrics

    model, data = tiny_model
    config = _config(model, data, **{"total_steps": 2, "checkpoint_every": 2})
    with caplog.at_level(logging.WARNING, logger="stare_jax.trainer"):
        trainer.train(config, str(tmp_path / "agree"))
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]  # the real sampler agrees
    monkeypatch.setattr(trainer, "collect_batch", collect_with_shifted_log_probs)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stare_jax.trainer"):
        trainer.train(config, str(tmp_path / "disagree"))
    warned = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 0: the update's log-probs disagree"), warned
