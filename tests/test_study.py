"""The mismatch study: the walk task by hand, destabilisation by hand, the noise guard on a real fp32-sampler
run, alert timing on a small real run, the stale sampler, and the `study` command end to end (CI-sized)."""

import json
import math

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch

pytest.importorskip("torchao")

from triage_monitor.analysis import open_run  # noqa: E402
from triage_monitor.alerts import NOISE_FLOOR_NATS, Rule, AlertEngine, default_rules, replay_engine  # noqa: E402
from triage_monitor.cli import main  # noqa: E402
from triage_monitor.demo import DemoConfig, run_demo  # noqa: E402
from triage_monitor.demo.study import destabilisation_step, judge_run, onsets  # noqa: E402
from triage_monitor.demo.task import EQUALS, BOS, WalkTask  # noqa: E402

# a CI-sized walk job: 16-token responses, 8 responses per step, no warm start
TINY = dict(task="walk", response_len=16, alphabet=4, sft_steps=0, prompts_per_step=2, group_size=4, eval_size=4,
            gate_width=16, repair_width=16, segment_width=16, window=3, calibration_steps=2, log_every=100,
            nvfp4_backend="native")


def test_walk_task_by_hand():
    task = WalkTask(length=5, alphabet=3)
    allowed = torch.tensor([[1, 4, 7], [0, 2, 9]])
    _, prompts = task.sample(2, torch.Generator().manual_seed(0))
    assert prompts.shape == (2, 5) and (prompts[:, 0] == BOS).all() and (prompts[:, -1] == EQUALS).all()
    resp = torch.tensor([[1, 4, 1, 7, 4],     # every token allowed, no repeat: 5/5
                         [0, 0, 3, 9, 2]])    # repeat at 1, 3 not allowed: 3/5
    assert task.valid(resp, allowed).tolist() == [[True] * 5, [True, False, False, True, True]]
    assert task.reward(resp, allowed).tolist() == pytest.approx([1.0, 0.6])
    assert task.reward(resp[:, :2], allowed).tolist() == pytest.approx([0.4, 0.2])  # missing tokens are invalid
    walks, length = WalkTask(64, 4).answers(torch.tensor([[0, 3, 5, 8]] * 50), torch.Generator().manual_seed(1))
    assert walks.shape == (50, 64) and (length == 64).all()
    assert (WalkTask(64, 4).reward(walks, torch.tensor([[0, 3, 5, 8]] * 50)) == 1.0).all()
    # uniform over the 3 other symbols: every symbol occurs, never twice in a row
    assert set(walks.unique().tolist()) == {0, 3, 5, 8}
    with pytest.raises(ValueError, match="alphabet"):
        WalkTask(64, 1)


def test_destabilisation_step_by_hand():
    steps = np.arange(60)
    flat = np.full(60, 0.8)
    assert destabilisation_step(steps, flat) is None
    # reward 0.8 for 30 steps, then 0.1: the trailing-10 mean drops below 0.4 once 6 of its 10 steps are 0.1
    # (4·0.8 + 6·0.1)/10 = 0.38 < 0.4 at step 35; (5·0.8 + 5·0.1)/10 = 0.45 at step 34
    crash = np.where(steps < 30, 0.8, 0.1)
    assert destabilisation_step(steps, crash) == 35
    # a dip that recovers is not a destabilisation
    dip = np.where((steps >= 30) & (steps < 45), 0.1, 0.8)
    assert destabilisation_step(steps, dip) is None
    # a crash in the last MIN_STAY steps is too late to call
    late = np.where(steps < 52, 0.8, 0.0)
    assert destabilisation_step(steps, late) is None
    with pytest.raises(ValueError, match="length"):
        destabilisation_step(steps, flat[:-1])


