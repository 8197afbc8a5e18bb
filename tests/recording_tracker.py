"""Helpers of the prime-rl, NeMo RL and slime hook tests (tests/test_hooks_{prime_rl,nemo_rl,slime}.py).

* :class:`RecordingTracker`, registered as tracker kind ``"recorder"``: a hook's ``loggers=[{"kind": "recorder",
  "path": ...}]`` reaches it as configuration, the monitor of rank 0 builds it in its own process and feeds it;
  it appends what it receives (metrics, alerts, pid) to ``path`` as JSON lines, so a test reads back from any
  process which monitor fed it and with what.
* :class:`AlertLines`: counts the alert lines the monitor's logging sink writes in this process.
* :func:`steps_table`: the run's ``steps/`` table read back from Parquet, one rank, indexed by step — the monitor's
  values a framework's reduced metrics are compared with.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from triage_monitor.alerting import trackers

KIND = "recorder"


def register() -> None:
    """Make ``"recorder"`` a tracker kind in this process (every process that validates or builds one)."""
    trackers.KINDS.setdefault(KIND, "recording_tracker:RecordingTracker")


class RecordingTracker:
    """A tracker (``log_metrics`` / ``emit`` / ``close``) that writes JSON lines to ``path``."""

    def __init__(self, keys="curated", path: str = ""):
        self.keys, self.path = keys, path
        self._write({"kind": "built"})

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **row}) + "\n")

    def log_metrics(self, step, metrics) -> None:
        self._write({"kind": "metrics", "step": int(step),
                     "metrics": {k: v for k, v in trackers.select_metrics(metrics, self.keys).items()
                                 if math.isfinite(v)}})

    def emit(self, alert) -> None:
        self._write({"kind": "alert", **alert.to_row()})

    def close(self) -> None:
        self._write({"kind": "closed"})


def read(path) -> list:
    """The rows a :class:`RecordingTracker` wrote ([] when it was never built)."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class AlertLines(logging.Handler):
    """Counts the records of the ``triage_monitor.alerts`` logger (one per alert the monitor's rules raise)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list = []
        logging.getLogger("triage_monitor.alerts").addHandler(self)

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    def remove(self) -> None:
        logging.getLogger("triage_monitor.alerts").removeHandler(self)


def steps_table(run_dir, rank: int = 0):
    """The ``steps/`` rows of ``rank`` (pandas, indexed by step; the last attempt's row of a repeated step)."""
    import pandas as pd

    steps = pd.read_parquet(Path(run_dir) / "steps")
    return steps[steps["rank"] == rank].drop_duplicates("step", keep="last").set_index("step").sort_index()


def alerts_table(run_dir):
    """The run's ``alerts/`` rows (an empty frame when no alert fired)."""
    import pandas as pd

    p = Path(run_dir) / "alerts"
    return pd.read_parquet(p) if p.exists() else pd.DataFrame(columns=["step", "rule", "rank"])
