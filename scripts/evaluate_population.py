"""Judge the alert rules on the study's population (docs/alerts.md#evaluating-the-alerts, docs/study.md).

    triage-monitor study --population --jobs 2 --out runs/population      # 64 runs, resumable
    python scripts/evaluate_population.py runs/population                 # the tables below, as Markdown

1. Reads every finished run of ``OUT/runs`` and its split (calibration seeds / held-out seeds, fixed in
   ``triage_monitor.demo.population`` before any threshold was chosen).
2. On the calibration half only, chooses each collapse-tier rule's threshold
   (:func:`triage_monitor.offline.evaluation.calibrate_threshold`: the highest recall that warns on no held fp32 or
   on-policy NVFP4 run) and the |δ|-level baseline's.
3. On the held-out half, reports per rule (as shipped and as calibrated), per tier and per baseline: runs warned,
   precision, recall, lead, held runs warned by regime (``evaluate``).
4. On the held-out half, the step-level AUROC of each metric for "destabilises within H steps", with a 95 %
   bootstrap interval over runs (``metric_auroc``); each metric's sign is fixed on the calibration half.

Writes ``OUT/evaluation.json`` and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from triage_monitor.alerting.alerts import NOISE_FLOOR_NATS, baseline_rules, default_rules
from triage_monitor.demo.population import split_of
from triage_monitor.offline.evaluation import calibrate_threshold, default_horizon, evaluate, load_run, metric_auroc

#: candidate thresholds per calibrated rule, least to most conservative
GRIDS = {
    "rho_asym_rising": [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0],
    "rho_asym_high": [1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.3, 2.6, 3.0],
    "rho_asym_critical": [1.5, 1.8, 2.0, 2.3, 2.6, 3.0, 3.5, 4.0],
    "c_tok_excess": [0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2],
    "small_gap_share_falling": [0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.3],
    "k3_kl_rising": [0.5, 1.0, 1.5, 2.0, 3.0, 5.0],
    "gate_downweighting_rising": [0.01, 0.02, 0.05, 0.1, 0.2],
    "baseline_delta_level": [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0],
}


def _guarded(f: pd.DataFrame, col: str) -> np.ndarray:
    """A ratio metric with its noise-level steps (window mean |δ| below the floor) left out (NaN)."""
    v = f[col].to_numpy(float).copy() if col in f else np.full(len(f), np.nan)
    if "window/delta_abs_mean" in f:
        v[f["window/delta_abs_mean"].to_numpy(float) < NOISE_FLOOR_NATS] = np.nan
    return v


def _excess(f: pd.DataFrame, col: str, n: int = 50) -> np.ndarray:
    v = _guarded(f, col)
    base = np.nanmedian(v[:n]) if np.isfinite(v[:n]).any() else np.nan
    return v - base


def _drawdown(f: pd.DataFrame) -> np.ndarray:
    m = pd.Series(f["reward"].to_numpy(float)).rolling(10, min_periods=10).mean().to_numpy()
    peak = np.fmax.accumulate(np.where(np.isnan(m), -np.inf, m))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(m) & (peak > 0), (peak - m) / peak, np.nan)


def _onset(f: pd.DataFrame) -> np.ndarray:
    """1 from the direction onset on (window ρ_asym above its reference band, the study's definition), else 0."""
    from triage_monitor.demo.study import _ref_start, onsets

    lag = int(f["sampler_staleness"].max()) if "sampler_staleness" in f and f["sampler_staleness"].notna().any() else 0
    on = onsets(f, _ref_start(f, lag))["direction_up"]
    steps = f["step"].to_numpy()
    out = np.where(steps >= on, 1.0, 0.0) if on is not None else np.zeros(len(f))
    out[np.isnan(_guarded(f, "window/rho_asym"))] = np.nan
    return out


def _c_tok_null_excess(f: pd.DataFrame) -> np.ndarray:
    """Window C_tok minus the median of its shuffle null (docs/metrics.md#stages; 99 draws), every 5th step from the
    first full window (the stage table at those anchors), NaN elsewhere and where the null is degenerate."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.offline.stages import stage_table

    steps = f["step"].to_numpy()
    out = np.full(len(f), np.nan)
    anchors = [int(s) for s in steps[24::5]]
    if not anchors:
        return out
    t = stage_table(open_run(f.attrs["path"]), anchors=anchors, draws=99)
    ok = t["max_segments"] > 1
    where = {int(s): float(v) for s, v, good in zip(t["step"], t["c_tok_excess"], ok) if good}
    for i, s in enumerate(steps):
        out[i] = where.get(int(s), np.nan)
    return out


#: step-level scores (higher = riskier by construction or flipped on the calibration half)
SCORES = {
    "window ρ_asym": lambda f: _guarded(f, "window/rho_asym"),
    "ρ_asym direction onset (0/1)": _onset,
    "window small-gap share": lambda f: f["window/small_gap_share"].to_numpy(float),
    "window k3 KL": lambda f: _guarded(f, "window/k3_kl"),
    "window |δ| q0.05": lambda f: f["window/delta_q05"].to_numpy(float),
    "window |δ| q0.01": lambda f: f["window/delta_q01"].to_numpy(float),
    "window mean |δ|": lambda f: f["window/delta_abs_mean"].to_numpy(float),
    "C_tok excess over its first 50 steps": lambda f: _excess(f, "window/c_tok"),
    "C_tok excess over its shuffle null (every 5th step)": _c_tok_null_excess,
    "Gate down-weighted share": lambda f: f["gate_downweighted_frac"].to_numpy(float)
    if "gate_downweighted_frac" in f else np.full(len(f), np.nan),
    "gradient norm": lambda f: f["grad_norm"].to_numpy(float),
    "reward drawdown from its running peak": _drawdown,
}


def _pct(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0%}"


def _md(table: pd.DataFrame, groups) -> str:
    lines = ["| detector | tier | warned | precision | recall (timely/failed) | lead median (min–max) | late | "
             + " | ".join(f"held {g} warned" for g in groups) + " |",
             "|---" * (7 + len(groups)) + "|"]
    for _, r in table.iterrows():
        lead = "—" if math.isnan(r["lead_median"]) else f"{r['lead_median']:g} ({r['lead_min']:g}–{r['lead_max']:g})"
        lines.append(f"| {r['label']} | {r['tier']} | {r['warned']}/{r['runs']} | {_pct(r['precision'])} | "
                     f"{_pct(r['recall'])} ({r['timely']}/{r['failed']}) | {lead} | {r['late']} | "
                     + " | ".join(f"{r[f'held_warned_{g}']}/{r[f'held_{g}']}" for g in groups) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("population", help="the folder of `triage-monitor study --population --out`")
    p.add_argument("--boot", type=int, default=1000, help="bootstrap resamples of runs for the AUROC interval")
    args = p.parse_args(argv)
    root = Path(args.population)
    runs = []
    for d in sorted((root / "runs").iterdir()):
        try:
            status = json.loads((d / "run.json").read_text()).get("status")
        except (OSError, ValueError):
            continue
        if status != "finished":
            continue
        r = load_run(d)
        r.info["split"] = split_of(int(r.info["seed"]))
        r.frame.attrs["path"] = str(d)
        runs.append(r)
    cal = [r for r in runs if r.info["split"] == "calibration"]
    held = [r for r in runs if r.info["split"] == "heldout"]
    if not cal or not held:
        print(f"need finished runs in both halves (calibration {len(cal)}, held-out {len(held)})", file=sys.stderr)
        return 2
    horizon = default_horizon(runs)
    groups = sorted({r.group for r in runs})
    print(f"population {root}: {len(runs)} finished run(s); calibration {len(cal)} "
          f"({sum(r.destabilised_at is not None for r in cal)} destabilised), held-out {len(held)} "
          f"({sum(r.destabilised_at is not None for r in held)} destabilised); H = {horizon} steps\n")

    shipped = default_rules()
    bases = baseline_rules()
    by_name = {r.name: r for r in shipped + bases}
    chosen, calib_tables = {}, {}
    for name, grid in GRIDS.items():
        best, tab = calibrate_threshold(cal, by_name[name], grid, horizon)
        calib_tables[name] = tab
        chosen[name] = best
        print(f"calibration: {name}: " + (f"threshold {best.threshold:g}" if best else "no threshold qualifies "
                                           "(every candidate warns on a quiet run or catches nothing)"))
    # the tier each calibrated rule earns on the calibration half: collapse only if, at its calibrated threshold, it
    # warns on no quiet run and its precision is at least the reward-drop baseline's (what anyone can write)
    base_score = evaluate(cal, [], [by_name["baseline_reward_drawdown"]], horizon).iloc[0]
    print(f"\ncalibration: baseline_reward_drawdown precision {_pct(base_score['precision'])}, recall "
          f"{_pct(base_score['recall'])}\n\n| rule | calibrated threshold | precision | recall | tier earned |\n|---|---|---|---|---|")
    decisions = {}
    for name in GRIDS:
        if name.startswith("baseline"):
            continue
        best = chosen.get(name)
        if best is None:
            decisions[name] = ("mismatch", "no threshold warns on no quiet run and catches a failure")
            print(f"| {name} | — | — | — | mismatch |")
            continue
        sc = evaluate(cal, [best], [], horizon).iloc[0]
        ok = sc["precision"] >= base_score["precision"] and sc["timely"] > 0
        decisions[name] = ("collapse" if ok else "mismatch", f"threshold {best.threshold:g}")
        print(f"| {name} | {best.threshold:g} | {_pct(sc['precision'])} | {_pct(sc['recall'])} | "
              f"{'collapse' if ok else 'mismatch'} |")
    calibrated = [replace(chosen[r.name], name=r.name + "@cal") for r in shipped
                  if r.tier == "collapse" and chosen.get(r.name) is not None]
    base_cal = [replace(chosen["baseline_delta_level"], name="baseline_delta_level@cal")] \
        if chosen.get("baseline_delta_level") else []

    out = {"horizon": horizon, "runs": [{"run": r.name, "group": r.group, "split": r.info["split"],
                                         "destabilised_at": r.destabilised_at, **r.info} for r in runs],
           "chosen": {k: (v.threshold if v else None) for k, v in chosen.items()}, "decisions": decisions}
    for half, sel in (("calibration", cal), ("heldout", held)):
        table = evaluate(sel, shipped + calibrated, bases + base_cal, horizon)
        table["label"] = [f"{k}: {n}" if k in ("tier", "group") else n for k, n in zip(table["kind"], table["name"])]
        keep = table[(table["kind"] != "group") & ~((table["kind"] == "rule") & (table["warned"] == 0)
                                                     & table["name"].isin([r.name for r in shipped if r.group in
                                                                           ("integrity", "monitor")]))]
        print(f"\n### {half} half ({len(sel)} runs, {sum(r.destabilised_at is not None for r in sel)} destabilised)\n")
        print(_md(keep, groups))
        out[half] = table.to_dict("records")

    n_fail = sum(r.destabilised_at is not None for r in held)
    print(f"\n### step-level AUROC on the held-out half (destabilises within H steps; 95 % bootstrap over runs, "
          f"failed and held runs resampled separately; {n_fail} failed run(s) of {len(held)})\n")
    print("| metric | sign (fixed on calibration) | AUROC calibration | AUROC held-out [95 % CI] | positive / negative steps |")
    print("|---|---|---|---|---|")
    out["auroc"] = []
    for label, fn in SCORES.items():
        a_cal = metric_auroc(cal, fn, horizon, n_boot=0)[0]
        sign = -1.0 if (math.isfinite(a_cal) and a_cal < 0.5) else 1.0
        a, lo, hi, pos, neg = metric_auroc(held, lambda f, fn=fn, s=sign: s * fn(f), horizon, n_boot=args.boot)
        a_cal_signed = a_cal if sign > 0 else 1 - a_cal
        print(f"| {label} | {'higher' if sign > 0 else 'lower'} = riskier | {a_cal_signed:.2f} | {a:.2f} "
              f"[{lo:.2f}, {hi:.2f}] | {pos} / {neg} |")
        out["auroc"].append({"metric": label, "sign": sign, "auroc_calibration": a_cal_signed, "auroc": a,
                             "low": lo, "high": hi, "positive": pos, "negative": neg})
    (root / "evaluation.json").write_text(json.dumps(out, indent=1, default=float))
    print(f"\nwritten: {root / 'evaluation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
