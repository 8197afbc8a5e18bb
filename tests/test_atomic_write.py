"""Every Parquet file of a run is written under a hidden temporary name and renamed into place
(``triage_monitor.sink.write_table_atomic``), so no reader ever sees a partial file under a table's name and a
failed write leaves nothing behind.  Deterministic: the write is made to fail (or is watched) at a chosen point,
instead of killing a process at a moment that depends on timing (tests/test_faults.py's SIGKILL test)."""

from __future__ import annotations

import errno
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor import sink
from triage_monitor.batch import TokenBatch
from triage_monitor.layout import TEMP_PREFIX

REAL_WRITE = pq.write_table
TABLE = pa.table({"x": list(range(1000)), "y": [float(i) / 7 for i in range(1000)]})


def _partial_then_full_disk(calls: list):
    """A ``pq.write_table`` that writes the first half of the file's real bytes to its target, notes what is on
    disk at that moment, then fails as a full disk does."""
    def write(table, where, **kw):
        buf = pa.BufferOutputStream()
        REAL_WRITE(table, buf, **kw)
        data = buf.getvalue().to_pybytes()
        with open(where, "wb") as f:
            f.write(data[: len(data) // 2])
        calls.append({"target": where, "listing": sorted(p.name for p in where.parent.iterdir())})
        raise OSError(errno.ENOSPC, "No space left on device")
    return write


def test_a_write_that_fails_midway_leaves_no_partial_file_and_no_temporary_one(tmp_path, monkeypatch):
    """The bytes go to a hidden ``.tmp-*`` file beside the target (same directory: the rename is atomic), never to
    the table's name; when the write fails after half the file is on disk, the error reaches the caller, nothing
    exists under the table's name and the temporary file is gone."""
    calls: list = []
    monkeypatch.setattr(pq, "write_table", _partial_then_full_disk(calls))
    path = tmp_path / "steps" / "step-3-rank-0-attempt-1.parquet"
    with pytest.raises(OSError) as err:
        sink.write_table_atomic(TABLE, path)
    assert err.value.errno == errno.ENOSPC
    (call,) = calls
    assert call["target"].parent == path.parent and call["target"].name.startswith(TEMP_PREFIX)
    assert call["target"] != path and call["listing"] == [call["target"].name]    # half a file, hidden name only
    assert not path.exists() and list(path.parent.iterdir()) == []


def test_a_failed_rewrite_keeps_the_complete_earlier_file(tmp_path, monkeypatch):
    """A file rewritten (a resumed step) keeps its earlier complete content while the new bytes are written, and
    keeps it when the new write fails midway or the rename itself fails."""
    path = tmp_path / "t.parquet"
    old = pa.table({"x": [1, 2, 3]})
    sink.write_table_atomic(old, path)
    calls: list = []
    monkeypatch.setattr(pq, "write_table", _partial_then_full_disk(calls))
    with pytest.raises(OSError):
        sink.write_table_atomic(TABLE, path)
    assert sorted(calls[0]["listing"]) == sorted([calls[0]["target"].name, "t.parquet"])
    assert pq.read_table(path).equals(old) and [p.name for p in tmp_path.iterdir()] == ["t.parquet"]

    monkeypatch.setattr(pq, "write_table", REAL_WRITE)

    def refuse(src, dst):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(sink.os, "replace", refuse)
    with pytest.raises(OSError):
        sink.write_table_atomic(TABLE, path)
    assert pq.read_table(path).equals(old) and [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_the_table_name_appears_only_once_the_file_is_complete(tmp_path, monkeypatch):
    """While the bytes are written, the table's name does not exist (a new file) or still holds the earlier file
    (a rewrite); afterwards it holds the whole new table and no temporary file is left."""
    seen: list = []

    def watch(table, where, **kw):
        REAL_WRITE(table, where, **kw)
        final = where.parent / "t.parquet"
        seen.append((where.name.startswith(TEMP_PREFIX), final.exists() and pq.read_table(final).num_rows))
    monkeypatch.setattr(pq, "write_table", watch)
    path = tmp_path / "t.parquet"
    sink.write_table_atomic(pa.table({"x": [1, 2, 3]}), path)
    sink.write_table_atomic(TABLE, path)
    assert seen == [(True, False), (True, 3)]
    assert pq.read_table(path).equals(TABLE) and [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_every_parquet_file_of_a_run_goes_through_a_temporary_name_and_a_failed_one_leaves_nothing(
        tmp_path, monkeypatch):
    """A run's token and steps files (and the others) are each written under a hidden name in their table's
    directory; the writes of step 1 fail midway (a full disk): after close, every visible file is complete and
    readable, step 1 has no file under any table's name, no temporary file is left, and the lost rows are counted."""
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    targets: list = []

    def write(table, where, **kw):
        targets.append(where)
        if getattr(write, "failing", False):
            return _partial_then_full_disk([])(table, where, **kw)
        return REAL_WRITE(table, where, **kw)
    monkeypatch.setattr(pq, "write_table", write)

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        s = -torch.rand(4, 16, generator=g) - 0.01
        return TokenBatch.from_padded(s - 0.1 * torch.rand(4, 16, generator=g), s, torch.tensor([1., -1., 2., -2.]),
                                      torch.ones(4, 16, dtype=torch.bool))

    run_dir = tmp_path / "run"
    with MismatchMonitor(run_dir, MonitorConfig(calibration_steps=1)) as mon:
        mon.log_step(0, batch(0))
        mon.sink.flush()
        write.failing = True
        mon.log_step(1, batch(1))
        mon.sink.flush()
        dropped = mon.sink.dropped_rows
        write.failing = False
        mon.log_step(2, batch(2))
    assert targets and all(t.name.startswith(TEMP_PREFIX) and t.parent.parent == run_dir for t in targets)
    assert {t.parent.name for t in targets} >= {"tokens", "steps"}
    visible = [p for p in run_dir.rglob("*.parquet") if not p.name.startswith(TEMP_PREFIX)]
    for p in visible:
        pq.read_table(p)                                          # complete: readable to the end
    steps = {(p.parent.name, int(re.match(r"step-(\d+)-rank-", p.name).group(1))) for p in visible}
    assert {s for _, s in steps} == {0, 2} and {("tokens", 0), ("steps", 0), ("tokens", 2), ("steps", 2)} <= steps
    assert list(run_dir.rglob(f"{TEMP_PREFIX}*")) == []
    assert dropped == 4 * 16 + 1                                  # step 1's 64 token rows and its steps row
