"""The run's manifest, ``run.json``: :class:`RunManifest`, reading and writing it, and how a new writer's
configuration differs from the run's (the input of the start checks, :func:`triage_monitor.records.check_run_dir`).

``run.json`` is standard JSON (NaN and ±inf written as null), indented by two spaces, written atomically.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, NamedTuple

import numpy as np

from .layout import RunLayout, temp_path

SCHEMA_VERSION = 3             # of run.json (3: flat table files, RunLayout)

#: ``MonitorConfig`` keys that steer only I/O, devices or start-up checks: attempts of one run may differ in them.
IO_CONFIG_KEYS = frozenset({"record_tokens", "max_queue_bytes", "backpressure",
                            "alignment_check_steps"})
#: Manifest (``info``) keys that say what was trained or imported: an existing run continues only when they match
#: (besides the metric configuration); a key set on one side only counts as a difference.
IDENTITY_KEYS = ("framework", "model", "task", "correction", "seed", "demo_config", "imported_from", "column_map")


def write_json_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` as standard JSON (NaN/inf become null) through a temporary file and an atomic rename.

    Raises:
        OSError: the file cannot be written (no temporary file is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path.parent, ".json")
    try:
        tmp.write_text(json.dumps(_json_safe(obj), indent=2, default=_json_default, allow_nan=False))
        os.replace(tmp, path)
    finally:  # a failed write (full disk) leaves no temporary file behind
        tmp.unlink(missing_ok=True)


def _json_safe(o):
    """``o`` with non-finite floats (numpy's included) replaced by None, recursively (JSON has no NaN)."""
    if isinstance(o, (float, np.floating)):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def read_manifest(run_dir) -> "RunManifest":
    """The :class:`RunManifest` of ``run_dir``.

    Raises:
        FileNotFoundError: no ``run.json``.
        ValueError: ``run.json`` is not a JSON object (the message names the file).
    """
    path = RunLayout(run_dir).manifest
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return RunManifest.from_dict(raw)


@dataclass
class RunManifest:
    """The run's ``run.json``, read and written here only.

    Attributes:
        monitor_config: ``MonitorConfig.to_dict()`` of the run (window, calibration steps, metric thresholds,
            a given τ_tail); ``analysis.Run.config`` turns it back into the ``MonitorConfig``.
        info: the user's / framework's facts (``manifest=`` of the monitor).
        attempts: one entry per process start (attempt id, start time, host, pid, world size).
        calibration: τ_tail's one home once calibrated: ``{"tau_tail", "frozen_at_step", "attempt"}`` (nats).
        status: ``running`` | ``finished`` | ``failed``.
        steps_logged, writer: set when the monitor closes (rows written / dropped, last error).
        extra: keys this version does not know (kept on rewrite).
    """

    monitor_config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    attempts: list = field(default_factory=list)
    calibration: Optional[dict] = None
    status: str = "running"
    steps_logged: Optional[int] = None
    writer: Optional[dict] = None
    schema_version: int = SCHEMA_VERSION
    tool: str = "triage-monitor"
    tool_version: str = ""
    created: str = ""
    python: str = ""
    torch: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tau_tail(self) -> Optional[float]:
        """The run's τ_tail in nats: the given one (``monitor_config.tau_tail``), else the calibrated one, else None."""
        given = self.monitor_config.get("tau_tail")
        if given is not None:
            return float(given)
        cal = self.calibration or {}
        return None if cal.get("tau_tail") is None else float(cal["tau_tail"])

    @classmethod
    def from_dict(cls, d: dict) -> "RunManifest":
        """Parse a ``run.json`` object: the known keys become the fields, every other key goes to ``extra``."""
        d = dict(d)
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        return cls(**known, extra=d)

    def to_dict(self) -> dict:
        """The JSON object written to ``run.json`` (``extra``'s keys at the top level)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d.update(self.extra)
        return d

    def write(self, run_dir) -> None:
        """Write ``run_dir/run.json`` atomically (standard JSON: NaN → null).

        Raises:
            OSError: the file cannot be written."""
        write_json_atomic(self.to_dict(), RunLayout(run_dir).manifest)


# ----------------------------------------------------------------------------------- configuration differences
def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _normalised(obj):
    """``obj`` as it reads back from run.json (tuples → lists, NaN → None, Paths → str)."""
    return json.loads(json.dumps(_json_safe(obj), default=_json_default, allow_nan=False))


class ConfigDifferences(NamedTuple):
    """How a new writer's configuration differs from a run's: two ``{key: (old, new)}`` dicts."""

    #: ``monitor_config.<key>`` of the metric configuration (:data:`IO_CONFIG_KEYS` ignored)
    metric: dict
    #: the :data:`IDENTITY_KEYS` of the manifest (what was trained)
    identity: dict


def config_differences(old: RunManifest, monitor_config: dict, info: dict) -> ConfigDifferences:
    """:class:`ConfigDifferences` of a new writer's ``monitor_config`` and manifest ``info`` against the run
    ``old``."""
    new_mc = _flat(_normalised({k: v for k, v in monitor_config.items() if k not in IO_CONFIG_KEYS}))
    old_mc = _flat({k: v for k, v in old.monitor_config.items() if k not in IO_CONFIG_KEYS})
    metric = {f"monitor_config.{k}": (old_mc.get(k), new_mc.get(k)) for k in sorted(set(new_mc) | set(old_mc))
              if old_mc.get(k) != new_mc.get(k)}
    new_info = _normalised({k: info[k] for k in IDENTITY_KEYS if k in info})
    identity = {}
    for k in IDENTITY_KEYS:
        if k in new_info or k in old.info:
            a, b = old.info.get(k), new_info.get(k)
            if isinstance(a, dict) and isinstance(b, dict):
                fa, fb = _flat(a), _flat(b)
                identity.update({f"{k}.{j}": (fa.get(j), fb.get(j)) for j in sorted(set(fa) | set(fb))
                                 if fa.get(j) != fb.get(j)})
            elif a != b:
                identity[k] = (a, b)
    return ConfigDifferences(metric, identity)


def describe_differences(diffs: dict, limit: int = 8) -> str:
    """``"key: old -> new; ..."`` of the first ``limit`` entries of a :func:`config_differences` dict, with
    ``"; and <n> more"`` for the rest (the start checks' messages)."""
    items = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items()]
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
