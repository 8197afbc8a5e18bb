"""The Streamlit post-mortem app (AppTest against real demo runs) and the ``dashboard`` launcher."""

from __future__ import annotations

import argparse
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from triage_monitor.dashboards import launch as dashboard  # noqa: E402
from triage_monitor.commands import dashboard as dashboard_cmd  # noqa: E402
from triage_monitor.offline.analysis import open_run, recompute  # noqa: E402
from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.triage.controller import TriageConfig, TriageController  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402
from triage_monitor.offline.stages import stage_table  # noqa: E402

APP = str(dashboard.app_path())


def app(monkeypatch, *runs) -> AppTest:
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", os.pathsep.join(str(r) for r in runs))
    return AppTest.from_file(APP, default_timeout=180).run()


def charts(at: AppTest) -> dict:
    """title (up to ' · ') -> plotly figure JSON of every chart on the page."""
    out = {}
    for el in at.get("plotly_chart"):
        spec = json.loads(el.proto.spec)
        out[spec["layout"]["title"]["text"].split(" · ")[0]] = spec
    return out


def trace(spec: dict, **meta) -> dict:
    found = [d for d in spec["data"] if all(d.get("meta", {}).get(k) == v for k, v in meta.items())]
    assert len(found) == 1, (meta, [d.get("meta") for d in spec["data"]])
    return found[0]


def y(tr: dict) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in tr["y"]], dtype=float)


def assert_ok(at: AppTest) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_app_shows_analysis_values(monkeypatch, demo_run_dir):
    """Agreement test: the dashboard's charts vs ``recompute`` / the step table, both read by
    ``triage_monitor.analysis``; the analysis values are checked independently in tests/test_monitor.py
    (test_live_metrics_equal_an_independent_computation_from_the_records) and tests/test_stages.py
    (test_stage_row_equals_an_independent_computation_from_the_records)."""
    run = open_run(demo_run_dir)
    live = run.steps()
    at = app(monkeypatch, demo_run_dir)
    assert_ok(at)
    c = charts(at)
    for title in ("Direction: ρ_asym = mass(A⁻) / mass(A⁺)", "Small-gap share |δ| < 0.05", "q0.05 of δ",
                  "k3 KL estimator", "Reward and accuracy", "TRIAGE controller", "Quadrant masses (share of |A| mass)",
                  "Localisation", "δ distribution (log count)", "Segment tail fraction, A<0 responses"):
        assert title in c, sorted(c)
    assert any(k.startswith("Response ") for k in c)
    label = Path(demo_run_dir).name
    d = c["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"]
    # default view: the live pooled trailing-window values, exactly
    for col in ("rho_asym", "rho_asym_lennorm"):
        tr = trace(d, run=label, column=col)
        assert tr["x"] == live["step"].tolist()
        np.testing.assert_array_equal(y(tr), live[f"window/{col}"].to_numpy(float))
    assert any(s["type"] == "line" and s["y0"] == 1.0 for s in d["layout"]["shapes"])      # the 1.0 line
    np.testing.assert_allclose(y(trace(c["Small-gap share |δ| < 0.05"], column="small_gap_share")),
                               100 * live["window/small_gap_share"].to_numpy(float), rtol=1e-12)
    np.testing.assert_array_equal(y(trace(c["q0.05 of δ"], column="delta_q05")),
                                  live["window/delta_q05"].to_numpy(float))
    np.testing.assert_allclose(y(trace(c["Reward and accuracy"], column="reward")),
                               live["reward"].rolling(10, min_periods=1).mean().to_numpy(float), rtol=1e-12)
    np.testing.assert_allclose(y(trace(c["TRIAGE controller"], column="gate_weight_mean")),
                               live["gate_weight_mean"].rolling(10, min_periods=1).mean().to_numpy(float))
    # quadrant shares of |A| mass, by hand from the four masses
    q = c["Quadrant masses (share of |A| mass)"]
    masses = live[[f"window/mass_{r}" for r in ("amp_neg", "amp_pos", "con_neg", "con_pos")]].to_numpy(float)
    for i, r in enumerate(("amp_neg", "amp_pos", "con_neg", "con_pos")):
        np.testing.assert_allclose(y(trace(q, column=f"mass_{r}")), 100 * masses[:, i] / masses.sum(1), rtol=1e-12)
    # localisation uses the run's one frozen tau_tail for every step (the live rows' first steps are provisional)
    loc = c["Localisation"]
    frozen = recompute(run)
    assert frozen["tau_tail"].nunique() == 1
    for col in ("c_tok", "r_amp", "h_seg"):
        np.testing.assert_allclose(y(trace(loc, column=col)), 100 * frozen[f"window/{col}"].to_numpy(float),
                                   rtol=1e-12)
    assert any(s["type"] == "line" and s["y0"] == 5.0 for s in loc["layout"]["shapes"])   # uniform reference
    # overview numbers
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Steps"] == str(len(live)) and metrics["Tokens"] == f"{int(live['n_tokens'].sum()):,}"
    assert metrics["Correction"] == "triage"
    # the stage table equals stages.stage_table
    shown = at.dataframe[-1].value
    ref = stage_table(run, draws=499, seed=0)
    assert shown["stage"].tolist() == ["25%", "50%", "75%", "100%"]
    np.testing.assert_allclose(shown["C_tok %"].to_numpy(float), 100 * ref["c_tok"].to_numpy(float))
    np.testing.assert_allclose(shown["null median %"].to_numpy(float), 100 * ref["c_tok_null_median"].to_numpy(float))
    np.testing.assert_allclose(shown["dilution %"].to_numpy(float), 100 * ref["dilution"].to_numpy(float))


