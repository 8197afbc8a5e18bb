"""The run directory on disk: Arrow schemas, manifest, the background Parquet writer and its start checks.

Layout (README "The run directory"), every table readable as a whole by ``pandas.read_parquet(dir)``,
``pyarrow.dataset.dataset(dir)``, DuckDB or Polars, with ``step``, ``rank`` and ``attempt`` int64 columns::

    run.json                                                  manifest (:class:`RunManifest`)
    tokens/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet      valid tokens of one step on one rank
    steps/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet       one row of live metrics
    quarantine/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet  tokens excluded by on_invalid="quarantine"
    alerts/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet      alerts raised at that step
    .writer-rank-<R>.lock                                     held (flock) by the process writing rank R

One schema per table (:data:`TOKEN_SCHEMA`, :data:`ALERT_SCHEMA`, :data:`QUARANTINE_SCHEMA`; the steps table:
int64 ``step``/``rank``/``attempt``, float64 metrics, a string ``nan_reasons``).  ``attempt`` (nanoseconds
since the epoch at monitor start, shared by the ranks of one job start) is in the name and a column: a job
resumed from a checkpoint writes a repeated step under its newer attempt, then removes that rank's files of
the step from earlier attempts, so one (step, rank) has one file once the write is done.  Ranks an earlier
attempt had and the resumed job has not stay on disk under the older attempt: readers keep each step's latest
attempt (``analysis.open_run``; with plain pandas ``df[df.attempt == df.groupby("step").attempt.transform("max")]``).
Zero-padded names sort in step order.  Runs written before manifest schema 3 used hive directories
``<table>/step=<S>/rank=<R>/part-<attempt>.parquet``; the reader still reads them, the writer does not
continue them.

Files appear atomically: each is written under a hidden temporary name (``.tmp-*``, which pyarrow's
dataset discovery skips) and renamed, so a killed job leaves only complete files.  Writes happen on a
background thread behind a queue bounded in bytes; once started, the writer never raises into the training
loop: it counts, warns once and degrades (:class:`ParquetSink`).  What can be checked before training does
raise, at start (:class:`RunWriter`, :class:`OutputError`): an unwritable directory, a directory that
holds a run of another configuration, a second live writer of the same rank.
"""

from __future__ import annotations

import json
import math
import logging
import os
import queue
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import OutputError, RunConflictError, RunLockedError, UnwritableOutputError  # noqa: F401

log = logging.getLogger("triage_monitor.records")

SCHEMA_VERSION = 3             # of run.json (3: flat table files; 2: hive step=/rank= dirs; 1: + duplicated config keys)
MANIFEST = "run.json"

#: Columns every token file has (``token_extras`` add float32 columns after them).
TOKEN_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()),
    ("sample_id", pa.int64()), ("group_id", pa.int64()), ("position", pa.int32()),
    ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()), ("advantage", pa.float32()),
    ("attempt", pa.int64()),
])
#: Columns of the alerts table (one row per fired rule: ``alerts.Alert.to_row()`` plus rank and attempt).
ALERT_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("rule", pa.string()), ("metric", pa.string()),
    ("value", pa.float64()), ("threshold", pa.float64()), ("window", pa.int64()), ("level", pa.string()),
    ("title", pa.string()), ("text", pa.string()), ("attempt", pa.int64()),
])
#: Columns of the quarantine table (docs/reliability.md): the excluded tokens and why.
QUARANTINE_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("sample_id", pa.int64()), ("position", pa.int64()),
    ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()), ("advantage", pa.float32()),
    ("reason", pa.string()), ("attempt", pa.int64()),
])
TABLES = ("tokens", "steps", "quarantine", "alerts")
_FILE_RE = re.compile(r"^step-(-?\d+)-rank-(\d+)-attempt-(\d+)\.parquet$")


def table_file(run_dir, table: str, step: int, rank: int, attempt: int) -> Path:
    """``run_dir/<table>/step-<step:08d>-rank-<rank:04d>-attempt-<attempt>.parquet``: the file of (table, step,
    rank) written by ``attempt``."""
    return Path(run_dir) / table / f"step-{int(step):08d}-rank-{int(rank):04d}-attempt-{int(attempt)}.parquet"


