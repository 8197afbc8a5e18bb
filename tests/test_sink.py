"""The background Parquet writer (triage_monitor.sink): typed queue items, the flush deadline, the queue bound,
write errors counted and reported once, removals of an earlier attempt's files, the columns cast to a schema."""

import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from triage_monitor.layout import RunLayout
from triage_monitor.sink import ROW_BYTES, DeferredColumns, Delete, ParquetSink, Write


def test_flush_with_a_timeout_returns_at_the_deadline_and_without_waits_for_the_disk(tmp_path):
    release = threading.Event()

    def slow_columns():                       # a file the writer thread is still building
        release.wait(10)
        return {"x": np.arange(3)}

    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, DeferredColumns(slow_columns, 24, 3))
        t0 = time.monotonic()
        sink.flush(timeout=0.3)
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 3, waited
        assert sink.written_files == 0
        threading.Timer(0.3, release.set).start()
        sink.flush()                          # no timeout: until the file is on disk
        assert sink.written_files == 1 and sink.written_rows == 3
        assert pq.read_table(RunLayout(tmp_path).table_file("steps", 0, 0, 1)).column("x").to_pylist() == [0, 1, 2]
        # a removal queued behind a slow file is waited for too
        old = RunLayout(tmp_path).table_file("tokens", 0, 0, 0)
        old.parent.mkdir()
        old.write_bytes(b"")
        release.clear()
        sink.submit("steps", 1, 0, DeferredColumns(slow_columns, 24, 3))
        sink.submit_delete("tokens", 0, 0, attempt=0)
        threading.Timer(0.2, release.set).start()
        sink.flush()
        assert not old.exists() and sink.written_files == 2
    finally:
        release.set()
        sink.close()


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
        release.set()
        t.join(10)
        assert accepted == [True]
        sink.flush()
        assert sink.written_files == 2 and sink.written_rows == 9 and sink.dropped_rows == 0
    finally:
        release.set()
        sink.close()
    assert sink.closed and sink.submit("steps", 2, 0, [{"x": 1}, {"x": 2}]) is False and sink.dropped_rows == 2
    sink.submit_delete("steps", 0, 0, attempt=1)                   # nothing queued after close
    assert RunLayout(tmp_path / "block").table_file("steps", 0, 0, 1).exists()

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
        assert sink.written_rows == 8 and sink.written_files == 2
    finally:
        release.set()
        sink.close()
    with pytest.raises(ValueError, match="backpressure must be 'block' or 'drop', got 'wait'"):
        ParquetSink(tmp_path, attempt=1, backpressure="wait")


def test_an_unwritable_file_is_counted_and_reported_once(tmp_path, caplog):
    (tmp_path / "steps").write_text("")                  # the table directory cannot be created
    sink = ParquetSink(tmp_path, attempt=1)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        for s in range(3):
            sink.submit("steps", s, 0, {"x": np.arange(4)})
        sink.close()
    assert sink.dropped_rows == 12 and sink.written_rows == 0 and sink.written_files == 0
    assert sink.last_error.startswith(("FileExistsError: ", "NotADirectoryError: "))
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warned) == 1 and "steps rows for step 0" in warned[0]


def test_close_waits_at_most_its_timeout_for_a_busy_writer_which_still_writes_the_file(tmp_path, held_file):
    """``close(timeout=0.2)`` while the writer thread is busy with a file returns with the thread still running
    (a hung disk does not hang the job's exit); the file is written once the writer gets on."""
    release = threading.Event()
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, held_file(release, rows=2))
        sink.close(timeout=0.2)
        assert sink.closed is True and sink._thread.is_alive() and sink.written_files == 0
    finally:
        release.set()
    sink._thread.join(10)
    assert not sink._thread.is_alive() and (sink.written_files, sink.written_rows) == (1, 2)


def test_a_files_columns_are_cast_to_the_schema_it_was_submitted_with(tmp_path):
    """``submit(..., schema)`` writes the schema's types: float64 and int64 columns given for a float32 / int32
    schema come back float32 / int32 (the token files' compact columns); without a schema numpy's types stay."""
    schema = pa.schema([("step", pa.int64()), ("rank", pa.int64()), ("x", pa.float32()), ("n", pa.int32())])
    cols = {"step": np.array([3, 3]), "rank": np.array([0, 0]), "x": np.array([0.5, 1.5]), "n": np.array([7, 8])}
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("tokens", 3, 0, cols, schema)
        sink.submit("tokens", 4, 0, {**cols, "step": np.array([4, 4])})
    finally:
        sink.close()
    t = pq.read_table(RunLayout(tmp_path).table_file("tokens", 3, 0, 1))
    assert t.schema.equals(schema) and t.column("x").to_pylist() == [0.5, 1.5] and t.column("n").to_pylist() == [7, 8]
    assert pq.read_table(RunLayout(tmp_path).table_file("tokens", 4, 0, 1)).schema.types == [
        pa.int64(), pa.int64(), pa.float64(), pa.int64()]


