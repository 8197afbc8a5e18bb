"""Alert rules: hysteresis, cooldown, clearing, calibration, rewind; live == replay; defaults on
synthetic trajectories shaped like the published reference values (docs/metrics.md); rule files; the CLI."""

import json
import logging
import math

import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor.alerting.alerts import AlertEngine, CallbackSink, LoggingSink, Rule, default_rules, load_rules, replay
from triage_monitor.commands.alerts import main as alerts_cli


def run(rule_or_rules, values, steps=None, metric=None):
    """Feed ``values`` (one per step) for the rule's metric; return the fired steps per rule."""
    rules = [rule_or_rules] if isinstance(rule_or_rules, Rule) else rule_or_rules
    eng = AlertEngine(rules)
    steps = range(len(values)) if steps is None else steps
    for s, v in zip(steps, values):
        eng.observe(s, {metric or rules[0].metric: v})
    return [a.step for a in eng.fired]


def test_hysteresis_needs_hold_consecutive_steps():
    r = Rule("r", "window/x", "above", 1.0, hold=3)
    # streaks: 1,2,reset,1,2,3 -> fire at 6; 7 stays active; 8 clears; 9 starts a new streak
    assert run(r, [0, 2, 2, 0, 2, 2, 2, 2, 0, 2]) == [6]


def test_cooldown_delays_refiring_until_it_has_passed():
    r = Rule("r", "window/x", "above", 1.0, hold=1, cooldown=5)
    # fire at 0; 2 and 4 hold but are within 5 steps of 0; 5 holds and 5-0 >= 5 -> fire; 7 is within 5 of 5
    assert run(r, [2, 0, 2, 0, 2, 2, 0, 2]) == [0, 5]


def test_clearing_rearms_and_nan_does_not_clear(caplog):
    r = Rule("r", "window/x", "below", 0.0)
    assert run(r, [-1, -1, 1, -1]) == [0, 3]          # clears at 2, fires again at 3
    # NaN / missing: not evaluated, stays active for fewer than clear_after (default: hold) steps in a row
    assert run(Rule("r", "window/x", "below", 0.0, clear_after=2), [-1, math.nan, -1, None]) == [0]
    assert run(r, [-1, math.nan, -1]) == [0, 2]       # hold 1: one step without a value clears it, step 2 fires anew
    eng = AlertEngine([r])
    eng.observe(0, {"window/x": -1})
    assert eng.active == ["r"]
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        eng.observe(1, {"window/x": 1})
    assert eng.active == []
    # the clearing message must not read as if the condition still held
    assert "r cleared at step 1: no longer true that window/x = 1 is below 0" in caplog.text


def test_calibration_window_uses_median_of_first_n_steps():
    r = Rule("r", "window/x", "excess", 0.5, baseline_steps=4)
    # steps 100..103 calibrate (no alert even at 3.0); median baseline 1.0 (the mean, 1.5, would not fire)
    assert run(r, [1, 1, 3, 1, 1.6, 1.4, 1.7], steps=range(100, 107)) == [104, 106]
    assert run(Rule("r", "window/x", "excess", 0.5, baseline=1.5), [1, 1, 3, 1, 1.6]) == [2]
    rel = Rule("r", "window/x", "deficit", 0.25, baseline_steps=2, relative=True)
    assert run(rel, [2, 2, 1.6, 1.4]) == [3]          # (2-1.6)/2 = 0.2 no; (2-1.4)/2 = 0.3 yes


def test_rising_needs_monotone_chain_and_total_rise():
    r = Rule("r", "window/x", "rising", 0.5, window=2, k=2)
    # step 4: 1 -> 1.2 -> 1.8 (rise 0.8); step 5: 1 -> 1.2 -> 1.8 active; step 6: 1.8 -> 1.7 breaks -> clear;
    # step 7: 1.2 -> 1.8 -> 1.9 (rise 0.7) fires; step 8: 1.8 -> 1.7 -> 2.6 is not monotone -> clear
    assert run(r, [1, 1, 1.2, 1.2, 1.8, 1.8, 1.7, 1.9, 2.6]) == [4, 7]
    # k=1: step 7 rises only 0.1 over step 5; step 8 rises 0.9 over step 6
    r3 = Rule("r", "window/x", "rising", 0.5, window=2, k=1)
    assert run(r3, [1, 1, 1.2, 1.2, 1.8, 1.8, 1.7, 1.9, 2.6]) == [4, 8]
    f = Rule("r", "window/x", "falling", 0.1, window=1, k=2, relative=True)
    assert run(f, [1.0, 0.95, 0.85, 0.8]) == [2]      # (1-0.85)/1 = 0.15 > 0.1; step 3 stays active


def test_rising_over_k_windows_rejects_non_monotone_chain():
    r = Rule("r", "window/x", "rising", 0.5, window=2, k=2)
    assert run(r, [1, 1, 0.9, 0.9, 2, 2]) == []      # 1 -> 0.9 -> 2: rise 1.0 but not monotone


def test_trailing_aggregation_of_per_step_metric():
    r = Rule("r", "x", "above", 2.0, window=3, agg="mean")
    # trailing means over steps (t-3, t]: 1, 1.5, 2, 3, 4 -> fires at step 3
    assert run(r, [1, 2, 3, 4, 5]) == [3]
    mx = Rule("r", "x", "above", 4.5, window=3, agg="max")
    assert run(mx, [5, 1, 1, 1, 1]) == [0]            # max over (t-3, t] stays 5 until step 3 clears


