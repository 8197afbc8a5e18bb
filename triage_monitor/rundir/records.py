"""What the monitor puts in a run directory: the tables' declared schemas, :class:`RunWriter` and its start checks.

The run directory's names belong to :mod:`triage_monitor.rundir.layout`; its storage (a local directory or an object
store) to :mod:`triage_monitor.rundir.storage`; the file formats to :mod:`triage_monitor.rundir.blocks`; the manifest to
:mod:`triage_monitor.rundir.manifest`; the writer locks to :mod:`triage_monitor.rundir.locks`; the background writer to
:mod:`triage_monitor.rundir.sink`.  Every table's sealed blocks are readable as a whole by ``pandas.read_parquet(dir)``,
``pyarrow.dataset.dataset(dir)``, DuckDB or Polars, with ``step``, ``rank`` and ``attempt`` int64 columns.

One declared schema per table (docs/metrics.md#run-directory-tables names every column): :data:`TOKEN_SCHEMA`
(plus float32 token extras), :data:`QUARANTINE_SCHEMA`, :data:`ALERT_SCHEMA`, :data:`TIMINGS_SCHEMA` and
:func:`steps_schema` (int64
``step``/``rank``, the float64 metric columns the monitor declares — :func:`triage_monitor.monitor.steps_schema`
— and the extras given at the first step, int64 ``attempt``, float64 ``wall_time``, a string
``nan_reasons``).  ``attempt`` (nanoseconds since the epoch at monitor start, shared by the ranks of one job
start) is in the names and a column: a job resumed from a checkpoint writes a repeated step under its newer
attempt; the earlier attempt's records of that step stay in its blocks, and readers keep each step's latest
attempt (``analysis.open_run``; with plain pandas ``df[df.attempt == df.groupby("step").attempt.transform("max")]``,
docs/metrics.md#reading-a-run-with-other-tools).

Writes happen on a background thread behind a queue bounded in bytes; once started, the writer never raises
into the training loop: it counts, warns once and degrades (:class:`~triage_monitor.rundir.sink.ParquetSink`).  What
can be checked before training does raise, at start (:class:`RunWriter`, :class:`OutputError`): an unwritable
directory, a directory that holds a run of another configuration, a second live writer of the same rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence, TypedDict

import numpy as np
import pyarrow as pa

from ..errors import OutputError, RunConflictError, RunLockedError, UnwritableOutputError  # noqa: F401  (raised here)
from .layout import MANIFEST, RunLayout
from .locks import acquire_writer_lock, probe_lock, release_writer_lock
from .storage import TEMP_PREFIX, Store, open_store
from .manifest import (IDENTITY_KEYS, IO_CONFIG_KEYS, ManifestError, RunManifest, json_text,  # noqa: F401
                       check_monitor_config, config_differences, describe_differences, read_manifest)
from .blocks import constant_column
from .sink import WAIT_TIMEOUT_S, DeferredColumns, ParquetSink
from ..metrics.timings import COLUMNS as TIME_COLUMN, TIME_COLUMNS

#: the writer's messages (locks, files, manifest) share one logger name
log = logging.getLogger("triage_monitor.records")

#: Columns every token file has (``token_extras`` add float32 columns after them).
TOKEN_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()),
    ("sample_id", pa.int64()), ("group_id", pa.int64()), ("position", pa.int32()),
    ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()), ("advantage", pa.float32()),
    ("attempt", pa.int64()),
])
#: Token columns held as dictionaries in memory on the writer thread (records.RunWriter.record_step): the same
#: int64 columns on disk.
DICTIONARY_TOKEN_COLUMNS = ("step", "rank", "sample_id", "group_id", "attempt")
#: Columns of the alerts table (one row per fired rule: ``alerts.Alert.to_row()`` plus rank and attempt).
ALERT_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("rule", pa.string()), ("metric", pa.string()),
    ("value", pa.float64()), ("threshold", pa.float64()), ("window", pa.int64()), ("level", pa.string()),
    ("title", pa.string()), ("text", pa.string()), ("attempt", pa.int64()), ("tier", pa.string()),
])
#: Columns of the quarantine table (docs/reliability.md): the excluded tokens and why.
QUARANTINE_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("sample_id", pa.int64()), ("position", pa.int64()),
    ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()), ("advantage", pa.float32()),
    ("reason", pa.string()), ("attempt", pa.int64()),
])
#: Columns of the timings table: phase timings (and the framework's reward) that reached the run after their step's
#: row was written (a framework's driver-side timers and reward, docs/hooks.md#phase-timings), one row per step and
#: writer; readers fill the steps table's ``time/<phase>`` and ``reward`` columns the row left NaN
#: (``analysis.Run.steps``).
TIMINGS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()),
    *((c, pa.float64()) for c in TIME_COLUMNS), ("reward", pa.float64()),
    ("framework", pa.string()), ("framework_step", pa.int64()), ("attempt", pa.int64()), ("wall_time", pa.float64()),
])
#: The bookkeeping columns of the steps table around its metric columns.
STEPS_HEAD = (("step", pa.int64()), ("rank", pa.int64()))
STEPS_TAIL = (("attempt", pa.int64()), ("wall_time", pa.float64()), ("nan_reasons", pa.string()))
#: Their names: the writer's, never a metric column.
BOOKKEEPING_COLUMNS = frozenset(n for n, _ in STEPS_HEAD + STEPS_TAIL)


def steps_schema(metric_columns: Sequence[str]) -> pa.Schema:
    """The steps table's schema for the float64 ``metric_columns`` (in order): int64 ``step`` and ``rank``, the
    metric columns, int64 ``attempt``, float64 ``wall_time`` (seconds since the epoch) and the string
    ``nan_reasons`` (JSON ``{metric: why NaN}``).

    Raises:
        ValueError: a metric column is named like a bookkeeping column or given twice."""
    names = list(metric_columns)
    bad = sorted({n for n in names if n in BOOKKEEPING_COLUMNS or names.count(n) > 1})
    if bad:
        raise ValueError(f"steps metric columns {bad} are bookkeeping columns or given twice")
    return pa.schema([*STEPS_HEAD, *((n, pa.float64()) for n in names), *STEPS_TAIL])


def table_schemas(steps: pa.Schema) -> dict[str, pa.Schema]:
    """``{table: schema}`` of the five tables (:data:`~triage_monitor.rundir.layout.TABLES`), with ``steps`` as given
    (:func:`triage_monitor.monitor.steps_schema`); token extras are not included."""
    return {"tokens": TOKEN_SCHEMA, "steps": steps, "quarantine": QUARANTINE_SCHEMA, "alerts": ALERT_SCHEMA,
            "timings": TIMINGS_SCHEMA}


def timings_row(step: int, rank: int, attempt: int, times: dict, framework: Optional[str] = None,
                framework_step: Optional[int] = None, reward: Optional[float] = None) -> dict[str, Any]:
    """One row of the timings table (:data:`TIMINGS_SCHEMA`): ``times`` (``{phase or "step": seconds}``) in the
    ``time/<phase>`` columns, NaN where absent; ``reward`` the framework's reward of the step (NaN when not given);
    ``framework`` the timers' framework ("" when not said), ``framework_step`` the framework's own step number (-1
    when not said).

    Raises:
        KeyError: a key of ``times`` that is not a phase (nor ``"step"``)."""
    row: dict[str, Any] = {"step": int(step), "rank": int(rank)}
    row.update((c, math.nan) for c in TIME_COLUMNS)
    for phase, v in times.items():
        row[TIME_COLUMN[phase]] = float(v)
    row["reward"] = math.nan if reward is None else float(reward)
    row.update(framework=framework or "", framework_step=-1 if framework_step is None else int(framework_step),
               attempt=int(attempt), wall_time=time.time())
    return row


class _AttemptStart(TypedDict):
    """The keys every attempt entry of run.json has (:class:`AttemptEntry`)."""

    attempt: int
    started: str
    host: str
    pid: int
    world_size: int


class AttemptEntry(_AttemptStart, total=False):
    """One entry of run.json's ``attempts``, written by :class:`RunWriter` at a writer's start (``changed``: the
    configuration keys a resumed attempt changed, ``{key: [old, new]}``)."""

    changed: dict[str, list[Any]]


def check_writer_options(where: str, *, rank=None, attempt=None, resume=False, force=False) -> None:
    """The options of a run's writer (``MismatchMonitor``, a hook's ``HookSettings``), checked with the readers'
    rules before anything is written: ``rank`` and ``attempt`` None or integers from 0 to 2**63 - 1 (the file
    names' and run.json's int64 fields), ``resume`` and ``force`` booleans.

    Raises:
        TypeError: a value of the wrong type, naming ``<where>.<option>``.
        ValueError: an integer out of range, naming ``<where>.<option>``."""
    for name, v in (("rank", rank), ("attempt", attempt)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{where}: {name} must be an integer from 0 to 2**63 - 1, got {v!r} "
                            f"({type(v).__name__})")
        if not 0 <= int(v) <= 2 ** 63 - 1:
            raise ValueError(f"{where}: {name} must be an integer from 0 to 2**63 - 1 (readers refuse other values "
                             f"in file names and run.json), got {int(v)}")
    for name, v in (("resume", resume), ("force", force)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{where}: {name} must be True or False, got {v!r} ({type(v).__name__}): a string such "
                            f"as 'no' would count as true")


#: Seconds run.json and the lock's release get at a :meth:`RunWriter.close` whose writer used up its bound.
CLOSE_GRACE_S = 5.0


def _bounded(fn, timeout: Optional[float]) -> bool:
    """Run ``fn()`` on a daemon thread and wait at most ``timeout`` seconds (None: no bound); True when it
    returned (its exceptions are its own to handle) within the bound."""
    import threading

    t = threading.Thread(target=fn, name="triage-monitor-close", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def new_attempt_id() -> int:
    """A sortable attempt id: nanoseconds since the epoch."""
    return time.time_ns()


# ------------------------------------------------------------------------------------------ start checks
def probe_writable(path) -> Store:
    """Create the run directory ``path`` (a location or its :class:`~triage_monitor.rundir.storage.Store`; on an object
    store there is nothing to create) and write + remove a hidden probe file in it.

    Returns:
        its :class:`~triage_monitor.rundir.storage.Store`.

    Raises:
        UnwritableOutputError: naming the location and the reason (read-only file system, permission denied,
            a parent that is a regular file, a bucket that does not exist or refuses the credentials, ...).
        UnsupportedLocationError: a URI scheme that is not supported (a ValueError naming it).
    """
    store = path if isinstance(path, Store) else open_store(path)
    probe = f"{TEMP_PREFIX}probe-{uuid.uuid4().hex}"
    try:
        store.makedirs("")
        if store.is_local:                  # the OS's own error (and the probe's name) when it fails
            store.local(probe).write_bytes(b"")
        else:
            store.write_bytes(probe, b"")
        store.delete(probe)
    except OSError as exc:
        where = store.display()
        if store.is_local:
            reason = exc.strerror or str(exc)
            extra = f" ({exc.filename})" if exc.filename and Path(exc.filename) != Path(where) else ""
        else:
            reason, extra = str(exc), ""
        raise UnwritableOutputError(f"{where}: cannot write the output directory: {reason}{extra}",
                                    where if not store.is_local else Path(where)) from exc
    return store


def _move_aside(p: Path) -> Path:
    """Rename run directory ``p`` to a new sibling ``<name>.replaced-<UTC time>[-n]`` and recreate ``p`` empty."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    layout = RunLayout(p)
    dest, n = layout.replaced(stamp), 1
    while dest.exists():
        dest, n = layout.replaced(stamp, n), n + 1
    os.rename(p, dest)
    p.mkdir()
    return dest