def test_noise_guard_rule():
    rule = Rule(name="rho_hi", metric="window/rho_asym", condition="above", threshold=1.45, hold=2,
                guard_metric="window/delta_abs_mean", guard_min=NOISE_FLOOR_NATS)
    eng = AlertEngine([rule])
    for s in range(5):        # a bit-exact pipeline: ρ_asym swings high on rounding noise, |δ| ~ 1e-8
        assert eng.observe(s, {"window/rho_asym": 1.9, "window/delta_abs_mean": 1e-8}) == []
    assert eng.noise_steps["rho_hi"] == [0, 1, 2, 3, 4]
    # above the floor the same values fire after `hold` steps; a missing guard value does not block
    assert eng.observe(5, {"window/rho_asym": 1.9, "window/delta_abs_mean": 0.03}) == []
    assert [a.step for a in eng.observe(6, {"window/rho_asym": 1.9})] == [6]
    with pytest.raises(ValueError, match="guard_min"):
        Rule(name="x", metric="m", condition="above", threshold=1, guard_min=float("nan"))
    guarded = {r.name: r for r in default_rules() if r.guard_metric}
    assert {"rho_asym_rising", "rho_asym_high", "rho_asym_critical", "k3_kl_rising", "c_tok_excess"} <= set(guarded)
    assert all(r.guard_metric == "window/delta_abs_mean" and r.guard_min == NOISE_FLOOR_NATS
               for r in guarded.values())


def test_full_window_lookback():
    def fired(rule, values):
        eng = AlertEngine([rule])
        return [a.step for s, v in enumerate(values) for a in eng.observe(s, {"window/x": v})]
    base = dict(name="r", metric="window/x", condition="rising", threshold=0.1, window=2, k=1)
    # step 2 looks back at step 0, whose 2-step window held one step: only a full window (step >= 1) counts
    assert fired(Rule(**base), [1, 1, 2, 3]) == [2]
    assert fired(Rule(**base, full_window=True), [1, 1, 2, 3]) == [3]
    assert all(r.full_window for r in default_rules() if r.condition in ("rising", "falling")
               and r.metric.startswith("window/"))


