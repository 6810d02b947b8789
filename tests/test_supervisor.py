"""`python -m stare_jax.train --restarts N`: a training process killed by a signal is started again
from its newest checkpoint, at most N times in a row without a new checkpoint, each restart
recorded; nothing else is restarted.

The policy is checked on small stand-in children (a few lines of Python that die or exit as told);
the end-to-end test kills a real training and compares its metrics with an uninterrupted run.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from stare_jax import supervisor
from stare_jax.writers import read_jsonl

from tests.e2e_helpers import QUICKSTART, ROOT, comparable, run_train, subprocess_env, tiny_overrides, train_cmd

# A stand-in training: counts its starts in WORKDIR/starts, then behaves as the N-th entry of PLAN
# says: "kill" (SIGKILL itself), "abort" (SIGABRT), "progress" (commit checkpoint step 10 * the start's
# number, then SIGKILL itself), an exit status, "term" (wait for SIGTERM, then exit 143 as the
# trainer does after saving) or "hup" (count the SIGHUPs it gets in WORKDIR/hups for a second, then
# exit 129).
CHILD = r"""
import os, signal, sys, time
workdir, plan = sys.argv[1], sys.argv[2].split(",")
path = os.path.join(workdir, "starts")
n = int(open(path).read()) if os.path.exists(path) else 0
open(path, "w").write(str(n + 1))
what = plan[min(n, len(plan) - 1)]
if what == "progress":
    root = os.path.join(workdir, "checkpoints", str(10 * (n + 1)))
    for item in ("", "state", "data", "meta"):
        os.makedirs(os.path.join(root, item), exist_ok=True)
        open(os.path.join(root, item, "commit_success.txt"), "w").close()
    what = "kill"
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "abort":
    signal.signal(signal.SIGABRT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGABRT)
if what == "term":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    open(os.path.join(workdir, "ready"), "w").close()
    while True:
        time.sleep(0.05)
if what == "hup":
    signal.signal(signal.SIGHUP, lambda *a: open(os.path.join(workdir, "hups"), "a").write("1"))
    open(os.path.join(workdir, "ready"), "w").close()
    while not os.path.exists(os.path.join(workdir, "hups")):
        time.sleep(0.05)
    time.sleep(1.0)
    sys.exit(129)
