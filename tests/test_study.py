"""The mismatch study: the walk task by hand, destabilisation / blow-up / onsets by hand, the noise guard on a real
fp32-sampler run, live alerts on a small real run, the stale sampler, the sampler-follow correlation, the GPU preset
through the CPU, and the `study` command end to end (CI-sized)."""

import json
import math

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch

pytest.importorskip("torchao")

from triage_monitor.offline.analysis import open_run  # noqa: E402
from triage_monitor.alerting.alerts import NOISE_FLOOR_NATS, Rule, AlertEngine, default_rules, replay_engine  # noqa: E402
from triage_monitor.cli import main  # noqa: E402
from triage_monitor.demo import DemoConfig, run_demo  # noqa: E402
from triage_monitor.demo.nvfp4 import use_recipe  # noqa: E402
from triage_monitor.demo.grpo import follow_correlation, teacher_forced_logp  # noqa: E402
from triage_monitor.demo.study import (ARMS, DEFAULT_ARMS, GPU_PRESET, blowup_step, destabilisation_step,  # noqa: E402
                                       judge_run, onsets, pick_pair, study_config)
from triage_monitor.demo.task import EQUALS, BOS, VOCAB_SIZE, WalkTask  # noqa: E402

pytestmark = pytest.mark.slow

# a CI-sized walk job: 16-token responses (two 8-token segments), 8 responses per step, no warm start, on-policy
TINY = dict(task="walk", response_len=16, alphabet=4, sft_steps=0, prompts_per_step=2, group_size=4, eval_size=4,
            gate_width=8, repair_width=16, segment_width=8, window=3, calibration_steps=2, log_every=100,
            nvfp4_backend="native", sampler_lag=0, follow_every=2, eval_every=2)


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
    # a deep dip that recovers counts: 0.0 on steps 30..44, 0.8 before and after.  m(35) = (4·0.8 + 6·0)/10
    # = 0.32 < 0.4 (half the peak 0.8); m(48) = (6·0 + 4·0.8)/10 = 0.32; m(49) = (5·0 + 5·0.8)/10 = 0.4, not below:
    # below on steps 35..48, 14 consecutive steps >= 10, although the run ends back at 0.8
    dip = np.where((steps >= 30) & (steps < 45), 0.0, 0.8)
    assert destabilisation_step(steps, dip) == 35
    # a shorter dip, 0.0 on steps 30..38 (9 steps): m(34) = 0.4 and m(43) = 0.4 are not below, so the mean is below
    # half the peak on steps 35..42 only: 8 consecutive steps < 10, not destabilised
    short = np.where((steps >= 30) & (steps < 39), 0.0, 0.8)
    assert np.flatnonzero(pd.Series(short).rolling(10).mean().to_numpy() < 0.4).tolist() == list(range(35, 43))
    assert destabilisation_step(steps, short) is None
    # the running peak is the reference: 0.5 for 20 steps, 1.0 for 20, then 0.45.  m(48) = (1·1.0 + 9·0.45)/10
    # = 0.505 is not below 0.5; m(49..59) = 0.45 is: 11 consecutive steps from 49
    climb = np.concatenate([np.full(20, 0.5), np.full(20, 1.0), np.full(20, 0.45)])
    assert destabilisation_step(steps, climb) == 49
    # a crash in the last 9 steps cannot be called: 0.0 from step 46 gives m < 0.4 from step 51 (9 steps to 59)
    late = np.where(steps < 46, 0.8, 0.0)
    assert destabilisation_step(steps, late) is None
    assert destabilisation_step(steps, np.where(steps < 45, 0.8, 0.0)) == 50     # 50..59: exactly 10 steps
    with pytest.raises(ValueError, match="length"):
        destabilisation_step(steps, flat[:-1])


def test_blowup_step_by_hand():
    steps = np.arange(40)
    # mean |δ| 0.05 nats for 20 steps, then 1.0: the reference (rows 0..9) is 0.05, 10x = 0.5; the trailing mean
    # exceeds 0.5 once 10 of its rows hold... (k·1.0 + (10−k)·0.05)/10 > 0.5 for k >= 5: at step 24
    d = np.where(steps < 20, 0.05, 1.0)
    assert blowup_step(steps, d) == 24
    # from a later reference (a lagged sampler at full staleness from row 20) there is no growth at all
    assert blowup_step(steps, d, ref_start=20) is None
    # the same growth at noise level (a bit-exact fp32 sampler) never counts
    assert blowup_step(steps, d * 1e-6, guard=d * 1e-6) is None
    assert blowup_step(steps, d * 1e-6) == 24            # without the guard it would
    # too short for a reference
    assert blowup_step(steps[:5], d[:5]) is None
    with pytest.raises(ValueError, match="ref_start"):
        blowup_step(steps, d, ref_start=-1)


