"""The file formats of a run's tables: writing a rank's steps into blocks, and reading a step or a block back.

A table's records of one rank go, step by step, into a *block* (names: :mod:`triage_monitor.rundir.layout`):

* each step is first written whole to its own **pending file**, an Arrow IPC stream compressed with LZ4
  (``<table>/.pending-<S>-rank-<R>-attempt-<A>-part-<P>.arrow``), through a temporary name and a rename (on an
  object store: one upload).  Once it is there, the step survives a killed process;
* the same step is appended as one or more row groups to the block's Parquet file, written under a hidden
  temporary name (``<table>/.tmp-*.parquet``; for an object store in a local spool directory);
* the block is **sealed** after ``roll_steps`` steps (aligned: it ends at a step S with ``(S + 1) % roll_steps ==
  0``), when its bytes pass ``roll_bytes``, before a step that is not the last + 1 or whose columns differ, and at
  close: the Parquet footer is written, the file is renamed to ``steps-<lo>-<hi>-...parquet`` (uploaded, on an
  object store), then the block's pending files are removed.

So at any time a rank has fewer than ``roll_steps`` pending files per table, and each block is one file holding its
steps ``lo..hi`` in order.  A killed writer leaves its open block's pending files; a reader reads them
(:func:`read_part`), and the next writer of that rank seals them (:func:`seal_pending`).  The tables
``quarantine`` and ``alerts`` have rows at some steps only: the writer hears of a step only when it has rows
there, a block holds the steps with rows of one ``roll_steps`` window (the steps between have none), and it is
sealed when a row of a later window comes, or at close.

Torch-free: pyarrow, numpy and the standard library.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence, TypedDict, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from .layout import DENSE_TABLES, TEMP_PREFIX, Part, RunLayout
from .storage import Store, StoreIdentity

log = logging.getLogger("triage_monitor.records")

#: Steps a block holds at most, by default (``MonitorConfig.roll_steps``).
ROLL_STEPS = 50
#: Bytes (of the columns written) after which a block is sealed early, by default (``MonitorConfig.roll_bytes``).
ROLL_BYTES = 1 << 30
#: Columns written without a dictionary: the per-token log-probs, nearly every value distinct, where a dictionary
#: only costs time (the writer's encode ~0.55x without it on them, files 0.72-0.90x the size:
#: benchmarks/bench_writer_encoding.py).  Every other column (ids, positions, the broadcast advantage, steps) keeps
#: pyarrow's default dictionary encoding.
PLAIN_COLUMNS = frozenset({"learner_logp", "sampler_logp"})
#: The pending files' IPC options, on the writer's own thread (no pool competing with training): LZ4 frames for a
#: step of :data:`COMPRESS_BYTES` or more (8.4 bytes a token instead of 31; with the file's removal at sealing
#: counted, the page cache's work on the uncompressed bytes costs more than the compression: 8.9 against 11.5 ns a
#: token at 34k tokens, 8.9 against 18.1 at 2.6M), none for a smaller one (a steps row, a few hundred tokens:
#: compressing its buffers costs more than it saves).
IPC_OPTIONS = ipc.IpcWriteOptions(compression="lz4", use_threads=False)
IPC_PLAIN = ipc.IpcWriteOptions(compression=None, use_threads=False)
COMPRESS_BYTES = 256 << 10


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns of ``schema`` written with a dictionary: all but :data:`PLAIN_COLUMNS`."""
    return [f.name for f in schema if f.name not in PLAIN_COLUMNS]


#: Columns whose min / max each row group records: the ones readers select row groups and files by (a step's rows
#: are found by the ``step`` statistics).  Statistics of every column cost the writer more than the encode itself.
STATISTICS_COLUMNS = ("step", "rank", "attempt")


class ParquetOptions(TypedDict):
    """The ``pq.write_table`` / ``pq.ParquetWriter`` keywords of :func:`parquet_options`."""

    use_dictionary: list[str]
    compression: str
    write_statistics: Union[list[str], bool]
    store_schema: bool


