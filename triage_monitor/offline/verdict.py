"""The verdict on a run: what happened, when, why, and what to do (docs/alerts.md#the-run-verdict).

Two layers, one text.  :func:`run_verdict` is the run-level paragraph that ``analyze``, ``alerts``, the report (top
banner) and the dashboard (banner) print, and ``analyze`` stores as ``analysis/verdict.json``::

    verdict: CRITICAL — destabilised at step 22 (trailing reward 0.598 → 0.00195); first alerts: mismatch delta_q05_low
    at step 7 (15 steps ahead), collapse rho_asym_high at step 47 (25 steps after)
      outcome: ...
      first alert of each tier: ...
      worst windows: ...
      at the end (step 149): ...
      next: ...
      last step: WARNING — window ρ_asym 1.36 at step 149, ...

Its last line is :func:`health_verdict`, the status of the last step: that step's pooled window ρ_asym (the
direction metric the shipped rules listen to first, docs/metrics.md#rho_asym) against the healthy band — a reference
run's own range when one is given (:func:`reference_band`, docs/alerts.md#a-reference-run), and the published one
(:mod:`triage_monitor.alerting.references`) — and the thresholds of the rules, and the state of the alert engine after the
run's steps (:meth:`~triage_monitor.alerting.alerts.AlertEngine.status`).

The outcome comes from the recorded ``reward`` column alone, by the definition of :mod:`triage_monitor.alerting.outcome`; a
run without one gets "no reward recorded", never an outcome.  Alert tiers, runbook entries and thresholds are read
from the rules the engine ran, never from rule names written here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, TypedDict

import numpy as np

from ..alerting.alert_rules import NOISE_FLOOR_NATS, TIERS
from ..alerting.outcome import DEFAULT_OUTCOME, OutcomeDefinition, destabilisation_step, trailing_mean
from ..alerting.references import RHO_ASYM_HEALTHY, rho_asym_thresholds

#: Verdict levels, least to most severe.
LEVELS = ("NO SIGNAL", "OK", "WATCH", "WARNING", "CRITICAL")
#: How the published band is named wherever it is drawn or cited.
PUBLISHED_LABEL = "published (4B dense / 30B MoE)"
#: The direction metric the verdict and the charts judge, and the guard that says when it is noise.
DIRECTION, GUARD = "window/rho_asym", "window/delta_abs_mean"
#: Central quantiles of a reference run's window ρ_asym that make its band (docs/alerts.md#a-reference-run).
REFERENCE_QUANTILES = (0.05, 0.95)


class Outcome(TypedDict):
    """:attr:`RunVerdict.outcome`: what the reward did (values None where they do not apply), in this key order."""

    status: str
    step: Optional[int]
    definition: str
    peak: Optional[float]
    peak_step: Optional[int]
    at: Optional[float]
    minimum: Optional[float]
    minimum_step: Optional[int]
    last: Optional[float]
    last_step: Optional[int]
    recent_fall: bool


class WorstPoint(TypedDict):
    """One entry of :attr:`RunVerdict.worst`: the worst window's step, its value and the value's unit."""

    step: int
    value: float
    unit: str


class VerdictDict(TypedDict):
    """:meth:`RunVerdict.to_dict` (``analysis/verdict.json``): every field as JSON values, in this key order."""

    level: str
    text: str
    lines: list[str]
    outcome: Outcome
    first_alerts: dict[str, dict[str, Any]]
    worst: dict[str, WorstPoint]
    active: list[dict[str, Any]]
    cleared: list[dict[str, Any]]
    actions: list[str]
    focus_step: Optional[int]
    focus_why: str
    status: dict[str, Any]
    reference: Optional[dict[str, Any]]
    steps: list[Optional[int]]


@dataclass(frozen=True)
class Verdict:
    """``level`` (one of :data:`LEVELS`), ``line`` (the sentence printed), ``step`` (the step judged, or None),
    ``rho`` (its window ρ_asym), ``not_evaluable`` (``[(rule, reason), ...]`` of rules that did not evaluate)."""

    level: str
    line: str
    step: object
    rho: float
    not_evaluable: tuple


@dataclass(frozen=True)
class ReferenceBand:
    """The healthy band of window ρ_asym taken from a reference run (:func:`reference_band`).

    ``label``: the run's name; ``lo``, ``hi``: the band (NaN when the run has no usable window); ``windows``: the
    steps it pools; ``noise``: steps left out as noise level; ``note``: why there is no band (empty otherwise)."""

    label: str
    lo: float
    hi: float
    windows: int
    noise: int
    note: str = ""

    @property
    def usable(self) -> bool:
        """True when the band has finite ends."""
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    def describe(self) -> str:
        """``"reference fp32-s0 0.443–0.751"`` (or why it has no band)."""
        if self.usable:
            return f"reference {self.label} {self.lo:.3g}–{self.hi:.3g}"
        return f"reference {self.label}: {self.note}"


def _finite_rows(frame, col):
    if col not in frame.columns:
        return None
    s = frame[["step", col]].dropna()
    s = s[np.isfinite(s[col].to_numpy(dtype=float))]
    return s.sort_values("step")


def _noise_mask(frame):
    """Boolean array over ``frame``'s rows: the window's mean |δ| is below the noise floor (the shipped rules'
    guard, docs/alerts.md#noise-guard); all False without the guard column."""
    if GUARD not in frame.columns:
        return np.zeros(len(frame), dtype=bool)
    g = frame[GUARD].to_numpy(dtype=float)
    return np.isfinite(g) & (g < NOISE_FLOOR_NATS)


def reference_band(frame, label: str, window: Optional[int] = None,
                   quantiles: tuple = REFERENCE_QUANTILES) -> ReferenceBand:
    """The healthy band of window ρ_asym from a reference run's steps (an on-policy or BF16 control of the same job,
    docs/alerts.md#a-reference-run): the ``quantiles`` (5 % and 95 %) of its pooled window ρ_asym over the steps from
    its first full window on, steps at noise level (window mean |δ| below
    :data:`~triage_monitor.alerting.alert_rules.NOISE_FLOOR_NATS` nats) left out.

    Args:
        frame: pandas.DataFrame of the reference run's steps (``step``, ``window/rho_asym``, ``window/delta_abs_mean``).
        label: the name shown in legends and the verdict.
        window: the run's trailing window in steps (its first ``window`` − 1 steps pool fewer; None: 25).

    Returns:
        :class:`ReferenceBand`; ``lo`` = ``hi`` = NaN with a ``note`` when no step qualifies (e.g. a bit-exact
        control, whose ρ_asym is a ratio of rounding noise).
    """
    window = 25 if window is None else int(window)
    if DIRECTION not in frame.columns or not len(frame):
        return ReferenceBand(label, math.nan, math.nan, 0, 0, "it has no window ρ_asym")
    first = int(frame["step"].min())
    full = frame["step"].to_numpy() >= first + window - 1
    noise = _noise_mask(frame) & full
    rho = frame[DIRECTION].to_numpy(dtype=float)
    keep = full & ~noise & np.isfinite(rho)
    if not keep.any():
        why = (f"every window is at noise level (mean |δ| < {NOISE_FLOOR_NATS:g} nats: learner and sampler agree to "
               "rounding, its ρ_asym is noise), no band" if noise.any() else "no finite window ρ_asym, no band")
        return ReferenceBand(label, math.nan, math.nan, 0, int(noise.sum()), why)
    lo, hi = np.quantile(rho[keep], quantiles)
    return ReferenceBand(label, float(lo), float(hi), int(keep.sum()), int(noise.sum()))


def health_verdict(frame, engine, reference: Optional[ReferenceBand] = None) -> Verdict:
    """The status of a run's last step after its rules ran over its steps (the last line of :func:`run_verdict`).

    Args:
        frame: pandas.DataFrame of the run's steps (``step``, ``window/rho_asym``, ``window/delta_abs_mean``; the
            monitor's live steps table or a recomputed one).
        engine: the :class:`~triage_monitor.alerting.alerts.AlertEngine` that observed those steps (live, or
            :func:`~triage_monitor.alerting.alerts.replay_engine` on ``frame``).
        reference: a reference run's band (:func:`reference_band`): the last window is placed against it (the
            published band is still cited).

    Returns:
        :class:`Verdict`.  Level: CRITICAL with an active collapse-tier ERROR alert or ρ_asym above the highest
        threshold of a collapse-tier rule; WARNING with an active collapse-tier WARN alert or above the lowest such
        threshold; WATCH above the healthy band (the reference's when given, else the published), above a
        mismatch-tier rule's threshold, with a mismatch-tier alert active (informational, docs/alerts.md#tiers) or
        with alerts that fired and cleared; OK otherwise; NO SIGNAL when the learner
        and sampler agree to rounding (mean |δ| below the noise floor, docs/alerts.md#noise-guard) or the direction
        metric has no value.
    """
    lo, hi = RHO_ASYM_HEALTHY
    thresholds = rho_asym_thresholds(engine.rules)
    thr_text = ", ".join(f"{v:g} {lvl}" for v, _, lvl in thresholds) or "none"
    step, rho = _last_finite(frame, DIRECTION)
    _, gap = _last_finite(frame, GUARD)
    status = engine.status()
    levels = {r.name: r.level for r in engine.rules}
    tiers = {r.name: getattr(r, "tier", "collapse") for r in engine.rules}
    active = [s.name for s in status if s.active]
    fired = sum(s.fired for s in status)
    last = int(frame["step"].max()) if len(frame) else None
    waiting = [s for s in status if not s.evaluated and s.evaluable_from is not None and last is not None
               and s.evaluable_from > last]
    ref = reference if reference is not None and reference.usable else None
    rank = 1
    if step is None:
        head, rank = "window ρ_asym has no value in this run", 0
    elif math.isfinite(gap) and gap < NOISE_FLOOR_NATS:
        head, rank = (f"learner and sampler agree to rounding (window mean |δ| {gap:.2g} nats < {NOISE_FLOOR_NATS:g}): "
                      f"ρ_asym {rho:.3g} at step {step} is noise, there is no mismatch to judge"), 0
    else:
        where = f"window ρ_asym {rho:.3g} at step {step}"
        above = [(v, lvl) for v, _, lvl in thresholds if rho > v]
        blo, bhi, name = (ref.lo, ref.hi, f"the range of reference {ref.label}") if ref else \
            (lo, hi, "the published healthy range")
        if above:
            v, lvl = above[-1]
            # a threshold of a mismatch-tier rule says how far off-policy the sampler is, not that the run is
            # collapsing (docs/alerts.md#tiers): it raises the level to WATCH at most
            head, rank = f"{where}, above the {lvl} threshold {v:g}", (4 if lvl == "ERROR" else 3) \
                if any(t == v and tiers.get(n) == "collapse" for t, n, _ in thresholds) else 2
        elif rho > bhi:
            nxt = f", below the first alert threshold {thresholds[0][0]:g}" if thresholds else ""
            head, rank = f"{where}, above {name}{nxt}", 2
        elif rho >= blo:
            head = f"{where}, within {name}"
        else:
            head = f"{where}, below {name}"
        cited = [reference.describe()] if reference is not None else []
        cited += [f"{PUBLISHED_LABEL} {lo:g}–{hi:g}", f"alert thresholds {thr_text}"]
        head += f" ({'; '.join(cited)})"
    if active:
        loud = [n for n in active if tiers.get(n, "collapse") == "collapse"]     # mismatch tier: informational
        rank = max(rank, (4 if any(levels[n] == "ERROR" for n in loud) else 3) if loud else 2)
        alerts = f"{len(active)} alert(s) active ({', '.join(active)})"
    elif fired:
        rank = max(rank, 2)
        alerts = f"{fired} alert(s) fired earlier, none active now"
    else:
        alerts = "no alert"
    parts = [head, alerts]
    if waiting:
        starts = sorted({s.evaluable_from for s in waiting})
        if starts[0] > 2 ** 63 - 1:                 # steps are int64: no step of this run can get there
            parts.append(f"{len(waiting)} rule(s) not evaluable on this run (they start past the largest step "
                         "number, 2**63 - 1)")
        else:
            when = f"{starts[0]}" if len(starts) == 1 else f"{starts[0]}–{min(starts[-1], 2 ** 63 - 1)}"
            parts.append(f"{len(waiting)} rule(s) not evaluable before step {when}")
    level = LEVELS[rank]
    return Verdict(level, f"verdict: {level} — " + "; ".join(parts), step, rho,
                   tuple((s.name, s.reason) for s in status if not s.evaluated and s.reason))


def _last_finite(frame, col):
    s = _finite_rows(frame, col)
    if s is None or s.empty:
        return None, math.nan
    # by column: a row of mixed columns is upcast to float64, which turns step 2**63 - 1 into 2**63
    return int(s["step"].iloc[-1]), float(s[col].iloc[-1])


# ------------------------------------------------------------------------------------------ the run verdict
@dataclass(frozen=True)
class RunVerdict:
    """The run-level verdict (:func:`run_verdict`).

    Attributes:
        level: one of :data:`LEVELS` (CRITICAL when the run destabilised, else the last step's level).
        lines: the paragraph, one string per line (``lines[0]`` starts ``"verdict: <LEVEL> — "``; the last is the
            last step's status, :func:`health_verdict`).
        outcome: ``{"status": "destabilised" | "held" | "no reward recorded", "step", "definition", "peak",
            "peak_step", "at", "minimum", "minimum_step", "last", "last_step", "recent_fall"}`` (reward values are
            the trailing means of the definition; absent entries None).
        first_alerts: tier -> ``{"rule", "step", "level", "lead", "runbook"}`` of the tier's first alert
            (``lead``: steps before the destabilisation, negative after it, None without an outcome).
        worst: metric -> ``{"step", "value", "unit"}``: the worst window of the direction (highest window ρ_asym,
            noise-level steps left out) and magnitude metrics (lowest window δ q0.05, nats; lowest window small-gap
            share, fraction).
        active: ``[{"rule", "tier", "level", "since", "runbook"}]`` in alert at the last step.
        cleared: ``[{"rule", "tier", "level", "fired_at", "step", "reason"}]`` every clearing, in order.
        actions: the next actions, each naming its runbook entry.
        focus_step, focus_why: the most informative step (the first collapse-tier alert, else the window ρ_asym
            peak, else the last step) and why; the dashboard's token views open there.
        status: the last step's :class:`Verdict`.
        reference: the reference band used (:class:`ReferenceBand` as a dict) or None.
    """

    level: str
    lines: tuple[str, ...]
    outcome: Outcome
    first_alerts: dict
    worst: dict[str, WorstPoint]
    active: list
    cleared: list
    actions: list[str]
    focus_step: Optional[int]
    focus_why: str
    status: Verdict
    reference: Optional[dict] = None
    steps: tuple = field(default=(None, None))

    @property
    def text(self) -> str:
        """The paragraph as printed (lines joined by newlines)."""
        return "\n".join(self.lines)

    @property
    def line(self) -> str:
        """The first line (``"verdict: <LEVEL> — ..."``)."""
        return self.lines[0]

    def to_dict(self) -> VerdictDict:
        """A JSON-able dict of every field (``analysis/verdict.json``; NaN written as null); ``text`` holds the
        paragraph."""
        d = {"level": self.level, "text": self.text, "lines": list(self.lines), "outcome": self.outcome,
             "first_alerts": self.first_alerts, "worst": self.worst, "active": self.active, "cleared": self.cleared,
             "actions": self.actions, "focus_step": self.focus_step, "focus_why": self.focus_why,
             "status": {**asdict(self.status), "not_evaluable": [list(x) for x in self.status.not_evaluable]},
             "reference": self.reference, "steps": list(self.steps)}
        return _no_nan(json.loads(json.dumps(d, default=_json_default)))


def _no_nan(x):
    """``x`` with every non-finite float replaced by None (strict JSON: a browser's JSON.parse reads it)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if not math.isfinite(float(x)) else float(x)
    raise TypeError(type(x).__name__)


def _g(x, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


def _outcome(frame, definition: OutcomeDefinition) -> Outcome:
    out: Outcome = {"status": "no reward recorded", "step": None, "definition": definition.describe(), "peak": None,
           "peak_step": None, "at": None, "minimum": None, "minimum_step": None, "last": None, "last_step": None,
           "recent_fall": False}
    if "reward" not in frame.columns:
        return out
    f = frame[["step", "reward"]].sort_values("step")
    reward = f["reward"].to_numpy(dtype=float)
    if not np.isfinite(reward).any():
        return out
    steps = f["step"].to_numpy()
    m = trailing_mean(reward, definition.smooth)
    if not np.isfinite(m).any():
        out["status"] = "too short to judge"
        out["definition"] = (f"{definition.describe()}; the run has {len(steps)} step(s), fewer than the "
                             f"{definition.smooth} the trailing mean needs")
        return out
    s = destabilisation_step(steps, reward, definition)
    fin = np.isfinite(m)
    ipk = int(np.nanargmax(m))
    imin = int(np.nanargmin(m))
    ilast = int(np.flatnonzero(fin)[-1])
    # the keys exist already: setting them keeps the key order
    out["peak"], out["peak_step"] = float(m[ipk]), int(steps[ipk])
    out["minimum"], out["minimum_step"] = float(m[imin]), int(steps[imin])
    out["last"], out["last_step"] = float(m[ilast]), int(steps[ilast])
    if s is not None:
        i = int(np.flatnonzero(steps == s)[0])
        ipk_before = int(np.nanargmax(np.where(fin[:i + 1], m[:i + 1], -np.inf)))
        out["status"], out["step"], out["at"] = "destabilised", int(s), float(m[i])
        out["peak"], out["peak_step"] = float(m[ipk_before]), int(steps[ipk_before])
    else:
        out["status"] = "held"
        peak_now = np.fmax.accumulate(np.where(fin, m, -np.inf))
        out["recent_fall"] = bool(fin[ilast] and m[ilast] < definition.fraction * peak_now[ilast])
    return out


def _worst(frame) -> dict[str, WorstPoint]:
    out: dict[str, WorstPoint] = {}
    noise = _noise_mask(frame)
    if len(frame) and noise.all():           # learner = sampler to rounding: no window is worse than another
        return out
    for col, pick, unit in ((DIRECTION, "max", ""), ("window/delta_q05", "min", "nats"),
                            ("window/small_gap_share", "min", "fraction")):
        if col not in frame.columns:
            continue
        v = frame[col].to_numpy(dtype=float).copy()
        if col == DIRECTION:
            v[noise] = np.nan          # a ratio of rounding noise is no direction (docs/alerts.md#noise-guard)
        if not np.isfinite(v).any():
            continue
        i = int(np.nanargmax(v) if pick == "max" else np.nanargmin(v))
        out[col] = {"step": int(frame["step"].iloc[i]), "value": float(v[i]), "unit": unit}
    return out


def _nan_reason(frame, step: int, metric: str) -> str:
    if "nan_reasons" not in frame.columns:
        return ""
    rows = frame.loc[frame["step"] == step, "nan_reasons"]
    for raw in rows:
        try:
            why = json.loads(raw or "{}").get(metric, "")
        except (TypeError, ValueError):
            why = ""
        if why:
            return str(why)
    return ""


def _short_reason(c, frame, metric: str) -> str:
    if c.reason.startswith("no longer true"):
        return "condition stopped holding"
    if c.reason.startswith("held back at noise level"):
        return "noise level"
    why = _nan_reason(frame, c.step, metric)
    head = c.reason.split(" (steps")[0]
    return f"{head}" + (f": {why}" if why else "")


def _lead_text(lead: Optional[int]) -> str:
    if lead is None:
        return ""
    if lead > 0:
        return f" ({lead} steps ahead)"
    if lead == 0:
        return " (at the destabilisation step)"
    return f" ({-lead} steps after)"


def run_verdict(frame, engine, *, reference: Optional[ReferenceBand] = None,
                definition: OutcomeDefinition = DEFAULT_OUTCOME) -> RunVerdict:
    """The run-level verdict: what happened, when, why, what to do (docs/alerts.md#the-run-verdict).

    Args:
        frame: pandas.DataFrame of the run's steps, one row per step (``step``, ``reward`` when the loop recorded
            one, ``window/rho_asym``, ``window/delta_abs_mean``, ``window/delta_q05``, ``window/small_gap_share``,
            ``nan_reasons``; the live steps table ``open_run(p).steps()`` or a recomputed one).
        engine: the :class:`~triage_monitor.alerting.alerts.AlertEngine` that observed those steps (live, or
            :func:`~triage_monitor.alerting.alerts.replay_engine` on ``frame``): its fired alerts (with their tiers), its
            clearings and the rules' runbook entries.
        reference: a reference run's band (:func:`reference_band`), or None for the published band alone.
        definition: the destabilisation definition (:class:`~triage_monitor.alerting.outcome.OutcomeDefinition`).

    Returns:
        :class:`RunVerdict`.  The outcome is read from ``reward`` only: "destabilised at step s" by ``definition``,
        "held", "too short to judge", or "no reward recorded" (never an invented outcome).
    """
    from ..alerting.alerts import runbook_ref

    status = health_verdict(frame, engine, reference)
    rules = {r.name: r for r in engine.rules}
    ref_of = (lambda name: (runbook_ref(rules[name]) if name in rules else "") or "docs/alerts.md#runbook")
    out = _outcome(frame, definition)
    s = out["step"]
    first_step = int(frame["step"].min()) if len(frame) else None
    last_step = int(frame["step"].max()) if len(frame) else None

    # the first alert of each tier, in the tiers' order
    first: dict = {}
    for a in engine.fired:
        t = getattr(a, "tier", rules[a.rule].tier if a.rule in rules else "collapse")
        if t not in first:
            first[t] = {"rule": a.rule, "step": int(a.step), "level": a.level, "lead": None if s is None else s - a.step,
                        "runbook": ref_of(a.rule)}
    first = {t: first[t] for t in TIERS if t in first}
    worst = _worst(frame)
    last_fire = {}
    for a in engine.fired:
        last_fire[a.rule] = int(a.step)
    stat = engine.status()
    active = [{"rule": x.name, "tier": rules[x.name].tier, "level": rules[x.name].level,
               "since": last_fire.get(x.name), "runbook": ref_of(x.name)} for x in stat if x.active]
    cleared = [{"rule": c.rule, "tier": c.tier, "level": c.level, "fired_at": c.fired_at, "step": c.step,
                "reason": c.reason, "why": _short_reason(c, frame, rules[c.rule].metric if c.rule in rules else "")}
               for c in getattr(engine, "cleared", [])]

    # the most informative step: the first collapse-tier alert, else the direction's peak
    if "collapse" in first:
        focus, focus_why = first["collapse"]["step"], f"the first collapse-tier alert, {first['collapse']['rule']}"
    elif DIRECTION in worst:
        focus, focus_why = worst[DIRECTION]["step"], "the window ρ_asym peak"
    else:
        focus, focus_why = last_step, "the last step"

    # ---- the lines
    lines = []
    if out["status"] == "destabilised":
        head = (f"destabilised at step {s} (trailing {definition.smooth}-step reward {_g(out['peak'])} at step "
                f"{out['peak_step']} → {_g(out['at'])} at step {s})")
        level = "CRITICAL"
    elif out["status"] == "held":
        head = "the reward held" + (" (it has fallen below the line in the last steps: too recent to call)"
                                    if out["recent_fall"] else "")
        level = status.level
    else:
        head = out["status"]
        level = status.level
    if first:
        head += "; first alerts: " + ", ".join(f"{t} {x['rule']} at step {x['step']}{_lead_text(x['lead'])}"
                                               for t, x in first.items())
    else:
        head += "; no alert fired"
    lines.append(f"verdict: {level} — {head}")
    if out["status"] in ("destabilised", "held"):
        tail = (f"minimum {_g(out['minimum'])} at step {out['minimum_step']}, last {_g(out['last'])} at step "
                f"{out['last_step']}")
        if out["status"] == "destabilised":
            what = (f"the trailing {definition.smooth}-step mean reward fell from its peak {_g(out['peak'])} (step "
                    f"{out['peak_step']}) below {definition.fraction:g} × that peak at step {s} and stayed there "
                    f"{definition.stay} steps; {tail}")
        else:
            what = (f"the trailing {definition.smooth}-step mean reward never stayed below {definition.fraction:g} × "
                    f"its running peak for {definition.stay} steps (peak {_g(out['peak'])} at step "
                    f"{out['peak_step']}; {tail})")
        lines.append(f"  outcome: {what} [{out['definition']}]")
    elif out["status"] == "no reward recorded":
        lines.append("  outcome: no reward recorded (no reward column in the steps table), so no outcome is judged")
    else:
        lines.append(f"  outcome: {out['status']} [{out['definition']}]")
    if first:
        lines.append("  first alert of each tier: " + "; ".join(
            f"{t} — {x['rule']} ({x['level']}) at step {x['step']}{_lead_text(x['lead'])}" for t, x in first.items())
            + "".join(f"; {t} — none" for t in TIERS if t not in first))
    parts = []
    if DIRECTION in worst:
        w = worst[DIRECTION]
        parts.append(f"direction window ρ_asym {_g(w['value'])} at step {w['step']}")
    mags = []
    if "window/delta_q05" in worst:
        w = worst["window/delta_q05"]
        mags.append(f"window δ q0.05 {_g(w['value'])} nats at step {w['step']}")
    if "window/small_gap_share" in worst:
        w = worst["window/small_gap_share"]
        mags.append(f"window small-gap share {100 * w['value']:.1f} % at step {w['step']}")
    if mags:
        parts.append("magnitude " + ", ".join(mags))
    if parts:
        lines.append("  worst windows: " + "; ".join(parts))
    elif len(frame) and _noise_mask(frame).all():
        lines.append(f"  worst windows: none — every window is at noise level (mean |δ| < {NOISE_FLOOR_NATS:g} nats)")
    end = []
    end.append("active " + ", ".join(f"{x['rule']} ({x['tier']}, since step {x['since']})" for x in active)
               if active else "no alert active")
    if cleared:
        end.append("cleared " + ", ".join(f"{c['rule']} at step {c['step']} ({c['why']})" for c in cleared))
    lines.append(f"  at the end (step {last_step}): " + "; ".join(end))
    actions = _actions(out, first, active, status, focus, focus_why, ref_of, reference)
    lines.append("  next: " + "; ".join(actions))
    lines.append("  last step: " + status.line[len("verdict: "):])
    return RunVerdict(level, tuple(lines), out, first, worst, active, cleared, actions, focus, focus_why, status,
                      None if reference is None else asdict(reference), (first_step, last_step))


def _actions(out, first, active, status, focus, focus_why, ref_of, reference) -> list[str]:
    acts: list[str] = []
    seen: set = set()

    def add(text, rule=None):
        if rule is not None:
            if rule in seen:
                return
            seen.add(rule)
        acts.append(text)

    s = out["step"]
    col = first.get("collapse")
    asked_reference = False
    if out["status"] == "destabilised":
        if col is not None and col["lead"] is not None and col["lead"] > 0:
            add(f"the first collapse warning came {col['lead']} steps ahead: {col['rule']} at step {col['step']} "
                f"({col['runbook']})", col["rule"])
        else:
            add(f"no collapse-tier alert before step {s}: check the thresholds on a reference run of your setup "
                "(docs/alerts.md#a-reference-run)")
            asked_reference = True
    for x in active:
        if x["tier"] == "collapse":
            add(f"{x['rule']} is active: {x['runbook']}", x["rule"])
    if col is not None:
        add(f"{col['rule']}: {col['runbook']}", col["rule"])
    mis = first.get("mismatch")
    if mis is not None:
        add(f"{mis['rule']} (mismatch tier: the sampler is this far off-policy): {mis['runbook']}", mis["rule"])
    for x in active:
        add(f"{x['rule']} is active: {x['runbook']}", x["rule"])
    if out["status"] == "no reward recorded":
        add("record the reward (log_step(..., extra={'reward': r})) to judge the outcome "
            "(docs/alerts.md#the-run-verdict)")
    if status.level == "NO SIGNAL" and not first:
        add("learner and sampler agree to rounding: no mismatch to correct")
    elif reference is None and first and not asked_reference:
        add("compare with a reference run of your setup, --reference (docs/alerts.md#a-reference-run)")
    if not acts:
        add("nothing to do: no alert fired" + (" and the reward held" if out["status"] == "held" else ""))
    if focus is not None and (first or out["status"] == "destabilised"):
        add(f"inspect step {focus} ({focus_why}; the dashboard's token views open there)")
    return acts


def reference_of_run(run) -> ReferenceBand:
    """:func:`reference_band` of an opened run (:func:`triage_monitor.offline.analysis.open_run`): its live steps, its
    window, its directory's name as the label."""
    return reference_band(run.steps(), run.path.name, run.config.window)


def verdict_of_steps(frame, rules=None, reference: Optional[ReferenceBand] = None,
                     definition: OutcomeDefinition = DEFAULT_OUTCOME) -> RunVerdict:
    """:func:`run_verdict` after replaying ``rules`` (None: the shipped defaults) over ``frame`` (a run's steps):
    what ``analyze``, ``alerts``, the report and the dashboard print."""
    from ..alerting.alerts import replay_engine

    return run_verdict(frame, replay_engine(rules, frame), reference=reference, definition=definition)


__all__ = ["LEVELS", "PUBLISHED_LABEL", "REFERENCE_QUANTILES", "Verdict", "ReferenceBand", "RunVerdict", "Outcome",
           "WorstPoint", "VerdictDict", "reference_band", "reference_of_run", "health_verdict", "run_verdict", "verdict_of_steps"]
