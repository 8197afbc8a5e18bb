"""One live writer per rank: the writer locks of a run directory (docs/reliability.md#one-run-per-directory).

The writer of rank R holds ``flock(LOCK_EX)`` on :meth:`RunLayout.lock_file(R) <triage_monitor.layout.RunLayout.lock_file>`
and writes ``pid host attempt`` into it.  The OS drops an flock when its holder dies, so a killed job leaves no
stale lock.

A file system without flock (an NFS mount without its lock daemon answers ENOLCK; some FUSE file systems
ENOSYS / EOPNOTSUPP): the writer warns once and holds an exclusive lock file instead,
:meth:`RunLayout.exclusive_lock_file(R) <triage_monitor.layout.RunLayout.exclusive_lock_file>`, created with
``O_EXCL`` (atomic on local file systems and on NFS v3 and later) and holding the same ``pid P on HOST, ...`` line;
it is removed at close.  A second writer of the rank is refused while the file exists and names a live process.
A writer killed without its close leaves the file behind: a writer starting on the *same host* sees that pid P
is not running (``kill(P, 0)``) and takes the file over with a warning; a file naming another host, or a text it
cannot read, is never taken over (the error says which file to remove once that job is gone).  A reused pid
makes a dead holder look alive: refused, never a second writer.  The removal of a stale file is guarded by a
second ``O_EXCL`` file (:meth:`~triage_monitor.layout.RunLayout.lock_takeover_file`), so that of two writers
starting at once one takes over and the other is refused.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Optional

from .errors import RunLockedError, UnwritableOutputError
from .layout import RunLayout

#: the writer's messages (locks, files, manifest) share one logger name
log = logging.getLogger("triage_monitor.records")

#: writer locks this process holds: {resolved lock path: fd}
_HELD: dict = {}
#: the exclusive lock files (no flock) among them: {fd: (path, the line written)}
_EXCLUSIVE: dict = {}
#: the holder line's pid and host
_HOLDER_RE = re.compile(r"^pid (\d+) on ([^\s,]+),")


class _NoFlock(Exception):
    """flock is not available for this file (the platform or the file system); ``args[0]``: the OS reason."""


def _holder_line(attempt: int) -> str:
    return (f"pid {os.getpid()} on {socket.gethostname()}, attempt {int(attempt)}, since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")


def _read_holder(path: Path) -> Optional[str]:
    """The stripped first 512 bytes of ``path`` (U+FFFD for bytes that are not UTF-8); None when it is gone."""
    try:
        with open(path, "rb") as f:
            return f.read(512).decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def _is_stale(holder: Optional[str], path: Path) -> bool:
    """True when ``holder`` (the line of lock file ``path``) names a process of this host that is not running, or
    this process while it does not hold ``path``.  A line that names another host, or none, is never stale (it
    cannot be checked from here)."""
    m = _HOLDER_RE.match(holder or "")
    if not m or m.group(2) != socket.gethostname():
        return False
    pid = int(m.group(1))
    if pid == os.getpid():         # this process, yet not among the locks it holds: left by an earlier start
        return not any(p == path for p, _ in _EXCLUSIVE.values())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:                # EPERM: the process exists (another user's)
        return False
    return False


def _refuse(path: Path, rank, holder: str, exclusive: bool) -> RunLockedError:
    how = (f"no flock on this file system: {path} stands in for the lock; a writer killed on another host leaves "
           f"it behind: remove it once that job is gone" if exclusive else "a killed writer's lock is released by "
           "the OS")
    return RunLockedError(f"{path.parent}: another process is writing this run's rank {rank} "
                          f"({holder or 'unknown process'}); one writer per rank: stop it, or write to another "
                          f"directory ({how})", path.parent)


def _flock(path: Path) -> int:
    """An fd holding ``flock(LOCK_EX)`` on ``path``.

    Raises:
        RunLockedError: another open file holds it (its pid / host / attempt in the message).
        UnwritableOutputError: the lock file cannot be opened or created (a directory in its place, ...).
        _NoFlock: the platform or the file system has no flock."""
    try:
        import fcntl
    except ImportError:          # not POSIX
        raise _NoFlock("no fcntl module") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)   # read-only: a later remount read-only is not blocked
    except OSError as exc:
        raise UnwritableOutputError(f"{path}: cannot open the writer lock file: {exc.strerror or exc}",
                                    path.parent) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise _refuse(path, RunLayout.lock_rank(path), holder, exclusive=False) from None
    except OSError as exc:       # a file system without flock (some network mounts)
        os.close(fd)
        raise _NoFlock(exc.strerror or str(exc)) from None
    return fd


def _exclusive_path(lock: Path) -> Path:
    return RunLayout(lock.parent).exclusive_lock_file(RunLayout.lock_rank(lock))


def _check_exclusive(lock: Path) -> None:
    """Raise :class:`RunLockedError` when the rank's exclusive lock file exists and is not stale."""
    excl = _exclusive_path(lock)
    holder = _read_holder(excl)
    if holder is not None and not _is_stale(holder, excl):
        raise _refuse(excl, RunLayout.lock_rank(lock), holder, exclusive=True)


def probe_lock(path: Path) -> None:
    """Raise :class:`RunLockedError` when a live process holds the writer lock ``path`` (a file of
    :meth:`RunLayout.lock_files`), by flock or by its exclusive lock file; the probe itself keeps no lock.

    Raises:
        RunLockedError: another open file holds it, or its exclusive lock file names a live process (or
            another host).
        UnwritableOutputError: the lock file cannot be opened."""
    path = Path(path)
    try:
        os.close(_flock(path))
    except _NoFlock:
        pass
    _check_exclusive(path)