def test_widgets_change_what_is_shown(monkeypatch, demo_run_dir):
    run = open_run(demo_run_dir)
    live = run.steps()
    at = app(monkeypatch, demo_run_dir)
    label = Path(demo_run_dir).name
    # window toggle -> per-step values
    at.radio(key="view").set_value("per step").run()
    assert_ok(at)
    d = charts(at)["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"]
    np.testing.assert_array_equal(y(trace(d, run=label, column="rho_asym")), live["rho_asym"].to_numpy(float))
    # another trailing window -> recomputed from the token files
    at.radio(key="view").set_value("trailing window").run()
    at.number_input(key="window_steps").set_value(3).run()
    assert_ok(at)
    rec = recompute(run, window=3)
    d = charts(at)["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"]
    np.testing.assert_array_equal(y(trace(d, run=label, column="rho_asym")), rec["window/rho_asym"].to_numpy(float))
    assert at.dataframe[-1].value["window"].tolist()[-1] == f"{rec['step'].iloc[-1] - 2}-{rec['step'].iloc[-1]}"

    # step picker -> histogram of that step's δ
    step = 7
    at.select_slider(key="step").set_value(step).run()
    assert_ok(at)
    c = charts(at)
    hist = c["δ distribution (log count)"]
    assert hist["layout"]["title"]["text"].endswith(f"step {step}")
    toks = run.tokens(step)
    delta = toks["learner_logp"].astype(np.float64) - toks["sampler_logp"].astype(np.float64)
    bars = hist["data"][0]
    assert sum(bars["y"]) == len(toks) == live.set_index("step").at[step, "n_tokens"]
    counts, _ = np.histogram(delta, bins=np.array(bars["meta"]["edges"]))
    assert bars["y"] == counts.tolist()
    tau = live.set_index("step").at[step, "tau_tail"]
    assert any(s["type"] == "line" and s["x0"] == pytest.approx(tau) for s in hist["layout"]["shapes"])

    # response picker -> that response's δ and Gate weights
    options = at.selectbox(key="response").options
    assert len(options) == toks["sample_id"].nunique()
    pick = int(toks["sample_id"].unique()[3])
    at.selectbox(key="response").set_value(pick).run()
    assert_ok(at)
    resp = next(v for k, v in charts(at).items() if k.startswith(f"Response {pick}"))
    mine = toks[toks["sample_id"] == pick].sort_values("position")
    tr = trace(resp, column="delta")
    assert tr["x"] == mine["position"].tolist()
    np.testing.assert_allclose(tr["y"], (mine["learner_logp"].astype(np.float64)
                                         - mine["sampler_logp"].astype(np.float64)).to_numpy())
    batch = run.token_batch(step)
    cfg = run.manifest.info["demo_config"]
    gw = TriageController(TriageConfig(gate_width=cfg["gate_width"], gate_scope=cfg["gate_scope"]))(
        batch, step=0).gate_weights
    sel = batch.sample_id[batch.sample_index] == pick
    np.testing.assert_allclose(trace(resp, column="gate_weight")["y"], gw[sel].numpy())
    sign = "A < 0" if mine["advantage"].mean() < 0 else "A > 0" if mine["advantage"].mean() > 0 else "A = 0"
    assert sign in resp["layout"]["title"]["text"]

    # user anchors for the stage table
    at.text_input(key="anchors").input("5, 12").run()
    assert_ok(at)
    assert at.dataframe[-1].value["step"].tolist() == [5, 12]
    at.text_input(key="anchors").input("999").run()
    assert not at.exception and any("not recorded" in w.value for w in at.warning)


