"""``triage-monitor study``: the demo job's arms × seeds, destabilisation, alert timing and one comparison report.

The study runs the demo GRPO job (:mod:`.grpo`) once per (arm, seed):

==========  =================================================================
``none``    NVFP4 sampler, fp32 learner, no correction (plain PPO)
``tis``     same numerics, TIS weights
``triage``  same numerics, TRIAGE (TIS + Gate + Repair, calibrated Gate)
``fp32``    control: the same job with a full-precision sampler, no correction
==========  =================================================================

Every arm shares the learning rate, seeds and task; only the sampler numerics
(``fp32``) or the correction differ, so a failure of ``none`` that ``fp32``
does not share is a mismatch effect, not a learning-rate blow-up.

Destabilisation (fixed before any run, :func:`destabilisation_step`): the
trailing :data:`SMOOTH_STEPS`-step mean reward falls below
:data:`COLLAPSE_FRACTION` of its running peak and stays below it until the end
of the run, for at least :data:`MIN_STAY` steps.

Each run is also judged by the shipped default alert rules
(:func:`triage_monitor.alerts.default_rules`, replayed on its per-step
metrics) and by when the direction metric (pooled ``window/rho_asym``) and
the magnitude metrics (``window/small_gap_share``, ``window/k3_kl``) leave the
healthy band of the run's own reference window (:func:`onsets`).

Output (``out``): one run directory per (arm, seed) under ``runs/``,
``study.html`` (plotly, self-contained), ``summary.csv`` (one row per run),
``trajectories.csv`` (the key per-step columns of every run) and ``study.json`` (configuration, definitions, the table).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from ..alerts import NOISE_FLOOR_NATS, default_rules, replay_engine
from ..layout import RunLayout
from .grpo import DemoConfig

#: Arms: overrides of the base configuration.
ARMS = {
    "none": dict(correction="none"),
    "tis": dict(correction="tis"),
    "triage": dict(correction="triage"),
    "fp32": dict(sampler_recipe="fp32", correction="none"),
}
ARM_LABELS = {"none": "NVFP4 sampler · no correction", "tis": "NVFP4 sampler · TIS",
              "triage": "NVFP4 sampler · TRIAGE", "fp32": "fp32 sampler (control) · no correction"}
ARM_COLORS = {"none": "#dc2626", "tis": "#d97706", "triage": "#2563eb", "fp32": "#6b7280"}

#: The study's job: 64-token walks (entropy kept), 64-token segments for Gate and monitor, calibrated Gate.
STUDY_BASE = dict(task="walk", response_len=64, alphabet=4, sft_steps=25, sft_target=0.0, prompts_per_step=4,
                  group_size=8, eval_size=8, gate_width=64, repair_width=128, segment_width=64, window=25,
                  calibration_steps=10, gate_thresholds="calibrated", quantize="all", sampler_lag=0,
                  nvfp4_backend="native", lr=1e-3, steps=120, log_every=10)
#: ``--quick`` (``make demo``): one seed of the uncorrected and the TRIAGE arm side by side, fewer steps.
QUICK = dict(arms=("none", "triage"), seeds=(0,), steps=60)

SMOOTH_STEPS = 10
COLLAPSE_FRACTION = 0.5
MIN_STAY = 10
#: relative widths of the healthy bands of :func:`onsets` (at least; 3 MADs when wider)
RHO_BAND, SMALL_GAP_BAND, K3_FACTOR = 0.15, 0.05, 2.0
#: alert groups that count as early warnings (integrity rules catch bugs, not drift)
WARNING_GROUPS = ("direction", "localization", "magnitude", "controller")


# ------------------------------------------------------------------------------ judging one run
def destabilisation_step(steps: Sequence[int], reward: Sequence[float]) -> Optional[int]:
    """The step at which a run destabilised, or None.

    Definition: ``m(t)`` = mean reward over the trailing :data:`SMOOTH_STEPS`
    steps (defined once that many steps exist); ``peak(t)`` = max of ``m`` up
    to ``t``.  The run destabilised at the first step ``t`` where
    ``m(t) < COLLAPSE_FRACTION · peak(t)`` and ``m`` stays below
    ``COLLAPSE_FRACTION · peak`` at every later step, with at least
    :data:`MIN_STAY` steps from ``t`` to the end of the run.

    Args:
        steps: ``(n,)`` increasing step numbers; reward: ``(n,)`` mean reward per step.

    Raises:
        ValueError: different lengths.
    """
    steps, reward = np.asarray(steps), np.asarray(reward, dtype=float)
    if steps.shape != reward.shape:
        raise ValueError(f"destabilisation_step: steps {steps.shape} and reward {reward.shape} differ in length")
    m = pd.Series(reward).rolling(SMOOTH_STEPS, min_periods=SMOOTH_STEPS).mean().to_numpy()
    peak = np.fmax.accumulate(np.where(np.isnan(m), -np.inf, m))
    below = ~np.isnan(m) & (m < COLLAPSE_FRACTION * peak)
    # first index from which `below` holds to the end
    tail_ok = np.logical_and.accumulate(below[::-1])[::-1]
    idx = np.flatnonzero(tail_ok)
    if not idx.size or len(steps) - idx[0] < MIN_STAY:
        return None
    return int(steps[idx[0]])


def _band(ref: np.ndarray, rel: float) -> tuple[float, float]:
    ref = ref[np.isfinite(ref)]
    if not ref.size:
        return math.nan, math.nan
    med = float(np.median(ref))
    half = max(3.0 * float(np.median(np.abs(ref - med))), rel * abs(med))
    return med - half, med + half


def onsets(df: pd.DataFrame, window: int) -> dict:
    """When the direction and magnitude metrics leave the healthy band of the run's reference window.

    Reference window: the ``window`` steps after the first full trailing window
    (steps ``[first + window − 1, first + 2·window − 1)``).  Bands:
    ``window/rho_asym`` median ± max(3 MAD, 15 % of the median);
    ``window/small_gap_share`` below median − max(3 MAD, 0.05);
    ``window/k3_kl`` above :data:`K3_FACTOR` × its median.  A step whose
    ``window/delta_abs_mean`` is below :data:`~triage_monitor.alerts.NOISE_FLOOR_NATS`
    is at noise level: it neither defines nor leaves a band.

    Args:
        df: per-step metrics (``step`` and the ``window/`` columns of the monitor).
        window: the monitor's window in steps.

    Returns:
        ``direction``, ``small_gap``, ``k3``: first step outside the band after
        the reference window (None if never), ``rho_band`` (lo, hi),
        ``noise_steps`` (count of steps at noise level).
    """
    d = df.sort_values("step").reset_index(drop=True)
    steps = d["step"].to_numpy()
    noise = d.get("window/delta_abs_mean", pd.Series(np.inf, index=d.index)).to_numpy(float) < NOISE_FLOOR_NATS
    start = window - 1
    ref = slice(start, start + window)
    after = np.arange(len(d)) >= start + window

    def first(mask):
        idx = np.flatnonzero(mask & after & ~noise)
        return int(steps[idx[0]]) if idx.size else None

    out = {"noise_steps": int(noise.sum())}
    rho = d["window/rho_asym"].to_numpy(float)
    lo, hi = _band(np.where(noise, np.nan, rho)[ref], RHO_BAND)
    out["rho_band"] = (lo, hi)
    out["direction"] = first((rho < lo) | (rho > hi)) if math.isfinite(lo) else None
    sg = d["window/small_gap_share"].to_numpy(float)
    lo_sg, _ = _band(np.where(noise, np.nan, sg)[ref], 0.0)
    med_sg = float(np.nanmedian(sg[ref])) if np.isfinite(sg[ref]).any() else math.nan
    out["small_gap"] = first(sg < min(lo_sg, med_sg - SMALL_GAP_BAND)) if math.isfinite(med_sg) else None
    k3 = d["window/k3_kl"].to_numpy(float)
    med_k3 = float(np.nanmedian(np.where(noise, np.nan, k3)[ref])) if (np.isfinite(k3[ref]) & ~noise[ref]).any() \
        else math.nan
    out["k3"] = first(k3 > K3_FACTOR * med_k3) if math.isfinite(med_k3) else None
    return out


def judge_run(df: pd.DataFrame, window: int, rules=None) -> dict:
    """Destabilisation, onsets and default-rule alerts of one run's per-step metrics ``df``.

    Returns a dict: ``steps`` (horizon), ``destabilised_at``, ``direction_onset``,
    ``small_gap_onset``, ``k3_onset``, ``first_alert`` (step of the first
    early-warning alert, groups :data:`WARNING_GROUPS`), ``first_alert_rule``,
    ``lead_steps`` / ``lead_frac`` (destabilisation − first alert, and that as a
    fraction of the horizon; None without both), ``alerts`` (list of
    ``(step, rule)``), ``noise_level_steps`` (most steps at which the noise guard held
    a guarded rule back), ``reward_peak`` and ``reward_final`` (trailing
    means), ``delta_abs_first`` / ``delta_abs_last`` (mean |δ|, nats, first and
    last 10 % of the run) and ``rho_window_last``.
    """
    d = df.sort_values("step").reset_index(drop=True)
    steps = d["step"].to_numpy()
    destab = destabilisation_step(steps, d["reward"].to_numpy(float))
    on = onsets(d, window)
    quiet = logging.getLogger("triage_monitor.alerts")
    level = quiet.level
    quiet.setLevel(logging.WARNING)     # "cleared" lines of every replayed run would drown the table
    try:
        eng = replay_engine(default_rules() if rules is None else rules, d)
    finally:
        quiet.setLevel(level)
    groups = {r.name: r.group for r in eng.rules}
    warn = [a for a in eng.fired if groups.get(a.rule) in WARNING_GROUPS]
    first = warn[0] if warn else None
    lead = (destab - first.step) if (destab is not None and first is not None) else None
    n = len(d)
    m = d["reward"].rolling(SMOOTH_STEPS, min_periods=1).mean()
    tenth = max(1, n // 10)
    noise = max(eng.noise_steps.values(), key=len, default=[])
    return {
        "steps": n, "destabilised_at": destab,
        "direction_onset": on["direction"], "small_gap_onset": on["small_gap"], "k3_onset": on["k3"],
        "first_alert": first.step if first else None, "first_alert_rule": first.rule if first else None,
        "lead_steps": lead, "lead_frac": (lead / n) if lead is not None else None,
        "alerts": [(int(a.step), a.rule) for a in warn], "noise_level_steps": len(noise),
        "reward_peak": float(m.max()), "reward_final": float(m.iloc[-1]),
        "delta_abs_first": float(d["delta_abs_mean"].iloc[:tenth].mean()),
        "delta_abs_last": float(d["delta_abs_mean"].iloc[-tenth:].mean()),
        "rho_window_last": float(d["window/rho_asym"].iloc[-1]),
    }


# ------------------------------------------------------------------------------ running
def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)   # a log file gets the whole table


def _run_one(job: tuple) -> tuple:
    """Worker: run one (arm, seed) and return (key, per-step frame, attrs)."""
    key, cfg_dict, out_dir, queue, existing = job
    import torch

    from .grpo import run_demo

    torch.set_num_threads(cfg_dict.get("threads", 1))
    cfg = DemoConfig(**cfg_dict)
    cb = (lambda _m: queue.put((key, 1))) if queue is not None else None
    df = run_demo(cfg, out_dir, quiet=True, on_step=cb, **existing)
    return key, df, dict(df.attrs)


def run_study(base: DemoConfig, out, arms: Sequence[str] = tuple(ARMS), seeds: Sequence[int] = (0, 1, 2),
              jobs: int = 1, console=None, progress: bool = True, resume: bool = False,
              force: bool = False) -> pd.DataFrame:
    """Run every (arm, seed), judge each run and write the comparison report into ``out``.

    Args:
        base: the shared configuration (its ``correction`` / ``sampler_recipe`` / ``seed``
            are set per arm and seed from :data:`ARMS`).
        out: output directory (created).
        arms: names from :data:`ARMS`; seeds: integers.
        jobs: runs in parallel (separate processes; 1 = in this process).
        resume / force: what to do with a run already in ``out/runs/<arm>-s<seed>``
            (docs/reliability.md#one-run-per-directory): continue it as a new attempt, or move it aside.
        console: ``rich.console.Console`` for the progress bar and the table (default: a new one).
        progress: show the progress bar.

    Returns:
        The summary table, one row per run (also ``out/summary.csv``).

    Raises:
        ValueError: an unknown arm, no arm or no seed, or ``jobs < 1``.
        triage_monitor.records.OutputError: a run directory holds another run, is locked by a live process,
            or cannot be written (raised before that run's first step).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"study: arms must be a non-empty subset of {tuple(ARMS)}, got {list(arms)}")
    if not seeds:
        raise ValueError("study: give at least one seed")
    if jobs < 1:
        raise ValueError(f"study: jobs must be >= 1, got {jobs}")
    console = console or _console()
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    plan = {}
    for arm in arms:
        for seed in seeds:
            cfg = replace(base, seed=int(seed), **ARMS[arm])
            plan[(arm, int(seed))] = (cfg, out / "runs" / f"{arm}-s{seed}")
    console.print(f"[bold]triage-monitor study[/]: {len(arms)} arm(s) × {len(seeds)} seed(s), {base.steps} steps "
                  f"each → {out}")
    console.print(f"mismatch: {replace(base, **ARMS['none']).mechanism()}")
    frames, attrs = {}, {}
    existing = {"resume": resume, "force": force}
    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, disable=not progress) as bar:
        total = bar.add_task("study (steps)", total=len(plan) * base.steps)
        if jobs == 1:
            for key, (cfg, path) in plan.items():
                bar.update(total, description=f"study: {key[0]} seed {key[1]}")
                _, frames[key], attrs[key] = _run_inline(key, cfg, path, lambda: bar.advance(total), existing)
        else:
            _run_parallel(plan, jobs, frames, attrs, lambda: bar.advance(total), existing)
    seconds = time.perf_counter() - t0
    summary = summarize(frames, attrs, base.window)
    write_outputs(out, base, frames, summary, seconds)
    print_summary(console, summary, out, seconds)
    return summary


def _run_inline(key, cfg: DemoConfig, path: Path, tick: Callable[[], None], existing: dict):
    from .grpo import run_demo

    df = run_demo(cfg, path, quiet=True, on_step=lambda _m: tick(), **existing)
    return key, df, dict(df.attrs)


def _run_parallel(plan: dict, jobs: int, frames: dict, attrs: dict, tick: Callable[[], None], existing: dict) -> None:
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor, wait, FIRST_COMPLETED

    from ..engines import ignore_sigint, stop_pool

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                                       initializer=ignore_sigint) as pool, stop_pool(pool):
        q = manager.Queue()
        pending = {pool.submit(_run_one, (key, asdict(cfg), str(path), q, existing)) for key, (cfg, path) in plan.items()}
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            while True:
                try:
                    q.get_nowait()
                except queue_mod.Empty:
                    break
                tick()
            for fut in done:
                key, df, at = fut.result()
                frames[key], attrs[key] = df, at


