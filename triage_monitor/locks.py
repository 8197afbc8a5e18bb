"""One live writer per rank: the ``flock`` writer locks of a run directory (docs/reliability.md).

The writer of rank R holds ``flock(LOCK_EX)`` on :meth:`RunLayout.lock_file(R) <triage_monitor.layout.RunLayout.lock_file>`
and writes ``pid host attempt`` into it.  The OS drops an flock when its holder dies, so a killed job leaves no
stale lock.  A file system without flock: a warning, and the writer goes on without the lock.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from .errors import RunLockedError, UnwritableOutputError
from .layout import RunLayout

#: the writer's messages (locks, files, manifest) share one logger name
log = logging.getLogger("triage_monitor.records")

#: writer locks this process holds: {resolved lock path: fd}
_HELD: dict = {}


def probe_lock(path: Path) -> None:
    """Raise :class:`RunLockedError` when a live process holds the writer lock ``path`` (a file of
    :meth:`RunLayout.lock_files`); the probe itself keeps no lock.

    Raises:
        RunLockedError: another open file holds it.
        UnwritableOutputError: the lock file cannot be opened."""
    fd = _try_lock(Path(path))
    if fd is not None:
        os.close(fd)


def _try_lock(path: Path) -> Optional[int]:
    """An fd holding ``flock(LOCK_EX)`` on ``path`` (None where the platform or file system has no flock).

    Raises:
        RunLockedError: another open file holds it (its pid / host / attempt in the message).
        UnwritableOutputError: the lock file cannot be opened or created (a directory in its place, ...).
    """
    try:
        import fcntl
    except ImportError:          # not POSIX: no lock
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)   # read-only: a later remount read-only is not blocked
    except OSError as exc:
        raise UnwritableOutputError(f"{path}: cannot open the writer lock file: {exc.strerror or exc}",
                                    path.parent) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
        finally:
            os.close(fd)
        raise RunLockedError(f"{path.parent}: another process is writing this run's rank {RunLayout.lock_rank(path)} "
                             f"({holder}); one writer per rank: stop it, or write to another directory "
                             f"(a killed writer's lock is released by the OS)", path.parent) from None
    except OSError as exc:       # a file system without flock (some network mounts): go on without the lock
        os.close(fd)
        log.warning("triage-monitor: cannot lock %s (%s); a second writer of this rank would not be detected",
                    path, exc.strerror or exc)
        return None
    return fd


def acquire_writer_lock(run_dir, rank: int, attempt: int) -> Optional[int]:
    """Hold ``run_dir/.writer-rank-<rank>.lock`` (:meth:`RunLayout.lock_file`; ``flock``, released by the OS when
    the process dies) and write ``pid host attempt`` into it.  Returns the fd to pass to
    :func:`release_writer_lock` (None: no flock here).

    A lock this process already holds (a monitor of the same rank and run that was never closed, e.g. a
    notebook cell run twice) is taken over with a warning: the lock guards against other processes.

    Raises:
        RunLockedError: another live process holds it.
        UnwritableOutputError: the lock file cannot be opened, or its line cannot be written (a full disk: the
            start check's empty probe file needs no free block); the lock is released first.
    """
    import socket

    path = RunLayout(run_dir).lock_file(rank)
    key = str(path.resolve())
    if key in _HELD:
        log.warning("triage-monitor: an earlier writer of rank %d of %s in this process was not closed; the new "
                    "one takes over (close monitors, or use them in a with-block)", int(rank), run_dir)
        release_writer_lock(_HELD[key])
    fd = _try_lock(path)
    if fd is not None:
        _HELD[key] = fd
        try:
            path.write_text(f"pid {os.getpid()} on {socket.gethostname()}, attempt {int(attempt)}, since "
                            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        except OSError as exc:
            release_writer_lock(fd)
            raise UnwritableOutputError(f"{path}: cannot write the writer lock file: {exc.strerror or exc}",
                                        path.parent) from exc
    return fd


def release_writer_lock(fd: Optional[int]) -> None:
    """Release a lock of :func:`acquire_writer_lock` (closing the fd drops the flock); None does nothing."""
    if fd is not None:
        for k in [k for k, v in _HELD.items() if v == fd]:
            del _HELD[k]
        try:
            os.close(fd)
        except OSError:
            pass
