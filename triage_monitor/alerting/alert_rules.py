"""Alert rules: the :class:`Rule` record, its validation, rule files (TOML / YAML) and the shipped defaults.

A :class:`Rule` watches one metric (a name from the monitor's metric dict,
e.g. ``"window/rho_asym"`` for the monitor's pooled 25-step window value,
docs/metrics.md#steps-and-windows) and tests one condition every step:

==============  =========================================================================
``above``       value > threshold
``below``       value < threshold
``rising``      the value at t, t-w, ..., t-k·w (w = ``window`` steps) strictly increases
                and v(t) - v(t-k·w) > threshold (``relative``: divided by |v(t-k·w)|);
                with ``full_window`` no look-back lies before the first full window
``falling``     mirror of ``rising``: strictly decreasing, drop > threshold
``excess``      value - baseline > threshold; baseline = median of the value over the
                first ``baseline_steps`` steps of the run (or given as ``baseline``)
``deficit``     baseline - value > threshold
``drawdown``    (running peak - value) / |running peak| > threshold: the value fell this far
                below the highest value it had since the rule's first full window
                (e.g. a trailing reward 20 % below its peak: ``threshold = 0.2``)
==============  =========================================================================

The value a rule tests is the metric itself when the metric already is a
trailing-window value (name starting ``window/``: the monitor pools the raw
sums of the window, docs/metrics.md#steps-and-windows) or when ``window == 1``; otherwise the engine
aggregates the per-step values of the trailing ``window`` steps (inclusive)
with ``agg`` (mean, sum, min, max, last; NaN values are ignored).  Averaging
per-step ratios is not the pooled window of docs/metrics.md: prefer ``window/<name>``
metrics where the monitor provides them.

Noise guard: a rule with a ``guard_metric`` is evaluated only on steps where
that metric is at least ``guard_min``.  The shipped direction rules (and the
other ratio rules) guard on ``window/delta_abs_mean`` >= :data:`NOISE_FLOOR_NATS`:
below it the learner and sampler agree to float rounding (a bit-exact
pipeline: |δ| ≈ 1e-8 nats), ρ_asym is a ratio of two rounding-noise masses
and swings between ~0.6 and ~1.9 with no meaning, so the step is reported as
*noise level* (:attr:`triage_monitor.alerting.alerts.AlertEngine.noise_steps`), the rule's streak restarts
and it never fires there.  A step whose guard value is missing is evaluated
normally (a foreign history without the guard column keeps its alerts).

The engine that evaluates rules (hysteresis, cooldown, sinks, replay) is
:mod:`triage_monitor.alerting.alerts`, which re-exports everything public here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

CONDITIONS = ("above", "below", "rising", "falling", "excess", "deficit", "drawdown")
LEVELS = ("INFO", "WARN", "ERROR")
#: What a rule's alert means (docs/alerts.md#tiers): ``mismatch`` — the sampler is this far off-policy or this
#: imprecise, or the logged gap cannot be trusted (informational: expected on any lagged or low-precision run);
#: ``collapse`` — a warning that the run is heading for divergence.
TIERS = ("mismatch", "collapse")
AGGS = {"mean": np.nanmean, "sum": np.nansum, "min": np.nanmin, "max": np.nanmax, "last": None}
WINDOW_PREFIX = "window/"
DEFAULT_RULES_FILE = "default_alert_rules.toml"
#: Baseline rules any engineer writes without this toolkit (docs/alerts.md#evaluating-the-alerts): the yardstick of
#: ``triage-monitor alerts --evaluate``
BASELINE_RULES_FILE = "baseline_alert_rules.toml"
#: Mean |δ| (nats) below which direction metrics are float-rounding noise: 1e-4 nats sits ~1000× above a
#: bit-exact fp32 pipeline (|δ| ~ 1e-8–1e-7) and ~100× below an NVFP4 sampler (|δ| ~ 0.01–0.1); docs/alerts.md#noise-guard
NOISE_FLOOR_NATS = 1e-4

# ----------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """One alert rule (see the module docstring for the semantics of each field).

    Args:
        name: unique id; the W&B alert title is derived from it.
        metric: key in the per-step metric dict (``"window/rho_asym"``, ``"nonfinite_count"``).
        condition: one of :data:`CONDITIONS`.
        threshold: level (above/below), minimum rise/drop (rising/falling) or minimum
            distance from the baseline (excess/deficit), in the metric's units
            (or a fraction of the reference value when ``relative``).
        window: trailing window in steps: the aggregation length for a per-step metric,
            and the spacing of the look-back for rising/falling.  For ``window/<name>``
            metrics it should equal the monitor's window (25).
        agg: aggregation of per-step values over the window (ignored for ``window/`` metrics).
        k: number of windows a rising/falling condition spans.
        baseline_steps: calibration length N for excess/deficit: steps
            ``[first_step, first_step + N)``.
        baseline: explicit baseline (skips calibration).
        relative: threshold is relative to the reference value (look-back or baseline).
        hold: consecutive evaluated steps the condition must hold before firing (>= 1).
        cooldown: minimum steps between two firings of this rule (>= 0).
        level: ``INFO``, ``WARN`` or ``ERROR``.
        wait_s: W&B ``wait_duration`` in seconds (server-side de-duplication per title).
        group: free label (``direction``, ``magnitude``, ...), shown in docs and tables.
        tier: one of :data:`TIERS`: ``mismatch`` (informational: the gap is this large, expected on any stale or
            low-precision run) or ``collapse`` (the run is heading for divergence; the only tier that raises a
            W&B alert by default).  A rule file's rule without ``tier`` is a ``collapse`` rule.
        note: one sentence appended to the alert text (why the rule exists).
        guard_metric: optional metric that must be >= ``guard_min`` for the rule to be
            evaluated at a step (the noise guard; see the module docstring).  Empty: no guard.
        guard_min: the guard's threshold, in ``guard_metric``'s units (nats for ``window/delta_abs_mean``).
        full_window: rising/falling only: a look-back before step ``first_step + window − 1``
            (the monitor's first full window) is not a reference (the rule waits for one).
        clear_after: an active alert clears once the tested value has been missing or NaN on this many consecutive
            steps (0, the default: the rule's ``hold``, as many steps as it took to fire); a step held back by the
            noise guard clears it at once (docs/alerts.md#hysteresis-clearing-cooldown).
        runbook: where the rule's "what to do" entry is (a doc anchor or a URL), named in its alert text; empty:
            the shipped rules' entry in docs/alerts.md#runbook, none for other rules
            (:func:`triage_monitor.alerting.alerts.runbook_ref`).

    Raises:
        ValueError: naming the field and the bad value.
    """

    name: str
    metric: str
    condition: str
    threshold: float
    window: int = 1
    agg: str = "mean"
    k: int = 2
    baseline_steps: int = 50
    baseline: Optional[float] = None
    relative: bool = False
    hold: int = 1
    cooldown: int = 0
    level: str = "WARN"
    wait_s: float = 600.0
    group: str = ""
    tier: str = "collapse"
    note: str = ""
    guard_metric: str = ""
    guard_min: float = 0.0
    full_window: bool = False
    clear_after: int = 0
    runbook: str = ""

    def __post_init__(self):
        def bad(f, why):
            raise ValueError(f"alert rule {self.name!r}: {f}={getattr(self, f)!r} {why}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"alert rule: name={self.name!r} must be a non-empty string")
        if not isinstance(self.metric, str) or not self.metric:
            bad("metric", "must be a non-empty string")
        if self.condition not in CONDITIONS:
            bad("condition", f"must be one of {CONDITIONS}")
        if self.level not in LEVELS:
            bad("level", f"must be one of {LEVELS}")
        if self.tier not in TIERS:
            bad("tier", f"must be one of {TIERS}")
        if self.agg not in AGGS:
            bad("agg", f"must be one of {tuple(AGGS)}")
        try:
            threshold_ok = math.isfinite(float(self.threshold))
        except (TypeError, ValueError):
            threshold_ok = False
        if not threshold_ok:
            bad("threshold", "must be a finite number")
        for f, lo in (("window", 1), ("k", 1), ("baseline_steps", 1), ("hold", 1), ("cooldown", 0)):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                bad(f, f"must be an integer >= {lo}")
        if self.baseline is not None and not math.isfinite(float(self.baseline)):
            bad("baseline", "must be a finite number or omitted")
        if not float(self.wait_s) >= 0:
            bad("wait_s", "must be >= 0")
        if not isinstance(self.guard_metric, str):
            bad("guard_metric", "must be a metric name or empty")
        try:
            guard_ok = math.isfinite(float(self.guard_min))
        except (TypeError, ValueError):
            guard_ok = False
        if not guard_ok:
            bad("guard_min", "must be a finite number")
        object.__setattr__(self, "guard_min", float(self.guard_min))
        if not isinstance(self.full_window, bool):
            bad("full_window", "must be true or false")
        if not isinstance(self.clear_after, int) or isinstance(self.clear_after, bool) or self.clear_after < 0:
            bad("clear_after", "must be an integer >= 0 (0: the rule's hold)")
        if not isinstance(self.runbook, str):
            bad("runbook", "must be a string (a doc reference or URL) or empty")
        object.__setattr__(self, "threshold", float(self.threshold))

    @property
    def clear_steps(self) -> int:
        """Consecutive steps without a value of the tested metric (missing or NaN) after which an active alert of
        this rule clears (docs/alerts.md#hysteresis-clearing-cooldown): ``clear_after``, or ``hold`` when 0."""
        return self.clear_after or self.hold

    @property
    def pooled(self) -> bool:
        """True when the metric already is a trailing-window value (no engine aggregation)."""
        return self.metric.startswith(WINDOW_PREFIX) or self.window == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "rule") -> "Rule":
        """Build a rule from a mapping (one TOML/YAML table); unknown keys raise ValueError naming ``where``."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected a table of rule fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [f for f in ("name", "metric", "condition", "threshold") if f not in d]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {missing}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


def load_rules(path) -> list[Rule]:
    """Read rules from a TOML (``.toml``, :mod:`tomllib`) or YAML (``.yaml``/``.yml``) file.

    Layout: a top-level list ``rules`` of tables (TOML ``[[rules]]``), each holding
    :class:`Rule` fields.  Raises ValueError (file, rule index, field) on bad content,
    FileNotFoundError when the file is missing.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:  # pragma: no cover - pyyaml comes with wandb
            raise ImportError(f"{path}: reading YAML rules needs PyYAML (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    else:
        try:
            import tomllib
        except ImportError:  # pragma: no cover - Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{path}: expected a top-level list 'rules' ([[rules]] tables in TOML)")
    rules = [Rule.from_dict(d, where=f"{path}: rules[{i}]") for i, d in enumerate(data["rules"])]
    names = [r.name for r in rules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{path}: duplicate rule name(s) {dup}")
    return rules


def baseline_rules() -> list[Rule]:
    """The baseline rules (``triage_monitor/baseline_alert_rules.toml``): a trailing reward below its running peak, a
    gradient-norm spike, a mean |δ| level; what the shipped rules must beat (docs/alerts.md#evaluating-the-alerts)."""
    with resources.as_file(resources.files("triage_monitor") / BASELINE_RULES_FILE) as p:
        return load_rules(p)


def default_rules() -> list[Rule]:
    """The shipped defaults (``triage_monitor/default_alert_rules.toml``; justified in docs/alerts.md)."""
    with resources.as_file(resources.files("triage_monitor") / DEFAULT_RULES_FILE) as p:
        return load_rules(p)


__all__ = ["Rule", "load_rules", "default_rules", "baseline_rules", "BASELINE_RULES_FILE", "CONDITIONS", "LEVELS", "TIERS", "AGGS", "WINDOW_PREFIX",
           "DEFAULT_RULES_FILE", "NOISE_FLOOR_NATS"]
