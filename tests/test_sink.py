"""The background writer (triage_monitor.sink) and the blocks it writes (triage_monitor.blocks): typed queue items,
the flush deadline, the queue bound, write errors counted and reported once, the columns cast to a schema; a
rank's steps in one Parquet block per ``roll_steps`` steps, each step in a pending file until its block is
sealed, what rolls a block early, and the pending files a killed writer leaves sealed by the next one."""

import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runfiles import files, parts
from triage_monitor.rundir.blocks import BlockWriter, read_part, seal_pending, write_pending
from triage_monitor.rundir.layout import RunLayout
from triage_monitor.rundir.sink import ROW_BYTES, DeferredColumns, ParquetSink, Recover, Write
from triage_monitor.rundir.storage import open_store


def _names(d, table):
    return [(p.lo, p.hi, p.part, p.sealed) for p in sorted(parts(d, table), key=lambda p: (p.lo, not p.sealed))]


def test_flush_with_a_timeout_returns_at_the_deadline_and_without_waits_for_the_disk(tmp_path):
    release = threading.Event()

    def slow_columns():                       # a step the writer thread is still building
        release.wait(10)
        return {"x": np.arange(3)}

    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, DeferredColumns(slow_columns, 24, 3))
        t0 = time.monotonic()
        sink.flush(timeout=0.3)
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 3, waited
        assert sink.written_steps == 0
        threading.Timer(0.3, release.set).start()
        sink.flush()                          # no timeout: until the step is on disk (its pending file)
        assert sink.written_steps == 1 and sink.written_rows == 3
        (pending,) = parts(tmp_path, "steps")
        assert not pending.sealed and read_part(open_store(tmp_path), pending).column("x").to_pylist() == [0, 1, 2]
    finally:
        release.set()
        sink.close()
    (block,) = files(tmp_path, "steps")       # sealed at close, its pending file gone
    assert block.name.startswith("steps-00000000-00000000-rank-0000-attempt-1-part-0")
    assert pq.read_table(block).column("x").to_pylist() == [0, 1, 2]


def test_a_full_queue_blocks_or_drops_and_a_closed_sink_counts_its_rows(tmp_path, held_file):
    release = threading.Event()
    sink = ParquetSink(tmp_path / "block", attempt=1, max_queue_bytes=150, backpressure="block")
    try:
        assert sink.submit("steps", 0, 0, held_file(release))    # alone in the queue: accepted
        accepted = []
        t = threading.Thread(target=lambda: accepted.append(sink.submit("steps", 1, 0, {"x": np.arange(7)})))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not accepted                      # 100 + 56 bytes > 150: waits for the writer
        assert sink.blocked_submits == 1
        release.set()
        t.join(10)
        assert accepted == [True]
        sink.flush()
        assert sink.written_steps == 2 and sink.written_rows == 9 and sink.dropped_rows == 0
    finally:
        release.set()
        sink.close()
    assert sink.closed and sink.submit("steps", 2, 0, [{"x": 1}, {"x": 2}]) is False and sink.dropped_rows == 2
    assert _names(tmp_path / "block", "steps") == [(0, 1, 0, True)]

    release = threading.Event()
    sink = ParquetSink(tmp_path / "drop", attempt=1, max_queue_bytes=150, backpressure="drop")
    try:
        assert sink.submit("steps", 0, 0, held_file(release, rows=2))
        assert sink.submit("steps", 1, 0, {"x": np.arange(6)}) is True        # 100 + 48 bytes fit
        assert sink.submit("steps", 2, 0, {"x": np.arange(3)}) is False       # + 24 does not: dropped, counted
        assert sink.submit("steps", 3, 0, [{"x": 1}]) is False                # a row counts 256 bytes
        assert sink.dropped_rows == 4
        release.set()
        sink.flush()
        assert sink.written_rows == 8 and sink.written_steps == 2
    finally:
        release.set()
        sink.close()
    with pytest.raises(ValueError, match="backpressure must be 'block' or 'drop', got 'wait'"):
        ParquetSink(tmp_path, attempt=1, backpressure="wait")


