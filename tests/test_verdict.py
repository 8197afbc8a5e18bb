"""The post-mortem tells what happened, when, why and what to do: the run-level verdict (docs/alerts.md#the-run-verdict),
alerts that clear when their metric vanishes (docs/alerts.md#hysteresis-clearing-cooldown), the runbook entries
(docs/alerts.md#runbook) and a reference run's band (docs/alerts.md#a-reference-run).

The runs are built by hand through the public API (``MismatchMonitor`` with a recorded ``reward``), each with a
shape where a wrong answer differs from the right one: a reward that falls at a known step, alerts of both tiers at
known steps, a metric that turns NaN, a stretch at noise level."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor import TokenBatch
from triage_monitor.alerting.alert_rules import default_rules
from triage_monitor.alerting.alerts import AlertEngine, Rule, replay_engine, runbook_ref
from triage_monitor.offline.analysis import open_run
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.alerting.outcome import destabilisation_step
from triage_monitor.offline.verdict import reference_band, run_verdict

ROOT = Path(__file__).resolve().parents[1]


def _batch(g, *, drift=0.0, noise=False, negative_only=False, b=16, t=32):
    """One step: a sampler, a learner ``drift`` nats below it on the tokens of A<0 responses (ρ_asym rises with it),
    or equal to it to 1e-7 nats (``noise``: below the noise floor); ``negative_only``: every advantage < 0, so no
    A>0 token and ρ_asym has no value (NaN)."""
    sampler = -3 * torch.rand(b, t, generator=g) - 0.05                                  # (b, t), nats
    adv = torch.linspace(-1.0, 1.0, b)                                                   # (b,), no A = 0
    if negative_only:
        adv = -adv.abs() - 0.1
    if noise:
        learner = sampler + 1e-7 * torch.randn(b, t, generator=g)
    else:
        learner = sampler - drift * (adv < 0).float()[:, None] + 0.02 * torch.randn(b, t, generator=g)
    return TokenBatch.from_padded(learner.clamp(max=0), sampler, adv, torch.ones(b, t, dtype=torch.bool))


# ------------------------------------------------------------------------------ 3. alert state follows its metric
def test_an_alert_clears_when_its_metric_has_no_value_or_is_at_noise_level_live_equals_replay(tmp_path):
    """A rule on the step's ρ_asym fires on an amplifying stretch; its metric then has no value (no A>0 token: NaN)
    and the alert clears after ``hold`` = 2 such steps, with that reason; a guarded rule clears at the first step at
    noise level.  The live engine's clearings equal those of the replay of the run directory, step for step."""
    rules = [Rule("rho_step_high", "rho_asym", "above", 1.3, hold=2, tier="collapse"),
             Rule("rho_guarded", "rho_asym", "above", 1.3, hold=2, tier="mismatch", guard_metric="delta_abs_mean",
                  guard_min=1e-4)]
    g = torch.Generator().manual_seed(0)
    mon = MismatchMonitor(tmp_path / "run", MonitorConfig(window=5, calibration_steps=3), alerts=rules)
    plan = ["amp"] * 6 + ["nan"] * 4 + ["amp"] * 4 + ["noise"] * 3
    for step, kind in enumerate(plan):
        m = mon.log_step(step, _batch(g, drift=0.6 if kind != "noise" else 0.0, noise=kind == "noise",
                                      negative_only=kind == "nan"))
        if kind == "nan":
            assert math.isnan(m["rho_asym"])
        elif kind == "amp":
            assert m["rho_asym"] > 1.3
        else:
            assert m["delta_abs_mean"] < 1e-4
    live = list(mon.alerts.cleared)
    fired = [(a.step, a.rule) for a in mon.alerts.fired]
    mon.close()
    # both fire at 1 (hold 2); NaN at 6, 7 clears them at 7 (hold 2 steps without a value); the amplifying stretch
    # from 10 fires them again at 11; the unguarded rule ignores the noise stretch from 14, the guarded one clears
    assert fired == [(1, "rho_step_high"), (1, "rho_guarded"), (11, "rho_step_high"), (11, "rho_guarded")]
    by_rule = {}
    for c in live:
        by_rule.setdefault(c.rule, []).append(c)
    first = by_rule["rho_step_high"][0]
    assert (first.step, first.fired_at) == (7, 1)
    assert first.reason == "rho_asym had no value on 2 consecutive step(s) (steps 6–7; the rule clears after 2)"
    noise = by_rule["rho_guarded"][-1]
    assert noise.step == 14 and noise.reason.startswith("held back at noise level (delta_abs_mean = ")
    # the same clearings from the run directory, replayed offline
    replayed = replay_engine(rules, open_run(tmp_path / "run").steps()).cleared
    assert replayed == live
    status = {s.name: s for s in replay_engine(rules, open_run(tmp_path / "run").steps()).status()}
    assert not status["rho_guarded"].active and status["rho_guarded"].cleared == noise


