"""TensorBoard and MLflow trackers, read back with each tracker's own reader.

TensorBoard: the event files are read with TensorBoard's ``EventAccumulator``
(``tensorboard.backend.event_processing``), scalars and the text plugin's tensors.  MLflow: the ``MlflowClient`` on a
local **file** store (``file:`` URI under ``tmp_path``); MLflow 3.18 keeps that store in maintenance mode and refuses
it unless ``MLFLOW_ALLOW_FILE_STORE=true``, which the fixture sets (the sqlite store needs the full ``mlflow``
package's SQLAlchemy, not installed: ``mlflow-skinny`` is the tracking client).  No mocks of either library: a
failure is a real one (an unwritable log directory, a deleted MLflow run, the refused file store).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import pytest
import torch

if os.environ.get("CI") == "true":      # in CI a missing tracker library is a failure, never a skip
    import mlflow
    import tensorboard  # noqa: F401
else:
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from triage_monitor.alerting import mlflow_logger, tensorboard_logger  # noqa: E402
from triage_monitor.alerting.alerts import Alert  # noqa: E402
from triage_monitor.alerting.mlflow_logger import MLflowLogger  # noqa: E402
from triage_monitor.alerting.tensorboard_logger import TensorBoardLogger  # noqa: E402
from triage_monitor.alerting.trackers import CURATED_KEYS, TrackerSpec, build_trackers  # noqa: E402

NAN = float("nan")
#: one step's metrics as the monitor returns them: the curated keys, two more numbers, a string, NaN
STEP = {"step": 7, "window/rho_asym": 1.9, "rho_asym": NAN, "window/small_gap_share": 0.8, "window/k3_kl": 1e-3,
        "window/c_tok": 0.21, "delta_abs_mean": 0.05, "gate_downweighted_frac": 0.125, "alerts_active": 1.0,
        "nonfinite_count": 0.0, "reward": 0.5, "label": "not a number"}
NUMERIC = sorted(k for k, v in STEP.items() if k != "step" and not isinstance(v, str))
ALERTS = [Alert(7, "rho_asym_critical", "window/rho_asym", 1.9, 1.8, 25, "ERROR", "triage ERROR: rho_asym_critical",
                "window/rho_asym = 1.9 is above 1.8 at step 7", 600.0),
          Alert(9, "my rule/2", "reward", 0.1, 0.2, 1, "WARN", "triage WARN: my rule/2", "reward = 0.1 at step 9", 0.0)]


def same(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


# ------------------------------------------------------------------------------------------------ readers
def tb_read(log_dir):
    """``(scalars, texts)`` of every event file under ``log_dir``: ``{tag: [(step, value)]}``, ``{tag: [(step, str)]}``
    (the text plugin stores its strings as tensors under ``<tag>/text_summary``)."""
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    scalars = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in tags["scalars"]}
    texts = {t[:-len("/text_summary")]: [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors(t)]
             for t in tags["tensors"] if t.endswith("/text_summary")}
    return scalars, texts


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local MLflow file store: ``(uri, client)``."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = "file:" + str(tmp_path / "mlruns")
    yield uri, MlflowClient(tracking_uri=uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()


def the_run(client, experiment):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def artifact(client, run_id, path, tmp_path) -> str:
    out = tmp_path / "dl"
    out.mkdir(exist_ok=True)
    with open(client.download_artifacts(run_id, path, str(out))) as f:
        return f.read()


# ------------------------------------------------------------------------------------------------ TensorBoard
def test_tensorboard_logs_the_curated_set_by_default(tmp_path):
    lg = TensorBoardLogger(str(tmp_path / "tb"))
    lg.log_metrics(7, STEP)
    lg.log_metrics(8, {**STEP, "window/rho_asym": 2.25})
    lg.close()
    scalars, _ = tb_read(tmp_path / "tb")
    assert set(scalars) == {"triage/" + k for k in CURATED_KEYS}
    assert scalars["triage/window/rho_asym"] == [(7, pytest.approx(1.9)), (8, 2.25)]
    assert [s for s, _ in scalars["triage/rho_asym"]] == [7, 8] and all(math.isnan(v) for _, v in
                                                                         scalars["triage/rho_asym"])
    for k in CURATED_KEYS:
        assert same(scalars["triage/" + k][0][1], STEP[k]), k


def test_tensorboard_keys_all_and_a_list(tmp_path):
    lg = TensorBoardLogger(str(tmp_path / "all"), keys="all")
    lg.log_metrics(7, STEP)
    lg.close()
    scalars, _ = tb_read(tmp_path / "all")
    assert set(scalars) == {"triage/" + k for k in NUMERIC}            # the string and "step" left out
    assert scalars["triage/reward"] == [(7, 0.5)] and scalars["triage/nonfinite_count"] == [(7, 0.0)]
    lg = TensorBoardLogger(str(tmp_path / "two"), keys=["reward", "window/k3_kl"], prefix="tm/")
    lg.log_metrics(3, STEP)
    lg.close()
    scalars, _ = tb_read(tmp_path / "two")
    assert set(scalars) == {"tm/reward", "tm/window/k3_kl"}
    with pytest.raises(ValueError, match="keys='some'"):
        TensorBoardLogger(str(tmp_path / "x"), keys="some")


def test_tensorboard_alert_text_count_and_config(tmp_path):
    lg = TensorBoardLogger(str(tmp_path / "tb"), config={"model": "4B"})
    lg.log_config({"tool": "triage-monitor", "info": {"framework": "test"}})
    for a in ALERTS:
        lg.emit(a)
    lg.close()
    scalars, texts = tb_read(tmp_path / "tb")
    assert texts["triage/alerts"] == [
        (7, "**triage ERROR: rho_asym_critical** at step 7\n\nwindow/rho_asym = 1.9 is above 1.8 at step 7"),
        (9, "**triage WARN: my rule/2** at step 9\n\nreward = 0.1 at step 9")]
    assert scalars["triage/alerts_fired"] == [(7, 1.0), (9, 2.0)]
    ((step, text),) = texts["triage/config"]
    assert step == 0 and all(line.startswith("    ") for line in text.splitlines())   # a Markdown code block
    assert json.loads(text) == {"model": "4B", "tool": "triage-monitor", "info": {"framework": "test"}}


def test_tensorboard_alerts_only_and_a_writer_of_your_own(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "own"))
    lg = TensorBoardLogger(writer=w, metrics=False)
    lg.log_metrics(7, STEP)
    lg.emit(ALERTS[0])
    lg.close()                                   # flushed, not closed: the writer is yours
    w.add_scalar("mine", 1.0, 0)
    w.close()
    scalars, texts = tb_read(tmp_path / "own")
    assert set(scalars) == {"triage/alerts_fired", "mine"} and [s for s, _ in texts["triage/alerts"]] == [7]


def test_tensorboard_unwritable_log_dir_is_reported_once(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a regular file where the log directory should be")
    lg = TensorBoardLogger(str(blocker / "tb"))
    with caplog.at_level(logging.WARNING, logger="triage_monitor.tensorboard"):
        for step in range(3):
            lg.log_metrics(step, STEP)
        lg.emit(ALERTS[0])
        lg.log_config({"x": 1})
        lg.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["TensorBoardLogger: SummaryWriter failed; skipped (further failures are counted, not reported)"]
    assert lg._guard.failures == {"SummaryWriter": 1} and lg.writer is None


def test_tensorboard_calls_after_close_write_nothing(tmp_path):
    lg = TensorBoardLogger(str(tmp_path / "tb"))
    lg.log_metrics(0, STEP)
    lg.close()
    lg.close()
    lg.log_metrics(1, STEP)
    lg.emit(ALERTS[0])
    scalars, texts = tb_read(tmp_path / "tb")
    assert scalars["triage/window/rho_asym"] == [(0, pytest.approx(1.9))] and "triage/alerts" not in texts
    assert len(list((tmp_path / "tb").iterdir())) == 1          # SummaryWriter reopens a file when used again


def test_tensorboard_missing_is_a_no_op_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)          # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(tensorboard_logger, "_missing_reported", False)
    with caplog.at_level(logging.WARNING, logger="triage_monitor.tensorboard"):
        for _ in range(2):
            lg = TensorBoardLogger(str(tmp_path / "tb"))
            lg.log_config({"x": 1})
            lg.log_metrics(0, STEP)
            lg.emit(ALERTS[0])
            lg.close()
    assert [r.getMessage() for r in caplog.records] == [
        "tensorboard is not installed: TensorBoard logging and alerts are disabled "
        "(pip install 'triage-monitor[tensorboard]')"]
    assert not (tmp_path / "tb").exists()


# ------------------------------------------------------------------------------------------------ MLflow
def test_mlflow_logs_the_curated_set_with_steps_and_ends_its_run(store):
    uri, client = store
    lg = MLflowLogger(uri, "exp")
    lg.log_metrics(7, STEP)
    lg.log_metrics(8, {**STEP, "window/rho_asym": 2.25})
    run_id = lg.run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    lg.close()
    run = the_run(client, "exp")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert set(run.data.metrics) == {"triage/" + k for k in CURATED_KEYS}
    assert history(client, run_id, "triage/window/rho_asym") == [(7, pytest.approx(1.9)), (8, 2.25)]
    rho = history(client, run_id, "triage/rho_asym")
    assert [s for s, _ in rho] == [7, 8] and all(math.isnan(v) for _, v in rho)
    for k in CURATED_KEYS:
        assert same(history(client, run_id, "triage/" + k)[0][1], STEP[k]), k


def test_tracker_timestamps_are_the_time_of_logging(store, tmp_path):
    """MLflow's metric timestamps (milliseconds since the epoch) and TensorBoard's event wall times (seconds), read back
    against the clock around the calls: values and steps alone would pass with a timestamp in the wrong unit
    (docs/testing.md#test-data)."""
    import time

    uri, client = store
    t0 = time.time()
    lg = MLflowLogger(uri, "exp")
    lg.log_metrics(7, STEP)
    lg.emit(ALERTS[0])
    run_id = lg.run_id
    lg.close()
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    tb.log_metrics(7, STEP)
    tb.emit(ALERTS[0])
    tb.close()
    t1 = time.time()
    for key in ("triage/window/rho_asym", "triage/alerts_fired"):
        (m,) = client.get_metric_history(run_id, key)
        assert int(t0 * 1000) <= m.timestamp <= int(t1 * 1000) + 1, (key, m.timestamp, t0, t1)
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    for tag in ("triage/window/rho_asym", "triage/alerts_fired"):
        (e,) = ea.Scalars(tag)
        assert t0 - 1 <= e.wall_time <= t1 + 1, (tag, e.wall_time, t0, t1)


def test_mlflow_keys_all(store):
    uri, client = store
    lg = MLflowLogger(uri, "exp", keys="all", run_name="everything")
    lg.log_metrics(7, STEP)
    lg.close()
    run = the_run(client, "exp")
    assert set(run.data.metrics) == {"triage/" + k for k in NUMERIC}
    assert run.data.tags["mlflow.runName"] == "everything"
    assert history(client, run.info.run_id, "triage/reward") == [(7, 0.5)]


def test_mlflow_alert_tags_artifacts_and_config(store, tmp_path):
    uri, client = store
    lg = MLflowLogger(uri, "exp", config={"model": "4B"})
    lg.log_config({"tool": "triage-monitor"})
    for a in ALERTS:
        lg.emit(a)
    lg.close()
    run = the_run(client, "exp")
    rid, tags = run.info.run_id, run.data.tags
    assert tags["triage.alert.rho_asym_critical"] == "ERROR at step 7: window/rho_asym = 1.9 is above 1.8 at step 7"
    assert tags["triage.alert.my_rule_2"] == "WARN at step 9: reward = 0.1 at step 9"     # '/' and ' ' made safe
    assert tags["triage.alerts_fired"] == "2" and tags["triage.last_alert"] == "step 9: triage WARN: my rule/2"
    assert history(client, rid, "triage/alerts_fired") == [(7, 1.0), (9, 2.0)]
    assert sorted(a.path for a in client.list_artifacts(rid, "triage/alerts")) == [
        "triage/alerts/step00000007-rho_asym_critical.txt", "triage/alerts/step00000009-my_rule_2.txt"]
    body = artifact(client, rid, "triage/alerts/step00000007-rho_asym_critical.txt", tmp_path)
    title, text, fields = body.split("\n\n", 2)
    assert title == "triage ERROR: rho_asym_critical" and text == ALERTS[0].text
    assert json.loads(fields) == ALERTS[0].to_row()
    assert json.loads(artifact(client, rid, "triage/config.json", tmp_path)) == {"model": "4B", "tool": "triage-monitor"}


def test_mlflow_uses_the_active_run_and_leaves_it_open(store, monkeypatch):
    """An active (fluent) run, e.g. the one transformers' MLflowCallback starts, receives the alerts; the logger
    neither ends it nor starts another; with metrics=False it adds no metric series of its own."""
    uri, client = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    exp = client.create_experiment("framework")
    with mlflow.start_run(experiment_id=exp) as active:
        lg = MLflowLogger(metrics=False)
        lg.log_metrics(7, STEP)
        lg.emit(ALERTS[0])
        lg.close()
        assert lg.run_id is None                                    # closed
        assert mlflow.active_run().info.run_id == active.info.run_id
        assert client.get_run(active.info.run_id).info.status == "RUNNING"
    run = client.get_run(active.info.run_id)
    assert set(run.data.metrics) == set()       # not even triage/alerts_fired: the run's axis is the framework's
    assert run.data.tags["triage.alert.rho_asym_critical"].startswith("ERROR at step 7: ")
    assert len(client.search_experiments()) == 2                    # "Default" and "framework": nothing started


def test_mlflow_given_run_is_not_ended(store):
    uri, client = store
    run = client.create_run(client.create_experiment("mine"))
    lg = MLflowLogger(uri, run_id=run.info.run_id)
    lg.log_metrics(1, STEP)
    lg.close()
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert history(client, run.info.run_id, "triage/delta_abs_mean") == [(1, 0.05)]


def test_mlflow_failing_call_is_reported_once(store, caplog):
    """Logging into a deleted run fails in MLflow itself: each operation reported once, the rest counted."""
    uri, client = store
    run = client.create_run(client.create_experiment("gone"))
    client.delete_run(run.info.run_id)
    lg = MLflowLogger(uri, run_id=run.info.run_id)
    with caplog.at_level(logging.WARNING, logger="triage_monitor.mlflow"):
        for step in range(3):
            lg.log_metrics(step, STEP)
        lg.emit(ALERTS[0])
        lg.close()
    msgs = [r.getMessage() for r in caplog.records]
    # (the file store's artifact writes do not check the run's state: the alert's text artifact still lands)
    assert msgs == ["MLflowLogger: log_batch failed; skipped (further failures are counted, not reported)"]
    assert lg._guard.failures == {"log_batch": 4}
    assert "must be in 'active' lifecycle_stage" in str(caplog.records[0].exc_info[1])


def test_mlflow_refused_file_store_is_reported_once_naming_the_opt_in(store, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")      # the user's own refusal (unset: the logger opts in)
    lg = MLflowLogger("file:" + str(tmp_path / "refused"), "exp")       # (MLflow caches a store per URI)
    with caplog.at_level(logging.WARNING, logger="triage_monitor.mlflow"):
        for step in range(3):
            lg.log_metrics(step, STEP)
        lg.emit(ALERTS[0])
        lg.close()
    (rec,) = caplog.records
    assert rec.getMessage().startswith("MLflowLogger: MlflowClient failed")
    assert "MLFLOW_ALLOW_FILE_STORE" in str(rec.exc_info[1])
    assert lg.run_id is None


def test_mlflow_missing_is_a_no_op_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setattr(mlflow_logger, "_missing_reported", False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="triage_monitor.mlflow"):
        for _ in range(2):
            lg = MLflowLogger("file:" + str(tmp_path / "mlruns"))
            lg.log_config({"x": 1})
            lg.log_metrics(0, STEP)
            lg.emit(ALERTS[0])
            lg.close()
    assert [r.getMessage() for r in caplog.records] == [
        "mlflow is not installed: MLflow logging and alerts are disabled (pip install 'triage-monitor[mlflow]')"]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ specs
def test_tracker_specs_build_the_shipped_trackers(store, tmp_path):
    uri, _ = store
    tb, ml = build_trackers([{"kind": "tensorboard", "log_dir": str(tmp_path / "tb")},
                             TrackerSpec("mlflow", "all", {"tracking_uri": uri, "experiment": "spec"})])
    assert isinstance(tb, TensorBoardLogger) and tb.keys == "curated" and tb.log_dir == str(tmp_path / "tb")
    assert isinstance(ml, MLflowLogger) and ml.keys == "all" and ml.tracking_uri == uri
    assert isinstance(TrackerSpec.parse("tensorboard").build(), TensorBoardLogger)
    assert TrackerSpec.parse({"kind": "mlflow", "keys": ["reward"]}).build().keys == ("reward",)


# ------------------------------------------------------------------------------------------------ end to end
def amplifying_batch(step: int, g: torch.Generator):
    """16 responses × 32 tokens; A = +1 / −1 alternating.  δ = learner − sampler = −0.1 on every A<0 token
    (sampler above the learner: amplifying, A⁻ side) and on 3 of every 4 A>0 tokens; +0.1 on the A>0 tokens at
    positions 0, 4, 8, ... (amplifying, A⁺ side).  By hand: mass_amp_neg = 8 · 32 · 1, mass_amp_pos = 8 · 8 · 1,
    so ρ_asym = 4.0 on every step and every window; mean |δ| = 0.1 nats (above the 1e-4 noise guard)."""
    from triage_monitor.batch import TokenBatch

    sampler = -3 * torch.rand(16, 32, generator=g) - 0.2
    adv = torch.tensor([1.0, -1.0] * 8)
    pos = torch.arange(32).expand(16, 32)
    delta = torch.where((adv[:, None] > 0) & (pos % 4 == 0), 0.1, -0.1)
    return TokenBatch.from_padded(sampler + delta, sampler, adv, torch.ones(16, 32, dtype=torch.bool))


def test_monitor_default_rules_reach_tensorboard_and_mlflow(store, tmp_path):
    """The real MismatchMonitor with the shipped default rules and both trackers as configuration: the amplifying
    sampler (ρ_asym = 4.0 by hand) fires rho_asym_critical (hold 3: step 2) and rho_asym_high (hold 5: step 4);
    each tracker holds the curated series and both alerts."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.monitor import MismatchMonitor

    uri, client = store
    g = torch.Generator().manual_seed(0)
    loggers = [TrackerSpec("tensorboard", options={"log_dir": str(tmp_path / "tb")}),
               {"kind": "mlflow", "tracking_uri": uri, "experiment": "e2e"}]
    with MismatchMonitor(tmp_path / "run", loggers=loggers) as mon:
        returned = [mon.log_step(step, amplifying_batch(step, g)) for step in range(6)]
    assert [m["window/rho_asym"] for m in returned] == [pytest.approx(4.0, rel=1e-6)] * 6
    assert [m["alerts_active"] for m in returned] == [0, 0, 1, 1, 2, 2]
    fired = sorted(zip(open_run(tmp_path / "run").alerts()["step"], open_run(tmp_path / "run").alerts()["rule"]))
    assert fired == [(2, "rho_asym_critical"), (4, "rho_asym_high")]

    scalars, texts = tb_read(tmp_path / "tb")
    assert set(scalars) == {"triage/" + k for k in CURATED_KEYS if k != "gate_downweighted_frac"} | {
        "triage/alerts_fired", "triage/noise"}                      # no controller: no Gate fraction
    assert scalars["triage/noise"] == [(s, 0.0) for s in range(6)]  # mean |δ| 0.1 nats: above the noise floor
    assert scalars["triage/window/rho_asym"] == [(s, pytest.approx(4.0, rel=1e-6)) for s in range(6)]
    assert scalars["triage/delta_abs_mean"] == [(s, pytest.approx(0.1, rel=1e-5)) for s in range(6)]
    assert scalars["triage/alerts_active"] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert [(s, t.split("\n")[0]) for s, t in texts["triage/alerts"]] == [
        (2, "**triage ERROR (mismatch): rho_asym_critical** at step 2"), (4, "**triage WARN (mismatch): rho_asym_high** at step 4")]
    assert "is above 1.8 at step 2" in texts["triage/alerts"][0][1]
    assert json.loads(texts["triage/config"][0][1])["tool"] == "triage-monitor"      # the run's manifest

    run = the_run(client, "e2e")
    rid = run.info.run_id
    assert run.info.status == "FINISHED"                            # the monitor closed the tracker
    assert history(client, rid, "triage/window/rho_asym") == [(s, pytest.approx(4.0, rel=1e-6)) for s in range(6)]
    assert history(client, rid, "triage/alerts_active") == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 2.0),
                                                             (5, 2.0)]
    assert run.data.tags["triage.alert.rho_asym_critical"].startswith("ERROR at step 2: window/rho_asym = ")
    assert run.data.tags["triage.alert.rho_asym_high"].startswith("WARN at step 4: ")
    assert run.data.tags["triage.alerts_fired"] == "2"
    assert len(client.list_artifacts(rid, "triage/alerts")) == 2


def test_ratios_at_noise_level_reach_the_trackers_as_nan_beside_the_noise_flag(store, tmp_path):
    """The issue a user met: with sampler = learner to 1e-6 nats, ρ_asym is a ratio of rounding noise (here 4.0, above
    the 1.8 ERROR line) and the alert guard rightly stays silent — the trackers must not chart it as a value either.
    Steps 0-3: |δ| = 0.1 nats (ρ_asym 4.0 by hand); steps 4-9: the same pattern at 1e-6 nats.  With a 2-step window
    the window's mean |δ| drops below the 1e-4 floor from step 5 (steps 4-5 pooled): from there window ρ_asym and C_tok
    reach TensorBoard and MLflow as NaN, the step's ρ_asym from step 4, and ``triage/noise`` reads 1."""
    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig
    from triage_monitor.alerting.trackers import NOISE_GUARDED, tracker_metrics
    from triage_monitor.alerting.alert_rules import NOISE_FLOOR_NATS, default_rules

    # the same rule as the alert guard: every guarded shipped rule on a ratio is masked by its own guard and floor
    for r in default_rules():
        if r.guard_metric and r.metric in NOISE_GUARDED:
            assert (NOISE_GUARDED[r.metric], r.guard_min) == (r.guard_metric, NOISE_FLOOR_NATS)
    assert {r.metric for r in default_rules() if r.guard_metric} - {"window/k3_kl"} <= set(NOISE_GUARDED)
    uri, client = store
    g = torch.Generator().manual_seed(0)
    adv = torch.tensor([1.0, -1.0] * 8)
    pos = torch.arange(32).expand(16, 32)
    loggers = [TrackerSpec("tensorboard", options={"log_dir": str(tmp_path / "tb")}),
               {"kind": "mlflow", "tracking_uri": uri, "experiment": "noise"}]
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, calibration_steps=2), loggers=loggers) as mon:
        returned = []
        for step in range(10):
            size = 0.1 if step < 4 else 1e-6
            sampler = -3 * torch.rand(16, 32, generator=g) - 0.2
            delta = torch.where((adv[:, None] > 0) & (pos % 4 == 0), size, -size)
            returned.append(mon.log_step(step, TokenBatch.from_padded(sampler + delta, sampler, adv,
                                                                      torch.ones(16, 32, dtype=torch.bool))))
    assert all(m["rho_asym"] == pytest.approx(4.0, rel=1e-3) for m in returned)     # the monitor keeps the value
    want_noise = [0.0] * 5 + [1.0] * 5
    assert [tracker_metrics(m)["noise"] for m in returned] == want_noise
    scalars, _ = tb_read(tmp_path / "tb")
    assert [v for _, v in scalars["triage/noise"]] == want_noise
    win = [v for _, v in scalars["triage/window/rho_asym"]]
    assert win[:5] == [pytest.approx(4.0, rel=1e-3)] * 5 and all(math.isnan(v) for v in win[5:])
    step_rho = [v for _, v in scalars["triage/rho_asym"]]
    assert step_rho[:4] == [pytest.approx(4.0, rel=1e-3)] * 4 and all(math.isnan(v) for v in step_rho[4:])
    rid = the_run(client, "noise").info.run_id
    hist = history(client, rid, "triage/window/rho_asym")
    assert [s for s, v in hist if not math.isnan(v)] == [0, 1, 2, 3, 4]
    assert [v for _, v in history(client, rid, "triage/noise")] == want_noise


