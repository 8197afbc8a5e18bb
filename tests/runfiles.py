"""Test helpers: the files of a run directory's tables, found through the run's own index
(triage_monitor.layout.RunLayout), never by guessing names."""

from __future__ import annotations

from pathlib import Path

from triage_monitor.layout import RunLayout


def parts(run_dir, table: str) -> list:
    """Every :class:`~triage_monitor.layout.Part` of ``table`` (sealed blocks and pending files), by name."""
    return sorted(RunLayout(run_dir).index(table).parts, key=lambda p: p.name)


def file_of(run_dir, table: str, step: int, rank: int = 0) -> Path:
    """The local path of the file holding ``step`` of ``rank`` in ``table`` (its latest records)."""
    found = [p for p in RunLayout(run_dir).index(table).for_step(step) if p.rank == rank]
    assert found, f"no {table} file holds step {step} of rank {rank} in {run_dir}"
    return Path(run_dir) / found[0].name


def files(run_dir, table: str) -> list:
    """The local paths of every file of ``table``, sorted by name."""
    return [Path(run_dir) / p.name for p in parts(run_dir, table)]


def steps_of(run_dir, table: str, rank=None) -> list:
    """The sorted steps the files of ``table`` hold (of ``rank`` only, unless None)."""
    idx = RunLayout(run_dir).index(table)
    return sorted({s for p in idx.parts if rank is None or p.rank == rank for s in range(p.lo, p.hi + 1)})
