"""Early-warning alert rules over the per-step metric stream; sinks; offline replay.

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
*noise level* (:attr:`AlertEngine.noise_steps`), the rule's streak restarts
and it never fires there.  A step whose guard value is missing is evaluated
normally (a foreign history without the guard column keeps its alerts).

Hysteresis: a rule fires when its condition has held on ``hold`` consecutive
evaluated steps and at least ``cooldown`` steps have passed since it last
fired; it then stays *active* (no new alert) until a step where the condition
does not hold, which clears it.  A step where the value is missing or NaN
(or the look-back/baseline is not available yet) is not evaluated: the rule's
state is left unchanged.

Steps: integers, normally increasing.  A step that is not larger than the
last one seen (a job resumed from a checkpoint) *replaces* the history from
that step on: the engine rewinds its state to what it was before the first
observation of that step (recomputed silently from the kept history) and goes
on from there.  Alerts already sent are not withdrawn.

:func:`replay` feeds a metrics frame through the same :class:`AlertEngine`
row by row, so replay and live give the same alerts on the same sequence.

Sinks receive every fired :class:`Alert`: :class:`LoggingSink` (Python
logging), :class:`CallbackSink` (a user function) and
:class:`triage_monitor.wandb_logger.WandbAlertSink`; the monitor writes
:meth:`Alert.to_row` to the run directory's ``alerts/`` table.  A sink that
raises is reported once (with its traceback) and skipped for that alert;
alerts never raise into the training loop.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

log = logging.getLogger("triage_monitor.alerts")

CONDITIONS = ("above", "below", "rising", "falling", "excess", "deficit")
LEVELS = ("INFO", "WARN", "ERROR")
AGGS = {"mean": np.nanmean, "sum": np.nansum, "min": np.nanmin, "max": np.nanmax, "last": None}
WINDOW_PREFIX = "window/"
DEFAULT_RULES_FILE = "default_alert_rules.toml"
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
        note: one sentence appended to the alert text (why the rule exists).
        guard_metric: optional metric that must be >= ``guard_min`` for the rule to be
            evaluated at a step (the noise guard; see the module docstring).  Empty: no guard.
        guard_min: the guard's threshold, in ``guard_metric``'s units (nats for ``window/delta_abs_mean``).
        full_window: rising/falling only: a look-back before step ``first_step + window − 1``
            (the monitor's first full window) is not a reference (the rule waits for one).

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
    note: str = ""
    guard_metric: str = ""
    guard_min: float = 0.0
    full_window: bool = False

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
        object.__setattr__(self, "threshold", float(self.threshold))

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
            import tomli as tomllib
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


def default_rules() -> list[Rule]:
    """The shipped defaults (``triage_monitor/default_alert_rules.toml``; justified in docs/alerts.md)."""
    with resources.as_file(resources.files("triage_monitor") / DEFAULT_RULES_FILE) as p:
        return load_rules(p)


# ---------------------------------------------------------------------------------------- alerts
@dataclass
class Alert:
    """One fired rule.  ``value`` is the tested statistic (the level for above/below, the
    rise/drop for rising/falling, the distance from the baseline for excess/deficit),
    comparable with ``threshold``; ``window`` is the rule's window in steps."""

    step: int
    rule: str
    metric: str
    value: float
    threshold: float
    window: int
    level: str
    title: str
    text: str
    wait_s: float = 600.0

    def to_row(self) -> dict:
        """The row the monitor writes to the run's ``alerts/`` table (wait_s is not part of it)."""
        d = asdict(self)
        d.pop("wait_s")
        return d


# ----------------------------------------------------------------------------------------- sinks
class LoggingSink:
    """Send alerts to Python logging (INFO/WARN/ERROR -> logging.INFO/WARNING/ERROR)."""

    LEVEL = {"INFO": logging.INFO, "WARN": logging.WARNING, "ERROR": logging.ERROR}

    def __init__(self, logger: Optional[logging.Logger] = None):
        self.logger = logger or log

    def emit(self, alert: Alert) -> None:
        """Log ``title: text`` at the alert's level."""
        self.logger.log(self.LEVEL[alert.level], "%s: %s", alert.title, alert.text)


