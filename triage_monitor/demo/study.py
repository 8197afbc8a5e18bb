"""``triage-monitor study``: the demo job's arms × seeds, destabilisation, alert timing and one comparison report.

The study runs the demo GRPO job (:mod:`.grpo`, :class:`~.grpo.DemoConfig`'s defaults) once per
(arm, seed).  Its mismatch mechanism (docs/study.md): an NVFP4 W4A4 sampler that generates with
the weights of ``sampler_lag`` (8) updates ago, an asynchronous rollout, against an fp32 learner:

============  ===================================================================================
``none``      lagged NVFP4 sampler, no correction (plain PPO): the arm expected to fail
``tis``       same sampler, TIS weights (clip [0, 2])
``triage``    same sampler, TRIAGE (TIS + Gate + Repair, Gate calibrated on the first steps)
``fp32-lag``  fp32 sampler with the same lag, no correction: staleness without 4-bit numerics
``fp32``      fp32 sampler on-policy (lag 0), no correction: the control
``none-mlp``  (GPU preset) NVFP4 on the MLP linears only, no correction: the deployed scope
============  ===================================================================================

All arms share the learning rate, seeds, prompts and model, so a failure of ``none`` that ``fp32``
does not share is a mismatch effect, not a learning-rate blow-up.

Definitions (fixed before any run; docs/study.md#definitions):

* **destabilised** (:func:`destabilisation_step`): the trailing :data:`SMOOTH_STEPS`-step mean
  reward is below :data:`COLLAPSE_FRACTION` × its running peak on :data:`MIN_STAY` consecutive
  steps; the step is the first of them.  A deep dip that recovers counts.
* **mismatch blow-up** (:func:`blowup_step`): the trailing 10-step mean of the per-step mean |δ|
  (or of the per-step k3 KL) exceeds :data:`BLOWUP_FACTOR` × its value over the first 10 steps at
  full staleness, above the noise floor.
* **direction onset** (:func:`onsets`): window ρ_asym above (one-sided, rising amplification) or
  outside (two-sided) the band of the run's own reference steps.
* **alerts**: the shipped default rules, live (the run directory's ``alerts/`` table; a replay
  over the same metrics is checked against it); lead = destabilisation − first early warning.
* **sampler-follow correlation** (``follow``): mean of the run's ``follow_corr`` probes
  (:func:`~.grpo.follow_correlation`).

Output (``out``): one run directory per (arm, seed) under ``runs/``, ``study.html`` (plotly,
self-contained), ``summary.csv`` (one row per run), ``arms.csv`` (one row per arm),
``trajectories.csv`` (key per-step columns of every run) and ``study.json`` (configuration,
definitions, the tables).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, TypedDict

import numpy as np
import pandas as pd

from ..alerting.alerts import NOISE_FLOOR_NATS, TIERS, default_rules, replay_engine
from ..exits import command_line
from ..rundir.layout import MANIFEST
from ..alerting.outcome import COLLAPSE_FRACTION, MIN_STAY, SMOOTH_STEPS, destabilisation_step, trailing_mean  # noqa: F401
from ..metrics.timings import (DEFAULT_K, LABELS, PHASES, CycleComparison, CycleSummary, compare_cycles, cycle_summary,
                               figures)
from .grpo import DemoConfig

#: Arms: overrides of the base configuration (the base's ``sampler_lag`` is the study's staleness).
ARMS: dict[str, dict[str, Any]] = {
    "none": dict(correction="none"),
    "none-half-lr": dict(correction="none", lr_factor=0.5),
    "tis": dict(correction="tis"),
    "triage": dict(correction="triage"),
    "fp32-lag": dict(sampler_recipe="fp32", correction="none"),
    "fp32": dict(sampler_recipe="fp32", correction="none", sampler_lag=0),
    "nvfp4": dict(correction="none", sampler_lag=0),
    "none-mlp": dict(correction="none", quantize="mlp"),
}
#: The study's arms when ``--arms`` is not given.
DEFAULT_ARMS = ("none", "none-half-lr", "tis", "triage", "fp32-lag", "fp32")
#: The study's seeds when ``--seeds`` is not given (a paper-sized study: a 5-seed study's counts are not significant).
DEFAULT_SEEDS = tuple(range(10))
#: The corrected arm and the baseline it is judged against (an asynchronous trainer's fair baseline is TIS, not
#: plain PPO), and the comparisons whose exact tests the findings report (Holm-corrected together).
TREATMENT_ARM, BASELINE_ARM = "triage", "tis"
COMPARISONS = (("triage", "tis"), ("triage", "none"), ("tis", "none"), ("none", "none-half-lr"))
#: The arm expected to fail, and the on-policy control.
FAILING_ARM, CONTROL_ARM = "none", "fp32"
ARM_COLORS = {"none": "#dc2626", "none-half-lr": "#f87171", "tis": "#d97706", "triage": "#2563eb",
              "fp32-lag": "#7c3aed", "fp32": "#6b7280", "nvfp4": "#0891b2", "none-mlp": "#059669"}
#: The study's fields that arms set (not options of ``study``: they would overlap ``--arms`` / ``--seeds``).
PER_ARM_FIELDS = ("seed", "correction", "sampler_recipe")



class RunSet(TypedDict):
    """Arms and seeds of a study (:data:`QUICK`)."""

    arms: tuple[str, ...]
    seeds: tuple[int, ...]


#: ``--quick`` (``make demo``): the failing arm and the on-policy control, one seed, side by side.
QUICK: RunSet = dict(arms=("none", "fp32"), seeds=(0,))
#: ``--preset gpu`` (scripts/gpu_study.sh, docs/study.md#the-nvfp4-regime-on-a-gpu): the NVFP4 regime itself, no staleness.  A
#: wider and deeper model, a 1024-token vocabulary with a never-valid tail, 256-token responses with
#: 64-token segments (4 per response), 16 × 16 responses a step and an Adam learning rate small enough
#: that the sampler's quantised weights follow little of each update (follow correlation ≤ 0.3 was
#: measured at lr 1e-4 with every linear quantised and 3e-5 MLP-only on the CPU job).
GPU_PRESET = dict(
    config=dict(d_model=256, n_layer=4, n_head=8, vocab_tail=1010, response_len=256, segment_width=64,
                gate_width=64, repair_width=128, prompts_per_step=16, group_size=16, lr=3e-5, steps=600,
                sampler_lag=0, sft_steps=300, sft_batch=64, eval_size=16, eval_every=25, follow_every=25,
                device="cuda"),
    arms=("none", "tis", "triage", "fp32", "none-mlp"), seeds=(0,))
PRESETS: dict[str, dict[str, Any]] = {"gpu": GPU_PRESET}

BLOWUP_FACTOR = 10.0
#: steps of the reference of :func:`blowup_step` and :func:`onsets`, from the first step at full staleness
REF_STEPS = 10
#: relative widths of the healthy bands of :func:`onsets` (at least; 3 MADs when wider)
RHO_BAND, SMALL_GAP_BAND, K3_FACTOR = 0.15, 0.05, 2.0
#: alert groups reported with their own first step (``first_<group>_alert``)
WARNING_GROUPS = ("direction", "localization", "magnitude", "controller")
#: the tier whose alerts count as early warnings of a collapse (lead, false alerts; docs/alerts.md#tiers)
WARNING_TIER = "collapse"
#: the lead an early warning should have, as a fraction of the horizon
LEAD_GOAL = 0.2
#: seeds per arm below which the claim is not judged
MIN_SEEDS = 3


def arm_config(arm: str, base: DemoConfig, seed: Optional[int] = None) -> DemoConfig:
    """``base`` with the overrides of ``arm`` (an ``lr_factor`` scales the base's learning rate) and ``seed``."""
    ov = dict(ARMS[arm])
    factor = ov.pop("lr_factor", None)
    if factor is not None:
        ov["lr"] = base.lr * factor
    if seed is not None:
        ov["seed"] = int(seed)
    return replace(base, **ov)


def arm_label(arm: str, base: DemoConfig) -> str:
    """A short description of an arm under ``base`` (e.g. ``NVFP4 sampler 8 stale · TIS``)."""
    cfg = arm_config(arm, base)
    num = "fp32" if cfg.sampler_recipe == "fp32" else ("NVFP4 (MLP)" if cfg.quantize == "mlp" else "NVFP4")
    lag = f" {cfg.sampler_lag} stale" if cfg.sampler_lag else " on-policy"
    corr = {"none": "no correction", "tis": "TIS", "triage": "TRIAGE"}[cfg.correction]
    tail = " (control)" if arm == CONTROL_ARM else ""
    lr = f" · lr {cfg.lr:g}" if cfg.lr != base.lr else ""
    return f"{num} sampler{lag} · {corr}{lr}{tail}"


# ------------------------------------------------------------------------------ judging one run
_trailing = trailing_mean


def blowup_step(steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray, ref_start: int = 0,
                guard: Optional[Sequence[float] | np.ndarray] = None, factor: float = BLOWUP_FACTOR) -> Optional[int]:
    """The first step at which a mismatch magnitude has grown ``factor``-fold, or None.

    ``m(t)`` = trailing :data:`SMOOTH_STEPS`-row mean of ``values`` (per-step mean |δ| in nats, or
    per-step k3 KL); the reference is ``m`` at row ``ref_start + SMOOTH_STEPS − 1`` (the mean over
    the rows ``[ref_start, ref_start + SMOOTH_STEPS)``: for a lagged sampler the first steps at full
    staleness).  Returns the first later step with ``m(t) > factor · reference``; rows whose trailing
    mean of ``guard`` (the per-step mean |δ|) is below :data:`~triage_monitor.alerting.alerts.NOISE_FLOOR_NATS`
    are at noise level and never count.  None if the run is too short for the reference.

    Raises:
        ValueError: lengths differ, or ``ref_start < 0``.
    """
    step_arr, v = np.asarray(steps), np.asarray(values, dtype=float)
    if step_arr.shape != v.shape or (guard is not None and np.shape(guard) != v.shape):
        raise ValueError("blowup_step: steps, values and guard must have one row each")
    if ref_start < 0:
        raise ValueError(f"blowup_step: ref_start must be >= 0, got {ref_start}")
    m = _trailing(v)
    r = ref_start + SMOOTH_STEPS - 1
    if r >= len(v) or not np.isfinite(m[r]):
        return None
    ok = np.ones(len(v), bool) if guard is None else ~(_trailing(guard) < NOISE_FLOOR_NATS)
    hit = np.flatnonzero((np.arange(len(v)) > r) & (m > factor * m[r]) & ok)
    return int(step_arr[hit[0]]) if hit.size else None


class Band(NamedTuple):
    """:func:`_band`: the low and high edge of a reference band (NaN, NaN when there is no finite value)."""

    low: float
    high: float


def _band(ref: np.ndarray, rel: float) -> Band:
    """The band ``median ± max(3·MAD, rel·|median|)`` of the finite values of ``ref`` (1-D float)."""
    ref = ref[np.isfinite(ref)]
    if not ref.size:
        return Band(math.nan, math.nan)
    med = float(np.median(ref))
    half = max(3.0 * float(np.median(np.abs(ref - med))), rel * abs(med))
    return Band(med - half, med + half)


class Onsets(TypedDict):
    """:func:`onsets`: the first steps (None: never) and the ρ_asym band, in this key order."""

    noise_steps: int
    rho_band: tuple[float, float]
    direction_up: Optional[int]
    direction_2s: Optional[int]
    small_gap: Optional[int]
    k3: Optional[int]


def onsets(df: pd.DataFrame, ref_start: int = 0) -> Onsets:
    """When the direction and magnitude metrics leave the band of the run's own reference steps.

    Reference: the :data:`REF_STEPS` rows from ``ref_start`` (the first step at full staleness).
    Bands: ``window/rho_asym`` median ± max(3 MAD, 15 % of the median); ``window/small_gap_share``
    below median − max(3 MAD, 0.05); ``window/k3_kl`` above :data:`K3_FACTOR` × its median.  A row
    whose ``window/delta_abs_mean`` is below :data:`~triage_monitor.alerting.alerts.NOISE_FLOOR_NATS` is at
    noise level: it neither defines nor leaves a band.

    Returns:
        ``direction_up`` (first step after the reference above the ρ_asym band: rising
        amplification, one-sided), ``direction_2s`` (first step outside it, either side),
        ``small_gap``, ``k3`` (None if never), ``rho_band`` (lo, hi), ``noise_steps`` (rows at noise level).
    """
    d = df.sort_values("step").reset_index(drop=True)
    steps = d["step"].to_numpy()
    noise = d.get("window/delta_abs_mean", pd.Series(np.inf, index=d.index)).to_numpy(float) < NOISE_FLOOR_NATS
    ref = slice(ref_start, ref_start + REF_STEPS)
    after = np.arange(len(d)) >= ref_start + REF_STEPS

    def first(mask) -> Optional[int]:
        idx = np.flatnonzero(mask & after & ~noise)
        return int(steps[idx[0]]) if idx.size else None

    rho = d["window/rho_asym"].to_numpy(float)
    lo, hi = _band(np.where(noise, np.nan, rho)[ref], RHO_BAND)
    ok = math.isfinite(lo)
    sg = np.where(noise, np.nan, d["window/small_gap_share"].to_numpy(float))
    lo_sg, _ = _band(sg[ref], 0.0)
    med_sg = float(np.nanmedian(sg[ref])) if np.isfinite(sg[ref]).any() else math.nan
    k3 = np.where(noise, np.nan, d["window/k3_kl"].to_numpy(float))
    med_k3 = float(np.nanmedian(k3[ref])) if np.isfinite(k3[ref]).any() else math.nan
    return {"noise_steps": int(noise.sum()), "rho_band": (lo, hi),
            "direction_up": first(rho > hi) if ok else None,
            "direction_2s": first((rho < lo) | (rho > hi)) if ok else None,
            "small_gap": first(sg < min(lo_sg, med_sg - SMALL_GAP_BAND)) if math.isfinite(med_sg) else None,
            "k3": first(k3 > K3_FACTOR * med_k3) if math.isfinite(med_k3) else None}


def _ref_start(d: pd.DataFrame, lag: Optional[int]) -> int:
    """Row of the first step at full staleness (0 on-policy)."""
    if "sampler_staleness" in d:
        st = d["sampler_staleness"].to_numpy(float)
        full = np.flatnonzero(st >= np.nanmax(st)) if np.isfinite(st).any() else np.array([0])
        return int(full[0]) if full.size else 0
    return min(int(lag or 0), max(len(d) - 1, 0))


def judge_run(df: pd.DataFrame, window: int, rules=None, live_alerts: Optional[pd.DataFrame] = None,
              lag: Optional[int] = None) -> dict[str, Any]:
    """Destabilisation, blow-up, onsets, alerts and diagnostics of one run's per-step metrics ``df``.

    Args:
        df: the run's per-step table (``step``, ``reward``, ``delta_abs_mean``, ``k3_kl``,
            ``grad_norm``, ``follow_corr``, the ``window/`` columns).
        window: the monitor's window in steps (the range of window ρ_asym starts at its first full window).
        rules: the alert rules replayed (None: the shipped defaults).
        live_alerts: the run directory's live ``alerts/`` table (``step``, ``rule``); None: use the replay.
        lag: the sampler lag, when ``df`` has no ``sampler_staleness`` column.

    Returns:
        A dict: ``steps``; ``destabilised_at``, ``blowup_delta_at``, ``blowup_k3_at`` (steps or None);
        ``reward_first`` / ``reward_peak`` / ``reward_min`` / ``reward_last`` (trailing-10 means);
        ``delta_abs_ref`` (10-step mean |δ| at the reference, nats), ``delta_abs_max10``,
        ``delta_abs_last``; ``rho_window_min`` / ``rho_window_max`` (window ρ_asym from the first full
        window, noise-level steps left out); ``grad_norm_max``; ``follow`` (mean follow correlation);
        ``direction_onset_up`` (one-sided), ``direction_onset_2s`` (two-sided), ``small_gap_onset``,
        ``k3_onset``; ``first_alert``, ``first_alert_rule``, ``lead_steps``, ``lead_frac``,
        ``n_alerts`` (early warnings: alerts of the tier :data:`WARNING_TIER`), ``first_<group>_alert`` (first
        alert of any tier of each of those groups: ``first_direction_alert``, ...), ``alerts`` (list of
        ``(step, rule)``), ``alerts_source`` (``live`` or ``replay``), ``live_equals_replay``
        (None without a live table) and ``noise_level_steps``.  A plain dict (a summary row, in this column order):
        its ``first_<group>_alert`` / ``first_<tier>_...`` keys follow :data:`WARNING_GROUPS` and
        :data:`~triage_monitor.alerting.alert_rules.TIERS`.
    """
    d = df.sort_values("step").reset_index(drop=True)
    steps = d["step"].to_numpy()
    n = len(d)
    reward = d["reward"].to_numpy(float)
    destab = destabilisation_step(steps, reward)
    r0 = _ref_start(d, lag)
    delta = d["delta_abs_mean"].to_numpy(float)
    k3 = d["k3_kl"].to_numpy(float) if "k3_kl" in d else np.full(n, np.nan)
    blow_d = blowup_step(steps, delta, r0, guard=delta)
    blow_k = blowup_step(steps, k3, r0, guard=delta)
    on = onsets(d, r0)
    quiet = logging.getLogger("triage_monitor.alerts")
    level = quiet.level
    quiet.setLevel(logging.WARNING)     # "cleared" lines of every replayed run would drown the table
    try:
        eng = replay_engine(default_rules() if rules is None else rules, d)
    finally:
        quiet.setLevel(level)
    groups = {r.name: r.group for r in eng.rules}
    tiers = {r.name: r.tier for r in eng.rules}
    every = [(int(a.step), a.rule) for a in eng.fired]
    if live_alerts is not None and len(live_alerts):        # every tier's first alert from the live table too
        every = sorted((int(s), str(r)) for s, r in zip(live_alerts["step"], live_alerts["rule"]))
    warns = lambda rule: tiers.get(rule) == WARNING_TIER     # noqa: E731  (early warnings: the collapse tier)
    replayed = [(int(a.step), a.rule) for a in eng.fired if warns(a.rule)]
    live: Optional[list[tuple[int, str]]]
    if live_alerts is not None and len(live_alerts):
        live = sorted((int(s), str(r)) for s, r in zip(live_alerts["step"], live_alerts["rule"]) if warns(str(r)))
    else:
        live = [] if live_alerts is not None else None
    warn = live if live is not None else replayed
    first = warn[0] if warn else None
    lead = (destab - first[0]) if (destab is not None and first is not None) else None
    m = _trailing(reward)
    dm = _trailing(delta)
    rho = d["window/rho_asym"].to_numpy(float)
    wnoise = d.get("window/delta_abs_mean", pd.Series(np.inf, index=d.index)).to_numpy(float) < NOISE_FLOOR_NATS
    rho_ok = rho[(np.arange(n) >= window - 1) & ~wnoise & np.isfinite(rho)]
    follow = d["follow_corr"].to_numpy(float) if "follow_corr" in d else np.array([np.nan])
    noise = max(eng.noise_steps.values(), key=len, default=[])
    ref_row = min(r0 + SMOOTH_STEPS - 1, n - 1)

    def fin(x):
        return float(x) if np.isfinite(x) else math.nan

    return {
        "steps": n, "destabilised_at": destab, "blowup_delta_at": blow_d, "blowup_k3_at": blow_k,
        "reward_first": fin(m[min(SMOOTH_STEPS - 1, n - 1)]), "reward_peak": fin(np.nanmax(m)) if np.isfinite(m).any()
        else math.nan, "reward_min": fin(np.nanmin(m)) if np.isfinite(m).any() else math.nan,
        "reward_last": fin(m[-1]),
        "delta_abs_ref": fin(dm[ref_row]), "delta_abs_max10": fin(np.nanmax(dm)) if np.isfinite(dm).any()
        else math.nan, "delta_abs_last": fin(dm[-1]),
        "rho_window_min": fin(rho_ok.min()) if rho_ok.size else math.nan,
        "rho_window_max": fin(rho_ok.max()) if rho_ok.size else math.nan,
        "grad_norm_max": fin(np.nanmax(d["grad_norm"].to_numpy(float))) if "grad_norm" in d else math.nan,
        "follow": fin(np.nanmean(follow)) if np.isfinite(follow).any() else math.nan,
        "direction_onset_up": on["direction_up"], "direction_onset_2s": on["direction_2s"],
        "small_gap_onset": on["small_gap"], "k3_onset": on["k3"],
        "first_alert": first[0] if first else None, "first_alert_rule": first[1] if first else None,
        "lead_steps": lead, "lead_frac": (lead / n) if lead is not None else None, "n_alerts": len(warn),
        **{f"first_{g}_alert": next((st for st, r in every if groups.get(r) == g), None) for g in WARNING_GROUPS},
        **{f"first_{t}_alert": next((st for st, r in every if tiers.get(r) == t), None) for t in TIERS},
        **{f"first_{t}_rule": next((r for st, r in every if tiers.get(r) == t), None) for t in TIERS},
        "collapse_lead_steps": (destab - next(st for st, r in every if tiers.get(r) == "collapse"))
        if destab is not None and any(tiers.get(r) == "collapse" for _, r in every) else None,
        "reward_auc": fin(np.nanmean(m)) if np.isfinite(m).any() else math.nan,
        "alerts": warn, "alerts_source": "live" if live is not None else "replay",
        "live_equals_replay": (live == sorted(replayed)) if live is not None else None,   # the same (step, rule) set
        "noise_level_steps": len(noise),
    }


# ------------------------------------------------------------------------------ running
def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)   # a log file gets the whole table