sys.exit(int(what))
"""


def _child(workdir, plan):
    return [sys.executable, "-c", CHILD, str(workdir), plan]


def _supervise(workdir, plan, restarts):
    """`supervisor.supervise` of the stand-in in a fresh interpreter, as the command line runs it
    (no JAX threads in the forking process): the finished process."""
    code = ("import sys; from stare_jax import supervisor; "
            f"sys.exit(supervisor.supervise({_child(workdir, plan)!r}, {str(workdir)!r}, {restarts}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


def _commit(workdir, step):
    root = os.path.join(workdir, "checkpoints", str(step))
    for item in ("", "state", "data", "meta"):
        os.makedirs(os.path.join(root, item), exist_ok=True)
        open(os.path.join(root, item, "commit_success.txt"), "w").close()


def test_restarts_flag_is_split_off_and_bad_values_are_refused():
    assert supervisor.split_restarts_flag(["--config", "c.py", "--restarts", "3", "--workdir", "w"]) == (
        ["--config", "c.py", "--workdir", "w"], 3)
    assert supervisor.split_restarts_flag(["--restarts=0", "--x"]) == (["--x"], 0)
    assert supervisor.split_restarts_flag(["--config", "c.py"]) == (["--config", "c.py"], 0)
    for bad in (["--restarts"], ["--restarts", "-1"], ["--restarts=two"]):
        with pytest.raises(supervisor.RestartsFlagError, match="allowed: an integer >= 0"):
            supervisor.split_restarts_flag(bad)


def test_latest_committed_step_counts_only_fully_committed_steps(tmp_path):
    assert supervisor.latest_committed_step(str(tmp_path)) is None
    _commit(str(tmp_path), 2)
    _commit(str(tmp_path), 4)
    os.makedirs(tmp_path / "checkpoints" / "6" / "state")          # a save cut short: no markers
    _commit(str(tmp_path), 8)
    os.remove(tmp_path / "checkpoints" / "8" / "meta" / "commit_success.txt")  # one item uncommitted
    os.makedirs(tmp_path / "checkpoints" / "4.invalid-1")
    assert supervisor.latest_committed_step(str(tmp_path)) == 4


def test_deaths_by_signal_are_restarted_and_recorded_until_the_child_ends(tmp_path):
    _commit(str(tmp_path), 2)
    r = _supervise(tmp_path, "kill,abort,0", 3)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "starts").read_text() == "3"
    rows = read_jsonl(str(tmp_path / supervisor.RECORD))
    assert [(r["died_of"], r["returncode"], r["resume_step"], r["restart"], r["in_a_row"], r["max_restarts"])
            for r in rows] == [("SIGKILL", -9, 2, 1, 1, 3), ("SIGABRT", -6, 2, 2, 2, 3)]
    err = r.stderr.strip().splitlines()
    assert len(err) == 2 and "died of SIGKILL; restarting, from checkpoint step 2 (restart 1 of 3 in a row" in err[0]
    assert "died of SIGABRT" in err[1]


def test_restarts_are_bounded_and_the_last_death_is_the_status(tmp_path):
    r = _supervise(tmp_path, "kill", 2)
    assert r.returncode == 128 + 9  # as a shell reports a process killed by SIGKILL
    assert (tmp_path / "starts").read_text() == "3"
    assert len(read_jsonl(str(tmp_path / supervisor.RECORD))) == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "after 2 restart(s) in a row without a new checkpoint: giving up; no checkpoint yet; " \
           "rerun the command to resume" in last


def test_a_death_after_a_new_checkpoint_starts_the_restart_count_again(tmp_path):
    """N bounds the restarts in a row without progress: each attempt that commits a newer checkpoint
    before it dies is restarted however many came before; the first that does not counts."""
    _commit(str(tmp_path), 5)
    r = _supervise(tmp_path, "progress,progress,progress,0", 1)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "starts").read_text() == "4"
    rows = read_jsonl(str(tmp_path / supervisor.RECORD))
    assert [(r["resume_step"], r["restart"], r["in_a_row"]) for r in rows] == [(10, 1, 1), (20, 2, 1), (30, 3, 1)]

    crash_loop = tmp_path / "crash_loop"
    crash_loop.mkdir()
    r = _supervise(crash_loop, "progress,kill", 1)  # progress once, then a death before the next checkpoint
    assert r.returncode == 128 + 9
    assert (crash_loop / "starts").read_text() == "2"
    assert [(row["resume_step"], row["in_a_row"]) for row in read_jsonl(str(crash_loop / supervisor.RECORD))] == [
        (10, 1)]
    last = r.stderr.strip().splitlines()[-1]
    assert "after 1 restart(s) in a row without a new checkpoint: giving up; the newest checkpoint is step 10" in last


@pytest.mark.parametrize("status", [1, 2, 3])
def test_an_exit_with_a_status_is_never_restarted(tmp_path, status):
    assert _supervise(tmp_path, str(status), 5).returncode == status
    assert (tmp_path / "starts").read_text() == "1"
    assert not (tmp_path / supervisor.RECORD).exists()


@pytest.mark.parametrize("plan, signals, status", [
    ("term,0", [signal.SIGTERM], 143),
    # a closing terminal sends SIGHUP twice (the kernel, then the shell); the child must see one, or it
    # would take the second for an impatient repeat and exit without saving
    ("hup,0", [signal.SIGHUP, signal.SIGHUP], 129),
], ids=["sigterm", "sighup_twice"])
def test_a_stop_signal_to_the_supervisor_reaches_the_child_once_and_nothing_is_restarted(tmp_path, plan, signals,
                                                                                          status):
    """Run as the command line would (`python -m stare_jax.train` is replaced by the stand-in), with
    SIGHUP's default action as a terminal's shell gives it (the suite may run under nohup)."""
    code = ("import signal, sys; from stare_jax import supervisor; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
            f"sys.exit(supervisor.supervise({_child(tmp_path, plan)!r}, {str(tmp_path)!r}, 3))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env())
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.1)
        assert proc.wait(timeout=60) == status
    finally:
        proc.kill()
    assert (tmp_path / "starts").read_text() == "1"
    assert not (tmp_path / supervisor.RECORD).exists()
    if plan.startswith("hup"):
        assert (tmp_path / "hups").read_text() == "1"


def test_restarts_flag_errors_exit_2_with_one_line(tmp_path):
    cases = [(["--restarts", "x"], "--restarts: 'x' is not allowed; allowed: an integer >= 0"),
             (["--restarts", "1", "--config.distributed.num_processes=2"], "must restart all of them together"),
             (["--restarts", "1", "--config.nonexistent=1"], "nonexistent")]
    for extra, needle in cases:
        r = subprocess.run([sys.executable, "-m", "stare_jax.train", "--config", QUICKSTART, "--workdir",
                            str(tmp_path / "w"), *extra], cwd=ROOT, env=subprocess_env(), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, (extra, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (extra, lines)
    assert not (tmp_path / "w").exists()


def test_a_killed_training_restarts_from_its_checkpoint_and_ends_as_an_uninterrupted_run(tiny_model, tmp_path):
    model, data = tiny_model
    overrides = tiny_overrides(model, data, total_steps=6, checkpoint_every=2,
                               **{"reward.name": "tests.train_fixtures:slow_reward"})
    ref = str(tmp_path / "ref")
    r = run_train(ref, overrides)
    assert r.returncode == 0, r.stderr[-3000:]

    workdir = str(tmp_path / "run")
    metrics, lock = os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, ".lock")
    proc = subprocess.Popen(train_cmd(workdir, overrides) + ["--restarts", "2"], cwd=ROOT,
                            env=subprocess_env(STARE_TEST_REWARD_DELAY="0.05"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3):
            assert time.time() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.05)
        child = int(open(lock).read())
        assert child != proc.pid  # the training runs in a child of the command
        os.kill(child, signal.SIGKILL)  # as the OOM killer would; an XLA abort is SIGABRT
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = read_jsonl(os.path.join(workdir, supervisor.RECORD))
    assert len(rows) == 1 and rows[0]["died_of"] == "SIGKILL" and rows[0]["pid"] == child
    assert rows[0]["resume_step"] in (None, 2, 4)
    assert f"training process {child} died of SIGKILL; restarting" in err
    assert "resumed from step" in err or rows[0]["resume_step"] is None
    assert comparable(read_jsonl(metrics)) == comparable(read_jsonl(os.path.join(ref, "metrics.jsonl")))
    assert supervisor.latest_committed_step(workdir) == 6
