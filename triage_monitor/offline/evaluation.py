"""Judge alert rules on a population of runs with known outcomes (docs/alerts.md#evaluating-the-alerts).

``triage-monitor alerts --evaluate RUN [RUN ...]`` (:mod:`triage_monitor.commands.alerts`) asks of every rule
what one asks of a classifier: on runs that failed and runs that held, does a warning mean the run is about to
fail?  Each run's outcome comes from its recorded reward (:func:`triage_monitor.alerting.outcome.destabilisation_step`,
the definition selectable) or from a label file.  Every rule (and the union of each tier's and each group's rules)
is replayed over each run's per-step metrics with the live engine (:func:`triage_monitor.alerting.alerts.replay_engine`),
and scored at the run level with a horizon ``H`` steps:

* a warning at step ``w`` on a run that destabilised at ``s`` is **timely** when ``s - H <= w <= s``;
* **warned runs**: failed runs with a warning at or before ``s`` and held runs with any warning;
* **precision** = runs with a timely warning / warned runs; **recall** = runs with a timely warning / failed runs;
* **lead** = ``s`` − the first warning at or before ``s`` (steps), over failed runs warned in time or early;
* **late**: failed runs whose first warning came after ``s``; **held warned**: held runs with any warning, also
  broken down by run group (``fp32``, ``nvfp4``, ``stale`` for the demo's runs; a label file's ``group``).

The same figures are computed for the baseline rules (:func:`triage_monitor.alerting.alert_rules.baseline_rules`): a
trailing reward 20 % below its running peak, a gradient-norm spike, a mean |δ| level.

:func:`metric_auroc` scores a metric as a step-level predictor of "destabilises within H steps" (AUROC with a
bootstrap over runs); :func:`calibrate_threshold` chooses a rule's threshold on one set of runs (the
calibration half) for reporting on another.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd

from ..alerting.alerts import Rule, normalize_columns, replay_engine
from ..errors import TriageMonitorError
from ..alerting.outcome import DEFAULT_OUTCOME, OutcomeDefinition, destabilisation_step

#: default horizon, as a fraction of a run's length (steps): "destabilises within H steps of the warning"
HORIZON_FRACTION = 0.2


class EvaluationError(TriageMonitorError, ValueError):
    """A run or label file that cannot be evaluated (names the run and the field)."""


@dataclass
class EvalRun:
    """One run to evaluate.

    ``name``: shown in tables; ``frame``: its per-step metrics (``step`` and metric columns, one row a step);
    ``destabilised_at``: the outcome (a step, or None when it held); ``outcome_known``: False when neither a reward
    nor a label says (such runs are listed, not scored); ``group``: a label for breakdowns (``fp32``, ``nvfp4``,
    ``stale``, a label file's group, or ``all``); ``info``: extra facts (condition, seed, split)."""

    name: str
    frame: pd.DataFrame
    destabilised_at: Optional[int]
    outcome_known: bool = True
    group: str = "all"
    info: dict = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        """Rows (steps) of the run."""
        return len(self.frame)


# ------------------------------------------------------------------------------------------------ loading
class DemoGroup(NamedTuple):
    """:func:`_demo_group`: the demo job's regime (``"all"`` when not a demo run) and its config facts."""

    group: str
    facts: dict[str, Any]


def _demo_group(path: Path) -> DemoGroup:
    """The demo job's regime (``fp32`` / ``nvfp4`` on-policy, ``stale``) and config facts from run.json, if any."""
    try:
        info = json.loads((path / "run.json").read_text()).get("info", {})
    except (OSError, ValueError):
        return DemoGroup("all", {})
    cfg = info.get("demo_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        return DemoGroup("all", {})
    lag = int(cfg.get("sampler_lag", 0) or 0)
    group = "stale" if lag else ("fp32" if cfg.get("sampler_recipe") == "fp32" else "nvfp4")
    return DemoGroup(group, {k: cfg.get(k) for k in ("sampler_recipe", "sampler_lag", "correction", "lr", "seed")})


class Label(NamedTuple):
    """One run's label (:func:`read_labels`): the step it failed at (None: held) and its group (None: not given)."""

    failed_at: Optional[int]
    group: Optional[str]


def read_labels(path) -> dict[str, Label]:
    """A label file: ``{run name: Label(failed_at step or None, group or None)}`` (the labels are tuples).

    CSV with columns ``run`` and ``failed_at`` (a step; empty = held) and optionally ``group``; or JSON
    ``{"run": {"failed_at": step or null, "group": "..."}}``.  The run name is the run directory's name (or the
    CSV file's stem).

    Raises:
        EvaluationError: a missing column, or a ``failed_at`` that is not an integer (naming the row and value).
    """
    path = Path(path)
    if path.suffix.lower() == ".json":
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise EvaluationError(f"{path}: expected an object of run -> {{failed_at, group}}")
        rows = [{"run": k, **(v if isinstance(v, dict) else {"failed_at": v})} for k, v in raw.items()]
        table = pd.DataFrame(rows)
    else:
        table = pd.read_csv(path, dtype={"run": str})
    for col in ("run", "failed_at"):
        if col not in table.columns:
            raise EvaluationError(f"{path}: label file needs columns run, failed_at (and optionally group); "
                                  f"missing {col!r}")
    out: dict[str, Label] = {}
    for i, r in table.iterrows():
        v = r["failed_at"]
        if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
            step = None
        else:
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not math.isfinite(f) or f != int(f):
                raise EvaluationError(f"{path}: row {i}: failed_at = {v!r} is not an integer step (empty = held)")
            step = int(f)
        g = r.get("group") if "group" in table.columns else None
        out[str(r["run"])] = Label(step, None if g is None or (isinstance(g, float) and math.isnan(g)) else str(g))
    return out


def load_run(path, labels: Optional[dict] = None, definition: OutcomeDefinition = DEFAULT_OUTCOME,
             step_column: str = "step") -> EvalRun:
    """An :class:`EvalRun` from a run directory (its steps table) or a metrics CSV (a W&B history export).

    The outcome: the label of the run's name when ``labels`` has one, else
    :func:`~triage_monitor.alerting.outcome.destabilisation_step` of its ``reward`` column under ``definition``, else
    unknown (no reward recorded).

    Raises:
        EvaluationError: no step column, or no steps.
        OSError: an unreadable file.
    """
    path = Path(path)
    group: str = "all"
    info: dict = {}
    if path.is_dir():
        from .analysis import open_run
        frame = open_run(path).steps()
        group, info = _demo_group(path)
        name = path.name
    else:
        frame = normalize_columns(pd.read_csv(path))
        name = path.stem
        if step_column not in frame.columns and step_column.startswith("triage/"):
            step_column = step_column[len("triage/"):]
        if step_column not in frame.columns:
            raise EvaluationError(f"{path}: no step column {step_column!r}")
        frame = frame[frame[step_column].notna()].rename(columns={step_column: "step"})
        frame["step"] = frame["step"].astype(np.int64)
    if frame.empty:
        raise EvaluationError(f"{path}: no recorded steps")
    frame = frame.sort_values("step", kind="stable").drop_duplicates("step", keep="last").reset_index(drop=True)
    known = True
    if labels and name in labels:
        destab, lg = labels[name]
        group = lg or group
    elif "reward" in frame.columns and frame["reward"].notna().any():
        destab = destabilisation_step(frame["step"], pd.to_numeric(frame["reward"], errors="coerce"), definition)
    else:
        destab, known = None, False
    return EvalRun(name, frame, destab, known, group, info)


# ------------------------------------------------------------------------------------------------ scoring
def warning_steps(run: EvalRun, rules: Sequence[Rule]) -> dict[str, list[int]]:
    """``{rule name: [steps it fired at]}`` of ``rules`` replayed over ``run``'s metrics (the live engine)."""
    quiet = logging.getLogger("triage_monitor.alerts")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        eng = replay_engine(list(rules), run.frame)
    finally:
        quiet.setLevel(level)
    out: dict[str, list[int]] = {r.name: [] for r in rules}
    for a in eng.fired:
        out[a.rule].append(int(a.step))
    return out


class Score(NamedTuple):
    """Run-level figures of one detector (a rule, or the union of a tier's / group's rules); see the module text."""

    runs: int
    failed: int
    held: int
    warned: int
    timely: int
    late: int
    held_warned: int
    precision: float
    recall: float
    lead_median: float
    lead_min: float
    lead_max: float
    warnings_on_held: int


def score_detector(runs: Sequence[EvalRun], fires: Sequence[Sequence[int]], horizon: int) -> Score:
    """Score one detector whose warning steps on ``runs[i]`` are ``fires[i]`` (runs with an unknown outcome skipped).

    Args:
        runs: the runs; fires: one list of warning steps per run; horizon: ``H`` in steps (>= 0).

    Returns:
        :class:`Score` (precision NaN when nothing warned, recall NaN when nothing failed).
    """
    failed = held = warned = timely = late = held_warned = on_held = 0
    leads = []
    for run, ws in zip(runs, fires):
        if not run.outcome_known:
            continue
        ws = sorted(ws)
        s = run.destabilised_at
        if s is None:
            held += 1
            if ws:
                warned += 1
                held_warned += 1
                on_held += len(ws)
            continue
        failed += 1
        before = [w for w in ws if w <= s]
        if before:
            warned += 1
            leads.append(s - before[0])
            if any(s - horizon <= w for w in before):
                timely += 1
        elif ws:
            late += 1
    lead = np.asarray(leads, dtype=float)
    return Score(failed + held, failed, held, warned, timely, late, held_warned,
                 timely / warned if warned else math.nan, timely / failed if failed else math.nan,
                 float(np.median(lead)) if lead.size else math.nan, float(lead.min()) if lead.size else math.nan,
                 float(lead.max()) if lead.size else math.nan, on_held)


def default_horizon(runs: Sequence[EvalRun], fraction: float = HORIZON_FRACTION) -> int:
    """``fraction`` × the median run length (steps), rounded; at least 1."""
    n = np.median([r.n_steps for r in runs]) if runs else 0
    return max(1, int(round(fraction * float(n))))


def evaluate(runs: Sequence[EvalRun], rules: Sequence[Rule], baselines: Sequence[Rule] = (),
             horizon: Optional[int] = None) -> pd.DataFrame:
    """Per rule, per tier, per rule group and per baseline: the :class:`Score` columns, plus held runs warned per run
    group (``held_warned_<group>``, ``held_<group>``).

    Returns:
        One row per detector: ``kind`` (``rule``, ``tier``, ``group``, ``baseline``), ``name``, ``tier``, the
        :class:`Score` fields and the per-group columns.  ``df.attrs["horizon"]`` is H.

    Raises:
        EvaluationError: no run with a known outcome.
    """
    scored = [r for r in runs if r.outcome_known]
    if not scored:
        raise EvaluationError("alerts --evaluate: no run has an outcome (no reward recorded and no label)")
    horizon = default_horizon(scored) if horizon is None else int(horizon)
    allrules = list(rules) + list(baselines)
    fires = [warning_steps(r, allrules) for r in runs]
    groups = sorted({r.group for r in scored})
    detectors: list[tuple[str, str, str, Callable[[dict[str, list[int]]], list[int]]]] = []
    for r in rules:
        detectors.append(("rule", r.name, r.tier, _fired_one(r.name)))
    for tier in dict.fromkeys(r.tier for r in rules):
        names = [r.name for r in rules if r.tier == tier]
        detectors.append(("tier", tier, tier, _fired_any(names)))
    for grp in dict.fromkeys(r.group for r in rules):
        names = [r.name for r in rules if r.group == grp]
        tiers = "/".join(dict.fromkeys(r.tier for r in rules if r.group == grp))
        detectors.append(("group", grp or "(none)", tiers, _fired_any(names)))
    for r in baselines:
        detectors.append(("baseline", r.name, r.tier, _fired_one(r.name)))
    rows = []
    for kind, name, tier, pick in detectors:
        ws = [pick(f) for f in fires]
        row = {"kind": kind, "name": name, "tier": tier, **score_detector(runs, ws, horizon)._asdict()}
        for g in groups:
            held = [(r, w) for r, w in zip(runs, ws) if r.outcome_known and r.group == g and r.destabilised_at is None]
            row[f"held_{g}"] = len(held)
            row[f"held_warned_{g}"] = sum(1 for _, w in held if w)
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["horizon"] = horizon
    return out


def _fired_one(name: str) -> Callable[[dict[str, list[int]]], list[int]]:
    """A detector of one rule: its steps out of a :func:`warning_steps` dict."""
    return lambda fired: fired[name]


def _fired_any(names: Sequence[str]) -> Callable[[dict[str, list[int]]], list[int]]:
    """A detector of several rules (a tier's, a group's): their steps, rule by rule, out of a :func:`warning_steps`
    dict."""
    return lambda fired: [w for n in names for w in fired[n]]


# ------------------------------------------------------------------------------------------------ AUROC
def auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` (``(n,)`` floats, higher = more likely positive) for ``labels``
    (``(n,)`` bools), ties counted half (the Mann–Whitney U statistic / n_pos·n_neg); NaN without both classes."""
    labels = np.asarray(labels, bool)
    scores = np.asarray(scores, float)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if not n_pos or not n_neg:
        return math.nan
    ranks = pd.Series(scores).rank(method="average").to_numpy()
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class StepLabels(NamedTuple):
    """:func:`step_labels`: which rows of the run are kept (bool, one per row) and the kept rows' labels (bool)."""

    keep: np.ndarray
    labels: np.ndarray


def step_labels(run: EvalRun, horizon: int) -> StepLabels:
    """:class:`StepLabels` ``(rows kept, label)`` of one run for a step-level score: every step of a held run
    (label False); the steps at or before the destabilisation of a failed run, labelled True when it is at most
    ``horizon`` steps away."""
    steps = run.frame["step"].to_numpy()
    s = run.destabilised_at
    if s is None:
        return StepLabels(np.ones(len(steps), bool), np.zeros(len(steps), bool))
    keep = steps <= s
    return StepLabels(keep, (s - steps <= horizon)[keep])


class MetricAUROC(NamedTuple):
    """:func:`metric_auroc`: the step-level AUROC, its 95 % bootstrap interval and the steps of each label."""

    auroc: float
    low: float
    high: float
    positives: int
    negatives: int


def metric_auroc(runs: Sequence[EvalRun], score: Callable[[pd.DataFrame], np.ndarray], horizon: int,
                 n_boot: int = 1000, seed: int = 0) -> MetricAUROC:
    """Step-level AUROC of ``score`` for "destabilises within ``horizon`` steps", with a 95 % bootstrap interval.

    Args:
        runs: runs with a known outcome; score: ``frame -> (rows,)`` float scores (NaN rows are left out).
        horizon: H in steps; n_boot: bootstrap resamples of whole runs (steps of one run are not independent),
            failed and held runs resampled separately (a stratified bootstrap: every resample has both; with few
            failed runs the interval is still only as wide as their spread, so read it beside their count);
        seed: the bootstrap's random seed.

    Returns:
        ``MetricAUROC(auroc, low, high, positive steps, negative steps)`` (a tuple).
    """
    per = []
    for r in runs:
        if not r.outcome_known:
            continue
        keep, lab = step_labels(r, horizon)
        sc = np.asarray(score(r.frame), float)[keep]
        ok = np.isfinite(sc)
        per.append((lab[ok], sc[ok]))
    if not per:
        return MetricAUROC(math.nan, math.nan, math.nan, 0, 0)
    lab = np.concatenate([p[0] for p in per])
    sc = np.concatenate([p[1] for p in per])
    point = auroc(lab, sc)
    rng = np.random.default_rng(seed)
    # stratified by outcome: failed runs and held runs are resampled separately, so every resample keeps both
    failed = [i for i, p in enumerate(per) if p[0].any()]
    others = [i for i, p in enumerate(per) if not p[0].any()]
    boots = []
    for _ in range(n_boot if failed and others else 0):
        idx = np.concatenate([rng.choice(failed, len(failed)), rng.choice(others, len(others))])
        b = auroc(np.concatenate([per[i][0] for i in idx]), np.concatenate([per[i][1] for i in idx]))
        if math.isfinite(b):
            boots.append(b)
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots else (math.nan, math.nan))
    return MetricAUROC(point, float(lo), float(hi), int(lab.sum()), int((~lab).sum()))


# ------------------------------------------------------------------------------------------------ calibration
class Calibration(NamedTuple):
    """:func:`calibrate_threshold`'s choice: the rule at the chosen threshold (None: none qualifies) and the table of
    every candidate's :class:`Score`."""

    rule: Optional[Rule]
    table: pd.DataFrame


def calibrate_threshold(runs: Sequence[EvalRun], rule: Rule, candidates: Sequence[float], horizon: int,
                        quiet_groups: Sequence[str] = ("fp32", "nvfp4"),
                        min_precision: float = 0.0) -> Calibration:
    """Choose ``rule``'s threshold on ``runs`` (the calibration half): the candidate with the highest recall among
    those that warn on no held run of ``quiet_groups`` and reach ``min_precision``; ties go to the higher precision,
    then the longer median lead, then the more conservative threshold (the later candidate in ``candidates``
    order: give them from least to most conservative).

    Returns:
        ``Calibration(rule with the chosen threshold or None when no candidate qualifies, table of every candidate's
        Score)`` (a tuple).
    """
    rows: list[dict[str, Any]] = []
    best: Optional[Rule] = None
    best_key: Optional[tuple[float, float, float, int]] = None
    for i, thr in enumerate(candidates):
        r = replace(rule, threshold=float(thr))
        fires = [warning_steps(run, [r])[r.name] for run in runs]
        sc = score_detector(runs, fires, horizon)
        quiet_warned = sum(1 for run, w in zip(runs, fires) if run.outcome_known and run.group in quiet_groups
                           and run.destabilised_at is None and w)
        rows.append({"threshold": float(thr), "quiet_warned": quiet_warned, **sc._asdict()})
        prec = 0.0 if math.isnan(sc.precision) else sc.precision
        if quiet_warned or prec < min_precision or not sc.timely:
            continue
        key = (sc.recall, prec, 0.0 if math.isnan(sc.lead_median) else sc.lead_median, i)
        if best_key is None or key >= best_key:
            best, best_key = r, key
    return Calibration(best, pd.DataFrame(rows))


__all__ = ["HORIZON_FRACTION", "EvaluationError", "EvalRun", "Score", "read_labels", "load_run", "warning_steps", "Label", "Calibration", "MetricAUROC",
           "score_detector", "default_horizon", "evaluate", "auroc", "step_labels", "metric_auroc",
           "calibrate_threshold"]
