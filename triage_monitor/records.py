"""The run directory on disk: Arrow schemas, manifest and the background Parquet writer.

Layout (README "The run directory"), every file readable by pyarrow, pandas,
DuckDB, Polars or Spark::

    run.json                                   manifest (schema version, tool version, config, attempts)
    tokens/step=<S>/rank=<R>/part-<attempt>.parquet      valid tokens of one step on one rank
    steps/step=<S>/rank=<R>/part-<attempt>.parquet       one row of live metrics
    quarantine/step=<S>/rank=<R>/part-<attempt>.parquet  tokens excluded by on_invalid="quarantine"
    alerts/step=<S>/rank=<R>/part-<attempt>.parquet      alerts raised at that step

``step`` and ``rank`` live in the hive directory names only (pyarrow and
pandas add them as columns when reading the folder).  ``attempt`` (int64,
nanoseconds since the epoch at monitor start) is a column: a job resumed from
a checkpoint repeats step numbers under a newer attempt, and readers keep the
latest attempt of each step.

Files appear atomically: each is written under a hidden temporary name
(``.tmp-*``, which pyarrow's dataset discovery skips) and renamed, so a killed
job leaves only complete files.  Writes happen on a background thread behind
a queue bounded in bytes; the writer never raises into the training loop: it
counts, warns once and degrades (:class:`ParquetSink`).
"""

from __future__ import annotations

import json
import math
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger("triage_monitor.records")

SCHEMA_VERSION = 1
MANIFEST = "run.json"

#: Columns every token file has (step and rank come from the directory names).
TOKEN_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("group_id", pa.int64()), ("position", pa.int32()),
    ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()), ("advantage", pa.float32()),
    ("attempt", pa.int64()),
])


def partition_dir(run_dir, table: str, step: int, rank: int) -> Path:
    """``run_dir/table/step=<step>/rank=<rank>``."""
    return Path(run_dir) / table / f"step={int(step)}" / f"rank={int(rank)}"


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` through a hidden temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{uuid.uuid4().hex}.parquet"
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


def write_json_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` as standard JSON (NaN/inf become null) through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{uuid.uuid4().hex}.json"
    try:
        tmp.write_text(json.dumps(_json_safe(obj), indent=2, default=_json_default, allow_nan=False))
        os.replace(tmp, path)
    finally:  # a failed write (full disk) leaves no temporary file behind
        tmp.unlink(missing_ok=True)


def _json_safe(o):
    """``o`` with non-finite floats replaced by None, recursively (JSON has no NaN)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def read_manifest(run_dir) -> dict:
    """The parsed ``run.json`` of ``run_dir``.  Raises FileNotFoundError when absent."""
    return json.loads((Path(run_dir) / MANIFEST).read_text())


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def new_attempt_id() -> int:
    """A sortable attempt id: nanoseconds since the epoch."""
    return time.time_ns()


class ParquetSink:
    """Background writer of the run directory's Parquet files.

    ``submit(table, step, rank, columns)`` queues one file (a dict of 1-D
    numpy arrays, or a list of row dicts) and returns at once.  The queue is
    bounded to ``max_queue_bytes``; when full, ``backpressure="block"`` waits
    for the writer and ``"drop"`` drops the file and counts its rows.

    I/O errors (read-only or full disk, ...) never propagate: the rows are
    counted in :attr:`dropped_rows`, the first error is logged once and kept
    in :attr:`last_error`.  ``close()`` drains the queue (``flush()`` waits
    without closing).
    """

    def __init__(self, run_dir, attempt: int, max_queue_bytes: int = 256 << 20, backpressure: str = "block"):
        if backpressure not in ("block", "drop"):
            raise ValueError(f"backpressure must be 'block' or 'drop', got {backpressure!r}")
        self.run_dir = Path(run_dir)
        self.attempt = int(attempt)
        self.max_queue_bytes = int(max_queue_bytes)
        self.backpressure = backpressure
        self.written_rows = 0
        self.written_files = 0
        self.dropped_rows = 0
        self.last_error: Optional[str] = None
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._q: "queue.Queue" = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="triage-monitor-writer", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- producer
    def submit(self, table: str, step: int, rank: int, columns, schema: Optional[pa.Schema] = None) -> bool:
        """Queue one file; returns False if it was dropped (closed sink or full queue with ``drop``)."""
        nbytes, nrows = _size_of(columns)
        with self._cv:
            if self._closed:
                self.dropped_rows += nrows
                return False
            while self._queued_bytes + nbytes > self.max_queue_bytes and self._queued_bytes > 0:
                if self.backpressure == "drop":
                    self.dropped_rows += nrows
                    return False
                self._cv.wait(timeout=1.0)
            self._queued_bytes += nbytes
        self._q.put((table, int(step), int(rank), columns, schema, nbytes, nrows))
        return True

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued file is written (or dropped)."""
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
        """Drain the queue and stop the writer thread."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self._q.put(None)
        self._thread.join(timeout)

    # ---------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            table, step, rank, columns, schema, nbytes, nrows = item
            try:
                if isinstance(columns, list):
                    tab = pa.Table.from_pylist(columns, schema=schema)
                else:
                    tab = pa.table(columns, schema=schema)
                path = partition_dir(self.run_dir, table, step, rank) / f"part-{self.attempt}.parquet"
                write_table_atomic(tab, path)
                self.written_rows += nrows
                self.written_files += 1
            except Exception as exc:  # never raise into training: count and report once
                self.dropped_rows += nrows
                if self.last_error is None:
                    log.warning("triage-monitor could not write %s rows for step %s (%s); training continues, "
                                "rows are counted as dropped", table, step, exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                with self._cv:
                    self._queued_bytes -= nbytes
                    self._cv.notify_all()


def _size_of(columns) -> tuple:
    if isinstance(columns, list):
        return 256 * max(len(columns), 1), len(columns)
    nbytes = sum(getattr(v, "nbytes", 8 * len(v)) for v in columns.values())
    nrows = len(next(iter(columns.values()))) if columns else 0
    return max(nbytes, 1), nrows
