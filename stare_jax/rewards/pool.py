"""RewardPool: reward functions run in isolated worker processes with per-call timeouts.

The trainer process runs JAX, so it is never forked: workers come from a `forkserver` (a clean
interpreter that has pre-imported the verifiers, so replacing a worker takes milliseconds) or from
`spawn`. Each worker has its own pipe and runs one call at a time; calls are spread over all
workers in parallel.

A call that raises, returns something that is not a real number, or returns NaN/inf scores 0.0;
a call still running `timeout_s` after it was handed to a worker scores 0.0, its worker is killed
(SIGKILL, then reaped) and replaced; a worker that dies mid-call scores 0.0 and is replaced.
Nothing of that stops training: `score` always returns one float per response plus counters

    reward_timeouts, reward_errors, reward_nonfinite, reward_calls, reward_s

A batch of n calls on W workers takes at most about ceil(n / W) * timeout_s (all hanging);
`batch_timeout_s` caps the whole batch (unfinished calls then count as timeouts).

    with RewardPool("math", num_workers=4, timeout_s=10) as pool:
        scores, stats = pool.score(responses, ground_truths)
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import sys
import threading
import time
import types
import weakref
from typing import Any, NamedTuple, Sequence

import numpy as np

from stare_jax import preemption
from stare_jax.rewards.functions import FIRST_CALL_IMPORTS, load_function, resolve_spec

log = logging.getLogger(__name__)

#: what the forkserver imports for every reward; `preload_modules` adds the reward's own
DEFAULT_PRELOAD = ("stare_jax.rewards.pool", "stare_jax.rewards.functions")
STAT_KEYS = ("reward_timeouts", "reward_errors", "reward_nonfinite", "reward_calls")


LOAD = "load"  # the task id of a worker's start-up check that the pool's reward function imports
LOAD_TIMEOUT_S = 120.0


def preload_modules(spec: str) -> tuple[str, ...]:
    """The modules a pool's forkserver imports before it forks workers for reward `spec` (a
    "module:function" spec): `DEFAULT_PRELOAD` and what a built-in reward imports when first
    called (`functions.FIRST_CALL_IMPORTS`): for a built-in reward its own, for any other every
    built-in's, since its calls may name them (`score(..., reward=...)`) and an import inside a
    call counts against the call's timeout. A countdown pool's per-call math reward pays
    math-verify's import (~0.5-1 s) on each worker's first such call. Never a user's module: the
    forkserver ignores only an ImportError of a preload, so one that raises otherwise or hangs
    would take the pool down with it, where the workers' own import is checked and timed
    (`_check_loadable`)."""
    if spec in FIRST_CALL_IMPORTS:
        return DEFAULT_PRELOAD + FIRST_CALL_IMPORTS[spec]
    every = dict.fromkeys(m for modules in FIRST_CALL_IMPORTS.values() for m in modules)
    return DEFAULT_PRELOAD + tuple(every)


class RewardSpecError(ValueError):
    """The pool's reward function cannot be loaded (no such module or function, an import that
    fails or hangs): bad input, refused when the pool starts rather than scored 0 call by call."""


def _load_failure(e: BaseException) -> str:
    """A reward function's failure to load as "Type: first line of its message"."""
    from stare_jax.config import first_line

    return f"{type(e).__name__}: {first_line(e)}"[:500]


class RewardResult(NamedTuple):
    """Scores float32 [N] (0.0 for failed calls) and the counters of this call."""

    scores: np.ndarray
    stats: dict[str, float]


# --------------------------------------------------------------------------- worker side


def _watch_parent(parent_pid: int) -> None:
    """Exit the worker when the trainer is gone (even while a reward call hangs)."""
    ppid = os.getppid()
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass
        if os.getppid() != ppid:
            os._exit(0)