def test_framework_values_leave_out_the_ratios_at_noise_level_and_keep_other_nans():
    """slime, Miles and SkyRL reduce a metrics dict key by key over their ranks: the ratios at noise level are left
    out (the guard is global, alike on every rank), the flag says why, a rank's own NaN stays a key."""
    from triage_monitor.alerting.trackers import framework_values

    quiet = {"window/rho_asym": 2.885, "rho_asym": 3.1, "window/delta_abs_mean": 5e-5, "delta_abs_mean": 4e-5,
             "window/k3_kl": 1e-9, "gate_downweighted_frac": float("nan")}
    got = framework_values(quiet, ["window/rho_asym", "rho_asym", "window/k3_kl", "gate_downweighted_frac"])
    assert "window/rho_asym" not in got and "rho_asym" not in got and got["window/k3_kl"] == 1e-9
    assert math.isnan(got["gate_downweighted_frac"]) and "noise" not in got      # the flag only when asked for
    loud = {**quiet, "window/delta_abs_mean": 0.05, "delta_abs_mean": 0.05}
    got = framework_values(loud, "curated")
    assert got["window/rho_asym"] == 2.885 and got["rho_asym"] == 3.1 and got["noise"] == 0.0
    assert framework_values(quiet, "curated")["noise"] == 1.0