@pytest.mark.parametrize("agg", ["max", "mean", "sum"])
def test_a_spike_leaves_the_rules_window_after_exactly_w_steps(agg):
    """A spike at step 2 in a flat series, window w = 3: the rule's trailing value holds the spike at steps 2, 3, 4
    (windows (t − 3, t]) and not at step 5, so it fires at 2 and clears at 5 exactly — not at 6 (a window of
    w + 1 steps), not at 4 (w − 1).  The data differs across every window boundary (docs/testing.md#test-data)."""
    r = Rule("r", "x", "above", 4.0, window=3, agg=agg)
    eng = AlertEngine([r])
    values = [0.0, 0.0, 30.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    for s, v in enumerate(values):
        eng.observe(s, {"x": v})
    assert [a.step for a in eng.fired] == [2] and [c.step for c in eng.cleared] == [5]


def test_a_rising_rule_looks_back_exactly_one_window():
    """A strictly rising series with a different value at every step (0, 1, 3, 6, 10, 15), window 2, k = 1: the
    look-back of step t is step t − 2 itself, so the rule first evaluates at step 2 and fires there with the rise
    v(2) − v(0) = 3 (a look-back one step short or long would give 2 or 5 and evaluate at another step)."""
    r = Rule("r", "window/x", "rising", 2.5, window=2, k=1)
    eng = AlertEngine([r])
    for s, v in enumerate([0.0, 1.0, 3.0, 6.0, 10.0, 15.0]):
        eng.observe(s, {"window/x": v})
    (a,) = eng.fired
    assert (a.step, a.value) == (2, 3.0)


def test_trailing_sum_respects_step_gaps():
    s = Rule("r", "x", "above", 6.5, window=3, agg="sum")
    # steps 0,1,2: sum 6; step 10: window (7,10] holds only 4; step 11: 4+5 = 9 > 6.5
    assert run(s, [1, 2, 3, 4, 5], steps=[0, 1, 2, 10, 11]) == [11]


def test_repeated_step_replaces_history():
    r = Rule("r", "window/x", "above", 1.0, hold=2)
    eng = AlertEngine([r])
    for s, v in [(0, 0), (1, 2), (2, 0), (1, 2), (2, 2)]:
        eng.observe(s, {"window/x": v})
    # after the repeat of step 1 the history is 0:0, 1:2, 2:2 -> fires at 2 (hold 2)
    assert [a.step for a in eng.fired] == [2]
    fresh = AlertEngine([r])
    for s, v in [(0, 0), (1, 2), (2, 2)]:
        fresh.observe(s, {"window/x": v})
    assert eng.state_dict() == fresh.state_dict()


def test_state_dict_round_trip_continues_identically():
    rules = [Rule("e", "window/x", "excess", 0.5, baseline_steps=3, hold=2)]
    vals = [1, 1, 1, 1.2, 2, 2, 2, 1, 2, 2]
    a = AlertEngine(rules)
    for s, v in enumerate(vals[:5]):
        a.observe(s, {"window/x": v})
    b = AlertEngine(rules)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.fired == []                                # rebuilding sends nothing
    rest_a = [x for s, v in enumerate(vals[5:], 5) for x in a.observe(s, {"window/x": v})]
    rest_b = [x for s, v in enumerate(vals[5:], 5) for x in b.observe(s, {"window/x": v})]
    assert [x.to_row() for x in rest_a] == [x.to_row() for x in rest_b] == [x.to_row() for x in a.fired]
    assert [x.step for x in a.fired] == [5, 9]


def test_alert_row_and_text_name_metric_value_threshold_window_step():
    r = Rule("rho_high", "window/rho_asym", "above", 1.45, window=25, level="ERROR", note="why.")
    eng = AlertEngine([r])
    (a,) = eng.observe(7, {"window/rho_asym": 2.319})
    row = a.to_row()
    assert row == {"step": 7, "rule": "rho_high", "metric": "window/rho_asym", "value": 2.319,
                   "threshold": 1.45, "window": 25, "level": "ERROR", "title": "triage ERROR (collapse): rho_high",
                   "text": a.text, "tier": "collapse"}
    for part in ("window/rho_asym", "2.319", "1.45", "25-step window", "step 7", "why."):
        assert part in a.text


def test_failing_sink_reported_once_and_others_still_called(caplog):
    got = []

    class Broken:
        def emit(self, alert):
            raise RuntimeError("sink down")

    r = Rule("r", "window/x", "above", 0.0)
    eng = AlertEngine([r], sinks=[Broken(), CallbackSink(got.append), LoggingSink()])
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        for s, v in enumerate([1, -1, 1, -1, 1]):
            eng.observe(s, {"window/x": v})
        eng.close()
    assert [a.step for a in got] == [0, 2, 4]
    failures = [rec for rec in caplog.records if "failed on" in rec.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert any("failed 3 times" in rec.getMessage() for rec in caplog.records)
    assert sum(rec.levelno == logging.WARNING and "triage WARN (collapse): r" in rec.getMessage()
               for rec in caplog.records) == 3


def test_rule_validation_names_field_and_value():
    with pytest.raises(ValueError, match=r"condition='sideways'"):
        Rule("r", "x", "sideways", 1.0)
    with pytest.raises(ValueError, match=r"hold=0"):
        Rule("r", "x", "above", 1.0, hold=0)
    with pytest.raises(ValueError, match=r"threshold=nan"):
        Rule("r", "x", "above", float("nan"))
    with pytest.raises(ValueError, match=r"step=1.5"):
        AlertEngine([Rule("r", "x", "above", 1.0)]).observe(1.5, {})


# ------------------------------------------------------------------------------------ rule files
TOML = """
[[rules]]
name = "a"
metric = "window/rho_asym"
condition = "rising"
threshold = 0.1
window = 25
k = 3
relative = true
level = "ERROR"
"""
YAML = """
rules:
  - {name: a, metric: window/rho_asym, condition: rising, threshold: 0.1, window: 25, k: 3,
     relative: true, level: ERROR}
"""


def test_toml_and_yaml_rules_agree(tmp_path):
    (tmp_path / "r.toml").write_text(TOML)
    (tmp_path / "r.yaml").write_text(YAML)
    a, b = load_rules(tmp_path / "r.toml"), load_rules(tmp_path / "r.yaml")
    assert a == b == [Rule("a", "window/rho_asym", "rising", 0.1, window=25, k=3, relative=True, level="ERROR")]


def test_rule_file_errors_name_file_index_and_field(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(TOML + '\n[[rules]]\nname = "b"\nmetric = "x"\ncondition = "above"\nthreshold = 1\nhodl = 3\n')
    with pytest.raises(ValueError, match=r"bad.toml: rules\[1\]: unknown field\(s\) \['hodl'\]"):
        load_rules(p)
    p.write_text(TOML.replace('"ERROR"', '"PANIC"'))
    with pytest.raises(ValueError, match=r"rules\[0\].*level='PANIC'"):
        load_rules(p)
    p.write_text(TOML + TOML)
    with pytest.raises(ValueError, match="duplicate rule name"):
        load_rules(p)


def test_default_rules_cover_the_issue_list():
    rules = {r.name: r for r in default_rules()}
    want = {("window/rho_asym", "above"), ("window/rho_asym", "rising"), ("window/c_tok", "excess"),
            ("window/small_gap_share", "falling"), ("window/delta_q05", "below"), ("window/k3_kl", "rising"),
            ("nonfinite_count", "above"), ("gate_downweighted_frac", "rising")}
    assert want <= {(r.metric, r.condition) for r in rules.values()}
    assert rules["rho_asym_high"].threshold > 1.337 and rules["rho_asym_high"].threshold < 1.488


# ------------------------------------------------------------------------- synthetic trajectories
W = 25


def _interp(anchors, steps):
    xs, ys = zip(*anchors)
    return np.interp(steps, xs, ys)


def synthetic_history(kind: str, n_steps: int = 301, seed: int = 0) -> pd.DataFrame:
    """Per-step metrics and their 25-step trailing windows (pooled sums for rho_asym).

    ``trajectory``: window/rho_asym passes 1.02 (step 75, healthy), 1.50 (150, drift), 2.32 (225,
    pre-terminal) like the dense-4B reference; small_gap_share stays >= 0.83 until pre-terminal and
    magnitude metrics only move at the terminal collapse (docs/metrics.md#magnitude).  ``flat``: healthy throughout.
    """
    rng = np.random.default_rng(seed)
    steps = np.arange(n_steps)
    # per-step anchors are shifted by half a window so the trailing window hits the reference values
    lag = W // 2
    if kind == "trajectory":
        rho = _interp([(0, 1.02), (75 - lag, 1.02), (150 - lag, 1.50), (225 - lag, 2.32), (300 - lag, 1.94)], steps)
        sgs = _interp([(0, 0.92), (225, 0.86), (260, 0.84), (300, 0.55)], steps)
        q05 = _interp([(0, -0.24), (225, -0.30), (260, -0.6), (300, -42.75)], steps)
        k3 = _interp([(0, 1e-3), (225, 1.2e-3), (260, 3e-3), (300, 5e-2)], steps)
        ctok = _interp([(0, 0.2156), (75, 0.2156), (150, 0.2574), (225, 0.2568), (300, 0.1513)], steps)
        gate = _interp([(0, 0.010), (225, 0.014), (300, 0.30)], steps)
    else:
        rho, sgs, q05, k3, ctok, gate = (np.full(n_steps, v) for v in (1.023, 0.92, -0.24, 1e-3, 0.2156, 0.01))
    amp_pos = 100.0 * (1 + 0.1 * rng.standard_normal(n_steps))
    amp_neg = rho * 100.0 * (1 + 0.1 * rng.standard_normal(n_steps))
    per = {
        "mass_amp_pos": amp_pos, "mass_amp_neg": amp_neg, "rho_asym": amp_neg / amp_pos,
        "small_gap_share": sgs + 0.01 * rng.standard_normal(n_steps),
        "delta_q05": q05 * (1 + 0.05 * rng.standard_normal(n_steps)),
        "k3_kl": k3 * (1 + 0.1 * rng.standard_normal(n_steps)),
        "c_tok": ctok + 0.02 * rng.standard_normal(n_steps),
        "gate_downweighted_frac": gate + 0.003 * rng.standard_normal(n_steps),
        "nonfinite_count": np.zeros(n_steps),
    }
    df = pd.DataFrame({"step": steps, **per})
    roll = df.rolling(W, min_periods=1)
    sums = roll.sum()
    df["window/rho_asym"] = sums["mass_amp_neg"] / sums["mass_amp_pos"]
    means = roll.mean()
    for m in ("small_gap_share", "delta_q05", "k3_kl", "c_tok"):
        df["window/" + m] = means[m]
    return df


GROUPS = {r.name: r.group for r in default_rules()}


def test_synthetic_trajectory_matches_reference_shape():
    df = synthetic_history("trajectory").set_index("step")
    for step, ref in ((75, 1.02), (150, 1.50), (225, 2.32)):
        assert abs(df.loc[step, "window/rho_asym"] - ref) < 0.08
    assert df.loc[:225, "window/small_gap_share"].min() >= 0.83


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_defaults_fire_on_direction_before_magnitude(seed):
    alerts = replay(None, synthetic_history("trajectory", seed=seed))
    first = {}
    for a in alerts:
        first.setdefault(GROUPS[a.rule], a.step)
    # the direction rules fire during the drift phase; magnitude only at the terminal collapse
    assert first["direction"] <= 150
    assert "magnitude" in first, "magnitude rules never fired: the comparison would be vacuous"
    assert first["direction"] < first["magnitude"]
    assert first["magnitude"] > 225
    fired_rules = {a.rule for a in alerts}
    assert {"rho_asym_rising", "rho_asym_high", "rho_asym_critical"} <= fired_rules
    rising = next(a for a in alerts if a.rule == "rho_asym_rising")
    high = next(a for a in alerts if a.rule == "rho_asym_high")
    assert rising.step < high.step                    # the rise is visible before the level is crossed


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_defaults_silent_on_flat_healthy_history(seed):
    assert replay(None, synthetic_history("flat", n_steps=600, seed=seed)) == []


def test_nonfinite_rule_fires_on_first_count():
    df = synthetic_history("flat", n_steps=60)
    df.loc[40, "nonfinite_count"] = 3
    alerts = replay(None, df)
    assert [(a.rule, a.step, a.level, a.value) for a in alerts] == [("nonfinite_logp", 40, "ERROR", 3.0)]


# ------------------------------------------------------------------------------- live == replay
def _rows(alerts):
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in a.to_row().items()}
            for a in alerts]


def test_live_and_replay_identical_including_resume():
    """Agreement test: live engine vs ``replay``, both use ``AlertEngine``; the independent checks are the
    hand-worked hysteresis / cooldown / score tests above and tests/test_constants_alerts.py."""
    df = synthetic_history("trajectory", seed=5)
    # a resumed job: steps 200..230 are seen, then the job restarts from step 210 with new values
    resumed = df[df.step.between(210, 230)].copy()
    resumed["window/rho_asym"] *= 0.9
    seq = pd.concat([df[df.step <= 230], resumed, df[df.step > 230]], ignore_index=True)
    live_got = []
    eng = AlertEngine(default_rules(), sinks=[CallbackSink(live_got.append)])
    live = []
    for row in seq.to_dict("records"):
        step = int(row.pop("step"))
        live += eng.observe(step, row)
    eng.close()
    assert live_got == live and len(live) >= 4
    assert _rows(replay(default_rules(), seq)) == _rows(live)


# ------------------------------------------------------------------------------------------- CLI
def _write_steps(run_dir, df, attempt):
    """Steps rows as a run directory holds them (triage_monitor.layout, triage_monitor.blocks): run.json + a block
    of the steps of ``df`` for ranks 0 and 1 of ``attempt``."""
    import pyarrow as pa
    from triage_monitor.rundir.blocks import write_parquet
    from triage_monitor.rundir.layout import RunLayout
    from triage_monitor.rundir.storage import open_store
    store = open_store(run_dir)
    store.write_bytes("run.json", b'{"schema_version": 4, "tool": "triage-monitor"}')
    steps = df["step"].astype(int)
    for rank in (0, 1):
        rows = [{**row, "step": int(row["step"]), "rank": rank, "attempt": attempt} for row in df.to_dict("records")]
        write_parquet(store, RunLayout.block("steps", int(steps.min()), int(steps.max()), rank, attempt, 0),
                      pa.Table.from_pylist(rows))


def test_cli_run_dir_and_wandb_csv_match_replay(tmp_path, capsys):
    """Agreement test: the CLI on a run directory and on a W&B CSV vs ``replay``, all use ``AlertEngine``;
    independent checks: the hand-worked rule tests above and tests/test_constants_alerts.py."""
    df = synthetic_history("trajectory", n_steps=240, seed=3)
    # a resumed job rewrote steps 120..139 under a later attempt: the reader keeps the later values
    _write_steps(tmp_path / "run", df, attempt=1)
    df.loc[df.step.between(120, 139), "window/rho_asym"] += 0.5
    _write_steps(tmp_path / "run", df[df.step.between(120, 139)], attempt=2)
    expected = _rows(replay(None, df))
    assert expected and expected != _rows(replay(None, synthetic_history("trajectory", n_steps=240, seed=3)))
    assert alerts_cli([str(tmp_path / "run"), "--format", "json"]) == 1          # alerts fired: a finding
    out = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["rule"]) for r in out] == [(r["step"], r["rule"]) for r in expected]
    # a W&B history export: triage/ prefixed columns, triage/step, W&B's own columns
    wb = df.rename(columns=lambda c: "triage/" + c)
    wb.insert(0, "_step", np.arange(len(wb)) + 1000)
    wb.to_csv(tmp_path / "hist.csv", index=False)
    assert alerts_cli(["--from-csv", str(tmp_path / "hist.csv"), "--step-column", "triage/step",
                       "--format", "csv"]) == 1
    got = pd.read_csv(__import__("io").StringIO(capsys.readouterr().out))
    assert list(zip(got.step, got.rule)) == [(r["step"], r["rule"]) for r in expected]
    # the table format prints, and a custom rules file is honoured
    (tmp_path / "r.toml").write_text('[[rules]]\nname="hi"\nmetric="rho_asym"\ncondition="above"\n'
                                     'threshold=1.4\nwindow=5\nhold=2\n')
    assert alerts_cli(["--from-csv", str(tmp_path / "hist.csv"), "--rules", str(tmp_path / "r.toml")]) == 1
    assert "hi" in capsys.readouterr().out


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert alerts_cli([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    # a run and a CSV at once: refused, not one of the two silently
    pd.DataFrame({"step": [0], "rho_asym": [1.0]}).to_csv(tmp_path / "one.csv", index=False)
    assert alerts_cli([str(tmp_path / "nope"), "--from-csv", str(tmp_path / "one.csv")]) == 2
    assert "not both" in capsys.readouterr().err
    # no alert fired: 0
    assert alerts_cli(["--from-csv", str(tmp_path / "one.csv")]) == 0
    pd.DataFrame({"x": [1]}).to_csv(tmp_path / "h.csv", index=False)
    assert alerts_cli(["--from-csv", str(tmp_path / "h.csv")]) == 2
    assert "no step column 'step'" in capsys.readouterr().err


def test_live_monitor_run_and_cli_replay_agree(tmp_path, capsys):
    """Agreement test (both use ``AlertEngine``; independent checks: tests/test_constants_alerts.py).

    The real MismatchMonitor writes alerts/ from the live engine; replaying the run directory
    with the same rules (CLI) gives the same alerts."""
    import torch

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text("""
rules:
  - {name: gap_rising, metric: window/delta_abs_mean, condition: rising, threshold: 0.2, relative: true,
     window: 4, k: 2, hold: 2, level: WARN}
  - {name: nonfinite, metric: nonfinite_count, condition: above, threshold: 0, level: ERROR}
  - {name: q05_low, metric: window/delta_q05, condition: below, threshold: -1.0, hold: 3, level: ERROR}
""")
    eng = AlertEngine(load_rules(rules_file))
    g = torch.Generator().manual_seed(1)
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=4, calibration_steps=4), alerts=eng) as mon:
        for step in range(30):
            scale = 0.05 if step < 12 else 0.05 * 1.3 ** (step - 11)
            sampler = -torch.rand(8, 16, generator=g) * 3 - 0.01
            learner = (sampler + torch.randn(8, 16, generator=g) * scale).clamp(max=0.0)
            if step == 20:
                learner[3, 5] = float("-inf")
            adv = torch.linspace(-1, 1, 8)
            mon.log_step(step, TokenBatch.from_padded(learner, sampler, adv, torch.ones(8, 16, dtype=torch.bool),
                                                      on_invalid="quarantine"))
    live = [(a.step, a.rule) for a in eng.fired]
    assert {r for _, r in live} == {"gap_rising", "nonfinite", "q05_low"} and (20, "nonfinite") in live
    table = open_run(tmp_path / "run").alerts()
    assert sorted(zip(table["step"], table["rule"])) == sorted(live)
    assert alerts_cli([str(tmp_path / "run"), "--rules", str(rules_file), "--format", "json"]) == 1
    replayed = [(r["step"], r["rule"]) for r in json.loads(capsys.readouterr().out)]
    assert replayed == live


