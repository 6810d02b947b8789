"""Fault tests of issue 19: damaged checkpoints, preemption signals, bad input, leftovers, a second
training in the same workdir. Each kills, corrupts or signals a real training process (tiny
embedded model, a few steps) or runs the command-line entry points as a user would. The fault
matrix in docs/faults.md names these tests.
"""

import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from stare_jax import checkpoint as ckpt_lib
from stare_jax import trainer
from stare_jax.writers import read_jsonl

from tests.e2e_helpers import (QUICKSTART, ROOT, comparable, run_train, subprocess_env, tiny_overrides,
                               train_cmd)

EVAL = {"eval.enabled": True, "eval.n": 2, "eval.max_prompts": 4}
SLOW = {"reward.name": "tests.train_fixtures:slow_reward"}


def _run(module_args, timeout=300, **env):
    return subprocess.run([sys.executable, "-m", *module_args], cwd=ROOT, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _evaluate(workdir, *extra):
    return _run(["stare_jax.evaluate", "--config", QUICKSTART, "--workdir", workdir, "--n", "2",
                 "--config.eval.max_prompts=4", "--config.reward.num_workers=1", *extra])


def _export(workdir, out, *extra):
    return _run(["stare_jax.export", "--workdir", workdir, "--out", out, *extra])


def _wait_rows(path, n, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} rows (process exit {proc.poll()})")


def _copy(workdir, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(workdir, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def _flip_bit_in_the_largest_weight(workdir, step):
    """Flips one bit in the middle of the largest trained weight's raw bytes, found by content in the
    step's OCDBT data files (checkpoints are uncompressed): Orbax itself restores this silently."""
    import jax
    import orbax.checkpoint as ocp

    state = os.path.join(workdir, "checkpoints", str(step), "state")
    weights = [np.ascontiguousarray(np.asarray(x)) for path, x in
               jax.tree_util.tree_flatten_with_path(ocp.PyTreeCheckpointer().restore(state))[0]
               if jax.tree_util.keystr(path).startswith("['train']['model']")]
    raw = max(weights, key=lambda w: w.nbytes).tobytes()
    d = os.path.join(state, "ocdbt.process_0", "d")
    for name in os.listdir(d):
        data = bytearray(open(os.path.join(d, name), "rb").read())
        at = data.find(raw)
        if at >= 0:
            data[at + len(raw) // 2] ^= 0x40
            open(os.path.join(d, name), "wb").write(bytes(data))
            return
    raise AssertionError(f"the largest weight's bytes are in no data file of {d}")


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    """A 4-step run (checkpoints 2 and 4) killed right after its last checkpoint committed and before
    its final evaluation, then re-run: (workdir, overrides, killed result, eval existed after the
    kill, rerun result)."""
    model, data = tiny_model
    workdir = str(tmp_path_factory.mktemp("faults") / "run")
    overrides = tiny_overrides(model, data, total_steps=4, checkpoint_every=2, **EVAL)
    killed = run_train(workdir, overrides, **{trainer.FAULT_KILL_BEFORE_FINAL_EVAL: "1"})
    eval_after_kill = os.path.exists(os.path.join(workdir, "eval", "step_4.json"))
    rerun = run_train(workdir, overrides)
    return workdir, overrides, killed, eval_after_kill, rerun


# ----------------------------------------------------------------------------- items 1-3: checkpoints

def test_final_eval_is_written_by_the_rerun_after_a_kill_before_it(finished_run):
    workdir, _, killed, eval_after_kill, rerun = finished_run
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not eval_after_kill
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from step 4" in rerun.stderr
    result = json.load(open(os.path.join(workdir, "eval", "step_4.json")))
    assert result["step"] == 4 and result["results"]["countdown"]["n"] == 2


def test_bit_flip_in_checkpoint_is_detected_and_every_entry_point_falls_back(finished_run, tmp_path):
    workdir, overrides, *_ = finished_run
    work = _copy(workdir, tmp_path)
    good_eval = open(os.path.join(work, "eval", "step_4.json")).read()
    _flip_bit_in_the_largest_weight(work, 4)

    r = _evaluate(work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint step 4 is unusable" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 2
    assert open(os.path.join(work, "eval", "step_4.json")).read() == good_eval  # the good result is kept

    r = _export(work, str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint step 4 is unusable" in r.stderr and "exported step 2" in r.stdout

    r = run_train(work, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "moved aside" in r.stderr and "resumed from step 2" in r.stderr
    assert comparable(read_jsonl(os.path.join(work, "metrics.jsonl"))) == \
        comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl")))


def test_evaluation_with_slots_equals_the_static_evaluation(finished_run, tmp_path):
    """`stare_jax.evaluate` with the slot-refilling sampler (eval.slots) writes the same results,
    sampled responses included, as the run's own final evaluation with the static batch."""
    workdir, *_ = finished_run
    work = _copy(workdir, tmp_path)
    reference = json.load(open(os.path.join(workdir, "eval", "step_4.json")))
    r = _evaluate(work, "--config.eval.slots=3")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.load(open(os.path.join(work, "eval", "step_4.json")))
    assert got["step"] == 4
    assert got["results"] == reference["results"]


def test_missing_manifest_falls_back_without_asyncio_noise(finished_run, tmp_path):
    workdir, overrides, *_ = finished_run
    work = _copy(workdir, tmp_path)
    os.remove(os.path.join(work, "checkpoints", "4", "state", "manifest.ocdbt"))
    r = _export(work, str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "missing file" in r.stderr and "exported step 2" in r.stdout
    assert "Event loop is closed" not in r.stderr and "Traceback" not in r.stderr
    r = run_train(work, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "missing file" in r.stderr and "resumed from step 2" in r.stderr
    assert "Event loop is closed" not in r.stderr and "Traceback" not in r.stderr


def test_nonfinite_checkpoint_is_never_restored(tmp_path):
    """A state saved with NaN parameters (its digest is valid: the damage is in the values) is refused
    by every restore; the previous step is used instead."""
    import jax
    import jax.numpy as jnp

    ckpt = ckpt_lib.Checkpointer(str(tmp_path), keep=3)
    good = {"train": {"model": {"w": jnp.ones((4, 3))}, "controller": {"last_entropy": jnp.float32(jnp.nan)}}}
    bad = {"train": {"model": {"w": jnp.ones((4, 3)).at[1, 2].set(jnp.nan)},
                     "controller": {"last_entropy": jnp.float32(0.5)}}}
    ckpt.save(1, good, {}, {"step": 1})
    ckpt.save(2, bad, {}, {"step": 2})
    ckpt.wait()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), good)
    ro = ckpt_lib.Checkpointer(str(tmp_path), read_only=True)
    with pytest.raises(ckpt_lib.CheckpointUnusableError, match="non-finite values in train/model/w"):
        ro.restore({"train": {"model": abstract["train"]["model"]}}, step=2, partial=True)
    assert ro.restore({"train": {"model": abstract["train"]["model"]}}, partial=True)[0] == 1
    ro.close()
    step, state, _, _ = ckpt.restore(abstract)
    assert step == 1 and np.isfinite(np.asarray(state["train"]["model"]["w"])).all()
    assert sorted(os.listdir(ckpt.directory)) == ["1", "2.invalid-0"]
    ckpt.close()


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_checkpoint_compression_is_a_choice_and_either_kind_restores(tmp_path):
    """`checkpoint_compression` (Checkpointer(compression=...)): off, a 4 MB array of zeros is stored
    as its 4 MB; on, zstd shrinks it to almost nothing; a Checkpointer of either kind restores both."""
    import jax
    import jax.numpy as jnp

    state = {"train": {"model": {"w": jnp.zeros((1024, 1024)), "b": jnp.arange(7, dtype=jnp.int32)}}}
    sizes = {}
    for compression in (False, True):
        ckpt = ckpt_lib.Checkpointer(str(tmp_path / str(compression)), compression=compression)
        ckpt.save(1, state, {"position": 3}, {"step": 1})
        ckpt.close()
        sizes[compression] = _dir_bytes(str(tmp_path / str(compression) / "checkpoints" / "1" / "state"))
    assert sizes[False] > 4 * 1024 * 1024 > 40 * sizes[True], sizes
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)
    for written in (False, True):
        for reader in (False, True):
            ckpt = ckpt_lib.Checkpointer(str(tmp_path / str(written)), compression=reader)
            step, restored, data, _ = ckpt.restore(abstract)
            ckpt.close()
            assert step == 1 and data == {"position": 3}
            assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), restored, state))


def test_state_digest_catches_any_single_bit_flip_and_ignores_the_layout():
    import jax
    import jax.numpy as jnp

    from stare_jax import parallel

    x = jax.random.normal(jax.random.key(0), (8, 16))
    base = ckpt_lib.state_digest({"x": x})["x"][0]
    raw = np.asarray(x).view(np.uint32).copy()
    for i, bit in ((0, 0), (37, 31), (127, 7), (64, 22)):
        flipped = raw.copy().reshape(-1)
        flipped[i] ^= np.uint32(1 << bit)
        assert ckpt_lib.state_digest({"x": jnp.asarray(flipped.view(np.float32).reshape(8, 16))})["x"][0] != base
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor")))
    assert ckpt_lib.state_digest({"x": sharded})["x"][0] == base
    assert ckpt_lib.digest_problem({"x": ([1, 2], True)}, {"algorithm": ckpt_lib.DIGEST_ALGORITHM,
                                                          "leaves": {"x": [1, 3]}}).startswith("content digest")


_DIGEST_STRESS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from stare_jax import checkpoint
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
specs = [P("tensor", None), P(None, "tensor"), P(("data", "tensor"), None), P()]
leaves = {f"w{i}": jax.device_put(jnp.full((64 * (1 + i % 3), 32), float(i)), NamedSharding(mesh, specs[i % 4]))
          for i in range(40)}
first = checkpoint.state_digest(leaves)
for _ in range(int(sys.argv[1])):
    assert checkpoint.state_digest(leaves) == first
print("ok")
"""


def test_state_digest_of_sharded_leaves_never_deadlocks_xla_cpu():
    """More CPU devices than cores (the tests' meshes), 40 sharded leaves: with every leaf's program
    (each an all-reduce over the devices) in flight at once, XLA:CPU's pool threads deadlocked at
    one program's collective within 20-160 digests and aborted after 40 s (a CI run died of it in
    the mesh-restore test); each program with collectives now finishes before the next starts."""
    r = subprocess.run([sys.executable, "-c", _DIGEST_STRESS, "300"], cwd=ROOT, env=subprocess_env(4),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_state_digest_keeps_its_values_and_compiles_one_program_per_leaf_shape():
    """The digest values of checkpoints written before the leaf-by-leaf programs (the golden sums
    below were computed by the earlier whole-state program), one compiled program per distinct leaf
    shape and dtype, not one per state, and on a CPU no tree reduction (its temporaries made the
    digest of a real train state 5x slower: docs/faults.md)."""
    import jax
    import jax.numpy as jnp

    tree = {"a": jnp.arange(128, dtype=jnp.float32).reshape(8, 16) / 7, "b": jnp.arange(12, dtype=jnp.int32) * -3,
            "c": (jnp.arange(10, dtype=jnp.float32) / 3).astype(jnp.bfloat16), "k": jax.random.key(3)}
    assert ckpt_lib.state_digest(tree) == {"a": ([3818024074, 550416447], True), "b": ([4294964062, 1400792411], True),
                                           "c": ([1620056, 2414541032], True), "k": ([9, 2527132011], True)}
    layers = {f"layer{i}": {"w": jnp.full((13, 11), float(i)), "b": jnp.full((3, 11), float(i))} for i in range(12)}
    before = ckpt_lib._leaf_digest_fns["cpu"]._cache_size()
    digest = ckpt_lib.state_digest(layers)
    assert len(digest) == 24 and len({tuple(sums) for sums, _ in digest.values()}) == 24
    assert ckpt_lib._leaf_digest_fns["cpu"]._cache_size() - before == 2
    # On a CPU the hashing fuses into the sums: no windowed tree reduction over written-out words.
    big = jnp.ones((130, 110))  # the rewrite leaves reductions of a few windows alone
    assert "reduce-window" in jax.jit(ckpt_lib._leaf_digest).lower(big).compile().as_text()
    assert "reduce-window" not in ckpt_lib._leaf_digest_fns["cpu"].lower(big).compile().as_text()


# ----------------------------------------------------------------------------- item 4: signals, item 6: lock

def _tb_events(directory):
    """(file, Event) of every record of the TensorBoard event files in `directory`, oldest file first."""
    from tensorboardX.proto import event_pb2

    for path in sorted(glob.glob(os.path.join(directory, "events.*")), key=os.path.getmtime):
        data = open(path, "rb").read()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            yield path, event
            i += 12 + n + 4


def test_sigterm_saves_the_step_and_exits_143_and_a_second_training_is_refused(tiny_model, tmp_path):
    model, data = tiny_model
    overrides = tiny_overrides(model, data, total_steps=8, checkpoint_every=8, keep_checkpoints=1,
                               **{"logging.tensorboard": True}, **SLOW)
    ref = str(tmp_path / "ref")
    r = run_train(ref, {**overrides, "checkpoint_every": 2})
    assert r.returncode == 0, r.stderr[-3000:]
    # Old steps are retired by an atomic rename, then removed: only the newest step remains.
    assert sorted(os.listdir(os.path.join(ref, "checkpoints"))) == ["8"]

    workdir = str(tmp_path / "run")
    metrics = os.path.join(workdir, "metrics.jsonl")
    proc = subprocess.Popen(train_cmd(workdir, overrides), cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_rows(metrics, 2, proc)
        # Held still while a second training starts (its imports can outlast the first run's
        # remaining steps on a slow host); a stopped process keeps its flock.
        proc.send_signal(signal.SIGSTOP)
        try:
            second = run_train(workdir, overrides)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [second.stderr.strip()]
        assert "is in use by another training" in second.stderr
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM: saved a checkpoint at step ")
    step = int(last.split("step ")[1].split(";")[0])
    assert 2 <= step < 8
    assert ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(step)
    assert [row["step"] for row in read_jsonl(metrics)] == list(range(step))

    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {step}" in r.stderr
    assert comparable(read_jsonl(metrics)) == comparable(read_jsonl(os.path.join(ref, "metrics.jsonl")))
    # TensorBoard is told to hide the first attempt's events of the redone steps (none here: the
    # checkpoint is at the last completed step, so nothing is redone; the purge marker is there).
    events = list(_tb_events(os.path.join(workdir, "tensorboard")))
    newest = events[-1][0]
    starts = [e.step for f, e in events if f == newest and e.HasField("session_log")
              and e.session_log.status == e.session_log.START]
    assert starts == [step]


def test_second_sigint_exits_at_once_without_saving(tiny_model, tmp_path):
    model, data = tiny_model
    overrides = tiny_overrides(model, data, total_steps=50, checkpoint_every=50, **SLOW)
    workdir = str(tmp_path / "run")
    proc = subprocess.Popen(train_cmd(workdir, overrides), cwd=ROOT,
                            env=subprocess_env(STARE_TEST_REWARD_DELAY="0.15"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_rows(os.path.join(workdir, "metrics.jsonl"), 1, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # well inside the ~2.4 s step the first signal lets finish
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT again: exiting at once" in err and "saved a checkpoint" not in err
    assert not any(d.isdigit() for d in os.listdir(os.path.join(workdir, "checkpoints")))


# On a new session with the pty as its controlling terminal and SIGHUP's default action (as a
# terminal's shell starts a command, even if the suite runs under nohup), then the training itself:
# closing the pty's master hangs the terminal up (the kernel sends SIGHUP, later writes fail with EIO).
_ON_A_TERMINAL = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                  "signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def test_a_closed_terminal_saves_the_step_exits_129_and_logs_to_the_workdir(tiny_model, tmp_path):
    """A run in a terminal that closes (SIGHUP from the kernel, and a second from the shell to its
    jobs) finishes its step, saves, writes its stop line to WORKDIR/hangup.log and exits 129; the
    reward workers (same process group) survive the hang-up, and the resumed run ends exactly like
    an uninterrupted one. Before, the default action killed the run and lost every step since its
    last checkpoint."""
    import pty
    import select

    model, data = tiny_model
    overrides = tiny_overrides(model, data, total_steps=6, checkpoint_every=6, **SLOW)
    ref = str(tmp_path / "ref")
    r = run_train(ref, overrides)
    assert r.returncode == 0, r.stderr[-3000:]

    workdir = str(tmp_path / "run")
    metrics = os.path.join(workdir, "metrics.jsonl")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", _ON_A_TERMINAL, *train_cmd(workdir, overrides)[1:]], cwd=ROOT,
                            env=subprocess_env(STARE_TEST_REWARD_DELAY="0.1"), stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        deadline = time.time() + 300
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2):
            assert time.time() < deadline and proc.poll() is None, f"exit {proc.poll()}"
            if select.select([master], [], [], 0.05)[0]:
                os.read(master, 1 << 16)  # drain the terminal, as a terminal would
        os.close(master)  # the terminal closes: the kernel hangs the session up
        time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)  # the shell's copy
        assert proc.wait(timeout=300) == 129
    finally:
        proc.kill()
    last = open(os.path.join(workdir, "hangup.log")).read().strip().splitlines()[-1]
    assert last.startswith("stopped by SIGHUP: saved a checkpoint at step "), last
    step = int(last.split("step ")[1].split(";")[0])
    assert 2 <= step < 6 and ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(step)
    assert [row["step"] for row in read_jsonl(metrics)] == list(range(step))

    r = run_train(workdir, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {step}" in r.stderr
    assert comparable(read_jsonl(metrics)) == comparable(read_jsonl(os.path.join(ref, "metrics.jsonl")))


def test_nohup_stays_and_an_inherited_sigint_ignore_does_not(tmp_path):
    """`nohup` ignores SIGHUP before the run starts: the run keeps it ignored (its output already
    goes to a file). SIGINT inherited as ignored (a background job, a pytest-xdist worker's child)
    is handled all the same, so `kill -INT` still stops the run with a checkpoint."""
    from stare_jax import preemption

    before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with preemption.StopSignal(str(tmp_path / "hangup.log")) as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) == stop._handle
            assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert not (tmp_path / "hangup.log").exists()


# ----------------------------------------------------------------------------- item 5: bad input

def _one_line_exit_2(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, (needle, last)


def test_bad_training_inputs_exit_2_with_one_line(tiny_model, tmp_path):
    model, data = tiny_model
    base = tiny_overrides(model, data)
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (str(tmp_path / "a"), {**base, "data.train_files": "/nonexistent/train.jsonl"}, [],
         ("data.train_files", "data.name='countdown' does not use it")),
        (str(tmp_path / "b"), {**base, "model.path": "/nonexistent/model"}, [], ("model.path", "/nonexistent/model")),
        (str(afile), base, [], ("--workdir", str(afile), "not a directory")),
        # an empty workdir once trained into the current directory; one under a file crashed in makedirs
        ("", base, [], ("--workdir: empty",)),
        (str(afile / "run"), base, [], ("--workdir", str(afile / "run"), "cannot be created or written in")),
        (str(tmp_path / "c"), base, ["--config", "configs/nonexistent.py"], ("configs/nonexistent.py", "no such file")),
        # a reward function that cannot be imported: refused as the verifier pool starts, before the model loads
        (str(tmp_path / "d"), {**base, "reward.name": "tests.reward_fixtures:no_such_reward"}, [],
         ("reward.name", "has no attribute 'no_such_reward'")),
    ]
    for workdir, overrides, config_args, needles in cases:
        cmd = train_cmd(workdir, overrides)
        if config_args:
            cmd[cmd.index("--config"):cmd.index("--config") + 2] = config_args
        r = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        _one_line_exit_2(r, *needles)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_a_damaged_model_directory_exits_2_with_one_line(tiny_model, tmp_path):
    """A model directory that cannot be read (config.json not JSON or lacking a field, the weights
    cut short, a tokenizer file not JSON) stops training with one line naming the file, exit 2 and
    no traceback; so do evaluate and export of a run whose model directory was damaged after it trained."""
    model, data = tiny_model
    good = shutil.copytree(model, str(tmp_path / "model"))
    run = str(tmp_path / "run")
    r = run_train(run, tiny_overrides(good, data, total_steps=1, checkpoint_every=1))
    assert r.returncode == 0, r.stderr[-3000:]

    def write(text):
        return lambda path: open(path, "w").write(text)

    def drop_field(path):
        with open(path) as f:
            cfg = json.load(f)
        del cfg["hidden_size"]
        with open(path, "w") as f:
            json.dump(cfg, f)

    def cut(path):
        head = open(path, "rb").read(1000)
        open(path, "wb").write(head)

    cases = [("config.json", write("{bad"), ("model error:", "config.json", "cannot be read as JSON")),
             ("config.json", drop_field, ("config.json", "hidden_size")),
             ("model.safetensors", cut, ("model error:", "model.safetensors")),
             ("tokenizer.json", write("{bad"), ("model error:", "tokenizer files cannot be loaded")),
             ("tokenizer_config.json", write("{bad"), ("model error:", "tokenizer files cannot be loaded"))]
    for i, (name, damage, needles) in enumerate(cases):
        path = shutil.copytree(good, str(tmp_path / f"damaged{i}"))
        damage(os.path.join(path, name))
        _one_line_exit_2(run_train(str(tmp_path / f"work{i}"), tiny_overrides(path, data)), path, *needles)
    write("{bad")(os.path.join(good, "tokenizer.json"))  # the trained run's model directory
    _one_line_exit_2(_evaluate(run), "model error:", "tokenizer files cannot be loaded")
    _one_line_exit_2(_export(run, str(tmp_path / "hf")), "model error:", "tokenizer files cannot be loaded")


def test_bad_evaluate_and_export_inputs_exit_2_with_one_line(finished_run, tmp_path):
    workdir, overrides, *_ = finished_run
    _one_line_exit_2(_evaluate(workdir, "--step", "3"), "no complete step 3")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_exit_2(_evaluate(str(empty)), str(empty), "no checkpoints")
    _one_line_exit_2(_evaluate(workdir, "--samples", "3"), "--samples: unknown argument", "--n N")  # not a flag of it
    _one_line_exit_2(_run(["stare_jax.evaluate", "--config", QUICKSTART, "--workdir", workdir, "--n", "x"]),
                     "--n: got 'x'; allowed: an integer >= 1")
    out = tmp_path / "model.safetensors"
    out.write_text("precious")
    _one_line_exit_2(_export(workdir, str(out)), "--out", "exists and is not a directory")
    assert out.read_text() == "precious"
    _one_line_exit_2(_export(workdir, str(out / "hf")), "--out", "cannot be created or written in")
    _one_line_exit_2(_export(workdir, ""), "--out: empty")
    _one_line_exit_2(_evaluate(""), "--workdir: empty")
    # an export onto the run itself would overwrite its config.json, a checkpoint or its base model
    before = {name: open(os.path.join(workdir, name)).read() for name in ("config.json", "metrics.jsonl")}
    _one_line_exit_2(_export(workdir, workdir + os.sep), "--out", "is the run's workdir")
    _one_line_exit_2(_export(workdir, os.path.join(workdir, "checkpoints", "hf")), "inside the run's checkpoints")
    _one_line_exit_2(_export(workdir, overrides["model.path"]), "the run's base model directory")
    assert {name: open(os.path.join(workdir, name)).read() for name in before} == before
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "hf"))


# ----------------------------------------------------------------------------- item 6: leftovers

def test_kill_during_warm_start_leaves_no_model_tmp(tmp_path):
    """The embedded model is written to WORKDIR/model.tmp-<pid> and renamed; a SIGKILL in between
    left that directory forever. The next run removes it."""
    workdir = str(tmp_path / "run")
    tiny = {"model.embedded.hidden_size": 16, "model.embedded.num_layers": 1, "model.embedded.num_heads": 2,
            "model.embedded.num_kv_heads": 1, "model.embedded.intermediate_size": 32, "warmstart.batch_size": 8}
    overrides = tiny_overrides("", str(tmp_path / "tfds"), **tiny, **{"warmstart.steps": 100000})
    proc = subprocess.Popen(train_cmd(workdir, overrides), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not glob.glob(os.path.join(workdir, "model.tmp-*")):
            time.sleep(0.05)
        assert glob.glob(os.path.join(workdir, "model.tmp-*")), "the warm start never began"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    r = run_train(workdir, {**overrides, "warmstart.steps": 2, "total_steps": 1, "checkpoint_every": 1})
    assert r.returncode == 0, r.stderr[-3000:]
    assert glob.glob(os.path.join(workdir, "model.tmp-*")) == []
    assert "left by a killed process" in r.stderr


def test_half_deleted_retired_step_is_removed_on_the_next_start(finished_run, tmp_path):
    """Orbax retires old steps by renaming them into checkpoints/todelete/ (atomic) before removing
    them; what a kill leaves there is removed by the next start and never listed as a step."""
    workdir, overrides, *_ = finished_run
    work = _copy(workdir, tmp_path)
    leftover = os.path.join(work, "checkpoints", ckpt_lib.TODELETE, "1", "state")
    os.makedirs(leftover)
    open(os.path.join(leftover, "_METADATA"), "w").write("{")
    r = run_train(work, overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(work, "checkpoints"))) == ["2", "4"]


_SECOND_SIGNAL = """
import multiprocessing, os, signal, time
from stare_jax import preemption
child = multiprocessing.get_context("forkserver").Process(target=int)  # starts a forkserver, as the reward pool does
child.start(); child.join()
print(multiprocessing.process.current_process()._config["tempdir"], flush=True)
with preemption.StopSignal() as stop:
    stop.defer()
    os.kill(os.getpid(), signal.SIGTERM)  # the first: only flagged
    assert stop.signum == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # the second: out at once
    time.sleep(60)
"""


def test_a_second_signal_exits_at_once_and_leaves_no_multiprocessing_tempdir(tmp_path):
    """A second SIGTERM exits at once with 143 and one line, and removes multiprocessing's
    /tmp/pymp-* directory (the forkserver's socket), which os._exit would otherwise leave behind."""
    r = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**subprocess_env(), "TMPDIR": str(tmp_path)})
    assert r.returncode == 143, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == "SIGTERM again: exiting at once without saving"
    tempdir = r.stdout.strip()
    assert tempdir.startswith(str(tmp_path)) and os.path.basename(tempdir).startswith("pymp-")
    assert not os.path.exists(tempdir) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_during_warm_start_exits_at_once_with_one_line(tmp_path, sig, code):
    """SIGINT / SIGTERM before the training loop (here: inside a warm start that would take hours)
    end the run at once with one line and status 130 / 143, no traceback (nothing to save yet)."""
    workdir = str(tmp_path / "run")
    tiny = {"model.embedded.hidden_size": 16, "model.embedded.num_layers": 1, "model.embedded.num_heads": 2,
            "model.embedded.num_kv_heads": 1, "model.embedded.intermediate_size": 32, "warmstart.batch_size": 8}
    overrides = tiny_overrides("", str(tmp_path / "tfds"), **tiny, **{"warmstart.steps": 100000})
    proc = subprocess.Popen(train_cmd(workdir, overrides), cwd=ROOT, env=subprocess_env(), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(os.path.join(workdir, "model.tmp-*")):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"stopped by {sig.name} before the first"), err


def test_storage_failures_are_recognised_through_library_wrappers(tmp_path):
    """`workdir.storage_reason` finds a full or failing disk in an OSError, in a library's error that
    quotes the system's message (TensorStore, array_record), or in an exception's cause; other
    errors (a missing file, a bug) are not storage failures and keep their traceback in `train`."""
    import errno

    from stare_jax import train, workdir as workdir_lib

    reason = workdir_lib.storage_reason
    assert reason(OSError(errno.ENOSPC, "No space left on device", "/x")) == "No space left on device (errno 28)"
    assert reason(RuntimeError('Failed to finalize writing of split "train": write() failed: File too large')) == \
        f"File too large (errno {errno.EFBIG})"
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        except OSError as e:
            raise ValueError("save failed") from e
    except ValueError as e:
        assert reason(e) == f"Read-only file system (errno {errno.EROFS})"
    assert reason(FileNotFoundError(errno.ENOENT, "No such file or directory")) is None
    assert reason(ValueError("shapes do not match")) is None
    line = train.failure_line(OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl"), str(tmp_path))
    assert line == (f"error: writing under {tmp_path} failed: No space left on device (errno 28) (OSError: [Errno 28] "
                    f"No space left on device: '/w/metrics.jsonl'); no checkpoint was committed yet: free space (or "
                    f"fix the file system) and rerun the same command to resume")


def test_out_of_device_memory_is_one_line_naming_what_to_lower(tmp_path):
    """XLA's RESOURCE_EXHAUSTED (a batch too large for the devices: the quickstart with
    data.prompt_batch_size=10000 asked for 35 GiB here) is one line with what to lower and the
    checkpoint a rerun resumes from, not a traceback; an XLA error of another kind keeps it."""
    import jax

    from stare_jax import train

    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 37566579736 bytes.")
    line = train.failure_line(oom, str(tmp_path))
    assert line.startswith("error: out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating 37566579736 "
                           "bytes.); no checkpoint was committed yet: lower data.prompt_batch_size, "), line
    assert line.endswith("and rerun the same command to resume") and "stare_jax.dryrun" in line
    assert train.failure_line(jax.errors.JaxRuntimeError("INTERNAL: something else"), str(tmp_path)) is None
    assert train.failure_line(ValueError("RESOURCE_EXHAUSTED"), str(tmp_path)) is None  # only XLA's own
    assert train.failure_line(oom, str(tmp_path), resume=False).endswith("and rerun the same command")
