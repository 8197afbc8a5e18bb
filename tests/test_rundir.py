"""The run directory as a unit of storage: readers name what they cannot read, every table reads with plain
pandas / pyarrow / DuckDB / Polars, one run per directory, one writer per rank, unwritable outputs fail at start."""

from __future__ import annotations

import logging

import pytest
import torch

from triage_monitor.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step, B=4, T=32):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 4
    lp = (s + torch.randn(B, T, generator=g) * .1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 100 * step)


def _write(d, steps=5, **kw):
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), **kw) as mon:
        return [mon.log_step(s, _batch(s)) for s in range(steps)]


def _table_file(d, table, step):
    return next(p for p in (d / table).rglob("*.parquet") if f"step-{step:08d}" in p.name or f"step={step}" in str(p))


# ============================================================================ corrupt files are named
def test_truncated_parquet_files_are_counted_named_and_logged(tmp_path, caplog):
    d = tmp_path / "run"
    _write(d)
    bad_step, bad_tok = _table_file(d, "steps", 3), _table_file(d, "tokens", 2)
    for f in (bad_step, bad_tok):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])                # a truncated file, as a killed copy leaves it
    run = open_run(d)
    assert run.unreadable == []
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        steps = run.steps()
        assert steps["step"].tolist() == [0, 1, 2, 4]        # step 3 left out, and said so
        with pytest.raises(KeyError, match="unreadable"):
            run.tokens(2)
        assert len(run.tokens(1)) == 4 * 32
        run.steps()                                           # read again: named once
    assert [p for p, _ in run.unreadable] == [str(bad_step), str(bad_tok)]
    assert all(reason for _, reason in run.unreadable)
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 2 and str(bad_step) in warned[0] and str(bad_tok) in warned[1]
