"""The alert engine: evaluates :class:`~triage_monitor.alerting.alert_rules.Rule` s on the per-step metric stream,
hands fired alerts to sinks, and replays a recorded history offline.

The rules themselves (fields, conditions, noise guard, rule files, the shipped
defaults) live in :mod:`triage_monitor.alerting.alert_rules`; they are re-exported here
(``from triage_monitor.alerts import Rule, default_rules, load_rules``).
The command ``triage-monitor alerts`` is :mod:`triage_monitor.commands.alerts`.

Hysteresis: a rule fires when its condition has held on ``hold`` consecutive
evaluated steps and at least ``cooldown`` steps have passed since it last
fired; it then stays *active* (no new alert) until a step where the condition
does not hold, which clears it.  A step where the value is missing or NaN
(or the look-back/baseline is not available yet) is not evaluated: the rule's
state is left unchanged — until the value has been missing or NaN on
:attr:`Rule.clear_steps` consecutive steps, which clears an active alert with
that reason; a step below the rule's noise guard clears it at once.  Every
clearing is kept in :attr:`AlertEngine.cleared` (a :class:`Clear` each), live
and in replay alike.

Steps: integers, normally increasing.  A step that is not larger than the
last one seen (a job resumed from a checkpoint) *replaces* the history from
that step on: the engine rewinds its state to what it was before the first
observation of that step (recomputed silently from the kept history) and goes
on from there.  Alerts already sent are not withdrawn.

:func:`replay` feeds a metrics frame through the same :class:`AlertEngine`
row by row, so replay and live give the same alerts on the same sequence.

Sinks receive every fired :class:`Alert`: :class:`LoggingSink` (Python
logging), :class:`CallbackSink` (a user function) and
:class:`triage_monitor.alerting.wandb_logger.WandbAlertSink`; the monitor writes
:meth:`Alert.to_row` to the run directory's ``alerts/`` table.  A sink that
raises is reported once (with its traceback) and skipped for that alert;
alerts never raise into the training loop.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import (Any, Callable, Mapping, NamedTuple, Optional, Protocol, Sequence, TypedDict,
                    runtime_checkable)

import numpy as np

# the rules are re-exported: ``from triage_monitor.alerts import Rule, default_rules, load_rules`` keeps working
from .alert_rules import (AGGS, CONDITIONS, LEVELS, NOISE_FLOOR_NATS, TIERS, Rule, baseline_rules,  # noqa: F401
                          default_rules, load_rules)

log = logging.getLogger("triage_monitor.alerts")


# ---------------------------------------------------------------------------------------- alerts
class EngineState(TypedDict):
    """:meth:`AlertEngine.state_dict`: the observed steps and, per metric the rules use, its value at each."""

    steps: list[int]
    metrics: dict[str, list[float]]


@dataclass
class Alert:
    """One fired rule.  ``value`` is the tested statistic (the level for above/below, the
    rise/drop for rising/falling, the distance from the baseline for excess/deficit),
    comparable with ``threshold``; ``window`` is the rule's window in steps; ``tier`` the rule's tier
    (:data:`~triage_monitor.alerting.alert_rules.TIERS`: ``mismatch`` informational, ``collapse`` a warning of divergence)."""

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
    tier: str = "collapse"

    def to_row(self) -> dict[str, Any]:
        """The row the monitor writes to the run's ``alerts/`` table: the fields but ``wait_s``, in order (the
        table's declared schema: :data:`triage_monitor.rundir.records.ALERT_SCHEMA`)."""
        d = asdict(self)
        d.pop("wait_s")
        return d


@dataclass(frozen=True)
class Clear:
    """One active alert that cleared (:attr:`AlertEngine.cleared`): at ``step``, the rule ``rule`` (of ``tier``,
    ``level``) that fired at ``fired_at``; ``reason`` says why: its condition stopped holding, its metric had no
    value on :attr:`~triage_monitor.alerting.alert_rules.Rule.clear_steps` consecutive steps, or its noise guard held it
    back (docs/alerts.md#hysteresis-clearing-cooldown)."""

    step: int
    rule: str
    reason: str
    fired_at: Optional[int]
    tier: str
    level: str