def test_a_nan_gap_shorter_than_clear_after_keeps_the_alert_and_clear_after_overrides_hold():
    r = Rule("r", "window/x", "above", 1.0, hold=1, clear_after=3)
    eng = AlertEngine([r])
    seq = [2.0, math.nan, math.nan, 2.0, math.nan, math.nan, math.nan, 2.0]
    fired = [s for s, x in enumerate(seq) if eng.observe(s, {"window/x": x})]
    assert fired == [0, 7]                        # 2 NaN steps keep it active; the 3rd clears it; step 7 fires anew
    assert [(c.step, c.fired_at) for c in eng.cleared] == [(6, 0)]
    with pytest.raises(ValueError, match="clear_after"):
        Rule("r", "x", "above", 1.0, clear_after=-1)


# ------------------------------------------------------------------------------------------ 1. the run verdict
#: the two tiers' rules of the failing-run tests, written here so that the shipped rules' calibration (which rule is
#: in which tier, at which threshold) cannot move the expected steps
TIER_RULES = [Rule("gap_wide", "window/delta_q05", "below", -0.3, window=5, hold=2, tier="mismatch", level="WARN"),
              Rule("direction_up", "window/rho_asym", "above", 2.0, window=5, hold=3, tier="collapse", level="ERROR")]


def _failing_run(path, steps=60, rules=None):
    """The demo's failing run in miniature: a sampler that drifts away from the learner on the A<0 responses from step
    10 (the gap first: δ q0.05 falls at once; ρ_asym climbs with the drift), a reward of 0.6 that falls to 0.05 from
    step 30.  By hand: the trailing 10-step mean is 0.6 until step 29 and (0.6·(39 − t) + 0.05·(t − 29)) / 10 after,
    first below 0.5 × 0.6 = 0.3 at t = 35 (0.27; 0.325 at 34) and below from there on: destabilised at step 35."""
    g = torch.Generator().manual_seed(1)
    mon = MismatchMonitor(path, MonitorConfig(window=5, calibration_steps=3), alerts=rules)
    for step in range(steps):
        drift = 0.0 if step < 10 else min(0.05 * (step - 9), 1.5)
        mon.log_step(step, _batch(g, drift=drift), extra={"reward": 0.6 if step < 30 else 0.05})
    mon.close()
    return open_run(path)


def _control_run(path, steps=60, reward=True):
    """A control that holds: sampler = learner to rounding, a reward rising from 0.5 to 0.7 with a 6-step dip to 0.1
    at steps 30-35 (deep, but shorter than the definition's 10-step stay: not a destabilisation)."""
    g = torch.Generator().manual_seed(2)
    mon = MismatchMonitor(path, MonitorConfig(window=5, calibration_steps=3))
    for step in range(steps):
        r = 0.1 if 30 <= step < 36 else 0.5 + 0.2 * step / steps
        mon.log_step(step, _batch(g, noise=True), extra={"reward": r} if reward else None)
    mon.close()
    return open_run(path)