class ProgressPayload(TypedDict):
    """One step of a run as the progress display gets it (:func:`_progress_payload`)."""

    step: int
    reward: float
    delta: float


class RunResult(NamedTuple):
    """One finished (arm, seed) run (:func:`_run_one`): its key, per-step frame and the frame's attrs."""

    key: tuple[str, int]
    frame: pd.DataFrame
    attrs: dict[str, Any]


def _progress_payload(m: dict) -> ProgressPayload:
    return {"step": int(m["step"]), "reward": float(m.get("reward", math.nan)),
            "delta": float(m.get("delta_abs_mean", math.nan))}


def _run_one(job: tuple[tuple[str, int], dict[str, Any], str, Any, dict[str, bool]]) -> RunResult:
    """Worker: run one (arm, seed) and return (key, per-step frame, attrs).

    ``job``: ``(key, DemoConfig fields, run directory, progress queue or None, resume/force options)``."""
    key, cfg_dict, out_dir, queue, existing = job
    import torch

    from .grpo import run_demo

    torch.set_num_threads(cfg_dict.get("threads", 1))
    cfg = DemoConfig(**cfg_dict)
    cb = (lambda m: queue.put((key, _progress_payload(m)))) if queue is not None else None
    df = run_demo(cfg, out_dir, quiet=True, on_step=cb, **existing)
    return RunResult(key, df, dict(df.attrs))