def test_replay_skips_rows_without_step_and_names_bad_columns():
    r = Rule("r", "window/x", "above", 1.0)
    # a W&B export interleaves rows logged by other code (no triage/step): they are skipped
    df = pd.DataFrame({"triage/step": [0, None, 1, None, 2], "triage/window/x": [0, 5, 2, "NaN", 3]})
    assert [a.step for a in replay([r], df)] == [1]
    with pytest.raises(ValueError, match=r"column 'window/x' is not numeric \(row 1 = 'oops'\)"):
        replay([r], pd.DataFrame({"step": [0, 1], "window/x": ["1", "oops"]}))
    with pytest.raises(ValueError, match=r"step\[row 1\] = 1.5 is not an integer step"):
        replay([r], pd.DataFrame({"step": [0, 1.5], "window/x": [1, 2]}))
    with pytest.raises(ValueError, match=r"step\[row 0\] = abc is not an integer step"):
        replay([r], pd.DataFrame({"step": ["abc"], "window/x": [1]}))


def test_without_wandb_everything_works_and_says_so_once(monkeypatch, caplog):
    """Runs whether or not wandb is installed (test_wandb.py is skipped without it)."""
    import sys

    from triage_monitor.alerting import wandb_logger
    from triage_monitor.alerting.wandb_logger import WandbAlertSink, WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)       # `import wandb` now raises ImportError
    monkeypatch.setattr(wandb_logger, "_missing_reported", False)
    got = []
    with caplog.at_level(logging.WARNING, logger="triage_monitor.wandb"):
        lg = WandbLogger()
        sink = WandbAlertSink(lg)
        eng = AlertEngine([Rule("r", "x", "above", 0.0)], sinks=[sink, CallbackSink(got.append)])
        for step in range(3):
            lg.log_metrics(step, {"x": 1.0})
            eng.observe(step, {"x": 1.0})
        lg.log_config({"a": 1})
        lg.close()
        eng.close()
        WandbLogger()
    assert lg.run is None and [a.step for a in got] == [0]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "wandb is not installed" in msgs[0]