def test_the_verdict_of_a_failing_run_names_the_destabilisation_step_and_the_first_alert_of_each_tier(tmp_path):
    run = _failing_run(tmp_path / "failing", rules=TIER_RULES)
    steps = run.steps()
    assert destabilisation_step(steps["step"], steps["reward"]) == 35           # the definition, as worked out above
    engine = replay_engine(TIER_RULES, steps)
    first = {}
    for a in engine.fired:                                                       # the engine's own record, by tier
        first.setdefault(a.tier, a.step)
    assert set(first) == {"mismatch", "collapse"} and first["mismatch"] < first["collapse"] < 35
    v = run_verdict(steps, engine)
    assert v.level == "CRITICAL" and v.outcome["status"] == "destabilised" and v.outcome["step"] == 35
    assert v.outcome["peak"] == pytest.approx(0.6) and v.outcome["at"] == pytest.approx(0.27)
    assert v.lines[0].startswith("verdict: CRITICAL — destabilised at step 35 (trailing 10-step reward 0.6 at step 9 "
                                 "→ 0.27 at step 35)")
    m, c = first["mismatch"], first["collapse"]
    assert f"first alerts: mismatch gap_wide at step {m} ({35 - m} steps ahead), collapse direction_up at step {c} " \
           f"({35 - c} steps ahead)" in v.lines[0]
    assert v.first_alerts["mismatch"] == {"rule": "gap_wide", "step": m, "level": "WARN", "lead": 35 - m,
                                          "runbook": "docs/alerts.md#runbook"}
    assert v.first_alerts["collapse"]["rule"] == "direction_up" and v.first_alerts["collapse"]["lead"] == 35 - c
    # the worst window of the direction and magnitude metrics, each with its step
    rho = steps.set_index("step")["window/rho_asym"]
    q05 = steps.set_index("step")["window/delta_q05"]
    assert v.worst["window/rho_asym"] == {"step": int(rho.idxmax()), "value": float(rho.max()), "unit": ""}
    assert v.worst["window/delta_q05"]["step"] == int(q05.idxmin())
    assert f"worst windows: direction window ρ_asym {rho.max():.3g} at step {int(rho.idxmax())}" in v.text
    # the token views open at the first collapse-tier alert, and the verdict says so
    assert v.focus_step == c and f"inspect step {c} (the first collapse-tier alert, direction_up" in v.text
    assert v.lines[-1].startswith("  last step: ") and v.status.step == 59
    assert json.loads(json.dumps(v.to_dict()))["outcome"]["step"] == 35


def test_the_verdict_of_a_control_that_holds_invents_no_outcome(tmp_path):
    """A deep 6-step dip of the reward is not a destabilisation (the definition wants 10 steps), and a run without a
    reward column gets 'no reward recorded', whatever its metrics say."""
    run = _control_run(tmp_path / "control")
    steps = run.steps()
    v = run_verdict(steps, replay_engine(None, steps))
    assert v.outcome["status"] == "held" and v.outcome["step"] is None
    assert "destabilised at" not in v.text and v.level == "NO SIGNAL"
    assert v.lines[0] == "verdict: NO SIGNAL — the reward held; no alert fired"
    assert "worst windows: none — every window is at noise level" in v.text
    bare = _control_run(tmp_path / "no-reward", reward=False).steps()
    assert "reward" not in bare.columns
    v = run_verdict(bare, replay_engine(None, bare))
    assert v.outcome["status"] == "no reward recorded" and "destabilised at" not in v.text
    assert v.lines[0].startswith("verdict: NO SIGNAL — no reward recorded")
    assert "record the reward (log_step(..., extra={'reward': r})) to judge the outcome" in v.text


def test_a_fall_in_the_last_steps_is_not_called(tmp_path):
    """A reward that falls to 0 in the last 6 steps: its trailing mean is below half its peak only at the last step
    (0.24 at step 39; 0.3 at 38, not below), fewer than the 10-step stay: "held", with the fall named."""
    frame = pd.DataFrame({"step": range(40), "reward": [0.6] * 34 + [0.0] * 6})
    v = run_verdict(frame, replay_engine(None, frame))
    assert v.outcome["status"] == "held" and v.outcome["recent_fall"]
    assert "too recent to call" in v.lines[0]


