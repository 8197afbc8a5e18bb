"""The run directory on disk: Arrow schemas, manifest and the background Parquet writer.

Layout (README "The run directory"), every file readable by pyarrow, pandas,
DuckDB, Polars or Spark::

    run.json                                   manifest (:class:`RunManifest`: versions, config, attempts, τ_tail)
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger("triage_monitor.records")

SCHEMA_VERSION = 2             # of run.json (1: the same plus duplicated top-level config keys, still read)
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


def read_manifest(run_dir) -> "RunManifest":
    """The :class:`RunManifest` of ``run_dir``.

    Raises:
        FileNotFoundError: no ``run.json``.
        ValueError: ``run.json`` is not a JSON object (the message names the file).
    """
    path = Path(run_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return RunManifest.from_dict(raw)


#: Keys of schema-1 manifests that duplicated ``monitor_config`` (dropped on reading; the config is the home).
_LEGACY_KEYS = ("segment_width", "small_gap_threshold", "tau_tail", "window", "calibration_steps")


@dataclass
class RunManifest:
    """The run's ``run.json``, read and written here only.

    Attributes:
        monitor_config: ``MonitorConfig.to_dict()`` of the run (window, calibration steps, metric thresholds,
            a given τ_tail); ``analysis.Run.config`` turns it back into the ``MonitorConfig``.
        info: the user's / framework's facts (``manifest=`` of the monitor).
        attempts: one entry per process start (attempt id, start time, host, pid, world size).
        calibration: τ_tail's one home once calibrated: ``{"tau_tail", "frozen_at_step", "attempt"}`` (nats).
        status: ``running`` | ``finished`` | ``failed``.
        steps_logged, writer: set when the monitor closes (rows written / dropped, last error).
        extra: keys this version does not know (kept on rewrite).
    """

    monitor_config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    attempts: list = field(default_factory=list)
    calibration: Optional[dict] = None
    status: str = "running"
    steps_logged: Optional[int] = None
    writer: Optional[dict] = None
    schema_version: int = SCHEMA_VERSION
    tool: str = "triage-monitor"
    tool_version: str = ""
    created: str = ""
    python: str = ""
    torch: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tau_tail(self) -> Optional[float]:
        """The run's τ_tail in nats: the given one (``monitor_config.tau_tail``), else the calibrated one, else None."""
        given = self.monitor_config.get("tau_tail")
        if given is not None:
            return float(given)
        cal = self.calibration or {}
        return None if cal.get("tau_tail") is None else float(cal["tau_tail"])

    @classmethod
    def from_dict(cls, d: dict) -> "RunManifest":
        """Parse a ``run.json`` object (schema 1 or 2)."""
        d = dict(d)
        names = {f.name for f in fields(cls)} - {"extra"}
        legacy_cal = d.pop("tau_tail_calibrated", None)
        for k in _LEGACY_KEYS:
            d.pop(k, None)
        known = {k: d.pop(k) for k in list(d) if k in names}
        m = cls(**known, extra=d)
        if m.calibration is None and legacy_cal is not None and m.monitor_config.get("tau_tail") is None:
            m.calibration = {"tau_tail": legacy_cal}
        return m

    def to_dict(self) -> dict:
        """The JSON object written to ``run.json``."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d.update(self.extra)
        return d

    def write(self, run_dir) -> None:
        """Write ``run_dir/run.json`` atomically (standard JSON: NaN → null)."""
        write_json_atomic(self.to_dict(), Path(run_dir) / MANIFEST)


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


class RunWriter:
    """Everything the monitor puts on disk: the manifest (rank 0 writes it) and the Parquet columns of each step.

    Args:
        run_dir: the run directory; an existing run is continued as a new attempt (its manifest kept).
        attempt: this process start's attempt id (shared by all ranks).
        rank, world_size: this process's rank and the job's size.
        monitor_config: ``MonitorConfig.to_dict()``.
        info: facts for ``RunManifest.info`` (merged into an existing run's).
        versions: ``{"tool_version", "python", "torch"}`` for a new manifest.
        max_queue_bytes, backpressure: of the :class:`ParquetSink`.

    ``manifest`` exists on every rank; only rank 0 writes it.  I/O errors never raise: they are logged once.
    """

    def __init__(self, run_dir, attempt: int, rank: int, world_size: int, monitor_config: dict, info: dict,
                 versions: dict, max_queue_bytes: int = 256 << 20, backpressure: str = "block"):
        import platform
        import socket

        self.run_dir, self.attempt, self.rank = Path(run_dir), int(attempt), int(rank)
        self._warned: set = set()
        entry = {"attempt": self.attempt, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "host": socket.gethostname(), "pid": os.getpid(), "world_size": int(world_size)}
        try:
            old = read_manifest(self.run_dir) if (self.run_dir / MANIFEST).exists() else None
        except (OSError, ValueError):
            old = None
        #: τ_tail an earlier attempt froze (None for a new run or a given τ_tail): the resumed job keeps it
        self.resumed_tau_tail: Optional[float] = (
            old.calibration.get("tau_tail") if old is not None and old.calibration and
            monitor_config.get("tau_tail") is None else None)
        if old is not None:
            old.attempts.append(entry)
            old.info.update(info)
            old.status = "running"
            self.manifest = old
        else:
            self.manifest = RunManifest(monitor_config=dict(monitor_config), info=dict(info), attempts=[entry],
                                        created=entry["started"], python=platform.python_version(), **versions)
        self.save_manifest()
        self.sink = ParquetSink(self.run_dir, self.attempt, max_queue_bytes, backpressure)

    def save_manifest(self) -> None:
        """Write run.json (rank 0 only); an OSError is reported once and monitoring continues."""
        if self.rank != 0:
            return
        try:
            self.manifest.write(self.run_dir)
        except OSError as exc:
            self._warn_once("manifest", "triage-monitor could not write %s (%s); monitoring continues",
                            self.run_dir / MANIFEST, exc)

    def save_calibration(self, tau_tail: float, step: int) -> None:
        """Record the frozen τ_tail (nats) and the step it froze at, so a resumed job keeps it."""
        self.manifest.calibration = {"tau_tail": float(tau_tail), "frozen_at_step": int(step), "attempt": self.attempt}
        self.save_manifest()

    def record_step(self, step: int, batch, metrics: dict, reasons: dict, token_extras: Optional[dict],
                    record_tokens: bool = True) -> None:
        """Queue the step's token rows (``record_tokens``), quarantined rows and the metric row."""
        import torch

        from .batch import INVALID_REASONS

        if record_tokens and batch.num_tokens:
            cols = {
                "sample_id": batch.sample_id[batch.sample_index].cpu().numpy(),
                "group_id": batch.group_id[batch.sample_index].cpu().numpy(),
                "position": batch.position.cpu().numpy().astype(np.int32),
                "learner_logp": batch.learner_logp.float().cpu().numpy(),
                "sampler_logp": batch.sampler_logp.float().cpu().numpy(),
                "advantage": batch.advantage.float().cpu().numpy(),
                "attempt": np.full(batch.num_tokens, self.attempt, dtype=np.int64),
            }
            schema = TOKEN_SCHEMA
            for k, v in (token_extras or {}).items():
                cols[k] = torch.as_tensor(v).detach().float().cpu().numpy().reshape(-1)
                schema = schema.append(pa.field(k, pa.float32()))
            self.sink.submit("tokens", step, self.rank, cols, schema)
        if batch.quarantine_rows is not None:
            qd = {k: v.numpy() for k, v in batch.quarantine_rows.items()}
            qd["reason"] = np.array([INVALID_REASONS[int(c)] for c in qd["reason"]])
            qd["attempt"] = np.full(len(qd["position"]), self.attempt, dtype=np.int64)
            self.sink.submit("quarantine", step, self.rank, qd)
        row = {k: (float(v) if k != "step" else None) for k, v in metrics.items() if k != "step"}
        row["attempt"] = self.attempt
        row["wall_time"] = time.time()
        row["nan_reasons"] = json.dumps(reasons)
        row["writer_dropped_rows"] = float(self.sink.dropped_rows)
        self.sink.submit("steps", step, self.rank, [row])

    def record_alerts(self, step: int, rows: list) -> None:
        """Queue the alert rows raised at ``step`` (each gets this attempt's id)."""
        if rows:
            self.sink.submit("alerts", step, self.rank, [{**r, "attempt": self.attempt} for r in rows])

    def close(self, status: str, steps_logged: int) -> None:
        """Drain the writer and mark the manifest ``status`` with the writer's counts."""
        self.sink.close()
        self.manifest.status = status
        self.manifest.steps_logged = int(steps_logged)
        self.manifest.writer = {"written_rows": self.sink.written_rows, "dropped_rows": self.sink.dropped_rows,
                                "last_error": self.sink.last_error}
        self.save_manifest()

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