def _worker_main(conn, parent_pid: int) -> None:
    """Worker loop: receive (task id, spec, response, ground truth), send (task id, kind, value)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a closed terminal are the trainer's business
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    functions: dict[str, Any] = {}
    try:
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, spec, response, ground_truth = msg
        if task_id == LOAD:  # the pool's start-up check of its reward function
            try:
                functions[spec] = load_function(spec)
                reply = (LOAD, "ok", None)
            except BaseException as e:  # noqa: BLE001 - an import may even call sys.exit
                reply = (LOAD, "error", _load_failure(e))
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return
            continue
        try:
            fn = functions.get(spec)
            if fn is None:
                fn = functions[spec] = load_function(spec)
            value = fn(response, ground_truth)
            if isinstance(value, np.ndarray) and value.shape == ():
                value = value[()]
            if isinstance(value, (numbers.Real, np.bool_)):  # bool, int, float and numpy scalars
                reply = (task_id, "ok", float(value))
            else:
                reply = (task_id, "error", f"returned {type(value).__name__}, not a number")
        except Exception as e:  # noqa: BLE001 - any verifier failure is a zero reward
            reply = (task_id, "error", f"{type(e).__name__}: {e}"[:500])
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


# --------------------------------------------------------------------------- parent side


@contextlib.contextmanager
def _main_module_hidden():
    """Starts processes without re-importing the trainer's `__main__` in them.

    spawn/forkserver children normally re-import the parent's main module (as `__mp_main__`),
    which for the trainer means importing JAX in every worker (slow restarts, memory) and, for a
    script without a `__main__` guard, re-running it. Workers only need importable functions, so
    the main module is replaced by an empty one while `Process.start()` records it.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class _Worker:
    __slots__ = ("process", "conn", "tasks")

    def __init__(self, process, conn):
        self.process = process
        self.conn = conn
        self.tasks = 0