def test_direction_onset_one_sided_and_two_sided():
    n = 40
    base = {"step": np.arange(n), "window/delta_abs_mean": np.full(n, 0.05), "window/small_gap_share": np.full(n, 0.9),
            "window/k3_kl": np.full(n, 1e-3)}
    ref = np.full(10, 1.0)
    # falling ρ_asym (what TRIAGE does): leaves the band below only -> two-sided onset, no one-sided onset
    falling = pd.DataFrame({**base, "window/rho_asym": np.concatenate([ref, np.linspace(1.0, 0.5, n - 10)])})
    on = onsets(falling)
    assert on["rho_band"] == pytest.approx((0.85, 1.15))
    assert on["direction_up"] is None and on["direction_2s"] == 19   # 1 − 9·(0.5/29) = 0.845 < 0.85 at row 19
    # rising ρ_asym (amplification): both, at the first value above 1.15 (row 10 + k, k·(1/29) > 0.15: k = 5)
    rising = pd.DataFrame({**base, "window/rho_asym": np.concatenate([ref, np.linspace(1.0, 2.0, n - 10)])})
    on = onsets(rising)
    assert on["direction_up"] == on["direction_2s"] == 15
    # the reference starts at full staleness (ref_start): from row 20 the band is 1.5 ± 3 MAD (rows 20..29 hold
    # 1 + k/29, k = 10..19: median 1.5, MAD 2.5/29) = 1.5 ± 0.2586, first value above it: k = 23, row 33
    late = onsets(rising, ref_start=20)
    assert late["rho_band"] == pytest.approx((1.5 - 7.5 / 29, 1.5 + 7.5 / 29)) and late["direction_up"] == 33
    # at noise level nothing is an onset
    quiet = rising.assign(**{"window/delta_abs_mean": 1e-8})
    assert onsets(quiet)["direction_up"] is None and onsets(quiet)["noise_steps"] == n


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


def test_live_alerts_and_diagnostics_on_a_small_real_run(tmp_path):
    cfg = DemoConfig(**{**TINY, "steps": 8, "correction": "triage", "sampler_lag": 2})
    df = run_demo(cfg, tmp_path, quiet=True)
    assert (df["window/delta_abs_mean"] > NOISE_FLOOR_NATS).all()     # NVFP4: a real gap, above the floor
    assert df["sampler_staleness"].tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    # a rule that fires once window ρ_asym exceeds its first value: found by hand with pandas
    thr = float(df["window/rho_asym"].dropna().iloc[0])
    rule = Rule(name="rho_up", metric="window/rho_asym", condition="above", threshold=thr, group="direction",
                guard_metric="window/delta_abs_mean", guard_min=NOISE_FLOOR_NATS)
    j = judge_run(df, window=cfg.window, rules=[rule])
    above = df.loc[df["window/rho_asym"] > thr, "step"]
    assert j["first_alert"] == (int(above.iloc[0]) if len(above) else None) and j["alerts_source"] == "replay"
    assert j["destabilised_at"] is None and j["lead_steps"] is None      # 8 steps: nothing to call
    # the shipped rules ran live: the run directory's alerts/ table is what the study reads, and a replay agrees
    live = open_run(tmp_path).alerts()
    jl = judge_run(df, window=cfg.window, live_alerts=live)
    assert jl["alerts_source"] == "live" and jl["live_equals_replay"] is True
    assert jl["n_alerts"] == len([r for r in live.get("rule", []) if r != "nonfinite_logp"])
    # two rules firing at one step: the live table's order within a step is not the firing order, and still agrees
    twins = [Rule(name=n, metric="window/rho_asym", condition="above", threshold=thr, group="direction",
                  guard_metric="window/delta_abs_mean", guard_min=NOISE_FLOOR_NATS) for n in ("z_up", "a_up")]
    fired = sorted((int(a.step), a.rule) for a in replay_engine(twins, df).fired)   # z_up fires first, stored after
    if fired:
        assert [r for _, r in fired[:2]] == ["a_up", "z_up"]
        as_stored = pd.DataFrame({"step": [s for s, _ in fired], "rule": [n for _, n in fired]})
        assert judge_run(df, window=cfg.window, rules=twins, live_alerts=as_stored)["live_equals_replay"] is True
        assert judge_run(df, window=cfg.window, rules=twins, live_alerts=as_stored.iloc[:1])["live_equals_replay"] is False
    # diagnostics by hand: trailing-10 reward needs 10 steps (8 here: NaN), gradient norm, follow probes at 0, 2, 4, 6
    assert math.isnan(j["reward_min"]) and j["grad_norm_max"] == pytest.approx(df["grad_norm"].max())
    assert df["follow_corr"].notna().tolist() == [s % 2 == 0 for s in range(8)]
    assert j["follow"] == pytest.approx(df["follow_corr"].mean()) and -1 < j["follow"] < 1
    # the Gate's calibrated thresholds act at this scale: it down-weights tokens after the reference window
    assert df.loc[df["step"] >= cfg.calibration_steps, "gate_downweighted_frac"].max() > 0
    on = onsets(df, 2)
    assert set(on) == {"noise_steps", "rho_band", "direction_up", "direction_2s", "small_gap", "k3"}
    info = json.loads((tmp_path / "run.json").read_text())["info"]
    assert info["mismatch_mechanism"] == cfg.mechanism()
    assert "a sampler 2 updates stale" in info["mismatch_mechanism"] and "was not measured" in info["mismatch_mechanism"]