def runbook_ref(rule: Rule) -> str:
    """Where the "what to do" entry of ``rule`` is: its own ``runbook`` field when set, else
    ``docs/alerts.md#<name>`` for a rule named like a shipped default (each has an entry under
    docs/alerts.md#runbook), else ``""``."""
    if rule.runbook:
        return rule.runbook
    return f"docs/alerts.md#{rule.name}" if rule.name in _shipped_names() else ""


_SHIPPED: Optional[frozenset] = None


def _shipped_names() -> frozenset:
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = frozenset(r.name for r in default_rules())
    return _SHIPPED


# ------------------------------------------------------------------------------------- the seams
@runtime_checkable
class AlertSink(Protocol):
    """Where an alert goes: ``emit(alert)`` for every :class:`Alert` raised (a ``close()`` is optional)."""

    def emit(self, alert: Alert) -> None: ...


@runtime_checkable
class AlertObserver(Protocol):
    """What the monitor runs the step's metrics through: :class:`AlertEngine`, or an engine of your own
    (``observe`` returns the alerts fired at the step; a ``close()`` is optional)."""

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]: ...


@runtime_checkable
class RuleReporter(Protocol):
    """An alert engine that also says which rules it runs and which are active (:class:`AlertEngine` does): the
    monitor then logs the number of active rules (``alert_state``) and checks the rules' metrics at the first step.
    Optional: an engine of your own without them gets ``alert_state`` NaN and no check."""

    rules: Sequence[Rule]

    @property
    def active(self) -> list[str]: ...


@runtime_checkable
class Closable(Protocol):
    """Anything with a ``close()`` (a sink, a tracker) that the owner calls at the end."""

    def close(self) -> None: ...


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
@dataclass(frozen=True)
class RuleStatus:
    """What one rule did over the steps an engine observed (:meth:`AlertEngine.status`).

    ``evaluated``: steps where its condition was tested; ``noise``: steps its noise guard held it back;
    ``fired``: alerts it raised; ``active``: fired and not cleared at the last step; ``evaluable_from``: the
    first step at which it can evaluate (its look-backs or baseline exist; None for a rule whose metric never
    had a value); ``reason``: why it did not evaluate ("" when it did); ``cleared``: its latest :class:`Clear`
    when it is not active now (None when it never cleared, or fired again after it)."""

    name: str
    group: str
    evaluated: int
    noise: int
    fired: int
    active: bool
    evaluable_from: Optional[int]
    reason: str
    cleared: Optional[Clear] = None


@dataclass
class _State:
    streak: int = 0
    active: bool = False
    last_fire: Optional[int] = None
    baseline: Optional[float] = None
    peak: float = -math.inf


class RuleEvaluation(NamedTuple):
    """One rule on one step: whether it holds (None: not evaluable), its score, and the human-readable detail."""
    holds: Optional[bool]
    score: float
    detail: str


