"""The names of a run directory, and the index of its tables: the one place that says where each record lives.

Every module that writes or reads a run directory (the writer, :func:`triage_monitor.offline.analysis.open_run`, the
dashboard, the framework hooks) asks :class:`RunLayout` for its names and :meth:`RunLayout.index` for the files
of a table; changing how runs are stored is this file, :mod:`triage_monitor.rundir.blocks` (the file formats) and their
tests.  The layout (docs/metrics.md#run-directory-tables, docs/reliability.md#what-a-killed-job-keeps)::

    run.json                                                             manifest (triage_monitor.manifest)
    <table>/steps-<lo:08d>-<hi:08d>-rank-<R:04d>-attempt-<A>-part-<P>.parquet
                                        a sealed block: steps lo..hi of rank R, every one of them once,
                                        one or more row groups per step, in step order
    <table>/.pending-<S:08d>-rank-<R:04d>-attempt-<A>-part-<P>.arrow
                                        step S of the block being written (Arrow IPC stream, LZ4): on disk
                                        once the step is written, removed once its block is sealed
    .writer-rank-<R>.lock               held (flock) by the process writing rank R; on an object store a
                                        lease object (triage_monitor.locks)
    .writer-rank-<R>.lock.excl          its stand-in on a file system without flock
    .ranks/<attempt>/<n>                rank claims of hook processes without a rank (local runs)
    .<framework>/<job>/                 a framework hook's shared files (e.g. .verl/)
    analysis/states-<key>.npz           cached per-step metric states (offline)

``<table>`` is one of :data:`TABLES`.  A rank's steps of one table go into blocks of consecutive steps (at most
``MonitorConfig.roll_steps``, default 50, aligned so that a block ends at a step S with ``(S + 1) % roll_steps
== 0``; earlier when its bytes pass ``roll_bytes``, when the next step is not the last + 1, or when the table's
columns change).  So a run's file count grows as ranks × steps / 50, and a reader learns which steps each file
holds from its name alone.  ``attempt`` (nanoseconds since the epoch at monitor start, shared by the ranks of one
job start) and ``part`` (the block's number within its rank and attempt) say which records are the newest: a
step's records in a table are those of the latest attempt that wrote the step there (in the tables with rows at
some steps only, ``quarantine`` and ``alerts``: the step's latest attempt over ``tokens`` and ``steps``,
:meth:`RunLayout.step_attempts`; in ``timings``, written late by whichever process holds a framework's timers,
the step's newest row of the table itself), and within an attempt those of the highest part (a step logged twice in a row rolls to a new part), a sealed block before the pending file of
the same part (the same records, while the block is being sealed).  Files of one step of the layout before
blocks (``step-<S>-rank-<R>-attempt-<A>.parquet``) read as one-step blocks of part 0.

Hidden names (``.pending-*``, ``.tmp-*`` writes under way) are skipped by pyarrow's dataset discovery, DuckDB and
Polars globs of ``*.parquet``: plain readers see the sealed blocks (docs/metrics.md#reading-a-run-with-other-tools).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple, Optional

from .storage import TEMP_PREFIX, Store, local_path, open_store  # noqa: F401  (TEMP_PREFIX: the layout's too)

#: The manifest's file name.
MANIFEST = "run.json"
#: The run's tables, each a directory of block files.
TABLES = ("tokens", "steps", "quarantine", "alerts", "timings")
#: Tables written late, by whichever process holds a framework's timers (a driver without a monitor, or the
#: monitor's rank): a rank's writer never seals another attempt's pending files of these at start (a driver may
#: still be writing them); their writer seals them at close, and readers read a killed writer's pending files.
LATE_TABLES = ("timings",)
#: The tables every logged step of a rank has records in (when the rank writes them): they say which attempt a
#: step's records come from.  The others hold rows of some steps only.
DENSE_TABLES = ("tokens", "steps")

_BLOCK_RE = re.compile(r"^steps-(-?\d+)-(-?\d+)-rank-(\d+)-attempt-(\d+)-part-(\d+)\.parquet$")
_PENDING_RE = re.compile(r"^\.pending-(-?\d+)-rank-(\d+)-attempt-(\d+)-part-(\d+)\.arrow$")
_ONE_STEP_RE = re.compile(r"^step-(-?\d+)-rank-(\d+)-attempt-(\d+)\.parquet$")     # the layout before blocks
_LOCK_RE = re.compile(r"^\.writer-rank-(\d+)\.lock$")


class PartOrder(NamedTuple):
    """How new a part's records are (:attr:`Part.order`): compared as ``(attempt, part, sealed)``."""

    attempt: int
    part: int
    sealed: bool


