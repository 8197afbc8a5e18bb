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
second ``O_EXCL`` file (:meth:`~triage_monitor.rundir.layout.RunLayout.lock_takeover_file`), so that of two writers
starting at once one takes over and the other is refused.

An object store (``s3://``) has neither ``flock`` nor an exclusive create: the writer of rank R holds a **lease**,
the object :meth:`RunLayout.lock_name(R) <triage_monitor.layout.RunLayout.lock_name>` holding the same line and the
time it was last renewed, which a thread of the writer renews every :data:`LEASE_RENEW_S` seconds and removes at
close.  A writer starting while another attempt's lease was renewed less than :data:`LEASE_STALE_S` seconds ago is
refused, unless it names a process of this host that is not running; an older lease, or a dead local one (a
killed writer's), is taken over with a warning.  Two writers of one rank starting within
the same instant are not told apart (no conditional write): both write, and neither can damage the other's records,
since every file name holds its attempt id and readers keep each step's latest attempt.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import RunLockedError, UnwritableOutputError
from .layout import RunLayout
from .storage import Store, open_store

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
    """The exclusive lock file of the writer lock ``lock`` (a :meth:`RunLayout.lock_file`, so its rank is known)."""
    rank = RunLayout.lock_rank(lock)
    assert rank is not None, f"{lock} is not a writer lock file"    # callers pass lock_file / lock_files names
    return RunLayout(lock.parent).exclusive_lock_file(rank)


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


def acquire_writer_lock(run_dir, rank: int, attempt: int):
    """The writer lock of ``rank`` of the run at ``run_dir`` (a location or its
    :class:`~triage_monitor.rundir.storage.Store`): :func:`acquire_local_lock` on a local file system, a :class:`Lease` on
    an object store.  Pass the result to :func:`release_writer_lock`.

    Raises:
        RunLockedError, UnwritableOutputError: as :func:`acquire_local_lock` and :func:`Lease.acquire`."""
    store = run_dir if isinstance(run_dir, Store) else open_store(run_dir)
    if store.is_local:
        return acquire_local_lock(store.local(), rank, attempt)
    return Lease.acquire(store, rank, attempt)


def acquire_local_lock(run_dir, rank: int, attempt: int) -> Optional[int]:
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


def release_writer_lock(fd) -> None:
    """Release a lock of :func:`acquire_writer_lock` (closing the fd drops the flock; an exclusive lock file is
    removed if it still holds this process's line; a :class:`Lease` is released); None does nothing."""
    if fd is None:
        return
    if isinstance(fd, Lease):
        fd.release()
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


#: Seconds between two renewals of a writer's lease on an object store.
LEASE_RENEW_S = 30.0
#: A lease renewed longer ago than this is a killed writer's, taken over by a new writer of the rank.
LEASE_STALE_S = 120.0
_RENEWED_RE = re.compile(r"renewed (\d+(?:\.\d+)?)")


#: the leases this process holds: {(location, rank)}
_LEASES: set = set()


def _lease_dead(holder: str, store: Store, rank: int) -> bool:
    """True when the lease line ``holder`` names a process of this host that is not running (this process: one
    that holds no lease of the rank any more)."""
    m = _HOLDER_RE.match(holder or "")
    if not m or m.group(2) != socket.gethostname():
        return False
    if int(m.group(1)) == os.getpid():
        return (store.location, int(rank)) not in _LEASES
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class Lease:
    """The writer lock of one rank on an object store (module docstring): the lease object and the thread that
    renews it."""

    def __init__(self, store: Store, rank: int, attempt: int):
        self.store, self.rank, self.attempt = store, int(rank), int(attempt)
        self.name = RunLayout.lock_name(rank)
        self._head = _holder_line(attempt).strip()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.renewals = 0
        #: the lease line of the writer that took this rank over (None while the lease is this writer's): set by
        #: :meth:`renew`, after which this writer writes no record (its writer counts them dropped)
        self.taken_over_by: Optional[str] = None

    def _line(self) -> str:
        return f"{self._head}, renewed {time.time():.3f}\n"

    def write(self) -> None:
        """Write (renew) the lease object.

        Raises:
            OSError: it cannot be written."""
        self.store.write_bytes(self.name, self._line().encode())
        self.renewals += 1

    @classmethod
    def acquire(cls, store: Store, rank: int, attempt: int) -> "Lease":
        """Take the lease of ``rank`` and start renewing it.

        Raises:
            RunLockedError: another attempt's lease was renewed less than :data:`LEASE_STALE_S` seconds ago
                (the message quotes its line and its age).
            UnwritableOutputError: the lease object cannot be written."""
        lease = cls(store, rank, attempt)
        try:
            held = store.read_bytes(lease.name).decode(errors="replace").strip()
        except FileNotFoundError:
            held = None
        except OSError as exc:
            raise UnwritableOutputError(f"{store.display(lease.name)}: cannot read the writer lease: {exc}",
                                        store.display()) from exc
        if held:
            m, mine = _RENEWED_RE.search(held), f"attempt {int(attempt)}," in held
            age = time.time() - float(m.group(1)) if m else None
            dead = _lease_dead(held, store, rank)        # a process of this host that is not running
            if not mine and not dead and (age is None or age < LEASE_STALE_S):
                how = f"renewed {age:.0f} s ago" if age is not None else "with no renewal time"
                raise RunLockedError(f"{store.display()}: another process is writing this run's rank {int(rank)} "
                                     f"({held}; {how}); one writer per rank: stop it, or write to another location "
                                     f"(a lease not renewed for {LEASE_STALE_S:.0f} s is a stopped writer's and is "
                                     f"taken over)", store.display())
            if not mine:
                why = "names a process of this host that is not running" if dead else f"was not renewed for {age:.0f} s"
                log.warning("triage-monitor: %s %s (%s): a stopped writer's lease, taken over",
                            store.display(lease.name), why, held)
        try:
            lease.write()
        except OSError as exc:
            raise UnwritableOutputError(f"{store.display(lease.name)}: cannot write the writer lease: {exc}",
                                        store.display()) from exc
        _LEASES.add((store.location, lease.rank))
        lease._thread = threading.Thread(target=lease._renew, name="triage-monitor-lease", daemon=True)
        lease._thread.start()
        return lease

    def renew(self) -> bool:
        """Renew the lease unless another writer has taken it over (its object names another attempt, or is gone:
        this writer was stopped or cut off for :data:`LEASE_STALE_S` seconds): then :attr:`taken_over_by` is set, one ERROR
        line says so, and the lease is never renewed again.  Returns whether the lease is still this writer's.

        Raises:
            OSError: the lease object cannot be read or written."""
        if self.taken_over_by is not None:
            return False
        try:
            held = self.store.read_bytes(self.name).decode(errors="replace").strip()
        except FileNotFoundError:    # only a writer releasing its own lease deletes one: another took over, and closed
            held = "its lease object was removed by the writer that took it over and has closed since"
        if not held.startswith(self._head):
            self.taken_over_by = held
            self._stop.set()
            log.error("triage-monitor: another writer took over rank %d of %s (%s): this writer (attempt %d) writes "
                      "no more records (counted as dropped) and leaves run.json to it", self.rank,
                      self.store.display(), held, self.attempt)
            return False
        self.write()
        return True

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 — advisory: writing records goes on
                if not warned:
                    warned = True
                    log.warning("triage-monitor: cannot renew the writer lease %s (%s); a second writer of this "
                                "rank may start after %.0f s", self.store.display(self.name), exc, LEASE_STALE_S)

    def release(self) -> None:
        """Stop renewing and remove the lease object if it is still this writer's."""
        self._stop.set()
        _LEASES.discard((self.store.location, self.rank))
        try:
            held = self.store.read_bytes(self.name).decode(errors="replace")
            if held.startswith(self._head):
                self.store.delete(self.name)
        except OSError:
            pass