class _ArmProgress:
    """Progress per run: a rich bar per run on a terminal; plain lines (every tenth of the steps and at
    the end of each run) when the output is not a terminal, so a log file shows them as they happen."""

    def __init__(self, console, plan: dict, steps: int, enabled: bool = True):
        self.console, self.steps, self.enabled = console, steps, enabled
        self.live = enabled and console.is_terminal
        self.every = max(1, steps // 10)
        self.t0 = time.perf_counter()
        self.rewards: dict = {k: [] for k in plan}
        self.bar = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
            self.tasks = {k: self.bar.add_task(f"{k[0]} s{k[1]}", total=steps, info="") for k in plan}

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, key, p: ProgressPayload) -> None:
        if not self.enabled:
            return
        r = self.rewards[key]
        r.append(p["reward"])
        trail = float(np.mean(r[-SMOOTH_STEPS:]))
        info = f"reward {trail:.2f}  |δ| {p['delta']:.3g}"
        done = p["step"] + 1
        if self.bar is not None:
            self.bar.update(self.tasks[key], completed=done, info=info)
        elif done % self.every == 0 or done == self.steps:
            self.console.print(f"{key[0]} s{key[1]}: step {done}/{self.steps}, trailing-{SMOOTH_STEPS} {info} nats, "
                               f"{time.perf_counter() - self.t0:.0f} s", highlight=False, soft_wrap=True)


