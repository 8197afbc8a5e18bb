"""Trackers: where a step's metrics and alerts go besides the run directory (W&B, TensorBoard, MLflow).

A tracker is any object with ``log_metrics(step, metrics)`` and ``close()`` (:class:`MetricLogger`); one that
also has ``emit(alert)`` (:class:`triage_monitor.alerting.alerts.AlertSink`) receives every alert the monitor's rules raise, and one with
``log_config(mapping)`` receives the run's manifest once.  The shipped ones are lazily imported, optional, and
never raise into the training loop:

==============  ====================================================  ==================================
``wandb``       :class:`triage_monitor.alerting.wandb_logger.WandbLogger`       metrics; ``wandb.Run.alert``
``tensorboard`` :class:`triage_monitor.alerting.tensorboard_logger.TensorBoardLogger`  scalars; alert text
``mlflow``      :class:`triage_monitor.alerting.mlflow_logger.MLflowLogger`     metrics; alert tags + text artifacts
==============  ====================================================  ==================================

**Which keys.**  A tracker logs the curated set :data:`CURATED_KEYS` by default — the handful a person reads
on a dashboard: direction (window and step ρ_asym), magnitude (small-gap share, k3 KL, mean |δ|), localisation
(C_tok), the Gate's activity and the number of active alerts — each as ``triage/<name>``; ``keys="all"`` logs
every metric of the step, or give the names (docs/alerts.md#trackers).

**Configuration, not objects.**  A framework hook runs in processes it does not create (Ray workers), so
trackers are given to it as :class:`TrackerSpec` (or its plain forms: ``"tensorboard"``,
``{"kind": "mlflow", "keys": "all", "tracking_uri": ...}``), which pickle; :func:`build_trackers` turns them
into live trackers in the process that logs (rank 0).

This module imports no tracker library; each tracker module imports its own on first use.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

#: Key prefix of every metric in a tracker (``window/rho_asym`` -> ``triage/window/rho_asym``).
PREFIX = "triage/"

#: The default metric set of every tracker and of the frameworks' own loggers (docs/alerts.md#trackers).
CURATED_KEYS = ("window/rho_asym", "rho_asym", "window/small_gap_share", "window/k3_kl", "window/c_tok",
                "delta_abs_mean", "gate_downweighted_frac", "alerts_active")

#: Ratio metrics that are rounding noise when the learner and the sampler agree to rounding: each with the metric that
#: says so, by the rule of the shipped rules' noise guard (docs/alerts.md#noise-guard): below
#: :data:`~triage_monitor.alerting.alert_rules.NOISE_FLOOR_NATS` nats of mean |δ| they reach a tracker as NaN.
NOISE_GUARDED = {**{f"window/{m}": "window/delta_abs_mean" for m in ("rho_asym", "rho_asym_lennorm", "amp_share",
                                                                         "c_tok")},
                 **{m: "delta_abs_mean" for m in ("rho_asym", "rho_asym_lennorm", "amp_share", "c_tok")}}
#: The flag series beside them: 1.0 when the step's window is at noise level, 0.0 otherwise (``triage/noise``).
NOISE_KEY = "noise"

#: Tracker kinds and the ``module:Class`` that implements each.
KINDS = {"wandb": "triage_monitor.wandb_logger:WandbLogger",
         "tensorboard": "triage_monitor.tensorboard_logger:TensorBoardLogger",
         "mlflow": "triage_monitor.mlflow_logger:MLflowLogger"}

Keys = Union[str, Sequence[str]]


class CallGuard:
    """Call a tracker library's function without ever raising: the first failure of each named operation is
    reported (a warning with its traceback on ``logger``), later ones are only counted in :attr:`failures`.

    Args:
        owner: the tracker's name in the report (``"TensorBoardLogger"``).
        logger: where the report goes.
    """

    def __init__(self, owner: str, logger: logging.Logger):
        self.owner, self.logger = owner, logger
        #: failures so far per operation name
        self.failures: dict = {}

    def __call__(self, what: str, fn, *a, **kw):
        """``fn(*a, **kw)``, or None when it raised (reported once per ``what``)."""
        try:
            return fn(*a, **kw)
        except Exception:
            n = self.failures.get(what, 0)
            self.failures[what] = n + 1
            if n == 0:
                self.logger.warning("%s: %s failed; skipped (further failures are counted, not reported)",
                                    self.owner, what, exc_info=True)
            return None


@runtime_checkable
class MetricLogger(Protocol):
    """What the monitor calls on a tracker every step (rank 0); a ``close()`` (called at the end) is optional
    (:class:`triage_monitor.alerting.alerts.Closable`)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...


