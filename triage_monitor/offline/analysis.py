"""Offline analysis of a run directory: open, stream steps, recompute metrics.

Everything offline (CLI tables, the static report, the dashboard, alert
replay) reads runs through this module.  Metrics are recomputed with the very
code the live monitor used (:class:`~triage_monitor.metrics.MetricTracker`),
so ``recompute(run)`` reproduces the live per-step values.

    run = open_run("runs/demo")
    live = run.steps()                 # live metric rows, one per step
    again = recompute(run)             # from the token Parquet files alone
    batch = run.token_batch(step=10)   # a TokenBatch, for drill-downs
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
from functools import cached_property
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..alerting.alert_rules import default_rules
from ..rundir.blocks import forget_shared_groups, read_part
from ..errors import TriageMonitorError
from ..rundir.layout import DENSE_TABLES, MANIFEST, TABLES, Part, RunLayout, TableIndex
from ..rundir.manifest import ManifestError, RunManifest, read_manifest
from ..rundir.storage import Store, open_store, store_identity
from ..metrics import names
from ..metrics.timings import TIME_COLUMNS

if TYPE_CHECKING:              # numba-compiled module: imported where the metrics are computed
    from ..metrics.state_kernel import NullInput

log = logging.getLogger("triage_monitor.analysis")

# the metric code (metrics, state_kernel: numba) is imported inside the functions that need it, so that reading
# step-level data (Run.steps, the dashboard's first charts) does not pay for it; nothing on the offline path
# imports torch (only Run.token_batch, which builds a TokenBatch).


class RunDirError(TriageMonitorError, ValueError):
    """The path is not a readable run directory (the message says why)."""


class RunReadError(RunDirError, OSError):
    """The run's location could not be read: the operating system or the store refused or timed out (a frozen
    object store, a permission) — an I/O error (exit 3 in the commands), not a wrong path."""


class RunSignature(NamedTuple):
    """What :func:`run_signature` reads of a run directory (a cache key: compares and hashes as the plain tuple)."""

    manifest_mtime_ns: Optional[int]
    steps_files: int
    newest_steps_mtime_ns: int
    steps_bytes: int


def run_signature(path) -> RunSignature:
    """``(manifest mtime_ns or None, number of steps files, newest steps file mtime_ns, their bytes)`` of the run
    directory ``path``: it changes whenever the run gains step records or its manifest is rewritten (the
    dashboard's cache key).  Never raises: what cannot be read counts as absent."""
    try:
        store = open_store(path)
    except (ValueError, OSError):
        return RunSignature(None, 0, 0, 0)
    try:
        info = store.info(MANIFEST)
        man = info.mtime_ns if info.type.name == "File" else None
    except OSError:
        man = None
    try:
        entries = store.listdir("steps")
    except OSError:
        entries = []
    return RunSignature(man, len(entries), max((e.mtime_ns for e in entries), default=0),
                        sum(e.size for e in entries))


class RunLocation(str):
    """The location of a run on an object store as users name it (``s3://bucket/runs/a``): a string with the
    ``name`` and ``parent`` of its path, as a local run's ``Path`` has."""

    @property
    def _posix(self) -> PurePosixPath:
        return PurePosixPath(self.split("?", 1)[0].split("://", 1)[-1])

    @property
    def name(self) -> str:
        return self._posix.name

    @property
    def parent(self) -> PurePosixPath:
        return self._posix.parent


class StepSource(NamedTuple):
    """Where one step's records of one table are: the run's location and the files to read, one per rank
    (:meth:`~triage_monitor.rundir.layout.TableIndex.for_step`).  Plain data: it travels to worker processes and Ray."""

    location: str
    step: int
    parts: tuple

    def hint(self) -> str:
        """A name for messages: the first file."""
        return f"{self.location}/{self.parts[0].name}" if self.parts else self.location


def _store(location: str) -> Store:
    """One :class:`~triage_monitor.rundir.storage.Store` per store and process (an object store's client is reused),
    keyed by its :func:`~triage_monitor.rundir.storage.store_identity` (endpoint, region, credentials, bucket/prefix), not
    by the URI alone: the same URI under another ``AWS_ENDPOINT_URL`` is another store."""
    return _store_of(location, store_identity(location))


@functools.lru_cache(maxsize=16)
def _store_of(location: str, identity: tuple) -> Store:
    return open_store(location)


class Run:
    """A run directory opened for reading (see :func:`open_run`).

    Attributes:
        path: the run directory: a ``Path`` (local), or a :class:`RunLocation` (an ``s3://`` URI).
        layout: its :class:`~triage_monitor.rundir.layout.RunLayout`.
        unreadable: ``[(path, reason), ...]`` (both str) of every table file a read of this object found
            corrupt or unreadable (truncated Parquet, no permission, a column missing) and skipped, in the
            order found; each is also logged once as a WARNING.  Reads fill it as they go: after ``steps()``
            it names the bad ``steps/`` files, after ``tokens(s)`` the bad token files of step ``s``.

    The tables' indexes (one listing of each table directory) are taken once per object; a run being written
    gains steps that a new :func:`open_run` sees.
    """

    def __init__(self, path) -> None:
        #: the run directory's names (:class:`~triage_monitor.rundir.layout.RunLayout`)
        self.layout = RunLayout(path)
        self.path = self.layout.root if self.layout.is_local else RunLocation(self.layout.display)
        self.unreadable: list[tuple[str, str]] = []
        self._indexes: dict[str, TableIndex] = {}
        self._attempts: Optional[dict[int, int]] = None

    @property
    def store(self) -> Store:
        return self.layout.store

    def refresh(self) -> None:
        """Forget the tables' listings: the next read lists them again (a run being written has gained steps)."""
        self._indexes.clear()
        self._attempts = None

    def _skip_unreadable(self, f, reason: str) -> None:
        """Record ``f`` in :attr:`unreadable` (once) and log a WARNING naming it."""
        if any(p == str(f) for p, _ in self.unreadable):
            return
        self.unreadable.append((str(f), reason))
        log.warning("triage-monitor: skipped unreadable file %s (%s)", f, reason)

    def _read(self, part: Part, columns: Optional[Sequence[str]] = None,
              step: Optional[int] = None) -> Optional[pa.Table]:
        """The rows of ``part`` (only those of ``step``), or None (recorded in :attr:`unreadable`) when it fails."""
        try:
            return read_part(self.store, part, columns, step)
        except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
            self._skip_unreadable(self.store.display(part.name), f"{type(exc).__name__}: {exc}")
            return None

    def index(self, table: str) -> TableIndex:
        """The :class:`~triage_monitor.rundir.layout.TableIndex` of ``table`` (listed once per object)."""
        if table not in self._indexes:
            self._indexes[table] = self.layout.index(table)
        return self._indexes[table]

    def step_attempts(self) -> dict[int, int]:
        """``{step: attempt}``: each step's latest attempt over the tokens and steps tables
        (:meth:`~triage_monitor.rundir.layout.RunLayout.step_attempts`): the attempt whose alert and quarantine rows a
        reader takes.  The tokens and the steps rows of a step are each their own table's latest attempt (a
        resumed job whose token writes failed keeps the earlier attempt's tokens of the step)."""
        if self._attempts is None:
            self._attempts = self.layout.step_attempts({t: self.index(t) for t in ("tokens", "steps")})
        return self._attempts

    @cached_property
    def manifest(self) -> RunManifest:
        """The run's :class:`~triage_monitor.rundir.manifest.RunManifest` (``run.json``)."""
        return read_manifest(self.layout)

    @cached_property
    def config(self):
        """The :class:`~triage_monitor.monitor.MonitorConfig` the live monitor used (window, calibration steps,
        metric thresholds, a given τ_tail); the documented defaults for what the manifest lacks."""
        from ..config import MonitorConfig

        return MonitorConfig.from_dict(self.manifest.monitor_config, strict=False)   # a newer release's keys: ignored

    @property
    def tau_tail(self) -> Optional[float]:
        """The run's one τ_tail (nats): the given one, else the calibrated one; None before calibration."""
        return self.manifest.tau_tail

    def metric_config(self):
        """The :class:`~triage_monitor.metrics.MetricConfig` the live monitor used (``self.config.metrics``)."""
        return self.config.metrics

    def step_numbers(self) -> list[int]:
        """Sorted steps that have token records (a step logged without valid tokens included)."""
        return self.index("tokens").steps()

    def token_source(self, step: int) -> StepSource:
        """The :class:`StepSource` of the step's token records (latest attempt, one file per rank).

        Raises:
            KeyError: the step has no token records."""
        parts = self.index("tokens").for_step(step)
        if not parts:
            raise KeyError(f"step {step} has no token records in {self.path}")
        return StepSource(self.layout.location, int(step), tuple(parts))

    def tokens(self, step: int, columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
        """Token rows of one step (all ranks, latest attempt) as a DataFrame, sorted by (sample_id, rank, position):
        a response is the rows of one (rank, sample_id), contiguous even where two ranks reuse a sample id.

        ``columns``: only these (a ``rank`` column is always there). A rank file that cannot be read is skipped
        and named in :attr:`unreadable` (with a WARNING).

        Raises:
            KeyError: the step has no token records, or none of its token files is readable.
        """
        src = self.token_source(step)
        tables = []
        for f in src.parts:
            t = self._read(f, columns, src.step)
            if t is None:
                continue
            if "rank" not in t.column_names:      # columns= without it: the rank of the file's name
                t = t.append_column("rank", pa.array([f.rank] * t.num_rows, pa.int64()))
            tables.append(t)
        if not tables:
            raise KeyError(f"step {step}: every token file is unreadable "
                           f"({', '.join(self.store.display(f.name) for f in src.parts)})")
        df = pa.concat_tables(tables, promote_options="default").to_pandas()
        sort = [c for c in ("sample_id", "rank", "position") if c in df.columns]
        return df.sort_values(sort, kind="stable").reset_index(drop=True)

    def token_files(self, step: int) -> list[str]:
        """The step's token files of its latest attempt (their locations, str), one per rank, by rank; a block
        file holds the step among others."""
        return [self.store.display(f.name) for f in self.token_source(step).parts]

    def token_batch(self, step: int, rank: Optional[int] = None):
        """The step's valid tokens as a :class:`~triage_monitor.batch.TokenBatch` (float32 values exactly as recorded).

        A response is keyed by (rank, sample_id): ranks that reuse sample ids (the default ids 0 … B−1 of
        ``from_padded`` on every rank) stay separate responses.  ``batch.sample_id`` is the recorded id while no
        two of the step's ranks share one (a one-rank run; hooks that pass global ids); otherwise the responses
        are numbered 0 … S−1 in (sample_id, rank) order.  :meth:`responses` gives each response's rank and
        recorded id either way.  ``rank``: that rank's tokens only (its recorded ids).

        Raises:
            KeyError: the step has no token records (of ``rank``), or none is readable.
        """
        import torch

        from ..batch import TokenBatch

        df = self._batch_tokens(step, rank)
        t = {c: torch.as_tensor(df[c].to_numpy().copy()) for c in ("learner_logp", "sampler_logp", "advantage",
                                                                      "position", "group_id")}
        ids = torch.from_numpy(np.array(_response_ids(df)[1], dtype=np.int64))
        return TokenBatch.from_flat(t["learner_logp"], t["sampler_logp"], t["advantage"], ids,
                                    t["position"], group_id=t["group_id"])

    def responses(self, step: int, rank: Optional[int] = None) -> pd.DataFrame:
        """One row per response of :meth:`token_batch` ``(step, rank)``, in the batch's order (row i is sample
        index i): ``batch_id`` (the batch's ``sample_id``), ``rank`` and ``sample_id`` (as recorded by that rank),
        ``n_tokens``."""
        df = self._batch_tokens(step, rank)
        first, ids = _response_ids(df)
        out = df.loc[first, ["rank", "sample_id"]].reset_index(drop=True).astype("int64")
        out.insert(0, "batch_id", ids[first])
        out["n_tokens"] = np.diff(np.append(first, len(df)))
        return out

    def _batch_tokens(self, step: int, rank: Optional[int]) -> pd.DataFrame:
        df = self.tokens(step, ["sample_id", "group_id", "position", "learner_logp", "sampler_logp", "advantage"])
        if rank is not None:
            df = df[df["rank"].to_numpy() == rank].reset_index(drop=True)
            if not len(df):
                raise KeyError(f"step {step} has no token records of rank {rank} in {self.path}")
        return df

    def iter_batches(self, steps: Optional[Sequence[int]] = None) -> Iterator:
        """Yield ``(step, TokenBatch)`` in step order (:meth:`token_batch`: responses keyed by rank and sample id),
        one step in memory at a time."""
        for s in (self.step_numbers() if steps is None else steps):
            yield s, self.token_batch(s)

    def _rows(self, table: str, rank: Optional[int] = None) -> Optional[pd.DataFrame]:
        """Every row of ``table`` (of ``rank`` only, unless None) whose step's records are the latest: rows of an
        earlier attempt of a step a later attempt redid are left out, and within an attempt those of an earlier
        part (the step logged again).  None when the table holds nothing readable."""
        idx = self.index(table)
        if table in DENSE_TABLES:                 # every step a rank logs has its records here: their own latest
            latest = idx.attempts()
        else:                                     # rows at some steps only: the step's latest attempt, wherever
            latest = dict(self.step_attempts())   # it wrote (no row then means none fired / none quarantined)
            for s, a in idx.attempts().items():
                latest.setdefault(s, a)
        frames = []
        for p in idx.parts:
            if rank is not None and p.rank != rank:
                continue
            if not any(latest.get(s) == p.attempt for s in range(p.lo, p.hi + 1)):
                continue                            # every step of the file was redone by a later attempt
            t = self._read(p)
            if t is None:
                continue
            df = t.to_pandas()
            df["step"], df["rank"] = df["step"].astype("int64"), p.rank
            df["_order"] = [p.order] * len(df)
            df["_file"] = p.name
            frames.append(df)
        if not frames:
            return None
        df = pd.concat(frames, ignore_index=True)
        df = df[df["attempt"].to_numpy() == df["step"].map(latest).to_numpy()]
        newest = df.groupby(["step", "rank"])["_order"].transform("max")
        df = df[df["_order"] == newest]
        if table == "steps":                        # one row a step and rank: a file with more is damaged there
            dup = df.duplicated(["step", "rank"], keep=False)
            for (name, step), n in df[dup].groupby(["_file", "step"]).size().items():
                self._skip_unreadable(self.store.display(name), f"{n} rows for step {step}, a steps file holds one "
                                                                "row a step")
            df = df[~dup]
        return df.drop(columns=["_order", "_file"])

    def steps(self, rank: Optional[int] = 0) -> pd.DataFrame:
        """Live per-step metric rows (latest attempt of each step), sorted by step.

        ``rank=None`` returns every rank's rows (a ``rank`` column tells them apart).
        Returns an empty DataFrame with a ``step`` column when nothing was recorded yet.
        """
        df = self._rows("steps", rank)
        if df is None or not len(df):
            return pd.DataFrame({"step": pd.Series([], dtype="int64")})
        front = ["step", "rank"]
        df = df[front + [c for c in df.columns if c not in front]].sort_values(["step", "rank"]).reset_index(
            drop=True)
        return _fill_late_timings(df, self.timings())

    def timings(self) -> pd.DataFrame:
        """The timings table: phase timings and rewards recorded after their step's row (a framework driver's
        timers and reward, :class:`~triage_monitor.rundir.timings_writer.TimingsWriter`, rank 0;
        ``MismatchMonitor.add_timings``, the monitor's rank), one row a step and rank: each column's newest reading
        (latest attempt, then part, then write time; a later row without a phase or reward keeps the earlier row's,
        a later row without ``framework_step`` keeps the earlier one's).  :meth:`steps` fills its rows'
        ``time/<phase>`` and ``reward`` columns from these where they are NaN.  Empty (with a ``step`` column) when
        there are none."""
        idx = self.index("timings")
        frames = []
        for p in idx.parts:
            t = self._read(p)
            if t is None or not t.num_rows:
                continue
            df = t.to_pandas()
            df["_order"] = [p.order] * len(df)
            frames.append(df)
        if not frames:
            return pd.DataFrame({"step": pd.Series([], dtype="int64")})
        df = pd.concat(frames, ignore_index=True)
        df["step"], df["rank"] = df["step"].astype("int64"), df["rank"].astype("int64")
        df = df.sort_values(["step", "rank", "_order", "wall_time"], kind="stable").drop(columns=["_order"])
        df["framework_step"] = df["framework_step"].where(df["framework_step"] >= 0)      # -1: not given
        df["framework"] = df["framework"].where(df["framework"] != "")
        out = df.groupby(["step", "rank"], sort=True).last().reset_index()     # each column's newest reading
        out["framework_step"] = out["framework_step"].fillna(-1).astype("int64")
        out["framework"] = out["framework"].fillna("")
        return out.astype({"attempt": "int64"})

    def _table(self, name: str) -> pd.DataFrame:
        """All rows of a side table (``alerts``, ``quarantine``), latest attempt, with a ``step`` column."""
        df = self._rows(name)
        if df is None:
            return pd.DataFrame({"step": []})
        return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)

    def alerts(self) -> pd.DataFrame:
        """Alert rows recorded in ``alerts/`` (empty DataFrame when none).  Rows of a run written before alerts had
        a ``tier`` column get the tier of the shipped rule of that name (``""`` for another rule)."""
        df = self._table("alerts")
        if len(df) and "rule" in df.columns:
            shipped = {r.name: r.tier for r in default_rules()}
            known = df["tier"] if "tier" in df.columns else pd.Series(None, index=df.index, dtype=object)
            df["tier"] = known.where(known.notna(), df["rule"].map(shipped)).fillna("")
        return df

    def quarantine(self) -> pd.DataFrame:
        """Quarantined tokens (docs/reliability.md), with a ``step`` column (empty when none)."""
        return self._table("quarantine")

    def file_count(self) -> dict[str, int]:
        """``{table: files}`` of the run's tables (sealed blocks and pending files), from their listings."""
        return {t: len(self.index(t)) for t in TABLES}


def _fill_late_timings(steps: pd.DataFrame, late: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with its ``time/<phase>`` and ``reward`` columns filled from the timings table ``late``
    (:meth:`Run.timings`) where NaN: a row takes its own rank's timings and reward of its step, then rank 0's (a
    driver's, or the reporting rank's: the job's), each only when written after the attempt that wrote the row
    started (a resumed job's re-logged steps do not take an earlier attempt's timers; attempt ids are the attempt's
    start, ns since the epoch).  A ``reward`` column is added only when the timings table holds a reward.
    ``steps`` itself when there is nothing to fill."""
    if not len(late):
        return steps
    cols = [c for c in TIME_COLUMNS if c in late.columns]
    if "reward" in late.columns and late["reward"].notna().any():     # a framework's reward that came late
        cols.append("reward")
    out = steps.copy()
    started = out["attempt"].to_numpy(np.float64) / 1e9 if "attempt" in out.columns else np.zeros(len(out))
    keys = out[["step", "rank"]].reset_index(drop=True)
    own = keys.merge(late[["step", "rank", "wall_time", *cols]], on=["step", "rank"], how="left")
    job = keys[["step"]].merge(late.loc[late["rank"] == 0, ["step", "wall_time", *cols]], on="step", how="left")
    for source in (own, job):
        after = source["wall_time"].to_numpy(np.float64) >= started       # NaN (no row) compares False
        for c in cols:
            given = np.where(after, source[c].to_numpy(np.float64), np.nan)
            have = out[c].to_numpy(np.float64) if c in out.columns else np.full(len(out), np.nan)
            out[c] = np.where(np.isnan(have), given, have)
    return out


class ResponseIds(NamedTuple):
    """The responses of a step's token rows (:func:`_response_ids`): ``first`` row of each, ``ids`` of every row."""

    first: np.ndarray
    ids: np.ndarray


def _response_ids(df: pd.DataFrame) -> ResponseIds:
    """(first row of each response, the batch's sample id of every row) of token rows sorted by (sample_id, rank,
    position) (:meth:`Run.tokens`): a response is one (rank, sample_id); its id is the recorded one while no two
    ranks share a sample id, else its number 0 … S−1 in that order."""
    sid, rk = df["sample_id"].to_numpy(np.int64), df["rank"].to_numpy(np.int64)
    new = np.ones(len(df), dtype=bool)
    new[1:] = (sid[1:] != sid[:-1]) | (rk[1:] != rk[:-1])
    first = np.flatnonzero(new)
    if np.unique(sid[first]).size == first.size:
        return ResponseIds(first, sid)
    return ResponseIds(first, np.cumsum(new) - 1)


def open_run(path) -> Run:
    """Open a run directory written by :class:`~triage_monitor.monitor.MismatchMonitor`: a local path, a
    ``file://`` URI or an ``s3://`` URI.  Only ``run.json`` is read; the tables are listed when first read.

    Raises:
        RunDirError: the location is of an unsupported scheme, does not exist, is not a directory, or has no
            ``run.json`` manifest, or the manifest is unreadable or has a field of the wrong type or out of
            range (:class:`~triage_monitor.rundir.manifest.ManifestError`: the message names the file and the field).
    """
    try:
        layout = RunLayout(path)
    except ValueError as exc:             # an unsupported URI scheme
        raise RunDirError(str(exc)) from exc
    p, store = layout.display, layout.store
    try:
        if store.is_local:
            if not store.exists(""):
                raise RunDirError(f"{p}: no such directory")
            if not store.is_dir(""):
                raise RunDirError(f"{p}: not a directory")
        if not store.is_file(MANIFEST):
            raise RunDirError(f"{p}: not a triage-monitor run directory (no {MANIFEST})")
    except OSError as exc:
        raise RunReadError(f"{p}: cannot be read ({exc})") from exc
    run = Run(store)
    try:
        run.manifest
    except ManifestError as exc:             # names the file and the field already
        raise RunDirError(str(exc)) from exc
    except OSError as exc:
        raise RunReadError(f"{store.display(MANIFEST)}: unreadable manifest ({exc})") from exc
    except ValueError as exc:
        raise RunDirError(f"{store.display(MANIFEST)}: unreadable manifest ({exc})") from exc
    return run


#: Columns the metrics read from the token files.
TOKEN_COLUMNS = ("sample_id", "position", "learner_logp", "sampler_logp", "advantage")
#: Metrics that depend on τ_tail (docs/metrics.md#tau_tail): provisional on a live step with tau_tail_frozen = 0.
TAU_DEPENDENT = names.TAU_DEPENDENT       # (declared with the metrics: Metric.needs_tau)
TAU_MODES = ("frozen", "live")


class TokenArrays(NamedTuple):
    """One token file's decoded columns (:func:`read_token_arrays`), each ``(n,)`` in file order."""

    sample_id: np.ndarray       # int64
    position: np.ndarray        # int64
    learner_logp: np.ndarray    # float32, nats
    sampler_logp: np.ndarray    # float32, nats
    advantage: np.ndarray       # float32


def read_token_arrays(source) -> list[TokenArrays]:
    """Decode a step's token records into numpy columns: a list of ``(sample_id int64, position int64,
    learner_logp float32, sampler_logp float32, advantage float32)``, one per file, each ``(n,)`` in file order.
    Nothing else (no pandas, no sort): the decode the offline metrics pay.

    ``source``: a :class:`StepSource` (the step's rows of each rank's file, :meth:`Run.token_source`), or local
    paths of Parquet files each holding one step's rows (read whole).

    Raises:
        OSError, pyarrow.ArrowException: a file cannot be read."""
    if not isinstance(source, StepSource):
        tables = [pq.read_table(f, columns=list(TOKEN_COLUMNS)) for f in source]
    else:
        store = _store(source.location)
        tables = [read_part(store, f, TOKEN_COLUMNS, source.step) for f in source.parts]
    return [TokenArrays(*(t.column(c).to_numpy() for c in TOKEN_COLUMNS)) for t in tables]


def _hint(source) -> str:
    return source.hint() if isinstance(source, StepSource) else str(source[0]) if len(source) else ""


def state_of_arrays(parts: list, tau_tail: float, config, path_hint: str = "",
                    null_input: Optional[list] = None) -> "np.ndarray":
    """The :class:`~triage_monitor.metrics.MismatchStats` state vector of one step from its decoded rank files
    (:func:`read_token_arrays`), with τ_tail ``tau_tail`` (nats, NaN: no localisation).

    Each rank file is one batch, exactly as the live monitor updated it on that rank; the ranks merge by the
    state's declared reductions.  Rows must be ordered by (sample_id, position) as the monitor writes them;
    other orders are sorted first.

    With ``null_input`` (a list), each rank file's C_tok shuffle-null input is appended to it
    (:func:`triage_monitor.metrics.state_kernel.update_state`).

    Returns:
        ``(state_layout(W).size,)`` float64 numpy array.

    Raises:
        ValueError: a (sample_id, position) pair occurs twice in a file (named by ``path_hint``).
    """
    from ..metrics.stats import MismatchStats
    from ..metrics.state_kernel import BOTH, MAGNITUDE, OK

    stats = MismatchStats(config)
    mode = MAGNITUDE if math.isnan(tau_tail) else BOTH
    for sid, pos, lp, sp, adv in parts:
        if sid.size == 0:
            continue
        # δ in float32 exactly as TokenBatch.delta; a response is a run of equal sample ids (the kernel checks
        # the (sample_id, position) order and refuses other orders, which are sorted here first)
        delta = np.subtract(lp, sp, dtype=np.float32)
        if stats.update_arrays(delta, adv, sid, pos, -1, mode, tau_tail, null_input) == OK:
            continue
        order = np.lexsort((pos, sid))
        sid, pos, delta, adv = sid[order], pos[order], delta[order], adv[order]
        if stats.update_arrays(delta, adv, sid, pos, -1, mode, tau_tail, null_input) != OK:
            raise ValueError(f"{path_hint}: a (sample_id, position) pair occurs twice in the token records")
    return stats.array


def step_state(source, tau_tail: float, config) -> "np.ndarray":
    """:func:`state_of_arrays` of the step's token records (``source`` as :func:`read_token_arrays` takes it;
    decode + metric state: the map of :func:`recompute`, run by any engine of :mod:`triage_monitor.offline.engines`)."""
    return state_of_arrays(read_token_arrays(source), tau_tail, config, _hint(source))


class StepResult(NamedTuple):
    """One step's metric state and its C_tok shuffle-null input (:func:`_step_result`)."""

    state: np.ndarray
    null_input: "NullInput"


def _step_result(parts: list, tau_tail: float, config, path_hint: str = "") -> StepResult:
    """``(state, null_input)`` of one step: :func:`state_of_arrays` and the step's C_tok shuffle-null input
    (a :class:`~triage_monitor.metrics.state_kernel.NullInput`, the ranks' concatenated; empty without τ_tail).  What
    the engines map."""
    from ..metrics.state_kernel import NullInput

    nulls: list = []
    state = state_of_arrays(parts, tau_tail, config, path_hint, nulls)
    return StepResult(state, NullInput.concat(nulls))


def _prefetch(source, tau_tail, config):
    return read_token_arrays(source), tau_tail, config, _hint(source)


class StepStates:
    """Per-step metric states of a run (one fixed-size vector per step, docs/metrics.md#state) and the
    τ_tail each was computed with: every per-step and trailing-window metric derives from them.

    Attributes:
        steps: sorted step numbers.
        states: ``(len(steps), state size)`` float64.
        taus: τ_tail of each step (nats).
        config: the :class:`~triage_monitor.metrics.MetricConfig`.
        window: the trailing window in steps.
        tau_mode: "frozen" (one τ_tail for the run) or "live" (the live provisional values replayed).
        null_inputs: per step, the C_tok shuffle-null input recorded with its state
            (``(segment_valid, response_segments, response_tails)``, :func:`_step_result`), or None.
    """

    def __init__(self, steps, states, taus, config, window: int, tau_mode: str, null_inputs=None):
        self.steps, self.states, self.taus = list(steps), states, list(taus)
        self.null_inputs = null_inputs
        self.config, self.window, self.tau_mode = config, int(window), tau_mode
        self._index = {s: i for i, s in enumerate(self.steps)}

    def stats(self, step: int):
        """The :class:`~triage_monitor.metrics.MismatchStats` of one step."""
        from ..metrics.stats import MismatchStats

        i = self._index[int(step)]
        return MismatchStats(self.config, state=self.states[i].copy(), tau_tail=self.taus[i])

    def window_stats(self, step: int, window: Optional[int] = None):
        """The merge of the steps ``s`` with ``step - window < s <= step`` (in step order), as live."""
        from ..metrics.stats import MismatchStats, state_layout

        w = self.window if window is None else int(window)
        idx = [i for i, s in enumerate(self.steps) if step - w < s <= step]
        layout = state_layout(self.config.segment_width)
        state = layout.reduce([self.states[i] for i in idx]) if idx else layout.identity_array()
        return MismatchStats(self.config, state=state, tau_tail=self.taus[idx[-1]] if idx else math.nan)

    def frame(self, window: Optional[int] = None) -> pd.DataFrame:
        """Step and ``window/<name>`` metrics of every step (the table :func:`recompute` returns)."""
        from ..metrics.stats import METRIC_NAMES

        rows = []
        for s in self.steps:
            row = {"step": s, **self.stats(s).compute().values}
            row.update({f"window/{k}": v for k, v in self.window_stats(s, window).compute().values.items()})
            rows.append(row)
        df = pd.DataFrame(rows, columns=["step", *METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)])
        df.attrs.update(tau_mode=self.tau_mode, window=self.window if window is None else int(window))
        return df


def _calibration_taus(parts: list, steps: list, q: float, mode: str, n_calib: int) -> dict[int, float]:
    """τ_tail of each of ``steps`` from the calibration parts of the run's first steps (``parts``, in order)."""
    from ..metrics.stats import tau_from_calibration

    frozen = tau_from_calibration(parts, q) if parts else math.nan
    if mode == "frozen":
        return {s: frozen for s in steps}
    out = {}
    for i, s in enumerate(steps):
        out[s] = tau_from_calibration(parts[:i + 1], q) if i < len(parts) and i < n_calib else frozen
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def recompute_states(run: Run, *, tau_tail: Optional[float] = None, calibration_steps: Optional[int] = None,
                     config=None, steps: Optional[Sequence[int]] = None, window: Optional[int] = None,
                     tau_mode: str = "frozen", engine: str = "local", workers: int = 1,
                     address: Optional[str] = None, progress: bool = False, cache: bool = False) -> StepStates:
    """Per-step metric states of a run from its token files (see :func:`recompute` for the arguments).

    With ``cache``, the states are read from / saved to ``RUN_DIR/analysis/states-<key>.npz``, the key
    covering the token files (names, sizes, modification times) and every setting that changes a state,
    so ``analyze``, the stage table, the report and the dashboard share one computation; a read-only run
    directory just skips the save.

    τ_tail: explicit (argument, or the run's configured value) for every step; else calibrated from the
    merged δ sketches of the run's first ``calibration_steps`` steps with tokens.  ``tau_mode="frozen"``
    (the post-mortem) uses that one value for every step, the first ones included; ``"live"`` replays the
    live monitor's provisional values on the reference steps.  The reference steps are mapped first with a
    candidate τ_tail (the run's recorded calibration, or the live rows'), which is then checked against their
    sketches; the other steps are mapped once with the τ_tail the sketches give.  When the candidate was wrong
    one WARNING line says so (:func:`tau_mismatch_message`) and only the reference steps are mapped again, so
    the result never depends on the candidate.
    """
    from .engines import map_ordered, progress_bar
    from ..metrics.stats import MetricTracker, MismatchStats

    if tau_mode not in TAU_MODES:
        raise ValueError(f"tau_mode must be one of {TAU_MODES}, got {tau_mode!r}")
    mc = run.config
    cfg = config or mc.metrics
    win = int(window if window is not None else mc.window)
    explicit = tau_tail if tau_tail is not None else mc.tau_tail
    n_calib = int(calibration_steps if calibration_steps is not None else mc.calibration_steps)
    MetricTracker(cfg, win, explicit, n_calib)                       # validates window, τ_tail, calibration
    all_steps = run.step_numbers()
    files = {s: run.token_source(s) for s in all_steps}
    todo = all_steps if steps is None else sorted({int(s) for s in steps})
    missing = [s for s in todo if s not in files]
    if missing:
        raise KeyError(f"step(s) {missing[:5]} have no token records in {run.path}")
    calib = all_steps[:n_calib]
    if engine == "local":
        workers = planned_workers([files[s] for s in todo], workers)
    kw = dict(engine=engine, workers=workers, address=address)
    path = None
    if cache:
        path = run.layout.states_cache(_cache_key(files, todo, cfg, explicit, n_calib, tau_mode))
        hit = _load_states(run.store, path, cfg, win, tau_mode)
        if hit is not None:
            return hit

    nulls: dict = {}
    need = todo if explicit is not None else sorted(set(todo) | set(calib))
    quiet = (lambda: None)

    def run_map(which, taus, advance, here=False):
        if not which:
            return {}
        results = map_ordered(_step_result, [(files[s], taus[s], cfg) for s in which], prefetch=_prefetch,
                              finish=forget_shared_groups, advance=advance,
                              **(dict(kw, workers=1) if here and engine == "local" else kw))
        nulls.update(zip(which, (r[1] for r in results)))
        return {s: r[0] for s, r in zip(which, results)}

    # one progress bar over the maps (the steps of ``need``, each counted once)
    with progress_bar(progress, len(need), "recomputing metrics") as advance:
        if explicit is not None:
            taus = {s: float(explicit) for s in todo}
            states = run_map(todo, taus, advance)
        else:
            cand = _candidate_taus(run, tau_mode, need, calib)
            if cand is None:            # nothing recorded to start from: read the reference steps' δ first
                pre = run_map(calib, {s: math.nan for s in calib}, quiet, here=True)
                cand = _calibration_taus([_part(pre[s], cfg) for s in calib], need, cfg.tail_quantile, tau_mode,
                                         n_calib)
            # the reference steps first (in this process: local workers are started once, for the others), with
            # the candidate; their δ sketches give every step's τ_tail, and the other steps are mapped once with
            # it.  Only reference steps whose candidate was wrong are mapped again (one line says so).
            states = run_map(calib, cand, advance, here=True)
            taus = _calibration_taus([_part(states[s], cfg) for s in calib], need, cfg.tail_quantile, tau_mode,
                                     n_calib)
            redo = [s for s in calib if not _same(taus[s], cand[s])]
            if redo:
                log.warning("triage-monitor: %s", tau_mismatch_message(cand, taus, redo, tau_mode))
                states.update(run_map(redo, taus, quiet, here=True))
            states.update(run_map([s for s in need if s not in states], taus, advance))
    size = MismatchStats(cfg).array.size
    mat = np.stack([states[s] for s in todo]) if todo else np.zeros((0, size))
    out = StepStates(todo, mat, [taus[s] for s in todo], cfg, win, tau_mode, [nulls[s] for s in todo])
    if path is not None:
        _save_states(run.store, path, out)
    return out


#: Token-record bytes each local worker process must have to map before its start-up (a spawned interpreter
#: importing numba, pyarrow and the package, and loading the compiled kernels: about 1 s on the 2-core machine)
#: pays off: 1 GiB, about 110M tokens, 3-4 s of decoding in one process.  Below it, fewer workers (one: this
#: process) are faster.
WORKER_MIN_BYTES = 1 << 30


#: Cores the machine must give this process for local worker processes to pay: one process already keeps two
#: busy (the next step decoded by pyarrow on a background thread while the compiled kernel updates this one), so on
#: two cores N workers only add their start-up (``--workers 2`` 0.64x one process on a 100M-token run of 8 ranks,
#: benchmarks/bench_ranks.py).
WORKER_MIN_CORES = 3


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def planned_workers(sources: Sequence, workers: int) -> int:
    """How many local worker processes the map over ``sources`` (:class:`StepSource` s) uses when ``workers`` are
    asked for: at most one per :data:`WORKER_MIN_BYTES` of their token records (a block's bytes shared by its
    steps), none (1: this process) with fewer than :data:`WORKER_MIN_CORES` usable cores, at least 1 — so
    ``--workers N`` is never slower than one process on a run or a machine too small for it."""
    workers = int(workers)
    if workers <= 1:
        return max(workers, 1)
    if usable_cores() < WORKER_MIN_CORES:
        return 1
    nbytes = sum(p.size / (p.hi - p.lo + 1) for src in sources for p in src.parts)
    return max(1, min(workers, int(nbytes // WORKER_MIN_BYTES)))


def _cache_key(files: dict, todo: list, cfg, explicit, n_calib: int, tau_mode: str) -> str:
    import hashlib
    from dataclasses import asdict

    from ..metrics.stats import state_layout

    # the state layout is part of the key: a state of another layout (a field added or resized) is never loaded.
    # A step's records are keyed by the files that hold them: name (rank, attempt, part, pending or sealed), size
    # and modification time, so a file truncated, emptied, rewritten or sealed since is read again.
    layout = [(f.name, f.size, f.reduction) for f in state_layout(cfg.segment_width).fields]
    h = hashlib.sha256(json.dumps([asdict(cfg), explicit, n_calib, tau_mode, todo, layout,
                                   list(state_kernel_fields()), _CACHE_FORMAT]).encode())
    for s in sorted(files):
        h.update(f"{s}:{[(p.name, p.size, p.mtime_ns) for p in files[s].parts]};".encode())
    return h.hexdigest()[:20]


#: Version of the cached states file (part of its key): 2 adds the shuffle-null inputs, 3 keys by records, 4 by
#: their files' names, sizes and modification times.
_CACHE_FORMAT = 4


def state_kernel_fields() -> tuple[str, ...]:
    """The names of the state's additive sums, in state order (part of the state cache's key)."""
    from ..metrics.state_kernel import SUM_FIELDS

    return SUM_FIELDS


def _load_states(store: Store, path: str, cfg, window: int, tau_mode: str) -> Optional[StepStates]:
    try:
        with np.load(io.BytesIO(store.read_bytes(path))) as z:
            split = (lambda values, lengths: np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else [])
            nulls = list(zip(split(z["null_seg"], z["null_seg_len"]), split(z["null_nseg"], z["null_resp_len"]),
                             split(z["null_tails"], z["null_resp_len"])))
            steps = z["steps"].tolist()
            return StepStates(steps, z["states"], z["taus"].tolist(), cfg, window, tau_mode,
                              nulls if len(nulls) == len(steps) else None)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 — a damaged cache (BadZipFile, a truncated array, ...) is recomputed
        log.warning("triage-monitor: the state cache %s is damaged (%s: %s); recomputing it",
                    store.display(path), type(exc).__name__, exc)
        return None


def _save_states(store: Store, path: str, states: StepStates) -> None:
    """Save ``states`` at ``path`` of the run; a failed save (a read-only run, a full disk) is skipped."""
    buf = io.BytesIO()
    nulls = states.null_inputs or []
    cat = (lambda k: np.concatenate([n[k] for n in nulls]) if nulls else np.zeros(0, np.int32))
    np.savez_compressed(buf, steps=np.asarray(states.steps, dtype=np.int64), states=states.states,
                        taus=np.asarray(states.taus, dtype=np.float64), null_seg=cat(0), null_nseg=cat(1),
                        null_tails=cat(2), null_seg_len=np.array([len(n[0]) for n in nulls], np.int64),
                        null_resp_len=np.array([len(n[1]) for n in nulls], np.int64))
    try:
        store.makedirs(RunLayout.analysis_dir)
        store.write_bytes(path, buf.getvalue())
    except OSError:
        pass


def tau_mismatch_message(cand: dict, taus: dict, redo: list, tau_mode: str) -> str:
    """The one line :func:`recompute_states` logs when the τ_tail it started from (run.json's, or the live rows')
    differs from the one the reference steps' δ sketches give."""
    s = redo[0]
    src = "the live rows'" if tau_mode == "live" else "run.json's"
    return (f"tau_tail {cand[s]:.6g} ({src}) differs from {taus[s]:.6g} recalibrated from the reference steps' "
            f"records; using the recalibrated value: {len(redo)} reference step(s) recomputed, the other steps "
            f"computed once with it")


def _part(state, cfg):
    from ..metrics.stats import MismatchStats, _calibration_part

    return _calibration_part(MismatchStats(cfg, state=np.array(state)))    # a copy: Ray's arrays are read-only


def _candidate_taus(run: Run, mode: str, steps: list, calib: list) -> Optional[dict]:
    """A guess of each step's τ_tail from what the live monitor recorded (None: nothing usable)."""
    if mode != "live" and run.tau_tail is not None:         # the manifest's: no need to read the step rows
        return {s: float(run.tau_tail) for s in steps}
    live = run.steps()
    if mode == "live":
        if "tau_tail" not in live.columns:
            return None
        rec = dict(zip(live["step"].astype(int), live["tau_tail"].astype(float)))
        return {s: rec.get(s, math.nan) for s in steps} if all(s in rec for s in calib) else None
    tau = run.tau_tail
    if tau is None and calib and "tau_tail" in live.columns:
        # the live value at the last reference step pools the same steps as the frozen one (also when the
        # run stopped before its reference window was complete)
        at = live.loc[live["step"] == calib[-1], "tau_tail"]
        tau = float(at.iloc[0]) if len(at) and not math.isnan(float(at.iloc[0])) else None
    return None if tau is None else {s: float(tau) for s in steps}


def recompute(run: Run, *, window: Optional[int] = None, tau_tail: Optional[float] = None,
              calibration_steps: Optional[int] = None, config=None,
              steps: Optional[Sequence[int]] = None, progress: bool = False, tau_mode: str = "frozen",
              engine: str = "local", workers: int = 1, address: Optional[str] = None,
              cache: bool = False) -> pd.DataFrame:
    """Recompute every per-step and trailing-window metric from the token files alone.

    Defaults come from the run's manifest (window, τ_tail or its calibration, thresholds); override any
    of them for a what-if analysis.  Each step is one fixed-size state (:func:`recompute_states`); a
    window is the merge of its steps' states, as live.

    Args:
        tau_mode: "frozen" (default, the post-mortem): one τ_tail for every step, the first
            ``calibration_steps`` included; "live": the provisional τ_tail the live monitor used on the
            reference steps, so every live value is reproduced (docs/metrics.md#tau_tail).
        engine, workers, address: where the steps are mapped (:func:`triage_monitor.offline.engines.map_ordered`):
            this process, ``workers`` local processes, or a Ray cluster; the result is bit-identical.
        progress: show a progress bar.
        cache: reuse / save the per-step states under ``RUN_DIR/analysis`` (:func:`recompute_states`).

    Returns:
        DataFrame with a ``step`` column, the step metrics (:data:`METRIC_NAMES`) and ``window/<name>``
        columns; ``df.attrs`` holds ``tau_mode`` and ``window``.

    Raises:
        KeyError: a requested step has no token records.  ValueError: bad window / τ_tail / mode.
        ImportError: engine "ray" without Ray installed.
    """
    return recompute_states(run, tau_tail=tau_tail, calibration_steps=calibration_steps, config=config,
                            steps=steps, window=window, tau_mode=tau_mode, engine=engine, workers=workers,
                            address=address, progress=progress, cache=cache).frame()


class Postmortem(NamedTuple):
    """What :func:`postmortem_frame` returns: the per-step metric ``frame`` and the ``states`` behind it (None for a
    run without token records)."""

    frame: pd.DataFrame
    states: Optional["StepStates"]


def postmortem_frame(run: Run, window: Optional[int] = None, live: Optional[pd.DataFrame] = None,
                     steps: Optional[Sequence[int]] = None) -> Postmortem:
    """The per-step metric frame a post-mortem shows, and the states behind it: ``(frame, states)``.

    With token records: every metric and ``window/<name>`` from the run's cached per-step states with one
    frozen τ_tail (:func:`recompute_states`), joined with the live-only columns (training extras,
    integrity counters, ``tau_tail_frozen``).  Without token records: the live rows (``states`` None),
    whose values before the live τ_tail froze are provisional.  ``steps``: only these steps (e.g. the ones
    a page listed once, so that a run being written is shown as one snapshot); None: every step with tokens.
    """
    live = run.steps() if live is None else live
    token_steps = run.step_numbers()
    if steps is not None:
        token_steps = sorted(set(token_steps) & {int(s) for s in steps})
    if not token_steps:
        return Postmortem(live, None)
    states = recompute_states(run, cache=True, steps=None if steps is None else token_steps)
    rec = states.frame(window)
    extra = live[["step", *[c for c in live.columns if c not in rec.columns]]] if "step" in live.columns else None
    frame = rec.merge(extra, on="step", how="left") if extra is not None and len(extra.columns) > 1 else rec
    frame.attrs.update(rec.attrs)
    return Postmortem(frame, states)


def compare_live(run: Run, recomputed: pd.DataFrame, rtol: float = 1e-9,
                 live: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Per metric, the largest relative difference ``|live − rec| / max(|live|, |rec|)`` between live and
    recomputed values (``inf`` when one side is NaN and the other is not).

    NaN in both counts as equal; ``live`` (from :meth:`Run.steps`) saves a second read of the step rows.
    When ``recomputed`` used one frozen τ_tail (``attrs["tau_mode"] == "frozen"``, :func:`recompute`'s
    default), the τ-dependent metrics (:data:`TAU_DEPENDENT`) of the live steps computed with a
    provisional τ_tail (``tau_tail_frozen == 0``), and the windows holding such a step, are not compared:
    they are counted in ``provisional`` instead.

    Returns a DataFrame (metric, max_rel_diff, equal, compared, provisional).
    """
    live = (run.steps() if live is None else live).set_index("step")
    rec = recomputed.set_index("step")
    common = rec.index.intersection(live.index)
    provisional = pd.Series(False, index=common)
    window_prov = pd.Series(False, index=common)
    if recomputed.attrs.get("tau_mode", "frozen") == "frozen" and "tau_tail_frozen" in live.columns:
        prov_steps = [int(s) for s in live.index[live["tau_tail_frozen"].astype(float) == 0]]
        w = int(recomputed.attrs.get("window") or run.config.window)
        provisional = pd.Series([s in set(prov_steps) for s in common], index=common, dtype=bool)
        window_prov = pd.Series([any(s - w < p <= s for p in prov_steps) for s in common], index=common, dtype=bool)
    out = []
    for c in rec.columns:
        if c not in live.columns:
            continue
        skip = pd.Series(False, index=common)
        if c.split("/")[-1] in TAU_DEPENDENT:
            skip = window_prov if c.startswith("window/") else provisional
        keep = common[~skip.to_numpy()]
        a = live.loc[keep, c].astype(float)
        b = rec.loc[keep, c].astype(float)
        both_nan = a.isna() & b.isna()
        # relative to the larger magnitude: bounded (<= 2) when one side is 0, never 1e298
        diff = ((a - b).abs() / pd.concat([a.abs(), b.abs()], axis=1).max(axis=1).clip(lower=1e-300)
                ).where(~both_nan, 0.0)
        mismatch_nan = a.isna() ^ b.isna()
        m = math.inf if bool(mismatch_nan.any()) else float(diff.max()) if len(diff) else 0.0
        out.append({"metric": c, "max_rel_diff": m, "equal": m <= rtol, "compared": len(keep),
                    "provisional": int(skip.sum())})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------- live vs recomputed after a resume
def differing_steps(live, rec, metric: str, rtol: float = 1e-9) -> set:
    """Steps where ``live`` and ``rec`` values of ``metric`` differ (NaN on both sides is equal)."""
    m = live[["step", metric]].merge(rec[["step", metric]], on="step", suffixes=("_live", "_rec"))
    a, b = m[f"{metric}_live"].to_numpy(float), m[f"{metric}_rec"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        same = (np.isnan(a) & np.isnan(b)) | (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b)))
    return set(m["step"].to_numpy()[~same].tolist())


def provisional_skips(live, rec, window: int) -> dict[str, set[int]]:
    """{metric: steps} that :func:`~triage_monitor.offline.analysis.compare_live` leaves out: the τ-dependent metrics
    of live steps with a provisional τ_tail, and of the windows holding one (frozen τ mode only)."""

    if rec.attrs.get("tau_mode", "frozen") != "frozen" or "tau_tail_frozen" not in live.columns:
        return {}
    prov = set(live.loc[live["tau_tail_frozen"].astype(float) == 0, "step"].astype(int))
    steps = set(live["step"].astype(int))
    win = {s for s in steps if any(s - window < p <= s for p in prov)}
    return {**{m: prov for m in TAU_DEPENDENT}, **{f"window/{m}": win for m in TAU_DEPENDENT}}


class ResumeExplanations(NamedTuple):
    """What :func:`resume_explanations` returns: the differences a resumed run explains, and why."""

    explained: dict[str, set[int]]       # metric -> steps
    reasons: list[str]                   # one sentence each


def resume_explanations(run, live, rec) -> "ResumeExplanations":
    """Which live/recomputed differences a resumed (multi-attempt) run explains, and why.

    Two effects of a later attempt (a resumed job, or a re-run into the same directory) on what the live
    monitor computed, that the recomputation from the visible token files cannot reproduce:

    * **τ_tail from replaced steps**: the later attempt read back the τ_tail that run.json recorded, which
      an earlier attempt calibrated on its own first steps; when the later attempt rewrote those steps,
      the recomputation calibrates on the new ones.  The τ-dependent metrics
      (:data:`~triage_monitor.offline.analysis.TAU_DEPENDENT`) of every step whose live τ_tail differs from the
      recomputed one are explained.
    * **restarted window**: each process start begins an empty trailing window, so a live window that
      ends after a resume holds only that attempt's steps; the recomputation pools the visible steps of
      every attempt.  The ``window/`` metrics of windows whose visible steps come from more than one
      attempt are explained.

    Returns:
        ``({metric: set of steps}, [sentence, ...])``; empty for a run with one attempt.
    """

    if "attempt" not in live.columns or live["attempt"].nunique() < 2 and len(run.manifest.attempts) < 2:
        return ResumeExplanations({}, [])
    att = dict(zip(live["step"].astype(int), live["attempt"]))
    steps = sorted(att)
    window = int(rec.attrs.get("window") or run.config.window)
    explained: dict = {}
    reasons = []
    cal = run.manifest.calibration if isinstance(run.manifest.calibration, dict) else {}
    tau_steps = set()
    if "tau_tail" in live.columns and "tau_tail" in rec.columns:
        tau_steps = differing_steps(live, rec, "tau_tail")
        if "tau_tail_frozen" in live.columns:      # provisional steps are left out by compare_live already
            frozen = set(live.loc[live["tau_tail_frozen"].astype(float) == 1, "step"].astype(int))
            tau_steps &= frozen
    if tau_steps:
        n_cal = int(run.config.calibration_steps)
        replaced = [s for s in steps[:n_cal] if cal.get("attempt") is not None and att[s] != cal.get("attempt")]
        live_tau = float(live.loc[live["step"] == min(tau_steps), "tau_tail"].iloc[0])
        rec_tau = float(rec.loc[rec["step"] == min(tau_steps), "tau_tail"].iloc[0])
        why = (f"run.json's tau_tail was calibrated by attempt {cal.get('attempt')} on steps that attempt "
               f"{att[replaced[0]]} later rewrote ({replaced[0]}..{replaced[-1]})" if replaced else
               "the live monitor restored tau_tail from run.json at a resume")
        reasons.append(f"resume: {why}; the live steps used tau_tail = {live_tau:.6g}, the recomputation calibrates "
                       f"{rec_tau:.6g} from the visible steps, so the tau-dependent metrics "
                       f"({', '.join(TAU_DEPENDENT)}) of {len(tau_steps)} step(s) differ as expected")
        for m in TAU_DEPENDENT:
            explained.setdefault(m, set()).update(tau_steps)
            explained.setdefault(f"window/{m}", set()).update(tau_steps)
    mixed = {s for s in steps if len({att[t] for t in steps if s - window < t <= s}) > 1}
    if mixed:
        reasons.append(f"resume: the live trailing window restarts at each attempt, while the recomputation pools "
                       f"the visible steps of every attempt: the window/ metrics of {len(mixed)} step(s) "
                       f"({min(mixed)}..{max(mixed)}) whose window spans two attempts differ as expected")
        for m in rec.columns:
            if m.startswith("window/"):
                explained.setdefault(m, set()).update(mixed)
    # a window holding a step whose τ-dependent values differ differs as well
    if tau_steps:
        near = {s for s in steps if any(s - window < t <= s for t in tau_steps)}
        for m in TAU_DEPENDENT:
            explained.setdefault(f"window/{m}", set()).update(near)
    return ResumeExplanations(explained, reasons)


def record_gaps(run: Run, live: Optional[pd.DataFrame] = None) -> list[str]:
    """What the run's records lack, one plain sentence each (``[]``: nothing known to be missing).  What readers
    say before they call a run's records complete (``analyze``, docs/reliability.md#a-frozen-or-slow-store):

    * run.json's ``status`` is not ``finished`` (a live or killed job, or one whose close could not write run.json:
      the last steps may be missing);
    * the writer dropped rows: run.json's ``writer.dropped_rows`` (and whether close timed out), or, for a run that
      never closed, the steps table's ``writer_dropped_rows``;
    * steps with token records but no steps row (rank 0's table), named;
    * steps whose steps row counts tokens (``n_tokens`` > 0) but that have no token records at all (a run that
      records tokens), named;
    * files a read of ``run`` found unreadable (:attr:`Run.unreadable`).

    Args:
        run: the opened run.
        live: its steps table (``run.steps()``) when already read; read here otherwise.

    Returns:
        list of str."""
    out = []
    man = run.manifest
    if man.status != "finished":
        out.append(f"run.json says the run is {man.status!r}, not 'finished' (a job still running or killed, or "
                   "one whose close could not write run.json): its last steps may be missing")
    writer = man.writer or {}
    dropped = int(writer.get("dropped_rows") or 0)
    if live is None:
        try:
            live = run.steps()
        except Exception:  # noqa: BLE001 — no steps table: the other checks still hold
            live = pd.DataFrame()
    if not dropped and "writer_dropped_rows" in live.columns and len(live):
        dropped = int(np.nan_to_num(live["writer_dropped_rows"].max()))
    if dropped:
        timed = " (close() gave up on a writer that made no progress)" if writer.get("close_timed_out") else ""
        out.append(f"the writer dropped {dropped} record row(s){timed}: run.json writer.dropped_rows / the steps "
                   "table's writer_dropped_rows")
    if "step" in live.columns:
        no_row = sorted(set(run.step_numbers()) - set(int(s) for s in live["step"]))
        if man.status != "finished" and len(live):
            # a run being written: token records past the last steps row read (a later listing, or steps the
            # caller's snapshot leaves out) are not missing rows; the status line above covers the last steps
            no_row = [s for s in no_row if s <= int(live["step"].max())]
        if no_row:
            more = " …" if len(no_row) > 8 else ""
            out.append(f"{len(no_row)} step(s) have token records but no steps row: "
                       f"{', '.join(map(str, no_row[:8]))}{more}")
        cfg = man.monitor_config if isinstance(man.monitor_config, dict) else {}
        if "n_tokens" in live.columns and cfg.get("record_tokens", True) is not False:
            counted = live.loc[pd.to_numeric(live["n_tokens"], errors="coerce").fillna(0) > 0, "step"]
            no_tok = sorted(set(int(s) for s in counted) - set(run.step_numbers()))
            if no_tok:
                more = " …" if len(no_tok) > 8 else ""
                out.append(f"{len(no_tok)} step(s) have a steps row counting tokens but no token records (a token "
                           f"file removed or never written): {', '.join(map(str, no_tok[:8]))}{more}")
    for path, reason in run.unreadable:
        out.append(f"unreadable file skipped: {path} ({reason})")
    return out