def check_run_dir(run_dir, monitor_config: dict, info: dict, *, resume: bool = False, force: bool = False,
                  rank: int = 0) -> Optional[RunManifest]:
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
        The existing run's :class:`~triage_monitor.rundir.manifest.RunManifest` to continue, or None for a new run.

    Raises:
        UnwritableOutputError: the directory cannot be created or written.
        RunConflictError: another configuration, an unreadable run.json or one with a field of the wrong type
            or out of range (:class:`~triage_monitor.rundir.manifest.ManifestError`); the message names the differing
            keys or the field, and the way out.
        RunLockedError: ``force`` while a process is writing the run.
    """
    store = probe_writable(run_dir)
    layout = RunLayout(store)
    p = layout.display
    if force:                # rank 0 moves an existing run aside; the other ranks follow it without a check
        if rank == 0 and layout.holds_run():
            if not store.is_local:
                raise UnwritableOutputError(f"{p} holds a run, and force=True cannot move a run aside on an object "
                                            "store (no rename): delete it with your store's tools, or write to "
                                            "another prefix", p)
            for lock in layout.lock_files():
                probe_lock(layout.root / lock)
            dest = _move_aside(layout.root)
            log.warning("triage-monitor: --force: the run that was in %s is now in %s; a new run starts", p, dest)
        return None
    if not store.exists(MANIFEST):
        return None
    name = p.rstrip("/").rsplit("/", 1)[-1]
    way_out = (f"write to a new directory, or start over with --force / force=True (the old run is moved to "
               f"{name}.replaced-<time>)" if store.is_local else
               "write to a new location (an object store's run is not moved aside: delete it with the store's tools)")
    try:
        old = read_manifest(layout)
    except ManifestError as exc:            # a field of the wrong type or out of range, named with the file
        raise RunConflictError(f"{p} holds a run whose {MANIFEST} has an invalid field ({exc}): {way_out}", p) \
            from exc
    except (OSError, ValueError) as exc:
        raise RunConflictError(f"{p} holds a run whose {MANIFEST} is unreadable ({exc}): {way_out}", p) from exc
    metric, identity = config_differences(old, monitor_config, info)
    if metric:
        raise RunConflictError(f"{p} holds a run with another metric configuration ({describe_differences(metric)}); "
                               f"one run uses one (offline recomputation and windows span its attempts): {way_out}",
                               p, {**metric, **identity})
    if identity and not resume:
        raise RunConflictError(f"{p} holds another run ({describe_differences(identity)}): continue it as a new "
                               f"attempt with --resume / resume=True (the changes are recorded in run.json's "
                               f"attempt), or {way_out}", p, identity)
    return old


class RunWriter:
    """Everything the monitor puts on disk: the manifest (rank 0 writes it) and the records of each step.

    Args:
        run_dir: the run directory (a local path, ``file://`` or ``s3://`` URI); an existing run of the same
            configuration is continued as a new attempt (its manifest kept), another one is refused
            (:func:`check_run_dir`).
        attempt: this process start's attempt id (shared by all ranks).
        rank, world_size: this process's rank and the job's size.
        monitor_config: ``MonitorConfig.to_dict()`` (its ``roll_steps`` / ``roll_bytes`` size the blocks).
        info: facts for ``RunManifest.info`` (merged into an existing run's).
        versions: ``{"tool_version", "python", "torch"}`` for a new manifest.
        max_queue_bytes, backpressure: of the :class:`~triage_monitor.rundir.sink.ParquetSink`.

        resume, force: for an existing run of another configuration (:func:`check_run_dir`).

    ``manifest`` exists on every rank; only rank 0 writes it.  The steps table's schema is declared once
    (:meth:`declare_steps`; the monitor declares it at its first step from the metrics and the extras of that
    step) or, when nobody declares it, taken from the first row's keys.  The start checks raise (below); after
    them, I/O errors never raise: they are logged once.  The writer holds its rank's writer lock (a lease on an
    object store, :mod:`triage_monitor.rundir.locks`) until :meth:`close` (or the process's death).  A continued run's
    pending files that earlier attempts of this rank left (a killed job) are sealed first, on the writer thread.

    Raises:
        ManifestError: (a ValueError) ``monitor_config`` holds a value its run.json could not be read back with
            (:func:`~triage_monitor.rundir.manifest.check_monitor_config`: a window above 2**63 - 1, a non-integral
            window, a non-finite τ_tail, ...), before anything is written.
        UnwritableOutputError, RunConflictError, RunLockedError: at start (:class:`OutputError`).
        UnsupportedLocationError: a URI scheme that is not supported (a ValueError naming it).
    """

    def __init__(self, run_dir, attempt: int, rank: int, world_size: int, monitor_config: dict, info: dict,
                 versions: dict, max_queue_bytes: int = 256 << 20, backpressure: str = "block", *,
                 resume: bool = False, force: bool = False):
        import platform
        import socket

        check_monitor_config(monitor_config, "MonitorConfig")   # what run.json will hold must read back
        self.attempt, self.rank = int(attempt), int(rank)
        self.store = probe_writable(run_dir)
        self.layout = RunLayout(self.store)
        #: the run directory as a user names it (a local path, or the URI)
        self.run_dir = self.layout.display
        self._warned: set = set()
        #: the steps table's schema (None until declared or until the first row)
        self.steps_schema: Optional[pa.Schema] = None
        self._steps_names: Optional[frozenset] = None
        self._lock = acquire_writer_lock(self.store, self.rank, self.attempt)
        try:
            if force and self.rank == 0 and self.store.is_local:   # moving the run aside moves this lock file with
                release_writer_lock(self._lock)                     # it: lock anew after
                self._lock = None
                old = check_run_dir(self.store, monitor_config, info, resume=resume, force=True, rank=self.rank)
                self._lock = acquire_writer_lock(self.store, self.rank, self.attempt)
            else:
                old = check_run_dir(self.store, monitor_config, info, resume=resume, force=force, rank=self.rank)
        except BaseException:
            release_writer_lock(self._lock)
            raise
        entry: AttemptEntry = {"attempt": self.attempt, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "host": socket.gethostname(), "pid": os.getpid(), "world_size": int(world_size)}
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
        self.sink = ParquetSink(self.store, self.attempt, max_queue_bytes, backpressure,
                                roll_steps=int(monitor_config.get("roll_steps", 50)),
                                roll_bytes=int(monitor_config.get("roll_bytes", 1 << 30)))
        lease = self._lock
        self.sink.taken_over = lambda: getattr(lease, "taken_over_by", None) is not None
        if any(a["attempt"] != self.attempt for a in self.manifest.attempts if a.get("attempt") is not None):
            self.sink.submit_recover(self.rank)   # a killed earlier attempt's open blocks: sealed before our steps

    def save_manifest(self) -> bool:
        """Write run.json (rank 0 only); an OSError is reported once and monitoring continues.  Returns False when
        it could not be written."""
        if self.rank != 0:
            return True
        try:
            self.manifest.write(self.layout)
        except OSError as exc:
            self._warn_once("manifest", "triage-monitor could not write %s (%s); monitoring continues",
                            self.store.display(MANIFEST), exc)
            return False
        return True

    def save_calibration(self, tau_tail: float, step: int) -> None:
        """Record the frozen τ_tail (nats) and the step it froze at, so a resumed job keeps it.  run.json is
        written on the writer thread, after the steps queued before (the training thread never waits on storage
        here: a frozen store or a hung mount delays the file, not the step)."""
        self.manifest.calibration = {"tau_tail": float(tau_tail), "frozen_at_step": int(step), "attempt": self.attempt}
        if self.rank == 0:
            data = json_text(self.manifest.to_dict()).encode()      # the manifest as of now, off this thread

            def write():
                try:
                    self.layout.store.write_bytes(MANIFEST, data)
                except OSError as exc:           # said once, as every run.json write (save_manifest)
                    self._warn_once("manifest", "triage-monitor could not write %s (%s); monitoring continues",
                                    self.store.display(MANIFEST), exc)

            self.sink.submit_task(write, MANIFEST)

    def declare_steps(self, schema: pa.Schema) -> None:
        """Declare the steps table's schema (:func:`steps_schema`) before the first row; a later declaration is
        ignored (one run, one schema)."""
        if self.steps_schema is None:
            self.steps_schema = schema

    def record_step(self, step: int, batch, metrics: dict, reasons: dict, token_extras: Optional[dict],
                    record_tokens: bool = True, steps_row: bool = True, alerts: Optional[list] = None) -> None:
        """Queue the step's records: the token rows (``record_tokens``; a step without valid tokens has none and is
        not in the tokens table, so offline recomputation never sees it), the quarantined rows, the metric row (``steps_row``: False for a rank other than 0 of a
        synchronised job, whose row would repeat rank 0's) and the alert rows (``alerts``: the rows fired at the
        step; ``[]`` or None: none).

        ``metrics``: ``{name: number}`` (``step`` ignored), written as float64; a declared column the step lacks
        is NaN; ``reasons``: ``{metric: why NaN}``, written as JSON."""
        import torch

        from ..batch import INVALID_REASONS

        step, n = int(step), batch.num_tokens
        if record_tokens and n:
            # on the caller's thread: only the copies to host (no-ops for CPU tensors); the per-token gathers,
            # casts and constant columns are built on the writer thread (DeferredColumns)
            host = batch.host()          # one copy a step, shared with the metrics (TokenBatch.host)
            sid, gid, si, pos = host.sample_id, host.group_id, host.sample_index, host.position
            floats = {k: getattr(host, k) for k in ("learner_logp", "sampler_logp", "advantage")}
            extras = {k: torch.as_tensor(v).detach().float().cpu().reshape(-1) for k, v in (token_extras or {}).items()}
            schema = TOKEN_SCHEMA
            for k in extras:
                schema = schema.append(pa.field(k, pa.float32()))
            rank, attempt = self.rank, self.attempt

            def token_columns() -> pa.Table:
                # the per-sample and constant columns as dictionary columns (written as the int64 columns they
                # stand for, blocks.parquet_options): step, rank and attempt one byte a token
                # (blocks.constant_column), sample_id and group_id the token's sample index into the per-sample ids
                # (one int32 array for both); the others as the schema's types
                index = pa.array(si.numpy().astype(np.int32))
                sids, gids = pa.array(sid.numpy()), pa.array(gid.numpy())
                zeros = pa.array(np.zeros(n, np.int8))          # the constant columns' one shared index array
                cols = {"step": constant_column(step, n, zeros), "rank": constant_column(rank, n, zeros),
                        "sample_id": pa.DictionaryArray.from_arrays(index, sids),
                        "group_id": pa.DictionaryArray.from_arrays(index, gids),
                        "position": pos.numpy().astype(np.int32)}
                cols.update((k, v.numpy()) for k, v in floats.items())
                cols["attempt"] = constant_column(attempt, n, zeros)
                cols.update((k, v.numpy()) for k, v in extras.items())
                return pa.table(cols, schema=pa.schema([pa.field(f.name, cols[f.name].type) if f.name in
                                                        DICTIONARY_TOKEN_COLUMNS else f for f in schema]))

            nbytes = n * (1 + 4 + 4 * (4 + len(extras)))      # the shared one-byte and int32 indices, 4-byte columns
            self.sink.submit("tokens", step, self.rank, DeferredColumns(token_columns, nbytes, n))
        if batch.quarantine_rows is not None:
            qd = {k: v.numpy() for k, v in batch.quarantine_rows.items()}
            m = len(qd["position"])
            qd["reason"] = np.array([INVALID_REASONS[int(c)] for c in qd["reason"]])
            qd.update(step=np.full(m, step, dtype=np.int64), rank=np.full(m, self.rank, dtype=np.int64),
                      attempt=np.full(m, self.attempt, dtype=np.int64))
            self.sink.submit("quarantine", step, self.rank, {f.name: qd[f.name] for f in QUARANTINE_SCHEMA},
                             QUARANTINE_SCHEMA)
        if steps_row:
            row: dict[str, Any] = {"step": step, "rank": self.rank}
            row.update((k, float(v)) for k, v in metrics.items() if k != "step")
            row["attempt"] = self.attempt
            row["wall_time"] = time.time()
            row["nan_reasons"] = json.dumps(reasons)
            row["writer_dropped_rows"] = float(metrics.get("writer_dropped_rows", self.sink.dropped_rows))
            self.sink.submit("steps", step, self.rank, [self._step_row(step, row)], self.steps_schema)
        if alerts:
            self.record_alerts(step, alerts)

    def record_alerts(self, step: int, rows: list) -> None:
        """Queue the alert rows raised at ``step`` (each gets this writer's rank and attempt id; none: nothing)."""
        if not rows:
            return
        self.sink.submit("alerts", step, self.rank, [{**r, "step": int(step), "rank": self.rank,
                                                      "attempt": self.attempt} for r in rows], ALERT_SCHEMA)

    def record_timings(self, step: int, times: dict, framework: Optional[str] = None,
                       framework_step: Optional[int] = None, reward: Optional[float] = None) -> None:
        """Queue a row of the timings table: ``step``'s phase timings (``{phase or "step": seconds}``,
        :func:`triage_monitor.metrics.timings.phase_times`' output) and reward that arrived after its steps row was written."""
        row = timings_row(step, self.rank, self.attempt, times, framework, framework_step, reward)
        self.sink.submit("timings", step, self.rank, [row], TIMINGS_SCHEMA)

    def _step_row(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with every column of the steps schema (NaN where absent), so that the steps table has one
        schema: the alignment checks of the first steps are NaN later.  Undeclared, the schema is the first row's
        keys; a key first seen late is warned and added to the schema (later blocks carry it)."""
        if self.steps_schema is None:
            self.steps_schema = steps_schema([k for k in row if k not in BOOKKEEPING_COLUMNS])
        names = self._steps_names
        if names is None or len(names) != len(self.steps_schema):
            names = self._steps_names = frozenset(self.steps_schema.names)   # not a list rebuilt for every key
        new = [k for k in row if k not in names]
        if new:
            self._warn_once("columns", "triage-monitor: step %d brings new metric column(s) %s (extra keys not "
                            "passed at the first step): files of the steps/ table differ in columns; "
                            "open_run().steps() unites them, plain readers may take the first file's columns",
                            step, new)
            for k in new:
                self.steps_schema = self.steps_schema.append(pa.field(k, pa.float64()))
        return {k: row.get(k, math.nan) for k in self.steps_schema.names}

    def close(self, status: str, steps_logged: int, timeout: Optional[float] = WAIT_TIMEOUT_S) -> bool:
        """Drain the writer, seal its blocks and mark the manifest ``status`` with the writer's counts, within
        ``timeout`` seconds in all (default :data:`~triage_monitor.rundir.sink.WAIT_TIMEOUT_S`; None: no bound).

        At the bound (a frozen store, a hung mount) what is still queued is counted as dropped
        (:meth:`ParquetSink.close`) and run.json's ``writer`` says so (``dropped_rows``, ``unwritten_at_close``,
        ``close_timed_out``); run.json and the lock's release get what is left of the bound (at least
        :data:`CLOSE_GRACE_S` seconds) on a thread of their own, and when that passes too run.json keeps saying
        ``running`` (readers report such a run as incomplete) and one ERROR line says so.

        Returns:
            True when everything queued was written and run.json updated; False otherwise."""
        start = time.monotonic()
        drained = self.sink.close(timeout)
        self.manifest.status = status
        self.manifest.steps_logged = int(steps_logged)
        self.manifest.writer = {"written_rows": self.sink.written_rows, "dropped_rows": self.sink.dropped_rows,
                                "last_error": self.sink.last_error}
        if not drained:
            self.manifest.writer.update(close_timed_out=True, unwritten_at_close=self.sink.abandoned_rows)
        lock, self._lock = self._lock, None
        saved = [True]

        def finish():
            try:
                newer = self._newer_writer(lock)
                if newer:
                    self._warn_once("superseded", "triage-monitor: %s is not rewritten at close: %s",
                                    self.store.display(MANIFEST), newer)
                else:
                    saved[0] = self.save_manifest()
                release_writer_lock(lock)
            except Exception as exc:  # noqa: BLE001 — e.g. the S3 client finalized at exit under a hung request
                self._warn_once("close", "triage-monitor: closing %s failed (%s: %s)", self.run_dir,
                                type(exc).__name__, exc)

        left = None if timeout is None else max(timeout - (time.monotonic() - start), CLOSE_GRACE_S)
        done = _bounded(finish, left)
        if not done:
            log.error("triage-monitor: %s could not be written within close()'s bound (a frozen or slow store?): "
                      "it still says the run is running; the run's records end where the writer stopped",
                      self.store.display(MANIFEST))
        return drained and done and saved[0]

    def _newer_writer(self, lock) -> str:
        """Why run.json is no longer this writer's to rewrite ("" when it is): another writer took the rank over
        (the lease), or run.json lists a later attempt (a resumed job started meanwhile).  Rank 0 only."""
        if self.rank != 0:
            return ""
        held = getattr(lock, "taken_over_by", None)
        if held is not None:
            return f"another writer took this rank over ({held})"
        try:
            now = read_manifest(self.layout)
        except Exception:  # noqa: BLE001 — unreadable or gone: ours is written
            return ""
        later = [a.get("attempt") for a in now.attempts if (a.get("attempt") or 0) > self.attempt]
        return f"it lists a later attempt ({later[-1]}), whose run.json it is" if later else ""

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