_NOT_EVALUABLE = RuleEvaluation(None, math.nan, "")


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
        #: every clearing of an active alert, in order (:class:`Clear`; live and replay alike)
        self.cleared: list[Clear] = []
        self._reset()

    # ---- history and state
    def _reset(self) -> None:
        self._steps: list[int] = []
        self._cols: dict[str, list[float]] = {m: [] for m in self._metrics}     # raw per-step values
        self._vals: dict[str, list[float]] = {r.name: [] for r in self.rules}   # tested value per step
        self._state = {r.name: _State(baseline=r.baseline) for r in self.rules}
        self._evaluated = {r.name: 0 for r in self.rules}
        self._present: set = set()                             # metrics that appeared in some step
        self._missing = {r.name: 0 for r in self.rules}        # consecutive steps its tested value had none
        self._clearing: list[Clear] = []                       # cleared at the step being observed
        #: rule name -> steps at which its guard held it back (noise level), in order
        self.noise_steps: dict[str, list[int]] = {r.name: [] for r in self.rules if r.guard_metric}

    @property
    def active(self) -> list[str]:
        """Names of the rules that fired and have not cleared."""
        return [n for n, s in self._state.items() if s.active]

    def state_dict(self) -> EngineState:
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
        kept: EngineState = {"steps": self._steps[:cut], "metrics": {m: v[:cut] for m, v in self._cols.items()}}
        self.load_state_dict(kept)

    def _advance(self, step: int, metrics: Mapping[str, Any], emit: bool) -> list[Alert]:
        self._steps.append(step)
        for m in self._metrics:
            self._cols[m].append(_as_float(metrics.get(m)))
        self._present.update(m for m in self._metrics if m in metrics)
        out = []
        self._clearing = []
        for r in self.rules:
            v = self._value(r)
            self._vals[r.name].append(v)
            a = self._step_rule(r, step, v)
            if a is not None:
                out.append(a)
        if emit:
            self.cleared.extend(self._clearing)
            for a in out:
                self.fired.append(a)
                self._send(a)
        return out

    def _clear(self, r: Rule, st: "_State", step: int, reason: str) -> None:
        """Clear the active alert of ``r`` at ``step`` for ``reason`` (logged at INFO, kept in :attr:`cleared`)."""
        log.info("alerts: %s cleared at step %d: %s", r.name, step, reason)
        self._clearing.append(Clear(step, r.name, reason, st.last_fire, r.tier, r.level))
        st.streak, st.active = 0, False

    def _value(self, r: Rule) -> float:
        col = self._cols[r.metric]
        if r.pooled:
            return col[-1]
        lo = bisect.bisect_right(self._steps, self._steps[-1] - r.window)
        xs = np.asarray(col[lo:], dtype=float)
        if not np.isfinite(xs).any():
            return math.nan
        agg = AGGS[r.agg]                        # None for "last"
        return float(xs[np.isfinite(xs)][-1]) if agg is None else float(agg(xs))

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
                if st.active:
                    self._clear(r, st, step, f"held back at noise level ({r.guard_metric} = {g:.3g} < "
                                             f"{r.guard_min:g}: learner and sampler agree to rounding)")
                st.streak, st.active = 0, False
                return None
        holds, score, detail = self._evaluate(r, st, step, v)
        if holds is None:
            if math.isfinite(v):
                self._missing[r.name] = 0
                return None
            n = self._missing[r.name] = self._missing[r.name] + 1
            if st.active and n >= r.clear_steps:       # no value for as long as it took to fire: not evidence
                self._clear(r, st, step, f"{r.metric} had no value on {n} consecutive step(s) (steps "
                                         f"{self._steps[-n]}–{step}; the rule clears after {r.clear_steps})")
            return None
        self._missing[r.name] = 0
        self._evaluated[r.name] += 1
        if not holds:
            if st.active:
                self._clear(r, st, step, f"no longer true that {detail}")
            st.streak, st.active = 0, False
            return None
        st.streak += 1
        if st.active or st.streak < r.hold:
            return None
        if st.last_fire is not None and step - st.last_fire < r.cooldown:
            return None
        st.active, st.last_fire = True, step
        title = f"triage {r.level} ({r.tier}): {r.name}"[:64]
        held = f"held {st.streak} step{'s' if st.streak != 1 else ''}"
        text = f"{detail} at step {step} ({self._pooled(r, step)}{held})."
        if r.note:
            text += f" {r.note}"
        ref = runbook_ref(r)
        if ref:
            text += f" What to do: {ref}"
        return Alert(step, r.name, r.metric, score, r.threshold, r.window, r.level, title, text, float(r.wait_s),
                     r.tier)

    def _pooled(self, r: Rule, step: int) -> str:
        """Which steps the tested value pools, as alert text: ``"pooled over steps 0–8 (9 of a 25-step window); "``
        for a ``window/`` metric (the monitor pools the steps it has seen, up to its window: a job's first steps,
        or a resumed job's, pool fewer), the aggregation for a per-step metric, nothing for a one-step rule."""
        if r.window == 1:
            return ""
        lo = bisect.bisect_right(self._steps, step - r.window)
        n, first = len(self._steps) - lo, self._steps[lo]
        how = "pooled over" if r.metric.startswith("window/") else f"{r.agg} over"
        span = f"step {step} only" if n == 1 else f"steps {first}–{step}"
        return f"{how} {span} ({n} of a {r.window}-step window); "

    def _evaluate(self, r: Rule, st: _State, step: int, v: float) -> RuleEvaluation:
        """-> RuleEvaluation(holds or None when not evaluable, score, human-readable detail)."""
        c, thr, m = r.condition, r.threshold, r.metric
        if c in ("excess", "deficit") and st.baseline is None:
            first = self._steps[0]
            if step < first + r.baseline_steps:
                return _NOT_EVALUABLE
            lo = bisect.bisect_left(self._steps, first)
            hi = bisect.bisect_left(self._steps, first + r.baseline_steps)
            xs = np.asarray(self._vals[r.name][lo:hi], dtype=float)
            xs = xs[np.isfinite(xs)]
            st.baseline = float(np.median(xs)) if xs.size else math.nan
            if not xs.size:
                log.warning("alerts: rule %s: no finite %s in the first %d steps; it will not evaluate",
                            r.name, m, r.baseline_steps)
        if not math.isfinite(v):
            return _NOT_EVALUABLE
        if c == "drawdown":
            if step < self._steps[0] + r.window - 1:      # a partial first window is no peak
                return _NOT_EVALUABLE
            st.peak = max(st.peak, v)
            if st.peak == 0:
                return _NOT_EVALUABLE
            score = (st.peak - v) / abs(st.peak)
            return RuleEvaluation(score > thr, score, f"{m} = {_fmt(v)} is {_fmt(score)} below its running peak "
                                                      f"{_fmt(st.peak)} (relative; threshold {_fmt(thr)})")
        if c == "above":
            return RuleEvaluation(v > thr, v, f"{m} = {_fmt(v)} is above {_fmt(thr)}")
        if c == "below":
            return RuleEvaluation(v < thr, v, f"{m} = {_fmt(v)} is below {_fmt(thr)}")
        unit = " (relative)" if r.relative else ""
        if c in ("excess", "deficit"):
            b = st.baseline
            assert b is not None                 # set above for excess/deficit (median of the first steps, or NaN)
            if not math.isfinite(b):
                return _NOT_EVALUABLE
            score = (v - b) if c == "excess" else (b - v)
            if r.relative:
                score = score / abs(b) if b != 0 else math.nan
                if not math.isfinite(score):
                    return _NOT_EVALUABLE
            word = "above" if c == "excess" else "below"
            return RuleEvaluation(score > thr, score, (
                f"{m} = {_fmt(v)} is {_fmt(score)}{unit} {word} its baseline {_fmt(b)} "
                f"(first {r.baseline_steps} steps; threshold {_fmt(thr)})"))
        chain = [v] + [self._lookback(r, i) for i in range(1, r.k + 1)]   # newest first
        if not all(math.isfinite(x) for x in chain):
            return _NOT_EVALUABLE
        sign = 1.0 if c == "rising" else -1.0
        monotone = all(sign * (a - b) > 0 for a, b in zip(chain[:-1], chain[1:]))
        ref = chain[-1]
        score = sign * (v - ref)
        if r.relative:
            if ref == 0:
                return _NOT_EVALUABLE
            score /= abs(ref)
        path = " -> ".join(_fmt(x) for x in reversed(chain))
        word = "rose" if c == "rising" else "fell"
        return RuleEvaluation(monotone and score > thr, score, (
            f"{m} {word} {path} over {r.k} window(s) of {r.window} steps "
            f"(change {_fmt(score)}{unit}, threshold {_fmt(thr)})"))

    # ---- which rules could evaluate
    def evaluable_from(self, r: Rule) -> Optional[int]:
        """The first step at which ``r`` can evaluate, given the first step observed (None before any step):
        a rising/falling rule needs ``k`` look-backs of ``window`` steps (after the first full window with
        ``full_window``), an excess/deficit rule its baseline steps; the others the first step."""
        if not self._steps:
            return None
        first = self._steps[0]
        if r.condition in ("rising", "falling"):
            return first + r.k * r.window + (r.window - 1 if r.full_window else 0)
        if r.condition in ("excess", "deficit") and r.baseline is None:
            return first + r.baseline_steps
        return first

    def _why_not(self, r: Rule) -> str:
        if not self._steps:
            return "no step observed"
        if r.metric not in self._present:
            return f"metric {r.metric} is not in the metrics"
        if not any(math.isfinite(x) for x in self._cols[r.metric]):
            return f"metric {r.metric} never had a finite value"
        start, last = self.evaluable_from(r), self._steps[-1]
        assert start is not None                 # None only before any step, returned above
        if start > last:
            if r.condition in ("rising", "falling"):
                need = (f"{r.k} look-back(s) of {r.window} steps" + (" after the first full window" if r.full_window
                                                                        else ""))
            else:
                need = f"a baseline over the first {r.baseline_steps} steps"
            if start > 2 ** 63 - 1:              # steps are int64: no step of this run can get there
                return f"not evaluable on this run (needs {need}: past the largest step number, 2**63 - 1)"
            return f"not evaluable before step {start} (needs {need})"
        noise = self.noise_steps.get(r.name, [])
        if noise:
            return (f"held back at noise level on {len(noise)} step(s) ({r.guard_metric} < {r.guard_min:g}: learner "
                    f"and sampler agree to rounding)")
        return f"{r.metric} had no finite value at the steps from {start} on"

    def status(self) -> list[RuleStatus]:
        """One :class:`RuleStatus` per rule, in rule order: which rules evaluated, which could not yet and why."""
        fired: dict[str, int] = {}
        for a in self.fired:
            fired[a.rule] = fired.get(a.rule, 0) + 1
        cleared: dict[str, Clear] = {}
        for c in self.cleared:
            cleared[c.rule] = c
        out = []
        for r in self.rules:
            n = self._evaluated[r.name]
            out.append(RuleStatus(r.name, r.group, n, len(self.noise_steps.get(r.name, [])), fired.get(r.name, 0),
                                  self._state[r.name].active,
                                  self.evaluable_from(r) if r.metric in self._present else None,
                                  "" if n else self._why_not(r),
                                  None if self._state[r.name].active else cleared.get(r.name)))
        return out

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
                if isinstance(s, Closable):
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