def parquet_options(schema: pa.Schema) -> ParquetOptions:
    """The writer options of every Parquet file of a run (``pq.write_table`` / ``pq.ParquetWriter`` keywords):
    a dictionary for every column but :data:`PLAIN_COLUMNS`, statistics of :data:`STATISTICS_COLUMNS`, no
    compression (the data after dictionary and plain encoding does not shrink under Snappy: the files are the
    same size, the write 0.4-0.6x the time; ``python benchmarks/bench_writer_encoding.py``), and no Arrow schema
    in the footer: a column given as a dictionary in memory (:func:`constant_column`) reads back as its value type
    (int64), as every reader takes it from the Parquet types."""
    stats = [c for c in STATISTICS_COLUMNS if c in schema.names]
    return {"use_dictionary": dictionary_columns(schema), "compression": "none", "write_statistics": stats or False,
            "store_schema": False}


def constant_column(value: int, n: int, zeros: Optional[pa.Array] = None) -> pa.DictionaryArray:
    """``n`` copies of the int64 ``value`` (a step's ``step``, ``rank``, ``attempt``) as a dictionary column: one
    byte a row in memory instead of eight (2.6M tokens: 2.6 MB instead of 21 MB a column), written to Parquet as
    the int64 column it stands for (:func:`parquet_options`), read back from a pending file as one
    (:func:`plain`).  ``zeros``: ``n`` int8 zeros to use as its indices (the constant columns of a step share one
    array); built when not given."""
    index = pa.array(np.zeros(int(n), np.int8)) if zeros is None else zeros
    # every index is 0, the dictionary's one entry: no bounds check (a pass over the indices)
    return pa.DictionaryArray.from_arrays(index, pa.array([int(value)], pa.int64()), safe=False)


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with its dictionary fields as their value types."""
    return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type,
                               f.nullable, f.metadata) for f in schema], metadata=schema.metadata)


def plain(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary columns as their value types (what a Parquet reader of the run gets)."""
    if not any(pa.types.is_dictionary(f.type) for f in table.schema):
        return table
    return table.cast(plain_schema(table.schema))


def write_parquet(store: Store, rel: str, table: pa.Table) -> None:
    """Write ``table`` as one Parquet file at ``rel`` of ``store``, whole or not at all
    (:meth:`~triage_monitor.rundir.storage.Store.writing`).

    Raises:
        OSError, pyarrow.ArrowException: it cannot be written (nothing is left behind)."""
    with store.writing(rel, ".parquet") as out:
        pq.write_table(table, out, **parquet_options(table.schema))


def write_pending(store: Store, rel: str, table: pa.Table) -> None:
    """Write one step's ``table`` as an Arrow IPC stream at ``rel`` (LZ4 from :data:`COMPRESS_BYTES`), whole or
    not at all.

    Raises:
        OSError, pyarrow.ArrowException: it cannot be written (nothing is left behind)."""
    options = IPC_OPTIONS if table.nbytes >= COMPRESS_BYTES else IPC_PLAIN
    with store.writing(rel, ".arrow") as out:
        if store.is_local:
            # the hidden temporary file the store renames into place, written through pyarrow's own file (a Python
            # file costs a bytes object, a copy and the GIL for every buffer: 1.5-2.6x the CPU of the write at 36k
            # tokens, benchmarks/bench_writer_encoding.py); the store's file stays open and empty meanwhile
            with pa.OSFile(out.name, "wb") as native, ipc.new_stream(native, table.schema, options=options) as w:
                w.write_table(table)
        else:
            with ipc.new_stream(out, table.schema, options=options) as w:
                w.write_table(table)


# ------------------------------------------------------------------------------------------------ reading
_FOOTERS: "OrderedDict" = OrderedDict()
_FOOTERS_LOCK = threading.Lock()
#: Parquet footers kept per process (a reader of a step opens the same blocks for each of their steps).
FOOTER_CACHE = 4096


def _footer(store: Store, part: Part) -> pq.FileMetaData:
    key = (store.identity, part.name, part.size, part.mtime_ns)
    with _FOOTERS_LOCK:
        md = _FOOTERS.get(key)
        if md is not None:
            _FOOTERS.move_to_end(key)
            return md
    with store.open_input(part.name) as f:
        md = pq.read_metadata(f)
    with _FOOTERS_LOCK:
        _FOOTERS[key] = md
        while len(_FOOTERS) > FOOTER_CACHE:
            _FOOTERS.popitem(last=False)
    return md