class CallbackSink:
    """Call ``fn(alert)`` for every alert."""

    def __init__(self, fn: Callable[[Alert], Any]):
        if not callable(fn):
            raise TypeError(f"CallbackSink: fn={fn!r} is not callable")
        self.fn = fn

    def emit(self, alert: Alert) -> None:
        """Call the user function (its exceptions are handled by the engine)."""
        self.fn(alert)


# ---------------------------------------------------------------------------------------- engine
@dataclass
class _State:
    streak: int = 0
    active: bool = False
    last_fire: Optional[int] = None
    baseline: Optional[float] = None


def _fmt(x: float) -> str:
    return f"{x:.4g}"


class AlertEngine:
    """Evaluate rules on every step and hand fired alerts to the sinks.

    Args:
        rules: the rules (default: :func:`default_rules`); names must be unique.
        sinks: objects with ``emit(alert)`` (and optionally ``close()``).

    ``observe(step, metrics)`` (metrics: ``dict[str, float]``, NaN allowed, missing keys
    allowed) returns the alerts fired at this step.  It never raises because of a sink;
    it raises ValueError only for a non-integer step.
    """

    def __init__(self, rules: Optional[Sequence[Rule]] = None, sinks: Sequence[Any] = ()):
        self.rules = list(default_rules() if rules is None else rules)
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"AlertEngine: duplicate rule names in {names}")
        self.sinks = list(sinks)
        self._metrics = sorted({r.metric for r in self.rules} | {r.guard_metric for r in self.rules if r.guard_metric})
        self._failed: dict[int, int] = {}  # id(sink) -> failure count
        self.fired: list[Alert] = []
        self._reset()

    # ---- history and state
    def _reset(self) -> None:
        self._steps: list[int] = []
        self._cols = {m: [] for m in self._metrics}         # raw per-step values
        self._vals = {r.name: [] for r in self.rules}         # tested value per step
        self._state = {r.name: _State(baseline=r.baseline) for r in self.rules}
        #: rule name -> steps at which its guard held it back (noise level), in order
        self.noise_steps: dict[str, list[int]] = {r.name: [] for r in self.rules if r.guard_metric}

    @property
    def active(self) -> list[str]:
        """Names of the rules that fired and have not cleared."""
        return [n for n, s in self._state.items() if s.active]

    def state_dict(self) -> dict:
        """JSON-able history (steps + the metrics the rules use); the engine state is a
        function of it, so ``load_state_dict`` on a fresh engine continues identically."""
        return {"steps": list(self._steps), "metrics": {m: list(v) for m, v in self._cols.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Rebuild the state silently from a :meth:`state_dict` (sends no alert)."""
        steps = list(state["steps"])
        cols = state["metrics"]
        self._reset()
        for i, s in enumerate(steps):
            self._advance(int(s), {m: cols[m][i] for m in cols if m in self._cols}, emit=False)

    # ---- main entry
    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """Record one step's metrics and return the alerts fired at this step."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"AlertEngine.observe: step={step!r} must be an int")
        step = int(step)
        if self._steps and step <= self._steps[-1]:
            self._rewind(step)
        return self._advance(step, metrics, emit=True)

    def _rewind(self, step: int) -> None:
        cut = bisect.bisect_left(self._steps, step)
        log.info("alerts: step %d repeats (last seen %d): replacing history from step %d on",
                 step, self._steps[-1], step)
        kept = {"steps": self._steps[:cut], "metrics": {m: v[:cut] for m, v in self._cols.items()}}
        self.load_state_dict(kept)

    def _advance(self, step: int, metrics: Mapping[str, Any], emit: bool) -> list[Alert]:
        self._steps.append(step)
        for m in self._metrics:
            self._cols[m].append(_as_float(metrics.get(m)))
        out = []
        for r in self.rules:
            v = self._value(r)
            self._vals[r.name].append(v)
            a = self._step_rule(r, step, v)
            if a is not None:
                out.append(a)
        if emit:
            for a in out:
                self.fired.append(a)
                self._send(a)
        return out

    def _value(self, r: Rule) -> float:
        col = self._cols[r.metric]
        if r.pooled:
            return col[-1]
        lo = bisect.bisect_right(self._steps, self._steps[-1] - r.window)
        xs = np.asarray(col[lo:], dtype=float)
        if not np.isfinite(xs).any():
            return math.nan
        return float(xs[np.isfinite(xs)][-1]) if r.agg == "last" else float(AGGS[r.agg](xs))

    def _lookback(self, r: Rule, i: int) -> float:
        """Tested value at the latest step <= t - i*window (NaN if before the first step, or, with
        ``full_window``, before step first + window - 1: a partial window is not a reference)."""
        target = self._steps[-1] - i * r.window
        if r.full_window and target < self._steps[0] + r.window - 1:
            return math.nan
        j = bisect.bisect_right(self._steps, target) - 1
        return self._vals[r.name][j] if j >= 0 else math.nan

    def _step_rule(self, r: Rule, step: int, v: float) -> Optional[Alert]:
        st = self._state[r.name]
        if r.guard_metric:
            g = self._cols[r.guard_metric][-1]
            if math.isfinite(g) and g < r.guard_min:   # noise level: never fires, the streak restarts
                self.noise_steps[r.name].append(step)
                st.streak, st.active = 0, False
                return None
        holds, score, detail = self._evaluate(r, st, step, v)
        if holds is None:
            return None
        if not holds:
            if st.active:
                log.info("alerts: %s cleared at step %d: no longer true that %s", r.name, step, detail)
            st.streak, st.active = 0, False
            return None
        st.streak += 1
        if st.active or st.streak < r.hold:
            return None
        if st.last_fire is not None and step - st.last_fire < r.cooldown:
            return None
        st.active, st.last_fire = True, step
        title = f"triage {r.level}: {r.name}"[:64]
        text = (f"{detail} at step {step} (window {r.window} steps; held {st.streak} step(s)).")
        if r.note:
            text += f" {r.note}"
        return Alert(step, r.name, r.metric, score, r.threshold, r.window, r.level, title, text, float(r.wait_s))

    def _evaluate(self, r: Rule, st: _State, step: int, v: float):
        """-> (holds or None when not evaluable, score, human-readable detail)."""
        c, thr, m = r.condition, r.threshold, r.metric
        if c in ("excess", "deficit") and st.baseline is None:
            first = self._steps[0]
            if step < first + r.baseline_steps:
                return None, math.nan, ""
            lo = bisect.bisect_left(self._steps, first)
            hi = bisect.bisect_left(self._steps, first + r.baseline_steps)
            xs = np.asarray(self._vals[r.name][lo:hi], dtype=float)
            xs = xs[np.isfinite(xs)]
            st.baseline = float(np.median(xs)) if xs.size else math.nan
            if not xs.size:
                log.warning("alerts: rule %s: no finite %s in the first %d steps; it will not evaluate",
                            r.name, m, r.baseline_steps)
        if not math.isfinite(v):
            return None, math.nan, ""
        if c == "above":
            return v > thr, v, f"{m} = {_fmt(v)} is above {_fmt(thr)}"
        if c == "below":
            return v < thr, v, f"{m} = {_fmt(v)} is below {_fmt(thr)}"
        unit = " (relative)" if r.relative else ""
        if c in ("excess", "deficit"):
            b = st.baseline
            if not math.isfinite(b):
                return None, math.nan, ""
            score = (v - b) if c == "excess" else (b - v)
            if r.relative:
                score = score / abs(b) if b != 0 else math.nan
                if not math.isfinite(score):
                    return None, math.nan, ""
            word = "above" if c == "excess" else "below"
            return score > thr, score, (f"{m} = {_fmt(v)} is {_fmt(score)}{unit} {word} its baseline "
                                        f"{_fmt(b)} (first {r.baseline_steps} steps; threshold {_fmt(thr)})")
        chain = [v] + [self._lookback(r, i) for i in range(1, r.k + 1)]   # newest first
        if not all(math.isfinite(x) for x in chain):
            return None, math.nan, ""
        sign = 1.0 if c == "rising" else -1.0
        monotone = all(sign * (a - b) > 0 for a, b in zip(chain[:-1], chain[1:]))
        ref = chain[-1]
        score = sign * (v - ref)
        if r.relative:
            if ref == 0:
                return None, math.nan, ""
            score /= abs(ref)
        path = " -> ".join(_fmt(x) for x in reversed(chain))
        word = "rose" if c == "rising" else "fell"
        return monotone and score > thr, score, (
            f"{m} {word} {path} over {r.k} window(s) of {r.window} steps "
            f"(change {_fmt(score)}{unit}, threshold {_fmt(thr)})")

    # ---- sinks
    def _send(self, alert: Alert) -> None:
        for s in self.sinks:
            try:
                s.emit(alert)
            except Exception:  # a sink must never break training
                n = self._failed.get(id(s), 0)
                self._failed[id(s)] = n + 1
                if n == 0:
                    log.warning("alerts: sink %r failed on %s; skipped (further failures of this sink are "
                                "counted, not reported)", s, alert.rule, exc_info=True)

    def close(self) -> None:
        """Close sinks that have ``close()``; report failure counts and rules that never evaluated."""
        for s in self.sinks:
            try:
                if hasattr(s, "close"):
                    s.close()
            except Exception:
                log.warning("alerts: closing sink %r failed", s, exc_info=True)
            if self._failed.get(id(s), 0) > 1:
                log.warning("alerts: sink %r failed %d times", s, self._failed[id(s)])
        never = [r.name for r in self.rules if self._steps
                 and not any(math.isfinite(x) for x in self._vals[r.name])]
        if never:
            log.info("alerts: rule(s) %s never saw a finite value of their metric", never)


def _as_float(x: Any) -> float:
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


# ---------------------------------------------------------------------------------------- replay
def replay(rules: Optional[Sequence[Rule]], metrics_frame, step_column: str = "step") -> list[Alert]:
    """The alerts of :func:`replay_engine` (same arguments, same errors), in order."""
    return replay_engine(rules, metrics_frame, step_column).fired


def replay_engine(rules: Optional[Sequence[Rule]], metrics_frame, step_column: str = "step") -> "AlertEngine":
    """Run ``rules`` over a metrics history with the live engine, row by row, in frame order.

    Args:
        rules: rules (None: :func:`default_rules`).
        metrics_frame: pandas.DataFrame with an integer ``step_column`` and one column per
            metric (named as in the live metric dict; a ``triage/`` prefix is stripped).
            Rows are fed in frame order, so a repeated step rewinds exactly as live; rows whose
            step is missing (NaN) are skipped.
    Returns:
        the engine after the last row: ``.fired`` holds the alerts that would have fired, in
        order; ``.noise_steps`` the steps each guarded rule spent at noise level.
    Raises:
        ValueError: the step column is missing or holds a non-integer value, or a metric column
            holds a non-numeric value (names the column and row).
    """
    frame = normalize_columns(metrics_frame)
    if step_column not in frame.columns:
        raise ValueError(f"replay: no step column {step_column!r}; columns: {list(frame.columns)[:20]}")
    steps = frame[step_column].to_numpy()
    eng = AlertEngine(rules)
    cols = [m for m in eng._metrics if m in frame.columns]
    data = {}
    for m in cols:
        try:
            data[m] = pd_numeric(frame[m])
        except ValueError as e:
            raise ValueError(f"replay: column {m!r} is not numeric ({e})") from None
    skipped = 0
    for i, s in enumerate(steps):
        if s is None or (isinstance(s, (float, np.floating)) and math.isnan(s)):
            skipped += 1           # e.g. a W&B export row logged by other code, without triage/step
            continue
        f = _as_float(s)
        if not math.isfinite(f) or f != int(f):
            raise ValueError(f"replay: {step_column}[row {i}] = {s} is not an integer step")
        eng.observe(int(f), {m: data[m][i] for m in cols})
    if skipped:
        log.info("replay: skipped %d row(s) without a %s value", skipped, step_column)
    return eng


def pd_numeric(col) -> np.ndarray:
    """A frame column as float64 (missing -> NaN); raises ValueError naming the first bad value."""
    import pandas as pd
    out = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    bad = np.flatnonzero(np.isnan(out) & col.notna().to_numpy() & (col.astype(str).str.lower() != "nan").to_numpy())
    if bad.size:
        raise ValueError(f"row {int(bad[0])} = {col.iloc[bad[0]]!r}")
    return out


def normalize_columns(frame):
    """Strip a ``triage/`` prefix (W&B history exports) from column names; a bare name wins on clashes."""
    ren = {}
    for c in frame.columns:
        if isinstance(c, str) and c.startswith("triage/") and c[len("triage/"):] not in frame.columns:
            ren[c] = c[len("triage/"):]
    return frame.rename(columns=ren) if ren else frame


def load_run_metrics(run_dir):
    """Per-step live metrics of a run directory (rank 0, latest attempt of each step, sorted by step),
    via :func:`triage_monitor.analysis.load_steps`.  Raises ``RunDirError`` (a ValueError)."""
    from .analysis import load_steps  # lazy: analysis imports torch
    return load_steps(run_dir)


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``triage-monitor alerts``."""
    parser.add_argument("run_dir", nargs="?", help="run directory (its steps/ table is replayed)")
    parser.add_argument("--rules", help="rules file (.toml, .yaml); default: the shipped default rules")
    parser.add_argument("--from-csv", dest="from_csv", metavar="CSV",
                        help="replay a metrics history CSV (e.g. a W&B history export) instead of RUN_DIR")
    parser.add_argument("--step-column", dest="step_column", default="step",
                        help="step column of the CSV (default: step; 'triage/step' is accepted as 'step')")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Replay the rules and print when each would have fired.  Returns the exit code
    (0; 2 on bad input, with the message on stderr)."""
    import pandas as pd
    try:
        rules = load_rules(args.rules) if args.rules else default_rules()
        if args.from_csv:
            frame = normalize_columns(pd.read_csv(args.from_csv))
            step_col = args.step_column[len("triage/"):] if args.step_column.startswith("triage/") \
                and args.step_column not in frame.columns else args.step_column
        elif args.run_dir:
            frame, step_col = load_run_metrics(args.run_dir), "step"
        else:
            raise ValueError("give RUN_DIR or --from-csv CSV")
        engine = replay_engine(rules, frame, step_column=step_col)
        alerts = engine.fired
    except (OSError, ValueError, ImportError) as e:
        print(f"triage-monitor alerts: error: {e}", file=sys.stderr)
        return 2
    absent = sorted({r.metric for r in rules} - set(frame.columns))
    rows = [a.to_row() for a in alerts]
    if args.format == "json":
        print(json.dumps(rows, indent=1, default=float))
    elif args.format == "csv":
        pd.DataFrame(rows, columns=[f.name for f in fields(Alert) if f.name != "wait_s"]).to_csv(
            sys.stdout, index=False)
    else:
        _print_table(rows, len(frame), len(rules))
    noise = {name: steps for name, steps in engine.noise_steps.items() if steps}
    if noise:
        guards = {(r.guard_metric, r.guard_min) for r in rules if r.name in noise}
        how = "; ".join(f"{m} < {_fmt(t)}" for m, t in sorted(guards))
        print(f"note: noise level ({how}: the learner and sampler agree to rounding, direction ratios are "
              f"noise) held back " + ", ".join(f"{n} on {len(s)} step(s)" for n, s in noise.items()), file=sys.stderr)
    if absent:
        print(f"note: metric(s) absent from the history, their rules never evaluated: {absent}", file=sys.stderr)
    return 0


def _print_table(rows: list[dict], n_steps: int, n_rules: int) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{len(rows)} alert(s) from {n_rules} rule(s) over {n_steps} step(s)")
    for c in ("step", "level", "rule", "metric", "value", "threshold", "text"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(str(r["step"]), r["level"], r["rule"], r["metric"], _fmt(r["value"]), _fmt(r["threshold"]),
                  r["text"])
    Console(width=160).print(t)


def alerts_cli(argv: Optional[Sequence[str]] = None) -> int:
    """``triage-monitor alerts RUN_DIR [--rules FILE] [--from-csv CSV --step-column step]``."""
    p = add_arguments(argparse.ArgumentParser(
        prog="triage-monitor alerts", description="Replay alert rules over a finished run or a metrics CSV."))
    return run_cli(p.parse_args(argv))


__all__ = ["Rule", "Alert", "AlertEngine", "LoggingSink", "CallbackSink", "load_rules", "default_rules",
           "replay", "replay_engine", "normalize_columns", "NOISE_FLOOR_NATS", "load_run_metrics", "add_arguments", "run_cli", "alerts_cli",
           "CONDITIONS", "LEVELS"]