# ---------------------------------------------------------------- what the engine reports in the log
class _FailingSink:
    """A sink whose ``emit`` raises (``fails`` times, then works) and whose ``close`` may raise."""

    def __init__(self, fails=10 ** 9, close_raises=False):
        self.fails, self.close_raises, self.closed, self.got = fails, close_raises, False, []

    def emit(self, alert):
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError("sink down")
        self.got.append(alert.step)

    def close(self):
        self.closed = True
        if self.close_raises:
            raise OSError("cannot close")

    def __repr__(self):
        return "<FailingSink>"


def _fire_every_other_step(eng, n=5):
    for s, v in enumerate([1, -1, 1, -1, 1][:n]):
        eng.observe(s, {"window/x": v})


def test_a_sink_failing_once_is_reported_with_its_traceback_and_not_counted_at_close(caplog):
    """One failure: one warning naming the sink and the rule, with the exception attached; no "failed N times"
    summary at close (that is for repeated failures); the sink is closed and gets the later alerts."""
    sink = _FailingSink(fails=1)
    eng = AlertEngine([Rule("r", "window/x", "above", 0.0)], sinks=[sink])
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        _fire_every_other_step(eng)
        eng.close()
    msgs = [rec.getMessage() for rec in caplog.records]
    failed = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert [rec.getMessage() for rec in failed] == [
        "alerts: sink <FailingSink> failed on r; skipped (further failures of this sink are counted, not reported)"]
    assert failed[0].exc_info[0] is RuntimeError
    assert not any("times" in m for m in msgs)
    assert sink.closed and sink.got == [2, 4]