def plan_study(base: DemoConfig, out, arms: Sequence[str],
               seeds: Sequence[int]) -> dict[tuple[str, int], tuple[DemoConfig, Path]]:
    """``{(arm, seed): (DemoConfig, run directory)}`` of a study (arms' overrides applied to ``base``).

    Raises:
        ValueError: an unknown arm, no arm or no seed.
    """
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"study: arms must be a non-empty subset of {tuple(ARMS)}, got {list(arms)}")
    if not seeds:
        raise ValueError("study: give at least one seed")
    out = Path(out)
    return {(arm, int(seed)): (arm_config(arm, base, seed), out / "runs" / f"{arm}-s{seed}")
            for arm in arms for seed in seeds}


def run_study(base: DemoConfig, out, arms: Sequence[str] = DEFAULT_ARMS, seeds: Sequence[int] = DEFAULT_SEEDS,
              jobs: int = 1, console=None, progress: bool = True, resume: bool = False,
              force: bool = False) -> pd.DataFrame:
    """Run every (arm, seed), judge each run and write the comparison report into ``out``.

    Args:
        base: the shared configuration (its ``correction`` / ``sampler_recipe`` / ``seed`` and, for
            ``fp32``, ``sampler_lag`` are set per arm and seed from :data:`ARMS`).
        out: output directory (created).
        arms: names from :data:`ARMS`; seeds: integers.
        jobs: runs in parallel (separate processes; 1 = in this process).
        resume / force: what to do with a run already in ``out/runs/<arm>-s<seed>``
            (docs/reliability.md#one-run-per-directory): continue it as a new attempt, or move it aside.
        console: ``rich.console.Console`` for progress and the table (default: a new one).
        progress: show progress (one bar per run on a terminal, plain lines otherwise).

    Returns:
        The summary table, one row per run (also ``out/summary.csv``).

    Raises:
        ValueError: an unknown arm, no arm or no seed, or ``jobs < 1``.
        triage_monitor.records.OutputError: a run directory holds another run, is locked by a live process,
            or cannot be written (raised before that run's first step).
    """
    if jobs < 1:
        raise ValueError(f"study: jobs must be >= 1, got {jobs}")
    plan = plan_study(base, out, arms, seeds)
    console = console or _console()
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    console.print(f"[bold]triage-monitor study[/]: {len(arms)} arm(s) × {len(seeds)} seed(s), {base.steps} steps "
                  f"each, {min(jobs, len(plan))} at a time → {out}", highlight=False)
    console.print(f"mismatch: {mechanism_sentence(base)}", highlight=False, soft_wrap=True)
    frames, attrs = {}, {}
    existing = {"resume": resume, "force": force}
    again = [str(p) for _, p in plan.values() if (p / MANIFEST).is_file()] if not (resume or force) else []
    if again:        # never a silent second attempt: say it, and how to start afresh
        one = len(again) == 1
        console.print(f"{len(again)} run director{'y' if one else 'ies'} of this study already hold{'s' if one else ''} a run "
                      f"({', '.join(again)}): a run of this configuration continues there as a new attempt (its "
                      "steps replace the older ones); --force starts afresh (the old run is moved aside)",
                      highlight=False, soft_wrap=True, markup=False)
    with _ArmProgress(console, plan, base.steps, enabled=progress) as bar:
        if jobs == 1:
            for key, (cfg, path) in plan.items():
                _, frames[key], attrs[key] = _run_inline(key, cfg, path, bar.update, existing)
        else:
            _run_parallel(plan, jobs, frames, attrs, bar.update, existing)
    seconds = time.perf_counter() - t0
    summary = summarize(frames, attrs, base.window, out)
    write_outputs(out, base, frames, summary, seconds)
    print_summary(console, summary, out, seconds, base, frames)
    return summary


def _run_inline(key, cfg: DemoConfig, path: Path, tick: Callable, existing: dict) -> RunResult:
    from .grpo import run_demo

    df = run_demo(cfg, path, quiet=True, on_step=lambda m: tick(key, _progress_payload(m)), **existing)
    return RunResult(key, df, dict(df.attrs))


def _run_parallel(plan: dict, jobs: int, frames: dict, attrs: dict, tick: Callable, existing: dict) -> None:
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from ..offline.engines import ignore_sigint, stop_pool

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                                       initializer=ignore_sigint) as pool, stop_pool(pool):
        q = manager.Queue()
        pending = {pool.submit(_run_one, (key, asdict(cfg), str(path), q, existing)) for key, (cfg, path) in plan.items()}

        def drain():
            while True:
                try:
                    key, payload = q.get_nowait()
                except queue_mod.Empty:
                    return
                tick(key, payload)

        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            drain()
            for fut in done:
                key, df, at = fut.result()
                frames[key], attrs[key] = df, at
        drain()


def _live_alerts(run_dir: Path) -> Optional[pd.DataFrame]:
    """The run directory's live alerts table (``step``, ``rule``), or None when the run has no directory."""
    from ..offline.analysis import open_run

    if not (Path(run_dir) / "run.json").exists():
        return None
    tab = open_run(run_dir).alerts()
    if "rule" not in tab:
        return pd.DataFrame({"step": [], "rule": []})
    return tab