@runtime_checkable
class ConfigRecorder(Protocol):
    """A tracker that records the run's manifest once (``log_config(mapping)``, JSON-able)."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...


def check_keys(keys: Keys, where: str = "keys") -> Keys:
    """Validate a key selection: ``"curated"``, ``"all"`` or a sequence of metric names.

    Raises:
        ValueError: anything else, naming ``where`` and the value.
    """
    if isinstance(keys, str):
        if keys not in ("curated", "all"):
            raise ValueError(f"{where}={keys!r}: use 'curated', 'all' or a list of metric names")
        return keys
    names = tuple(keys)
    if not names or not all(isinstance(k, str) and k for k in names):
        raise ValueError(f"{where}={keys!r}: use 'curated', 'all' or a non-empty list of metric names")
    return names


def select_metrics(metrics: Mapping[str, Any], keys: Keys = "curated") -> dict[str, float]:
    """The metrics a tracker logs: ``keys`` of ``metrics`` (``"curated"``: :data:`CURATED_KEYS`; ``"all"``:
    every key but ``step``), as floats; keys that are absent or not numbers are left out, NaN is kept.

    Args:
        metrics: the monitor's step metrics (``MismatchMonitor.log_step``'s return value).
        keys: see :func:`check_keys`.

    Returns:
        ``{name: float}`` without the prefix, in the order of ``keys`` (``"all"``: sorted by name).
    """
    keys = check_keys(keys)
    names = CURATED_KEYS if keys == "curated" else sorted(k for k in metrics if k != "step") if keys == "all" \
        else keys
    out: dict[str, float] = {}
    for k in names:
        v = metrics.get(k)
        if v is None or isinstance(v, bool):
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def at_noise_level(metrics: Mapping[str, Any], guard: str = "window/delta_abs_mean") -> bool:
    """True when ``metrics[guard]`` (mean |δ|, nats) is finite and below
    :data:`~triage_monitor.alerting.alert_rules.NOISE_FLOOR_NATS`: the shipped rules' noise guard (docs/alerts.md#noise-guard);
    False when it is absent or NaN (nothing says so)."""
    from .alert_rules import NOISE_FLOOR_NATS

    v = metrics.get(guard)
    if v is None:
        return False
    try:
        x = float(v)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and x < NOISE_FLOOR_NATS


def noise_flags(frame, window: bool = True):
    """:func:`at_noise_level` of every row of a steps frame: ``(rows,)`` bool numpy array — the window's mean |δ|
    (``window``) or the step's below the floor; all False without the column."""
    import numpy as np

    from .alert_rules import NOISE_FLOOR_NATS

    col = "window/delta_abs_mean" if window else "delta_abs_mean"
    if col not in frame.columns:
        return np.zeros(len(frame), dtype=bool)
    g = frame[col].to_numpy(dtype=float)
    return np.isfinite(g) & (g < NOISE_FLOOR_NATS)


def tracker_metrics(metrics: Mapping[str, Any], keys: Keys = "curated") -> dict[str, float]:
    """What a tracker (W&B, TensorBoard, MLflow) logs: :func:`select_metrics` with every ratio of
    :data:`NOISE_GUARDED` set to NaN where its guard is below the noise floor (:func:`at_noise_level`, the alert
    guard's rule: a ratio of rounding noise is no value to chart), and the flag :data:`NOISE_KEY` (1.0 / 0.0, from
    the window's mean |δ|) when the curated set or ``"all"`` is asked for (or ``"noise"`` named) and the step has
    the guard.

    Args:
        metrics: the monitor's step metrics; keys: see :func:`check_keys`.

    Returns:
        ``{name: float}`` without the prefix (docs/alerts.md#trackers).
    """
    out = select_metrics(metrics, keys)
    for k in out:
        guard = NOISE_GUARDED.get(k)
        if guard is not None and at_noise_level(metrics, guard):
            out[k] = math.nan
    named = keys in ("curated", "all") or (not isinstance(keys, str) and NOISE_KEY in keys)
    if named and "window/delta_abs_mean" in metrics:
        out[NOISE_KEY] = 1.0 if at_noise_level(metrics) else 0.0
    return out


def framework_values(metrics: Mapping[str, Any], keys: Keys = "curated") -> dict[str, float]:
    """What a hook hands to a framework that reduces a metrics dict over its data-parallel ranks key by key (slime,
    Miles, SkyRL): :func:`tracker_metrics` with the direction ratios at noise level *left out* rather than NaN — the
    noise guard is a globally reduced value (the window's mean |δ|), alike on every rank, so the keys stay the same on
    every rank — and every other NaN kept (a rank's own NaN must not drop a key on that rank alone).

    Returns:
        ``{name: float}`` without the prefix, the :data:`NOISE_KEY` flag included when :func:`tracker_metrics` adds it.
    """
    out = select_metrics(metrics, keys)
    for k in [k for k in out if k in NOISE_GUARDED and at_noise_level(metrics, NOISE_GUARDED[k])]:
        del out[k]
    flag = tracker_metrics(metrics, keys).get(NOISE_KEY)
    if flag is not None:
        out[NOISE_KEY] = flag
    return out


