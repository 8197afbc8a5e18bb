"""The background writer of a run directory's Parquet files (:class:`ParquetSink`) and its atomic table writes.

One typed item per file at the queue's door (:class:`Write`, :class:`Delete`), one queue bounded in bytes, one
writer thread.  Each file is written under a hidden temporary name and renamed (:func:`write_table_atomic`), so
a killed job leaves only complete files.  Once started, the writer never raises into the training loop: it
counts, warns once and degrades.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .layout import RunLayout, temp_path

#: the writer's messages (locks, files, manifest) share one logger name
log = logging.getLogger("triage_monitor.records")

#: Bytes a row given as a dict counts against the queue bound.
ROW_BYTES = 256
#: Columns written without a dictionary: the per-token log-probs, nearly every value distinct, where a dictionary
#: only costs time (the writer's encode ~0.55x without it on them, files 0.72-0.90x the size:
#: benchmarks/bench_writer_encoding.py).  Every other column (ids, positions, the broadcast advantage, steps) keeps
#: pyarrow's default dictionary encoding.
PLAIN_COLUMNS = frozenset({"learner_logp", "sampler_logp"})


def dictionary_columns(schema: pa.Schema) -> list:
    """The columns of ``schema`` written with a dictionary: all but :data:`PLAIN_COLUMNS`."""
    return [f.name for f in schema if f.name not in PLAIN_COLUMNS]


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` through a hidden temporary file (:func:`~triage_monitor.layout.temp_path`)
    and an atomic rename; the parent directories are created.

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be written (no temporary file is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path.parent, ".parquet")
    try:
        pq.write_table(table, tmp, use_dictionary=dictionary_columns(table.schema))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class DeferredColumns:
    """A file's columns, built on the writer thread: ``build()`` returns ``{name: 1-D values}`` (numpy arrays
    or lists, all of ``nrows`` values); ``nbytes`` / ``nrows`` size it for the queue bound before it exists.

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
    """Queue item: write the file of (``table``, ``step``, ``rank``) of the sink's attempt from ``columns``,
    cast to ``schema`` (None: the columns' own types)."""

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
        """Rows the file holds (counted written or dropped)."""
        return self.columns.nrows


@dataclass(frozen=True)
class Delete:
    """Queue item: remove the file of (``table``, ``step``, ``rank``) written by the earlier ``attempt`` (a missing
    file is no error).

    ``after``: a table; the file is removed only if the sink's own attempt has its file of (``after``, ``step``,
    ``rank``) on disk when the item's turn comes (the queue is FIFO: a :class:`Write` queued before it has been
    written or has failed by then), else it is kept and counted in :attr:`ParquetSink.kept_files`.  So a
    replaced file goes only once its replacement is on disk: a full disk or a dropped file keeps the earlier
    attempt's.  None: removed unconditionally."""

    table: str
    step: int
    rank: int
    attempt: int
    after: Optional[str] = None

    nbytes = 1          # counted in the queue until done, so flush() waits for it
    nrows = 0


class _Stop:
    """Queue item: the writer thread ends (queued by :meth:`ParquetSink.close`)."""


