"""The background writer of a run directory's tables (:class:`ParquetSink`).

One typed item per step and table at the queue's door (:class:`Write`), one queue bounded in bytes, one writer
thread, which hands each step to the :class:`~triage_monitor.rundir.blocks.BlockWriter` of its (table, rank): a pending
file per step, sealed into one Parquet block per ``roll_steps`` steps (docs/reliability.md#what-a-killed-job-keeps).
Once started, the writer never raises into the training loop: it counts, warns once and degrades; an error of the
writer thread is kept in :attr:`ParquetSink.last_error` and shows in the next step's ``writer_dropped_rows``.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from .blocks import ROLL_BYTES, ROLL_STEPS, BlockWriter, remove_stale_temps, seal_pending
from ..errors import ForkedWriterError
from .layout import LATE_TABLES, TABLES, RunLayout
from .storage import Store, open_store

#: the writer's messages (locks, files, manifest) share one logger name
log = logging.getLogger("triage_monitor.records")

#: What a block's error leaves (warned once): its steps are on disk all the same.
PENDING_KEPT = ("its steps stay in pending files, which readers read and a later seal (at close, or by the next "
                "writer of the rank) completes")
#: The local spool directories of object-store writers: ``$TMPDIR/<prefix><pid>-<random>``.
SPOOL_PREFIX = "triage-monitor-spool-"


def _remove_dead_spools() -> None:
    """Remove the spool directories of writer processes of this machine that are not running any more (a killed
    writer's; its blocks' steps are in their pending objects on the store)."""
    import re

    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.match(rf"^{SPOOL_PREFIX}(\d+)-", name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue                       # alive (or not ours to signal): kept
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            continue


#: Bytes a row given as a dict counts against the queue bound.
ROW_BYTES = 256
#: The default bound, seconds, of every wait of the training thread on the writer: ``close()`` and ``flush()``
#: (what is still queued at the bound is counted as dropped at close), and a submit of ``backpressure="block"``
#: waiting for room in a full queue (the step is dropped and counted after it).  A frozen store or a hung mount
#: never holds the job longer than this (docs/reliability.md#a-frozen-or-slow-store).
WAIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DeferredColumns:
    """A step's columns, built on the writer thread: ``build()`` returns ``{name: 1-D values}`` (numpy arrays
    or lists, all of ``nrows`` values) or a ``pyarrow.Table`` (taken as it is); ``nbytes`` / ``nrows`` size it for
    the queue bound before it exists.

    The one type of a :class:`Write`'s columns: :meth:`ParquetSink.submit` wraps columns given as a dict of
    arrays or as a list of row dicts into one (:meth:`of`)."""

    build: Callable[[], dict]
    nbytes: int
    nrows: int

    @classmethod
    def of(cls, columns, schema: Optional[pa.Schema] = None) -> "DeferredColumns":
        """``columns`` as :class:`DeferredColumns`: itself; a dict of 1-D arrays (``nbytes``: the arrays'
        bytes, 8 per value for a list); a list of row dicts (:data:`ROW_BYTES` per row; the columns of
        ``schema``, or of the first row's keys without one, a row lacking a key giving null).

        Raises:
            TypeError: another type."""
        if isinstance(columns, cls):
            return columns
        if isinstance(columns, dict):
            nbytes = sum(getattr(v, "nbytes", 8 * len(v)) for v in columns.values())
            nrows = len(next(iter(columns.values()))) if columns else 0
            return cls(lambda: columns, max(nbytes, 1), nrows)
        if isinstance(columns, list):
            rows = columns
            names = schema.names if schema is not None else list(rows[0]) if rows else []
            return cls(lambda: {k: [r.get(k) for r in rows] for k in names}, ROW_BYTES * max(len(rows), 1),
                       len(rows))
        raise TypeError(f"columns must be DeferredColumns, a dict of arrays or a list of rows, got "
                        f"{type(columns).__name__}")


@dataclass(frozen=True)
class Write:
    """Queue item: the rows of (``table``, ``step``, ``rank``) — possibly none: the step happened — from
    ``columns``, cast to ``schema`` (None: the columns' own types)."""

    table: str
    step: int
    rank: int
    columns: DeferredColumns
    schema: Optional[pa.Schema] = None

    @property
    def nbytes(self) -> int:
        """What the item counts against the queue bound (at least 1)."""
        return max(self.columns.nbytes, 1)

    @property
    def nrows(self) -> int:
        """Rows the step holds (counted written or dropped)."""
        return self.columns.nrows


@dataclass(frozen=True)
class Recover:
    """Queue item: seal the pending files that earlier attempts of ``rank`` left (a killed job's open blocks,
    :func:`~triage_monitor.rundir.blocks.seal_pending`)."""

    rank: int

    nrows = 0           # waited for by flush(); never held up by, nor counted against, the queue bound


@dataclass(frozen=True)
class Task:
    """Queue item: run ``fn()`` on the writer thread (a write the training thread must not wait for, e.g. run.json
    when τ_tail freezes); ``what`` names it in the one warning its failure gives."""

    fn: Callable[[], None]
    what: str

    nrows = 0           # as Recover: waited for by flush(), never bounded


class _Stop:
    """Queue item: seal every open block, then the writer thread ends (queued by :meth:`ParquetSink.close`)."""


class ParquetSink:
    """Background writer of a run's tables.

    ``submit(table, step, rank, columns)`` queues one step of one table (a :class:`Write`: :class:`DeferredColumns`
    built on the writer thread, or a dict of 1-D numpy arrays or a list of row dicts, wrapped into one) and
    returns at once.  The queue is bounded to ``max_queue_bytes``; when full, ``backpressure="block"`` waits for
    the writer and ``"drop"`` drops the step and counts its rows.  A table's steps of one rank go into blocks of
    ``roll_steps`` steps (:class:`~triage_monitor.rundir.blocks.BlockWriter`).

    I/O errors (read-only or full disk, ...) never propagate: the rows are counted in :attr:`dropped_rows`,
    the first error is logged once and kept in :attr:`last_error`.  ``close()`` drains the queue and seals the
    open blocks (``flush()`` waits for the queue without sealing).

    Args:
        run_dir: the run's location or :class:`~triage_monitor.rundir.storage.Store`.
        attempt: the attempt id in the names of the files written.
        heartbeat: called on the writer thread at most every ``heartbeat_s`` seconds while it writes (the lease
            of a writer on an object store, :mod:`triage_monitor.rundir.locks`); its errors are logged once.

    Raises:
        ValueError: ``backpressure`` is neither "block" nor "drop" (at construction).
    """

    def __init__(self, run_dir, attempt: int, max_queue_bytes: int = 256 << 20, backpressure: str = "block",
                 roll_steps: int = ROLL_STEPS, roll_bytes: int = ROLL_BYTES,
                 heartbeat: Optional[Callable[[], None]] = None, heartbeat_s: float = 30.0,
                 block_timeout: Optional[float] = WAIT_TIMEOUT_S):
        if backpressure not in ("block", "drop"):
            raise ValueError(f"backpressure must be 'block' or 'drop', got {backpressure!r}")
        self.store: Store = run_dir if isinstance(run_dir, Store) else open_store(run_dir)
        self.layout = RunLayout(self.store)
        self.attempt = int(attempt)
        self.max_queue_bytes = int(max_queue_bytes)
        self.backpressure = backpressure
        self.roll_steps, self.roll_bytes = int(roll_steps), int(roll_bytes)
        #: rows written (their step's pending file is on disk)
        self.written_rows = 0
        #: (table, step) records with rows written
        self.written_steps = 0
        self.dropped_rows = 0
        #: steps whose submit had to wait for room (``backpressure="block"``: the training loop was held)
        self.blocked_submits = 0
        #: steps dropped because ``backpressure="block"`` found no room within ``block_timeout`` seconds (counted
        #: in ``dropped_rows`` too)
        self.timed_out_submits = 0
        #: rows still queued (or being written) when :meth:`close` reached its bound: counted in ``dropped_rows``
        self.abandoned_rows = 0
        #: whether :meth:`close` gave up on the writer at its bound
        self.abandoned = False
        self.block_timeout = None if block_timeout is None else float(block_timeout)
        self._stalled = False               # a blocked submit timed out and the writer has finished nothing since
        self._inflight = None               # the item the writer thread is on
        self._pid = os.getpid()
        #: ``fn() -> bool``: whether another writer has taken this rank over (an object store's lease,
        #: :class:`~triage_monitor.rundir.locks.Lease`); from then on no step is written (each counted as dropped) and no
        #: block sealed.  None: never.
        self.taken_over: Optional[Callable[[], bool]] = None
        self.last_error: Optional[str] = None
        self._warned: set = set()
        self._heartbeat, self._heartbeat_s, self._beat_at = heartbeat, float(heartbeat_s), time.monotonic()
        self._writers: dict = {}
        self._spool: Optional[str] = None
        self._queued_bytes = 0              # the steps' bytes in the queue: what the bound limits
        self._queued_other = 0              # other items in the queue (Recover): waited for by flush, never bounded
        self._cv = threading.Condition()
        self._q: "queue.Queue" = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="triage-monitor-writer", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- producer
    def submit(self, table: str, step: int, rank: int, columns, schema: Optional[pa.Schema] = None) -> bool:
        """Queue one step of ``table`` (see the class); returns False if it was dropped (closed sink or full queue
        with ``drop``).

        Raises:
            TypeError: ``columns`` is of another type (:meth:`DeferredColumns.of`)."""
        return self._put(Write(table, int(step), int(rank), DeferredColumns.of(columns, schema), schema))

    def submit_recover(self, rank: int) -> None:
        """Queue the sealing of the pending files that earlier attempts of ``rank`` left (:class:`Recover`)."""
        self._put(Recover(int(rank)))

    def submit_task(self, fn: Callable[[], None], what: str) -> bool:
        """Run ``fn()`` on the writer thread, after what is queued (:class:`Task`); False when the sink is closed.
        Its exception is logged once and kept in :attr:`last_error`."""
        return self._put(Task(fn, what))

    def check_process(self) -> None:
        """Raise :class:`~triage_monitor.errors.ForkedWriterError` in a process forked after this sink was built
        (its writer thread is not there: nothing would be written, a flush would wait forever)."""
        if os.getpid() != self._pid:
            raise ForkedWriterError(f"triage-monitor: this monitor was built in process {self._pid} and is used in "
                                    f"process {os.getpid()}, forked from it after it was built: its writer thread "
                                    "does not exist here and nothing would be written; build a new monitor in the "
                                    "child (another rank, or another run directory), or fork before building it")

    def _put(self, item) -> bool:
        """Queue ``item`` under the byte bound (a :class:`Recover` or :class:`Task` neither counts nor waits for
        room); False when dropped."""
        self.check_process()
        with self._cv:
            if self._closed:
                self.dropped_rows += item.nrows
                return False
            if not isinstance(item, Write):
                self._queued_other += 1
                self._q.put(item)
                return True
            nbytes, waited = item.nbytes, False
            deadline = None if self.block_timeout is None else time.monotonic() + self.block_timeout
            while self._queued_bytes + nbytes > self.max_queue_bytes and self._queued_bytes > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if self.backpressure == "drop" or self._stalled or (left is not None and left <= 0):
                    self.dropped_rows += item.nrows
                    if self.backpressure == "block":
                        self.timed_out_submits += 1
                        if not self._stalled:
                            self._stalled = True
                            log.warning("triage-monitor: the writer made no room in its queue for %.0f s (a frozen "
                                        "or slow store?); training continues: steps that find the queue full are "
                                        "dropped and counted (metric writer_dropped_rows) until the writer moves "
                                        "again", self.block_timeout)
                    return False
                if not waited:
                    waited = True
                    self.blocked_submits += 1
                self._cv.wait(timeout=1.0 if left is None else max(min(left, 1.0), 0.01))
            self._queued_bytes += nbytes
        self._q.put(item)
        return True

    def flush(self, timeout: Optional[float] = WAIT_TIMEOUT_S) -> bool:
        """Wait until every queued step is written (or dropped), at most ``timeout`` seconds (default
        :data:`WAIT_TIMEOUT_S`; None: no limit).  Returns True when the queue is empty, False when the bound passed
        first (the writer goes on; nothing is dropped by a flush).

        Raises:
            ForkedWriterError: called in a process forked after the sink was built."""
        self.check_process()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queued_bytes > 0 or self._queued_other > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=0.5 if left is None else min(left, 0.5))
        return True

    @property
    def queued_rows(self) -> int:
        """Rows queued and not yet written (the item the writer is on included)."""
        with self._cv:
            rows = sum(getattr(i, "nrows", 0) for i in list(self._q.queue))
            return rows + (self._inflight.nrows if isinstance(self._inflight, Write) else 0)

    @property
    def sealed_blocks(self) -> int:
        """Blocks sealed so far (Parquet files completed, their pending files removed)."""
        return sum(w.sealed for w in list(self._writers.values()))

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: later submits are dropped and counted in ``dropped_rows``."""
        return self._closed

    def close(self, timeout: Optional[float] = WAIT_TIMEOUT_S) -> bool:
        """Drain the queue, seal the open blocks and stop the writer thread, waiting at most ``timeout`` seconds
        (default :data:`WAIT_TIMEOUT_S`; None: no limit).

        Returns:
            True when the writer finished; False when the bound passed first: the steps still queued, and the one
            being written, are counted in :attr:`dropped_rows` and :attr:`abandoned_rows` (the one being written may
            still reach the store), the writer thread writes nothing more, and the open blocks stay as pending
            files (which readers read and the next writer of the rank seals).

        Raises:
            ForkedWriterError: called in a process forked after the sink was built."""
        self.check_process()
        with self._cv:
            if self._closed:
                return not self.abandoned
            self._closed = True
        self._q.put(_Stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        self._abandon()
        return False

    def _abandon(self) -> None:
        """Give up on the writer thread (:meth:`close` at its bound): count what it has not written as dropped."""
        with self._cv:
            self.abandoned = True
            rows = self._inflight.nrows if isinstance(self._inflight, Write) else 0
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                rows += getattr(item, "nrows", 0)
            self.abandoned_rows = rows
            self.dropped_rows += rows
            self._queued_bytes, self._queued_other = 0, 0
            self._cv.notify_all()

    # ---------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            item = self._q.get()
            with self._cv:
                if self.abandoned:              # close() gave up on this thread: what is left was counted dropped
                    return
                self._inflight = item
            if item is _Stop:
                self._seal_all()
                return
            ok, exc = True, None
            try:
                if isinstance(item, Recover):
                    self._recover(item.rank)
                elif isinstance(item, Task):
                    item.fn()
                else:
                    self._write(item)
            except Exception as e:  # never raise into training: count and report once
                ok, exc = False, e
            with self._cv:
                self._inflight = None
                if self.abandoned:              # counted dropped at the bound, whatever became of it
                    return
                if isinstance(item, Write):
                    self._queued_bytes -= item.nbytes
                    if ok:
                        self.written_rows += item.nrows
                        self.written_steps += bool(item.nrows)
                        self._stalled = False
                    else:
                        self.dropped_rows += item.nrows
                else:
                    self._queued_other -= 1
                self._cv.notify_all()
            if exc is not None:
                if isinstance(item, Task):
                    self._report(exc, item.what, f"{item.what} is not written")
                else:
                    self._report(exc, f"{getattr(item, 'table', 'pending')} rows for step "
                                 f"{getattr(item, 'step', '-')}", "rows are counted as dropped")
            self._beat()

    def _report(self, exc: BaseException, what: str, consequence: str) -> None:
        """Keep ``exc`` as :attr:`last_error`; warn once per kind of consequence (rows dropped, a block left in
        pending files, the lease)."""
        if consequence not in self._warned:
            self._warned.add(consequence)
            log.warning("triage-monitor could not write %s (%s); training continues, %s", what, exc, consequence)
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _beat(self) -> None:
        if self._heartbeat is None or time.monotonic() - self._beat_at < self._heartbeat_s:
            return
        self._beat_at = time.monotonic()
        try:
            self._heartbeat()
        except Exception as exc:  # noqa: BLE001 — the lease is advisory; writing goes on
            self._report(exc, "the writer lease", "the lease may look stale to a second writer")

    def _spool_dir(self) -> Optional[str]:
        if self.store.is_local:
            return None
        if self._spool is None:
            _remove_dead_spools()
            self._spool = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-")
        return self._spool

    def _writer(self, table: str, rank: int) -> BlockWriter:
        key = (table, rank)
        w = self._writers.get(key)
        if w is None:
            w = self._writers[key] = BlockWriter(self.store, table, rank, self.attempt, self.roll_steps,
                                                 self.roll_bytes, self._spool_dir())
        return w

    def _write(self, item: Write) -> None:
        if self.taken_over is not None and self.taken_over():
            raise RuntimeError("another writer took over this rank (its lease); this writer's records stop here")
        built = item.columns.build()
        tab = built if isinstance(built, pa.Table) else pa.table(built, schema=item.schema)
        for i, key, value in ((0, "step", item.step), (1, "rank", item.rank)):   # plain readers get int64 step/rank
            if key not in tab.column_names:
                tab = tab.add_column(i, key, pa.array(np.full(tab.num_rows, value, dtype=np.int64)))
        w = self._writer(item.table, item.rank)
        w.write(item.step, tab)
        if w.error is not None:
            exc, w.error = w.error, None
            self._report(exc, f"the {item.table} block of rank {item.rank} at step {item.step}", PENDING_KEPT)

    def _recover(self, rank: int) -> None:
        for table in TABLES:                 # a killed attempt's open blocks' temporary files (never read)
            gone = remove_stale_temps(self.store, table, rank, self.attempt)
            if gone:
                log.info("triage-monitor: removed %d temporary file(s) a killed attempt of rank %d left in %s/",
                         len(gone), rank, table)
        for table in (t for t in TABLES if t not in LATE_TABLES):
            idx = self.layout.index(table)
            left = [p for p in idx.parts if not p.sealed and p.rank == rank and p.attempt != self.attempt]
            if left:
                names = seal_pending(self.store, left, self._spool_dir())
                log.info("triage-monitor: sealed %d pending file(s) an earlier attempt of rank %d left in %s/ "
                         "into %s", len(left), rank, table, ", ".join(names))

    def _seal_all(self) -> None:
        if self.taken_over is not None and self.taken_over():
            return          # the new writer of the rank seals what this one left in pending files
        for w in self._writers.values():
            try:
                w.close()
            except Exception as exc:  # noqa: BLE001 — its steps stay as pending files, which readers read
                self._report(exc, f"the last {w.table} block of rank {w.rank}", PENDING_KEPT)
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
