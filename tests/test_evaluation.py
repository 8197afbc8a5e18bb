"""``alerts --evaluate`` (triage_monitor.evaluation): run-level precision, recall and lead worked out by hand, the
outcome from a reward or a label file, and the population's fixed seed split (docs/alerts.md#evaluating-the-alerts)."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from triage_monitor.alerting.alerts import Rule
from triage_monitor.commands.alerts import main as alerts_cli
from triage_monitor.offline.evaluation import (EvalRun, auroc, calibrate_threshold, evaluate, load_run, metric_auroc,
                                       read_labels, score_detector)
from triage_monitor.alerting.outcome import OutcomeDefinition, destabilisation_step

RULE = Rule("x_high", "x", "above", 1.0, cooldown=1000, tier="collapse", group="direction")


def _run(name, n, spikes, destab, known=True, group="stale"):
    """A run of ``n`` steps whose metric x is 2 on the ``spikes`` steps (1 step each) and 0 elsewhere."""
    x = np.zeros(n)
    x[list(spikes)] = 2.0
    return EvalRun(name, pd.DataFrame({"step": np.arange(n), "x": x}), destab, known, group)


RUNS = [_run("A", 100, [30], 50),          # warned 20 steps before: timely with H = 30
        _run("B", 100, [5], 40),           # warned 35 steps before: early, not timely
        _run("C", 100, [70], 60),          # warned after destabilising: late
        _run("D", 100, [10], None, group="nvfp4"),   # held, warned: a false alarm on the realistic negative
        _run("E", 100, [], None, group="fp32"),      # held, quiet
        _run("F", 100, [20], None, known=False)]     # no reward, no label: not scored


def test_precision_recall_and_lead_by_hand():
    s = score_detector(RUNS, [[30], [5], [70], [10], [], [20]], horizon=30)
    assert (s.runs, s.failed, s.held, s.warned, s.timely, s.late, s.held_warned) == (5, 3, 2, 3, 1, 1, 1)
    assert s.precision == pytest.approx(1 / 3) and s.recall == pytest.approx(1 / 3)
    assert (s.lead_median, s.lead_min, s.lead_max, s.warnings_on_held) == (27.5, 20, 35, 1)
    # a longer horizon makes B's early warning timely: precision and recall 2/3, leads unchanged
    s = score_detector(RUNS, [[30], [5], [70], [10], [], [20]], horizon=35)
    assert (s.timely, s.precision, s.recall) == (2, pytest.approx(2 / 3), pytest.approx(2 / 3))


def test_evaluate_replays_the_rules_and_breaks_false_alarms_down_by_group():
    table = evaluate(RUNS, [RULE], [Rule("never", "x", "above", 5.0, group="baseline")], horizon=30)
    rule = table[(table["kind"] == "rule") & (table["name"] == "x_high")].iloc[0]
    assert (rule["warned"], rule["timely"], rule["late"], rule["lead_median"]) == (3, 1, 1, 27.5)
    assert (rule["held_warned_nvfp4"], rule["held_nvfp4"], rule["held_warned_fp32"], rule["held_fp32"]) == (1, 1, 0, 1)
    tier = table[(table["kind"] == "tier") & (table["name"] == "collapse")].iloc[0]
    assert tier["warned"] == 3 and tier["tier"] == "collapse"
    base = table[table["kind"] == "baseline"].iloc[0]
    assert (base["warned"], math.isnan(base["precision"]), base["recall"]) == (0, True, 0.0)
    assert table.attrs["horizon"] == 30


def test_the_outcome_comes_from_the_reward_or_a_label_and_the_cli_prints_it(tmp_path, capsys):
    steps = np.arange(80)
    reward = np.where(steps < 40, 0.8, 0.1)
    # the trailing 10-step mean first falls below half its peak 0.8 at step 45 (four 0.8s left in the window)
    assert destabilisation_step(steps, reward) == 45
    # a definition that needs 50 steps below the peak cannot call it within 80 steps
    assert destabilisation_step(steps, reward, OutcomeDefinition(stay=50)) is None
    x = np.where((steps >= 25) & (steps < 27), 2.0, 0.0)
    pd.DataFrame({"triage/step": steps, "reward": reward, "x": x}).to_csv(tmp_path / "fails.csv", index=False)
    pd.DataFrame({"triage/step": steps, "reward": np.full(80, 0.8), "x": x}).to_csv(tmp_path / "holds.csv", index=False)
    pd.DataFrame({"triage/step": steps, "x": x}).to_csv(tmp_path / "noreward.csv", index=False)
    (tmp_path / "rules.toml").write_text('[[rules]]\nname = "x_high"\nmetric = "x"\ncondition = "above"\n'
                                         'threshold = 1.0\ncooldown = 1000\n')
    rc = alerts_cli(["--evaluate", str(tmp_path / "fails.csv"), str(tmp_path / "holds.csv"),
                     str(tmp_path / "noreward.csv"), "--rules", str(tmp_path / "rules.toml"), "--step-column",
                     "triage/step", "--format", "json", "--horizon", "20"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["horizon"] == 20
    assert [(r["run"], r["destabilised_at"], r["outcome_known"]) for r in out["runs"]] == [
        ("fails", 45, True), ("holds", None, True), ("noreward", None, False)]
    (x_high,) = [d for d in out["detectors"] if d["name"] == "x_high" and d["kind"] == "rule"]
    assert (x_high["warned"], x_high["timely"], x_high["held_warned"], x_high["lead_median"]) == (2, 1, 1, 20)
    # a label file overrides the reward: "holds" failed at step 30 (x fired at 25: timely), "fails" held
    (tmp_path / "labels.csv").write_text("run,failed_at,group\nholds,30,mine\nfails,,mine\n")
    assert read_labels(tmp_path / "labels.csv") == {"holds": (30, "mine"), "fails": (None, "mine")}
    run = load_run(tmp_path / "holds.csv", read_labels(tmp_path / "labels.csv"), step_column="triage/step")
    assert (run.destabilised_at, run.group) == (30, "mine")
    (tmp_path / "bad.csv").write_text("run,failed_at\nholds,3.5\n")
    with pytest.raises(ValueError, match=r"row 0: failed_at = 3.5 is not an integer step"):
        read_labels(tmp_path / "bad.csv")
    assert alerts_cli(["--evaluate", str(tmp_path / "noreward.csv"), "--step-column", "triage/step"]) == 2
    assert "no run has an outcome" in capsys.readouterr().err


def test_auroc_by_hand_and_a_step_level_score():
    assert auroc(np.array([1, 1, 0, 0], bool), np.array([0.9, 0.4, 0.5, 0.1])) == 0.75
    assert auroc(np.array([1, 0], bool), np.array([0.5, 0.5])) == 0.5
    # x is 2 on the 10 steps before each failure and 0 elsewhere: a perfect step-level predictor with H = 10
    runs = [EvalRun(f"f{i}", pd.DataFrame({"step": np.arange(60), "x": np.where(np.arange(60) >= 30 + i, 2.0, 0.0)}),
                    40 + i) for i in range(3)] + \
        [EvalRun(f"h{i}", pd.DataFrame({"step": np.arange(60), "x": np.zeros(60)}), None) for i in range(3)]
    a, lo, hi, pos, neg = metric_auroc(runs, lambda f: f["x"].to_numpy(), horizon=10, n_boot=50)
    assert (a, lo, hi) == (1.0, 1.0, 1.0) and pos == 3 * 11 and neg == (30 + 31 + 32) + 3 * 60


def test_calibration_never_picks_a_threshold_that_warns_on_a_quiet_run():
    runs = [_run("A", 100, [30], 50), _run("Q", 100, [10], None, group="nvfp4")]
    runs[1].frame.loc[10, "x"] = 1.5          # the quiet run's spike is lower than the failing run's (2.0)
    best, table = calibrate_threshold(runs, RULE, [1.0, 1.8, 2.5], horizon=30)
    assert best.threshold == 1.8
    assert list(table["quiet_warned"]) == [1, 0, 0] and list(table["timely"]) == [1, 1, 0]


def test_the_population_split_is_fixed_and_disjoint():
    from triage_monitor.demo.grpo import DemoConfig
    from triage_monitor.demo.population import (CALIBRATION_SEEDS, CONDITIONS, HELDOUT_SEEDS, plan_population,
                                                regime, split_of)
    assert not set(CALIBRATION_SEEDS) & set(HELDOUT_SEEDS) and not set(CALIBRATION_SEEDS + HELDOUT_SEEDS) & set(range(10))
    plan = plan_population(DemoConfig(), "/tmp/x")
    assert len(plan) == len(CONDITIONS) * 4 >= 60 and len(CONDITIONS) == 24
    assert plan == plan_population(DemoConfig(), "/tmp/x")
    halves = {split_of(seed) for _, seed in plan}
    assert halves == {"calibration", "heldout"}
    assert {regime(ov) for ov in CONDITIONS.values()} == {"fp32", "nvfp4", "stale"}
    assert {ov["sampler_lag"] for ov in CONDITIONS.values()} == {0, 2, 4, 8}
    assert {ov["correction"] for ov in CONDITIONS.values()} == {"none", "tis", "triage"}
    assert len({ov["lr"] for ov in CONDITIONS.values()}) >= 2
    cfg, path = plan[("nvfp4-lr0.001", 50)]
    assert (cfg.sampler_recipe, cfg.sampler_lag, cfg.correction, cfg.lr, cfg.seed, path.name) == (
        "nvfp4", 0, "none", 1e-3, 50, "nvfp4-lr0.001-s50")
    with pytest.raises(ValueError, match="seed 3 is in neither"):
        plan_population(DemoConfig(), "/tmp/x", seeds=[3])