def parse_table_file(name: str) -> Optional[tuple]:
    """``(step, rank, attempt)`` of a :func:`table_file` name, None for any other name."""
    m = _FILE_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


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
    """``o`` with non-finite floats (numpy's included) replaced by None, recursively (JSON has no NaN)."""
    if isinstance(o, (float, np.floating)):
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
    numpy arrays, a list of row dicts, or :class:`DeferredColumns` built on
    the writer thread) and returns at once.  The queue is
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

    def submit_delete(self, table: str, step: int, rank: int, attempt: int) -> None:
        """Queue the removal of ``table``'s file of (step, rank) written by an earlier ``attempt``, after the files
        queued before it (a resumed job's step replaces the earlier attempt's).  A missing file is no error."""
        with self._cv:
            if self._closed:
                return
            self._queued_bytes += 1
        self._q.put((table, int(step), int(rank), None, int(attempt), 1, 0))

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
                if columns is None:      # a removal: ``schema`` holds the earlier attempt
                    table_file(self.run_dir, table, step, rank, schema).unlink(missing_ok=True)
                    continue
                path = table_file(self.run_dir, table, step, rank, self.attempt)
                if isinstance(columns, DeferredColumns):
                    columns = columns.build()
                if isinstance(columns, list):
                    tab = pa.Table.from_pylist(columns, schema=schema)
                else:
                    tab = pa.table(columns, schema=schema)
                for i, key, value in ((0, "step", step), (1, "rank", rank)):   # plain readers get int64 step/rank
                    if key not in tab.column_names:
                        tab = tab.add_column(i, key, pa.array(np.full(tab.num_rows, value, dtype=np.int64)))
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


@dataclass(frozen=True)
class DeferredColumns:
    """A file's columns built on the writer thread: ``build()`` returns the dict of 1-D numpy arrays;
    ``nbytes`` / ``nrows`` size it for the queue bound before it exists."""

    build: Callable[[], dict]
    nbytes: int
    nrows: int


def _size_of(columns) -> tuple:
    if isinstance(columns, DeferredColumns):
        return max(columns.nbytes, 1), columns.nrows
    if isinstance(columns, list):
        return 256 * max(len(columns), 1), len(columns)
    nbytes = sum(getattr(v, "nbytes", 8 * len(v)) for v in columns.values())
    nrows = len(next(iter(columns.values()))) if columns else 0
    return max(nbytes, 1), nrows


# ------------------------------------------------------------------------------------------ start checks
#: ``MonitorConfig`` keys that steer only I/O, devices or start-up checks: attempts of one run may differ in them.
IO_CONFIG_KEYS = frozenset({"record_tokens", "max_queue_bytes", "backpressure",
                            "alignment_check_steps"})
#: Manifest (``info``) keys that say what was trained or imported: an existing run continues only when they match
#: (besides the metric configuration); a key set on one side only counts as a difference.
IDENTITY_KEYS = ("framework", "model", "task", "correction", "seed", "demo_config", "imported_from", "column_map")


def probe_writable(path) -> Path:
    """Create directory ``path`` (and parents) and write + remove a hidden probe file in it.

    Returns:
        ``Path(path)``.

    Raises:
        UnwritableOutputError: naming the path and the OS reason (read-only file system, permission denied,
            a parent that is a regular file, ...).
    """
    p = Path(path)
    probe = p / f".tmp-probe-{uuid.uuid4().hex}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != p else ""
        raise UnwritableOutputError(f"{p}: cannot write the output directory: {reason}{where}", p) from exc
    return p


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _normalised(obj):
    """``obj`` as it reads back from run.json (tuples → lists, NaN → None, Paths → str)."""
    return json.loads(json.dumps(_json_safe(obj), default=_json_default, allow_nan=False))


def config_differences(old: "RunManifest", monitor_config: dict, info: dict) -> tuple:
    """``(metric, identity)``: two ``{key: (old, new)}`` dicts of how a new writer's configuration differs from
    the run ``old``: ``monitor_config.<key>`` for the metric configuration (:data:`IO_CONFIG_KEYS` ignored), the
    :data:`IDENTITY_KEYS` of the manifest for what was trained."""
    new_mc = _flat(_normalised({k: v for k, v in monitor_config.items() if k not in IO_CONFIG_KEYS}))
    old_mc = _flat({k: v for k, v in old.monitor_config.items() if k not in IO_CONFIG_KEYS})
    metric = {f"monitor_config.{k}": (old_mc.get(k), new_mc.get(k)) for k in sorted(set(new_mc) | set(old_mc))
              if old_mc.get(k) != new_mc.get(k)}
    new_info = _normalised({k: info[k] for k in IDENTITY_KEYS if k in info})
    identity = {}
    for k in IDENTITY_KEYS:
        if k in new_info or k in old.info:
            a, b = old.info.get(k), new_info.get(k)
            if isinstance(a, dict) and isinstance(b, dict):
                fa, fb = _flat(a), _flat(b)
                identity.update({f"{k}.{j}": (fa.get(j), fb.get(j)) for j in sorted(set(fa) | set(fb))
                                 if fa.get(j) != fb.get(j)})
            elif a != b:
                identity[k] = (a, b)
    return metric, identity