# ------------------------------------------------------------------------------- building an engine
def check_alerts_setting(alerts, where: str = "alerts"):
    """Validate an ``alerts=`` setting that must travel as configuration (a hook's settings): ``None`` /
    ``True`` (the shipped default rules), ``False`` (no rules), a rule file path, or a list of
    :class:`Rule` (or mappings of rule fields).  Returns it with mappings turned into rules.

    Raises:
        ValueError: a live engine or anything else, naming ``where`` and the value; a bad rule (its field).
    """
    if alerts is None or isinstance(alerts, bool):
        return alerts
    if isinstance(alerts, (str, os.PathLike)):
        return os.fspath(alerts)
    if isinstance(alerts, (list, tuple)):
        return [r if isinstance(r, Rule) else Rule.from_dict(r, where=f"{where}[{i}]") for i, r in enumerate(alerts)]
    raise ValueError(f"{where}={alerts!r}: give True (the shipped default rules), False (none), a rule file path or "
                     f"a list of rules; a live AlertEngine cannot travel into a worker process")


def build_engine(alerts=None, sinks: Sequence[Any] = ()) -> Optional[AlertObserver]:
    """The alert engine an ``alerts=`` setting asks for (``MismatchMonitor``'s, a hook's).

    Args:
        alerts: ``None`` or ``True``: the shipped default rules (:func:`default_rules`); ``False``: no engine;
            a rule file path (:func:`load_rules`); a list of :class:`Rule` (or mappings of rule fields); or a
            live engine (anything with ``observe``), returned as it is with its own sinks.
        sinks: sinks of an engine built here, after a :class:`LoggingSink` (each alert once as a log line at its
            level: WARN and ERROR reach stderr under Python's default logging).

    Raises:
        ValueError: a setting of another kind, a bad rule or rule file (naming the field).
        FileNotFoundError: a rule file that does not exist.
    """
    if alerts is False:
        return None
    if isinstance(alerts, AlertObserver):
        return alerts
    alerts = check_alerts_setting(alerts)
    rules = load_rules(alerts) if isinstance(alerts, str) else default_rules() if alerts in (None, True) else alerts
    return AlertEngine(rules, sinks=[LoggingSink(), *sinks])


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


__all__ = ["Rule", "Alert", "EngineState", "Clear", "runbook_ref", "RuleStatus", "AlertSink", "AlertObserver", "Closable", "AlertEngine", "LoggingSink", "CallbackSink", "load_rules", "default_rules",
           "replay", "replay_engine", "normalize_columns", "build_engine", "check_alerts_setting", "pd_numeric", "NOISE_FLOOR_NATS", "CONDITIONS", "LEVELS", "TIERS"]
