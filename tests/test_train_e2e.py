"""The main job end to end (issue 5): kill-and-resume exactness, bad input, export, evaluate.

Runs use a tiny embedded model built once per session, passed as `model.path` so every run goes
through the same Hugging Face loading path as a real model.
"""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from stare_jax import checkpoint as ckpt_lib
from stare_jax import config as config_lib
from stare_jax.eval_metrics import pass_at_k
from stare_jax.writers import read_jsonl

from tests.e2e_helpers import QUICKSTART, ROOT, train_cmd, comparable, subprocess_env, run_train, tiny_overrides


@pytest.fixture(scope="module")
def reference_run(tiny_model, tmp_path_factory):
    model, data = tiny_model
    workdir = str(tmp_path_factory.mktemp("ref") / "run")
    r = run_train(workdir, tiny_overrides(model, data))
    assert r.returncode == 0, r.stderr[-3000:]
    return workdir, comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl")))


def test_reference_run_writes_contract_metrics(reference_run):
    workdir, rows = reference_run
    assert [r["step"] for r in rows] == list(range(6))
    required = {"step", "entropy", "reward_mean", "accuracy", "response_length_mean", "loss", "grad_norm",
                "stare_gate_on", "stare_w", "stare_m", "stare_lplus_frac", "stare_lminus_frac"}
    assert required <= set(rows[0])
    raw = read_jsonl(os.path.join(workdir, "metrics.jsonl"))[0]
    assert "rollout_s" in raw and "update_s" in raw
    assert {"quad_pos_high_frac", "quad_neg_low_dH"} <= set(rows[0])
    assert all(r["stare_gate_on"] == 1.0 for r in rows)
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "6"))


def test_the_host_malloc_changes_no_result(tiny_model, reference_run, tmp_path):
    """The reference run's process re-executed itself with oneTBB's malloc where the tbb package is
    installed (stare_jax/allocator.py); glibc's malloc gives the same metrics, bit for bit."""
    from stare_jax import allocator

    model, data = tiny_model
    workdir = str(tmp_path / "system_malloc")
    r = run_train(workdir, tiny_overrides(model, data), STARE_JAX_MALLOC="system")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "host malloc: system" in r.stderr
    assert comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == reference_run[1]
    if allocator.tbbmalloc_libraries() is not None:
        r = run_train(str(tmp_path / "tbb_malloc"), tiny_overrides(model, data, total_steps=2, checkpoint_every=2))
        assert "host malloc: oneTBB" in r.stderr, r.stderr[-3000:]
        # the first step compiles, and the one-off blocks leave oneTBB's cache before each new program runs
        assert "oneTBB's cache emptied as step 0's new XLA programs were built" in r.stderr, r.stderr[-3000:]
        assert "cache emptied as step 1" not in r.stderr  # nothing new to build: its blocks stay cached


def test_sigkill_at_random_moment_then_resume_is_bitwise_identical(tiny_model, reference_run, tmp_path):
    model, data = tiny_model
    _, ref_rows = reference_run
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data)
    kill_after_rows = random.Random(os.getpid()).randint(1, 5)
    proc = subprocess.Popen(train_cmd(workdir, overrides), cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= kill_after_rows:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert comparable(read_jsonl(metrics)) == ref_rows


def test_sigkill_during_checkpoint_save_then_resume(tiny_model, reference_run, tmp_path):
    model, data = tiny_model
    _, ref_rows = reference_run
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data)
    r = run_train(workdir, overrides, **{ckpt_lib.FAULT_KILL_DURING_SAVE: "4"})
    assert r.returncode == -signal.SIGKILL
    ckpts = os.listdir(os.path.join(workdir, "checkpoints"))
    assert "2" in ckpts and "4" not in ckpts and any(c.startswith("4.") for c in ckpts)  # half-written step 4
    # Also a marker-less step directory, which Orbax alone would count as the latest step.
    os.makedirs(os.path.join(workdir, "checkpoints", "5"))
    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "moved aside" in r.stderr
    assert comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == ref_rows
    # the half-written step's temporary directory was removed as the rerun started
    assert not any(".orbax-checkpoint-tmp" in c for c in os.listdir(os.path.join(workdir, "checkpoints")))