def _describe(diffs: dict, limit: int = 8) -> str:
    items = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items()]
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def _holds_run(p: Path) -> bool:
    return (p / MANIFEST).exists() or any((p / t).is_dir() for t in TABLES)


def _move_aside(p: Path) -> Path:
    """Rename run directory ``p`` to a new sibling ``<name>.replaced-<UTC time>[-n]`` and recreate ``p`` empty."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = p.with_name(f"{p.name}.replaced-{stamp}")
    n = 1
    while dest.exists():
        dest, n = p.with_name(f"{p.name}.replaced-{stamp}-{n}"), n + 1
    os.rename(p, dest)
    p.mkdir()
    return dest


def check_run_dir(run_dir, monitor_config: dict, info: dict, *, resume: bool = False, force: bool = False,
                  rank: int = 0) -> Optional["RunManifest"]:
    """The start checks of a writer of ``run_dir`` (before any training work): writable, one run per directory.

    * the directory is created and probed (:func:`probe_writable`);
    * ``force``: an existing run (run.json or a table directory) is moved, whole, to the sibling
      ``<dir>.replaced-<UTC time>`` (rank 0 only) and a new run starts in the empty directory; refused while
      a process holds one of its writer locks;
    * otherwise an existing run continues as a new attempt when its metric configuration (``monitor_config``
      minus :data:`IO_CONFIG_KEYS`) and its :data:`IDENTITY_KEYS` match; with ``resume`` the identity keys may
      differ (the new attempt records the changes); the metric configuration never may.

    Args:
        run_dir: the run directory.
        monitor_config: ``MonitorConfig.to_dict()`` of the new writer.
        info: the new writer's manifest facts (``MismatchMonitor(manifest=...)``).
        resume, force: see above (the CLI's ``--resume`` / ``--force``).
        rank: the writer's rank (only rank 0 moves a run aside).

    Returns:
        The existing run's :class:`RunManifest` to continue, or None for a new run.

    Raises:
        UnwritableOutputError: the directory cannot be created or written.
        RunConflictError: another configuration, a run in the pre-schema-3 layout or an unreadable run.json
            (the message names the differing keys and the way out).
        RunLockedError: ``force`` while a process is writing the run.
    """
    p = probe_writable(run_dir)
    if force:                # rank 0 moves an existing run aside; the other ranks follow it without a check
        if rank == 0 and _holds_run(p):
            for lock in sorted(p.glob(".writer-rank-*.lock")):
                _probe_lock(lock)
            dest = _move_aside(p)
            log.warning("triage-monitor: --force: the run that was in %s is now in %s; a new run starts", p, dest)
        return None
    if not (p / MANIFEST).exists():
        return None
    way_out = (f"write to a new directory, or start over with --force / force=True (the old run is moved to "
               f"{p.name}.replaced-<time>)")
    try:
        old = read_manifest(p)
    except (OSError, ValueError) as exc:
        raise RunConflictError(f"{p} holds a run whose {MANIFEST} is unreadable ({exc}): {way_out}", p) from exc
    if old.schema_version < 3:
        raise RunConflictError(f"{p} holds a run in the older step=/rank= directory layout (manifest schema "
                               f"{old.schema_version}); this version reads it but does not continue it: {way_out}", p)
    metric, identity = config_differences(old, monitor_config, info)
    if metric:
        raise RunConflictError(f"{p} holds a run with another metric configuration ({_describe(metric)}); one run "
                               f"uses one (offline recomputation and windows span its attempts): {way_out}", p,
                               {**metric, **identity})
    if identity and not resume:
        raise RunConflictError(f"{p} holds another run ({_describe(identity)}): continue it as a new attempt with "
                               f"--resume / resume=True (the changes are recorded in run.json's attempt), or "
                               f"{way_out}", p, identity)
    return old


def add_existing_run_arguments(parser) -> None:
    """``--resume`` / ``--force`` (mutually exclusive) of the commands that write a run directory (``demo``,
    ``study``, ``import``): what to do with a run already in ``--out`` (:func:`check_run_dir`)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue the run already in --out as a new attempt even if its model / task / correction / "
                        "seed / source differ (the changes are recorded in run.json); the metric configuration "
                        "must match")
    g.add_argument("--force", action="store_true",
                   help="start a new run in --out; a run already there is moved to <out>.replaced-<UTC time>")


def _lock_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / f".writer-rank-{int(rank)}.lock"


