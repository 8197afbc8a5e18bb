"""Test helpers: the files of a run directory's tables, found through the run's own index
(triage_monitor.layout.RunLayout), never by guessing names."""

from __future__ import annotations

from pathlib import Path

from triage_monitor.rundir.layout import RunLayout


def parts(run_dir, table: str) -> list:
    """Every :class:`~triage_monitor.rundir.layout.Part` of ``table`` (sealed blocks and pending files), by name."""
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


def step_keys(run_dir, table: str) -> list:
    """``(step, rank, attempt)`` of every step each file of ``table`` holds (a block: each of its steps)."""
    return [(s, p.rank, p.attempt) for p in RunLayout(run_dir).index(table).parts for s in range(p.lo, p.hi + 1)]


def rows_of(run_dir, table: str, step: int, rank: int) -> int:
    """The rows of ``step`` of ``rank`` in ``table`` (its latest file: block or pending)."""
    from triage_monitor.rundir.blocks import read_part

    layout = RunLayout(run_dir)
    (part,) = [p for p in layout.index(table).for_step(step) if p.rank == rank]
    return read_part(layout.store, part, ["step"], step).num_rows


def shown(row) -> dict:
    """What trackers and framework loggers show of a steps-table row (``{metric: float}``): the direction ratios
    NaN at noise level (triage_monitor.trackers.tracker_metrics, the alert guard's rule), every other value as is."""
    import math

    from triage_monitor.alerting.trackers import NOISE_GUARDED, at_noise_level

    vals = {k: float(v) for k, v in dict(row).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: (math.nan if k in NOISE_GUARDED and at_noise_level(vals, NOISE_GUARDED[k]) else v)
            for k, v in vals.items()}