def test_an_unwritable_table_is_counted_and_reported_once(tmp_path, caplog):
    """A step that cannot be written (a regular file where the table's directory goes) is warned once, with the
    table, the step and the OS error (text typed out here); its rows are dropped; the next failure is not warned
    again but becomes the last error."""
    (tmp_path / "steps").write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 2, 0, {"x": np.arange(3)})
        sink.flush()
        sink.submit("steps", 3, 0, {"x": np.arange(4)})
    finally:
        sink.close()
    first = f"[Errno 17] File exists: '{tmp_path / 'steps'}'"
    assert [r.getMessage() for r in caplog.records] == [
        f"triage-monitor could not write steps rows for step 2 ({first}); training continues, rows are counted as "
        "dropped"]
    assert sink.dropped_rows == 7 and sink.last_error == f"FileExistsError: {first}"
    assert sink.written_rows == 0 and sink.written_steps == 0


def test_close_waits_at_most_its_timeout_and_counts_what_is_left_as_dropped(tmp_path, held_file):
    """``close(timeout=0.2)`` while the writer thread is busy with a step (a hung disk) returns False with the
    thread still running: the step being written and the one queued behind it are counted as dropped
    (``abandoned_rows``), and the writer, once it gets on, writes nothing more and counts nothing twice."""
    release = threading.Event()
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, held_file(release, rows=2))
        sink.submit("steps", 1, 0, {"x": np.arange(3)})
        assert sink.close(timeout=0.2) is False
        assert sink.closed is True and sink._thread.is_alive() and sink.written_steps == 0
        assert (sink.abandoned, sink.abandoned_rows, sink.dropped_rows) == (True, 5, 5)
    finally:
        release.set()
    sink._thread.join(10)
    assert not sink._thread.is_alive()
    assert (sink.written_steps, sink.written_rows, sink.sealed_blocks, sink.dropped_rows) == (0, 0, 0, 5)


def test_a_steps_columns_are_cast_to_the_schema_it_was_submitted_with(tmp_path):
    """``submit(..., schema)`` writes the schema's types: float64 and int64 columns given for a float32 / int32
    schema come back float32 / int32 (the token files' compact columns); without a schema numpy's types stay (and
    another schema is another block)."""
    schema = pa.schema([("step", pa.int64()), ("rank", pa.int64()), ("x", pa.float32()), ("n", pa.int32())])
    cols = {"step": np.array([3, 3]), "rank": np.array([0, 0]), "x": np.array([0.5, 1.5]), "n": np.array([7, 8])}
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("tokens", 3, 0, cols, schema)
        sink.submit("tokens", 4, 0, {**cols, "step": np.array([4, 4])})
    finally:
        sink.close()
    first, second = files(tmp_path, "tokens")
    t = pq.read_table(first)
    assert t.schema.equals(schema) and t.column("x").to_pylist() == [0.5, 1.5] and t.column("n").to_pylist() == [7, 8]
    assert pq.read_table(second).schema.types == [pa.int64(), pa.int64(), pa.float64(), pa.int64()]
    assert _names(tmp_path, "tokens") == [(3, 3, 0, True), (4, 4, 1, True)]


