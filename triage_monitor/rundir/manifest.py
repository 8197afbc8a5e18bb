"""The run's manifest, ``run.json``: :class:`RunManifest`, reading and writing it, and how a new writer's
configuration differs from the run's (the input of the start checks, :func:`triage_monitor.rundir.records.check_run_dir`).

``run.json`` is standard JSON (NaN and ±inf written as null), indented by two spaces, written atomically.
Reading it checks the type and range of every field this version uses, once (:meth:`RunManifest.from_dict`):
a crafted or damaged ``run.json`` is a :class:`ManifestError` naming the field, never a crash further on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from ..errors import TriageMonitorError
from .layout import MANIFEST, RunLayout

SCHEMA_VERSION = 4             # of run.json (3: flat table files, RunLayout; 4: blocks of steps, pending files)

#: ``MonitorConfig`` keys that steer only I/O, devices or start-up checks: attempts of one run may differ in them.
IO_CONFIG_KEYS = frozenset({"record_tokens", "max_queue_bytes", "backpressure",
                            "alignment_check_steps", "per_rank_steps", "roll_steps", "roll_bytes"})
#: Manifest (``info``) keys that say what was trained or imported: an existing run continues only when they match
#: (besides the metric configuration); a key set on one side only counts as a difference.
IDENTITY_KEYS = ("framework", "model", "task", "correction", "seed", "demo_config", "imported_from", "column_map")


def json_text(obj: dict) -> str:
    """``obj`` as standard JSON text, indented by two spaces (NaN/inf become null)."""
    return json.dumps(_json_safe(obj), indent=2, default=_json_default, allow_nan=False)


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


class ManifestError(TriageMonitorError, ValueError):
    """A ``run.json`` field of the wrong type or out of range (:meth:`RunManifest.from_dict`); a ``ValueError``.

    ``field``: the field's dotted name (``monitor_config.window``); ``path``: the file, when read from one."""

    def __init__(self, message: str, field: str, path=None):
        super().__init__(message)
        self.field = field
        self.path = None if path is None else Path(path)


