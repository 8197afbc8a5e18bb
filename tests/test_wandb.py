"""W&B logging and alerts with the real wandb client in offline mode, read back from the run's .wandb file.

wandb >= 0.2x no longer ships a Python reader of its transaction log (the old
``wandb.sdk.internal.datastore`` moved into the Go ``wandb-core``), so
:func:`read_wandb_records` below reads the documented LevelDB-log framing (7-byte
``:W&B`` header, 32 KiB blocks, records of crc32/length/type + payload, the crc
checked with zlib as the old datastore did) and parses each payload with wandb's
own protobuf class ``wandb.proto.wandb_internal_pb2.Record``.  No mocks of wandb.
"""

import json
import logging
import math
import struct
import zlib
from pathlib import Path

import pytest
import torch

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

from triage_monitor.alerting.alerts import AlertEngine, CallbackSink, LoggingSink, Rule  # noqa: E402
from triage_monitor.alerting.wandb_logger import WandbAlertSink, WandbLogger  # noqa: E402

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path) -> list:
    """All ``pb.Record`` messages of a ``.wandb`` transaction log, in order."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, buf, out = HEADER, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:                      # block trailer too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if crc == length == kind == 0:                    # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"crc mismatch at byte {pos}"
        pos += 7 + length
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def history_rows(records) -> list:
    """W&B history rows as dicts (NaN as the string "NaN"); W&B's own ``_step`` / ``_runtime`` / ``_timestamp`` left
    out."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json.replace("NaN", '"NaN"'))
                   for it in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def config_items(records) -> dict:
    out = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for it in items:
            out[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return out


def of_kind(records, kind):
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": tmp_path, "WANDB_CONFIG_DIR": tmp_path / "cfg",
                 "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data",
                 "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, str(v))
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()                     # wandb caches its settings (WANDB_DIR) per process: start clean


def init(tmp_path, **kw):
    return wandb.init(project="triage-test", dir=tmp_path, mode="offline", **kw)


def the_log(tmp_path) -> Path:
    """The run's transaction log, once complete.  ``run.finish()`` can return before wandb-core has
    flushed the file (seen on a loaded 2-core machine): ``wandb.teardown()`` waits for the service."""
    wandb.teardown()
    (f,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    return f


def logged(tmp_path) -> list:
    """Records of the (single) finished offline run under ``tmp_path``; checks the log is complete."""
    recs = read_wandb_records(the_log(tmp_path))
    assert "exit" in [r.WhichOneof("record_type") for r in recs], "transaction log incomplete"
    return recs


CURATED = ("window/rho_asym", "rho_asym", "window/small_gap_share", "window/k3_kl", "window/c_tok",
           "delta_abs_mean", "gate_downweighted_frac", "alerts_active")     # docs/alerts.md#trackers, typed out


def test_the_curated_set_by_default_everything_with_keys_all(offline):
    """A full step's metrics: by default only the curated keys (and triage/step) reach W&B; keys="all" logs every
    number; a list logs those names."""
    step = {"step": 3, "window/rho_asym": 1.9, "rho_asym": math.nan, "window/small_gap_share": 0.8,
            "window/k3_kl": 1e-3, "window/c_tok": 0.21, "delta_abs_mean": 0.05, "gate_downweighted_frac": 0.125,
            "alerts_active": 1.0, "nonfinite_count": 0.0, "reward": 0.5, "n_tokens": 640.0, "label": "text"}
    run = init(offline)
    for keys in ("curated", "all", ["reward", "window/c_tok"]):
        WandbLogger(run, keys=keys).log_metrics(3, step)
    run.finish()
    curated, everything, two = history_rows(logged(offline))
    assert set(curated) == {"triage/step"} | {"triage/" + k for k in CURATED}
    assert curated["triage/window/rho_asym"] == 1.9 and curated["triage/rho_asym"] == "NaN"
    assert curated["triage/alerts_active"] == 1 and curated["triage/step"] == 3
    numbers = {k for k, v in step.items() if k != "step" and not isinstance(v, str)}
    assert set(everything) == {"triage/step"} | {"triage/" + k for k in numbers}
    assert everything["triage/reward"] == 0.5 and everything["triage/n_tokens"] == 640
    assert set(two) == {"triage/step", "triage/reward", "triage/window/c_tok"}
    with pytest.raises(ValueError, match="keys='most'"):
        WandbLogger(run, keys="most")


def test_emit_sends_a_wandb_alert_record(offline):
    """WandbLogger is an alert sink itself: emit(alert) = a W&B alert record on its run (wait_s in ms)."""
    from triage_monitor.alerting.alerts import Alert

    run = init(offline)
    lg = WandbLogger(run)
    lg.emit(Alert(5, "rho_asym_critical", "window/rho_asym", 2.1, 1.8, 25, "ERROR", "triage ERROR: rho_asym_critical",
                  "window/rho_asym = 2.1 is above 1.8 at step 5", 300.0))
    run.finish()
    (alert,) = of_kind(logged(offline), "alert")
    assert (alert.title, alert.level, alert.wait_duration) == ("triage ERROR: rho_asym_critical", "ERROR", 300_000)
    assert alert.text == "window/rho_asym = 2.1 is above 1.8 at step 5"


def test_metrics_config_and_alerts_reach_the_wandb_log(offline):
    run = init(offline, config={"lr": 1e-6})
    lg = WandbLogger(run, config={"framework": "demo", "window": 25}, keys="all")
    fired = []
    eng = AlertEngine([Rule("rho_high", "window/rho_asym", "above", 1.45, window=25, level="ERROR", wait_s=120),
                       Rule("nonfinite", "nonfinite_count", "above", 0, level="WARN", wait_s=0)],
                      sinks=[LoggingSink(), WandbAlertSink(lg), CallbackSink(fired.append)])
    seq = [(0, 1.02, 0.0, math.nan), (1, 1.504, 0.0, 0.5), (2, 1.6, 3.0, 0.25), (2, 1.7, 0.0, 0.125)]
    for step, rho, nf, reward in seq:   # the monitor's order: loggers first, then the engine
        metrics = {"step": step, "window/rho_asym": rho, "nonfinite_count": nf, "reward": reward,
                   "n_tokens": torch.tensor(10)}
        lg.log_metrics(step, metrics)
        eng.observe(step, metrics)
    lg.close()                           # the logger did not start the run: it must not finish it
    assert wandb.run is run
    run.finish()

    recs = logged(offline)
    hist = history_rows(recs)
    assert [h["triage/step"] for h in hist] == [0, 1, 2, 2]        # a repeated step is logged again
    assert [h["triage/window/rho_asym"] for h in hist] == [1.02, 1.504, 1.6, 1.7]
    assert [h["triage/nonfinite_count"] for h in hist] == [0, 0, 3, 0]
    assert [h["triage/reward"] for h in hist] == ["NaN", 0.5, 0.25, 0.125]
    assert all(h["triage/n_tokens"] == 10 for h in hist) and all("triage/triage/step" not in h for h in hist)
    metrics = of_kind(recs, "metric")
    assert any(m.glob_name == "triage/*" and m.step_metric == "triage/step" for m in metrics)
    assert any(m.name == "triage/step" for m in metrics)
    cfg = config_items(recs)
    assert cfg["lr"] == 1e-6 and cfg["triage"] == {"framework": "demo", "window": 25}

    alerts = of_kind(recs, "alert")
    assert [(a.title, a.level) for a in alerts] == [("triage ERROR (collapse): rho_high", "ERROR"),
                                                   ("triage WARN (collapse): nonfinite", "WARN")]
    assert [a.text for a in alerts] == [a.text for a in fired]
    assert "window/rho_asym = 1.504 is above 1.45 at step 1 (pooled over steps 0–1 (2 of a 25-step window)" in \
        alerts[0].text
    assert "nonfinite_count = 3 is above 0 at step 2" in alerts[1].text
    assert alerts[0].wait_duration == 120_000                        # milliseconds
    assert alerts[1].wait_duration == 60_000                         # 0 -> W&B's default of one minute


def test_logger_starts_and_finishes_its_own_run(offline):
    assert wandb.run is None
    lg = WandbLogger(init_kwargs={"project": "triage-test", "dir": offline, "mode": "offline", "config": {"seed": 3}})
    eng = AlertEngine([Rule("low", "window/small_gap_share", "below", 0.83, hold=2)], sinks=[WandbAlertSink()])
    for step, v in enumerate([0.9, 0.82, 0.81, 0.95]):
        lg.log_metrics(step, {"window/small_gap_share": v})
        eng.observe(step, {"window/small_gap_share": v})
    assert lg.run is wandb.run is not None
    lg.close()
    assert wandb.run is None
    recs = logged(offline)
    assert [h["triage/window/small_gap_share"] for h in history_rows(recs)] == [0.9, 0.82, 0.81, 0.95]
    assert [(a.title, a.level) for a in of_kind(recs, "alert")] == [("triage WARN (collapse): low", "WARN")]
    assert "at step 2" in of_kind(recs, "alert")[0].text
    assert config_items(recs)["seed"] == 3


def test_monitor_feeds_wandb_and_alerts_table(offline):
    """End to end with the real MismatchMonitor: per-step metrics in W&B equal the returned ones,
    the alerts/ table holds Alert.to_row(), and the CLI replay of the run directory agrees."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    run = init(offline)
    lg = WandbLogger(run)
    rules = [Rule("nonfinite", "nonfinite_count", "above", 0, level="ERROR"),
             Rule("gap", "window/delta_abs_mean", "above", 0.3, window=25)]
    eng = AlertEngine(rules, sinks=[WandbAlertSink(run)])
    g = torch.Generator().manual_seed(0)
    returned = []
    with MismatchMonitor(offline / "run", MonitorConfig(), manifest={"framework": "test"},
                         loggers=[lg], alerts=eng) as mon:
        for step in range(6):
            sampler = -torch.rand(4, 8, generator=g) * 2 - 0.01
            learner = sampler + torch.randn(4, 8, generator=g) * (0.1 if step < 3 else 1.0)
            learner = learner.clamp(max=0.0)
            if step == 4:
                learner[1, 2] = float("nan")
            adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
            b = TokenBatch.from_padded(learner, sampler, adv, torch.ones(4, 8, dtype=torch.bool),
                                       on_invalid="quarantine")
            returned.append(mon.log_step(step, b))
    run.finish()
    hist = history_rows(logged(offline))
    assert [h["triage/step"] for h in hist] == list(range(6))
    for h, m in zip(hist, returned):         # the curated keys (no controller: no Gate fraction), as returned
        assert set(h) == {"triage/step", "triage/noise"} | {"triage/" + k for k in CURATED
                                                            if k != "gate_downweighted_frac"}
        assert h["triage/noise"] == 0.0                                   # |δ| ≈ 0.1 nats: no ratio is masked
        for k in ("window/rho_asym", "delta_abs_mean", "window/k3_kl", "alerts_active"):
            assert h["triage/" + k] == pytest.approx(m[k], rel=1e-12), k
    live = [a.to_row() for a in eng.fired]
    assert ("nonfinite", 4) in [(r["rule"], r["step"]) for r in live]
    table = open_run(offline / "run").alerts()
    assert sorted(zip(table["step"], table["rule"])) == sorted((r["step"], r["rule"]) for r in live)
    alert_recs = of_kind(logged(offline), "alert")
    assert [a.title for a in alert_recs] == [r["title"] for r in live]


def test_monitor_default_rules_alert_through_the_logger(offline):
    """The monitor's own engine (the shipped default rules) sends every alert to a tracker that has emit(): the
    WandbLogger given as a logger raises W&B alert records, no sink wired by hand.  The sampler sits above the
    learner on every A<0 token and on 3 of 4 A>0 tokens, below it on the other A>0 tokens: ρ_asym = (8·16)/(8·4)
    = 4.0 by hand, so rho_asym_critical (> 1.8, hold 3) fires at step 2."""
    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor

    run = init(offline)
    g = torch.Generator().manual_seed(1)
    adv = torch.tensor([1.0, -1.0] * 8)
    pos = torch.arange(16).expand(16, 16)
    delta = torch.where((adv[:, None] > 0) & (pos % 4 == 0), 0.1, -0.1)
    # rho_asym_critical is a mismatch-tier rule (docs/alerts.md#tiers): W&B raises it when asked for both tiers
    with MismatchMonitor(offline / "run", loggers=[WandbLogger(run, alert_tiers=("mismatch", "collapse"))]) as mon:
        for step in range(3):
            sampler = -3 * torch.rand(16, 16, generator=g) - 0.2
            m = mon.log_step(step, TokenBatch.from_padded(sampler + delta, sampler, adv, torch.ones(16, 16)))
    assert m["window/rho_asym"] == pytest.approx(4.0, rel=1e-6)
    run.finish()
    recs = logged(offline)
    (alert,) = of_kind(recs, "alert")
    assert (alert.title, alert.level) == ("triage ERROR (mismatch): rho_asym_critical", "ERROR")
    assert "is above 1.8 at step 2" in alert.text and alert.wait_duration == 600_000
    assert [h["triage/alerts_active"] for h in history_rows(recs)] == [0, 0, 1]


def test_failing_wandb_call_is_reported_once(offline, caplog):
    run = init(offline)
    lg = WandbLogger(run, keys="all")
    with caplog.at_level(logging.WARNING, logger="triage_monitor.wandb"):
        lg.log_metrics(0, {"x": 1.0, "bad": "text"})
        lg.log_metrics(1, {"x": 2.0, "bad": "text"})
    run.finish()
    with caplog.at_level(logging.WARNING, logger="triage_monitor.wandb"):
        lg.log_metrics(2, {"x": 3.0})                     # the run is finished: wandb raises
        lg.log_metrics(3, {"x": 4.0})
    msgs = [r.getMessage() for r in caplog.records if r.name == "triage_monitor.wandb"]
    assert msgs == ["WandbLogger: run.log failed; skipped (further failures are counted, not reported)"]
    assert lg._guard.failures == {"run.log": 2}                  # a non-number is skipped, silently
    hist = history_rows(logged(offline))
    assert [h["triage/x"] for h in hist] == [1.0, 2.0] and not any("triage/bad" in h for h in hist)


def test_failed_init_is_reported_once_and_not_retried(offline, caplog):
    lg = WandbLogger(init_kwargs={"project": "triage-test", "dir": offline, "mode": "no-such-mode"})
    with caplog.at_level(logging.WARNING, logger="triage_monitor.wandb"):
        for step in range(3):
            lg.log_metrics(step, {"x": 1.0})
    assert lg.run is None and wandb.run is None
    assert [r.getMessage() for r in caplog.records].count(
        "WandbLogger: wandb.init failed; skipped (further failures are counted, not reported)") == 1
    assert lg._guard.failures == {"wandb.init": 1}


def test_user_config_and_monitor_manifest_both_kept(offline):
    """The user's WandbLogger(config=...) and the monitor's manifest share the ``triage`` config entry: both
    survive in the final W&B config (the manifest used to replace the user's dict)."""
    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    run = init(offline, config={"lr": 1e-6})
    lg = WandbLogger(run, config={"model": "4B", "recipe": "nvfp4"})
    with MismatchMonitor(offline / "run", MonitorConfig(), manifest={"framework": "test"}, loggers=[lg]) as mon:
        s = -torch.rand(2, 4) - 0.01
        mon.log_step(0, TokenBatch.from_padded(s, s, torch.tensor([1.0, -1.0]), torch.ones(2, 4)))
    run.finish()
    cfg = config_items(logged(offline))
    assert cfg["lr"] == 1e-6
    assert cfg["triage"]["model"] == "4B" and cfg["triage"]["recipe"] == "nvfp4"      # the user's
    assert cfg["triage"]["tool"] == "triage-monitor" and cfg["triage"]["info"] == {"framework": "test"}  # ours


def test_only_the_collapse_tier_raises_a_wandb_alert_unless_both_are_asked_for(offline):
    """The mismatch tier is informational (docs/alerts.md#tiers): by default it never pages anyone through
    wandb.alert; a logger asked for both tiers raises both, in order."""
    rules = [Rule("stale", "window/delta_q05", "below", -1.0, tier="mismatch"),
             Rule("diverging", "window/rho_asym", "above", 1.8, tier="collapse")]
    for tiers, want in ((("collapse",), ["triage WARN (collapse): diverging"]),
                        (("mismatch", "collapse"), ["triage WARN (mismatch): stale", "triage WARN (collapse): diverging"])):
        d = offline / "-".join(tiers)
        lg = WandbLogger(init_kwargs={"project": "triage-test", "dir": d, "mode": "offline"}, alert_tiers=tiers)
        eng = AlertEngine(rules, sinks=[lg])
        eng.observe(0, {"window/delta_q05": -2.0, "window/rho_asym": 1.0})
        eng.observe(1, {"window/delta_q05": -2.0, "window/rho_asym": 2.0})
        lg.close()
        assert [a.title for a in of_kind(logged(d), "alert")] == want
    with pytest.raises(ValueError, match="alert_tiers='collapse': give a list of tiers"):
        WandbLogger(alert_tiers="collapse")