# ------------------------------------------------------------------------------------------ 2. the runbook
def _slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_every_shipped_rule_has_a_runbook_entry_and_its_alert_points_to_it():
    text = (ROOT / "docs" / "alerts.md").read_text()
    runbook = text[text.index("\n## Runbook\n"):]
    runbook = runbook[:runbook.index("\n## ", 1)]
    entries = {}
    for m in re.finditer(r"^### ([^\n]+)\n(.*?)(?=^### |\Z)", runbook, re.M | re.S):
        entries[_slug(m.group(1))] = m.group(2)
    for r in default_rules():
        ref = runbook_ref(r)
        assert ref == f"docs/alerts.md#{r.name}", ref
        body = entries.get(r.name)
        assert body is not None, f"no runbook entry for {r.name}"
        for part in ("**Means**", "**Check first**", "**Change**"):
            assert part in body, (r.name, part)
    # the alert text of a shipped rule ends with its entry; a rule of one's own names none unless it says where
    (a,) = AlertEngine([r for r in default_rules() if r.name == "nonfinite_logp"]).observe(0, {"nonfinite_count": 2})
    assert a.text.endswith("What to do: docs/alerts.md#nonfinite_logp")
    (a,) = AlertEngine([Rule("mine", "x", "above", 0.0)]).observe(0, {"x": 1.0})
    assert "What to do" not in a.text
    (a,) = AlertEngine([Rule("mine", "x", "above", 0.0, runbook="https://wiki/mine")]).observe(0, {"x": 1.0})
    assert a.text.endswith("What to do: https://wiki/mine")
    # every option the framework table names is spelled as docs/hooks.md spells it
    hooks = (ROOT / "docs" / "hooks.md").read_text()
    table = runbook[runbook.index("### Turning a correction on"):runbook.index("### `rho_asym_rising`")]
    for opt in ("vllm_importance_sampling_correction", "actor_rollout_ref.actor.policy_loss.loss_mode=triage",
                "--triage.config", "--triage.monitor_only", "--algo.advantage.is_correction_mode clip",
                "trainer.algorithm.policy_loss_type=triage", "NemoRLTriageLoss", "SlimeTriageLoss",
                "--custom-loss-function-path", "MilesTriageLoss", "--use-tis", "TRIAGE_MONITOR_TRIAGE"):
        assert opt in table and opt in hooks, opt


# ------------------------------------------------------------------------------------------ 5. a reference run
def test_a_reference_runs_band_and_the_verdict_against_it(tmp_path):
    """The band is the 5-95 % range of the reference's window ρ_asym from its first full window, noise left out; a
    bit-exact control gives no band and says why; the last step is placed against the band."""
    g = torch.Generator().manual_seed(3)
    mon = MismatchMonitor(tmp_path / "ref", MonitorConfig(window=5, calibration_steps=3))
    for step in range(30):
        mon.log_step(step, _batch(g, drift=0.0), extra={"reward": 0.5})
    mon.close()
    ref = open_run(tmp_path / "ref").steps()
    band = reference_band(ref, "ref", window=5)
    rho = ref.loc[ref["step"] >= 4, "window/rho_asym"].to_numpy(float)
    assert (band.lo, band.hi) == pytest.approx(tuple(np.quantile(rho, [0.05, 0.95])))
    assert band.windows == 26 and band.noise == 0 and band.usable
    control = _control_run(tmp_path / "control", steps=12).steps()
    none = reference_band(control, "control", window=5)
    assert not none.usable and none.noise == 8 and "noise level" in none.note
    # a run whose last window lies just above the band, below the first alert threshold (1.45): WATCH against the
    # reference, where the published band alone (1.023-1.337) would call the same value "within"
    rho_last = band.hi + 0.05
    frame = pd.DataFrame({"step": range(30), "window/rho_asym": [rho_last] * 30, "window/delta_abs_mean": [0.05] * 30})
    v = run_verdict(frame, replay_engine(None, frame), reference=band)
    assert f"window ρ_asym {rho_last:.3g} at step 29, above the range of reference ref, below the first alert " \
           f"threshold 1.45 (reference ref {band.lo:.3g}–{band.hi:.3g}; published (4B dense / 30B MoE) " \
           "1.023–1.337; alert thresholds 1.45 WARN, 1.8 ERROR)" in v.lines[-1]
    assert v.status.level == "WATCH" and v.reference["label"] == "ref"
    assert run_verdict(frame, replay_engine(None, frame)).status.level == "OK"