def read_part(store: Store, part: Part, columns: Optional[Sequence[str]] = None,
              step: Optional[int] = None) -> pa.Table:
    """The rows of ``part`` (a sealed block or a pending file), or only those of ``step``; ``columns``: only
    these (each must exist).  A pending file sealed into its block since the table was listed is read from the
    block.

    Raises:
        OSError, pyarrow.ArrowException, ValueError, KeyError: the file cannot be read (truncated, missing, a
            column absent); the message starts with the file's location."""
    try:
        try:
            return _read_part(store, part, columns, step)
        except FileNotFoundError:
            sealed = None if part.sealed else _sealed_instead(store, part)
            if sealed is None:
                raise
            return _read_part(store, sealed, columns, part.lo)
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        where = store.display(part.name)
        if where in str(exc):
            raise
        try:
            err = type(exc)(f"{where}: {exc}")
        except Exception:  # noqa: BLE001 — an exception type that takes other arguments: raised as it is
            raise exc from None
        raise err from exc


def _sealed_instead(store: Store, part: Part) -> Optional[Part]:
    """The sealed block that now holds the step of the pending file ``part`` (sealed, and the pending file removed,
    since the reader listed the table), or None."""
    for p in RunLayout(store).index(part.table).covering(part.lo):
        if p.sealed and (p.rank, p.attempt, p.part) == (part.rank, part.attempt, part.part):
            return p
    return None


def _read_part(store: Store, part: Part, columns, step) -> pa.Table:
    cols = list(columns) if columns else None
    if not part.sealed:
        with store.open_input(part.name) as f:
            t = ipc.open_stream(f).read_all()
        if cols is not None:
            t = t.select(cols)
        return plain(t)
    if step is None or part.lo == part.hi:
        with store.open_input(part.name) as f:
            return pq.read_table(f, columns=cols)
    md = _footer(store, part)
    step = int(step)
    index = _step_index(store, part, md)
    if index is None:                        # no statistics: read the step column to select the rows
        with store.open_input(part.name) as f:
            pf = pq.ParquetFile(f, metadata=md)
            t = pf.read(columns=None if cols is None else list(dict.fromkeys(["step", *cols])))
        t = t.filter(pc.equal(t.column("step"), step))
        return t if cols is None else t.select(cols)
    lo, hi = index
    groups = np.flatnonzero((lo <= step) & (step <= hi)).tolist()
    if not groups:
        schema = md.schema.to_arrow_schema()
        return schema.empty_table() if cols is None else schema.empty_table().select(cols)
    shared = {i for i in groups if lo[i] != hi[i]}
    if not shared:                           # row groups of this step alone
        with store.open_input(part.name) as f:
            return pq.ParquetFile(f, metadata=md).read_row_groups(groups, columns=cols)
    # a row group of several small steps: decoded once for all of them (_shared_group), this step's rows taken
    key = (_file_key(store, part), None if cols is None else tuple(cols))
    pieces = {i: _take_piece((key, i), step) for i in shared}
    pf = None
    try:
        out = []
        for i in groups:
            if pieces.get(i) is not None:
                out.append(pieces[i])
                continue
            if pf is None:
                f = store.open_input(part.name)
                pf = pq.ParquetFile(f, metadata=md)
            if i in shared:
                out.append(_shared_group(pf, (key, i), i, cols, step))
            else:
                out.append(pf.read_row_groups([i], columns=cols))
    finally:
        if pf is not None:
            f.close()
    return out[0] if len(out) == 1 else pa.concat_tables(out)


#: Decoded rows of the row groups that several steps share (a rank's small steps, gathered by the writer into one row
#: group of up to :data:`ROW_GROUP_BYTES`), split by step and kept until each step's rows are read once: a reader of
#: the steps one by one decodes such a row group once, not once per step it holds (a 32-rank run of 36k-token
#: rank-steps: a 17-step row group decoded 17 times, 9x the decode of a 1-rank run of the same tokens;
#: benchmarks/bench_ranks.py).  At most this many bytes are kept: of a row group whose leftovers do not all fit, the
#: next steps' rows that fit (the others are decoded from it again when read, and kept as room is freed; dropping
#: older leftovers instead would make every rank's row group evict the next one's); :func:`forget_shared_groups`
#: drops them all.  A reader of R ranks keeps up to R row groups' leftovers: ~24 bytes a token of a rank's 4 MiB
#: row group, so ~4-6 MB a rank; from ~200 ranks of such steps some steps are decoded more than once (not measured).
SHARED_GROUP_BYTES = 1 << 30
_SHARED: "OrderedDict" = OrderedDict()       # ((file, columns), row group) -> {step: table}
_SHARED_LOCK = threading.Lock()
_shared_bytes = 0


