"""Offline analysis of a run directory: open, stream steps, recompute metrics.

Everything offline (CLI tables, the static report, the dashboard, alert
replay) reads runs through this module.  Metrics are recomputed with the very
code the live monitor used (:class:`~triage_monitor.metrics.MetricTracker`),
so ``recompute(run)`` reproduces the live per-step values.

    run = open_run("runs/demo")
    live = run.steps()                 # live metric rows, one per step
    again = recompute(run)             # from the token Parquet files alone
    batch = run.token_batch(step=10)   # a TokenBatch, for drill-downs
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .records import MANIFEST, read_manifest

# torch-backed modules (batch, metrics) are imported inside the functions that need them, so that reading
# step-level data (Run.steps, the dashboard's first charts) does not pay for importing torch.


class RunDirError(ValueError):
    """The path is not a readable run directory (the message says why)."""


def _hive_int(p: Path, prefix: str):
    """The integer of a hive directory ``<prefix><int>``; None (skip) for anything else."""
    if not p.name.startswith(prefix) or not p.is_dir():
        return None
    try:
        return int(p.name[len(prefix):])
    except ValueError:
        return None


def _parts(root: Path) -> dict:
    """{step: [(rank, path), ...]} of the complete (non-hidden) Parquet files under ``root``.

    Entries that are not ``step=<int>/rank=<int>/*.parquet`` files are skipped."""
    out: dict = {}
    if not root.is_dir():
        return out
    for step_dir in root.iterdir():
        step = _hive_int(step_dir, "step=")
        if step is None:
            continue
        for rank_dir in step_dir.iterdir():
            rank = _hive_int(rank_dir, "rank=")
            if rank is None:
                continue
            for f in rank_dir.iterdir():
                if f.suffix == ".parquet" and not f.name.startswith((".", "_")) and f.is_file():
                    out.setdefault(step, []).append((rank, f))
    return out


def _latest_attempt(files: list) -> list:
    """The files of the step's latest attempt (``part-<attempt>.parquet``), every rank of it, by rank.

    All ranks of one process start share one attempt id (MismatchMonitor broadcasts rank 0's), so a
    step redone by a resumed job, even on fewer ranks, is read from the new attempt alone.
    Files whose name is not ``part-<int>.parquet`` are skipped."""
    parsed = []
    for rank, f in files:
        try:
            parsed.append((int(f.stem.split("-", 1)[1]), rank, f))
        except (IndexError, ValueError):
            continue
    if not parsed:
        return []
    latest = max(a for a, _, _ in parsed)
    return [f for a, r, f in sorted(parsed, key=lambda x: x[1]) if a == latest]


class Run:
    """A run directory opened for reading (see :func:`open_run`)."""

    def __init__(self, path):
        self.path = Path(path)

    @cached_property
    def manifest(self) -> dict:
        """The parsed ``run.json``."""
        return read_manifest(self.path)

    def metric_config(self):
        """The :class:`~triage_monitor.metrics.MetricConfig` the live monitor used (SPEC.md defaults if absent)."""
        from .metrics import MetricConfig

        mc = self.manifest.get("monitor_config", {}).get("metrics", {})
        return MetricConfig(**mc)

    def step_numbers(self) -> list:
        """Sorted steps that have token files."""
        return sorted(_parts(self.path / "tokens"))

    def tokens(self, step: int, columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
        """Token rows of one step (all ranks, latest attempt) as a DataFrame, sorted by (sample_id, position)."""
        files = _latest_attempt(_parts(self.path / "tokens").get(int(step), []))
        if not files:
            raise KeyError(f"step {step} has no token records in {self.path}")
        tables = []
        for f in files:
            t = pq.read_table(f, columns=list(columns) if columns else None)
            tables.append(t.append_column("rank", pa.array([int(f.parent.name[5:])] * t.num_rows, pa.int32())))
        df = pa.concat_tables(tables, promote_options="default").to_pandas()
        sort = [c for c in ("sample_id", "position") if c in df.columns]
        return df.sort_values(sort, kind="stable").reset_index(drop=True) if sort else df

    def token_batch(self, step: int):
        """The step's valid tokens as a :class:`~triage_monitor.batch.TokenBatch` (float32 values exactly as recorded)."""
        import torch

        from .batch import TokenBatch

        df = self.tokens(step, ["sample_id", "group_id", "position", "learner_logp", "sampler_logp", "advantage"])
        t = {c: torch.as_tensor(df[c].to_numpy().copy()) for c in df.columns if c != "rank"}
        return TokenBatch.from_flat(t["learner_logp"], t["sampler_logp"], t["advantage"], t["sample_id"],
                                    t["position"], group_id=t["group_id"])

    def iter_batches(self, steps: Optional[Sequence[int]] = None) -> Iterator:
        """Yield ``(step, TokenBatch)`` in step order, one step in memory at a time."""
        for s in (self.step_numbers() if steps is None else steps):
            yield s, self.token_batch(s)

    def steps(self, rank: Optional[int] = 0) -> pd.DataFrame:
        """Live per-step metric rows (latest attempt of each step), sorted by step.

        ``rank=None`` returns every rank's rows (a ``rank`` column tells them apart).
        Returns an empty DataFrame with a ``step`` column when nothing was recorded yet.
        """
        rows = []
        for step, files in sorted(_parts(self.path / "steps").items()):
            for f in _latest_attempt(files):
                r = _hive_int(f.parent, "rank=")
                if rank is not None and r != rank:
                    continue
                try:
                    t = pq.read_table(f)
                except (OSError, pa.ArrowInvalid):
                    continue
                d = t.to_pylist()[0]
                d["step"], d["rank"] = step, r
                rows.append(d)
        if not rows:
            return pd.DataFrame({"step": pd.Series([], dtype="int64")})
        df = pd.DataFrame(rows)
        front = ["step", "rank"]
        return df[front + [c for c in df.columns if c not in front]].sort_values(["step", "rank"]).reset_index(
            drop=True)

    def _table(self, name: str) -> pd.DataFrame:
        """All rows of a side table (``alerts``, ``quarantine``), latest attempt, with a ``step`` column."""
        frames = []
        for step, files in sorted(_parts(self.path / name).items()):
            for f in _latest_attempt(files):
                df = pq.read_table(f).to_pandas()
                df["step"] = step
                frames.append(df)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"step": []})

    def alerts(self) -> pd.DataFrame:
        """Alert rows recorded in ``alerts/`` (empty DataFrame when none)."""
        return self._table("alerts")

    def quarantine(self) -> pd.DataFrame:
        """Quarantined tokens (SPEC.md §8), with a ``step`` column (empty when none)."""
        return self._table("quarantine")


def open_run(path) -> Run:
    """Open a run directory written by :class:`~triage_monitor.monitor.MismatchMonitor`.

    Raises:
        RunDirError: the path does not exist, is not a directory, or has no
            ``run.json`` manifest, or the manifest is unreadable.
    """
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"{p}: no such directory")
    if not p.is_dir():
        raise RunDirError(f"{p}: not a directory")
    if not (p / MANIFEST).is_file():
        raise RunDirError(f"{p}: not a triage-monitor run directory (no {MANIFEST})")
    run = Run(p)
    try:
        run.manifest
    except (OSError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{p / MANIFEST}: unreadable manifest ({exc})") from exc
    return run


def load_steps(run_dir) -> pd.DataFrame:
    """Live per-step metrics of a run (rank 0, latest attempt), one row per step."""
    return open_run(run_dir).steps()


def recompute(run: Run, *, window: Optional[int] = None, tau_tail: Optional[float] = None,
              calibration_steps: Optional[int] = None, config=None,
              steps: Optional[Sequence[int]] = None, progress: bool = False) -> pd.DataFrame:
    """Recompute every per-step and trailing-window metric from the token files alone.

    Defaults come from the run's manifest (window, τ_tail or its calibration,
    thresholds), so the result equals the live metrics.  Override any of them
    for a what-if analysis.  Streams one step at a time.

    Returns:
        DataFrame with a ``step`` column, the step metrics (:data:`METRIC_NAMES`)
        and ``window/<name>`` columns.
    """
    from .metrics import METRIC_NAMES, MetricTracker

    mc = run.manifest.get("monitor_config", {})
    tracker = MetricTracker(config or run.metric_config(),
                            window if window is not None else mc.get("window", 25),
                            tau_tail if tau_tail is not None else mc.get("tau_tail"),
                            calibration_steps if calibration_steps is not None else mc.get("calibration_steps", 25))
    todo = run.step_numbers() if steps is None else list(steps)
    rows = []
    it = run.iter_batches(todo)
    if progress:
        from rich.progress import track
        it = track(it, total=len(todo), description="recomputing metrics", transient=True)
    for step, batch in it:
        s, w = tracker.step(step, batch)
        row = {"step": step, **s.values}
        row.update({f"window/{k}": v for k, v in w.values.items()})
        rows.append(row)
    cols = ["step", *METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)]
    return pd.DataFrame(rows, columns=cols)


def compare_live(run: Run, recomputed: pd.DataFrame, rtol: float = 1e-9,
                 live: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Per metric, the largest relative difference between live and recomputed values.

    NaN in both counts as equal; ``live`` (from :meth:`Run.steps`) saves a second read of the step rows.
    Returns a DataFrame (metric, max_rel_diff, equal).
    """
    live = (run.steps() if live is None else live).set_index("step")
    rec = recomputed.set_index("step")
    common = rec.index.intersection(live.index)
    out = []
    for c in rec.columns:
        if c not in live.columns:
            continue
        a = live.loc[common, c].astype(float)
        b = rec.loc[common, c].astype(float)
        both_nan = a.isna() & b.isna()
        diff = ((a - b).abs() / b.abs().clip(lower=1e-300)).where(~both_nan, 0.0)
        mismatch_nan = a.isna() ^ b.isna()
        m = math.inf if bool(mismatch_nan.any()) else float(diff.max()) if len(diff) else 0.0
        out.append({"metric": c, "max_rel_diff": m, "equal": m <= rtol})
    return pd.DataFrame(out)