# ------------------------------------------------------------------------------------------ 4. diagnostics' cause
def test_the_degenerate_localisation_notice_names_the_true_cause(tmp_path):
    """Responses of 64 tokens in 16-token segments (4 segments each): the first steps have an amplifying tail, the later
    ones a learner within 0.01 nats of the sampler (no token below τ_tail).  The late window's notice must say "no
    amplifying-tail token" and keep the segment width — not "shorter than one segment", the advice the issue met —
    while responses shorter than a segment still get that advice."""
    from triage_monitor.metrics.stats import MetricConfig
    from triage_monitor.offline.stages import degenerate_causes, degenerate_notice, stage_table

    g = torch.Generator().manual_seed(4)
    cfg = MonitorConfig(window=4, calibration_steps=3, metrics=MetricConfig(segment_width=16))
    with MismatchMonitor(tmp_path / "run", cfg) as mon:
        for step in range(16):
            s = -torch.rand(8, 64, generator=g) * 3 - 0.05
            tail = (torch.rand(8, 64, generator=g) < 0.1) * 1.5 if step < 6 else 0.0
            lp = (s + torch.randn(8, 64, generator=g) * (0.05 if step < 6 else 0.003) - tail).clamp(max=0)
            mon.log_step(step, TokenBatch.from_padded(lp, s, torch.linspace(-1, 1, 8),
                                                      torch.ones(8, 64, dtype=torch.bool)))
    table = stage_table(open_run(tmp_path / "run"), [5, 15], draws=19)
    assert table["max_segments"].tolist() == [4, 0]
    assert table["tail_tokens"].iloc[1] == 0 and table["neg_tokens"].iloc[1] == 4 * 4 * 64     # 4 A<0 responses/step
    assert [(st, c) for st, c, _ in degenerate_causes(table)] == [("step 15", "no_tail")]
    notice = degenerate_notice(table, 16)
    assert notice.startswith("No localisation in stage(s) step 15: the window holds no amplifying-tail token (0 of "
                             "1,024 A<0 tokens below τ_tail = ")
    assert "not a matter of the segment width" in notice and "shorter than one segment" not in notice
    # the other causes, as the counts tell them apart
    rows = pd.DataFrame({"stage": ["a", "b", "c"], "max_segments": [1, 1, 0], "neg_tokens": [100, 100, 0],
                         "tail_tokens": [5, 5, 0], "neg_pairs": [0, 40, 0], "tau_tail": [-0.5] * 3})
    assert [c for _, c, _ in degenerate_causes(rows)] == ["short", "short_tails", "no_negative"]
    text = degenerate_notice(rows, 64)
    assert "stage(s) a: every A<0 response is shorter than one segment (W = 64 positions)" in text
    assert "stage(s) b: every A<0 response that holds amplifying-tail tokens fits in one segment" in text
    assert "stage(s) c: the window holds no A<0 response" in text


# ------------------------------------------------------------------------------------------ 7. one colour convention
def test_one_colour_convention_for_the_report_the_dashboard_and_the_study():
    """The inspected (failing) run is red and the reference grey in the report and the dashboard (views.run_roles),
    the same red and grey as the study's failing arm (no correction) and its control."""
    from triage_monitor.demo.study import ARM_COLORS
    from triage_monitor.offline.views import INSPECTED_COLOR, REFERENCE_COLOR, run_roles

    assert ARM_COLORS["none"] == INSPECTED_COLOR and ARM_COLORS["fp32"] == REFERENCE_COLOR
    roles = run_roles(["failing", "other", "control"], reference="control")
    assert roles == {"failing": ("inspected", INSPECTED_COLOR), "other": ("compared", roles["other"][1]),
                     "control": ("reference", REFERENCE_COLOR)}
    assert roles["other"][1] not in (INSPECTED_COLOR, REFERENCE_COLOR)


def test_the_compare_caption_names_the_inspected_run_as_the_baseline_in_either_order(tmp_path, monkeypatch):
    """Two timed runs: the step-time comparison's caption names the run inspected as the baseline, whichever of the
    two is inspected (it read "a low-precision run ... the run inspected is the baseline", backwards when the
    low-precision run was the one inspected)."""
    import os

    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    for name, gen in (("bf16", 0.2), ("nvfp4", 0.1)):
        g = torch.Generator().manual_seed(6)
        with MismatchMonitor(tmp_path / name, MonitorConfig(window=3, calibration_steps=2)) as mon:
            for step in range(6):
                mon.log_step(step, _batch(g, drift=0.1), timings={"generation": gen, "update": 0.1, "step": gen + 0.1})
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", os.pathsep.join(str(tmp_path / n) for n in ("nvfp4", "bf16")))
    at = AppTest.from_file(str(ROOT / "dashboards" / "app.py"), default_timeout=300).run()
    assert not at.exception
    label = at.selectbox(key="cycle_other").label
    assert label.startswith("Compare nvfp4 (the run inspected: the baseline) with another run")
    at.selectbox(key="primary").set_value(str(tmp_path / "bf16")).run()
    assert not at.exception
    assert at.selectbox(key="cycle_other").label.startswith("Compare bf16 (the run inspected: the baseline) with")