class FileKey(NamedTuple):
    """What names the bytes of a part (:func:`_file_key`): its store, name, size and modification time."""

    store: Union[StoreIdentity, str]
    name: str
    size: int
    mtime_ns: int


def _file_key(store: Store, part: Part) -> FileKey:
    """What names the bytes of ``part``: a file rewritten (another size or modification time) is another key."""
    return FileKey(getattr(store, "identity", store.location), part.name, part.size, part.mtime_ns)


_INDEXES: "OrderedDict" = OrderedDict()


class StepIndex(NamedTuple):
    """The ``(min, max)`` step of each row group of a block (:func:`_step_index`): two int64 arrays."""

    lo: np.ndarray
    hi: np.ndarray


def _step_index(store: Store, part: Part, md: pq.FileMetaData) -> Optional[StepIndex]:
    """``(min, max)`` step of each row group of ``part`` (int64 arrays; an empty row group holds none: min > max),
    from its footer's statistics, kept per file (:data:`FOOTER_CACHE` of them); None when a non-empty row group
    has no ``step`` statistics."""
    key = _file_key(store, part)
    with _FOOTERS_LOCK:
        if key in _INDEXES:
            _INDEXES.move_to_end(key)
            return _INDEXES[key]
    names = md.schema.names
    out: Optional[StepIndex] = None
    if "step" in names:
        col = names.index("step")
        lo = np.ones(md.num_row_groups, np.int64)
        hi = np.zeros(md.num_row_groups, np.int64)
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            if rg.num_rows == 0:
                continue
            c = rg.column(col)
            if not c.is_stats_set or not c.statistics.has_min_max:
                break
            lo[i], hi[i] = c.statistics.min, c.statistics.max
        else:
            out = StepIndex(lo, hi)
    with _FOOTERS_LOCK:
        _INDEXES[key] = out
        while len(_INDEXES) > FOOTER_CACHE:
            _INDEXES.popitem(last=False)
    return out


def _take_piece(key: tuple, step: int) -> Optional[pa.Table]:
    """``step``'s rows of the shared row group ``key`` if kept (removed: each step's rows are handed out once)."""
    global _shared_bytes
    with _SHARED_LOCK:
        pieces = _SHARED.get(key)
        if pieces is None or step not in pieces:
            return None
        t, nbytes = pieces.pop(step)
        _shared_bytes -= nbytes
        if not pieces:
            del _SHARED[key]
        return t


def _shared_group(pf: pq.ParquetFile, key: tuple, group: int, cols, step: int) -> pa.Table:
    """``step``'s rows of the row group ``group`` that several steps share: the group is decoded whole (its ``step``
    column too), split by step in file order, and the other steps' rows kept for their readers (:data:`_SHARED`)."""
    global _shared_bytes
    t = pf.read_row_groups([group], columns=None if cols is None else list(dict.fromkeys(["step", *cols])))
    steps = t.column("step").to_numpy()
    if cols is not None:
        t = t.select(cols)
    pieces: dict = {}
    if steps.size and np.all(steps[1:] >= steps[:-1]):         # as written: each step's rows one run, in order
        cut = np.flatnonzero(steps[1:] != steps[:-1]) + 1
        for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [steps.size]])):
            pieces[int(steps[a])] = t.slice(int(a), int(b - a))
    else:
        for s in np.unique(steps):
            pieces[int(s)] = t.filter(pa.array(steps == s))
    mine = pieces.pop(step, None)
    if mine is None:
        mine = t.slice(0, 0)
    if pieces:
        # each piece's bytes: its share of the group's (a slice's own nbytes costs more than the slicing)
        per_row = t.nbytes / max(t.num_rows, 1)
        with _SHARED_LOCK:
            old = _SHARED.pop(key, None)
            if old is not None:
                _shared_bytes -= sum(n for _, n in old.values())
            kept = {}
            for s in sorted(pieces):             # the next steps first, as many as there is room for
                n = int(pieces[s].num_rows * per_row)
                if _shared_bytes + n > SHARED_GROUP_BYTES:
                    break
                kept[s] = (pieces[s], n)
                _shared_bytes += n
            if kept:
                _SHARED[key] = kept
    return mine


