"""The names of a run directory: the one place that says where each file of a run lives.

Every module that writes or reads a run directory (the writer, :func:`triage_monitor.analysis.open_run`, the
dashboard, the framework hooks) asks :class:`RunLayout` for its paths; changing how runs are stored is this
file plus its tests.  The layout (README "The run directory")::

    run.json                                                  manifest (triage_monitor.manifest.RunManifest)
    tokens/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet      valid tokens of one step on one rank
    steps/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet       one row of live metrics
    quarantine/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet  tokens excluded by on_invalid="quarantine"
    alerts/step-<S:08d>-rank-<R:04d>-attempt-<A>.parquet      alerts raised at that step
    analysis/states-<key>.npz                                 cached per-step metric states (offline)
    .writer-rank-<R>.lock                                     held (flock) by the process writing rank R
    .writer-rank-<R>.lock.excl                                its stand-in on a file system without flock
                                                              (created O_EXCL, holds "pid <p> on <host>, ...")
    .ranks/<attempt>/<n>                                      rank claims of hook processes without a rank
    .<framework>/<job>/                                       a framework hook's shared files (e.g. .verl/)

``attempt`` (nanoseconds since the epoch at monitor start, shared by the ranks of one job start) is in the
name: a resumed job writes a repeated step under its newer attempt, and readers keep each step's latest
attempt (:meth:`RunLayout.latest`).  Zero-padded names sort in step order.  Files are written under hidden
temporary names (:func:`temp_path`, ``.tmp-*``, which pyarrow's dataset discovery skips) and renamed.

Imports nothing but the standard library.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import NamedTuple, Optional

from .errors import UnsupportedLocationError

#: The manifest's file name.
MANIFEST = "run.json"
#: The run's tables, each a directory of Parquet files.
TABLES = ("tokens", "steps", "quarantine", "alerts")
#: Prefix of the hidden temporary files a write goes through (readers and dataset discovery skip them).
TEMP_PREFIX = ".tmp-"

_FILE_RE = re.compile(r"^step-(-?\d+)-rank-(\d+)-attempt-(\d+)\.parquet$")
_LOCK_RE = re.compile(r"^\.writer-rank-(\d+)\.lock$")


class TableFile(NamedTuple):
    """One table file of a run: the (step, rank, attempt) its name says, and its path."""

    step: int
    rank: int
    attempt: int
    path: Path


def parse_table_file(name: str) -> Optional[tuple]:
    """``(step, rank, attempt)`` (ints) of a table file name (:meth:`RunLayout.table_file`), None for any other
    name (a temporary file, a directory of another layout, a stray file)."""
    m = _FILE_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


#: A location given as ``scheme://...`` (an object store or a remote file system).
_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: The same after ``pathlib.Path`` has collapsed the double slash (``Path("s3://b/r")`` is ``s3:/b/r``): a first
#: component of two or more scheme characters and a colon (one letter and a colon is a Windows drive).
_COLLAPSED_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):$")


def run_path(location, what: str = "run directory") -> Path:
    """The local path of a run directory given as a path or a string: ``file://`` URIs become their path, any
    other URI scheme (``s3://``, ``gs://``, ``hdfs://``, ...; also as ``Path`` has collapsed it, ``s3:/b/r``)
    raises :class:`~triage_monitor.errors.UnsupportedLocationError` naming it, so that a remote destination is
    never written to a local folder of that name.  ``what`` names the location in the message (an output file:
    ``"--out"``)."""
    text = str(location)
    m = _URI_RE.match(text)
    scheme = m.group(1) if m else None
    rest = text.split("://", 1)[1] if scheme else ""
    if scheme is None:
        parts = Path(text).parts
        c = _COLLAPSED_URI_RE.match(parts[0]) if parts else None
        if c:
            scheme, rest = c.group(1), text[len(c.group(1)) + 2:]        # after "<scheme>:/"
            text = f"{scheme}://{rest}"
    if scheme is None:
        return Path(location)
    if scheme.lower() == "file":
        return Path("/" + rest.lstrip("/"))
    raise UnsupportedLocationError(text, scheme, what)


def temp_path(directory, suffix: str = "", kind: str = "") -> Path:
    """A new hidden temporary path in ``directory``: ``.tmp-<kind><32 hex digits><suffix>`` (a file written,
    then renamed into place; ``kind="probe-"``: the start check's probe file, written and removed)."""
    return Path(directory) / f"{TEMP_PREFIX}{kind}{uuid.uuid4().hex}{suffix}"


class RunLayout:
    """Where each file of the run directory ``root`` lives (see the module docstring for the tree).

    Only names: nothing here writes, and only :meth:`files`, :meth:`lock_files` and :meth:`holds_run` look at
    the disk (listing, never reading a file).
    """

    def __init__(self, root):
        self.root = run_path(root)       # an unsupported URI scheme: UnsupportedLocationError, never a local folder

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    # ------------------------------------------------------------------------------------- manifest, tables
    @property
    def manifest(self) -> Path:
        """``<root>/run.json``."""
        return self.root / MANIFEST

    def table_dir(self, table: str) -> Path:
        """``<root>/<table>``: the directory of one of :data:`TABLES`."""
        return self.root / table

    def table_file(self, table: str, step: int, rank: int, attempt: int) -> Path:
        """``<root>/<table>/step-<step:08d>-rank-<rank:04d>-attempt-<attempt>.parquet``: the file of (table, step,
        rank) written by ``attempt``."""
        return self.table_dir(table) / f"step-{int(step):08d}-rank-{int(rank):04d}-attempt-{int(attempt)}.parquet"

    parse = staticmethod(parse_table_file)

    def files(self, table: str) -> dict:
        """``{step: [TableFile, ...]}`` of the complete files of ``table`` (every rank and attempt, in listing
        order); entries whose name is no table file name (temporary files, anything else) and directories are
        skipped.  Empty when the table has no directory."""
        out: dict = {}
        root = self.table_dir(table)
        if not root.is_dir():
            return out
        for entry in root.iterdir():
            key = parse_table_file(entry.name)
            if key is not None and entry.is_file():
                step, rank, attempt = key
                out.setdefault(step, []).append(TableFile(step, rank, attempt, entry))
        return out

    @staticmethod
    def latest(files) -> list:
        """The files to read of one step: those of its latest attempt, by rank (``TableFile`` s).

        All ranks of one process start share one attempt id, so a step redone by a resumed job, even on fewer
        ranks, is read from the new attempt alone."""
        files = list(files)
        if not files:
            return []
        newest = max(f.attempt for f in files)
        return sorted((f for f in files if f.attempt == newest), key=lambda f: f.rank)

    def latest_files(self, table: str) -> dict:
        """``{step: [TableFile, ...]}``: :meth:`latest` of each step of :meth:`files`, steps in order."""
        return {s: self.latest(fs) for s, fs in sorted(self.files(table).items())}

    def holds_run(self) -> bool:
        """True when the directory holds a run: a manifest or one of the table directories."""
        return self.manifest.exists() or any(self.table_dir(t).is_dir() for t in TABLES)

    # -------------------------------------------------------------------------------------- writer locks
    def lock_file(self, rank: int) -> Path:
        """``<root>/.writer-rank-<rank>.lock``: held (``flock``) by the process writing ``rank``."""
        return self.root / f".writer-rank-{int(rank)}.lock"

    def exclusive_lock_file(self, rank: int) -> Path:
        """``<root>/.writer-rank-<rank>.lock.excl``: the writer lock's stand-in where the file system has no
        ``flock`` (created with ``O_EXCL`` by the writer, removed at its close; :mod:`triage_monitor.locks`)."""
        return self.root / f".writer-rank-{int(rank)}.lock.excl"

    def lock_takeover_file(self, rank: int) -> Path:
        """``<root>/.writer-rank-<rank>.lock.excl.takeover``: held (``O_EXCL``) for the instant a writer removes a
        stale :meth:`exclusive_lock_file`, so that two starting writers cannot both take it over."""
        return self.root / f".writer-rank-{int(rank)}.lock.excl.takeover"

    def lock_files(self) -> list:
        """The writer lock files present in the directory, sorted by name."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if _LOCK_RE.match(p.name))

    @staticmethod
    def lock_rank(path) -> Optional[int]:
        """The rank of a :meth:`lock_file` path, None for another name."""
        m = _LOCK_RE.match(Path(path).name)
        return int(m.group(1)) if m else None

    # -------------------------------------------------------------------------------------- side folders
    def rank_claims(self, attempt: int) -> Path:
        """``<root>/.ranks/<attempt>``: where hook processes without a rank claim one (a file per rank)."""
        return self.root / ".ranks" / str(int(attempt))

    def framework_dir(self, framework: str, job: str) -> Path:
        """``<root>/.<framework>/<job>``: the files a framework hook shares between the processes of one job
        (e.g. ``.verl/<ray job id>/``)."""
        return self.root / f".{framework}" / str(job)

    # ------------------------------------------------------------------------------------ offline analysis
    @property
    def analysis_dir(self) -> Path:
        """``<root>/analysis``: what offline commands save (the state cache, ``analyze``'s table)."""
        return self.root / "analysis"

    def states_cache(self, key: str) -> Path:
        """``<root>/analysis/states-<key>.npz``: the cached per-step metric states of one setting."""
        return self.analysis_dir / f"states-{key}.npz"

    def relative(self, path) -> str:
        """``path`` relative to the run directory, with ``/`` (e.g. ``tokens/step-....parquet``): the name a
        cache key uses, the same wherever the run is copied or moved.

        Raises:
            ValueError: ``path`` is not inside the run directory."""
        return Path(path).relative_to(self.root).as_posix()

    # ------------------------------------------------------------------------------------ moving a run aside
    def replaced(self, stamp: str, n: int = 0) -> Path:
        """``<root>.replaced-<stamp>`` (``n`` > 0: ``...-<n>``): the sibling a replaced run (``force``) moves to."""
        name = f"{self.root.name}.replaced-{stamp}" + (f"-{int(n)}" if n else "")
        return self.root.with_name(name)
