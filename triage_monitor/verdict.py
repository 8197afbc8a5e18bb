"""The one-line health verdict of a run: what the numbers on screen mean for it.

``analyze``, ``alerts`` and the report end with it (docs/alerts.md#rules-that-cannot-evaluate-yet-and-the-verdict), e.g.::

    verdict: OK — window ρ_asym 0.97 at step 29, below the healthy reference 1.023 (published healthy 1.023–1.337;
    alert thresholds 1.45 WARN, 1.8 ERROR); no alert; 4 rule(s) not evaluable before step 50–74

It reads the last step's pooled window ρ_asym (the direction metric the shipped rules listen to first,
docs/metrics.md#rho_asym) against the published references (:mod:`triage_monitor.references`) and the
thresholds of the rules, and the state of the alert engine after the run's steps (which rules fired, are
active, or could not evaluate yet, :meth:`~triage_monitor.alerts.AlertEngine.status`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .alert_rules import NOISE_FLOOR_NATS
from .references import RHO_ASYM_HEALTHY, rho_asym_thresholds

#: Verdict levels, least to most severe.
LEVELS = ("NO SIGNAL", "OK", "WATCH", "WARNING", "CRITICAL")


@dataclass(frozen=True)
class Verdict:
    """``level`` (one of :data:`LEVELS`), ``line`` (the sentence printed), ``step`` (the step judged, or None),
    ``rho`` (its window ρ_asym), ``not_evaluable`` (``[(rule, reason), ...]`` of rules that did not evaluate)."""

    level: str
    line: str
    step: object
    rho: float
    not_evaluable: tuple


def _last_finite(frame, col):
    if col not in frame.columns:
        return None, math.nan
    s = frame[["step", col]].dropna()
    s = s[s[col].astype(float).map(math.isfinite)]
    if s.empty:
        return None, math.nan
    row = s.sort_values("step").iloc[-1]
    return int(row["step"]), float(row[col])


def health_verdict(frame, engine) -> Verdict:
    """The verdict on a run's per-step metrics after its rules ran over them.

    Args:
        frame: pandas.DataFrame of the run's steps (``step``, ``window/rho_asym``, ``window/delta_abs_mean``; the
            monitor's live steps table or a recomputed one).
        engine: the :class:`~triage_monitor.alerts.AlertEngine` that observed those steps (live, or
            :func:`~triage_monitor.alerts.replay_engine` on ``frame``).

    Returns:
        :class:`Verdict`.  Level: CRITICAL with an active ERROR alert or ρ_asym above the highest threshold;
        WARNING with an active WARN alert or above the lowest; WATCH above the healthy range or with alerts
        that fired and cleared; OK otherwise; NO SIGNAL when the learner and sampler agree to rounding (mean |δ|
        below the noise floor, docs/alerts.md#noise-guard) or the direction metric has no value.
    """
    lo, hi = RHO_ASYM_HEALTHY
    thresholds = rho_asym_thresholds(engine.rules)
    thr_text = ", ".join(f"{v:g} {lvl}" for v, _, lvl in thresholds) or "none"
    step, rho = _last_finite(frame, "window/rho_asym")
    _, gap = _last_finite(frame, "window/delta_abs_mean")
    status = engine.status()
    levels = {r.name: r.level for r in engine.rules}
    active = [s.name for s in status if s.active]
    fired = sum(s.fired for s in status)
    last = int(frame["step"].max()) if len(frame) else None
    waiting = [s for s in status if not s.evaluated and s.evaluable_from is not None and last is not None
               and s.evaluable_from > last]
    rank = 1
    if step is None:
        head, rank = "window ρ_asym has no value in this run", 0
    elif math.isfinite(gap) and gap < NOISE_FLOOR_NATS:
        head, rank = (f"learner and sampler agree to rounding (window mean |δ| {gap:.2g} nats < {NOISE_FLOOR_NATS:g}): "
                      f"ρ_asym {rho:.3g} at step {step} is noise, there is no mismatch to judge"), 0
    else:
        where = f"window ρ_asym {rho:.3g} at step {step}"
        above = [(v, lvl) for v, _, lvl in thresholds if rho > v]
        if above:
            v, lvl = above[-1]
            head, rank = f"{where}, above the {lvl} threshold {v:g}", 4 if lvl == "ERROR" else 3
        elif rho > hi:
            nxt = f", below the first alert threshold {thresholds[0][0]:g}" if thresholds else ""
            head, rank = f"{where}, above the published healthy range {lo:g}–{hi:g}{nxt}", 2
        elif rho >= lo:
            head = f"{where}, within the published healthy range {lo:g}–{hi:g}"
        else:
            head = f"{where}, below the healthy reference {lo:g}"
        head += f" (published healthy {lo:g}–{hi:g}; alert thresholds {thr_text})"
    if active:
        rank = max(rank, 4 if any(levels[n] == "ERROR" for n in active) else 3)
        alerts = f"{len(active)} alert(s) active ({', '.join(active)})"
    elif fired:
        rank = max(rank, 2)
        alerts = f"{fired} alert(s) fired earlier, none active now"
    else:
        alerts = "no alert"
    parts = [head, alerts]
    if waiting:
        starts = sorted({s.evaluable_from for s in waiting})
        when = f"{starts[0]}" if len(starts) == 1 else f"{starts[0]}–{starts[-1]}"
        parts.append(f"{len(waiting)} rule(s) not evaluable before step {when}")
    level = LEVELS[rank]
    return Verdict(level, f"verdict: {level} — " + "; ".join(parts), step, rho,
                   tuple((s.name, s.reason) for s in status if not s.evaluated and s.reason))


__all__ = ["LEVELS", "Verdict", "health_verdict"]
