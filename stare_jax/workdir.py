"""The run directory: one training at a time (a lock), and leftovers of killed runs removed.

`WORKDIR/.lock` is held with `fcntl.flock` by process 0 of a training for its whole life; the
kernel releases it when the process dies, however it dies, so a stale lock never blocks a
re-run. Evaluation and export only read and take no lock.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
CHECKPOINT_ITEMS = ("state", "data", "meta")  # the items of a checkpoint step (`checkpoint.Checkpointer`)
COMMIT_MARKER = "commit_success.txt"          # Orbax's marker of a committed step and item


def step_is_committed(checkpoints_dir: str, step: int) -> bool:
    """Whether `<checkpoints_dir>/<step>/` and each of its items carry Orbax's commit marker (read
    without JAX, so that a supervising process stays light)."""
    root = os.path.join(checkpoints_dir, str(step))
    return os.path.isfile(os.path.join(root, COMMIT_MARKER)) and all(
        os.path.isfile(os.path.join(root, item, COMMIT_MARKER)) for item in CHECKPOINT_ITEMS)


#: the errors of a full or failing disk: no space, a quota, a read-only file system, I/O, a file size limit
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


def storage_reason(e: BaseException) -> str | None:
    """The system's reason when `e` or an exception in its cause/context chain is a failed write to
    storage (an OSError with one of `STORAGE_ERRNOS`, or a library's error quoting its strerror, as
    TensorStore's and array_record's do), e.g. "No space left on device (errno 28)"; else None."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return f"{os.strerror(seen.errno)} (errno {seen.errno})"
        for code in STORAGE_ERRNOS:
            if os.strerror(code) in str(seen):
                return f"{os.strerror(code)} (errno {code})"
        seen = seen.__cause__ or seen.__context__
    return None


class WorkdirError(ValueError):
    """The workdir cannot be used: it is a file, or another training holds it."""


def check_workdir(workdir: str, *, create: bool = False, flag: str = "--workdir") -> str:
    """The absolute `workdir`, or WorkdirError (naming `flag`) when it is empty, exists and is not a
    directory, or, with `create`, could not be made or written in: a temporary directory is made
    and removed in it, or in its nearest existing ancestor when it is absent (nothing is left)."""
    if not workdir.strip():
        raise WorkdirError(f"{flag}: empty; allowed: a directory path (created if absent)")
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"{flag}: {workdir} exists and is not a directory; allowed: a directory path "
                           f"(created if absent)")
    reason = unwritable_reason(path) if create else None
    if reason:
        raise WorkdirError(f"{flag}: {workdir}: cannot be created or written in ({reason}); allowed: "
                           f"a directory path this process can write (created if absent)")
    return path


def unwritable_reason(path: str) -> str | None:
    """Why the directory `path` could not be made or written in (the system's message), or None:
    a temporary directory is made and removed in it, or in its nearest existing ancestor when it is
    absent, so nothing is left behind."""
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=ancestor))
    except OSError as e:
        return e.strerror or str(e)
    return None


def unwritable_file_reason(path: str) -> str | None:
    """Why a file could not be written at `path`, or None: the path is empty or a directory, or its
    directory could not be made or written in (`unwritable_reason`). For scripts that write their
    results at the end, so that a bad path is refused before the work."""
    if not path.strip():
        return "empty"
    if os.path.isdir(path):
        return "is a directory"
    return unwritable_reason(os.path.dirname(os.path.abspath(path)))


class WorkdirLock:
    """An exclusive, non-blocking `flock` on WORKDIR/.lock (the holder's pid written inside)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock or raises WorkdirError naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirError(f"--workdir: {os.path.dirname(self.path)} is in use by another training (pid "
                               f"{holder}, lock {self.path}); wait for it to end or use another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Releases the lock (the file stays; its presence means nothing without the flock)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed, unreaped process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_tmp_dirs(path: str) -> list[str]:
    """Removes `<path>.tmp-<pid>` directories whose process is gone (left by a kill while the
    directory was being written); returns the removed paths."""
    removed = []
    for tmp in glob.glob(glob.escape(path) + ".tmp-*"):
        suffix = tmp.rsplit(".tmp-", 1)[1]
        if suffix.isdigit() and not _pid_alive(int(suffix)):
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s, left by a killed process", tmp)
            removed.append(tmp)
    return removed
