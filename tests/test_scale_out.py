"""Scale-out (issue 7): multi-process training equals single-process, and checkpoints reshard."""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from stare_jax import trainer
from stare_jax.writers import read_jsonl
from tests.e2e_helpers import ROOT, comparable, run_train, subprocess_env, tiny_overrides, train_cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _short_tmpdir(monkeypatch):
    """A short TMPDIR of its own for the processes each test starts, removed after the test with what a
    process killed there left in it (multiprocessing's `pymp-*` directories, which only an orderly
    exit removes). Short: the reward pool's forkserver socket lives there, and the pytest directory's
    path would pass AF_UNIX's 108-byte limit."""
    path = tempfile.mkdtemp(prefix="sj-")
    monkeypatch.setenv("TMPDIR", path)
    yield
    shutil.rmtree(path, ignore_errors=True)


def _close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float) and isinstance(b[k], float):
            assert abs(a[k] - b[k]) <= tol * max(1.0, abs(a[k])), (k, a[k], b[k])
        else:
            assert a[k] == b[k], (k, a[k], b[k])


def _two_processes(workdir, overrides, env=None, env_of_process_1=None, overrides_of_process_1=None, devices=1):
    """Starts the two processes of one training, `devices` CPU devices each (stderr piped, stdout
    dropped); `env` for both, `env_of_process_1` and `overrides_of_process_1` for process 1 only."""
    port = _free_port()
    procs = []
    for pid in range(2):
        o = dict(overrides, **{"distributed.coordinator_address": f"127.0.0.1:{port}", "distributed.num_processes": 2,
                               "distributed.process_id": pid}, **(overrides_of_process_1 or {} if pid == 1 else {}))
        extra = dict(env or {}, **(env_of_process_1 or {} if pid == 1 else {}))
        procs.append(subprocess.Popen(train_cmd(workdir, o), cwd=ROOT, env=subprocess_env(devices, **extra),
                                      text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


def _stderr_of(procs, timeout):
    """Each process's standard error once it ends (all are killed if one outlasts `timeout` s)."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()


def _wait_for_steps(procs, metrics, steps, timeout=200):
    """Waits until `metrics` holds `steps` rows while every process runs."""
    import time

    t0 = time.time()
    while not (os.path.exists(metrics) and len(read_jsonl(metrics)) >= steps):
        assert time.time() - t0 < timeout and all(p.poll() is None for p in procs)
        time.sleep(0.1)


def _lost_peer_line(pid, kept=r"the checkpoint of step [24] is intact"):
    """The line of process `pid` whose peer was lost (`kept`: what it says of the checkpoints)."""
    return re.compile(rf"error: process {pid} of 2 lost a peer: \w+: .*(Connection closed by peer|Connection reset by "
                      rf"peer).*; another process of the run stopped \(its own output gives the reason\); {kept}: "
                      rf"rerun every process with the same command to resume")


def test_two_processes_of_two_devices_match_one_process_of_four(tiny_model, tmp_path):
    """Issue 19 item 8: the topology (processes x devices) does not change the trajectory beyond
    reduction-order noise, for a data x fsdp and a data x tensor layout: 2 processes x 2 devices in
    each layout against one reference of 1 process x 4 devices (data x fsdp), 3 steps, every metric
    within 1e-6 (one reference for both: the layout does not change it either)."""
    model, data = tiny_model

    def overrides(mesh):
        return tiny_overrides(model, data, total_steps=3, checkpoint_every=3,
                              **{"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})

    single = str(tmp_path / "single")
    r = run_train(single, overrides((2, 2, 1)), devices=4)
    assert r.returncode == 0, r.stderr[-3000:]
    a = comparable(read_jsonl(os.path.join(single, "metrics.jsonl")))
    assert len(a) == 3
    for name, mesh in (("data2_fsdp2", (2, 2, 1)), ("data2_tensor2", (2, 1, 2))):
        multi = str(tmp_path / name)
        port = _free_port()
        procs = []
        for pid in range(2):
            o = dict(overrides(mesh), **{"distributed.coordinator_address": f"127.0.0.1:{port}",
                                         "distributed.num_processes": 2, "distributed.process_id": pid})
            procs.append(subprocess.Popen(train_cmd(multi, o), cwd=ROOT, env=subprocess_env(2), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = [p.communicate(timeout=600) for p in procs]
        assert all(p.returncode == 0 for p in procs), (name, [o[1][-2000:] for o in outs])
        b = comparable(read_jsonl(os.path.join(multi, "metrics.jsonl")))
        assert len(b) == 3, name
        for ra, rb in zip(a, b):
            _close(ra, rb)
        assert os.path.isdir(os.path.join(multi, "checkpoints", "3"))
        # the content digest the two processes saved (each leaf's sums read from its own replicated
        # copy, parallel.to_host) is the one a single process recomputes on restore
        assert trainer.load_trained_policy(multi)[2] == 3


def test_a_save_that_fails_on_one_process_stops_every_process_with_one_line(tiny_model, tmp_path):
    """On two processes, process 1's part of the step-4 checkpoint fails in Orbax's writer threads
    (its files limited to 1 KiB: EFBIG) while process 0's succeeds. Orbax's two threads then wait
    at different barriers until its 10-minute timeout (the run hung that long, then aborted); now
    the processes agree on the failure after the next step and both stop with one line each
    (process 1 names the system's reason, process 0 the process), well within that timeout, and
    the checkpoint of step 2 stays committed."""
    import time

    from stare_jax import checkpoint as ckpt_lib

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    os.makedirs(tmp_path / "tmp")
    t0 = time.time()
    procs = _two_processes(workdir, tiny_overrides(model, data, total_steps=8, checkpoint_every=2,
                                                   **{"mesh.data": 2, "mesh.fsdp": 2}),
                           env={ckpt_lib.FAULT_WRITE_FAILS_FROM_SAVE: "4:1", "TMPDIR": str(tmp_path / "tmp")}, devices=2)
    errs = _stderr_of(procs, 400)
    assert [p.returncode for p in procs] == [1, 1], [e[-2000:] for e in errs]
    assert time.time() - t0 < 300
    last = [e.strip().splitlines()[-1] for e in errs]
    intact = "; the checkpoint of step 2 is intact: free space (or fix the file system) and rerun the same command to resume"
    assert last[0] == (f"error: the checkpoint of step 4 could not be written to {workdir}/checkpoints: process 1's part "
                       f"failed (its own error line gives the reason){intact}"), last[0]
    assert last[1] == (f"error: the checkpoint of step 4 could not be written to {workdir}/checkpoints: File too large "
                       f"(errno 27) (Orbax's log of it: {workdir}/checkpoint_errors.log) (on process 1 of 2){intact}"), last[1]
    assert ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(2)
    assert not ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(4)
    steps = [row["step"] for row in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
    assert steps == list(range(len(steps))) and 4 <= len(steps) < 8
    # the immediate exit skips multiprocessing's finalizer: its /tmp/pymp-* directory is removed anyway
    assert os.listdir(tmp_path / "tmp") == []


def test_a_path_missing_on_one_process_stops_every_process_with_one_line(tiny_model, tmp_path):
    """`model.path` missing on process 1's host only: before, process 1 exited 2 before joining
    the run and process 0 waited in `jax.distributed.initialize` for its 5-minute timeout, then
    aborted with a fatal log; now both join, exchange their start-up checks through the
    coordination service's key-value store, and both exit 2 within seconds, process 1 with its own
    line and process 0 with that line under process 1's name. Nothing is trained."""
    import time

    model, data = tiny_model
    workdir, missing = str(tmp_path / "run"), str(tmp_path / "not_on_this_host")
    t0 = time.time()
    procs = _two_processes(workdir, tiny_overrides(model, data, **{"mesh.data": 2}),
                           overrides_of_process_1={"model.path": missing})
    errs = _stderr_of(procs, 200)
    assert [p.returncode for p in procs] == [2, 2], [e[-2000:] for e in errs]
    assert time.time() - t0 < 60
    own = (f"config error: model.path: {missing}: no such directory; allowed: a Hugging Face model directory "
           f"(config.json, *.safetensors, tokenizer files)")
    assert errs[1].strip().splitlines()[-1] == own
    assert errs[0].strip().splitlines()[-1] == f"process 1 of 2: {own}"
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.parametrize("failing", [1, 0])
def test_an_error_on_one_process_stops_every_process_at_once(tiny_model, tmp_path, failing):
    """A bug (any exception) on one process of two, in step 4: before, that process waited in JAX's
    shutdown barrier at exit while the other waited for it in its next collective, until the
    coordination service's 5-minute timeout aborted both (SIGABRT, a fatal log, no word from the
    healthy process of why). Now the failing process keeps its traceback and exits without the
    shutdown barrier, and the other's collective fails at once: it ends with one line naming the
    lost peer and the checkpoint to resume from. Both end within seconds, whichever fails, the
    coordination service's host (process 0) or not."""
    import signal
    import time

    from stare_jax import trainer as trainer_lib

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    t0 = time.time()
    procs = _two_processes(workdir, tiny_overrides(model, data, total_steps=8, checkpoint_every=2,
                                                   **{"mesh.data": 2}),
                           env={trainer_lib.FAULT_RAISE_AT_STEP: f"4:{failing}"})
    errs = _stderr_of(procs, 280)
    other = 1 - failing
    # When process 0 (the coordination service's host) fails, the other meets the lost service and
    # the closed peer at once: its collective's error reached Python first in every run seen, but
    # JAX's client may abort it first (SIGABRT, its own fatal line) on a loaded host.
    allowed = (1,) if failing == 1 else (1, -signal.SIGABRT)
    assert procs[failing].returncode == 1 and procs[other].returncode in allowed, [e[-2000:] for e in errs]
    assert time.time() - t0 < 150
    assert errs[failing].strip().splitlines()[-1] == f"RuntimeError: {trainer_lib.FAULT_RAISE_AT_STEP}: a failure injected in step 4"
    assert "Traceback (most recent call last)" in errs[failing]
    if procs[other].returncode == 1:
        assert _lost_peer_line(other).fullmatch(errs[other].strip().splitlines()[-1]), errs[other][-2000:]
    assert "Traceback" not in errs[other]
    assert len(read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == 4


def test_a_process_killed_during_a_save_stops_the_other_at_once_and_both_resume(tiny_model, tmp_path):
    """`kill -9` of process 1 while the checkpoint of step 4 is being written: process 0's next
    collective fails (Gloo: the dead peer's connection reset or closed) and it stops with one line
    in seconds, giving up its pending save (whose Orbax threads would wait for process 1 at the
    commit barrier), where before it waited for the coordination service's heartbeat timeout (100 s)
    and then aborted with SIGABRT and a fatal log. The rerun of both processes moves the
    uncommitted step aside and resumes from step 2 to the end."""
    import time

    from stare_jax import checkpoint as ckpt_lib

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data, total_steps=6, checkpoint_every=2, **{"mesh.data": 2})
    t0 = time.time()
    procs = _two_processes(workdir, overrides, env_of_process_1={ckpt_lib.FAULT_KILL_DURING_SAVE: "4"})
    errs = _stderr_of(procs, 280)
    assert [p.returncode for p in procs] == [1, -9], errs[0][-2000:]
    assert time.time() - t0 < 90
    assert _lost_peer_line(0).fullmatch(errs[0].strip().splitlines()[-1]), errs[0][-2000:]
    assert "checkpoint of step 4 abandoned uncommitted" in errs[0]
    assert "the checkpoint of step 2 is intact" in errs[0]
    assert not ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(4)
    procs = _two_processes(workdir, overrides)
    errs = _stderr_of(procs, 280)
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    assert [row["step"] for row in read_jsonl(os.path.join(workdir, "metrics.jsonl"))] == list(range(6))
    assert ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(6)


def test_sigterm_to_one_process_stops_both_after_the_same_step_and_both_resume(tiny_model, tmp_path):
    """A preemption notice (SIGTERM) to process 1 only: the processes combine their stop flags
    each step, so both finish the same step, save its checkpoint together and exit 143 with the
    stop line; the rerun of both resumes from it and ends with every step once."""
    import signal

    from stare_jax import checkpoint as ckpt_lib

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    overrides = tiny_overrides(model, data, total_steps=40, checkpoint_every=20, **{"mesh.data": 2})
    procs = _two_processes(workdir, overrides)
    metrics = os.path.join(workdir, "metrics.jsonl")
    try:
        _wait_for_steps(procs, metrics, 3)
        procs[1].send_signal(signal.SIGTERM)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    errs = _stderr_of(procs, 200)
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errs]
    last = [e.strip().splitlines()[-1] for e in errs]
    step = int(re.fullmatch(r"stopped by SIGTERM: saved a checkpoint at step (\d+); rerun the same command to resume",
                            last[0]).group(1))
    assert last[1] == last[0] and 3 <= step < 40
    assert ckpt_lib.Checkpointer(workdir, read_only=True).is_complete(step)
    procs = _two_processes(workdir, dict(overrides, total_steps=step + 2))
    errs = _stderr_of(procs, 280)
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    assert [row["step"] for row in read_jsonl(metrics)] == list(range(step + 2))


def test_a_hung_process_ends_the_run_after_the_configured_heartbeat_timeout(tiny_model, tmp_path):
    """A process that hangs (SIGSTOP: alive, its sockets open) blocks the others' collectives, on
    CPU as on GPU/TPU; only the coordination service's heartbeat timeout ends the run. With
    `distributed.heartbeat_timeout_s` 5 (JAX's default 100) process 0 ends within seconds, by
    JAX's own abort (a fatal log naming the unhealthy task, SIGABRT); the hung process, once
    continued, ends too."""
    import signal
    import time

    model, data = tiny_model
    workdir = str(tmp_path / "run")
    procs = _two_processes(workdir, tiny_overrides(model, data, total_steps=400, checkpoint_every=2,
                                                   **{"mesh.data": 2, "distributed.heartbeat_timeout_s": 5}))
    metrics = os.path.join(workdir, "metrics.jsonl")
    try:
        _wait_for_steps(procs, metrics, 3)
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        procs[0].wait(timeout=60)
        ended = time.time() - stopped
    finally:
        procs[1].send_signal(signal.SIGCONT)
        errs = _stderr_of(procs, 60)
    assert procs[0].returncode == -signal.SIGABRT and ended < 40, (ended, errs[0][-2000:])
    assert "Terminating process because the JAX distributed service detected fatal errors" in errs[0]
    # Continued, the hung process meets the lost service and the closed peer at once: JAX's client
    # aborts it, or its collective's error reaches Python first and it stops with the lost-peer line.
    assert procs[1].returncode in (1, -signal.SIGABRT), errs[1][-2000:]
    kept = r"(no checkpoint was committed yet|the checkpoint of step \d+ is intact)"  # a save may be pending
    assert procs[1].returncode != 1 or _lost_peer_line(1, kept).fullmatch(errs[1].strip().splitlines()[-1]), \
        errs[1][-2000:]


def test_a_process_that_never_joins_ends_the_wait_after_the_configured_timeout(tiny_model, tmp_path):
    """Process 1 of 2 never starts: process 0 waits in `jax.distributed.initialize` for
    `distributed.initialization_timeout_s` (here 3; JAX's default 300) and ends (JAX aborts it)."""
    import time

    model, data = tiny_model
    o = dict(tiny_overrides(model, data, **{"mesh.data": 2, "distributed.initialization_timeout_s": 3}),
             **{"distributed.coordinator_address": f"127.0.0.1:{_free_port()}", "distributed.num_processes": 2,
                "distributed.process_id": 0})
    t0 = time.time()
    r = subprocess.run(train_cmd(str(tmp_path / "run"), o), cwd=ROOT, env=subprocess_env(1), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and time.time() - t0 < 40, r.stderr[-2000:]
    assert "DEADLINE_EXCEEDED" in r.stderr


def test_checkpoint_restores_onto_other_meshes(tiny_model, tmp_path):
    model, data = tiny_model
    saved = str(tmp_path / "fsdp4")
    r = run_train(saved, tiny_overrides(model, data, total_steps=2, checkpoint_every=1,
                                        **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 1}), devices=4)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {}
    for name, mesh, devices in (("fsdp4", (1, 4, 1), 4), ("data2_tensor2", (2, 1, 2), 4), ("one_device", (1, 1, 1), 1)):
        workdir = saved if name == "fsdp4" else str(tmp_path / name)
        if workdir != saved:
            shutil.copytree(saved, workdir, ignore=shutil.ignore_patterns("tensorboard"))
        o = tiny_overrides(model, data, total_steps=3, checkpoint_every=1,
                           **{"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})
        r = run_train(workdir, o, devices=devices)
        assert r.returncode == 0, r.stderr[-3000:]
        rows[name] = comparable(read_jsonl(os.path.join(workdir, "metrics.jsonl")))[2]
    assert rows["fsdp4"]["step"] == 2
    _close(rows["fsdp4"], rows["data2_tensor2"])
    _close(rows["fsdp4"], rows["one_device"])


def test_embedded_warm_start_is_the_same_for_any_device_count(tmp_path):
    """Issue 19 item 8: the quickstart's embedded model is warm-started by ~400 jitted steps on one
    device, and XLA:CPU runs that same program slightly differently in a 4-device process than in a
    2-device one, so 1 process x 4 devices and 2 x 2 started RL from different weights (grad_norm
    4e-4 apart at step 0). The warm start now runs in a child pinned to one CPU device.

    The child compiles into the run's persistent compilation cache (here $STARE_COMPILATION_CACHE_DIR,
    which the parent, calling the library directly, never opens), and the second warm start of the
    same shape loads every program from it: no new entry."""
    code = ("import sys; from stare_jax import config as C, trainer; c = C.default_config(); "
            "c.warmstart.steps = 8; c.warmstart.batch_size = 16; c.seed = 77; "
            "trainer.embedded_model_dir(c, sys.argv[1])")
    cache = tmp_path / "xla"
    entries = []
    for devices in (4, 2):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"d{devices}")], cwd=ROOT,
                           env=subprocess_env(devices, STARE_COMPILATION_CACHE_DIR=str(cache)),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        entries.append(sorted(os.listdir(cache)))
    a, b = (open(tmp_path / f"d{n}" / "model" / "model.safetensors", "rb").read() for n in (4, 2))
    assert a == b
    assert entries[0] and entries[1] == entries[0]