def test_overlay_and_run_selection(monkeypatch, demo_run_dir, demo_run_dir_none):
    a, b = Path(demo_run_dir).name, Path(demo_run_dir_none).name
    at = app(monkeypatch, demo_run_dir, demo_run_dir_none)
    assert_ok(at)
    d = charts(at)["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"]
    none_live = open_run(demo_run_dir_none).steps()
    np.testing.assert_array_equal(y(trace(d, run=b, column="rho_asym")), none_live["window/rho_asym"].to_numpy(float))
    assert {t["meta"]["run"] for t in d["data"] if "run" in t.get("meta", {})} == {a, b}
    # the published healthy band and the shipped alert thresholds on window rho_asym, named in the legend
    guides = {t["meta"]["guide"]: t["meta"]["value"] for t in d["data"] if "guide" in t.get("meta", {})}
    assert guides == {"healthy": [1.023, 1.337], "rho_asym_high": 1.45, "rho_asym_critical": 1.8}
    shapes = d["layout"]["shapes"]
    assert [(x["y0"], x["y1"]) for x in shapes if x["type"] == "rect"] == [(1.023, 1.337)]
    assert sorted(x["y0"] for x in shapes if x["type"] == "line" and x["y0"] == x["y1"]) == [1.0, 1.45, 1.8]
    at.multiselect(key="overlay").set_value([str(demo_run_dir)]).run()
    d = charts(at)["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"]
    assert {t["meta"]["run"] for t in d["data"] if "run" in t.get("meta", {})} == {a}
    # the inspected run drives the overview and the step sections
    at.selectbox(key="primary").set_value(str(demo_run_dir_none)).run()
    assert_ok(at)
    assert {m.label: m.value for m in at.metric}["Correction"] == "none"
    assert charts(at)["Quadrant masses (share of |A| mass)"]["layout"]["title"]["text"].endswith(b)


