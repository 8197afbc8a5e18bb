"""Every file of a local run is written under a hidden temporary name and renamed into place
(``triage_monitor.storage.Store.writing`` for run.json and the pending files, ``blocks.BlockWriter`` for the
Parquet blocks), so no reader ever sees a partial file under a table's name and a failed write leaves nothing
behind.  Deterministic: the write is made to fail (or is watched) at a chosen point, instead of killing a process
at a moment that depends on timing (tests/test_faults.py's SIGKILL test)."""

from __future__ import annotations

import errno
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from runfiles import parts
from triage_monitor.rundir import blocks
from triage_monitor.batch import TokenBatch
from triage_monitor.rundir.layout import TEMP_PREFIX
from triage_monitor.rundir.storage import open_store

DATA = bytes(range(256)) * 64


def test_a_write_that_fails_midway_leaves_no_partial_file_and_no_temporary_one(tmp_path):
    """The bytes go to a hidden ``.tmp-*`` file beside the target (same directory: the rename is atomic), never to
    the target's name; when the write fails after half the bytes, the error reaches the caller, nothing exists
    under the target's name and the temporary file is gone."""
    store = open_store(tmp_path)
    listing = []
    with pytest.raises(OSError) as err:
        with store.writing("steps/t.parquet") as out:
            out.write(DATA[: len(DATA) // 2])
            listing.extend(p.name for p in (tmp_path / "steps").iterdir())
            raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.errno == errno.ENOSPC
    assert len(listing) == 1 and listing[0].startswith(TEMP_PREFIX)        # half a file, hidden name only
    assert list((tmp_path / "steps").iterdir()) == []


def test_a_failed_rewrite_keeps_the_complete_earlier_file(tmp_path, monkeypatch):
    """A file rewritten (run.json) keeps its earlier complete content while the new bytes are written, and keeps it
    when the new write fails midway or the rename itself fails."""
    store = open_store(tmp_path)
    store.write_bytes("run.json", b"old")
    with pytest.raises(OSError):
        with store.writing("run.json") as out:
            out.write(b"new, half")
            assert (tmp_path / "run.json").read_bytes() == b"old"
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (tmp_path / "run.json").read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["run.json"]

    def refuse(src, dst):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        store.write_bytes("run.json", b"new")
    assert (tmp_path / "run.json").read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(4, 16, generator=g) - 0.01
    return TokenBatch.from_padded(s - 0.1 * torch.rand(4, 16, generator=g), s, torch.tensor([1., -1., 2., -2.]),
                                  torch.ones(4, 16, dtype=torch.bool))


def test_every_file_of_a_run_goes_through_a_temporary_name_and_a_failed_step_leaves_nothing(tmp_path, monkeypatch):
    """A run's pending files, blocks and run.json are each renamed into place from a hidden name in their own
    directory; the pending files of step 1 fail (a full disk): after close, every visible file is complete and
    readable, no file holds step 1, no temporary file is left, and the lost rows are counted."""
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    renames: list = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((os.path.basename(src), os.path.dirname(src) == os.path.dirname(dst), dst))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", spy)
    real_pending = blocks.write_pending

    def pending(store, rel, table):
        if table.num_rows and table.column("step")[0].as_py() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pending(store, rel, table)
    monkeypatch.setattr(blocks, "write_pending", pending)

    run_dir = tmp_path / "run"
    with MismatchMonitor(run_dir, MonitorConfig(calibration_steps=1)) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
            mon.sink.flush()
        dropped = mon.sink.dropped_rows
    assert renames and all(name.startswith(TEMP_PREFIX) and same_dir for name, same_dir, _ in renames)
    assert {os.path.basename(os.path.dirname(d)) for _, _, d in renames} >= {"tokens", "steps", "run"}
    for table in ("tokens", "steps"):
        held = sorted(s for p in parts(run_dir, table) for s in range(p.lo, p.hi + 1))
        assert held == [0, 2], table                               # step 1 is in no file; 0 and 2 in their blocks
        for p in parts(run_dir, table):
            assert p.sealed and pq.read_table(run_dir / p.name).num_rows      # complete: readable to the end
    assert list(run_dir.rglob(f"{TEMP_PREFIX}*")) == []
    assert dropped == 4 * 16 + 1                                   # step 1's 64 token rows and its steps row


def test_a_block_appears_under_its_name_only_once_complete(tmp_path, monkeypatch):
    """While a block's steps are written, only hidden files exist (the steps in pending files, the block's Parquet
    file under a temporary name once it has a row group); its name appears at sealing, holding every step."""
    store = open_store(tmp_path)
    w = blocks.BlockWriter(store, "steps", 0, 1, roll_steps=3)
    t = pa.table({"step": pa.array([0], pa.int64()), "x": [1.0]})
    for s in range(2):
        w.write(s, t.set_column(0, "step", pa.array([s], pa.int64())))
        names = sorted(p.name for p in (tmp_path / "steps").iterdir())
        assert all(n.startswith((TEMP_PREFIX, ".pending-")) for n in names)
        assert len([n for n in names if n.startswith(".pending-")]) == s + 1
    w.write(2, t.set_column(0, "step", pa.array([2], pa.int64())))
    (name,) = [p.name for p in (tmp_path / "steps").iterdir()]
    assert name == "steps-00000000-00000002-rank-0000-attempt-1-part-0.parquet"
    assert pq.read_table(tmp_path / "steps" / name).column("step").to_pylist() == [0, 1, 2]