def _probe_lock(path: Path) -> None:
    """Raise RunLockedError when a process holds the writer lock ``path``."""
    fd = _try_lock(path)
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
        raise RunLockedError(f"{path.parent}: another process is writing this run's rank {path.name[13:-5]} "
                             f"({holder}); one writer per rank: stop it, or write to another directory "
                             f"(a killed writer's lock is released by the OS)", path.parent) from None
    except OSError as exc:       # a file system without flock (some network mounts): go on without the lock
        os.close(fd)
        log.warning("triage-monitor: cannot lock %s (%s); a second writer of this rank would not be detected",
                    path, exc.strerror or exc)
        return None
    return fd


#: writer locks this process holds: {resolved lock path: fd}
_HELD: dict = {}


def acquire_writer_lock(run_dir, rank: int, attempt: int) -> Optional[int]:
    """Hold ``run_dir/.writer-rank-<rank>.lock`` (``flock``, released by the OS when the process dies) and write
    ``pid host attempt`` into it.  Returns the fd to pass to :func:`release_writer_lock` (None: no flock here).

    A lock this process already holds (a monitor of the same rank and run that was never closed, e.g. a
    notebook cell run twice) is taken over with a warning: the lock guards against other processes.

    Raises:
        RunLockedError: another live process holds it.
        UnwritableOutputError: the lock file cannot be opened, or its line cannot be written (a full disk: the
            start check's empty probe file needs no free block); the lock is released first.
    """
    import socket

    path = _lock_path(run_dir, rank)
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
    """Release a lock of :func:`acquire_writer_lock` (closing the fd drops the flock)."""
    if fd is not None:
        for k in [k for k, v in _HELD.items() if v == fd]:
            del _HELD[k]
        try:
            os.close(fd)
        except OSError:
            pass