def test_every_queue_item_is_typed_and_a_steps_columns_are_one_type(tmp_path):
    """What reaches the queue: a :class:`Write` whose columns are :class:`DeferredColumns` whatever was submitted
    (a dict of arrays: its arrays' bytes, 3 int64 values = 24; a list of rows: 256 bytes a row; DeferredColumns:
    as given) or a :class:`Recover` of a rank (no row, outside the bound); nothing else."""
    sink = ParquetSink(tmp_path, attempt=7)
    seen = []
    put = sink._q.put
    sink._q.put = lambda item: (seen.append(item), put(item))
    schema = pa.schema([("x", pa.int64())])
    try:
        sink.submit("steps", 0, 0, {"x": np.arange(3)})
        sink.submit("alerts", 1, 2, [{"x": 1}, {"x": 2}], schema)
        sink.submit("tokens", 2, 0, DeferredColumns(lambda: {"x": np.arange(5)}, 40, 5))
        sink.submit_recover(0)
        sink.flush()
    finally:
        sink.close()
    writes, (recover, stop) = seen[:3], seen[3:]
    assert all(isinstance(w, Write) and isinstance(w.columns, DeferredColumns) for w in writes)
    assert [(w.table, w.step, w.rank, w.nbytes, w.nrows) for w in writes] == [
        ("steps", 0, 0, 24, 3), ("alerts", 1, 2, 2 * ROW_BYTES, 2), ("tokens", 2, 0, 40, 5)]
    assert writes[1].schema == schema and writes[1].columns.build() == {"x": [1, 2]}
    assert recover == Recover(0) and recover.nrows == 0
    assert not isinstance(stop, (Write, Recover))
    (alerts,) = files(tmp_path, "alerts")
    assert pq.read_table(alerts).to_pydict() == {"step": [1, 1], "rank": [2, 2], "x": [1, 2]}
    with pytest.raises(TypeError, match="columns must be DeferredColumns, a dict of arrays or a list of rows, got "
                                        "tuple"):
        DeferredColumns.of(("x",))


def test_rows_given_as_dicts_take_the_schemas_columns_or_the_first_rows_keys():
    """A list of rows becomes columns: with a schema, its columns in its order (a row lacking one gives None, a
    key the schema lacks is left out); without, the first row's keys."""
    schema = pa.schema([("b", pa.float64()), ("a", pa.int64())])
    rows = [{"a": 1, "b": 0.5, "c": "x"}, {"a": 2}]
    assert DeferredColumns.of(rows, schema).build() == {"b": [0.5, None], "a": [1, 2]}
    assert DeferredColumns.of(rows).build() == {"a": [1, 2], "b": [0.5, None], "c": ["x", None]}
    assert DeferredColumns.of([]).build() == {} and DeferredColumns.of([]).nbytes == ROW_BYTES


def _step(step, n=3, rank=0, extra=False):
    cols = {"step": np.full(n, step, np.int64), "rank": np.full(n, rank, np.int64),
            "x": np.arange(n, dtype=np.float32) + step}
    if extra:
        cols["y"] = np.zeros(n, np.float32)
    return pa.table(cols)


def test_a_block_holds_roll_steps_aligned_steps_and_each_step_is_pending_until_it_is_sealed(tmp_path, monkeypatch):
    """roll_steps 4: steps 2..12 go into blocks ending at steps 3, 7, 11 (aligned, (S + 1) % 4 == 0) and the
    open 12; before a block is sealed each of its steps is a pending file of its own (fewer than 4 at a time),
    after, none; the block's rows are its steps' in order, small steps in one row group (a reader of a step
    takes its rows out of it), steps of ROW_GROUP_BYTES or more in one row group each."""
    store = open_store(tmp_path)
    w = BlockWriter(store, "tokens", 0, 9, roll_steps=4)
    seen_pending = []
    for s in range(2, 13):
        w.write(s, _step(s))
        seen_pending.append(sum(not p.sealed for p in parts(tmp_path, "tokens")))
    assert max(seen_pending) == 3 and seen_pending[:4] == [1, 0, 1, 2]     # the 4th step seals the block
    assert _names(tmp_path, "tokens") == [(2, 3, 0, True), (4, 7, 1, True), (8, 11, 2, True), (12, 12, 3, False)]
    w.close()
    assert _names(tmp_path, "tokens") == [(2, 3, 0, True), (4, 7, 1, True), (8, 11, 2, True), (12, 12, 3, True)]
    block = tmp_path / "tokens" / "steps-00000004-00000007-rank-0000-attempt-9-part-1.parquet"
    md = pq.read_metadata(block)
    assert md.num_row_groups == 1 and pq.read_table(block).column("step").to_pylist() == [4] * 3 + [5] * 3 + [6] * 3 + [7] * 3
    part = RunLayout(tmp_path).index("tokens").for_step(6)[0]
    assert read_part(store, part, ["x"], step=6).column("x").to_pylist() == [6.0, 7.0, 8.0]
    assert list(tmp_path.joinpath("tokens").glob(".tmp-*")) == []        # no temporary file left
    import triage_monitor.rundir.blocks as blocks_mod

    monkeypatch.setattr(blocks_mod, "ROW_GROUP_BYTES", 1)               # every step is big: a row group each
    big = BlockWriter(store, "steps", 0, 9, roll_steps=4)
    for s in range(4):
        big.write(s, _step(s))
    f = tmp_path / "steps" / "steps-00000000-00000003-rank-0000-attempt-9-part-0.parquet"
    assert pq.read_metadata(f).num_row_groups == 4
    part = RunLayout(tmp_path).index("steps").for_step(2)[0]
    assert read_part(store, part, ["step", "x"], step=2).to_pydict() == {"step": [2] * 3, "x": [2.0, 3.0, 4.0]}