def test_step_time_and_the_full_cycle(monkeypatch, tmp_path):
    """The cycle section on two runs with hand-chosen phase times (a BF16 baseline: generation 6.0 s of 10.5 s,
    update 3.0, weight sync 0.5; an NVFP4 run: generation 2.5, a new 0.6 s quantisation, step 7.6): the stacked
    seconds and g per step equal the steps table, g = 0.571 and 1.48× at the default k = 2.3, 1.75× at k = 4, the
    comparison table's measured speedups 2.4× (generation), 1× (update), 1.38× (the cycle) beside both runs'
    mismatch figures."""
    from triage_monitor.metrics.timings import cycle_frame

    def write(path, times, gap):
        with MismatchMonitor(path, MonitorConfig(window=3, calibration_steps=2), manifest={"device": "cuda:0"}) as mon:
            for s in range(5):
                g = torch.Generator().manual_seed(s)
                lp = -torch.rand(4, 16, generator=g) - 0.01
                sp = (lp + gap * torch.randn(4, 16, generator=g)).clamp(max=-1e-4)
                mon.log_step(s, TokenBatch.from_padded(lp, sp, torch.linspace(-1, 1, 4)[:, None].expand(4, 16),
                                                       torch.ones(4, 16, dtype=torch.bool)),
                             timings={**times, "generation": times["generation"] + 0.1 * s,
                                      "step": times["step"] + 0.1 * s})
        return path

    bf16 = write(tmp_path / "bf16", {"generation": 6.0, "update": 3.0, "weight_sync": 0.5, "step": 10.5}, 1e-3)
    nvfp4 = write(tmp_path / "nvfp4", {"generation": 2.5, "update": 3.0, "weight_sync": 0.5, "quantize": 0.6,
                                       "step": 7.6}, 0.5)
    at = app(monkeypatch, bf16, nvfp4)
    assert_ok(at)
    c = charts(at)["Step time and the full cycle"]
    assert "CUDA figures" in c["layout"]["title"]["text"]
    steps = open_run(bf16).steps()
    np.testing.assert_array_equal(y(trace(c, phase="generation")), steps["time/generation"].to_numpy(float))
    np.testing.assert_array_equal(y(trace(c, phase="update")), steps["time/update"].to_numpy(float))
    np.testing.assert_allclose(y(trace(c, phase="untimed")), [1.0] * 5, rtol=1e-9)
    g = (6.0 + 0.1 * np.arange(5)) / (10.5 + 0.1 * np.arange(5))
    np.testing.assert_allclose(y(trace(c, column="g")), g, rtol=1e-12)
    np.testing.assert_allclose(y(trace(c, column="projected", k=2.3)), 1 / ((1 - g) + g / 2.3), rtol=1e-12)
    metrics = {m.label: m.value for m in at.metric}
    pooled = (30 + 1.0) / (52.5 + 1.0)
    assert metrics["Generation share g"] == f"{pooled:.3f}"
    assert metrics["Projected speedup at k = 2.3"] == f"{1 / ((1 - pooled) + pooled / 2.3):.2f}×"
    frames = {tuple(d.value.columns)[0]: d.value for d in at.dataframe}
    table = frames["phase "].set_index("phase ")
    assert table.loc["generation", "measured speedup (×)"] == pytest.approx(31.0 / 13.5)
    assert table.loc["update", "measured speedup (×)"] == pytest.approx(1.0)
    assert table.loc["whole step", "measured speedup (×)"] == pytest.approx(53.5 / 39.0)
    assert np.isnan(table.loc["quantisation / conversion", "measured speedup (×)"])
    mm = frames["mismatch"].set_index("mismatch")
    assert mm.loc["mean |δ| (nats)", "nvfp4"] > 100 * mm.loc["mean |δ| (nats)", "bf16"]
    assert mm.loc["alerts raised", "bf16"] == 0
    assert table.loc["generation", "faster generator"] == "yes" and table.loc["update", "faster generator"] == "no"
    assert "Mean step time by phase, the two runs" in charts(at)
    # k is the user's: the projection follows it
    at.number_input(key="cycle_k").set_value(4.0).run()
    assert_ok(at)
    c = charts(at)["Step time and the full cycle"]
    np.testing.assert_allclose(y(trace(c, column="projected", k=4.0)), 1 / ((1 - g) + g / 4.0), rtol=1e-12)
    assert {m.label: m.value for m in at.metric}["Projected speedup at k = 4"] == \
        f"{1 / ((1 - pooled) + pooled / 4):.2f}×"
    assert len(cycle_frame(steps)) == 5