# ------------------------------------------------------------------------------------------ 1. one text everywhere
def test_analyze_alerts_and_the_report_print_the_same_verdict_and_analyze_stores_it(tmp_path, capsys):
    """The same paragraph from `analyze` (and its analysis/verdict.json), `alerts` and the report's banner (and its
    embedded JSON); the report marks the destabilisation on its time series and draws the reference's band."""
    import html as html_mod

    from triage_monitor.cli import main
    from triage_monitor.offline.report import build_report

    failing = _failing_run(tmp_path / "failing")
    g = torch.Generator().manual_seed(5)
    with MismatchMonitor(tmp_path / "reference", MonitorConfig(window=5, calibration_steps=3)) as mon:
        for step in range(40):
            mon.log_step(step, _batch(g, drift=0.0), extra={"reward": 0.6})
    capsys.readouterr()
    assert main(["alerts", str(failing.path)]) == 1
    out = capsys.readouterr().out.splitlines()
    alerts_lines = out[next(k for k, line in enumerate(out) if line.startswith("verdict: ")):]
    assert alerts_lines[0].startswith("verdict: CRITICAL — destabilised at step 35")
    assert main(["analyze", str(failing.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(k for k, line in enumerate(out) if line.startswith("verdict: "))
    assert out[start:start + len(alerts_lines)] == alerts_lines
    stored = json.loads((failing.path / "analysis" / "verdict.json").read_text())
    assert stored["lines"] == alerts_lines and stored["outcome"]["step"] == 35
    page = build_report([failing.path], draws=9)
    data = re.search(r'<script type="application/json" id="triage-verdict">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data)["lines"] == alerts_lines
    banner = re.search(r'<div class="verdict verdict-critical" id="verdict">(.*?)<div class="rest">(.*?)</div>',
                       page, re.S)
    assert html_mod.unescape(banner.group(1)) == alerts_lines[0]
    assert html_mod.unescape(banner.group(2)).splitlines() == [line.strip() for line in alerts_lines[1:]]
    assert page.index('id="verdict"') < page.index("<h2>Overview</h2>")          # on top
    # with a reference: the verdict's last line and the chart use its band; every time series marks step 35
    ref_page = build_report([failing.path], draws=9, reference=tmp_path / "reference")
    ref_verdict = json.loads(re.search(r'id="triage-verdict">(.*?)</script>', ref_page, re.S).group(1))
    band = reference_band(open_run(tmp_path / "reference").steps(), "reference", window=5)
    assert f"reference reference {band.lo:.3g}–{band.hi:.3g}; published (4B dense / 30B MoE)" in ref_verdict["lines"][-1]
    markers = re.findall(r'"meta":\{"marker":"destabilised","step":(\d+)\}', ref_page)
    # every time series: the 5 panels with data here (no controller), the quadrants, the localisation (no timings)
    assert markers == ["35"] * 7
    legend = ref_page.replace("\\u002f", "/")                       # plotly's JSON writes "/" as \u002f
    assert "healthy ρ_asym 1.023–1.337, published (4B dense / 30B MoE)" in legend
    assert f"healthy ρ_asym {band.lo:.3g}–{band.hi:.3g}, reference reference" in legend


def test_a_mismatch_tier_alert_or_threshold_raises_the_last_step_to_watch_only():
    """The mismatch tier is informational (docs/alerts.md#tiers): an active mismatch-tier ERROR alert, or window ρ_asym
    above a mismatch-tier rule's threshold, makes the last step WATCH; the same rules in the collapse tier make it
    CRITICAL."""
    from triage_monitor.offline.verdict import health_verdict

    frame = pd.DataFrame({"step": np.arange(6), "window/rho_asym": np.full(6, 2.0),
                          "window/delta_abs_mean": np.full(6, 0.05), "window/delta_q05": np.full(6, -2.0)})
    for tier, level in (("mismatch", "WATCH"), ("collapse", "CRITICAL")):
        rules = [Rule("q05", "window/delta_q05", "below", -1.0, level="ERROR", tier=tier),
                 Rule("rho", "window/rho_asym", "above", 1.8, level="ERROR", tier=tier)]
        v = health_verdict(frame, replay_engine(rules, frame))
        assert v.level == level, (tier, v.line)