class Part(NamedTuple):
    """One file of a table: the steps ``lo..hi`` of ``rank`` written by ``attempt`` as its block ``part``;
    ``sealed`` for a Parquet block, False for a pending Arrow file of one step (``lo == hi``).  ``name`` is the
    file's path relative to the run directory (``tokens/steps-...``); ``size`` its bytes; ``mtime_ns`` its
    modification time (ns since the epoch; 0 unknown)."""

    table: str
    lo: int
    hi: int
    rank: int
    attempt: int
    part: int
    sealed: bool
    name: str
    size: int = 0
    mtime_ns: int = 0

    @property
    def order(self) -> PartOrder:
        """How new the records are, among files of one step and rank: attempt, then part, then sealed."""
        return PartOrder(self.attempt, self.part, self.sealed)


def block_name(lo: int, hi: int, rank: int, attempt: int, part: int) -> str:
    """The file name of a sealed block (module docstring)."""
    return f"steps-{int(lo):08d}-{int(hi):08d}-rank-{int(rank):04d}-attempt-{int(attempt)}-part-{int(part)}.parquet"


def pending_name(step: int, rank: int, attempt: int, part: int) -> str:
    """The file name of a pending step (module docstring)."""
    return f".pending-{int(step):08d}-rank-{int(rank):04d}-attempt-{int(attempt)}-part-{int(part)}.arrow"


def parse_part(table: str, name: str, size: int = 0, mtime_ns: int = 0) -> Optional[Part]:
    """The :class:`Part` a file name of ``table`` says (``size`` bytes, modified at ``mtime_ns``), None for any
    other name (a write under way, a stray file, a directory of another layout)."""
    m = _BLOCK_RE.match(name)
    if m:
        lo, hi, rank, attempt, part = (int(g) for g in m.groups())
        return (Part(table, lo, hi, rank, attempt, part, True, f"{table}/{name}", size, mtime_ns) if lo <= hi
                else None)
    m = _PENDING_RE.match(name)
    if m:
        step, rank, attempt, part = (int(g) for g in m.groups())
        return Part(table, step, step, rank, attempt, part, False, f"{table}/{name}", size, mtime_ns)
    m = _ONE_STEP_RE.match(name)
    if m:
        step, rank, attempt = (int(g) for g in m.groups())
        return Part(table, step, step, rank, attempt, 0, True, f"{table}/{name}", size, mtime_ns)
    return None