def test_repeated_sink_failures_and_a_failing_close_are_summarised(caplog):
    """Two failures: one warning at the first, "failed 2 times" at close; a close that raises is reported with its
    traceback and does not stop the engine from closing."""
    sink = _FailingSink(fails=2, close_raises=True)
    eng = AlertEngine([Rule("r", "window/x", "above", 0.0)], sinks=[sink])
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        _fire_every_other_step(eng)
        eng.close()
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert [rec.getMessage() for rec in warnings] == [
        "alerts: sink <FailingSink> failed on r; skipped (further failures of this sink are counted, not reported)",
        "alerts: closing sink <FailingSink> failed",
        "alerts: sink <FailingSink> failed 2 times"]
    assert warnings[1].exc_info[0] is OSError
    assert sink.got == [4]


def test_close_names_the_rules_that_never_saw_a_finite_value(caplog):
    """Rules "seen" (finite values) and "never" (only NaN / missing): close() lists exactly ["never"]; an engine that
    observed no step lists nothing."""
    rules = [Rule("seen", "window/x", "above", 5.0), Rule("never", "window/y", "above", 5.0)]
    eng = AlertEngine(rules)
    eng.observe(0, {"window/x": 1.0, "window/y": float("nan")})
    eng.observe(1, {"window/x": 2.0})
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        eng.close()
        AlertEngine(rules).close()
    assert [rec.getMessage() for rec in caplog.records] == [
        "alerts: rule(s) ['never'] never saw a finite value of their metric"]