def test_follow_correlation_by_hand():
    import torch

    from triage_monitor.demo.model import GPTConfig, TinyGPT
    from triage_monitor.demo.nvfp4 import get_recipe

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=22, quantized=("blocks.*.mlp.*",)))
    prompts = torch.randint(0, 10, (6, 6))
    resp = torch.randint(0, 10, (6, 16))
    mask = torch.ones(6, 16, dtype=torch.bool)
    mask[0, 10:] = False
    nv = get_recipe("nvfp4")
    with torch.no_grad():
        before_l = teacher_forced_logp(model, prompts, resp)
        with use_recipe(model, nv):
            before_s = teacher_forced_logp(model, prompts, resp)
        for p in model.parameters():          # one "update"
            p.add_(torch.randn_like(p) * 1e-3)
    # an fp32 sampler is the learner: its change is the learner's, correlation exactly 1
    assert follow_correlation(model, None, None, prompts, resp, mask, before_l, before_l) == pytest.approx(1.0, abs=1e-12)
    # NVFP4: Pearson's r of the two changes over the valid tokens, as numpy computes it
    r = follow_correlation(model, nv, None, prompts, resp, mask, before_l, before_s)
    with torch.no_grad():
        after_l = teacher_forced_logp(model, prompts, resp)
        with use_recipe(model, nv):
            after_s = teacher_forced_logp(model, prompts, resp)
    want = np.corrcoef((after_l - before_l)[mask].double().numpy(), (after_s - before_s)[mask].double().numpy())[0, 1]
    assert r == pytest.approx(want, rel=1e-9) and -1 <= r < 1
    # no change at all: undefined
    assert math.isnan(follow_correlation(model, None, None, prompts, resp, mask, after_l, after_l))


def test_stale_sampler_lags_the_learner(tmp_path):
    base = {**TINY, "steps": 3, "sampler_recipe": "fp32", "correction": "none", "lr": 1e-2}
    sync = run_demo(DemoConfig(**base), tmp_path / "sync", quiet=True)
    lag = run_demo(DemoConfig(**{**base, "sampler_lag": 1}), tmp_path / "lag", quiet=True)
    assert sync["delta_abs_mean"].max() < 1e-5
    # step 0 samples with the initial weights in both; from step 1 on the lagged sampler is one update behind
    assert lag["delta_abs_mean"].iloc[0] < 1e-5 and (lag["delta_abs_mean"].iloc[1:] > 1e-3).all()
    info = json.loads((tmp_path / "lag" / "run.json").read_text())["info"]
    assert info["sampler_lag"] == 1 and "stale" in info["mismatch_mechanism"]