class ParquetSink:
    """Background writer of the run directory's Parquet files.

    ``submit(table, step, rank, columns)`` queues one file (a :class:`Write`: :class:`DeferredColumns` built
    on the writer thread, or a dict of 1-D numpy arrays or a list of row dicts, wrapped into one) and returns
    at once.  The queue is bounded to ``max_queue_bytes``; when full, ``backpressure="block"`` waits for the
    writer and ``"drop"`` drops the file and counts its rows.

    I/O errors (read-only or full disk, ...) never propagate: the rows are counted in :attr:`dropped_rows`,
    the first error is logged once and kept in :attr:`last_error`.  An earlier attempt's file queued for removal
    with ``after`` is removed only once its replacement is on disk (:class:`Delete`).  ``close()`` drains the queue (``flush()``
    waits without closing).

    Raises:
        ValueError: ``backpressure`` is neither "block" nor "drop" (at construction).
    """

    def __init__(self, run_dir, attempt: int, max_queue_bytes: int = 256 << 20, backpressure: str = "block"):
        if backpressure not in ("block", "drop"):
            raise ValueError(f"backpressure must be 'block' or 'drop', got {backpressure!r}")
        self.run_dir = Path(run_dir)
        self.layout = RunLayout(self.run_dir)
        self.attempt = int(attempt)
        self.max_queue_bytes = int(max_queue_bytes)
        self.backpressure = backpressure
        self.written_rows = 0
        self.written_files = 0
        self.dropped_rows = 0
        #: files whose submit had to wait for room (``backpressure="block"``: the training loop was held)
        self.blocked_submits = 0
        #: earlier attempts' files a conditional :class:`Delete` kept because their replacement was not on disk
        self.kept_files = 0
        self.last_error: Optional[str] = None
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._q: "queue.Queue" = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="triage-monitor-writer", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- producer
    def submit(self, table: str, step: int, rank: int, columns, schema: Optional[pa.Schema] = None) -> bool:
        """Queue one file (see the class); returns False if it was dropped (closed sink or full queue with
        ``drop``).

        Raises:
            TypeError: ``columns`` is of another type (:meth:`DeferredColumns.of`)."""
        return self._put(Write(table, int(step), int(rank), DeferredColumns.of(columns, schema), schema))

    def submit_delete(self, table: str, step: int, rank: int, attempt: int, after: Optional[str] = None) -> None:
        """Queue the removal of ``table``'s file of (step, rank) written by an earlier ``attempt``, after the files
        queued before it (a resumed job's step replaces the earlier attempt's).  A missing file is no error.

        ``after``: remove it only if this sink's attempt then has its own file of (``after``, step, rank) on disk
        (the replacement; see :class:`Delete`); None removes it unconditionally."""
        self._put(Delete(table, int(step), int(rank), int(attempt), after))

    def _put(self, item) -> bool:
        """Queue ``item`` under the byte bound (a removal is never refused for room); False when dropped."""
        nbytes = item.nbytes
        with self._cv:
            if self._closed:
                self.dropped_rows += item.nrows
                return False
            waited = False
            while (isinstance(item, Write) and self._queued_bytes + nbytes > self.max_queue_bytes
                   and self._queued_bytes > 0):
                if self.backpressure == "drop":
                    self.dropped_rows += item.nrows
                    return False
                if not waited:
                    waited = True
                    self.blocked_submits += 1
                self._cv.wait(timeout=1.0)
            self._queued_bytes += nbytes
        self._q.put(item)
        return True

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued file is written (or dropped), at most ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queued_bytes > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._cv.wait(timeout=0.5 if left is None else min(left, 0.5))

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: later submits are dropped and counted in ``dropped_rows``."""
        return self._closed

    def close(self, timeout: Optional[float] = None) -> None:
        """Drain the queue and stop the writer thread (waiting at most ``timeout`` seconds for it)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self._q.put(_Stop)
        self._thread.join(timeout)

    # ---------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _Stop:
                return
            try:
                if isinstance(item, Delete):
                    self._delete(item)
                    continue
                self._write(item)
                self.written_rows += item.nrows
                self.written_files += 1
            except Exception as exc:  # never raise into training: count and report once
                self.dropped_rows += item.nrows
                if self.last_error is None:
                    log.warning("triage-monitor could not write %s rows for step %s (%s); training continues, "
                                "rows are counted as dropped", item.table, item.step, exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                with self._cv:
                    self._queued_bytes -= item.nbytes
                    self._cv.notify_all()

    def _delete(self, item: Delete) -> None:
        old = self.layout.table_file(item.table, item.step, item.rank, item.attempt)
        if item.after is not None and not self.layout.table_file(item.after, item.step, item.rank,
                                                                 self.attempt).is_file():
            if old.exists():       # its replacement was not written (full disk, dropped): the earlier file stays
                self.kept_files += 1
                if self.kept_files == 1:
                    log.warning("triage-monitor kept %s of an earlier attempt: this attempt's %s file of step %s "
                                "is not on disk, so the step keeps its earlier records", old, item.after, item.step)
            return
        old.unlink(missing_ok=True)

    def _write(self, item: Write) -> None:
        tab = pa.table(item.columns.build(), schema=item.schema)
        for i, key, value in ((0, "step", item.step), (1, "rank", item.rank)):   # plain readers get int64 step/rank
            if key not in tab.column_names:
                tab = tab.add_column(i, key, pa.array(np.full(tab.num_rows, value, dtype=np.int64)))
        write_table_atomic(tab, self.layout.table_file(item.table, item.step, item.rank, self.attempt))