def test_logging_sink_logs_title_and_text_at_the_alert_level(caplog):
    r = Rule("r", "window/x", "above", 0.0, level="ERROR")
    eng = AlertEngine([r], sinks=[LoggingSink()])
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        (a,) = eng.observe(3, {"window/x": 2.5})
    (rec,) = caplog.records
    assert rec.levelno == logging.ERROR and rec.getMessage() == f"triage ERROR (collapse): r: {a.text}"
    assert a.text.startswith("window/x = 2.5 is above 0 at step 3")


def test_rewind_is_logged_with_the_repeated_and_the_last_step(caplog):
    eng = AlertEngine([Rule("r", "window/x", "above", 0.0)])
    for s in (3, 5, 7):
        eng.observe(s, {"window/x": -1.0})
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        eng.observe(5, {"window/x": -1.0})
    assert [rec.getMessage() for rec in caplog.records] == [
        "alerts: step 5 repeats (last seen 7): replacing history from step 5 on"]
    assert eng.state_dict()["steps"] == [3, 5]


def test_callback_sink_refuses_a_non_callable():
    with pytest.raises(TypeError, match=r"^CallbackSink: fn=3 is not callable$"):
        CallbackSink(3)


def test_replay_reads_the_named_step_column_and_defaults_to_step():
    from triage_monitor.alerting.alerts import pd_numeric, replay_engine
    r = Rule("r", "window/x", "above", 1.0)
    df = pd.DataFrame({"global_step": [10, 11, 12], "window/x": [0, 2, 3]})
    assert [a.step for a in replay([r], df, "global_step")] == [11]
    assert [a.step for a in replay_engine([r], df.rename(columns={"global_step": "step"})).fired] == [11]
    # integer metric columns are read as float64
    out = pd_numeric(pd.Series([1, 2, 3]))
    assert out.dtype == np.float64 and out.tolist() == [1.0, 2.0, 3.0]