def framework_metrics(metrics: Optional[Mapping[str, Any]], keys: Keys = "curated",
                      prefix: str = PREFIX) -> dict[str, float]:
    """The metrics a framework hook hands to the framework's own logger: :func:`tracker_metrics` under
    ``prefix`` (``triage/``, so they never collide with a framework's names) — the direction ratios left out at
    noise level, as every tracker shows them (docs/alerts.md#noise-guard), beside the ``triage/noise`` flag — NaN
    values left out (a framework's reducer would spread them), plus ``triage/metrics_step``: the monitored step they
    belong to.

    Args:
        metrics: the last logged step's metrics (None: nothing logged yet -> ``{}``).
    """
    if not metrics:
        return {}
    out = {prefix + k: v for k, v in tracker_metrics(metrics, keys).items() if math.isfinite(v)}
    if "step" in metrics and out:
        out[prefix + "metrics_step"] = float(metrics["step"])
    return out


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker as picklable configuration (framework hooks build the live tracker in the logging process).

    Args:
        kind: a key of :data:`KINDS`.
        keys: metrics to log (:func:`check_keys`; default the curated set).
        options: keyword arguments of the tracker class (e.g. ``log_dir`` for TensorBoard, ``tracking_uri`` /
            ``experiment`` for MLflow, ``init_kwargs`` for W&B); plain values only.

    Raises:
        ValueError: an unknown kind or a bad key selection.
    """

    kind: str
    keys: Keys = "curated"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tracker kind {self.kind!r} is not one of {sorted(KINDS)}")
        object.__setattr__(self, "keys", check_keys(self.keys, f"tracker {self.kind!r} keys"))
        object.__setattr__(self, "options", dict(self.options))
        import inspect

        params = inspect.signature(self.tracker_class()).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            bad = sorted(set(self.options) - set(params) - {"keys"})
            if bad:
                raise ValueError(f"tracker {self.kind!r}: unknown option(s) {bad}; it takes "
                                 f"{sorted(k for k in params if k not in ('self', 'keys'))}")

    def tracker_class(self):
        """The tracker class of :attr:`kind` (imports its module, not the tracker library)."""
        import importlib

        mod, cls = KINDS[self.kind].split(":")
        return getattr(importlib.import_module(mod), cls)

    @classmethod
    def parse(cls, item) -> "TrackerSpec":
        """A spec from its plain forms: a spec, a kind name (``"tensorboard"``), or a mapping with ``kind``
        (and ``keys``; every other entry is an option).

        Raises:
            ValueError: anything else (naming it), an unknown kind, a bad key selection.
        """
        if isinstance(item, cls):
            return item
        if isinstance(item, str):
            return cls(item)
        if isinstance(item, Mapping) and "kind" in item:
            opts = {k: v for k, v in item.items() if k not in ("kind", "keys")}
            return cls(item["kind"], item.get("keys", "curated"), opts)
        raise ValueError(f"tracker {item!r}: give a kind ({', '.join(sorted(KINDS))}), a TrackerSpec or a mapping "
                         f"with 'kind'")

    def build(self):
        """The live tracker (imports its module now)."""
        return self.tracker_class()(keys=self.keys, **self.options)


def build_trackers(items: Iterable) -> list[MetricLogger]:
    """Live trackers from a mix of live objects (anything with ``log_metrics``, kept as it is) and
    :class:`TrackerSpec` plain forms (built now).  A tracker whose construction fails (its directory cannot be
    made, ...) is reported once as a warning and left out: monitoring never stops training.

    Raises:
        ValueError: an item that is neither, an unknown kind or option (naming it).
    """
    out = []
    for item in items or ():
        if isinstance(item, MetricLogger):
            out.append(item)
            continue
        spec = TrackerSpec.parse(item)
        try:
            out.append(spec.build())
        except Exception as exc:  # noqa: BLE001 — a tracker is optional; training goes on without it
            logging.getLogger("triage_monitor").warning(
                "triage-monitor: the %s tracker could not start (%s: %s); it is left out", spec.kind,
                type(exc).__name__, exc)
    return out


def specs_of(items: Iterable) -> list[TrackerSpec]:
    """Validate tracker configuration without building anything (hook settings on the driver): the
    :class:`TrackerSpec` of each item.

    Raises:
        ValueError: a live tracker object (it cannot travel into a worker process: give a spec) or a bad spec.
    """
    out = []
    for item in items or ():
        if isinstance(item, MetricLogger):
            raise ValueError(f"tracker {item!r} is a live object; a hook needs configuration it can rebuild in each "
                             f"worker: a kind name, a TrackerSpec or a mapping with 'kind'")
        out.append(TrackerSpec.parse(item))
    return out


__all__ = ["PREFIX", "CURATED_KEYS", "KINDS", "CallGuard", "MetricLogger", "ConfigRecorder", "TrackerSpec", "check_keys",
           "select_metrics", "tracker_metrics", "at_noise_level", "noise_flags", "NOISE_GUARDED", "NOISE_KEY",
           "framework_metrics", "build_trackers", "specs_of"]