def test_a_full_disk_stops_at_the_save_with_one_line_and_the_rerun_resumes(tiny_model, reference_run, tmp_path):
    """A checkpoint directory without room for the next save (checked before it starts, here by
    the test hook) stops the run with one line and exit 1, the previous checkpoint intact; with
    space again the same command resumes from it and ends like an uninterrupted run."""
    model, data = tiny_model
    _, ref_rows = reference_run
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data)
    r = run_train(workdir, overrides, **{ckpt_lib.FAULT_DISK_FULL_FROM_SAVE: "4"})
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the checkpoint of step 4 was not started: ") and "MiB free" in last, last
    assert last.endswith("the checkpoint of step 2 is intact: free space (or fix the file system) and rerun the "
                         "same command to resume"), last
    assert "Traceback" not in r.stderr and "ERROR" not in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in r.stderr
    assert comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == ref_rows


_FAILED_WRITE = """
import os, resource, sys, time
import jax.numpy as jnp
from stare_jax import checkpoint as ckpt_lib
ckpt = ckpt_lib.Checkpointer(sys.argv[1], keep=2)
ckpt.save(1, {"w": jnp.ones((512, 512), jnp.float32)}, {"pos": 1}, {"step": 1})
ckpt.wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, resource.RLIM_INFINITY))  # no file above 256 KiB
ckpt.save(2, {"w": jnp.full((512, 512), 2.0, jnp.float32)}, {"pos": 2}, {"step": 2})  # fails in Orbax's threads
seen = "nothing"
try:
    deadline = time.time() + 60
    while time.time() < deadline:
        ckpt.check()  # what the train loop calls after every step: must not block, must see the failure
        time.sleep(0.02)
    seen = "wait"
    ckpt.wait()
except ckpt_lib.CheckpointWriteError as e:
    print(f"{'check' if seen == 'nothing' else seen}|{e.step}|{e}")
ckpt.close()
"""