def test_a_gap_a_repeated_step_or_other_columns_roll_the_block_and_a_table_without_rows_writes_nothing(tmp_path):
    store = open_store(tmp_path)
    w = BlockWriter(store, "tokens", 1, 3, roll_steps=50)
    for s in (0, 1, 3, 3, 4):                  # a gap after 1, step 3 logged twice
        w.write(s, _step(s, rank=1))
    w.write(5, _step(5, rank=1, extra=True))   # a token column more
    w.close()
    assert _names(tmp_path, "tokens") == [(0, 1, 0, True), (3, 3, 1, True), (3, 4, 2, True), (5, 5, 3, True)]
    assert [p.part for p in RunLayout(tmp_path).index("tokens").for_step(3)] == [2]    # the later write wins

    a = BlockWriter(store, "alerts", 0, 3, roll_steps=50)   # a table with rows at some steps only
    empty = _step(0, n=0)
    for s in range(4):
        a.write(s, empty)
    assert parts(tmp_path, "alerts") == []                  # no rows, no block: nothing on disk
    a.write(4, _step(4, n=2))
    a.write(5, _step(5, n=0))                               # no pending file for a step without rows
    assert [(p.lo, p.sealed) for p in parts(tmp_path, "alerts")] == [(4, False)]
    a.write(6, _step(6, n=1))
    a.close()
    assert _names(tmp_path, "alerts") == [(4, 6, 0, True)]
    (f,) = files(tmp_path, "alerts")
    assert pq.read_table(f).column("step").to_pylist() == [4, 4, 6]


def test_a_killed_writers_pending_files_are_read_and_the_next_writer_seals_them(tmp_path):
    """A writer that never closes (a killed job) leaves its open block as pending files: readers read them; a
    sink of a later attempt seals them (Recover) into a block of their attempt before its own steps, the steps in
    order; a gap in a table every step has records in starts another block."""
    store = open_store(tmp_path)
    dead = BlockWriter(store, "tokens", 0, 1, roll_steps=50)
    for s in (0, 1, 2):
        dead.write(s, _step(s))
    write_pending(store, RunLayout.pending("tokens", 4, 0, 1, 0), _step(4))     # the same block, after a gap
    assert [p.sealed for p in parts(tmp_path, "tokens")] == [False] * 4
    (pending,) = RunLayout(tmp_path).index("tokens").for_step(2)
    assert not pending.sealed and read_part(store, pending).column("x").to_pylist() == [2.0, 3.0, 4.0]
    sink = ParquetSink(tmp_path, attempt=2)
    sink.submit_recover(0)
    sink.submit("tokens", 10, 0, {c: _step(10).column(c).to_numpy() for c in _step(10).column_names})
    sink.close()
    assert _names(tmp_path, "tokens") == [(0, 2, 0, True), (4, 4, 0, True), (10, 10, 0, True)]
    assert {p.attempt for p in parts(tmp_path, "tokens") if p.lo < 10} == {1}
    block = tmp_path / "tokens" / "steps-00000000-00000002-rank-0000-attempt-1-part-0.parquet"
    assert pq.read_table(block).column("step").to_pylist() == [0] * 3 + [1] * 3 + [2] * 3
    assert seal_pending(store, []) == []