def forget_shared_groups() -> None:
    """Drop the kept rows of shared row groups (:data:`SHARED_GROUP_BYTES`): a reader done with its steps."""
    global _shared_bytes
    with _SHARED_LOCK:
        _SHARED.clear()
        _shared_bytes = 0


# ------------------------------------------------------------------------------------------------ writing
class _OpenBlock:
    """The block being written: its steps so far, its Parquet writer and temporary file, the steps not yet in a
    row group, its pending files."""

    def __init__(self, lo: int, schema: pa.Schema, tmp: str, part: int):
        self.lo = self.hi = lo
        self.schema = schema
        self.tmp = tmp
        self.part = part
        self.bytes = 0
        self.rows = 0
        self.pending: list = []
        self.writer: Optional[pq.ParquetWriter] = None
        #: steps waiting for their row group: small steps share one (at most ROW_GROUP_BYTES of them)
        self.buffer: list = []
        self.buffered = 0


#: Steps smaller than :data:`ROW_GROUP_STEP_BYTES` (bytes of their columns) are gathered into one row group of at
#: most this many bytes: a row group a step would cost the writer a column chunk per column per step (the steps table
#: has ~180 columns and one row a step), and readers as many chunks.  No larger than a step of its own: a reader of
#: many ranks keeps each rank's decoded shared group until its steps are read (:data:`SHARED_GROUP_BYTES`), so the
#: group's size times the ranks is the reader's memory (16 MiB groups: 3.0 GB peak for 1 G tokens of 64 ranks,
#: benchmarks/bench_ranks.py --big).
ROW_GROUP_BYTES = 4 << 20
#: A step of this size or more (bytes of its columns as written: ~155k token rows) is a row group of its own (more,
#: over 2**20 rows: pyarrow's bound), written at once: a reader of one step decodes that step alone, and the writer
#: holds no step in memory after its pending file.  Smaller steps share row groups (readers decode a shared group once
#: for all its steps, :func:`read_part`): a row group costs the writer ~0.27 ms whatever its size, 13 % more CPU a
#: token at 31k-token steps when each was its own group (interleaved in one process, load 7), under 2 % from here.
ROW_GROUP_STEP_BYTES = 4 << 20