class TableIndex:
    """The files of one table, from one listing of its directory (:meth:`RunLayout.index`): which steps each
    holds, and which file to read for a step and rank.  Nothing is opened.

    Attributes:
        table: the table's name.
        parts: every :class:`Part`, in listing order.
    """

    def __init__(self, table: str, parts):
        self.table = table
        self.parts = list(parts)
        by_range: defaultdict[tuple[int, int], list[Part]] = defaultdict(list)
        for p in self.parts:
            by_range[(p.lo, p.hi)].append(p)
        #: the parts grouped by the steps they cover (ranks of one job roll together: few distinct ranges)
        self._ranges = sorted(by_range.items())
        self._steps: Optional[list[int]] = None

    def __len__(self) -> int:
        return len(self.parts)

    def steps(self) -> list[int]:
        """The sorted steps some file of the table holds."""
        if self._steps is None:
            self._steps = sorted({s for (lo, hi), _ in self._ranges for s in range(lo, hi + 1)})
        return self._steps

    def covering(self, step: int) -> list[Part]:
        """Every part that holds ``step`` (all ranks, attempts and parts)."""
        s = int(step)
        return [p for (lo, hi), ps in self._ranges if lo <= s <= hi for p in ps]

    def attempts(self) -> dict[int, int]:
        """``{step: the latest attempt that holds it}``."""
        out: dict[int, int] = {}
        for (lo, hi), ps in self._ranges:
            a = max(p.attempt for p in ps)
            for s in range(lo, hi + 1):
                if out.get(s, -1) < a:
                    out[s] = a
        return out

    def for_step(self, step: int, attempt: Optional[int] = None) -> list[Part]:
        """The parts to read for ``step``, one per rank, sorted by rank: those of ``attempt`` (None: the latest
        attempt holding the step), and per rank the newest (:attr:`Part.order`).  Empty when none holds it."""
        cands = self.covering(step)
        if not cands:
            return []
        a = max(p.attempt for p in cands) if attempt is None else int(attempt)
        best: dict[int, Part] = {}
        for p in cands:
            if p.attempt == a and (p.rank not in best or p.order > best[p.rank].order):
                best[p.rank] = p
        return [best[r] for r in sorted(best)]

    def ranks(self) -> list[int]:
        """The sorted ranks with a file in the table."""
        return sorted({p.rank for p in self.parts})