def rejudge(base: DemoConfig, out, console=None) -> pd.DataFrame:
    """Judge the run directories of a finished study in ``out/runs`` again and rewrite its outputs.

    For new definitions without re-running: each ``<arm>-s<seed>`` directory's per-step table is read
    back (``open_run(run_dir).steps()``); when ``base.window`` differs from the run's monitor window,
    the metrics are recomputed from the token records with ``base.window``
    (:func:`triage_monitor.offline.analysis.recompute`) and the training-loop columns (reward, controller
    stats, gradient norm) are kept; alerts are then replayed (the live table belongs to the old window).
    ``base`` also supplies the mechanism text.

    Raises:
        ValueError: ``out/runs`` holds no ``<arm>-s<seed>`` run directory.
    """
    from ..offline.analysis import open_run, recompute

    console = console or _console()
    out = Path(out)
    frames = {}
    same_window = True
    for d in sorted((out / "runs").glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if not (arm in ARMS and seed.isdigit() and (d / MANIFEST).is_file()):
            continue
        run = open_run(d)
        live = run.steps()
        if run.config.window != base.window:
            same_window = False
            rec = recompute(run, window=base.window)
            live = rec.merge(live[["step", *[c for c in live.columns if c not in rec.columns]]], on="step",
                             how="left")
        frames[(arm, int(seed))] = live
    if not frames:
        raise ValueError(f"study: no <arm>-s<seed> run directory under {out / 'runs'}")
    summary = summarize(frames, {}, base.window, out if same_window else None)
    write_outputs(out, base, frames, summary, math.nan, live=same_window)
    print_summary(console, summary, out, math.nan, base, frames)
    return summary


def summarize(frames: dict, attrs: dict, window: int, out: Optional[Path] = None) -> pd.DataFrame:
    """One row per (arm, seed): :func:`judge_run` (live alerts from ``out/runs/<arm>-s<seed>`` when ``out``
    is given) plus wall time; sorted by arm order then seed."""
    rows = []
    for (arm, seed), df in frames.items():
        live = _live_alerts(out / "runs" / f"{arm}-s{seed}") if out is not None else None
        j = judge_run(df, window, live_alerts=live)
        j.pop("alerts")
        rows.append({"arm": arm, "seed": seed, **j, "seconds": attrs.get((arm, seed), {}).get("seconds_total")})
    order = {a: i for i, a in enumerate(ARMS)}
    table = pd.DataFrame(rows)
    return table.sort_values(["arm", "seed"], key=lambda c: c.map(order) if c.name == "arm" else c).reset_index(
        drop=True)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p-value of Fisher's exact test of the 2×2 table ``[[a, b], [c, d]]`` (e.g. destabilised / held of
    two arms): the sum of the hypergeometric probabilities of every table with the same margins that is no more
    likely than the observed one (a relative tolerance of 1e-7, as R and SciPy use)."""
    n1, n2, k = a + b, c + d, a + c
    total = math.comb(n1 + n2, k)

    def prob(x):
        return math.comb(n1, x) * math.comb(n2, k - x) / total

    p0 = prob(a)
    lo, hi = max(0, k - n2), min(k, n1)
    return min(1.0, sum(p for p in (prob(x) for x in range(lo, hi + 1)) if p <= p0 * (1 + 1e-7)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (same order as given)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


class Estimate(NamedTuple):
    """A statistic with its 95 % bootstrap interval (:func:`bootstrap_ci`)."""

    value: float
    low: float
    high: float


def bootstrap_ci(values, stat: Callable = np.median, n: int = 2000, seed: int = 0) -> Estimate:
    """``Estimate(statistic, low, high)`` (a tuple): ``stat`` of ``values`` (``(k,)`` floats, NaN dropped) with a 95 % percentile
    bootstrap interval over ``n`` resamples (NaN for fewer than 2 values)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size < 2:
        return Estimate(float(stat(v)) if v.size else math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    boots = [stat(v[rng.integers(0, v.size, v.size)]) for _ in range(n)]
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return Estimate(float(stat(v)), float(lo), float(hi))


def comparisons(summary: pd.DataFrame) -> pd.DataFrame:
    """The study's pre-stated comparisons (:data:`COMPARISONS`) present in ``summary``: destabilised counts, Fisher's
    exact p-value, the Holm-adjusted p over the comparisons made, and the difference of the mean final trailing
    reward (first arm − second) with a 95 % bootstrap interval."""
    rows = []
    for a, b in COMPARISONS:
        ga, gb = summary[summary["arm"] == a], summary[summary["arm"] == b]
        if not len(ga) or not len(gb):
            continue
        da, db = int(ga["destabilised_at"].notna().sum()), int(gb["destabilised_at"].notna().sum())
        p = fisher_exact(da, len(ga) - da, db, len(gb) - db)
        la, lb = ga["reward_last"].to_numpy(float), gb["reward_last"].to_numpy(float)
        rng = np.random.default_rng(0)
        diffs = [np.nanmean(rng.choice(la, la.size)) - np.nanmean(rng.choice(lb, lb.size)) for _ in range(2000)]
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        rows.append({"a": a, "b": b, "destabilised_a": da, "seeds_a": len(ga), "destabilised_b": db,
                     "seeds_b": len(gb), "p_fisher": p, "reward_last_diff": float(np.nanmean(la) - np.nanmean(lb)),
                     "reward_last_diff_low": float(lo), "reward_last_diff_high": float(hi)})
    table = pd.DataFrame(rows)
    if len(table):
        table["p_holm"] = holm(list(table["p_fisher"]))
        table.attrs["comparisons"] = len(table)
    return table


def arm_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per arm: seeds, destabilised / blown-up counts, steps to destabilise (median, min–max),
    trailing reward minimum (median, min–max), early warnings (runs warned, median lead, runs with a lead of
    at least :data:`LEAD_GOAL` of the horizon, alerts on runs that did not destabilise) and mean follow."""
    out = []
    for arm, g in summary.groupby("arm", sort=False):
        dst = g["destabilised_at"].dropna()
        bl = g[["blowup_delta_at", "blowup_k3_at"]].min(axis=1, skipna=True).dropna()
        lead = g["lead_steps"].dropna()
        healthy = g[g["destabilised_at"].isna()]
        out.append({
            "arm": arm, "seeds": len(g), "destabilised": int(dst.size),
            "steps_to_destabilise_median": float(dst.median()) if dst.size else math.nan,
            "steps_to_destabilise_range": f"{int(dst.min())}–{int(dst.max())}" if dst.size else "—",
            "blown_up": int(bl.size),
            "reward_min_median": float(g["reward_min"].median()),
            "reward_min_range": f"{g['reward_min'].min():.2f}–{g['reward_min'].max():.2f}",
            "reward_last_median": float(g["reward_last"].median()),
            **{f"{k}_{part}": v for k in ("reward_auc", "reward_last", "reward_min") if k in g
               for part, v in zip(("mean", "low", "high"), bootstrap_ci(g[k], np.mean))},
            "grad_norm_max_median": float(g["grad_norm_max"].median()),
            "follow_mean": float(g["follow"].mean()),
            "warned": int(g["first_alert"].notna().sum()),
            "warned_before_destabilising": int((g["lead_steps"] > 0).sum()),
            "lead_median": float(lead.median()) if lead.size else math.nan,
            "lead_goal_met": int((g["lead_frac"] >= LEAD_GOAL).sum()),
            "healthy_runs": len(healthy), "alerts_on_healthy_runs": int(healthy["n_alerts"].sum()),
        })
    return pd.DataFrame(out)


# ------------------------------------------------------------------------------ report
def mechanism_sentence(base: DemoConfig) -> str:
    """The plain sentence on the mismatch of the study's failing arm (its :meth:`DemoConfig.mechanism`)."""
    return arm_config(FAILING_ARM, base).mechanism()


def _ratio(n: int, d: int) -> str:
    return f"{n}/{d}"


def verdict(summary: pd.DataFrame, base: Optional[DemoConfig] = None) -> list[str]:
    """Plain-language findings (one sentence each): per arm, the claim, the corrections and the alerts."""
    arms = arm_table(summary)
    by = {r["arm"]: r for _, r in arms.iterrows()}
    lines = []
    for _, r in arms.iterrows():
        label = arm_label(r["arm"], base) if base is not None else r["arm"]
        when = ""
        if r["destabilised"]:
            when = f" (steps {r['steps_to_destabilise_range']}, median {r['steps_to_destabilise_median']:.0f})"
        lines.append(f"{r['arm']} — {label}: destabilised on {_ratio(r['destabilised'], r['seeds'])} seed(s){when}; "
                     f"trailing-{SMOOTH_STEPS} reward minimum median {r['reward_min_median']:.2f} "
                     f"(range {r['reward_min_range']}); mismatch blow-up on {_ratio(r['blown_up'], r['seeds'])}; "
                     f"default rules warned on {_ratio(r['warned'], r['seeds'])}, before destabilising on "
                     f"{r['warned_before_destabilising']}; follow correlation {r['follow_mean']:.2f}.")
    f, c = by.get(FAILING_ARM), by.get(CONTROL_ARM)
    if f is not None and c is not None:
        holds = f["destabilised"] * 2 > f["seeds"] and c["destabilised"] == 0
        word = ("HOLDS" if holds else "DOES NOT HOLD") if min(f["seeds"], c["seeds"]) >= MIN_SEEDS else \
            f"not judged with fewer than {MIN_SEEDS} seeds per arm (the full study: docs/study.md)"
        lines.append(f"Claim ({FAILING_ARM} destabilises on most seeds, the on-policy control {CONTROL_ARM} on none): "
                     f"{word} — {FAILING_ARM} {_ratio(f['destabilised'], f['seeds'])}, "
                     f"{CONTROL_ARM} {_ratio(c['destabilised'], c['seeds'])}.")
        if c["alerts_on_healthy_runs"] or c["warned"]:
            lines.append(f"The default rules warned on the on-policy control ({c['warned']} run(s)).")
        else:
            lines.append("The default rules never warned on the on-policy control.")
    if f is not None:
        for arm in ("tis", "triage"):
            r = by.get(arm)
            if r is None:
                continue
            fewer = r["destabilised"] < f["destabilised"] if r["seeds"] == f["seeds"] else None
            word = ("fewer" if fewer else "no fewer") if fewer is not None else "a different number of"
            lines.append(f"{arm.upper()} vs {FAILING_ARM}: {word} destabilised seeds "
                         f"({_ratio(r['destabilised'], r['seeds'])} vs {_ratio(f['destabilised'], f['seeds'])}); "
                         f"reward minimum median {r['reward_min_median']:.2f} (range {r['reward_min_range']}) vs "
                         f"{f['reward_min_median']:.2f} ({f['reward_min_range']}); last {r['reward_last_median']:.2f} "
                         f"vs {f['reward_last_median']:.2f}.")
        n = int(summary.loc[summary["arm"] == FAILING_ARM, "steps"].max())
        lines.append(f"Alerts on {FAILING_ARM}: a lead of at least {LEAD_GOAL:.0%} of the horizon ({LEAD_GOAL * n:.0f} "
                     f"steps) on {_ratio(f['lead_goal_met'], f['destabilised'])} destabilised run(s); median lead "
                     f"{f['lead_median']:.0f} steps." if f["destabilised"] else
                     f"Alerts on {FAILING_ARM}: no run destabilised, so no lead to measure.")
    if f is not None and f["destabilised"]:
        g = summary[(summary["arm"] == FAILING_ARM) & summary["destabilised_at"].notna()]
        early = int((g["first_direction_alert"] < g["destabilised_at"]).sum()) if "first_direction_alert" in g else 0
        lines.append(f"Direction rules alone (ρ_asym) on {FAILING_ARM}: before destabilising on {early}/{len(g)} "
                     f"destabilised run(s).")
    comp = comparisons(summary)
    if len(comp):
        parts = [f"{r['a']} {r['destabilised_a']}/{r['seeds_a']} vs {r['b']} {r['destabilised_b']}/{r['seeds_b']}: "
                 f"p = {r['p_fisher']:.3g} (Holm {r['p_holm']:.3g}); final reward {r['reward_last_diff']:+.3f} "
                 f"[{r['reward_last_diff_low']:+.3f}, {r['reward_last_diff_high']:+.3f}]" for _, r in comp.iterrows()]
        lines.append(f"Exact tests of the destabilised counts (Fisher, two-sided; {len(comp)} comparison(s), Holm-"
                     f"corrected; the corrections are judged against {BASELINE_ARM.upper()}, the fair baseline of an "
                     f"asynchronous trainer): " + "; ".join(parts) + ".")
    learn = []
    for arm, g in summary.groupby("arm", sort=False):
        up = int((g["reward_last"] > g["reward_first"]).sum())
        learn.append(f"{arm} {up}/{len(g)}")
    lines.append("Runs that end above their starting trailing reward (does the arm learn?): " + ", ".join(learn) + ".")
    if "first_mismatch_alert" in summary:
        for _, r in summary.iterrows() if len(summary) <= 4 else []:
            mm, cl = r.get("first_mismatch_alert"), r.get("first_collapse_alert")
            said = (f"{r['arm']} s{r['seed']}: mismatch tier first at step {mm:.0f} ({r['first_mismatch_rule']})"
                    if mm is not None and not pd.isna(mm) else f"{r['arm']} s{r['seed']}: no mismatch-tier alert")
            said += (f"; collapse tier first at step {cl:.0f} ({r['first_collapse_rule']})" if cl is not None
                     and not pd.isna(cl) else "; no collapse-tier alert")
            dst = r["destabilised_at"]
            said += (f"; destabilised at step {dst:.0f}" if dst is not None and not pd.isna(dst) else "; held") + "."
            lines.append(said)
    for name, sel in (("the on-policy control", summary["arm"] == CONTROL_ARM),
                      ("the other arms", summary["arm"] != CONTROL_ARM)):
        held = summary[sel & summary["destabilised_at"].isna()]
        if len(held):
            n_al = int(held["n_alerts"].sum())
            lines.append(f"False alerts on {name}: {n_al} early warning(s) on {len(held)} run(s) that did not "
                         f"destabilise ({n_al / len(held):.1f} per run; runs with any: {int((held['n_alerts'] > 0).sum())}).")
    return lines


class RunPair(NamedTuple):
    """The (arm, seed) of a failing run and of a held run (:func:`pick_pair`); None where there is none."""

    failing: Optional[tuple[str, int]]
    held: Optional[tuple[str, int]]


def pick_pair(summary: pd.DataFrame) -> RunPair:
    """``RunPair((arm, seed) of a failing run or None, (arm, seed) of a held run or None)`` (a tuple) for the side-by-side
    view: the first destabilised run of the failing arm (else of any arm) and the control of the same seed
    (else the first run that held)."""
    bad = summary[summary["destabilised_at"].notna()]
    good = summary[summary["destabilised_at"].isna()]
    pref = bad[bad["arm"] == FAILING_ARM]
    fail = pref.iloc[0] if len(pref) else (bad.iloc[0] if len(bad) else None)
    held = None
    if len(good):
        ctl = good[good["arm"] == CONTROL_ARM]
        if fail is not None:
            same = ctl[ctl["seed"] == fail["seed"]]
            ctl = same if len(same) else ctl
        held = ctl.iloc[0] if len(ctl) else good.iloc[0]
    key = lambda r: None if r is None else (r["arm"], int(r["seed"]))
    return RunPair(key(fail), key(held))


#: The study's baseline for the step-time comparison: the full-precision on-policy sampler.
CYCLE_BASELINE = "fp32"


def _arm_frames(frames: dict) -> dict[str, pd.DataFrame]:
    """``{arm: every seed's step rows, concatenated}`` in :data:`ARMS` order."""
    arms = list(dict.fromkeys(a for a in ARMS if any(k[0] == a for k in frames)))
    return {a: pd.concat([df for (arm, _), df in sorted(frames.items()) if arm == a], ignore_index=True) for a in arms}


def cycle_by_arm(frames: dict, k: float = DEFAULT_K) -> dict[str, CycleSummary]:
    """``{arm: CycleSummary}`` of the study's own phase timings, every seed of the arm pooled
    (docs/metrics.md#step-time-and-the-full-cycle)."""
    return {a: cycle_summary(df, k) for a, df in _arm_frames(frames).items()}


def cycle_comparisons(frames: dict, k: float = DEFAULT_K) -> dict[str, CycleComparison]:
    """``{arm: CycleComparison}`` of every arm against :data:`CYCLE_BASELINE` (when both are in the study and
    timed)."""
    arms = _arm_frames(frames)
    base = arms.get(CYCLE_BASELINE)
    if base is None or not cycle_summary(base, k).steps:
        return {}
    return {a: compare_cycles(base, df, k) for a, df in arms.items() if a != CYCLE_BASELINE
            and cycle_summary(df, k).steps}


def cycle_lines(base: DemoConfig, frames: dict, k: float = DEFAULT_K) -> list[str]:
    """The study's step time in words: per arm the generation share and the projection, then each arm against the
    fp32 baseline (measured per-phase speedup), labelled with the device the figures were measured on."""
    out = []
    where = figures(base.device)
    for arm, s in cycle_by_arm(frames, k).items():
        if not s.steps:
            continue
        rest = ", ".join(f"{LABELS.get(p, p)} {100 * v:.0f} %" for p, v in s.not_sped_up[:3])
        out.append(f"{arm}: {s.mean['step'] * 1000:.0f} ms a step, generation {s.mean.get('generation', 0) * 1000:.0f} ms "
                   f"(g = {s.g:.2f}): a generator {k:g}× faster would give {s.projected:.2f}× on the full cycle; "
                   f"not sped up: {rest}")
    for arm, c in cycle_comparisons(frames, k).items():
        t = c.table.set_index("phase")
        q = t["other_s"].get("quantize", math.nan)
        said = f"{arm} ({arm_label(arm, base)}) vs {CYCLE_BASELINE} ({arm_label(CYCLE_BASELINE, base)}), same job: "
        said += f"generation {c.generation:.2f}×, whole cycle {c.cycle:.2f}× measured"
        if math.isfinite(q):
            said += f"; the sampler's weight quantisation {q * 1000:.2g} ms a step"
        out.append(said)
    if out:
        out.insert(0, f"step time ({where}, measured on this machine; NVFP4 is emulated on a CPU, so its generation is "
                      f"slower than fp32 here, where native kernels on a GPU are 2.08–2.35× faster: "
                      "docs/metrics.md#step-time-and-the-full-cycle):")
    return out


def report_html(base: DemoConfig, frames: dict, summary: pd.DataFrame, seconds: float,
                out: Optional[Path] = None) -> str:
    """The self-contained comparison report (plotly.js inline): one column of charts per arm, every seed.

    With ``out`` the alerts shown are the live ones of ``out/runs/<arm>-s<seed>``; without, a replay."""
    import html

    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ..metrics import names
    from ..offline.views import add_rho_asym_guides

    panels = [("reward", f"reward (trailing {SMOOTH_STEPS})", True),
              *((c, names.label(c, unit=True), False)          # the metrics under their declared labels
                for c in ("window/rho_asym", "window/delta_abs_mean", "window/k3_kl", "window/small_gap_share")),
              ("gate_downweighted_frac", "Gate down-weighted fraction", False), ("grad_norm", "gradient norm", False),
              ("follow_corr", "sampler-follow correlation", False)]
    arms = list(dict.fromkeys(a for a in ARMS if any(k[0] == a for k in frames)))
    fig = make_subplots(rows=len(panels), cols=len(arms), shared_xaxes=True, shared_yaxes="rows",
                        vertical_spacing=0.03, horizontal_spacing=0.015,
                        column_titles=[f"{a}: {arm_label(a, base)}" for a in arms],
                        row_titles=[p[1] for p in panels])
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    judged = {}
    for (arm, seed), df in sorted(frames.items(), key=lambda kv: (arms.index(kv[0][0]), kv[0][1])):
        d = df.sort_values("step")
        c = arms.index(arm) + 1
        name = f"{arm} s{seed}"
        j = judge_run(d, base.window, live_alerts=_live_alerts(out / "runs" / f"{arm}-s{seed}") if out else None)
        judged[(arm, seed)] = j
        for i, (col, _, smooth) in enumerate(panels, start=1):
            if col not in d:
                continue
            y = _trailing(d[col]) if smooth else d[col]
            mode = "markers+lines" if col == "follow_corr" else "lines"
            x, yy = (d["step"][d[col].notna()], d[col].dropna()) if col == "follow_corr" else (d["step"], y)
            fig.add_trace(go.Scatter(x=x, y=yy, mode=mode, name=name, legendgroup=name, showlegend=i == 1,
                                     line=dict(color=ARM_COLORS.get(arm), width=1.3, dash=dashes[seed % len(dashes)]),
                                     marker=dict(size=4)), row=i, col=c)
        if j["destabilised_at"] is not None:
            fig.add_vline(x=j["destabilised_at"], line=dict(color=ARM_COLORS.get(arm), dash="dot", width=1), col=c,
                          row="all")
    for (arm, seed), j in judged.items():
        if j["alerts"]:
            d = frames[(arm, seed)].sort_values("step").set_index("step")
            st = [s for s, _ in j["alerts"]]
            fig.add_trace(go.Scatter(x=st, y=d["window/rho_asym"].reindex(st), mode="markers", name=f"{arm} s{seed} alerts",
                                     legendgroup=f"{arm} s{seed}", showlegend=False,
                                     marker=dict(symbol="triangle-down", size=9, color=ARM_COLORS.get(arm)),
                                     text=[r for _, r in j["alerts"]], hovertemplate="%{text} @ %{x}"),
                          row=2, col=arms.index(arm) + 1)
    for i, arm in enumerate(arms, start=1):
        add_rho_asym_guides(fig, row=2, col=i)
    shown = set()
    for tr in fig.data:   # one legend entry per guide (the helper shows them only on row 1)
        meta = tr.meta if isinstance(tr.meta, dict) else None
        if meta and "guide" in meta and meta["guide"] not in shown:
            tr.showlegend = True
            shown.add(meta["guide"])
    fig.update_layout(height=210 * len(panels), template="plotly_white", margin=dict(l=60, r=120, t=70, b=40),
                      legend=dict(orientation="h", y=1.01, x=0, yanchor="bottom", font=dict(size=10)))
    fig.update_annotations(font_size=11)
    for c in range(1, len(arms) + 1):
        fig.update_yaxes(type="log", row=3, col=c)
        fig.update_yaxes(type="log", row=4, col=c)
    chart = fig.to_html(full_html=False, include_plotlyjs="inline", default_width="100%",
                        config={"displaylogo": False, "responsive": True})

    def table(frame: pd.DataFrame) -> str:
        shown = frame.astype(object)
        return shown.where(shown.notna(), "—").to_html(index=False, border=0, float_format=lambda x: f"{x:.3g}")

    cols = ["arm", "seed", "destabilised_at", "blowup_delta_at", "blowup_k3_at", "reward_first", "reward_min",
            "reward_last", "delta_abs_ref", "delta_abs_max10", "delta_abs_last", "rho_window_min", "rho_window_max",
            "grad_norm_max", "follow", "direction_onset_up", "direction_onset_2s", "small_gap_onset", "k3_onset",
            "first_alert", "first_alert_rule", "lead_steps", "lead_frac", "first_direction_alert",
            "first_localization_alert", "first_magnitude_alert", "n_alerts", "alerts_source",
            "noise_level_steps", "seconds"]
    from ..offline.views import cycle_bars_figure

    by_arm = cycle_by_arm(frames)
    bars = cycle_bars_figure({a: v for a, v in by_arm.items()}, "Mean step time by phase, per arm", base.device)
    cycle_chart = bars.to_html(full_html=False, include_plotlyjs=False, default_width="100%",
                               config={"displaylogo": False, "responsive": True}) if bars is not None else ""
    cycle_rows = []
    for arm, cs in by_arm.items():
        if not cs.steps:
            continue
        cycle_rows.append({"arm": arm, "steps": cs.steps, "step (ms)": 1000 * cs.mean["step"],
                           **{f"{LABELS[p]} (ms)": 1000 * cs.mean[p] for p in PHASES if p in cs.mean},
                           "untimed (ms)": 1000 * cs.mean.get("untimed", math.nan), "g": cs.g,
                           f"projected at k = {DEFAULT_K:g}": cs.projected})
    cycle_table = table(pd.DataFrame(cycle_rows)) if cycle_rows else ""
    compare_rows = []
    for arm, cmp in cycle_comparisons(frames).items():
        for _, r in cmp.table.iterrows():
            compare_rows.append({"arm": arm, "phase": r["label"], f"{CYCLE_BASELINE} (ms)": 1000 * r["base_s"],
                                 f"{arm} (ms)": 1000 * r["other_s"], "measured speedup": r["speedup"]})
    compare_table = table(pd.DataFrame(compare_rows)) if compare_rows else ""
    cycle_said = "".join(f"<li>{html.escape(x)}</li>" for x in cycle_lines(base, frames))
    findings = "".join(f"<li>{html.escape(s)}</li>" for s in verdict(summary, base))
    runs_alerts = "".join(f"<li><b>{html.escape(f'{a} s{s}')}</b>: "
                          + (html.escape(", ".join(f"{r} @ {st}" for st, r in j["alerts"])) or "none") + "</li>"
                          for (a, s), j in judged.items())
    fail, held = pick_pair(summary)
    pair = ""
    if fail and held:
        where = Path(out) if out is not None else Path(".")     # as printed on the console, from where it ran
        side = command_line("dashboard", where / "runs" / f"{fail[0]}-s{fail[1]}", where / "runs" / f"{held[0]}-s{held[1]}")
        pair = (f"<p>Side by side: <b>{fail[0]} s{fail[1]}</b> (destabilised) and <b>{held[0]} s{held[1]}</b> "
                f"(held) — <code>{html.escape(side)}</code> in {html.escape(str(Path.cwd()))}.</p>")
    mech = html.escape(mechanism_sentence(base))
    took = f"{seconds:.0f} s wall time" if math.isfinite(seconds) else "judged again from the run directories"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>triage-monitor study</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;margin:0;background:#f9fafb;color:#111827}}
main{{max-width:1500px;margin:0 auto;padding:24px 32px 60px}} table{{border-collapse:collapse;font-size:12px;
background:white}} th,td{{border:1px solid #e5e7eb;padding:3px 6px;text-align:right}} th{{background:#f3f4f6}}
.note{{color:#4b5563;font-size:13px}} .mech{{background:#fef3c7;border:1px solid #f59e0b;padding:8px 12px}}</style>
</head><body><main>
<h1>triage-monitor study: a stale NVFP4 sampler, corrections and controls</h1>
<div class="note">generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {len(frames)} run(s),
{base.steps} steps each, {took}; docs/study.md describes the job and the definitions.</div>
<p class="mech"><b>Mismatch mechanism.</b> {mech}</p>
{pair}
<h2>Findings</h2><ul>{findings}</ul>
<h2>Per arm</h2>
<div style="overflow-x:auto">{table(arm_table(summary))}</div>
<h2>Per run: steps to destabilise, blow-up, onsets, alerts, diagnostics</h2>
<div class="note">Destabilised: the trailing {SMOOTH_STEPS}-step mean reward below {COLLAPSE_FRACTION:g} × its running
peak on {MIN_STAY} consecutive steps (the first of them; a dip that recovers counts). Blow-up: the trailing
{SMOOTH_STEPS}-step mean of the per-step mean |δ| (or k3 KL) above {BLOWUP_FACTOR:g} × its value over the first
{SMOOTH_STEPS} steps at full staleness (delta_abs_ref, nats), above the {NOISE_FLOOR_NATS:g}-nat noise floor.
Reward columns are trailing-{SMOOTH_STEPS} means (first = at step {SMOOTH_STEPS - 1}); rho_window_* is the range of
window ρ_asym from the first full window, noise-level steps left out; follow is the mean sampler-follow
correlation. Direction onset: first step above (one-sided, rising amplification: direction_onset_up) or outside
(two-sided: direction_onset_2s) median ± max(3 MAD, {RHO_BAND:.0%}) of window ρ_asym over the {REF_STEPS} reference
steps. First alert: the first {WARNING_TIER}-tier alert of the shipped default rules (docs/alerts.md#tiers);
lead = destabilisation − first alert (lead_frac: of the horizon; goal ≥ {LEAD_GOAL:.0%}).</div>
<div style="overflow-x:auto">{table(summary[cols])}</div>
<h2>Over steps</h2><div class="note">One column per arm, one dash style per seed; dotted vertical lines:
destabilisation; window ρ_asym panel: the published healthy band and the alert thresholds.</div>
{chart}
<h2>Early-warning alerts per run</h2><ul>{runs_alerts}</ul>
<h2>Step time and the full cycle ({html.escape(figures(base.device))})</h2>
<div class="note">Each run's own timers, seconds per step, every seed of an arm pooled: generation (the sampler),
the sampler's weight quantisation, the stale weights' copy (weight sync), rewards and advantages, the learner's
recompute, the update, the demo's diagnostics (other). Measured on this machine's {html.escape(base.device)}: NVFP4 is
emulated here (fake quantisation in float32), so its generation is slower than full precision, where native NVFP4
kernels on a GPU are 2.08–2.35× faster; g and the projection 1 / ((1 − g) + g / k) say what a faster generator would
buy at this job's phase shares (docs/metrics.md#step-time-and-the-full-cycle).</div>
<ul>{cycle_said}</ul>
{cycle_chart}
<div style="overflow-x:auto">{cycle_table}</div>
<h3>Against the full-precision sampler ({CYCLE_BASELINE})</h3>
<div style="overflow-x:auto">{compare_table}</div>
</main></body></html>
"""


def write_outputs(out: Path, base: DemoConfig, frames: dict, summary: pd.DataFrame, seconds: float,
                  live: bool = True) -> None:
    """Write ``summary.csv``, ``arms.csv``, ``trajectories.csv`` (per-step key columns of every run),
    ``study.json`` and ``study.html`` into ``out`` (``live``: the report lists the runs' live alerts)."""
    summary.to_csv(out / "summary.csv", index=False)
    arms = arm_table(summary)
    arms.to_csv(out / "arms.csv", index=False)
    keep = ["step", "reward", "delta_abs_mean", "window/delta_abs_mean", "rho_asym", "window/rho_asym", "k3_kl",
            "window/small_gap_share", "window/k3_kl", "delta_min", "sampler_nll", "gate_downweighted_frac",
            "repair_active_frac", "grad_norm", "follow_corr", "sampler_staleness"]
    pd.concat([df[[c for c in keep if c in df]].assign(arm=arm, seed=seed) for (arm, seed), df in frames.items()]
              ).to_csv(out / "trajectories.csv", index=False)
    meta = {"base_config": asdict(base), "arms": {a: ARMS[a] for a in dict.fromkeys(k[0] for k in frames)},
            "mechanism": mechanism_sentence(base),
            "destabilisation": {"smooth_steps": SMOOTH_STEPS, "collapse_fraction": COLLAPSE_FRACTION,
                                "min_stay": MIN_STAY},
            "blowup": {"factor": BLOWUP_FACTOR, "reference_steps": SMOOTH_STEPS},
            "lead_goal": LEAD_GOAL, "noise_floor_nats": NOISE_FLOOR_NATS, "seconds": seconds,
            "verdict": verdict(summary, base),
            "per_arm": json.loads(arms.to_json(orient="records")),
            "runs": json.loads(summary.to_json(orient="records"))}
    (out / "study.json").write_text(json.dumps(meta, indent=1, default=str))
    try:                                  # plotly is optional (the dashboard extra): the tables above are the study
        import plotly.graph_objects  # noqa: F401
    except Exception as exc:              # missing, or an install that does not import (one line, not a traceback)
        (out / "study.html").unlink(missing_ok=True)
        why = "plotly is not installed" if isinstance(exc, ModuleNotFoundError) else f"plotly does not import ({exc})"
        logging.getLogger(__name__).warning("study.html not written: %s (pip install plotly)", why)
        return
    (out / "study.html").write_text(report_html(base, frames, summary, seconds, out if live else None),
                                    encoding="utf-8")


def print_summary(console, summary: pd.DataFrame, out: Path, seconds: float, base: Optional[DemoConfig] = None,
                  frames: Optional[dict] = None) -> None:
    """The per-run table, the findings, the step time by phase (``frames``: the runs' step rows) and where to look
    next."""
    from rich.table import Table

    t = Table(title="steps to destabilise (— = held), blow-up, first alert")
    cols = ["arm", "seed", "destabilised_at", "blowup_delta_at", "reward_first", "reward_min", "reward_last",
            "delta_abs_max10", "rho_window_max", "grad_norm_max", "follow", "direction_onset_up", "first_alert",
            "first_alert_rule", "lead_steps"]
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for _, r in summary.iterrows():
        t.add_row(*[(f"{v:.3g}" if isinstance(v, float) else str(v)) if v is not None and not
                    (isinstance(v, float) and math.isnan(v)) else "—" for v in (r[c] for c in cols)])
    console.print(t)
    for line in verdict(summary, base):
        console.print(line, highlight=False, soft_wrap=True)
    if base is not None and frames:
        for line in cycle_lines(base, frames):
            console.print(line, highlight=False, soft_wrap=True)
    took = f"{seconds:.0f} s" if math.isfinite(seconds) else "judged again"
    page = out / "study.html"
    shown = f"[bold]{page}[/]" if page.exists() else "none (plotly is not installed)"
    console.print(f"study: {took}.  Report: {shown}  (tables: {out / 'summary.csv'}, "
                  f"{out / 'arms.csv'})", highlight=False, soft_wrap=True)
    fail, held = pick_pair(summary)
    if fail and held:
        side = command_line("dashboard", out / "runs" / f"{fail[0]}-s{fail[1]}", out / "runs" / f"{held[0]}-s{held[1]}")
        console.print(f"Failing: {fail[0]} s{fail[1]}; held: {held[0]} s{held[1]}.  Side by side: {side}",
                      highlight=False, soft_wrap=True, markup=False)
    else:
        first_seed = summary["seed"].iloc[0]
        dirs = [out / "runs" / f"{a}-s{first_seed}" for a in dict.fromkeys(summary["arm"])]
        console.print(f"Dashboard (seed {first_seed} of each arm): {command_line('dashboard', *dirs)}",
                      highlight=False, soft_wrap=True, markup=False)


class StudyConfig(NamedTuple):
    """What a study runs (:func:`study_config`): the base configuration, the arms and the seeds."""

    config: DemoConfig
    arms: tuple[str, ...]
    seeds: tuple[int, ...]


def study_config(preset: Optional[str] = None, quick: bool = False, **given) -> StudyConfig:
    """The base :class:`DemoConfig`, arms and seeds of a study: ``DemoConfig`` defaults, then the preset
    (:data:`PRESETS`), then ``given`` (explicit options win).

    Returns:
        ``StudyConfig(DemoConfig, arms, seeds)`` (a tuple).

    Raises:
        ValueError: an unknown preset, a field in ``given`` that arms set per run (:data:`PER_ARM_FIELDS`),
            or an invalid configuration value.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"study: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    bad = [k for k in given if k in PER_ARM_FIELDS]
    if bad:
        raise ValueError(f"study: {', '.join(bad)} are set per arm and seed (--arms, --seeds)")
    names = {f.name for f in fields(DemoConfig)}
    p = PRESETS[preset] if preset is not None else {}
    cfg = DemoConfig(**{**p.get("config", {}), **{k: v for k, v in given.items() if k in names}})
    arms = tuple(QUICK["arms"] if quick else p.get("arms", DEFAULT_ARMS))
    seeds = tuple(QUICK["seeds"] if quick else p.get("seeds", DEFAULT_SEEDS))
    return StudyConfig(cfg, arms, seeds)