@pytest.fixture(scope="module")
def fp32_control(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    cfg = DemoConfig(**{**TINY, "steps": 6, "sampler_recipe": "fp32", "correction": "none"})
    return run_demo(cfg, out, quiet=True), out


def test_noise_guard_on_the_fp32_control(fp32_control):
    df, out = fp32_control
    # a bit-exact sampler: |δ| is float32 rounding (KV-cache decoding vs one full forward), far below the floor
    assert (df["window/delta_abs_mean"] < NOISE_FLOOR_NATS).all()
    assert df["delta_abs_mean"].max() < 1e-5
    assert np.isfinite(df["window/rho_asym"]).any()     # the ratio exists: it is rounding noise, not undefined
    # a direction rule that holds on every step: the guard alone keeps it silent
    always = dict(name="rho_any", metric="window/rho_asym", condition="above", threshold=0.0)
    eng = replay_engine([Rule(**always, guard_metric="window/delta_abs_mean", guard_min=NOISE_FLOOR_NATS)], df)
    assert eng.fired == [] and len(eng.noise_steps["rho_any"]) == int(np.isfinite(df["window/rho_asym"]).sum())
    assert len(replay_engine([Rule(**always)], df).fired) == 1
    # the shipped defaults stay silent, and the run directory's live alert table is empty
    j = judge_run(df, window=TINY["window"])
    assert j["first_alert"] is None and j["noise_level_steps"] == len(df)
    assert not (out / "alerts").exists() or ds.dataset(out / "alerts").count_rows() == 0


def test_alert_timing_on_a_small_real_run(tmp_path):
    cfg = DemoConfig(**{**TINY, "steps": 8, "correction": "triage", "gate_thresholds": "calibrated",
                        "quantize": "all"})
    df = run_demo(cfg, tmp_path, quiet=True)
    assert (df["window/delta_abs_mean"] > NOISE_FLOOR_NATS).all()     # NVFP4: a real gap, above the floor
    # a rule that fires once window ρ_asym exceeds its first value: found by hand with pandas
    thr = float(df["window/rho_asym"].dropna().iloc[0])
    rule = Rule(name="rho_up", metric="window/rho_asym", condition="above", threshold=thr, group="direction",
                guard_metric="window/delta_abs_mean", guard_min=NOISE_FLOOR_NATS)
    j = judge_run(df, window=cfg.window, rules=[rule])
    above = df.loc[df["window/rho_asym"] > thr, "step"]
    assert j["first_alert"] == (int(above.iloc[0]) if len(above) else None)
    assert j["destabilised_at"] is None and j["lead_steps"] is None      # 8 steps: nothing to call
    # the Gate's calibrated thresholds act at this scale: it down-weights tokens after the reference window
    assert df.loc[df["step"] >= cfg.calibration_steps, "gate_downweighted_frac"].max() > 0
    assert (df["grad_norm"] > 0).all() and "repair_active_frac" in df
    on = onsets(df, cfg.window)
    assert set(on) == {"noise_steps", "rho_band", "direction", "small_gap", "k3"} and on["noise_steps"] == 0
    info = json.loads((tmp_path / "run.json").read_text())["info"]
    assert "EXAGGERATED" in info["mismatch_mechanism"] and "all" in info["mismatch_mechanism"]


def test_stale_sampler_lags_the_learner(tmp_path):
    base = {**TINY, "steps": 3, "sampler_recipe": "fp32", "correction": "none", "lr": 1e-2}
    sync = run_demo(DemoConfig(**base), tmp_path / "sync", quiet=True)
    lag = run_demo(DemoConfig(**base, sampler_lag=1), tmp_path / "lag", quiet=True)
    assert sync["delta_abs_mean"].max() < 1e-5
    # step 0 samples with the initial weights in both; from step 1 on the lagged sampler is one update behind
    assert lag["delta_abs_mean"].iloc[0] < 1e-5 and (lag["delta_abs_mean"].iloc[1:] > 1e-3).all()
    info = json.loads((tmp_path / "lag" / "run.json").read_text())["info"]
    assert info["sampler_lag"] == 1 and "stale" in info["mismatch_mechanism"]


def test_study_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--arms", "none,fp32", "--seeds", "0", "--steps", "4"]
    for k, v in TINY.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert main(argv) == 0
    summary = pd.read_csv(out / "summary.csv")
    assert summary[["arm", "seed"]].values.tolist() == [["none", 0], ["fp32", 0]]
    assert summary["steps"].tolist() == [4, 4]
    traj = pd.read_csv(out / "trajectories.csv")
    assert len(traj) == 8 and {"window/rho_asym", "delta_abs_mean", "grad_norm"} <= set(traj.columns)
    for arm in ("none", "fp32"):
        assert (out / "runs" / f"{arm}-s0" / "run.json").exists()
    meta = json.loads((out / "study.json").read_text())
    assert meta["destabilisation"]["collapse_fraction"] == 0.5 and meta["noise_floor_nats"] == NOISE_FLOOR_NATS
    assert "sampler nvfp4" in meta["mechanism"]
    page = (out / "study.html").read_text()
    assert "Steps to destabilise" in page and "plotly" in page.lower() and "fp32 sampler (control)" in page
    text = capsys.readouterr().out
    assert "study.html" in text and "triage-monitor dashboard" in text
    assert main(["study", "--out", str(out), "--arms", "bogus"]) == 2
    # judging the finished runs again gives the same table
    (out / "summary.csv").unlink()
    assert main(["study", "--out", str(out), "--rejudge", "--window", str(TINY["window"])]) == 0
    again = pd.read_csv(out / "summary.csv").drop(columns="seconds")
    pd.testing.assert_frame_equal(again, summary.drop(columns="seconds"), check_dtype=False)
    assert main(["study", "--out", str(tmp_path / "empty"), "--rejudge"]) == 2
    # a second study with other settings into the same --out is refused (exit 2, nothing mixed) ...
    argv5 = ["study", "--out", str(out), "--arms", "none", "--seeds", "0", "--steps", "5"] + argv[9:]
    assert main(argv5) == 2
    assert "demo_config.steps: 4 -> 5" in capsys.readouterr().err
    assert open_run(out / "runs" / "none-s0").steps()["step"].tolist() == [0, 1, 2, 3]
    # ... and --force moves the old run aside
    assert main(argv5 + ["--force"]) == 0
    assert open_run(out / "runs" / "none-s0").steps()["step"].tolist() == [0, 1, 2, 3, 4]
    assert len(list((out / "runs").glob("none-s0.replaced-*"))) == 1
