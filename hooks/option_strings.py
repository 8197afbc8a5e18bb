"""The ``alerts`` / ``loggers`` / ``framework_keys`` hook options given as strings (verl's environment variables,
OpenRLHF's ``--triage.*`` flags) or as Python values (SkyRL's ``register``), checked where they are configured so
that a bad value fails at start-up, naming the variable or flag and the value; and the rank-consistent form of
the framework metrics for frameworks that all-reduce a metrics dict key by key (SkyRL).

No metric or alert logic here: the rules are :mod:`triage_monitor.alerting.alerts`', the key selection
:mod:`triage_monitor.alerting.trackers`'.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from triage_monitor.alerting.alerts import check_alerts_setting, load_rules
from triage_monitor.alerting.trackers import PREFIX, TrackerSpec, check_keys, framework_values, specs_of

#: Values of a string ``alerts`` option meaning the shipped default rules / no rules.
ALERTS_DEFAULT = ("default", "on", "true")
ALERTS_OFF = ("off", "false", "none")
#: The monitor's alert-state metric (``MismatchMonitor``: rank 0's count, NaN on the other ranks).
ALERT_STATE = "alerts_active"


def check_alerts(value, where: str):
    """A Python ``alerts`` setting checked now: True / None (default rules), False, a rule file that exists and
    parses, or a list of rules (or mappings of rule fields).

    Raises:
        ValueError: naming ``where`` and the value (a missing or bad rule file included).
    """
    try:
        value = check_alerts_setting(value, where)
        if isinstance(value, str):
            if not os.path.isfile(value):
                raise ValueError(f"{value!r} is not a file")
            load_rules(value)
    except (ValueError, OSError) as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(where) else f"{where}={value!r}: {msg}") from None
    return value


def parse_alerts(raw: Optional[str], where: str):
    """``alerts`` from a string: empty / ``default`` (the shipped rules), ``off``, or a rule file path
    (TOML / YAML, docs/alerts.md), checked now (:func:`check_alerts`).

    Raises:
        ValueError: naming ``where`` and the value.
    """
    text = (raw or "").strip()
    if not text or text.lower() in ALERTS_DEFAULT:
        return True
    if text.lower() in ALERTS_OFF:
        return False
    try:
        return check_alerts(text, where)
    except ValueError as exc:
        raise ValueError(f"{exc} (use 'default', 'off' or the path of a rule file)") from None


def check_loggers(value, where: str, shown=None) -> list[TrackerSpec]:
    """A Python ``loggers`` setting checked now: a list of tracker specs (kind names, mappings with ``kind``,
    :class:`~triage_monitor.alerting.trackers.TrackerSpec`); a single spec is taken as a list of one.

    Raises:
        ValueError: naming ``where`` and the value (``shown``, default ``value``): a live tracker object, an
            unknown kind, bad keys.
    """
    items = [value] if isinstance(value, (str, dict)) else list(value or [])
    try:
        return specs_of(items)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}={value if shown is None else shown!r}: {exc}") from None


def parse_loggers(raw: Optional[str], where: str) -> list[TrackerSpec]:
    """``loggers`` from a string: a JSON list of tracker specs (``'["tensorboard", {"kind": "mlflow",
    "tracking_uri": "file:/shared/mlruns"}]'``), a JSON object (one spec) or comma-separated kind names
    (``tensorboard,mlflow``); empty: none.

    Raises:
        ValueError: naming ``where`` and the value (not JSON, an unknown kind, ...).
    """
    text = (raw or "").strip()
    if not text:
        return []
    if text[0] in "[{":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}={text!r} is not JSON ({exc}); expected a list of tracker specs, e.g. "
                             f"'[\"tensorboard\", {{\"kind\": \"mlflow\", \"tracking_uri\": \"file:mlruns\"}}]'") from None
    else:
        value = [k.strip() for k in text.split(",") if k.strip()]
    return check_loggers(value, where, shown=text)


def check_framework_keys(value, where: str, shown=None):
    """A Python ``framework_keys`` setting checked now: ``"curated"``, ``"all"`` or a list of metric names.

    Raises:
        ValueError: naming ``where`` and the value (``shown``, default ``value``).
    """
    try:
        return check_keys(value, "keys")
    except (ValueError, TypeError) as exc:
        msg = str(exc).split(": ", 1)[-1]
        raise ValueError(f"{where}={value if shown is None else shown!r}: {msg}") from None


def parse_framework_keys(raw: Optional[str], where: str):
    """``framework_keys`` from a string: empty / ``curated``, ``all``, a JSON list of metric names or
    comma-separated names (``window/rho_asym,k3_kl``).

    Raises:
        ValueError: naming ``where`` and the value.
    """
    text = (raw or "").strip()
    if not text:
        return "curated"
    if text in ("curated", "all"):
        return text
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}={text!r} is not JSON ({exc}); expected 'curated', 'all' or metric names") \
                from None
    else:
        value = [k.strip() for k in text.split(",") if k.strip()]
    return check_framework_keys(value, where, shown=text)


def check_normalization(triage, where: str, normaliser: str) -> None:
    """Refuse a ``TriageConfig.normalization`` a framework hook cannot honour.

    Every hook's framework divides by its own normaliser, so the TRIAGE weights are renormalised per response
    (docs/hooks.md#triage-weights-under-a-frameworks-normaliser).  ``triage=None`` (monitoring only) and
    ``"per_response"`` pass.

    Raises:
        ValueError: ``normalization="global_token"``, naming ``where``, the setting and ``normaliser`` (what the
            framework divides by).
    """
    norm = getattr(triage, "normalization", "per_response")
    if triage is not None and norm != "per_response":
        raise ValueError(f"{where}: TriageConfig.normalization={norm!r} cannot be honoured: {normaliser}, so the "
                         "TRIAGE weights are renormalised per response (each response keeps its token count: "
                         "docs/hooks.md#triage-weights-under-a-frameworks-normaliser); use "
                         "normalization='per_response' (the default)")


def dp_framework_metrics(last: Optional[dict], keys, rank: int, dp_size: int, alerts_on: bool) -> dict[str, float]:
    """The framework metrics for a framework that averages a metrics dict over its data-parallel ranks **key by
    key** (one collective per key, so every rank must hand over the same keys in the same order: SkyRL).

    Like :func:`triage_monitor.alerting.trackers.framework_metrics` (``triage/<name>`` floats of the selection and
    ``triage/metrics_step``), but the keys depend on the configuration only, never on a value: NaN values are
    kept (a NaN of a globally reduced metric is NaN on every rank; a rank's own NaN, e.g. a controller ratio
    over zero tokens, would otherwise drop a key on that rank alone and mis-pair the collectives).  The alert
    state ``alerts_active`` exists on rank 0 only (the monitor evaluates the rules there): rank 0 hands over
    ``dp_size`` × its count, every other rank 0.0, so the framework's mean over the ranks is rank 0's count;
    without rules the key is left out on every rank.

    Args:
        last: the last logged step's metrics of this process (None: nothing logged yet → ``{}``).
        keys: the selection (``HookSettings.framework_keys``).
        rank: this process's monitor rank; ``dp_size``: the ranks the framework averages over.
        alerts_on: the hook's alerts setting is not False.
    """
    if not last:
        return {}
    out = {PREFIX + k: v for k, v in framework_values(last, keys).items()}   # ratios at noise level left out
    state = PREFIX + ALERT_STATE
    if state in out:
        if not alerts_on:
            del out[state]
        else:
            v = out[state]
            out[state] = float(v) * dp_size if rank == 0 and math.isfinite(v) else 0.0
    if "step" in last and out:
        out[PREFIX + "metrics_step"] = float(last["step"])
    return out


__all__ = ["check_alerts", "parse_alerts", "check_loggers", "parse_loggers", "check_framework_keys",
           "parse_framework_keys", "check_normalization", "dp_framework_metrics"]