def test_a_save_that_fails_in_the_background_is_one_error_naming_the_step_and_reason(tmp_path):
    """A write that fails inside Orbax's writer threads (here: a file size limit, EFBIG) surfaces at
    the next non-blocking `check()` as CheckpointWriteError naming the step, the system's reason and
    the file that holds Orbax's error records of it; the failed step's temporary directory is
    removed and the committed step stays."""
    r = subprocess.run([sys.executable, "-c", _FAILED_WRITE, str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    where, step, message = r.stdout.strip().split("|")
    log = tmp_path / "checkpoint_errors.log"
    assert where == "check" and step == "2" and message == (f"the checkpoint of step 2 could not be written to {tmp_path}/checkpoints: "
                                       f"File too large (errno {errno.EFBIG}) (Orbax's log of it: {log})"), r.stdout
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    # Orbax's tracebacks of the failed writer threads (~300 lines) went to the log, not to stderr
    assert "Traceback" not in r.stderr and "File too large" in log.read_text(), r.stderr[-3000:]


def test_resume_with_incompatible_config_is_refused(reference_run, tiny_model):
    model, data = tiny_model
    workdir, _ = reference_run
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    r = run_train(workdir, tiny_overrides(model, data, **{"loss.name": "grpo", "stare.enabled": False}))
    assert r.returncode == 2
    assert "loss.name" in r.stderr and "cannot resume" in r.stderr
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
    # A resumable change (more steps) is accepted and continues from the last checkpoint.
    r = run_train(workdir, tiny_overrides(model, data, total_steps=7))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(os.path.join(workdir, "metrics.jsonl"))] == list(range(7))


@pytest.mark.parametrize("name, extra", [
    # with the quickstart's STARE on, a quadrant restriction, and the micro-batched update path
    ("hapo", {"loss.quadrants": "PHR,NHR", "ppo.grad_accum": 2}),
    # with the slot-refilling sampler (issue 20)
    ("entropy_advantage", {"rollout.slots": 4}),
    # with the update on packed responses (issue 20; 16-token buckets: its capacity switches at step 3)
    ("w_reinforce", {"ppo.pack_tokens": 16}),
])
def test_polarity_entropy_methods_train_and_resume_bitwise_after_a_kill(tiny_model, tmp_path, name, extra):
    """Issue 18: each new method trains the quickstart config; a run SIGKILLed while saving step 4
    resumes from step 2 and recomputes steps 2-3 bit for bit (rows compared with the killed process's).
    The parametrisations also run issue 20's slot-refilling sampler and packed update."""
    model, data = tiny_model
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data, **{"loss.name": name, "total_steps": 4, "checkpoint_every": 2, **extra})
    r = run_train(workdir, overrides, **{ckpt_lib.FAULT_KILL_DURING_SAVE: "4"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    metrics = os.path.join(workdir, "metrics.jsonl")
    killed = comparable(read_jsonl(metrics))
    assert [row["step"] for row in killed] == [0, 1, 2, 3]
    if "ppo.pack_tokens" in extra and "host malloc: oneTBB" in r.stderr:  # the cache holds one update program
        for before, row in zip(killed, killed[1:]):
            switched = f"step {row['step']}'s update switched to packed capacity {row['packed_capacity']}"
            assert (switched in r.stderr) == (row["packed_capacity"] != before["packed_capacity"]), r.stderr[-3000:]
    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert comparable(read_jsonl(metrics)) == killed
    quads = ("phr", "plr", "nlr", "nhr")
    for row in killed:
        assert np.isfinite(row["loss"]) and row["nonfinite_skipped"] == 0
        assert sum(row[f"pe_quad_{q}_frac"] for q in quads) == pytest.approx(1.0, abs=1e-5)
        mass = sum(row[f"pe_quad_{q}_mass"] for q in quads)  # 0: no advantage at all (every group tied)
        assert mass == pytest.approx(1.0, abs=1e-5) or (mass == 0 and name != "w_reinforce")
        if name == "hapo":
            assert row["pe_quad_plr_mass"] == 0 and row["pe_quad_nlr_mass"] == 0
        if "ppo.pack_tokens" in extra:
            assert 0 < row["packed_capacity"] <= 16 * 12 and row["packed_capacity"] % 16 == 0


# ----------------------------------------------------------------------------- bad input, in process

def _config(model, data, **extra):
    c = config_lib.default_config()
    overrides = tiny_overrides(model, data, **extra)
    unused = config_lib.task_keys_unused_by(overrides.get("data.name", c.data.name))
    for key, value in overrides.items():
        if key in unused and key not in extra:
            continue  # the tiny countdown sizes do not apply to another task (refused if set)
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    config_lib.validate(c)
    return c


@pytest.mark.parametrize("reward, stat", [
    ("tests.train_fixtures:raise_sometimes", "reward_errors"),
    ("tests.train_fixtures:nan_sometimes", "reward_nonfinite"),
    ("tests.train_fixtures:hang_sometimes", "reward_timeouts"),
])
def test_misbehaving_reward_is_scored_zero_counted_and_training_continues(tiny_model, tmp_path, reward, stat):
    from stare_jax import trainer

    model, data = tiny_model
    config = _config(model, data, **{"reward.name": reward, "reward.timeout_s": 0.5, "reward.num_workers": 2,
                                     "total_steps": 2, "checkpoint_every": 1})
    t0 = time.time()
    trainer.train(config, str(tmp_path / "run"))
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert len(rows) == 2
    assert sum(r[stat] for r in rows) > 0
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert time.time() - t0 < 240
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "2"]


def test_nonfinite_loss_skips_the_step_and_keeps_parameters(tiny_model, tmp_path):
    import jax
    from flax import nnx

    from stare_jax import trainer
    from stare_jax.models import from_pretrained

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    config = _config(model, data, **{"reward.name": "tests.train_fixtures:overflow_reward", "total_steps": 1,
                                     "checkpoint_every": 1})
    trainer.train(config, workdir)
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert rows[0]["nonfinite_skipped"] == 1.0
    _, after, step = trainer.load_trained_policy(workdir)
    assert step == 1
    before = from_pretrained(model)
    for a, b in zip(jax.tree.leaves(nnx.state(before.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(after.model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_incompatible_reward_change_is_allowed_only_for_resources(tiny_model):
    model, data = tiny_model
    a = ckpt_lib.config_to_json(_config(model, data))
    b = ckpt_lib.config_to_json(_config(model, data, **{"reward.timeout_s": 3.0, "total_steps": 9}))
    assert ckpt_lib.incompatible_keys(a, b) == []
    # The remedy for a run that aborted with DynamicSamplingError: raise the cap and resume.
    raised = ckpt_lib.config_to_json(_config(model, data, **{"dynamic_sampling.max_num_gen_batches": 500}))
    assert ckpt_lib.incompatible_keys(a, raised) == []
    # A run saved before stare.top_p_ratio_minus existed resumes under its old-behaviour value only.
    older = {k: v for k, v in a.items() if k != "stare.top_p_ratio_minus"}
    assert ckpt_lib.incompatible_keys(older, a) == []
    resized = ckpt_lib.config_to_json(_config(model, data, **{"stare.top_p_ratio_minus": 0.25}))
    assert ckpt_lib.incompatible_keys(older, resized) == ["stare.top_p_ratio_minus"]
    c = ckpt_lib.config_to_json(_config(model, data, **{"stare.w": 2.0}))
    assert ckpt_lib.incompatible_keys(a, c) == ["stare.w"]


def test_empty_malformed_and_too_small_dataset_files_are_refused(tiny_model, tmp_path):
    from stare_jax import trainer
    from stare_jax.data import DataFormatError

    model, data = tiny_model
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    for path, pattern in ((empty, "empty.jsonl"), (bad, r"bad.jsonl.*line 2")):
        config = _config(model, data, **{"data.name": "math", "data.train_files": str(path), "reward.name": "math",
                                         "data.data_dir": str(tmp_path / f"tfds_{path.stem}")})
        with pytest.raises(DataFormatError, match=pattern):
            trainer.train(config, str(tmp_path / f"run_{path.stem}"))
    # fewer prompts than a step's batch (4 here): every batch would repeat them
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "1+1?", "answer": "2"}\n')
    config = _config(model, data, **{"data.name": "math", "data.train_files": str(one), "reward.name": "math",
                                     "data.data_dir": str(tmp_path / "tfds_one")})
    with pytest.raises(config_lib.ConfigError, match=r"data.prompt_batch_size: got 4; allowed: at most the 1 prompts"):
        trainer.train(config, str(tmp_path / "run_one"))


# ----------------------------------------------------------------------------- export and evaluate

def test_export_loads_in_transformers_with_matching_logits(reference_run, tmp_path):
    import torch
    import transformers

    from stare_jax import trainer
    from tests import hf_fixtures

    workdir, _ = reference_run
    out = str(tmp_path / "hf")
    r = subprocess.run([sys.executable, "-m", "stare_jax.export", "--workdir", workdir, "--out", out], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _, policy, _ = trainer.load_trained_policy(workdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("3 5 7=12:", add_special_tokens=False)) == "3 5 7=12:"
    ids, mask, pos = hf_fixtures.left_padded_batch(lengths=(10, 6, 3), total=10, vocab=policy.config.vocab_size)
    ref = hf_fixtures.torch_logits(hf, ids, mask, pos)
    ours = np.asarray(policy(ids, mask))
    assert np.abs(ours - ref)[mask > 0].max() <= 1e-4


def test_trained_policy_reads_only_the_parameters_and_equals_the_full_train_state(reference_run):
    """`load_trained_policy` (evaluate, export) partially restores the `model` subtree; it must equal
    the parameters of a full train-state restore, which differ from the base weights after training."""
    import jax
    from flax import nnx

    from stare_jax import parallel, trainer
    from stare_jax.models import from_pretrained
    from stare_jax.rl import abstract_train_state, create_train_state

    workdir, _ = reference_run
    config, policy, step = trainer.load_trained_policy(workdir)
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    path = config.model.path or os.path.join(workdir, "model")
    assert config.loss.kl_type == "none"  # no reference model in the saved train state
    base = from_pretrained(path, mesh=mesh)
    full_state = create_train_state(from_pretrained(path, mesh=mesh).model, config, mesh=mesh)
    ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
        restored_step, state, _, _ = ckpt.restore_latest(
            {"train": abstract_train_state(full_state, mesh),
             "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(mesh))})
    finally:
        ckpt.close()
    nnx.update(full_state, state["train"])
    assert restored_step == step  # the latest step (other tests may extend this run)
    leaves = lambda m: [np.asarray(x) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]  # noqa: E731
    changed = 0
    for ours, full, before in zip(leaves(policy.model), leaves(full_state.model), leaves(base.model)):
        np.testing.assert_array_equal(ours, full)
        changed += int(not np.array_equal(ours, before))
    assert changed > 0


def test_evaluate_writes_avg_and_pass_at_k_matching_hand_computation(reference_run, tmp_path):
    workdir, _ = reference_run
    r = subprocess.run([sys.executable, "-m", "stare_jax.evaluate", "--config", QUICKSTART, "--workdir", workdir,
                        "--n", "4", "--config.eval.max_prompts=8", "--config.reward.num_workers=1"], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    step = json.loads(r.stdout.strip().splitlines()[-1])["step"]
    result = json.load(open(os.path.join(workdir, "eval", f"step_{step}.json")))["results"]["countdown"]
    c = np.asarray(result["num_correct"])
    assert result["n"] == 4 and result["num_prompts"] == 8 == len(c)
    assert result["avg@4"] == pytest.approx(c.sum() / 32)
    samples = result["samples"]  # what the policy writes, for the reader of the eval file
    assert len(samples) == 4 and all(s["question"] and len(s["responses"]) == 2 for s in samples)
    assert all(r["reward"] in (0.0, 1.0) and isinstance(r["text"], str) for s in samples for r in s["responses"])
    # pass@k by hand: 1 - C(n - c, k) / C(n, k).
    from math import comb
    for k in (1, 2, 4):
        hand = np.mean([1 - comb(4 - ci, k) / comb(4, k) for ci in c])
        assert result[f"pass@{k}"] == pytest.approx(hand)


def test_pass_at_k_hand_cases():
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_no_recompilation_after_the_first_step_within_a_prompt_bucket(tiny_model, tmp_path):
    """Prompts of 2-5 countdown numbers (7-15 tokens) all fall in the 16-token bucket: only step 0
    compiles; steps whose longest prompt differs reuse the compiled sampler and update step."""
    model, _ = tiny_model
    overrides = tiny_overrides(model, str(tmp_path / "tfds"), **{
        "data.prompt_bucket_multiple": 16, "data.max_prompt_len": 32, "data.countdown_min_numbers": 2,
        "data.countdown_max_numbers": 5, "data.prompt_batch_size": 2, "total_steps": 6, "checkpoint_every": 6})
    r = run_train(str(tmp_path / "run"), overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert len({row["prompt_len_max"] for row in rows}) > 1, "the prompts should vary in length"
    assert all(row["prompt_len"] == 16 and row["prompt_len_max"] <= 16 for row in rows)
    assert rows[0]["compilations"] > 0, "the counter should see the first step's compilations"
    assert [row["compilations"] for row in rows[1:]] == [0] * 5
    assert "compiled" not in r.stderr