def test_a_write_error_is_warned_once_naming_table_step_and_reason_and_kept_as_last_error(tmp_path, caplog):
    """A file that cannot be written (a regular file where the table's directory goes) is warned once, with the
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


def test_removals_keep_the_queue_count_so_flush_still_waits_for_every_file(tmp_path):
    """Each queued removal counts one byte in the queue until it is done.  After 30 removals, a file queued
    behind them (or behind a slow file and a removal) is still waited for by flush; a removal that fails drops no
    row (it is reported as the last error)."""
    release = threading.Event()

    def slow_columns():
        release.wait(10)
        return {"x": np.arange(3)}

    sink = ParquetSink(tmp_path, attempt=1)
    try:
        for s in range(30):
            sink.submit_delete("tokens", s, 0, attempt=0)      # nothing to remove: no error
        sink.flush()
        assert (sink.last_error, sink.dropped_rows, sink.written_files) == (None, 0, 0)
        sink.submit("steps", 0, 0, DeferredColumns(slow_columns, 24, 3))
        threading.Timer(0.3, release.set).start()
        sink.flush()
        assert sink.written_files == 1
        release.clear()
        sink.submit("steps", 1, 0, DeferredColumns(slow_columns, 24, 3))
        sink.submit_delete("tokens", 0, 0, attempt=0)
        sink.submit("steps", 2, 0, DeferredColumns(slow_columns, 24, 3))
        threading.Timer(0.3, release.set).start()
        sink.flush()
        assert sink.written_files == 3 and sink.written_rows == 9
        RunLayout(tmp_path).table_file("tokens", 5, 0, 0).mkdir(parents=True)     # a directory: unlink fails
        sink.submit_delete("tokens", 5, 0, attempt=0)
        sink.flush()
        assert sink.dropped_rows == 0 and sink.last_error.startswith(("IsADirectoryError", "PermissionError"))
    finally:
        release.set()
        sink.close()


def test_every_queue_item_is_typed_and_a_files_columns_are_one_type(tmp_path):
    """What reaches the queue: a :class:`Write` whose columns are :class:`DeferredColumns` whatever was submitted
    (a dict of arrays: its arrays' bytes, 3 int64 values = 24; a list of rows: 256 bytes a row; DeferredColumns:
    as given) or a :class:`Delete` naming the earlier attempt (one byte in the queue, no row); nothing else."""
    sink = ParquetSink(tmp_path, attempt=7)
    seen = []
    put = sink._q.put
    sink._q.put = lambda item: (seen.append(item), put(item))
    schema = pa.schema([("x", pa.int64())])
    try:
        sink.submit("steps", 0, 0, {"x": np.arange(3)})
        sink.submit("alerts", 1, 2, [{"x": 1}, {"x": 2}], schema)
        sink.submit("tokens", 2, 0, DeferredColumns(lambda: {"x": np.arange(5)}, 40, 5))
        sink.submit_delete("tokens", 2, 0, attempt=3)
        sink.flush()
    finally:
        sink.close()
    writes, (delete, stop) = seen[:3], seen[3:]
    assert all(isinstance(w, Write) and isinstance(w.columns, DeferredColumns) for w in writes)
    assert [(w.table, w.step, w.rank, w.nbytes, w.nrows) for w in writes] == [
        ("steps", 0, 0, 24, 3), ("alerts", 1, 2, 2 * ROW_BYTES, 2), ("tokens", 2, 0, 40, 5)]
    assert writes[1].schema == schema and writes[1].columns.build() == {"x": [1, 2]}
    assert delete == Delete("tokens", 2, 0, 3) and (delete.nbytes, delete.nrows) == (1, 0)
    assert not isinstance(stop, (Write, Delete))
    assert pq.read_table(RunLayout(tmp_path).table_file("alerts", 1, 2, 7)).to_pydict() == {
        "step": [1, 1], "rank": [2, 2], "x": [1, 2]}
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
