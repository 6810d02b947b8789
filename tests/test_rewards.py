"""Answer extraction, the math and countdown rewards, the registry, and the isolated RewardPool."""

import os
import time

import numpy as np
import pytest

from stare_jax import rewards
from stare_jax.rewards import RewardPool, gsm8k_final_answer, last_boxed, math_reward

FIX = "tests.reward_fixtures"


# --------------------------------------------------------------------------- extraction and verifiers


@pytest.mark.parametrize("text,want", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("$\\boxed{\\left\\{ 1, 2 \\right\\}}$", "\\left\\{ 1, 2 \\right\\}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{a_{b_{c}}} end", "a_{b_{c}}"),
    ("\\fbox{7}", "7"),
    ("answer: \\boxed 5$ done", "5"),
    ("\\boxed{3} and then \\boxed{4", "3"),  # unclosed last box: previous complete one
    ("\\boxed { 12 }", "12"),
    ("no box", None),
    ("\\boxed{}", ""),
    ("\\boxedx{3}", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


def test_gsm8k_answer():
    assert gsm8k_final_answer("a\nb #### 72") == "72"
    assert gsm8k_final_answer("#### 1,234,567") == "1234567"
    assert gsm8k_final_answer("#### -3.5") == "-3.5"
    assert gsm8k_final_answer("no marker") is None


@pytest.mark.parametrize("response,gold,want", [
    ("... so the answer is \\boxed{34}.", "34", 1.0),
    ("\\boxed{35}", "34", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("first \\boxed{34} then \\boxed{12}", "34", 0.0),  # the last box counts
    ("34", "34", 0.0),  # no box
    ("\\boxed{}", "34", 0.0),
    ("\\boxed{34}", "\\boxed{34}", 1.0),  # gold already boxed
    ("\\boxed{\\text{(B)}}", "B", 1.0),
])
def test_math_reward(response, gold, want):
    assert math_reward(response, gold) == want


def test_countdown_reward():
    assert rewards.countdown_reward("(5+7)*2", "3 5 7 2=24") == 1.0
    assert rewards.countdown_reward("(5+7)*2", b"3 5 7 2=24".decode()) == 1.0
    assert rewards.countdown_reward("__import__('os')", "3 5 7 2=24") == 0.0


def test_registry():
    assert rewards.resolve_spec("math") == "stare_jax.rewards.functions:math_reward"
    assert rewards.get_reward_fn("countdown")("2*(5+7)", "3 5 7 2=24") == 1.0
    from tests import reward_fixtures
    assert rewards.register_reward("test_echo", reward_fixtures.echo_reward) == f"{FIX}:echo_reward"
    assert rewards.get_reward_fn("test_echo")("0.25", "") == 0.25
    assert rewards.register_reward("test_echo", f"{FIX}:echo_reward") == f"{FIX}:echo_reward"
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("test_echo", f"{FIX}:nan_reward")
    with pytest.raises(ValueError, match="not importable"):
        rewards.register_reward("test_lambda", lambda r, g: 1.0)
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.resolve_spec("no_such_reward")
    rewards.REGISTRY.pop("test_echo")


# --------------------------------------------------------------------------- RewardPool


def _gone(pid):
    """True when the process no longer exists (exited and reaped: not even a zombie)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def pool():
    with RewardPool(f"{FIX}:mixed_reward", num_workers=3, timeout_s=1.0) as p:
        yield p


def test_pool_builtin_rewards():
    """The built-in rewards score right through the pool. Its own pool with a generous timeout: a
    worker's first math-verify call (~0.1 s idle) once ran past the shared fixture's 1 s on a CI host
    whose two cores were busy with training tests, and every call scored 0 as a timeout."""
    with RewardPool(f"{FIX}:mixed_reward", num_workers=3, timeout_s=60.0) as pool:
        scores, stats = pool.score(["(5+7)*2", "5+7*2", "7*3+5-2", "(5+7)*2*2"], ["3 5 7 2=24"] * 4,
                                   reward="countdown")
        np.testing.assert_array_equal(scores, [1, 0, 1, 0])
        assert scores.dtype == np.float32 and stats["reward_errors"] == stats["reward_timeouts"] == 0
        scores, stats = pool.score(["\\boxed{\\frac{2}{4}}", "\\boxed{3}", "none"], ["0.5", "0.5", "0.5"],
                                   reward="math")
        np.testing.assert_array_equal(scores, [1, 0, 0])
        assert stats["reward_timeouts"] == 0
        assert pool.score([], []).scores.shape == (0,)


def test_pool_errors_are_zero_and_counted(pool):
    responses = ["ok:1", "raise", "ok:0.5", "nan", "str", "exit", "ok:0.25", "raise"]
    scores, stats = pool.score(responses, ["gt"] * len(responses))
    np.testing.assert_array_equal(scores, [1, 0, 0.5, 0, 0, 0, 0.25, 0])
    assert stats["reward_errors"] == 4  # 2 raises, 1 non-number, 1 dead worker
    assert stats["reward_nonfinite"] == 1 and stats["reward_timeouts"] == 0
    assert stats["reward_calls"] == len(responses)
    scores, stats = pool.score(["nan", "inf", "-inf"], ["gt"] * 3, reward=f"{FIX}:nan_reward")
    assert (scores == 0).all() and stats["reward_nonfinite"] == 3
    # The pool keeps working (the dead worker was replaced).
    scores, _ = pool.score(["ok:2"] * 7, ["gt"] * 7)
    assert (scores == 2).all() and len(pool.worker_pids) == 3


def test_pool_hanging_calls_are_bounded(pool):
    old = pool.worker_pids
    t = time.monotonic()
    scores, stats = pool.score(["hang", "hang", "hang"], ["gt"] * 3)
    elapsed = time.monotonic() - t
    assert (scores == 0).all() and stats["reward_timeouts"] == 3
    assert elapsed < 1.0 + 1.5, elapsed  # in parallel: about one timeout, not three
    assert not set(old) & set(pool.worker_pids)  # all three replaced
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in old)  # killed and reaped, no zombies
    t = time.monotonic()
    scores, stats = pool.score(["ok:1", "hang", "ok:3"], ["gt"] * 3, reward=None)
    np.testing.assert_array_equal(scores, [1, 0, 3])
    assert stats["reward_timeouts"] == 1 and time.monotonic() - t < 2.5


def test_pool_cpu_bound_hang_and_batch_timeout():
    with RewardPool(f"{FIX}:spinning_reward", num_workers=2, timeout_s=10.0, batch_timeout_s=1.0) as p:
        t = time.monotonic()
        scores, stats = p.score(["x"] * 5, [""] * 5)
        assert time.monotonic() - t < 1.0 + 1.5
        assert (scores == 0).all() and stats["reward_timeouts"] == 5
        scores, _ = p.score(["ok:1", "ok:4"], ["", ""], reward=f"{FIX}:mixed_reward")
        np.testing.assert_array_equal(scores, [1, 4])


def test_pool_close_reaps_workers():
    p = RewardPool(f"{FIX}:echo_reward", num_workers=2, timeout_s=2.0)
    pids = p.worker_pids
    assert p.score(["1.5"], [""]).scores.tolist() == [1.5]
    p.close()
    p.close()  # idempotent
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.score(["1"], [""])


_HANG_UP_THE_POOL = """
import os, signal, time
import multiprocessing.forkserver as forkserver
from stare_jax.rewards import RewardPool
with RewardPool("tests.reward_fixtures:echo_reward", num_workers=1, timeout_s=5.0) as p:
    assert signal.SIGHUP not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the block was lifted here
    server = forkserver._forkserver._forkserver_pid
    before = p.worker_pids
    for pid in (*before, server):  # a closing terminal signals the whole foreground process group
        os.kill(pid, signal.SIGHUP)
    time.sleep(0.5)
    assert open(f"/proc/{server}/stat").read().split(") ")[1][0] != "Z"  # the forkserver lives on (not a zombie)
    print(p.score(["2.5"], [""]).scores.tolist(), p.worker_pids == before)
"""


def test_pool_workers_and_forkserver_outlive_a_hang_up():
    """The workers and the forkserver share the trainer's process group, so a closing terminal's
    SIGHUP reaches them: they keep going (the step that finishes after it scores normally)."""
    import subprocess
    import sys

    from tests.e2e_helpers import ROOT, subprocess_env

    r = subprocess.run([sys.executable, "-c", _HANG_UP_THE_POOL], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[2.5]", "True"]


def test_pool_inline_and_spawn():
    inline = RewardPool(f"{FIX}:mixed_reward", num_workers=0)
    scores, stats = inline.score(["ok:1", "raise", "nan"], ["", "", ""])
    np.testing.assert_array_equal(scores, [1, 0, 0])
    assert stats["reward_errors"] == 1 and stats["reward_nonfinite"] == 1
    inline.close()
    with RewardPool("countdown", num_workers=1, timeout_s=30.0, start_method="spawn") as p:
        assert p.score(["(5+7)*2"], ["3 5 7 2=24"]).scores.tolist() == [1.0]
    with pytest.raises(ValueError, match="never 'fork'"):
        RewardPool("math", start_method="fork")
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool("nope")


def test_a_reward_that_cannot_load_is_refused_as_the_pool_starts(monkeypatch, tmp_path):
    """A misnamed reward would otherwise score 0 call after call until dynamic sampling gives up:
    the pool loads its function once at start and raises RewardSpecError (train exits 2), stopping
    the workers it started; an import that hangs is bounded by LOAD_TIMEOUT_S."""
    from stare_jax.rewards import pool as pool_lib

    started = []
    real_start = RewardPool._start_worker

    def recording_start(self, wait=True):
        w = real_start(self, wait)
        started.append(w.process.pid)
        return w

    monkeypatch.setattr(RewardPool, "_start_worker", recording_start)
    for spec, named in (("tests.no_such_module:f", "ModuleNotFoundError"), (f"{FIX}:no_such_reward", "AttributeError"),
                        ("stare_jax.rewards.functions:REGISTRY", "not callable")):
        for workers in (0, 2):
            with pytest.raises(rewards.RewardSpecError, match=f"{spec!r} cannot be loaded: .*{named}"):
                RewardPool(spec, num_workers=workers, timeout_s=5.0)
    (tmp_path / "slow_import_reward.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers take the parent's sys.path
    monkeypatch.setattr(pool_lib, "LOAD_TIMEOUT_S", 1.0)
    with pytest.raises(rewards.RewardSpecError, match="did not load within 1 s"):
        RewardPool("slow_import_reward:f", num_workers=1, start_method="spawn")
    assert len(started) == 7 and all(_gone(pid) for pid in started)


def test_pool_recycles_workers():
    with RewardPool(f"{FIX}:echo_reward", num_workers=1, timeout_s=5.0, max_tasks_per_worker=2) as p:
        first = p.worker_pids
        scores, stats = p.score([str(i) for i in range(5)], [""] * 5)
        np.testing.assert_array_equal(scores, np.arange(5))
        assert stats["reward_errors"] == 0 and p.worker_pids != first and len(p.worker_pids) == 1
        assert all(_gone(pid) for pid in first)


def test_the_forkserver_preloads_what_the_reward_needs_and_no_more():
    """math-verify (~0.5 s to import) is preloaded for the rewards that call it and for a user's
    reward (whose calls may name a built-in one; its own module is never preloaded: the forkserver
    ignores only an ImportError of a preload, and the workers' own import is checked and
    bounded), not for countdown."""
    import subprocess
    import sys

    from stare_jax.rewards.pool import DEFAULT_PRELOAD, preload_modules
    assert preload_modules(rewards.REGISTRY["math"]) == DEFAULT_PRELOAD + ("math_verify",)
    assert preload_modules(rewards.REGISTRY["final_answer"]) == DEFAULT_PRELOAD + ("math_verify",)
    assert "math_verify" not in preload_modules(rewards.REGISTRY["countdown"])
    assert preload_modules(f"{FIX}:echo_reward") == DEFAULT_PRELOAD + ("stare_jax.tasks.countdown", "math_verify")
    code = ("import sys\nfrom stare_jax.rewards import RewardPool\n"
            "with RewardPool(sys.argv[1], num_workers=1, timeout_s=60.0) as p:\n"
            f"    print(p.score(['x'], [''], reward='{FIX}:math_verify_imported').scores[0])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen = {}
    for reward in ("countdown", "math"):
        r = subprocess.run([sys.executable, "-c", code, reward], cwd=root, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        seen[reward] = float(r.stdout.split()[-1])
    assert seen == {"countdown": 0.0, "math": 1.0}