def test_clear_messages_for_bad_runs(monkeypatch, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    at = app(monkeypatch, plain, tmp_path / "missing")
    assert not at.exception
    errs = " ".join(e.value for e in at.error)
    assert "not a triage-monitor run directory" in errs and "no such directory" in errs
    # empty run: a manifest, no step yet, still running
    mon = MismatchMonitor(tmp_path / "empty", MonitorConfig())
    at = app(monkeypatch, tmp_path / "empty")
    assert not at.exception and not at.error
    assert any("no recorded steps" in w.value for w in at.warning)
    # run being written: a few steps, not closed; one step's token file not written yet
    g = torch.Generator().manual_seed(0)
    for s in range(3):
        lp = -torch.rand(6, 20, generator=g) * 2
        mon.log_step(s, TokenBatch.from_padded(lp + 0.1 * torch.randn(6, 20, generator=g).clamp(max=0), lp,
                                               torch.randn(6, generator=g), torch.ones(6, 20)))
    mon.flush()
    from runfiles import file_of

    file_of(tmp_path / "empty", "tokens", 2).unlink()               # step 2's pending token file
    at = app(monkeypatch, tmp_path / "empty")
    assert not at.exception and not at.error
    assert any("still being written" in i.value for i in at.info)
    assert any("step 2" in w.value for w in at.warning)              # token records missing: said, not raised
    assert len(at.get("plotly_chart")) >= 6                          # the step-level charts are there
    mon.close()
    # switching to a bad path from the sidebar (one under the run given: the page's roots are the runs given)
    at.text_area(key="runs_text").input(str(tmp_path / "empty" / "steps")).run()
    assert not at.exception and any("not a triage-monitor run" in e.value for e in at.error)
    # a run recorded without token rows: step-level charts, messages for the token-level parts
    with MismatchMonitor(tmp_path / "steps_only", MonitorConfig(record_tokens=False, window=2)) as m2:
        for s in range(4):
            lp = -torch.rand(6, 20, generator=g) * 2
            m2.log_step(s, TokenBatch.from_padded((lp + 0.1 * torch.randn(6, 20, generator=g)).clamp(max=0), lp,
                                                  torch.randn(6, generator=g), torch.ones(6, 20)))
    at = app(monkeypatch, tmp_path / "steps_only")
    assert not at.exception and not at.error
    assert len(at.get("plotly_chart")) >= 6
    warnings = " ".join(w.value for w in at.warning)
    live = open_run(tmp_path / "steps_only").steps()
    from triage_monitor.offline.verdict import verdict_of_steps

    focus = verdict_of_steps(live).focus_step                         # the page opens its token views there
    assert f"Token records of step {focus} are not readable" in warnings
    table = at.dataframe[-1].value                                   # live window values, null "-"
    assert table["step"].tolist() == [0, 1, 2, 3] and table["null 95% interval (%)"].tolist() == ["-"] * 4
    np.testing.assert_allclose(table["ρ_asym"].to_numpy(float), live["window/rho_asym"].to_numpy(float))
    at.number_input(key="window_steps").set_value(3).run()
    assert not at.exception and "no token records to recompute" in " ".join(w.value for w in at.warning)


def test_launcher_command_and_validation(demo_run_dir, tmp_path, capsys):
    p = dashboard_cmd.add_arguments(argparse.ArgumentParser())
    args = p.parse_args([str(demo_run_dir)])
    assert (args.host, args.port) == ("127.0.0.1", 8501)
    cmd = dashboard.build_command([str(demo_run_dir)], args.host, 9000)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and Path(cmd[4]).is_file() and cmd[4].endswith("app.py")
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1" and cmd[cmd.index("--server.port") + 1] == "9000"
    assert cmd[cmd.index("--") + 1:] == [str(demo_run_dir), f"--allow-root={demo_run_dir}"]
    ref = dashboard.build_command([str(demo_run_dir)], args.host, 9000, reference="/runs/ref")
    assert ref[ref.index("--") + 1:] == [str(demo_run_dir), "--reference", "/runs/ref", f"--allow-root={demo_run_dir}",
                                         "--allow-root=/runs/ref"]
    assert Path(cmd[4]).parent.name == "dashboards" and (Path(cmd[4]).parent / "__init__.py").is_file()
    args = p.parse_args([str(demo_run_dir), "--host", "0.0.0.0", "--port", "8600", "--print-command"])
    assert dashboard_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "--server.address 0.0.0.0" in out and "--server.port 8600" in out
    assert str(Path(demo_run_dir).resolve()) in out
    (tmp_path / "x").mkdir()
    assert dashboard_cmd.run(p.parse_args([str(demo_run_dir), str(tmp_path / "x")])) == 2
    assert "not a triage-monitor run directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="port"):
        dashboard.build_command([], port=70000)


def test_launcher_sigterm_stops_the_server_too(demo_run_dir):
    # `kill`, `timeout` or a supervisor signal the launcher only; the Streamlit child must not be orphaned
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = subprocess.Popen([sys.executable, "-m", "triage_monitor.cli", "dashboard", str(demo_run_dir),
                                 "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/_stcore/health"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the dashboard did not start")
        launcher.terminate()
        assert launcher.wait(timeout=30) is not None
        for _ in range(40):                          # the server goes away with the launcher
            try:
                urllib.request.urlopen(url, timeout=1)
                time.sleep(0.5)
            except OSError:
                break
        else:
            pytest.fail("the Streamlit server outlived its launcher")
    finally:
        launcher.kill()


def test_app_ships_in_the_wheel(tmp_path):
    """A regular (non-editable) install carries dashboards/app.py as triage_monitor/dashboards/app.py."""
    import subprocess
    import sys

    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in the environment")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("triage_monitor-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "triage_monitor/dashboards/app.py" in names
    assert "triage_monitor/dashboards/launch.py" in names
    for mod in ("report", "stages", "views"):
        assert f"triage_monitor/offline/{mod}.py" in names
    for pkg in ("metrics", "triage", "rundir", "alerting", "offline", "commands", "demo", "hooks"):
        assert f"triage_monitor/{pkg}/__init__.py" in names, pkg


def test_alerts_drawn_as_markers(monkeypatch, tmp_path):
    from triage_monitor.alerting.alerts import AlertEngine, Rule

    rules = [Rule("k3_high", "k3_kl", "above", 0.02, cooldown=3), Rule("ctok_high", "window/c_tok", "above", 0.0)]
    g = torch.Generator().manual_seed(1)
    with MismatchMonitor(tmp_path / "alerting", MonitorConfig(window=4, calibration_steps=2),
                         alerts=AlertEngine(rules)) as mon:
        for s in range(12):
            lp = -torch.rand(8, 40, generator=g) * 2
            noise = torch.randn(8, 40, generator=g) * (0.02 + 0.05 * s)
            mon.log_step(s, TokenBatch.from_padded((lp + noise).clamp(max=0), lp, torch.randn(8, generator=g),
                                                   torch.ones(8, 40)))
    run = open_run(tmp_path / "alerting")
    alerts, live = run.alerts(), run.steps().set_index("step")
    k3_steps = alerts.loc[alerts["rule"] == "k3_high", "step"].tolist()
    ctok_steps = alerts.loc[alerts["rule"] == "ctok_high", "step"].tolist()
    assert k3_steps and ctok_steps
    at = app(monkeypatch, tmp_path / "alerting")
    assert_ok(at)
    assert {m.label: m.value for m in at.metric}["Alerts"] == str(len(alerts))
    assert at.dataframe[0].value["rule"].tolist() == alerts["rule"].tolist()      # the alert table
    c = charts(at)
    label = "alerting"
    k3 = trace(c["k3 KL estimator"], run=label, alerts=True)
    assert k3["x"] == k3_steps
    np.testing.assert_array_equal(k3["y"], live.loc[k3_steps, "window/k3_kl"].to_numpy())
    d = trace(c["Direction: ρ_asym = mass(A⁻) / mass(A⁺)"], run=label, alerts=True)   # c_tok has no own panel
    assert d["x"] == ctok_steps
    assert all("ctok_high" in t for t in d["hovertext"])


def test_large_stage_table_waits_for_a_click(monkeypatch, demo_run_dir):
    monkeypatch.setenv("TRIAGE_MONITOR_STAGE_AUTO_TOKENS", "1000")
    at = app(monkeypatch, demo_run_dir)
    assert_ok(at)
    assert any("computed on request" in i.value for i in at.info)
    assert len(at.dataframe) == 0 and len(at.get("plotly_chart")) >= 10        # everything else is there
    at.toggle(key="stage_go").set_value(True).run()
    assert_ok(at)
    assert at.dataframe[-1].value["stage"].tolist() == ["25%", "50%", "75%", "100%"]


def test_step_level_path_needs_no_torch():
    """The dashboard's first charts (manifest, steps, figures) import neither torch nor the metric code."""
    import subprocess
    import sys

    code = ("import sys, triage_monitor.analysis, triage_monitor.views; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    from triage_monitor.metrics import stats as metrics
    from triage_monitor.offline import views
    assert views.REGIONS == metrics.REGIONS


def test_chart_cosmetics_labels_stay_clear_of_data_and_titles():
    """The toolbar stands vertically on the right edge (not over the title); the δ histogram labels one tick
    per decade and writes its τ_tail / small-gap labels above the plot area; the uniform C_tok reference is
    named in the legend, not written across the lines."""
    import pandas as pd

    from triage_monitor.offline import views

    rng = np.random.default_rng(0)
    delta = np.r_[rng.normal(0, 0.01, 20000), rng.normal(-0.5, 0.2, 300)]
    fig = views.delta_histogram_figure(delta, -0.2, 0.05, step=3)
    lay = fig.layout
    assert lay.modebar.orientation == "v"
    assert list(lay.yaxis.tickvals) == [1, 10, 100, 1000, 10000, 100000]
    assert list(lay.yaxis.ticktext) == ["1", "10", "100", "1k", "10k", "100k"]
    labels = {a.text: a for a in lay.annotations}
    tau = next(a for t, a in labels.items() if t.startswith("τ_tail"))
    assert tau.yref == "paper" and tau.y == 1.0 and tau.yanchor == "bottom"       # above the bars
    assert lay.margin.t >= 60                                                     # room between title and labels
    df = pd.DataFrame({"step": [0, 1, 2], "window/c_tok": [0.2, 0.3, 0.25], "window/r_amp": [0.05, 0.06, 0.05],
                       "window/h_seg": [0.1, 0.1, 0.1]})
    loc = views.localisation_figure(df, window=True)
    assert not [a for a in loc.layout.annotations if "reference" in (a.text or "")]
    ref = [t for t in loc.data if t.meta and "reference" in t.meta]
    assert len(ref) == 1 and ref[0].name == "uniform C_tok reference (5 %)" and ref[0].showlegend is not False


def test_drill_down_segments_use_the_monitor_width(monkeypatch, tmp_path):
    """The drill-down cuts responses with the monitor's W (as the heatmap does), not the Gate's width."""
    from triage_monitor.metrics.stats import MetricConfig

    g = torch.Generator().manual_seed(0)
    cfg = MonitorConfig(window=2, calibration_steps=1, metrics=MetricConfig(segment_width=8))
    with MismatchMonitor(tmp_path / "run", cfg, manifest={"triage_config": {"gate_width": 16}}) as mon:
        for step in range(3):
            s_ = -torch.rand(4, 40, generator=g) * 3 - 0.01
            lp = (s_ + torch.randn(4, 40, generator=g) * 0.1).clamp(max=0)
            mon.log_step(step, TokenBatch.from_padded(lp, s_, torch.linspace(-1, 1, 4), torch.ones(4, 40, dtype=bool)))
    at = app(monkeypatch, tmp_path / "run")
    assert_ok(at)
    captions = " ".join(c.value for c in at.caption)
    assert "Segment boundaries every 8 positions (the monitor's segment width W" in captions
    assert "Gate width 16" in captions
    resp = next(v for k, v in charts(at).items() if k.startswith("Response"))
    assert resp["layout"]["title"]["text"].endswith("segments of 8")
    xs = sorted(sh["x0"] + 0.5 for sh in resp["layout"]["shapes"] if sh["type"] == "line" and sh["x0"] == sh["x1"]
                and sh.get("xref") == "x")
    assert xs == [8, 16, 24, 32], xs


def test_manifest_strings_are_shown_as_plain_text_not_markdown(monkeypatch, tmp_path):
    """A crafted run.json (links, a remote image, bold, raw HTML in its model / task / framework, tool version and
    creation time) is shown as typed: plain text elements holding the strings verbatim, and no Markdown element of
    the page carries them (Markdown would render the link and load the image)."""
    link, image = "[click me](https://evil.example/phish)", "![pixel](https://evil.example/track.png)"
    crafted = {"model": f"{link} {image}", "task": "**bold** <img src=https://evil.example/x.png>",
               "framework": "<script>alert(1)</script>"}
    g = torch.Generator().manual_seed(0)
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, calibration_steps=1), manifest=crafted) as mon:
        for step in range(3):
            s_ = -torch.rand(4, 24, generator=g) * 2 - 0.01
            lp = (s_ + torch.randn(4, 24, generator=g) * 0.1).clamp(max=0)
            mon.log_step(step, TokenBatch.from_padded(lp, s_, torch.linspace(-1, 1, 4), torch.ones(4, 24, dtype=bool)))
    run_json = tmp_path / "run" / "run.json"
    doc = json.loads(run_json.read_text())
    doc.update(tool_version=image, created=link)
    run_json.write_text(json.dumps(doc))
    at = app(monkeypatch, tmp_path / "run")
    assert_ok(at)
    texts = [t.value for t in at.text]
    assert (f"{tmp_path / 'run'} · triage-monitor {image} · created {link}") in texts
    assert (f"model: {link} {image} · task: **bold** <img src=https://evil.example/x.png> · "
            "framework: <script>alert(1)</script>") in texts
    rendered = [m.value for m in at.markdown] + [c.value for c in at.caption]
    assert not [v for v in rendered if "evil.example" in v or "alert(1)" in v], rendered


@pytest.mark.multiprocess
def test_ctrl_c_stops_the_dashboard_server_with_one_line_and_status_130(tmp_path):
    """``triage-monitor dashboard RUN`` in its own session, Ctrl-C as a terminal sends it (SIGINT to the process
    group) once the server answers its health check: the launcher stops Streamlit, prints one line and exits 130,
    and nothing listens on the port any more."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    run = tmp_path / "run"
    with MismatchMonitor(run, MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            sp = -torch.rand(4, 16, generator=g) - 0.1
            mon.log_step(s, TokenBatch.from_padded(sp - 0.05, sp, torch.ones(4), torch.ones(4, 16)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "triage_monitor", "dashboard", str(run), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while True:                                           # the condition: the server answers
            assert proc.poll() is None, proc.stderr.read()
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=5).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert [ln for ln in err.splitlines() if "interrupted" in ln] == [
        "triage-monitor dashboard: interrupted (Ctrl-C); server stopped"], err
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the server still listens"


def test_a_page_opens_each_run_once_and_builds_the_stage_table_in_one_call(monkeypatch, demo_run_dir):
    """One page render (overview, charts, localisation, stage table, verdict) opens the run directory once, and the
    stage table is :func:`~triage_monitor.offline.stages.stage_table` over the page's snapshot — the same table the
    offline call gives."""
    import streamlit as st

    import triage_monitor.offline.analysis as analysis

    opened = []
    real = analysis.open_run

    def counting(path, *a, **k):
        opened.append(str(path))
        return real(path, *a, **k)

    st.cache_resource.clear()
    st.cache_data.clear()
    monkeypatch.setattr(analysis, "open_run", counting)
    at = app(monkeypatch, demo_run_dir)
    assert_ok(at)
    assert opened == [str(demo_run_dir)]
    shown = [df for df in at.dataframe if "C_tok %" in df.value.columns]
    assert len(shown) == 1
    expected = stage_table(open_run(demo_run_dir), window=None, seed=0)
    assert shown[0].value["step"].tolist() == expected["step"].tolist()