def test_last_aggregation_takes_the_newest_finite_value_of_the_window():
    """agg="last" over a 3-step window of a per-step metric: the newest finite value (steps 2..4 hold 5, 1, NaN →
    1), not the oldest, not the one before the newest."""
    r = Rule("r", "x", "above", 3.0, window=3, agg="last")
    eng = AlertEngine([r])
    for s, v in enumerate([0.0, 0.0, 5.0, 1.0, math.nan]):
        eng.observe(s, {"x": v})
    assert eng._vals["r"] == [0.0, 0.0, 5.0, 1.0, 1.0]
    assert [a.step for a in eng.fired] == [2]


def test_full_window_lookback_waits_for_the_first_full_window():
    """rising, window 3, k = 1, full_window: the look-back t − 3 is a reference from t − 3 ≥ first + 3 − 1 = 2 on, so
    with a steady rise (value = step) the first alert is at step 5 (chain 2 → 5), not earlier, not later."""
    r = Rule("r", "window/x", "rising", 2.5, window=3, k=1, full_window=True)
    assert run(r, [float(s) for s in range(8)]) == [5]
    r = Rule("r", "window/x", "rising", 2.5, window=3, k=1)
    assert run(r, [float(s) for s in range(8)]) == [3]          # without full_window: from the first step on


def test_noise_guard_boundary_restart_and_recorded_steps():
    """Guard metric ≥ guard_min is evaluated (exactly at guard_min too); below it the step is noise: recorded in
    noise_steps, the streak restarts from 0 and an active alert re-arms."""
    r = Rule("r", "window/x", "above", 1.0, hold=2, guard_metric="window/g", guard_min=0.5)
    eng = AlertEngine([r])
    seq = [(0, 2.0, 0.5), (1, 2.0, 0.5), (2, 2.0, 0.1), (3, 2.0, 0.9), (4, 2.0, 0.9)]
    fired = [s for s, x, g in seq if eng.observe(s, {"window/x": x, "window/g": g})]
    # fires at 1 (hold 2, the guard exactly at 0.5 counts), noise at 2 re-arms, fires again after 2 more steps
    assert fired == [1, 4]
    assert eng.noise_steps == {"r": [2]}


def test_titles_are_cut_to_64_characters_and_carry_the_rule_wait():
    """The W&B alert title is ``triage <LEVEL>: <name>`` cut to 64 characters; wait_s comes from the rule."""
    name = "n" * 80
    (a,) = AlertEngine([Rule(name, "window/x", "above", 0.0, wait_s=30)]).observe(0, {"window/x": 1.0})
    assert a.title == ("triage WARN (collapse): " + name)[:64] and len(a.title) == 64
    assert a.wait_s == 30.0


def test_clearing_and_missing_baseline_messages(caplog):
    r = Rule("r", "window/x", "below", 0.0)
    eng = AlertEngine([r, Rule("b", "window/y", "excess", 1.0, baseline_steps=3)])
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        for s, x in enumerate([-1.0, 1.0, 2.0, 3.0]):
            eng.observe(s, {"window/x": x, "window/y": math.nan})
    assert [rec.getMessage() for rec in caplog.records] == [
        "alerts: r cleared at step 1: no longer true that window/x = 1 is below 0",
        "alerts: rule b: no finite window/y in the first 3 steps; it will not evaluate"]


def test_replay_counts_the_rows_it_skips_and_lists_20_columns(caplog):
    r = Rule("r", "window/x", "above", 1.0)
    df = pd.DataFrame({"step": [None, 0, None, 1], "window/x": [9, 0, 9, 2]})
    with caplog.at_level(logging.INFO, logger="triage_monitor.alerts"):
        assert [a.step for a in replay([r], df)] == [1]
    assert [rec.getMessage() for rec in caplog.records] == ["replay: skipped 2 row(s) without a step value"]
    wide = pd.DataFrame({f"c{i:02d}": [0] for i in range(25)})
    with pytest.raises(ValueError, match=r"no step column 'step'; columns: \['c00', .*'c19'\]$"):
        replay([r], wide)


def test_alert_text_states_the_steps_actually_pooled():
    """A window value pools the steps the monitor has seen, up to its window: at step 8 of a run that started at 0,
    9 of the 25; at step 40, the whole window 16–40; a per-step metric aggregated by the engine says how."""
    eng = AlertEngine([Rule("w", "window/x", "above", 0.5, window=25, cooldown=0)])
    texts = {}
    for s in range(41):
        for a in eng.observe(s, {"window/x": 1.0 if s in (8, 40) else 0.0}):
            texts[s] = a.text
    assert texts[8] == "window/x = 1 is above 0.5 at step 8 (pooled over steps 0–8 (9 of a 25-step window); held 1 step)."
    assert "(pooled over steps 16–40 (25 of a 25-step window); held 1 step)" in texts[40]
    eng = AlertEngine([Rule("m", "x", "above", 0.5, window=4, agg="max")])
    (a,) = [a for s in (10, 12, 13) for a in eng.observe(s, {"x": float(s == 13)})]
    assert a.text == "x = 1 is above 0.5 at step 13 (max over steps 10–13 (3 of a 4-step window); held 1 step)."


