"""The options every loss hook of prime-rl, NeMo RL and slime takes beside its loss settings — ``alerts``,
``loggers``, ``framework_keys`` (:class:`~triage_monitor.hooks.worker_runtime.HookSettings`) — and the bookkeeping of
what these hooks hand to the framework's own metrics
(docs/hooks.md#alerts-trackers-and-what-reaches-the-frameworks-logger).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, NamedTuple

from triage_monitor.alerting.alerts import check_alerts_setting
from triage_monitor.alerting.trackers import CURATED_KEYS, Keys, TrackerSpec, check_keys, specs_of

from .worker_runtime import HookSettings, WorkerRuntime


class HookOptions(NamedTuple):
    """:func:`hook_options`' checked ``(alerts, loggers, framework_keys)``, in :class:`HookSettings`' terms."""

    alerts: object
    loggers: list[TrackerSpec]
    framework_keys: Keys


def hook_options(where: str, alerts, loggers, framework_keys) -> HookOptions:
    """Validate ``alerts`` / ``loggers`` / ``framework_keys`` as configuration (what :class:`HookSettings` takes);
    one tracker may be given without a list.

    Returns:
        :class:`HookOptions` ``(alerts, loggers, framework_keys)`` for :class:`HookSettings`: the alerts setting
        with rule mappings made rules, the loggers as :class:`~triage_monitor.alerting.trackers.TrackerSpec`
        list, the framework keys checked.

    Raises:
        ValueError: naming ``where`` and the option (a live engine or tracker included: a hook carries
            configuration only, each worker builds the live objects).
    """
    alerts = check_alerts_setting(alerts, f"{where}: alerts")
    if isinstance(loggers, (str, Mapping)) or hasattr(loggers, "kind"):
        loggers = [loggers]
    try:
        loggers = specs_of(loggers)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: loggers: {exc}") from None
    return HookOptions(alerts, loggers, check_keys(framework_keys, f"{where}: framework_keys"))


def framework_names(settings: HookSettings):
    """The metric names (without ``triage/``) the monitor hands to the framework: ``None`` for every metric
    (``framework_keys="all"``), else a frozenset; empty without a run directory (no monitor)."""
    if settings.run_dir is None:
        return frozenset()
    keys = settings.framework_keys
    return None if keys == "all" else frozenset(CURATED_KEYS if keys == "curated" else keys)


def own_stats(stats: Mapping[str, Any], settings: HookSettings) -> dict[str, Any]:
    """The controller's per-call statistics that keep their ``triage/<name>``: those whose name
    ``framework_keys`` does not claim (under a claimed name the framework logs the monitor's step value)."""
    names = framework_names(settings)
    return {} if names is None else {k: v for k, v in stats.items() if k not in names}


def reports(rt: WorkerRuntime) -> bool:
    """True in the process whose monitor reports (rank 0: its metrics are the job's, it alone has the alert
    state); False elsewhere and without a monitor."""
    mon = rt.monitor if rt.settings.run_dir is not None else None
    return mon is not None and bool(mon.reports)


#: per runtime, the metrics dict last handed over (kept alive, so identity cannot be confused with a new dict's)
_HANDED: "weakref.WeakKeyDictionary[WorkerRuntime, dict]" = weakref.WeakKeyDictionary()


def first_hand_over(rt: WorkerRuntime) -> bool:
    """True once per step this process logged: for the first loss call that asks after the step closed (the
    frameworks that add the metrics of every micro-batch get the value from one call only)."""
    last = rt.last_metrics
    if last is None or _HANDED.get(rt) is last:
        return False
    _HANDED[rt] = last
    return True


__all__ = ["HookOptions", "hook_options", "framework_names", "own_stats", "reports", "first_hand_over"]
