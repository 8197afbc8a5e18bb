"""``triage-monitor study --population``: a population of runs with real negatives, to judge the alerts on.

The study (:mod:`.study`) asks whether a mismatch breaks the job; the population asks whether a warning
*means* something: it mixes runs that hold and runs that fail, on purpose, so that an alert rule can be
scored like a classifier (docs/alerts.md#evaluating-the-alerts, :mod:`triage_monitor.offline.evaluation`).

Conditions (:data:`CONDITIONS`, every one the demo job of :class:`~.grpo.DemoConfig` with overrides):

* ``fp32`` — fp32 sampler on-policy: the control, nothing to warn about;
* ``nvfp4`` — NVFP4 sampler on-policy, no correction: **the realistic negative**, a real learner–sampler
  gap (|δ| ~ 0.01–0.1 nats) on a run that holds;
* ``nvfp4-lag{2,4,8}-{none,tis,triage}`` — the NVFP4 sampler 2, 4 or 8 updates stale (asynchronous rollout)
  with no correction, TIS or TRIAGE;

at the Adam learning rates of :data:`LEARNING_RATES` (the study's 1e-3, half and twice it); :func:`conditions`
lists the 24 combinations run, × 4 seeds = 96 runs.

Seeds are split before any threshold is chosen (fixed here, never tuned): :data:`CALIBRATION_SEEDS` choose
collapse-tier thresholds, :data:`HELDOUT_SEEDS` report them.  Neither overlaps the seeds of the documented
study (0–9).  The run directories are ``OUT/runs/<condition>-s<seed>``; a run whose ``run.json`` says
``finished`` is kept on a second call (resumable), an unfinished one is started over.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from ..rundir.layout import MANIFEST
from ..alerting.outcome import destabilisation_step
from .grpo import DemoConfig

#: Adam learning rates of the population (the study's, half of it, twice it).
LEARNING_RATES = (1e-3, 5e-4, 2e-3)
#: Sampler lags of the stale conditions (updates).
LAGS = (2, 4, 8)
#: Corrections of the stale conditions.
CORRECTIONS = ("none", "tis", "triage")
#: Seeds that choose thresholds (calibration half) and seeds that report them (held-out half): fixed in code before
#: any threshold was chosen; disjoint from each other and from the documented study's seeds 0–9.
CALIBRATION_SEEDS = (40, 41)
HELDOUT_SEEDS = (50, 51)


def _lr_tag(lr: float) -> str:
    return f"lr{lr:g}".replace("-0", "-")


def conditions() -> dict[str, dict[str, Any]]:
    """``{condition name: DemoConfig overrides}`` of the population, in a fixed order (24 conditions).

    Names: ``fp32-<lr>``, ``nvfp4-<lr>``, ``nvfp4-lag<L>-<correction>-<lr>`` (``<lr>`` as ``lr0.001``).  Not a full
    factorial: both on-policy regimes at every learning rate; lag 8 and lag 4 with every correction at the study's
    rate and at twice it, uncorrected at half of it; lag 8 with TIS at half rate; lag 2 uncorrected at the study's
    rate and half of it and with TIS at the study's rate.  The conditions at twice the rate were added after the first
    16 conditions' 64 runs held 5 failures (too few to judge a warning); no threshold had been chosen then.
    """
    hi, lo, top = LEARNING_RATES
    picks = [("fp32", 0, "none", hi), ("fp32", 0, "none", lo), ("nvfp4", 0, "none", hi), ("nvfp4", 0, "none", lo),
             *[("nvfp4", 8, c, hi) for c in CORRECTIONS], ("nvfp4", 8, "none", lo), ("nvfp4", 8, "tis", lo),
             *[("nvfp4", 4, c, hi) for c in CORRECTIONS], ("nvfp4", 4, "none", lo),
             ("nvfp4", 2, "none", hi), ("nvfp4", 2, "tis", hi), ("nvfp4", 2, "none", lo),
             ("fp32", 0, "none", top), ("nvfp4", 0, "none", top),
             *[("nvfp4", 8, c, top) for c in CORRECTIONS], *[("nvfp4", 4, c, top) for c in CORRECTIONS]]
    out: dict[str, dict[str, Any]] = {}
    for recipe, lag, corr, lr in picks:
        name = f"{recipe}-{_lr_tag(lr)}" if not lag else f"{recipe}-lag{lag}-{corr}-{_lr_tag(lr)}"
        out[name] = dict(sampler_recipe=recipe, correction=corr, sampler_lag=lag, lr=lr)
    return out


CONDITIONS = conditions()


def split_of(seed: int) -> str:
    """``"calibration"`` or ``"heldout"`` for a population seed.

    Raises:
        ValueError: a seed in neither half.
    """
    if seed in CALIBRATION_SEEDS:
        return "calibration"
    if seed in HELDOUT_SEEDS:
        return "heldout"
    raise ValueError(f"population: seed {seed} is in neither the calibration {CALIBRATION_SEEDS} nor the held-out "
                     f"{HELDOUT_SEEDS} half")


def regime(overrides: dict) -> str:
    """The regime a condition belongs to: ``fp32`` (on-policy control), ``nvfp4`` (on-policy low precision: the
    realistic negative) or ``stale`` (a lagged sampler)."""
    if overrides.get("sampler_lag", 0):
        return "stale"
    return "fp32" if overrides.get("sampler_recipe") == "fp32" else "nvfp4"


def plan_population(base: DemoConfig, out, seeds: Optional[Sequence[int]] = None,
                    names: Optional[Sequence[str]] = None) -> dict[tuple[str, int], tuple[DemoConfig, Path]]:
    """``{(condition, seed): (DemoConfig, run directory)}`` for the population.

    Args:
        base: the shared configuration (the demo job's defaults; the conditions set recipe, lag, correction, lr).
        out: the population's folder (runs under ``out/runs``).
        seeds: default both halves; names: default every condition of :data:`CONDITIONS`.

    Raises:
        ValueError: an unknown condition or a seed outside both halves.
    """
    # the halves interleaved (s40, s50, s41, s51): a population cut short still has runs in both
    seeds = list(seeds) if seeds is not None else [s for pair in zip(CALIBRATION_SEEDS, HELDOUT_SEEDS) for s in pair]
    for s in seeds:
        split_of(int(s))
    names = list(names) if names is not None else list(CONDITIONS)
    bad = [n for n in names if n not in CONDITIONS]
    if bad:
        raise ValueError(f"population: unknown condition(s) {bad}; known: {list(CONDITIONS)}")
    out = Path(out)
    return {(n, int(s)): (replace(base, seed=int(s), **CONDITIONS[n]), out / "runs" / f"{n}-s{s}")
            for s in seeds for n in names}


def _finished(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def run_population(base: DemoConfig, out, jobs: int = 2, seeds: Optional[Sequence[int]] = None,
                   names: Optional[Sequence[str]] = None, console=None, progress: bool = True) -> pd.DataFrame:
    """Run every (condition, seed) not finished yet, then write ``out/population.csv`` and return it.

    One row per run: ``run`` (directory name), ``condition``, ``regime``, ``sampler_lag``, ``correction``, ``lr``,
    ``seed``, ``split``, ``steps``, ``destabilised_at`` (:func:`~triage_monitor.alerting.outcome.destabilisation_step`
    of the recorded reward, or None) and ``path``.

    Raises:
        ValueError: ``jobs < 1``, an unknown condition or seed.
    """
    from ..offline.analysis import open_run
    from .study import _ArmProgress, _console, _run_parallel

    if jobs < 1:
        raise ValueError(f"population: jobs must be >= 1, got {jobs}")
    plan = plan_population(base, out, seeds, names)
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    console = console or _console()
    todo = {k: v for k, v in plan.items() if not _finished(v[1])}
    console.print(f"[bold]triage-monitor study --population[/]: {len(plan)} run(s) ({len(plan) - len(todo)} finished "
                  f"already), {base.steps} steps each, {min(jobs, max(len(todo), 1))} at a time → {out}",
                  highlight=False)
    t0 = time.perf_counter()
    if todo:
        frames: dict = {}
        attrs: dict = {}
        with _ArmProgress(console, todo, base.steps, enabled=progress) as bar:
            _run_parallel(todo, jobs, frames, attrs, bar.update, {"resume": False, "force": True})
    rows = []
    for (name, seed), (cfg, path) in plan.items():
        steps = open_run(path).steps()
        ov = CONDITIONS[name]
        rows.append({"run": path.name, "condition": name, "regime": regime(ov), "sampler_lag": cfg.sampler_lag,
                     "correction": cfg.correction, "lr": cfg.lr, "seed": seed, "split": split_of(seed),
                     "steps": len(steps), "destabilised_at": destabilisation_step(steps["step"], steps["reward"]),
                     "path": str(path)})
    table = pd.DataFrame(rows)
    table.to_csv(out / "population.csv", index=False)
    (out / "population.json").write_text(json.dumps({
        "base": asdict(base), "conditions": CONDITIONS, "calibration_seeds": CALIBRATION_SEEDS,
        "heldout_seeds": HELDOUT_SEEDS, "seconds": time.perf_counter() - t0}, indent=1, default=str))
    console.print(f"{len(table)} run(s), {int(table['destabilised_at'].notna().sum())} destabilised → "
                  f"{out / 'population.csv'}; judge the alerts with: triage-monitor alerts --evaluate "
                  f"{out / 'runs'}/*", highlight=False, soft_wrap=True)
    return table


__all__ = ["LEARNING_RATES", "LAGS", "CORRECTIONS", "CALIBRATION_SEEDS", "HELDOUT_SEEDS", "CONDITIONS", "conditions",
           "split_of", "regime", "plan_population", "run_population"]