def test_alert_texts_of_the_baseline_and_trend_conditions():
    """The text states the value, the score with its unit, the direction word, the reference and the threshold."""
    tail = " (held 1 step)."
    (a,) = AlertEngine([Rule("e", "window/x", "excess", 0.5, baseline=2.0, relative=True)]).observe(
        0, {"window/x": 3.5})
    assert a.value == 0.75 and a.text == ("window/x = 3.5 is 0.75 (relative) above its baseline 2 (first 50 steps; "
                                          "threshold 0.5) at step 0" + tail)
    (a,) = AlertEngine([Rule("d", "window/x", "deficit", 0.5, baseline=2.0)]).observe(0, {"window/x": 1.0})
    assert a.text == "window/x = 1 is 1 below its baseline 2 (first 50 steps; threshold 0.5) at step 0" + tail
    eng = AlertEngine([Rule("r", "window/x", "rising", 0.5, k=1)])
    eng.observe(0, {"window/x": 1.0})
    (a,) = eng.observe(1, {"window/x": 2.0})
    assert a.text == "window/x rose 1 -> 2 over 1 window(s) of 1 steps (change 1, threshold 0.5) at step 1" + tail
    eng = AlertEngine([Rule("f", "window/x", "falling", 0.2, k=1, relative=True)])
    eng.observe(0, {"window/x": 2.0})
    (a,) = eng.observe(1, {"window/x": 1.0})
    assert a.text == ("window/x fell 2 -> 1 over 1 window(s) of 1 steps (change 0.5 (relative), threshold 0.2) "
                      "at step 1" + tail)


def test_relative_score_against_a_zero_or_unit_baseline():
    """A relative score against a baseline of 0 is undefined (the step is not evaluated, nothing raises); against 1 it
    is the plain difference."""
    assert AlertEngine([Rule("z", "window/x", "excess", 0.5, baseline=0.0, relative=True)]).observe(
        0, {"window/x": 9.0}) == []
    (a,) = AlertEngine([Rule("u", "window/x", "excess", 0.5, baseline=1.0, relative=True)]).observe(
        0, {"window/x": 2.0})
    assert a.value == 1.0


def test_a_repeated_step_replaces_the_last_one_and_duplicate_rule_names_are_named():
    """A resumed job logs its last step again: the engine keeps one row for it (the new values)."""
    eng = AlertEngine([Rule("r", "window/x", "below", 0.0)])
    for step, x in ((0, 1.0), (1, 2.0), (1, 3.0)):
        eng.observe(step, {"window/x": x})
    assert eng.state_dict() == {"steps": [0, 1], "metrics": {"window/x": [1.0, 3.0]}}
    with pytest.raises(ValueError, match=r"AlertEngine: duplicate rule names in \['r', 'r'\]"):
        AlertEngine([Rule("r", "window/x", "below", 0.0), Rule("r", "window/x", "above", 1.0)])


# ------------------------------------------------------------------------------------------ tiers
def test_every_shipped_rule_has_a_tier_and_the_direction_rules_are_not_the_mismatch_detector():
    """Two tiers (docs/alerts.md#tiers): each shipped rule says whether it reports the mismatch itself (informational)
    or warns of a coming collapse; the staleness detector delta_q05_low is a mismatch-tier rule."""
    from triage_monitor.alerting.alert_rules import TIERS
    rules = {r.name: r for r in default_rules()}
    assert all(r.tier in TIERS for r in rules.values())
    assert rules["delta_q05_low"].tier == "mismatch" and rules["records_dropped"].tier == "mismatch"
    assert {r.tier for r in rules.values()} == set(TIERS)
    with pytest.raises(ValueError, match=r"tier='severe' must be one of \('mismatch', 'collapse'\)"):
        Rule("x", "m", "above", 1.0, tier="severe")


def test_the_tier_reaches_the_alert_its_title_and_the_alerts_table(tmp_path):
    """A mismatch-tier and a collapse-tier rule firing at one step: each alert, its title and the run's alerts table
    carry their own tier (an engine that stamped one tier on every alert fails)."""
    from triage_monitor import MismatchMonitor, MonitorConfig, TokenBatch
    from triage_monitor.offline.analysis import open_run
    rules = [Rule("gap", "n_tokens", "above", 0, tier="mismatch"), Rule("boom", "n_tokens", "above", 0)]
    (a, b) = AlertEngine(rules).observe(3, {"n_tokens": 5.0})
    assert (a.tier, a.title, b.tier, b.title) == ("mismatch", "triage WARN (mismatch): gap", "collapse",
                                                  "triage WARN (collapse): boom")
    d = tmp_path / "run"
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), alerts=rules)
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    mon.log_step(0, TokenBatch.from_padded(lp, lp - 0.1, torch.tensor([1.0]), torch.ones(1, 3)))
    mon.close()
    got = open_run(d).alerts()
    assert sorted(zip(got["rule"], got["tier"])) == [("boom", "collapse"), ("gap", "mismatch")]