def _take_over_stale(layout: RunLayout, rank: int, excl: Path, seen: str) -> None:
    """Remove the stale exclusive lock file ``excl`` (its line ``seen``) under the take-over file, unless another
    writer has replaced it meanwhile.

    Raises:
        RunLockedError: another writer is taking it over right now."""
    guard = layout.lock_takeover_file(rank)
    for _ in range(2):
        try:
            gfd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            other = _read_holder(guard)
            if other is not None and not _is_stale(other, guard):
                raise _refuse(excl, rank, f"{other}, taking over a stale lock", exclusive=True) from None
            guard.unlink(missing_ok=True)          # left by a writer killed while taking over
    else:
        raise _refuse(excl, rank, "another writer taking over a stale lock", exclusive=True)
    try:
        os.write(gfd, _holder_line(0).encode())
        if _read_holder(excl) == seen:             # still the stale one: only the guard's holder removes it
            excl.unlink()
            log.warning("triage-monitor: %s named a process of this host that is not running (%s): a killed "
                        "writer's lock, taken over", excl, seen)
    finally:
        os.close(gfd)
        guard.unlink(missing_ok=True)


def _acquire_exclusive(run_dir, rank: int, attempt: int) -> int:
    """Create the rank's exclusive lock file (``O_EXCL``) with this process's line; returns its fd.

    Raises:
        RunLockedError: it exists and names a live process, another host or no process.
        UnwritableOutputError: it cannot be created or written."""
    layout = RunLayout(run_dir)
    excl = layout.exclusive_lock_file(rank)
    line = _holder_line(attempt)
    for _ in range(3):
        try:
            fd = os.open(excl, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(excl)
            if holder is None:                     # removed meanwhile: try again
                continue
            if not _is_stale(holder, excl):
                raise _refuse(excl, rank, holder, exclusive=True) from None
            _take_over_stale(layout, rank, excl, holder)
            continue
        except OSError as exc:
            raise UnwritableOutputError(f"{excl}: cannot create the writer lock file: {exc.strerror or exc}",
                                        excl.parent) from exc
        try:
            os.write(fd, line.encode())
        except OSError as exc:
            os.close(fd)
            excl.unlink(missing_ok=True)
            raise UnwritableOutputError(f"{excl}: cannot write the writer lock file: {exc.strerror or exc}",
                                        excl.parent) from exc
        _EXCLUSIVE[fd] = (excl, line)
        return fd
    raise _refuse(excl, rank, "another writer starting at the same time", exclusive=True)


def acquire_writer_lock(run_dir, rank: int, attempt: int) -> Optional[int]:
    """Hold ``run_dir/.writer-rank-<rank>.lock`` (:meth:`RunLayout.lock_file`; ``flock``, released by the OS when
    the process dies) and write ``pid host attempt`` into it.  Where the file system has no flock, warn once and
    hold the exclusive lock file instead (:meth:`RunLayout.exclusive_lock_file`; see the module docstring).
    Returns the fd to pass to :func:`release_writer_lock`.

    A lock this process already holds (a monitor of the same rank and run that was never closed, e.g. a
    notebook cell run twice) is taken over with a warning: the lock guards against other processes.

    Raises:
        RunLockedError: another live process holds it (by flock, or by an exclusive lock file naming a live
            process, another host or no process).
        UnwritableOutputError: the lock file cannot be opened, or its line cannot be written (a full disk: the
            start check's empty probe file needs no free block); the lock is released first.
    """
    path = RunLayout(run_dir).lock_file(rank)
    key = str(path.resolve())
    if key in _HELD:
        log.warning("triage-monitor: an earlier writer of rank %d of %s in this process was not closed; the new "
                    "one takes over (close monitors, or use them in a with-block)", int(rank), run_dir)
        release_writer_lock(_HELD[key])
    try:
        fd = _flock(path)
    except _NoFlock as exc:
        excl = RunLayout(run_dir).exclusive_lock_file(rank)
        log.warning("triage-monitor: cannot lock %s (%s): no flock on this file system; the exclusive lock file %s "
                    "stands in for it (created with O_EXCL, removed at close)", path, exc.args[0], excl)
        fd = _acquire_exclusive(run_dir, rank, attempt)
        _HELD[key] = fd
        return fd
    try:
        _check_exclusive(path)         # a writer on a client of this file system without flock
    except RunLockedError:
        os.close(fd)
        raise
    _HELD[key] = fd
    try:
        path.write_text(_holder_line(attempt))
    except OSError as exc:
        release_writer_lock(fd)
        raise UnwritableOutputError(f"{path}: cannot write the writer lock file: {exc.strerror or exc}",
                                    path.parent) from exc
    return fd


def release_writer_lock(fd: Optional[int]) -> None:
    """Release a lock of :func:`acquire_writer_lock` (closing the fd drops the flock; an exclusive lock file is
    removed if it still holds this process's line); None does nothing."""
    if fd is None:
        return
    for k in [k for k, v in _HELD.items() if v == fd]:
        del _HELD[k]
    excl = _EXCLUSIVE.pop(fd, None)
    if excl is not None:
        path, line = excl
        try:
            if _read_holder(path) == line.strip():
                path.unlink()
        except OSError:           # a read-only remount: the file stays, and a later start finds it stale
            pass
    try:
        os.close(fd)
    except OSError:
        pass