class BlockWriter:
    """The blocks of one table of one rank and attempt (module docstring), written on the writer thread.

    Args:
        store: the run's :class:`~triage_monitor.rundir.storage.Store`.
        table, rank, attempt: what the blocks hold.
        roll_steps, roll_bytes: when a block is sealed.
        spool: a local directory for the blocks being written when the store is not local.

    A step of :data:`ROW_GROUP_STEP_BYTES` or more is written as its own row group at once; smaller steps are kept in
    memory until they fill a row group of :data:`ROW_GROUP_BYTES` or the block is sealed (they are on disk already,
    in their pending files).  :meth:`write` raises the I/O error of a step's pending
    file (the caller counts its rows as dropped); an error of the block's Parquet file abandons the block (its
    pending files stay, sealed by :meth:`close`) and is kept in :attr:`error`.
    """

    def __init__(self, store: Store, table: str, rank: int, attempt: int, roll_steps: int = ROLL_STEPS,
                 roll_bytes: int = ROLL_BYTES, spool: Optional[str] = None):
        self.store, self.table, self.rank, self.attempt = store, table, int(rank), int(attempt)
        self.roll_steps, self.roll_bytes = max(int(roll_steps), 1), int(roll_bytes)
        self.dense = table in DENSE_TABLES
        self.spool = spool
        self.open: Optional[_OpenBlock] = None
        self.next_part = 0
        #: parts whose block could not be completed: their pending files are sealed at close
        self.abandoned: list = []
        #: blocks sealed, files removed
        self.sealed = 0
        #: the last error of a block whose steps are nevertheless on disk (pending files); the caller resets it
        self.error: Optional[BaseException] = None

    def _temp(self) -> str:
        # the rank and attempt in the name: the next writer of the rank removes what a killed attempt left
        # (remove_stale_temps)
        name = f"{temp_prefix(self.rank, self.attempt)}{uuid.uuid4().hex}.parquet"
        if self.store.is_local:
            self.store.makedirs(self.table)
            return self.store.full(f"{self.table}/{name}")
        return os.path.join(self.spool or tempfile.gettempdir(), name)

    def write(self, step: int, table: pa.Table) -> None:
        """Write ``step``'s rows (``table``, possibly empty): its pending file, then the rows into the open block;
        seal the block when it is complete.

        Once the pending file is on disk the step is written, whatever follows: an error of the block's Parquet
        file then abandons the block (its steps stay in their pending files, sealed at :meth:`close`) and is kept
        in :attr:`error` for the caller to report.

        Raises:
            OSError, pyarrow.ArrowException: the step's pending file could not be written (nothing of the step
                is on disk; the open block goes on, and is sealed at the next step, which is not its last + 1)."""
        step = int(step)
        b = self.open
        if b is not None and (not self._continues(b, step) or not table.schema.equals(b.schema)):
            self.seal()
            b = None
        if b is None:
            if not self.dense and table.num_rows == 0:
                return                       # no rows and no block: nothing to keep
            b = self.open = _OpenBlock(step, table.schema, self._temp(), self.next_part)
            self.next_part += 1
        if table.num_rows or self.dense:
            rel = RunLayout.pending(self.table, step, self.rank, self.attempt, b.part)
            try:
                write_pending(self.store, rel, table)
            except BaseException:
                if b.rows == 0 and not b.pending:     # a block opened for this step alone: it holds nothing
                    self.open = None
                raise
            b.pending.append(rel)
        b.hi = step
        b.rows += table.num_rows
        b.bytes += table.nbytes
        try:
            if table.num_rows and table.nbytes >= ROW_GROUP_STEP_BYTES:
                self._flush(b)                   # the smaller steps before it, in order
                b.buffer.append(table)           # then this step alone
                self._flush(b)
            elif table.num_rows:
                b.buffer.append(table)
                b.buffered += table.nbytes
                if b.buffered >= ROW_GROUP_BYTES:
                    self._flush(b)
            if (step + 1) % self.roll_steps == 0 or b.bytes >= self.roll_bytes:
                self.seal()
        except Exception as exc:  # noqa: BLE001 — the step is safe in its pending file: only the block is lost
            self.error = exc
            self._abandon()

    def _continues(self, b: _OpenBlock, step: int) -> bool:
        """Whether ``step`` goes into the open block: the next step (a table every step has records in), or a
        later step of the same ``roll_steps`` window (a table with rows at some steps only: it hears of a step
        only when it has rows there, so the steps between are ones without)."""
        if self.dense:
            return step == b.hi + 1
        return step > b.hi and step // self.roll_steps == b.lo // self.roll_steps

    def _flush(self, b: _OpenBlock) -> pq.ParquetWriter:
        """Write the buffered steps as one row group (more when over pyarrow's bound of rows); returns the block's
        Parquet writer (opened on the first call)."""
        if b.writer is None:
            b.writer = pq.ParquetWriter(b.tmp, b.schema, **parquet_options(b.schema))
        writer = b.writer
        if b.buffer:
            t = b.buffer[0] if len(b.buffer) == 1 else pa.concat_tables(b.buffer)
            writer.write_table(t, row_group_size=max(t.num_rows, 1))
        b.buffer, b.buffered = [], 0
        return writer

    def _abandon(self) -> None:
        b, self.open = self.open, None
        if b is None:
            return
        if b.writer is not None:
            try:
                b.writer.close()
            except Exception:  # noqa: BLE001 — the block is given up; its pending files keep its steps
                pass
        _remove_local(b.tmp)
        if b.pending:
            self.abandoned.append(b.part)

    def seal(self) -> None:
        """Seal the open block (module docstring); nothing when none is open.

        Raises:
            OSError, pyarrow.ArrowException: the block could not be completed (its pending files stay, sealed at
                :meth:`close`)."""
        b = self.open
        if b is None:
            return
        try:
            self._flush(b).close()
            b.writer = None
            if b.rows or self.dense:
                _publish(self.store, b.tmp, RunLayout.block(self.table, b.lo, b.hi, self.rank, self.attempt, b.part))
            _remove_local(b.tmp)
        except BaseException:
            self._abandon()
            raise
        self.open = None
        self.sealed += 1
        for rel in b.pending:
            self.store.delete(rel)

    def close(self) -> None:
        """Seal the open block, then the pending files of the blocks abandoned after an error.

        Raises:
            OSError, pyarrow.ArrowException: a block could not be sealed."""
        try:
            self.seal()
        finally:
            if self.abandoned:
                parts, self.abandoned = self.abandoned, []
                idx = RunLayout(self.store).index(self.table)
                mine = [p for p in idx.parts if not p.sealed and p.rank == self.rank and p.attempt == self.attempt
                        and p.part in parts]
                seal_pending(self.store, mine, self.spool)