class RewardPool:
    """A pool of reward worker processes (see the module doc).

    Args:
      reward: default reward, a registered name ("math", "countdown") or "module:function" spec.
      num_workers: worker processes; 0 runs calls inline in this process (no isolation, no
        timeouts; for debugging). Default: min(4, CPU count).
      timeout_s: per-call limit, counted from when the call is handed to a (booted) worker.
      batch_timeout_s: optional limit for a whole `score` call.
      start_method: "forkserver" (default) or "spawn"; never "fork" (the parent runs JAX).
      preload: modules the forkserver imports once, so new workers start warm (default:
        `preload_modules(reward)`: math-verify's ~0.5 s import not for a countdown pool).
      max_tasks_per_worker: replace a worker after this many calls (bounds leaks); None = never.
    """

    def __init__(self, reward: str = "math", *, num_workers: int | None = None, timeout_s: float = 10.0,
                 batch_timeout_s: float | None = None, start_method: str = "forkserver",
                 preload: Sequence[str] | None = None, max_tasks_per_worker: int | None = None):
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (never 'fork'), got {start_method!r}")
        if timeout_s <= 0 or (batch_timeout_s is not None and batch_timeout_s <= 0):
            raise ValueError(f"timeouts must be positive, got timeout_s={timeout_s}, batch_timeout_s={batch_timeout_s}")
        self.reward_spec = resolve_spec(reward)
        self.num_workers = min(4, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = None if batch_timeout_s is None else float(batch_timeout_s)
        self.max_tasks_per_worker = max_tasks_per_worker
        self.totals = collections.Counter({k: 0 for k in STAT_KEYS})
        self._ctx = multiprocessing.get_context(start_method)
        if preload is None:
            preload = preload_modules(self.reward_spec)
        if start_method == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._workers: list[_Worker] = []
        self._closed = False
        self._next_task = 0
        self._errors_logged = 0
        self._finalizer = weakref.finalize(self, RewardPool._shutdown, self._workers)
        try:
            for _ in range(self.num_workers):  # start all, then wait for all: they boot in parallel
                self._workers.append(self._start_worker(wait=False))
            for w in self._workers:
                self._wait_ready(w)
            self._check_loadable(self.reward_spec)
        except BaseException:
            self.close()
            raise

    def _check_loadable(self, spec: str) -> None:
        """Loads `spec` in the first worker (in this process without workers); RewardSpecError when
        it cannot be imported within LOAD_TIMEOUT_S, so a misnamed reward stops the run at once."""
        if not self._workers:
            try:
                load_function(spec)
            except Exception as e:  # noqa: BLE001 - any failure to import is the same bad input
                raise RewardSpecError(f"{spec!r} cannot be loaded: {_load_failure(e)}") from None
            return
        w = self._workers[0]
        reply = None
        try:
            w.conn.send((LOAD, spec, None, None))
            if w.conn.poll(LOAD_TIMEOUT_S):
                reply = w.conn.recv()
        except (EOFError, OSError):
            pass
        if reply is None:  # close() (the caller's) kills the worker
            raise RewardSpecError(f"{spec!r} did not load within {LOAD_TIMEOUT_S:.0f} s in a reward worker")
        if reply[1] != "ok":
            raise RewardSpecError(f"{spec!r} cannot be loaded: {reply[2]}")

    # -- lifecycle

    def _start_worker(self, wait: bool = True) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_worker_main, args=(child_conn, os.getpid()), daemon=True,
                              name="stare-reward-worker")
        with _main_module_hidden(), preemption.blocked_hangup():  # the forkserver and workers inherit the block
            p.start()
        child_conn.close()
        w = _Worker(p, parent_conn)
        if wait:
            self._wait_ready(w)
        return w

    def _wait_ready(self, w: _Worker, timeout: float = 120.0) -> None:
        """Blocks until a new worker has booted, so its boot time never counts against a call."""
        ok = False
        try:
            if w.conn.poll(timeout):
                ok = w.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            pass
        if not ok:
            self._kill(w)
            raise RuntimeError(f"a reward worker failed to start within {timeout:.0f}s "
                               f"(exit code {w.process.exitcode})")

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            w.process.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        w.process.join(timeout=10)
        w.conn.close()

    def _replace(self, w: _Worker) -> _Worker:
        self._kill(w)
        new = self._start_worker()
        self._workers[self._workers.index(w)] = new
        return new

    @staticmethod
    def _shutdown(workers: list[_Worker]) -> None:
        for w in workers:
            try:
                w.conn.send(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=10)
            w.conn.close()
        workers.clear()

    def close(self) -> None:
        """Stops every worker (gracefully, then SIGKILL) and reaps it. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    # -- scoring

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], *, reward: str | None = None
              ) -> RewardResult:
        """Scores `responses[i]` against `ground_truths[i]` with the reward (default: the pool's).

        Returns float32 scores in input order and this call's counters; never raises for a failing
        verifier.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        spec = self.reward_spec if reward is None else resolve_spec(reward)
        self._errors_logged = 0
        t0 = time.monotonic()
        n = len(responses)
        scores = np.zeros((n,), np.float32)
        stats = collections.Counter({k: 0 for k in STAT_KEYS})
        stats["reward_calls"] = n
        items = [(str(r), str(g) if isinstance(g, str) else (g.decode() if isinstance(g, bytes) else g))
                 for r, g in zip(responses, ground_truths)]
        if self.num_workers == 0:
            fn = load_function(spec)
            for i, (r, g) in enumerate(items):
                try:
                    self._record(i, "ok", fn(r, g), scores, stats)
                except Exception as e:  # noqa: BLE001
                    self._record(i, "error", f"{type(e).__name__}: {e}", scores, stats)
        else:
            busy: dict = {}
            try:
                self._run(spec, items, scores, stats, t0, busy)
            except BaseException:
                # Interrupted mid-batch (e.g. KeyboardInterrupt): results still in flight would be
                # read by the next call, so replace the workers that hold them.
                for w, _, _ in list(busy.values()):
                    self._replace(w)
                raise
        self.totals.update(stats)
        out = {k: float(v) for k, v in stats.items()}
        out["reward_s"] = time.monotonic() - t0
        return RewardResult(scores, out)

    def _record(self, i: int, kind: str, value: Any, scores: np.ndarray, stats: collections.Counter) -> None:
        if kind == "ok":
            try:
                v = float(value)
            except (TypeError, ValueError):
                kind, value = "error", f"returned {type(value).__name__}, not a number"
            else:
                if math.isfinite(v):
                    scores[i] = v
                else:
                    stats["reward_nonfinite"] += 1
                return
        if kind == "timeout":
            stats["reward_timeouts"] += 1
        else:
            stats["reward_errors"] += 1
        if self._errors_logged < 3:  # per score() call; the counters have the totals
            self._errors_logged += 1
            log.warning("reward call %d scored 0 (%s): %s", i, kind, value)

    def _run(self, spec: str, items, scores, stats, t0: float, busy: dict) -> None:
        """Dispatch loop; `busy` maps task id -> (worker, item index, deadline)."""
        pending = collections.deque(range(len(items)))
        idle = list(self._workers)
        batch_deadline = None if self.batch_timeout_s is None else t0 + self.batch_timeout_s
        while pending or busy:
            # Dispatch to idle workers.
            while pending and idle:
                w = idle.pop()
                i = pending.popleft()
                task_id = self._next_task
                self._next_task += 1
                try:
                    w.conn.send((task_id, spec, items[i][0], items[i][1]))
                except (OSError, EOFError, BrokenPipeError):
                    # Died while idle: replace it and retry the item.
                    pending.appendleft(i)
                    idle.append(self._replace(w))
                    continue
                except Exception as e:  # noqa: BLE001 - e.g. an unpicklable ground truth
                    self._record(i, "error", f"cannot send: {type(e).__name__}: {e}", scores, stats)
                    idle.append(w)
                    continue
                w.tasks += 1
                busy[task_id] = (w, i, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            now = time.monotonic()
            wake = min(d for _, _, d in busy.values())
            if batch_deadline is not None:
                wake = min(wake, batch_deadline)
            by_conn = {w.conn: (tid, w, i) for tid, (w, i, _) in busy.items()}
            by_sentinel = {w.process.sentinel: (tid, w, i) for tid, (w, i, _) in busy.items()}
            ready = multiprocessing.connection.wait(list(by_conn) + list(by_sentinel), timeout=max(0.0, wake - now))
            done_workers = set()
            for obj in ready:
                if obj in by_conn:
                    tid, w, i = by_conn[obj]
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                else:
                    tid, w, i = by_sentinel[obj]
                    if id(w) in done_workers or tid not in busy:
                        continue
                    # Process exited: drain a result it may have sent just before exiting.
                    msg = None
                    try:
                        if w.conn.poll():
                            msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                if tid not in busy:
                    continue
                done_workers.add(id(w))
                del busy[tid]
                if msg is None or msg[0] != tid:
                    self._record(i, "error", "worker process died", scores, stats)
                    idle.append(self._replace(w))
                    continue
                self._record(i, msg[1], msg[2], scores, stats)
                if self.max_tasks_per_worker and w.tasks >= self.max_tasks_per_worker:
                    self._retire(w)
                    w = self._workers[-1]
                idle.append(w)
            # Timeouts.
            now = time.monotonic()
            over_batch = batch_deadline is not None and now >= batch_deadline
            for tid, (w, i, deadline) in list(busy.items()):
                if now >= deadline or over_batch:
                    del busy[tid]
                    self._record(i, "timeout", f"no result after {now - deadline + self.timeout_s:.1f}s", scores,
                                 stats)
                    idle.append(self._replace(w))
            if over_batch:
                while pending:
                    self._record(pending.popleft(), "timeout", "batch_timeout_s reached", scores, stats)

    def _retire(self, w: _Worker) -> None:
        """Graceful replacement after max_tasks_per_worker calls (the new worker goes last)."""
        try:
            w.conn.send(None)
            w.process.join(timeout=2)
        except Exception:  # noqa: BLE001
            pass
        self._kill(w)
        self._workers.remove(w)
        self._workers.append(self._start_worker())