class RunWriter:
    """Everything the monitor puts on disk: the manifest (rank 0 writes it) and the Parquet columns of each step.

    Args:
        run_dir: the run directory; an existing run of the same configuration is continued as a new attempt
            (its manifest kept), another one is refused (:func:`check_run_dir`).
        attempt: this process start's attempt id (shared by all ranks).
        rank, world_size: this process's rank and the job's size.
        monitor_config: ``MonitorConfig.to_dict()``.
        info: facts for ``RunManifest.info`` (merged into an existing run's).
        versions: ``{"tool_version", "python", "torch"}`` for a new manifest.
        max_queue_bytes, backpressure: of the :class:`ParquetSink`.

        resume, force: for an existing run of another configuration (:func:`check_run_dir`).

    ``manifest`` exists on every rank; only rank 0 writes it.  The start checks raise (below); after them,
    I/O errors never raise: they are logged once.  The writer holds ``.writer-rank-<rank>.lock`` until
    :meth:`close` (or the process's death).

    Raises:
        UnwritableOutputError, RunConflictError, RunLockedError: at start (:class:`OutputError`).
    """

    def __init__(self, run_dir, attempt: int, rank: int, world_size: int, monitor_config: dict, info: dict,
                 versions: dict, max_queue_bytes: int = 256 << 20, backpressure: str = "block", *,
                 resume: bool = False, force: bool = False):
        import platform
        import socket

        self.run_dir, self.attempt, self.rank = Path(run_dir), int(attempt), int(rank)
        self._warned: set = set()
        self._step_columns: dict = {}
        probe_writable(self.run_dir)
        self._lock = acquire_writer_lock(self.run_dir, self.rank, self.attempt)
        try:
            if force and self.rank == 0:     # moving the run aside moves this lock file with it: lock anew after
                release_writer_lock(self._lock)
                self._lock = None
                old = check_run_dir(self.run_dir, monitor_config, info, resume=resume, force=True, rank=self.rank)
                self._lock = acquire_writer_lock(self.run_dir, self.rank, self.attempt)
            else:
                old = check_run_dir(self.run_dir, monitor_config, info, resume=resume, force=force, rank=self.rank)
        except BaseException:
            release_writer_lock(self._lock)
            raise
        entry = {"attempt": self.attempt, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "host": socket.gethostname(), "pid": os.getpid(), "world_size": int(world_size)}
        #: attempt ids of the run's earlier attempts: a repeated step's files of this rank from them are removed
        #: once this attempt's are written
        self.earlier_attempts = [int(a["attempt"]) for a in (old.attempts if old is not None else [])
                                 if a.get("attempt") is not None and int(a["attempt"]) != self.attempt]
        #: τ_tail an earlier attempt froze (None for a new run or a given τ_tail): the resumed job keeps it
        self.resumed_tau_tail: Optional[float] = (
            old.calibration.get("tau_tail") if old is not None and old.calibration and
            monitor_config.get("tau_tail") is None else None)
        if old is not None:
            _, changed = config_differences(old, monitor_config, info)
            if changed:
                entry["changed"] = {k: list(v) for k, v in changed.items()}
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

        step, n = int(step), batch.num_tokens
        if record_tokens and n:
            # on the caller's thread: only the copies to host (no-ops for CPU tensors); the per-token gathers,
            # casts and constant columns are built on the writer thread (DeferredColumns)
            sid, gid, si, pos = (batch.sample_id.cpu(), batch.group_id.cpu(), batch.sample_index.cpu(),
                                 batch.position.cpu())
            floats = {k: getattr(batch, k).detach().float().cpu() for k in ("learner_logp", "sampler_logp", "advantage")}
            extras = {k: torch.as_tensor(v).detach().float().cpu().reshape(-1) for k, v in (token_extras or {}).items()}
            schema = TOKEN_SCHEMA
            for k in extras:
                schema = schema.append(pa.field(k, pa.float32()))
            rank, attempt = self.rank, self.attempt

            def token_columns() -> dict:
                cols = {"step": np.full(n, step, dtype=np.int64), "rank": np.full(n, rank, dtype=np.int64),
                        "sample_id": sid[si].numpy(), "group_id": gid[si].numpy(),
                        "position": pos.numpy().astype(np.int32)}
                cols.update((k, v.numpy()) for k, v in floats.items())
                cols["attempt"] = np.full(n, attempt, dtype=np.int64)
                cols.update((k, v.numpy()) for k, v in extras.items())
                return cols

            nbytes = n * (8 * 5 + 4 * (4 + len(extras)))
            self.sink.submit("tokens", step, self.rank, DeferredColumns(token_columns, nbytes, n), schema)
        if batch.quarantine_rows is not None:
            qd = {k: v.numpy() for k, v in batch.quarantine_rows.items()}
            m = len(qd["position"])
            qd["reason"] = np.array([INVALID_REASONS[int(c)] for c in qd["reason"]])
            qd.update(step=np.full(m, step, dtype=np.int64), rank=np.full(m, self.rank, dtype=np.int64),
                      attempt=np.full(m, self.attempt, dtype=np.int64))
            self.sink.submit("quarantine", step, self.rank, {f.name: qd[f.name] for f in QUARANTINE_SCHEMA},
                             QUARANTINE_SCHEMA)
        row = {"step": step, "rank": self.rank}
        row.update((k, float(v)) for k, v in metrics.items() if k != "step")
        row["attempt"] = self.attempt
        row["wall_time"] = time.time()
        row["nan_reasons"] = json.dumps(reasons)
        row["writer_dropped_rows"] = float(self.sink.dropped_rows)
        self.sink.submit("steps", step, self.rank, [self._step_row(step, row)])
        for a in self.earlier_attempts:       # a repeated step replaces the earlier attempts' files of this rank
            for table in TABLES:
                self.sink.submit_delete(table, step, self.rank, a)

    def _step_row(self, step: int, row: dict) -> dict:
        """``row`` with every column of this writer's earlier rows (NaN where absent), so that the steps table
        has one schema: the alignment checks of the first steps are NaN later; a key first seen late is warned."""
        cols = self._step_columns
        if not cols:
            cols.update(dict.fromkeys(row))
            cols.update(dict.fromkeys(("alignment_suspect", "alignment_shift", "alignment_ratio")))
        new = [k for k in row if k not in cols]
        if new:
            self._warn_once("columns", "triage-monitor: step %d brings new metric column(s) %s (extra keys not "
                            "passed at the first step): files of the steps/ table differ in columns; "
                            "open_run().steps() unites them, plain readers may take the first file's columns",
                            step, new)
            cols.update(dict.fromkeys(new))
        return {k: row.get(k, math.nan) for k in cols}

    def record_alerts(self, step: int, rows: list) -> None:
        """Queue the alert rows raised at ``step`` (each gets this attempt's id)."""
        if rows:
            self.sink.submit("alerts", step, self.rank, [{**r, "step": int(step), "rank": self.rank,
                                                          "attempt": self.attempt} for r in rows], ALERT_SCHEMA)

    def close(self, status: str, steps_logged: int) -> None:
        """Drain the writer and mark the manifest ``status`` with the writer's counts."""
        self.sink.close()
        self.manifest.status = status
        self.manifest.steps_logged = int(steps_logged)
        self.manifest.writer = {"written_rows": self.sink.written_rows, "dropped_rows": self.sink.dropped_rows,
                                "last_error": self.sink.last_error}
        self.save_manifest()
        release_writer_lock(self._lock)
        self._lock = None

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