class RunLayout:
    """Where each file of the run directory at ``location`` lives (module docstring for the tree).

    ``location``: a local path, a ``file://`` URI or an ``s3://`` URI (:func:`triage_monitor.rundir.storage.open_store`;
    another scheme raises :class:`~triage_monitor.errors.UnsupportedLocationError` naming it).  Names are paths
    relative to the run directory, read and written through :attr:`store`.  Only :meth:`index`,
    :meth:`lock_files` and :meth:`holds_run` look at the storage (listing, never reading a file).
    """

    def __init__(self, location) -> None:
        self.store: Store = location if isinstance(location, Store) else open_store(location)
        #: the run directory as a user names it in messages (a local path, or the URI)
        self.display = self.store.display()

    def __repr__(self) -> str:
        return f"RunLayout({self.display!r})"

    @property
    def location(self) -> str:
        """The location as given (what a worker process opens the same run with)."""
        return self.store.location

    @property
    def is_local(self) -> bool:
        return self.store.is_local

    @property
    def root(self) -> Path:
        """The local directory of the run.

        Raises:
            UnsupportedLocationError: the run is on an object store."""
        return self.store.local()

    # ------------------------------------------------------------------------------------- manifest, tables
    manifest = MANIFEST

    @staticmethod
    def table_dir(table: str) -> str:
        """``<table>``: the directory of one of :data:`TABLES`."""
        return table

    @staticmethod
    def block(table: str, lo: int, hi: int, rank: int, attempt: int, part: int) -> str:
        """``<table>/steps-...parquet``: a sealed block (:func:`block_name`)."""
        return f"{table}/{block_name(lo, hi, rank, attempt, part)}"

    @staticmethod
    def pending(table: str, step: int, rank: int, attempt: int, part: int) -> str:
        """``<table>/.pending-...arrow``: a pending step (:func:`pending_name`)."""
        return f"{table}/{pending_name(step, rank, attempt, part)}"

    parse = staticmethod(parse_part)

    def index(self, table: str) -> TableIndex:
        """The :class:`TableIndex` of ``table``: one listing of its directory (empty when it has none).

        Raises:
            OSError: the directory cannot be listed."""
        parts = (parse_part(table, e.name, e.size, e.mtime_ns) for e in self.store.listdir(table))
        return TableIndex(table, (p for p in parts if p is not None))

    def step_attempts(self, indexes=None) -> dict[int, int]:
        """``{step: attempt}``: the latest attempt of each step, over the tables every logged step has records in
        (:data:`DENSE_TABLES`; ``indexes``: ``{table: TableIndex}`` already listed, the others are listed).  The
        rows of a step from an earlier attempt (a resumed job redid the step) are not read."""
        indexes = dict(indexes or {})
        out: dict[int, int] = {}
        for t in DENSE_TABLES:
            idx = indexes.get(t) or self.index(t)
            for s, a in idx.attempts().items():
                if out.get(s, -1) < a:
                    out[s] = a
        return out

    def holds_run(self) -> bool:
        """True when the directory holds a run: a manifest or one of the table directories."""
        return self.store.exists(MANIFEST) or any(self.store.is_dir(t) for t in TABLES)

    # -------------------------------------------------------------------------------------- writer locks
    @staticmethod
    def lock_name(rank: int) -> str:
        """``.writer-rank-<rank>.lock``: held (``flock``) by the process writing ``rank``; the lease object of
        that writer on an object store."""
        return f".writer-rank-{int(rank)}.lock"

    def lock_file(self, rank: int) -> Path:
        """The local path of :meth:`lock_name` (a local run)."""
        return self.root / self.lock_name(rank)

    def exclusive_lock_file(self, rank: int) -> Path:
        """``<root>/.writer-rank-<rank>.lock.excl``: the writer lock's stand-in where the file system has no
        ``flock`` (created with ``O_EXCL`` by the writer, removed at its close; :mod:`triage_monitor.rundir.locks`)."""
        return self.root / f".writer-rank-{int(rank)}.lock.excl"

    def lock_takeover_file(self, rank: int) -> Path:
        """``<root>/.writer-rank-<rank>.lock.excl.takeover``: held (``O_EXCL``) for the instant a writer removes a
        stale :meth:`exclusive_lock_file`, so that two starting writers cannot both take it over."""
        return self.root / f".writer-rank-{int(rank)}.lock.excl.takeover"

    def lock_files(self) -> list[str]:
        """The names of the writer lock files (lease objects) present in the directory, sorted."""
        return sorted(e.name for e in self.store.listdir("") if _LOCK_RE.match(e.name))

    @staticmethod
    def lock_rank(path) -> Optional[int]:
        """The rank of a :meth:`lock_name` (or a path ending in one), None for another name."""
        m = _LOCK_RE.match(Path(str(path)).name)
        return int(m.group(1)) if m else None

    # -------------------------------------------------------------------------------------- side folders
    @staticmethod
    def rank_claims(attempt: int) -> str:
        """``.ranks/<attempt>``: where hook processes without a rank claim one (a file per rank)."""
        return f".ranks/{int(attempt)}"

    @staticmethod
    def framework_dir(framework: str, job: str) -> str:
        """``.<framework>/<job>``: the files a framework hook shares between the processes of one job
        (e.g. ``.verl/<ray job id>/``)."""
        return f".{framework}/{job}"

    # ------------------------------------------------------------------------------------ offline analysis
    analysis_dir = "analysis"

    @staticmethod
    def states_cache(key: str) -> str:
        """``analysis/states-<key>.npz``: the cached per-step metric states of one setting."""
        return f"analysis/states-{key}.npz"

    # ------------------------------------------------------------------------------------ moving a run aside
    def replaced(self, stamp: str, n: int = 0) -> Path:
        """``<root>.replaced-<stamp>`` (``n`` > 0: ``...-<n>``): the sibling a replaced local run (``force``) moves
        to."""
        root = self.root
        return root.with_name(f"{root.name}.replaced-{stamp}" + (f"-{int(n)}" if n else ""))


def run_path(location, what: str = "run directory") -> Path:
    """The local path of an output that must be local (``--out`` of ``analyze``, ``report -o``): a path or a
    ``file://`` URI.

    Raises:
        UnsupportedLocationError: any other scheme, naming it."""
    return local_path(location, what)