def rejudge(base: DemoConfig, out, console=None) -> pd.DataFrame:
    """Judge the run directories of a finished study in ``out/runs`` again and rewrite its outputs.

    For new alert rules or definitions without re-running: each ``<arm>-s<seed>``
    directory's per-step table is read back (``open_run(run_dir).steps()``);
    when ``base.window`` differs from the run's monitor window, the metrics are
    recomputed from the token records with ``base.window``
    (:func:`triage_monitor.analysis.recompute`) and the training-loop columns
    (reward, controller stats, gradient norm) are kept.  ``base`` also supplies
    the mechanism text.

    Raises:
        ValueError: ``out/runs`` holds no ``<arm>-s<seed>`` run directory.
    """
    from ..analysis import open_run, recompute

    console = console or _console()
    out = Path(out)
    frames = {}
    for d in sorted((out / "runs").glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if not (arm in ARMS and seed.isdigit() and RunLayout(d).manifest.exists()):
            continue
        run = open_run(d)
        live = run.steps()
        if run.config.window != base.window:
            rec = recompute(run, window=base.window)
            live = rec.merge(live[["step", *[c for c in live.columns if c not in rec.columns]]], on="step",
                             how="left")
        frames[(arm, int(seed))] = live
    if not frames:
        raise ValueError(f"study: no <arm>-s<seed> run directory under {out / 'runs'}")
    summary = summarize(frames, {}, base.window)
    write_outputs(out, base, frames, summary, math.nan)
    print_summary(console, summary, out, math.nan)
    return summary


def summarize(frames: dict, attrs: dict, window: int) -> pd.DataFrame:
    """One row per (arm, seed): :func:`judge_run` plus wall time; sorted by arm order then seed."""
    rows = []
    for (arm, seed), df in frames.items():
        j = judge_run(df, window)
        j.pop("alerts")
        rows.append({"arm": arm, "seed": seed, **j, "seconds": attrs.get((arm, seed), {}).get("seconds_total")})
    order = {a: i for i, a in enumerate(ARMS)}
    out = pd.DataFrame(rows)
    return out.sort_values(["arm", "seed"], key=lambda c: c.map(order) if c.name == "arm" else c).reset_index(
        drop=True)


# ------------------------------------------------------------------------------ report
def _opt(v):
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def verdict(summary: pd.DataFrame) -> list[str]:
    """Plain-language findings of the summary table (one sentence each)."""
    lines = []
    for arm, g in summary.groupby("arm", sort=False):
        n_d = int(g["destabilised_at"].notna().sum())
        when = ", ".join(str(int(x)) for x in g["destabilised_at"].dropna())
        n_a = int(g["first_alert"].notna().sum())
        lines.append(f"{ARM_LABELS.get(arm, arm)}: destabilised on {n_d}/{len(g)} seed(s)"
                     + (f" (steps {when})" if n_d else "") + f"; default rules warned on {n_a}/{len(g)}.")
    return lines


def report_html(base: DemoConfig, frames: dict, summary: pd.DataFrame, seconds: float) -> str:
    """The self-contained comparison report (plotly.js inline)."""
    import html

    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = [("reward", "reward (trailing mean)", True), ("window/rho_asym", "window ρ_asym (direction)", False),
              ("window/small_gap_share", "window small-gap share", False), ("window/k3_kl", "window k3 KL", False),
              ("window/delta_abs_mean", "window mean |δ| (nats)", False),
              ("gate_downweighted_frac", "Gate down-weighted fraction", False),
              ("repair_active_frac", "Repair active fraction", False), ("grad_norm", "gradient norm", False)]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.025,
                        subplot_titles=[p[1] for p in panels])
    dashes = ("solid", "dash", "dot", "dashdot", "longdash")
    alerts_by_run = {}
    for (arm, seed), df in frames.items():
        d = df.sort_values("step")
        name = f"{arm} s{seed}"
        for i, (col, _, smooth) in enumerate(panels, start=1):
            if col not in d:
                continue
            y = d[col].rolling(SMOOTH_STEPS, min_periods=1).mean() if smooth else d[col]
            fig.add_trace(go.Scatter(x=d["step"], y=y, mode="lines", name=name, legendgroup=name,
                                     showlegend=i == 1, line=dict(color=ARM_COLORS.get(arm), width=1.4,
                                                                  dash=dashes[seed % len(dashes)])), row=i, col=1)
        j = judge_run(d, base.window)
        alerts_by_run[name] = j["alerts"]
        if j["alerts"]:
            st = [s for s, _ in j["alerts"]]
            rho = d.set_index("step")["window/rho_asym"].reindex(st)
            fig.add_trace(go.Scatter(x=st, y=rho, mode="markers", name=f"{name} alerts", legendgroup=name,
                                     showlegend=False, marker=dict(symbol="triangle-down", size=10,
                                                                   color=ARM_COLORS.get(arm)),
                                     text=[r for _, r in j["alerts"]], hovertemplate="%{text} @ %{x}"),
                          row=2, col=1)
        if j["destabilised_at"] is not None:
            fig.add_vline(x=j["destabilised_at"], line=dict(color=ARM_COLORS.get(arm), dash="dot", width=1))
    fig.update_layout(height=230 * len(panels), template="plotly_white", margin=dict(l=60, r=20, t=40, b=40),
                      legend=dict(orientation="h", y=1.02, x=0, yanchor="bottom"))
    fig.update_yaxes(type="log", row=4, col=1)
    fig.update_yaxes(type="log", row=5, col=1)
    chart = fig.to_html(full_html=False, include_plotlyjs="inline", default_width="100%",
                        config={"displaylogo": False, "responsive": True})
    cols = ["arm", "seed", "destabilised_at", "direction_onset", "small_gap_onset", "k3_onset", "first_alert",
            "first_alert_rule", "lead_steps", "lead_frac", "noise_level_steps", "reward_peak", "reward_final",
            "delta_abs_first", "delta_abs_last", "rho_window_last", "seconds"]
    shown = summary[cols].astype(object)
    table = shown.where(shown.notna(), "—").to_html(index=False, border=0, float_format=lambda x: f"{x:.4g}")
    findings = "".join(f"<li>{html.escape(s)}</li>" for s in verdict(summary))
    alert_list = "".join(f"<li><b>{html.escape(k)}</b>: "
                         + (html.escape(", ".join(f"{r} @ {s}" for s, r in v)) or "none") + "</li>"
                         for k, v in alerts_by_run.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>triage-monitor study</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;margin:0;background:#f9fafb;color:#111827}}
main{{max-width:1280px;margin:0 auto;padding:24px 32px 60px}} table{{border-collapse:collapse;font-size:12.5px;
background:white}} th,td{{border:1px solid #e5e7eb;padding:4px 7px;text-align:right}} th{{background:#f3f4f6}}
.note{{color:#4b5563;font-size:13px}} .warn{{background:#fef3c7;border:1px solid #f59e0b;padding:8px 12px}}</style>
</head><body><main>
<h1>triage-monitor study: NVFP4 sampler vs corrections</h1>
<div class="note">generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {len(frames)} run(s),
{base.steps} steps each, {seconds:.0f} s wall time.</div>
<p class="warn"><b>Mismatch mechanism.</b> {html.escape(replace(base, **ARMS['none']).mechanism())}</p>
<h2>Findings</h2><ul>{findings}</ul>
<h2>Steps to destabilise, onsets and alerts</h2>
<div class="note">Destabilised: the trailing {SMOOTH_STEPS}-step mean reward falls below {COLLAPSE_FRACTION:g} × its
running peak and stays there to the end (≥ {MIN_STAY} steps). Onsets: first step after the reference window
(steps {base.window - 1}–{2 * base.window - 2}) where window ρ_asym leaves median ± max(3 MAD, {RHO_BAND:.0%}),
window small-gap share drops more than max(3 MAD, {SMALL_GAP_BAND}) or window k3 KL exceeds {K3_FACTOR:g}× its
median. First alert: the shipped default rules replayed on the run (groups {', '.join(WARNING_GROUPS)});
lead = destabilisation − first alert (fraction of the horizon). Noise-level steps: window mean |δ| below
{NOISE_FLOOR_NATS:g} nats, where ρ_asym is rounding noise and the direction rules are held back.</div>
<div style="overflow-x:auto">{table}</div>
<h2>Over steps</h2><div class="note">One colour per arm, one dash style per seed; ▼ alerts on the ρ_asym panel;
dotted vertical lines: destabilisation.</div>
{chart}
<h2>Alerts per run</h2><ul>{alert_list}</ul>
</main></body></html>
"""


def write_outputs(out: Path, base: DemoConfig, frames: dict, summary: pd.DataFrame, seconds: float) -> None:
    """Write ``summary.csv``, ``trajectories.csv`` (per-step key columns of every run), ``study.json`` and
    ``study.html`` into ``out``."""
    summary.to_csv(out / "summary.csv", index=False)
    keep = ["step", "reward", "delta_abs_mean", "window/delta_abs_mean", "rho_asym", "window/rho_asym",
            "window/small_gap_share", "window/k3_kl", "delta_min", "sampler_nll", "gate_downweighted_frac",
            "repair_active_frac", "grad_norm"]
    pd.concat([df[[c for c in keep if c in df]].assign(arm=arm, seed=seed) for (arm, seed), df in frames.items()]
              ).to_csv(out / "trajectories.csv", index=False)
    meta = {"base_config": asdict(base), "arms": {a: ARMS[a] for a in dict.fromkeys(k[0] for k in frames)},
            "mechanism": replace(base, **ARMS["none"]).mechanism(),
            "destabilisation": {"smooth_steps": SMOOTH_STEPS, "collapse_fraction": COLLAPSE_FRACTION,
                                "min_stay": MIN_STAY},
            "noise_floor_nats": NOISE_FLOOR_NATS, "seconds": seconds,
            "runs": json.loads(summary.to_json(orient="records"))}
    (out / "study.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / "study.html").write_text(report_html(base, frames, summary, seconds), encoding="utf-8")


def print_summary(console, summary: pd.DataFrame, out: Path, seconds: float) -> None:
    """The table, the findings and where to look next."""
    from rich.table import Table

    t = Table(title="steps to destabilise (— = stable), onsets and first alert")
    cols = ["arm", "seed", "destabilised_at", "direction_onset", "small_gap_onset", "k3_onset", "first_alert",
            "first_alert_rule", "lead_frac", "reward_peak", "reward_final", "delta_abs_last"]
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for _, r in summary.iterrows():
        t.add_row(*[(f"{v:.3g}" if isinstance(v, float) else str(v)) if v is not None and not
                    (isinstance(v, float) and math.isnan(v)) else "—" for v in (r[c] for c in cols)])
    console.print(t)
    for line in verdict(summary):
        console.print(line)
    first_seed = summary["seed"].iloc[0]
    dirs = " ".join(str(out / "runs" / f"{a}-s{first_seed}") for a in dict.fromkeys(summary["arm"]))
    console.print(f"study: {seconds:.0f} s.  Report: [bold]{out / 'study.html'}[/]  (table: {out / 'summary.csv'})")
    console.print(f"Dashboard (seed {first_seed} of each arm): triage-monitor dashboard {dirs}")