def temp_prefix(rank: int, attempt: int) -> str:
    """The start of the hidden temporary name of an open block of (``rank``, ``attempt``)."""
    return f"{TEMP_PREFIX}rank-{int(rank):04d}-attempt-{int(attempt)}-"


def remove_stale_temps(store: Store, table: str, rank: int, attempt: int) -> list[str]:
    """Remove the open-block temporary files that other attempts of ``rank`` left in ``table``'s directory (a local
    run; a killed writer's: the caller holds the rank's writer lock, so no other writer of the rank is alive).
    Returns the names removed; an OSError leaves a file where it is."""
    if not store.is_local:
        return []
    mine, prefix = temp_prefix(rank, attempt), f"{TEMP_PREFIX}rank-{int(rank):04d}-attempt-"
    gone: list[str] = []
    try:
        entries = store.listdir(table)
    except OSError:
        return []
    for e in entries:
        if e.name.startswith(prefix) and not e.name.startswith(mine) and e.name.endswith(".parquet"):
            try:
                os.unlink(store.full(f"{table}/{e.name}"))
                gone.append(e.name)
            except OSError:
                pass
    return gone


def _publish(store: Store, tmp: str, rel: str) -> None:
    """Put the finished local file ``tmp`` at ``rel``: a rename on a local store, an upload otherwise."""
    if store.is_local:
        os.replace(tmp, store.full(rel))
        return
    pafs.copy_files(tmp, store.full(rel), source_filesystem=pafs.LocalFileSystem(), destination_filesystem=store.fs)


def _remove_local(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def seal_pending(store: Store, parts: Sequence[Part], spool: Optional[str] = None) -> list[str]:
    """Seal pending files (those a killed writer left, or a block abandoned after an error) into blocks: per
    (table, rank, attempt, part), their steps in order into one Parquet block (a gap in a table every step has
    records in starts another block; the other tables keep one block, a missing step being a step without rows),
    then the pending files are removed.  A pending file that cannot be read is left where it is and logged.

    Returns:
        the names of the blocks written.

    Raises:
        OSError, pyarrow.ArrowException: a block could not be written (the pending files stay)."""
    groups: dict = {}
    for p in parts:
        if not p.sealed:
            groups.setdefault((p.table, p.rank, p.attempt, p.part), []).append(p)
    written = []
    for (table, rank, attempt, part), ps in sorted(groups.items()):
        schemas, ok = [], []                 # each readable pending file's schema (its first message only)
        for p in sorted(ps, key=lambda p: p.lo):
            try:
                with store.open_input(p.name) as f:
                    schemas.append(plain_schema(ipc.open_stream(f).schema))     # what read_part gives
                ok.append(p)
            except (OSError, pa.ArrowException, ValueError) as exc:
                log.warning("triage-monitor: pending file %s is unreadable (%s); left in place", p.name, exc)
        runs: list = []
        for p, schema in zip(ok, schemas):
            if runs and (p.lo == runs[-1][-1][0].lo + 1 or table not in DENSE_TABLES) and schema.equals(runs[-1][-1][1]):
                runs[-1].append((p, schema))
            else:
                runs.append([(p, schema)])
        sealed: list = []
        for run in runs:
            lo, hi, schema = run[0][0].lo, run[-1][0].lo, run[0][1]
            tmp = os.path.join(store.full(table) if store.is_local else (spool or tempfile.gettempdir()),
                               f"{TEMP_PREFIX}{uuid.uuid4().hex}.parquet")
            try:
                with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as w:
                    buffer: list = []
                    for p, _ in run:                      # one step in memory at a time, small ones gathered
                        buffer.append(read_part(store, p))
                        if sum(t.nbytes for t in buffer) >= ROW_GROUP_BYTES or p is run[-1][0]:
                            t = pa.concat_tables(buffer)
                            w.write_table(t, row_group_size=max(t.num_rows, 1))
                            buffer = []
                name = RunLayout.block(table, lo, hi, rank, attempt, part)
                _publish(store, tmp, name)
                written.append(name)
                sealed.extend(p for p, _ in run)
            finally:
                _remove_local(tmp)
        ok = sealed
        for p in ok:
            store.delete(p.name)
    return written
