"""Live warning: the monitor's alerts= setting, the rule status, the verdict, the curated tracker keys, and the
hook settings that carry them into worker processes."""

import json
import logging
import math
import pickle

import pandas as pd
import pytest
import torch

from triage_monitor.alerting.alert_rules import Rule
from triage_monitor.alerting.alerts import AlertEngine, CallbackSink, build_engine, replay_engine
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.alerting.trackers import CURATED_KEYS, TrackerSpec, framework_metrics, select_metrics, specs_of
from triage_monitor.offline.verdict import health_verdict


def biased(step, B=16, T=64, shift=-0.3):
    """A step whose learner rates tokens lower than the sampler (δ ~ N(shift, 0.3)): most A<0 mass amplifying,
    little A>0 mass amplifying, so window ρ_asym ≫ 1.8 for shift −0.3 (≈ 1 for shift 0)."""
    g = torch.Generator().manual_seed(step)
    s = -3 * torch.rand(B, T, generator=g) - 0.01
    lp = (s + shift + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-6)
    adv = torch.randn(B, generator=g)
    return TokenBatch.from_padded(lp, s, adv, torch.ones(B, T, dtype=torch.bool))


class Tracker:
    def __init__(self):
        self.rows, self.alerts, self.closed = [], [], False

    def log_metrics(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def emit(self, alert):
        self.alerts.append((alert.step, alert.rule))

    def close(self):
        self.closed = True


# ------------------------------------------------------------------------------------------ monitor
def test_the_default_rules_run_without_being_asked_and_reach_log_table_and_trackers(tmp_path, caplog):
    """MismatchMonitor(run_dir): the shipped rules; ρ_asym > 1.8 from step 0 so rho_asym_critical (hold 3) fires at
    step 2 and rho_asym_high (hold 5) at step 4: one ERROR and one WARNING line, two alerts/ rows, two tracker
    calls, alerts_active 0, 0, 1, 1, 2, 2."""
    tr = Tracker()
    with caplog.at_level(logging.WARNING, logger="triage_monitor.alerts"):
        with MismatchMonitor(tmp_path / "run", MonitorConfig(window=3), loggers=[tr]) as mon:
            active = [mon.log_step(s, biased(s))["alerts_active"] for s in range(6)]
    assert active == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    lines = [(r.levelname, r.getMessage().split(":")[1].strip()) for r in caplog.records
             if r.name == "triage_monitor.alerts"]
    assert lines == [("ERROR", "rho_asym_critical"), ("WARNING", "rho_asym_high")]
    rows = pd.read_parquet(tmp_path / "run" / "alerts")
    assert sorted(zip(rows["step"], rows["rule"])) == [(2, "rho_asym_critical"), (4, "rho_asym_high")]
    assert tr.alerts == [(2, "rho_asym_critical"), (4, "rho_asym_high")] and tr.closed
    assert [s for s, _ in tr.rows] == list(range(6)) and tr.rows[2][1]["alerts_active"] == 1.0
    steps = pd.read_parquet(tmp_path / "run" / "steps").sort_values("step")
    assert steps["alerts_active"].tolist() == active


@pytest.mark.parametrize("setting, expect", [
    (False, []),                                                           # no rules: nothing, alerts_active NaN
    ([Rule("low", "window/rho_asym", "above", 1.0)], [(0, "low")]),       # a list of rules
    ("file", [(1, "two")]),                                                # a rule file
])
def test_alerts_false_a_rule_list_and_a_rule_file(tmp_path, setting, expect):
    if setting == "file":
        (tmp_path / "r.toml").write_text('[[rules]]\nname = "two"\nmetric = "window/rho_asym"\ncondition = "above"\n'
                                         'threshold = 1.0\nhold = 2\n')
        setting = str(tmp_path / "r.toml")
    with MismatchMonitor(tmp_path / "run", alerts=setting) as mon:
        out = [mon.log_step(s, biased(s)) for s in range(3)]
    got = pd.read_parquet(tmp_path / "run" / "alerts") if (tmp_path / "run" / "alerts").exists() else pd.DataFrame(
        {"step": [], "rule": []})
    assert sorted(zip(got["step"], got["rule"])) == expect
    assert math.isnan(out[-1]["alerts_active"]) if setting is False else out[-1]["alerts_active"] == 1.0


def test_an_engine_of_your_own_keeps_its_sinks_and_ranks_other_than_0_raise_nothing(tmp_path):
    """An AlertEngine given by the user is used as it is (its sinks, not the trackers'); on rank 1 no rule runs and no
    tracker is called, whatever was passed."""
    got, tr = [], Tracker()
    eng = AlertEngine([Rule("low", "window/rho_asym", "above", 1.0)], sinks=[CallbackSink(got.append)])
    with MismatchMonitor(tmp_path / "a", alerts=eng, loggers=[tr]) as mon:
        mon.log_step(0, biased(0))
    assert [a.rule for a in got] == ["low"] and tr.alerts == [] and len(tr.rows) == 1
    tr1 = Tracker()
    with MismatchMonitor(tmp_path / "b", rank=1, attempt=5, alerts=[Rule("low", "window/rho_asym", "above", 1.0)],
                         loggers=[tr1]) as mon:
        m = mon.log_step(0, biased(0))
    assert math.isnan(m["alerts_active"]) and tr1.rows == [] and not tr1.closed
    assert not (tmp_path / "b" / "alerts").exists()


def test_build_engine_refuses_what_it_cannot_use():
    assert build_engine(False) is None
    assert [r.name for r in build_engine(None).rules] == [r.name for r in build_engine(True).rules]
    with pytest.raises(ValueError, match=r"alerts=3: give True"):
        build_engine(3)
    with pytest.raises(ValueError, match=r"alerts\[0\]: unknown field\(s\) \['bogus'\]"):
        build_engine([{"name": "x", "metric": "m", "condition": "above", "threshold": 1, "bogus": 1}])
    with pytest.raises(FileNotFoundError):
        build_engine("/nonexistent/rules.toml")


# ------------------------------------------------------------------------------------------- status
def test_rule_status_says_which_rules_could_not_evaluate_and_why():
    """Over 30 steps (0..29) with the default rules: the trend rules need step 0 + 2·25 + 24 = 74, c_tok_excess its
    50-step baseline, the Gate rule a metric this run lacks; the level rules evaluated on every step."""
    eng = AlertEngine()
    for s in range(30):
        eng.observe(s, {"window/rho_asym": 1.0, "window/delta_abs_mean": 0.05, "window/small_gap_share": 0.9,
                        "window/k3_kl": 0.01, "window/c_tok": 0.2, "window/delta_q05": -0.1})
    st = {s.name: s for s in eng.status()}
    assert st["rho_asym_high"].evaluated == 30 and st["rho_asym_high"].reason == ""
    assert st["rho_asym_rising"].evaluable_from == 74 and st["rho_asym_rising"].reason == (
        "not evaluable before step 74 (needs 2 look-back(s) of 25 steps after the first full window)")
    assert st["c_tok_excess"].evaluable_from == 50 and st["c_tok_excess"].reason == (
        "not evaluable before step 50 (needs a baseline over the first 50 steps)")
    assert st["gate_downweighting_rising"].evaluable_from is None
    assert st["gate_downweighting_rising"].reason == "metric gate_downweighted_frac is not in the metrics"
    # a run at noise level: the guarded rules are held back and say so
    eng = AlertEngine()
    for s in range(3):
        eng.observe(s, {"window/rho_asym": 1.9, "window/delta_abs_mean": 1e-8})
    st = {s.name: s for s in eng.status()}
    assert st["rho_asym_critical"].noise == 3 and st["rho_asym_critical"].reason.startswith(
        "held back at noise level on 3 step(s) (window/delta_abs_mean < 0.0001")
    assert not eng.fired


# ------------------------------------------------------------------------------------------ verdict
def _frame(rho, gap=0.05, start=0):
    n = len(rho)
    return pd.DataFrame({"step": range(start, start + n), "window/rho_asym": rho, "window/delta_abs_mean": [gap] * n,
                         "window/small_gap_share": [0.9] * n, "window/k3_kl": [0.01] * n, "window/c_tok": [0.2] * n})


@pytest.mark.parametrize("rho, level, phrase", [
    (0.97, "OK", "window ρ_asym 0.97 at step 29, below the published healthy range"),
    (1.2, "OK", "within the published healthy range"),
    (1.4, "WATCH", "above the published healthy range, below the first alert threshold 1.45"),
    # the shipped ρ_asym rules are mismatch-tier (docs/alerts.md#tiers): above their thresholds the last step is WATCH
    (1.5, "WATCH", "above the WARN threshold 1.45"),       # 30 steps above 1.45: rho_asym_high active
    (1.9, "WATCH", "above the ERROR threshold 1.8"),
])
def test_the_verdict_places_the_last_window_rho_asym_against_the_references(rho, level, phrase):
    frame = _frame([rho] * 30)
    v = health_verdict(frame, replay_engine(None, frame))
    assert v.level == level and phrase in v.line and v.step == 29
    assert "(published (4B dense / 30B MoE) 1.023–1.337; alert thresholds 1.45 WARN, 1.8 ERROR)" in v.line
    assert v.line.endswith("rule(s) not evaluable before step 50–74")


def test_the_verdict_of_a_30_step_run_names_active_alerts_and_waiting_rules():
    frame = _frame([0.97] * 29 + [0.97])
    v = health_verdict(frame, replay_engine(None, frame))
    assert v.line == ("verdict: OK — window ρ_asym 0.97 at step 29, below the published healthy range (published "
                      "(4B dense / 30B MoE) 1.023–1.337; alert thresholds 1.45 WARN, 1.8 ERROR); no alert; 4 rule(s) "
                      "not evaluable before step 50–74")
    frame = _frame([1.9] * 10)
    v = health_verdict(frame, replay_engine(None, frame))
    assert "2 alert(s) active (rho_asym_high, rho_asym_critical)" in v.line and v.level == "WATCH"   # mismatch tier
    # fired then cleared: WATCH, said so (critical, hold 3, fired at step 2; high, hold 5, at step 4)
    frame = _frame([1.9] * 5 + [1.1] * 5)
    v = health_verdict(frame, replay_engine(None, frame))
    assert v.level == "WATCH" and "2 alert(s) fired earlier, none active now" in v.line   # critical at 2, high at 4


def test_the_verdict_at_noise_level_and_without_a_direction_metric():
    frame = _frame([1.9] * 5, gap=3e-8)
    v = health_verdict(frame, replay_engine(None, frame))
    assert v.level == "NO SIGNAL" and "agree to rounding (window mean |δ| 3e-08 nats < 0.0001)" in v.line
    frame = pd.DataFrame({"step": [0, 1], "window/rho_asym": [math.nan, math.nan]})
    v = health_verdict(frame, replay_engine(None, frame))
    assert v.level == "NO SIGNAL" and "window ρ_asym has no value in this run" in v.line


# ------------------------------------------------------------------------------------------ trackers
def test_the_curated_set_and_the_framework_metrics():
    m = {"step": 7, "window/rho_asym": 1.5, "rho_asym": 1.4, "window/small_gap_share": 0.9, "window/k3_kl": 0.01,
         "window/c_tok": math.nan, "delta_abs_mean": 0.02, "gate_downweighted_frac": 0.1, "alerts_active": 1.0,
         "n_tokens": 100.0, "nonfinite_count": 0.0, "note": "text"}
    assert list(select_metrics(m)) == list(CURATED_KEYS) and math.isnan(select_metrics(m)["window/c_tok"])
    assert set(select_metrics(m, "all")) == set(m) - {"step", "note"}
    assert select_metrics(m, ["n_tokens", "missing"]) == {"n_tokens": 100.0}
    fw = framework_metrics(m)
    assert fw == {"triage/window/rho_asym": 1.5, "triage/rho_asym": 1.4, "triage/window/small_gap_share": 0.9,
                  "triage/window/k3_kl": 0.01, "triage/delta_abs_mean": 0.02, "triage/gate_downweighted_frac": 0.1,
                  "triage/alerts_active": 1.0, "triage/metrics_step": 7.0}     # NaN c_tok left out
    assert framework_metrics(None) == {}
    with pytest.raises(ValueError, match=r"keys='some': use 'curated', 'all' or a list"):
        select_metrics(m, "some")


def test_tracker_specs_travel_as_configuration():
    s = TrackerSpec.parse({"kind": "tensorboard", "keys": "all", "log_dir": "/x"})
    assert s == TrackerSpec("tensorboard", "all", {"log_dir": "/x"})
    assert pickle.loads(pickle.dumps(s)) == s and TrackerSpec.parse("mlflow").keys == "curated"
    with pytest.raises(ValueError, match=r"tracker kind 'neptune' is not one of \[.*'mlflow', .*'tensorboard', .*'wandb'\]"):
        TrackerSpec.parse("neptune")
    with pytest.raises(ValueError, match="is a live object"):
        specs_of([Tracker()])


def test_hook_settings_carry_alerts_loggers_and_framework_keys_as_configuration(tmp_path):
    from triage_monitor.hooks.worker_runtime import HookSettings, WorkerRuntime

    hs = HookSettings(run_dir=str(tmp_path / "run"), alerts=[{"name": "low", "metric": "window/rho_asym",
                                                              "condition": "above", "threshold": 1.0}],
                      loggers=["tensorboard"], framework_keys=["window/rho_asym", "alerts_active"])
    hs2 = pickle.loads(pickle.dumps(hs))
    assert hs2.alerts == [Rule("low", "window/rho_asym", "above", 1.0)] and hs2.loggers == [TrackerSpec("tensorboard")]
    with pytest.raises(ValueError, match="HookSettings.alerts=.*a live AlertEngine cannot travel"):
        HookSettings(alerts=AlertEngine())
    with pytest.raises(ValueError, match="HookSettings.framework_keys='x'"):
        HookSettings(framework_keys="x")
    rt = WorkerRuntime(HookSettings(run_dir=str(tmp_path / "run2"), alerts=hs2.alerts,
                                    framework_keys=["window/rho_asym", "alerts_active"]))
    rt.record(0, biased(0))
    assert rt.framework_metrics() == {}                     # step 0 is still open
    rt.record(1, biased(1))                                 # closes step 0
    fw = rt.framework_metrics()
    assert set(fw) == {"triage/window/rho_asym", "triage/alerts_active", "triage/metrics_step"}
    assert fw["triage/metrics_step"] == 0.0 and fw["triage/alerts_active"] == 1.0
    rt.close()
    assert pd.read_parquet(tmp_path / "run2" / "alerts")["rule"].tolist() == ["low"]


def test_alerts_and_analyze_commands_end_with_the_verdict_and_name_the_waiting_rules(tmp_path, capsys):
    """A 30-step healthy run (shift 0: window ρ_asym ≈ 1): `alerts` exits 0, lists the 4 rules that cannot evaluate
    before step 50–74 with their reasons, and ends with the verdict; `analyze` ends with the same verdict after its
    recomputation check."""
    from triage_monitor.cli import main

    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=25)) as mon:
        for s in range(30):
            mon.log_step(s, biased(s, shift=0.0))
    capsys.readouterr()
    assert main(["alerts", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    i = out.index("4 rule(s) could not evaluate yet over these 30 step(s):")
    assert out[i + 1:i + 5] == [
        "  rho_asym_rising: not evaluable before step 74 (needs 2 look-back(s) of 25 steps after the first full window)",
        "  c_tok_excess: not evaluable before step 50 (needs a baseline over the first 50 steps)",
        "  small_gap_share_falling: not evaluable before step 74 (needs 2 look-back(s) of 25 steps after the first "
        "full window)",
        "  k3_kl_rising: not evaluable before step 74 (needs 2 look-back(s) of 25 steps after the first full window)"]
    start = next(k for k, line in enumerate(out) if line.startswith("verdict: "))
    verdict = out[start:]                       # the run verdict (docs/alerts.md#the-run-verdict), its last line last
    assert verdict[0] == "verdict: OK — no reward recorded; no alert fired"
    assert verdict[-1].startswith("  last step: OK — ")
    assert verdict[-1].endswith("no alert; 4 rule(s) not evaluable before step 50–74")
    assert main(["analyze", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "recomputation check: all" in out and " ".join(verdict) in " ".join(out.splitlines())
    assert json.loads((tmp_path / "run" / "analysis" / "verdict.json").read_text())["lines"] == verdict


def test_a_tracker_that_cannot_start_is_left_out_and_an_unknown_option_is_refused(tmp_path, caplog, monkeypatch):
    """A tracker whose constructor fails warns once and the monitor goes on; a misspelt option is an error naming it
    when the spec is made (on the driver for a hook), not a failure inside a worker."""
    from triage_monitor.alerting import tensorboard_logger

    def broken(*a, **k):
        raise OSError("read-only file system")

    with pytest.raises(ValueError, match=r"tracker 'tensorboard': unknown option\(s\) \['logdir'\]"):
        TrackerSpec("tensorboard", options={"logdir": "/x"})
    spec = TrackerSpec("tensorboard", options={"log_dir": str(tmp_path / "tb")})
    monkeypatch.setattr(tensorboard_logger.TensorBoardLogger, "__init__", broken)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        with MismatchMonitor(tmp_path / "run", loggers=[spec]) as mon:
            mon.log_step(0, biased(0))
    assert mon.loggers == []
    assert [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()] == [
        "triage-monitor: the tensorboard tracker could not start (OSError: read-only file system); it is left out"]