def _argv(cfg: dict) -> list:
    """``study`` options for a config dict (log_every is not one: the runs print nothing)."""
    out = []
    for k, v in cfg.items():
        if k == "log_every":
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def test_study_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--arms", "none,fp32", "--seeds", "0", "--steps", "4"] + _argv(
        {**TINY, "sampler_lag": 2})
    assert main(argv) == 0
    summary = pd.read_csv(out / "summary.csv")
    assert summary[["arm", "seed"]].values.tolist() == [["none", 0], ["fp32", 0]]
    assert summary["steps"].tolist() == [4, 4] and summary["alerts_source"].tolist() == ["live", "live"]
    assert {"destabilised_at", "blowup_delta_at", "blowup_k3_at", "reward_min", "follow", "grad_norm_max",
            "rho_window_min", "rho_window_max", "direction_onset_up", "direction_onset_2s"} <= set(summary.columns)
    assert summary.loc[1, "follow"] == pytest.approx(1.0)        # the fp32 sampler follows the learner exactly
    arms = pd.read_csv(out / "arms.csv")
    assert arms["arm"].tolist() == ["none", "fp32"] and arms["seeds"].tolist() == [1, 1]
    traj = pd.read_csv(out / "trajectories.csv")
    assert len(traj) == 8 and {"window/rho_asym", "delta_abs_mean", "grad_norm", "follow_corr"} <= set(traj.columns)
    for arm in ("none", "fp32"):
        assert (out / "runs" / f"{arm}-s0" / "run.json").exists()
    # the arms' own lags: none keeps the study's (2), the control is on-policy
    infos = {a: json.loads((out / "runs" / f"{a}-s0" / "run.json").read_text())["info"] for a in ("none", "fp32")}
    assert infos["none"]["sampler_lag"] == 2 and infos["fp32"]["sampler_lag"] == 0
    assert "control" in infos["fp32"]["mismatch_mechanism"]
    meta = json.loads((out / "study.json").read_text())
    assert meta["destabilisation"] == {"smooth_steps": 10, "collapse_fraction": 0.5, "min_stay": 10}
    assert meta["noise_floor_nats"] == NOISE_FLOOR_NATS and meta["blowup"]["factor"] == 10.0
    assert meta["mechanism"] == infos["none"]["mismatch_mechanism"]
    assert meta["mechanism"].startswith("mismatch from a sampler 2 updates stale (asynchronous rollout) on top of nvfp4")
    page = (out / "study.html").read_text()
    assert "Steps to destabilise" not in page and "Per run: steps to destabilise" in page and "plotly" in page.lower()
    assert "fp32 sampler on-policy · no correction (control)" in page and html_escape(meta["mechanism"]) in page
    # the window ρ_asym panels carry the published healthy band and the alert thresholds (legend entries)
    legend = page.replace("\\u002f", "/")                  # plotly's JSON writes "/" as \u002f
    assert "published (4B dense / 30B MoE)" in legend and "alert rho_asym_high" in page and "alert rho_asym_critical" in page
    text = capsys.readouterr().out
    # progress per run as plain lines (captured output is not a terminal), the table, where to look
    assert "none s0: step 4/4" in text and "fp32 s0: step 4/4" in text
    assert "study.html" in text and "triage-monitor dashboard" in text and "mismatch: mismatch from" in text
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


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_study_options_do_not_overlap_and_defaults_are_the_demo_job(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    text = capsys.readouterr().out
    flags = [w.rstrip(",") for w in text.split() if w.startswith("--")]
    usage = text[:text.index("options:")]
    opts = [w.strip("[]") for w in usage.split() if w.strip("[]").startswith("--")]
    assert len(opts) == len(set(opts))                         # every option once
    for per_arm in ("--seed", "--correction", "--sampler-recipe", "--log-every"):
        assert per_arm not in opts
    assert "--seeds" in flags and "--sampler-lag" in flags and "--preset" in flags and "--device" in flags
    for bad in (["--seed", "1"], ["--correction", "tis"]):
        with pytest.raises(SystemExit):
            main(["study", "--out", "unused", *bad])
    # no options: the study's job is DemoConfig's defaults (what `triage-monitor demo` runs), six arms, 10 seeds
    cfg, arms, seeds = study_config()
    assert cfg == DemoConfig() and arms == DEFAULT_ARMS and seeds == tuple(range(10))
    assert set(DEFAULT_ARMS) == {"none", "none-half-lr", "tis", "triage", "fp32-lag", "fp32"}
    assert ARMS["fp32"]["sampler_lag"] == 0
    cfg, arms, seeds = study_config(quick=True, steps=7)
    assert (cfg.steps, arms, seeds) == (7, ("none", "fp32"), (0,))
    with pytest.raises(ValueError, match="per arm"):
        study_config(correction="tis")


def test_gpu_preset_runs_through_the_cpu(tmp_path, capsys):
    # the preset's values, explicit options winning (sizes cut down for CI); the same code as --device cuda
    cfg, arms, seeds = study_config("gpu", device="cpu", d_model=32)
    want = GPU_PRESET["config"]
    assert (cfg.d_model, cfg.n_layer, cfg.response_len, cfg.segment_width, cfg.sampler_lag, cfg.lr) == \
        (32, want["n_layer"], 256, 64, 0, 3e-5)
    assert cfg.response_len // cfg.segment_width == 4 and VOCAB_SIZE + cfg.vocab_tail == 1024
    assert cfg.prompts_per_step * cfg.group_size == 256 and 600 <= cfg.steps <= 1000
    assert arms == ("none", "tis", "triage", "fp32", "none-mlp")
    small = dict(d_model=32, n_layer=1, n_head=2, vocab_tail=10, response_len=16, segment_width=8, gate_width=8,
                 repair_width=16, prompts_per_step=2, group_size=2, sft_steps=2, sft_batch=4, eval_size=2, steps=3,
                 follow_every=1, window=3, calibration_steps=2)
    out = tmp_path / "gpu"
    assert main(["study", "--preset", "gpu", "--device", "cpu", "--out", str(out), "--arms", "none,none-mlp",
                 *_argv(small)]) == 0
    s = pd.read_csv(out / "summary.csv")
    assert s["arm"].tolist() == ["none", "none-mlp"] and s["follow"].notna().all()
    info = json.loads((out / "runs" / "none-mlp-s0" / "run.json").read_text())["info"]
    assert info["device"] == "cpu" and info["demo_config"]["quantize"] == "mlp" and info["demo_config"]["lr"] == 3e-5
    assert "on-policy" in info["mismatch_mechanism"] and "MLP linears" in info["mismatch_mechanism"]
    assert "10 never-valid tail tokens" in info["task"]
    import torch

    if not torch.cuda.is_available():     # no CUDA: the cuda path refuses with a message (exit 2), nothing runs
        assert main(["study", "--preset", "gpu", "--out", str(tmp_path / "no"), "--steps", "1"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
        assert not (tmp_path / "no").exists()


def test_gpu_script_is_one_prepared_command(tmp_path):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_study.sh"
    text = script.read_text()
    assert "--preset gpu" in text and "--device" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_pick_pair_prefers_the_failing_arm_and_its_control():
    s = pd.DataFrame({"arm": ["none", "none", "tis", "fp32", "fp32"], "seed": [0, 1, 0, 0, 1],
                      "destabilised_at": [None, 30, 20, None, None]})
    assert pick_pair(s) == (("none", 1), ("fp32", 1))
    assert pick_pair(s.assign(destabilised_at=None)) == (None, ("fp32", 0))     # nothing failed: the control
    assert pick_pair(s[s["arm"] != "fp32"].assign(destabilised_at=None)) == (None, ("none", 0))


def test_fisher_exact_holm_and_the_bootstrap_by_hand():
    """Fisher's two-sided exact p of known tables (R's fisher.test gives 0.0198 for 7/10 vs 1/10 and 1 for equal
    counts), Holm's step-down adjustment, and a bootstrap interval that holds the statistic."""
    from triage_monitor.demo.study import bootstrap_ci, fisher_exact, holm
    assert fisher_exact(7, 3, 1, 9) == pytest.approx(2 * (1200 + 45) / 125970)      # tables 7,8 and 1,0 of C(20,8)
    assert fisher_exact(3, 2, 3, 2) == pytest.approx(1.0)
    assert fisher_exact(0, 5, 5, 0) == pytest.approx(2 / 252)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    stat, lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0], np.mean)
    assert stat == 2.5 and 1.0 <= lo <= 2.5 <= hi <= 4.0


def test_the_paper_study_arms_half_lr_and_nvfp4():
    from triage_monitor.demo.study import DEFAULT_SEEDS, arm_config, arm_label
    base = DemoConfig()
    assert arm_config("none-half-lr", base).lr == base.lr / 2 and arm_config("none-half-lr", base).correction == "none"
    nv = arm_config("nvfp4", base, seed=4)
    assert (nv.sampler_recipe, nv.sampler_lag, nv.correction, nv.seed) == ("nvfp4", 0, "none", 4)
    assert "lr 0.0005" in arm_label("none-half-lr", base) and len(DEFAULT_SEEDS) >= 10