def test_an_unreadable_pending_file_is_left_in_place_and_named(tmp_path, caplog):
    store = open_store(tmp_path)
    dead = BlockWriter(store, "steps", 0, 1, roll_steps=50)
    for s in range(3):
        dead.write(s, _step(s, n=1))
    bad = [p for p in parts(tmp_path, "steps") if p.lo == 1][0]
    (tmp_path / bad.name).write_bytes(b"truncated")
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    written = seal_pending(store, parts(tmp_path, "steps"))
    assert written == ["steps/steps-00000000-00000000-rank-0000-attempt-1-part-0.parquet",
                       "steps/steps-00000002-00000002-rank-0000-attempt-1-part-0.parquet"]
    assert [p.name for p in parts(tmp_path, "steps") if not p.sealed] == [bad.name]
    assert any(bad.name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)


def test_a_pending_file_sealed_after_the_reader_listed_it_is_read_from_its_block(tmp_path):
    """A reader lists a run being written (a dashboard, analyze): the writer then seals the block and removes its
    pending files.  Reading a step through the listing made before gets the step's rows from the block (the race
    a live dashboard met), for one step and for a whole pending file; a Run opened before the seal reads on."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    store = open_store(tmp_path)
    w = BlockWriter(store, "tokens", 0, 1, roll_steps=50)
    for s in range(3):
        w.write(s, _step(s))
    listed = RunLayout(tmp_path).index("tokens").for_step(1)
    assert [p.sealed for p in listed] == [False]
    w.close()
    assert not (tmp_path / listed[0].name).exists()
    assert read_part(store, listed[0]).column("x").to_pylist() == [1.0, 2.0, 3.0]
    assert read_part(store, listed[0], ["step"], step=1).column("step").to_pylist() == [1, 1, 1]

    d = tmp_path / "run"
    import torch
    from triage_monitor.batch import TokenBatch

    b = TokenBatch.from_padded(-torch.rand(2, 8) - 0.1, -torch.rand(2, 8) - 0.1, torch.ones(2), torch.ones(2, 8))
    mon = MismatchMonitor(d, MonitorConfig(tau_tail=-1.0))
    for s in range(4):
        mon.log_step(s, b)
    mon.flush()
    run = open_run(d)
    assert run.step_numbers() == [0, 1, 2, 3] and not any(p.sealed for p in run.index("tokens").parts)
    mon.close()                                                  # sealed: the pending files are gone
    assert len(run.tokens(2)) == 16 and len(run.steps()) == 4


def test_a_step_of_row_group_step_bytes_or_more_is_a_row_group_of_its_own_after_the_smaller_steps_before_it(tmp_path,
                                                                                                          monkeypatch):
    """A step whose columns reach ROW_GROUP_STEP_BYTES is written as its own row group at once (a reader of one step
    decodes that step alone), after the smaller steps buffered before it (their own row group, in step order);
    smaller steps after it gather again.  The block's rows are the steps' in order, and each step reads back alone."""
    import triage_monitor.rundir.blocks as blocks_mod

    monkeypatch.setattr(blocks_mod, "ROW_GROUP_STEP_BYTES", _step(0, n=40).nbytes)   # 40 rows or more: big
    store = open_store(tmp_path)
    w = BlockWriter(store, "tokens", 0, 9, roll_steps=8)
    sizes = {0: 3, 1: 3, 2: 40, 3: 50, 4: 3, 5: 3, 6: 3, 7: 45}
    for s, n in sizes.items():
        w.write(s, _step(s, n=n))
    block = tmp_path / "tokens" / "steps-00000000-00000007-rank-0000-attempt-9-part-0.parquet"
    md = pq.read_metadata(block)
    groups = [pq.ParquetFile(block).read_row_group(i).column("step").to_pylist() for i in range(md.num_row_groups)]
    assert [sorted(set(g)) for g in groups] == [[0, 1], [2], [3], [4, 5, 6], [7]]
    assert pq.read_table(block).column("step").to_pylist() == [s for s, n in sizes.items() for _ in range(n)]
    for s, n in sizes.items():
        part = RunLayout(tmp_path).index("tokens").for_step(s)[0]
        assert read_part(store, part, ["x"], step=s).column("x").to_pylist() == [float(i + s) for i in range(n)]