#: The largest int64: step numbers, attempt ids and step counts are int64 columns and file-name fields.
INT64_MAX = 2 ** 63 - 1
#: ``MetricConfig`` fields a manifest's ``monitor_config.metrics`` may hold, and whether each is an integer.
_METRIC_FIELDS = {"small_gap_threshold": False, "segment_width": True, "tail_quantile": False,
                  "heavy_fraction": False, "top_fraction": False, "dilution_threshold": False}


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(v) -> str:
    """The JSON name of ``v``'s type (what a message says was found)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float, np.integer, np.floating)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _fail(name: str, what: str, v, numeric: bool = False):
    """Raise the :class:`ManifestError` of field ``name``: "must be <what>, got <v>" (a number asked for and
    given: the value alone; otherwise its JSON type too)."""
    got = _shown(v) if numeric and _is_number(v) else f"{_kind(v)} ({_shown(v)})"
    raise ManifestError(f"{name} must be {what}, got {got}", name)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _check_int(name: str, v, lo: int = 0, hi: int = INT64_MAX, *, null: bool = False) -> None:
    """``v`` is an integer in [lo, hi] (a float with an integral value counts: JSON has one number type)."""
    if v is None and null:
        return
    what = f"{'null or ' if null else ''}an integer from {lo} to {hi}"
    if not _is_number(v) or (isinstance(v, (float, np.floating)) and not float(v).is_integer()) \
            or not lo <= v <= hi:
        _fail(name, what, v, numeric=True)


def _check_real(name: str, v, *, null: bool = False) -> None:
    """``v`` is a finite number (or null with ``null``)."""
    if v is None and null:
        return
    if not _is_number(v) or not math.isfinite(float(v)):
        _fail(name, f"{'null or ' if null else ''}a finite number", v, numeric=True)


def _check_type(name: str, v, kind: type, what: str, *, null: bool = False) -> None:
    if (v is None and null) or isinstance(v, kind) and not (kind is int and isinstance(v, bool)):
        return
    _fail(name, f"{'null or ' if null else ''}{what}", v)


def check_monitor_config(cfg, name: str = "monitor_config") -> None:
    """Check a ``MonitorConfig.to_dict()`` as a run's manifest holds it (a missing key takes its default; a key
    this version does not know is kept, except under ``metrics``, whose thresholds a reader must honour).

    * ``window``, ``calibration_steps``: integers from 1 to 2**63 - 1 (steps are int64);
    * ``tau_tail``: null or a finite number (nats);
    * ``metrics``: an object of ``MetricConfig`` fields: finite numbers (``segment_width`` an integer) in the
      ranges ``MetricConfig`` accepts;
    * the I/O keys: ``record_tokens`` and ``per_rank_steps`` booleans, ``max_queue_bytes`` and
      ``alignment_check_steps`` integers, ``roll_steps`` and ``roll_bytes`` integers from 1, ``backpressure`` a
      string.

    Raises:
        ManifestError: the first field that fails, named ``<name>.<key>``."""
    from ..config import MetricConfig

    _check_type(name, cfg, dict, "an object")
    for key in ("window", "calibration_steps"):
        if key in cfg:
            _check_int(f"{name}.{key}", cfg[key], 1)
    if "tau_tail" in cfg:
        _check_real(f"{name}.tau_tail", cfg["tau_tail"], null=True)
    for key in ("record_tokens", "per_rank_steps"):
        if key in cfg:
            _check_type(f"{name}.{key}", cfg[key], bool, "a boolean")
    for key in ("max_queue_bytes", "alignment_check_steps"):
        if key in cfg:
            _check_int(f"{name}.{key}", cfg[key], -INT64_MAX - 1)
    for key in ("roll_steps", "roll_bytes"):
        if key in cfg:
            _check_int(f"{name}.{key}", cfg[key], 1)
    if "backpressure" in cfg:
        _check_type(f"{name}.backpressure", cfg["backpressure"], str, "a string")
    if "metrics" in cfg:
        metrics = cfg["metrics"]
        _check_type(f"{name}.metrics", metrics, dict, "an object")
        for key, v in metrics.items():
            field_name = f"{name}.metrics.{key}"
            if key not in _METRIC_FIELDS:
                raise ManifestError(f"{field_name} is no metric setting this version knows (known: "
                                    f"{', '.join(_METRIC_FIELDS)})", field_name)
            if _METRIC_FIELDS[key]:
                _check_int(field_name, v, 1)
            else:
                _check_real(field_name, v)
        try:
            MetricConfig(**metrics)
        except ValueError as exc:
            raise ManifestError(f"{name}.metrics: {exc}", f"{name}.metrics") from None


def _check_manifest(d: dict) -> None:
    """The type and range of every known field of a ``run.json`` object (see :meth:`RunManifest.from_dict`)."""
    if "monitor_config" in d:
        check_monitor_config(d["monitor_config"])
    for key in ("info", "writer"):
        if key in d:
            _check_type(key, d[key], dict, "an object", null=key == "writer")
    if "attempts" in d:
        _check_type("attempts", d["attempts"], list, "an array")
        for i, a in enumerate(d["attempts"]):
            _check_type(f"attempts[{i}]", a, dict, "an object")
            if "attempt" in a:
                _check_int(f"attempts[{i}].attempt", a["attempt"], 0, null=True)
            if "world_size" in a:
                _check_int(f"attempts[{i}].world_size", a["world_size"], 1, null=True)
    if "calibration" in d:
        cal = d["calibration"]
        _check_type("calibration", cal, dict, "an object", null=True)
        if cal is not None:
            if "tau_tail" in cal:
                _check_real("calibration.tau_tail", cal["tau_tail"], null=True)
            if "frozen_at_step" in cal:
                _check_int("calibration.frozen_at_step", cal["frozen_at_step"], -INT64_MAX - 1, null=True)
            if "attempt" in cal:
                _check_int("calibration.attempt", cal["attempt"], 0, null=True)
    if "steps_logged" in d:
        _check_int("steps_logged", d["steps_logged"], 0, null=True)
    if "schema_version" in d:
        _check_int("schema_version", d["schema_version"], 1)
        if d["schema_version"] > SCHEMA_VERSION:         # a layout this version cannot know how to read or extend
            raise ManifestError(f"schema_version {int(d['schema_version'])} is newer than this triage-monitor reads "
                                f"({SCHEMA_VERSION}): the run was written by a newer release; upgrade triage-monitor "
                                "to read or continue it", "schema_version")
    for key in ("status", "tool", "tool_version", "created", "python", "torch"):
        if key in d:
            _check_type(key, d[key], str, "a string")


def read_manifest(run_dir) -> "RunManifest":
    """The :class:`RunManifest` of ``run_dir`` (a location, or its :class:`~triage_monitor.rundir.layout.RunLayout`), its
    fields checked (:meth:`RunManifest.from_dict`).

    Raises:
        FileNotFoundError: no ``run.json``.
        ValueError: ``run.json`` is not a JSON object (the message names the file).
        ManifestError: (a ValueError) a field of the wrong type or out of range; the message names the file and
            the field.
    """
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(run_dir)
    path = layout.store.display(MANIFEST)
    try:
        raw = json.loads(layout.store.read_bytes(MANIFEST).decode())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return RunManifest.from_dict(raw)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}", exc.field, path) from None


@dataclass
class RunManifest:
    """The run's ``run.json``, read and written here only.

    Attributes:
        monitor_config: ``MonitorConfig.to_dict()`` of the run (window, calibration steps, metric thresholds,
            a given τ_tail); ``analysis.Run.config`` turns it back into the ``MonitorConfig``.
        info: the user's / framework's facts (``manifest=`` of the monitor).
        attempts: one entry per process start (attempt id, start time, host, pid, world size).
        calibration: τ_tail's one home once calibrated: ``{"tau_tail", "frozen_at_step", "attempt"}`` (nats).
        status: ``running`` | ``finished`` | ``failed`` | ``interrupted`` (Ctrl-C).
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
        """Parse a ``run.json`` object: the known keys become the fields, every other key goes to ``extra``.

        The fields this version uses are checked once, here, so that no reader meets a value it cannot use:
        ``monitor_config`` (:func:`check_monitor_config`), ``info`` an object, ``attempts`` an array of objects
        (``attempt`` an integer from 0, ``world_size`` from 1), ``calibration`` null or an object (``tau_tail``
        a finite number or null, ``frozen_at_step`` and ``attempt`` integers), ``writer`` null or an object,
        ``steps_logged`` null or an integer from 0, ``schema_version`` an integer from 1, ``status``,
        ``tool``, ``tool_version``, ``created``, ``python``, ``torch`` strings.  Integers are at most 2**63 - 1.

        Raises:
            ManifestError: the first field that fails (``.field`` its dotted name, in the message too)."""
        _check_manifest(d)
        d = dict(d)
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        return cls(**known, extra=d)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to ``run.json`` (``extra``'s keys at the top level)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d.update(self.extra)
        return d

    def write(self, run_dir) -> None:
        """Write ``run_dir/run.json`` (a location, or its :class:`~triage_monitor.rundir.layout.RunLayout`) whole or not
        at all (standard JSON: NaN → null).

        Raises:
            OSError: the file cannot be written."""
        layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(run_dir)
        layout.store.write_bytes(MANIFEST, json_text(self.to_dict()).encode())


# ----------------------------------------------------------------------------------- configuration differences
def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """``d`` with its nested dicts flattened into dotted keys (``{"a": {"b": 1}}`` → ``{"a.b": 1}``)."""
    out: dict[str, Any] = {}
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
    metric: dict[str, tuple[Any, Any]]
    #: the :data:`IDENTITY_KEYS` of the manifest (what was trained)
    identity: dict[str, tuple[Any, Any]]


def config_differences(old: RunManifest, monitor_config: dict, info: dict) -> ConfigDifferences:
    """:class:`ConfigDifferences` of a new writer's ``monitor_config`` and manifest ``info`` against the run
    ``old``."""
    new_mc = _flat(_normalised({k: v for k, v in monitor_config.items() if k not in IO_CONFIG_KEYS}))
    old_mc = _flat({k: v for k, v in old.monitor_config.items() if k not in IO_CONFIG_KEYS})
    metric = {f"monitor_config.{k}": (old_mc.get(k), new_mc.get(k)) for k in sorted(set(new_mc) | set(old_mc))
              if old_mc.get(k) != new_mc.get(k)}
    new_info = _normalised({k: info[k] for k in IDENTITY_KEYS if k in info})
    identity: dict[str, tuple[Any, Any]] = {}
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
