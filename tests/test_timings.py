"""Phase timings and the full-cycle arithmetic (docs/metrics.md#step-time-and-the-full-cycle), on values worked out by
hand: the generation share, the projected speedup, a run's breakdown, two runs compared, and the steps table's
``time/<phase>`` columns written by ``log_step``."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor.metrics import timings as tm
from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig, step_columns


def test_the_issue_example_by_hand():
    """Generation 6.0 s of a 10.5 s step: g = 6 / 10.5 = 0.5714; at k = 2.3, 1 / (0.42857 + 0.24845) = 1.4771."""
    g = tm.generation_share(6.0, 10.5)
    assert g == pytest.approx(0.571428571, abs=1e-9)
    assert tm.projected_speedup(g, 2.3) == pytest.approx(1.477064, abs=1e-6)
    assert round(tm.projected_speedup(g), 2) == 1.48                      # the default k is the published 2.3
    assert tm.projected_speedup(g, 1e12) == pytest.approx(1 / (1 - g), rel=1e-9)   # infinitely fast: 2.33×
    assert tm.projected_speedup(0.0, 5) == 1.0 and tm.projected_speedup(1.0, 4) == pytest.approx(4.0)
    assert math.isnan(tm.generation_share(math.nan, 10.0)) and math.isnan(tm.generation_share(1.0, 0.0))
    for bad in (0, -1, math.inf, math.nan, "x"):
        with pytest.raises(ValueError, match="speedup"):
            tm.projected_speedup(0.5, bad)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tm.projected_speedup(1.2, 2.3)


def hand_run(gen, step, update=None, sync=None, n=4) -> pd.DataFrame:
    rows = []
    for s in range(n):
        r = {"step": s, "time/generation": gen, "time/step": step}
        if update is not None:
            r["time/update"] = update
        if sync is not None:
            r["time/weight_sync"] = sync
        rows.append(r)
    return pd.DataFrame(rows)


def test_a_runs_breakdown_by_hand():
    """Steps of 10.5 s: generation 6.0, update 3.0, weight sync 0.5, 1.0 s untimed.  g = 0.5714 on every step and
    pooled; the phases that do not speed up are named with their shares: update 3/10.5 = 28.6 %, untimed 9.5 %,
    weight sync 4.8 %."""
    f = tm.cycle_frame(hand_run(6.0, 10.5, 3.0, 0.5))
    assert f["g"].tolist() == pytest.approx([6 / 10.5] * 4)
    assert f["projected"].tolist() == pytest.approx([1.477064] * 4, abs=1e-6)
    assert f["untimed"].tolist() == pytest.approx([1.0] * 4)
    assert set(f["total_from"]) == {"step timer"}
    s = tm.cycle_summary(hand_run(6.0, 10.5, 3.0, 0.5), k=2.3)
    assert (s.steps, s.generation_steps) == (4, 4)
    assert s.g == pytest.approx(6 / 10.5) and s.projected == pytest.approx(1.477064, abs=1e-6)
    assert s.mean == pytest.approx({"generation": 6.0, "update": 3.0, "weight_sync": 0.5, "step": 10.5,
                                    "untimed": 1.0})
    assert [p for p, _ in s.not_sped_up] == ["update", "untimed", "weight_sync"]
    assert [v for _, v in s.not_sped_up] == pytest.approx([3 / 10.5, 1 / 10.5, 0.5 / 10.5])
    text = "\n".join(s.lines("cpu"))
    assert "g = 0.571" in text and "1.48×" in text and "CPU figures" in text
    assert "update 28.6 %" in text and "weight sync 4.8 %" in text


def test_pooled_share_and_a_step_total_from_the_phases():
    """Step 0: 6 s of 10.5 s (step timer); step 1: no step timer, phases 2 + 2 → total 4, g = 0.5.  Pooled
    g = (6 + 2) / (10.5 + 4) = 0.5517, the per-step median (0.5714 + 0.5) / 2 = 0.5357."""
    df = pd.DataFrame({"step": [0, 1], "time/generation": [6.0, 2.0], "time/update": [3.0, 2.0],
                       "time/step": [10.5, math.nan]})
    f = tm.cycle_frame(df)
    assert f["total"].tolist() == [10.5, 4.0] and f["total_from"].tolist() == ["step timer", "sum of phases"]
    assert f["untimed"].tolist() == [1.5, 0.0]
    s = tm.cycle_summary(df)
    assert s.g == pytest.approx(8 / 14.5) and s.g_median == pytest.approx((6 / 10.5 + 0.5) / 2)
    assert s.total_from == "mixed"


def test_overlapping_timers_are_counted_and_steps_without_timings_left_out():
    """An asynchronous step: generation 8 s beside an update of 6 s in a 10 s step (sum 14 > 10): counted as
    overlapping; a step with no timer at all is not a timed step."""
    df = pd.DataFrame({"step": [0, 1, 2], "time/generation": [8.0, 4.0, math.nan],
                       "time/update": [6.0, 4.0, math.nan], "time/step": [10.0, 10.0, math.nan]})
    s = tm.cycle_summary(df)
    assert s.steps == 2 and s.overlapping_steps == 1
    assert "overlap" in " ".join(s.lines())
    empty = tm.cycle_summary(pd.DataFrame({"step": [0, 1], "n_tokens": [3.0, 4.0]}))
    assert empty.steps == 0 and math.isnan(empty.g) and "nothing to break down" in empty.lines()[0]


def test_two_runs_with_known_per_phase_ratios():
    """A BF16 baseline: generation 6.0, update 3.0, weight sync 0.5, step 10.5 (1.0 untimed).  The NVFP4 run:
    generation 2.5 (2.4× faster), update 3.0 (1×), weight sync 0.5, a new quantisation phase 0.6 s, step 7.6.
    Measured: generation 2.4×, update 1.00×, whole cycle 10.5 / 7.6 = 1.3816×; projected from g = 0.5714 and the
    measured 2.4×: 1 / (0.42857 + 0.5714 / 2.4) = 1.5000×, at k = 2.3: 1.4771× — the measured cycle is 0.92× the
    projection: the new quantisation phase ate part of the gain."""
    base = hand_run(6.0, 10.5, 3.0, 0.5)
    other = hand_run(2.5, 7.6, 3.0, 0.5)
    other["time/quantize"] = 0.6
    base["delta_abs_mean"], other["delta_abs_mean"] = 1e-7, 0.4
    base["window/rho_asym"], other["window/rho_asym"] = [1.0, 1.1, 1.2, 1.0], [1.2, 1.5, 1.9, 1.7]
    c = tm.compare_cycles(base, other, k=2.3)
    t = c.table.set_index("phase")
    assert t.loc["generation", "speedup"] == pytest.approx(2.4)
    assert t.loc["update", "speedup"] == pytest.approx(1.0) and t.loc["weight_sync", "speedup"] == pytest.approx(1.0)
    assert math.isnan(t.loc["quantize", "speedup"]) and t.loc["quantize", "other_s"] == pytest.approx(0.6)
    assert t.loc["quantize", "base_s"] != t.loc["quantize", "base_s"]            # the baseline has no such phase
    assert t.loc["step", "speedup"] == pytest.approx(10.5 / 7.6)
    assert bool(t.loc["generation", "sped_up_by_generator"]) and not bool(t.loc["update", "sped_up_by_generator"])
    assert c.cycle == pytest.approx(1.381579, abs=1e-6) and c.generation == pytest.approx(2.4)
    assert c.g_base == pytest.approx(6 / 10.5)
    assert c.projected_measured == pytest.approx(1.5, abs=1e-9)
    assert c.projected_k == pytest.approx(1.477064, abs=1e-6)
    m = c.mismatch.set_index("figure")
    assert m.loc["mean |δ| (nats)", "base"] == pytest.approx(1e-7) and m.loc["mean |δ| (nats)", "other"] == 0.4
    assert m.loc["window ρ_asym, last", "other"] == 1.7 and m.loc["window ρ_asym, max", "other"] == 1.9
    assert math.isnan(m.loc["k3 KL (nats)", "base"])                            # not in these tables
    text = "\n".join(c.lines(["bf16", "nvfp4"]))
    assert "1.38×" in text and "2.40×" in text and "1.50×" in text and "0.92× the projection" in text


def test_framework_names_map_onto_the_phases():
    raw = {"gen": 6.0, "reward": 0.25, "adv": 0.25, "old_log_prob": 1.0, "ref": 0.5, "update_actor": 2.0,
           "update_weights": 0.5, "step": 10.5, "testing": 30.0}
    assert tm.phase_times(raw, "verl") == {"generation": 6.0, "reward": 0.5, "logprob": 1.0, "reference": 0.5,
                                           "update": 2.0, "weight_sync": 0.5, "step": 10.5}
    logged = {f"timing_s/{k}": v for k, v in raw.items()}
    assert tm.phase_times(logged) == tm.phase_times(raw, "verl")               # logged names need no framework
    assert tm.phase_of("gen") is None                                          # a bare verl key only with "verl"
    assert tm.phase_times({"timing/generation": 4.0, "timing/make_experience": 1.0, "timing/ppo_train": 2.0,
                           "timing/broadcast": 0.3, "timing/step_total": 7.3}, "openrlhf") == {
        "generation": 4.0, "logprob": 1.0, "update": 2.0, "weight_sync": 0.3, "step": 7.3}
    assert tm.phase_of("profiling/Time taken: TriageGRPOTrainer.vLLM.generate", "trl") == "generation"
    assert tm.phase_of("time/wait_for_batch") == "generation" and tm.phase_of("time/step") == "step"
    assert tm.phase_of("timing/train/recompute_kv_scales") == "quantize"
    assert tm.phase_of("perf/train_wait_time") is None and tm.is_timer_name("perf/train_wait_time")
    skipped = []
    assert tm.phase_times({"timing/policy_train": 3.0, "loss": 0.1}, "skyrl", unmapped=skipped) == {}
    assert skipped == ["timing/policy_train", "loss"]
    with pytest.raises(ValueError, match="not a phase or a known timer"):
        tm.phase_times({"loss": 0.1}, strict=True)
    for bad in (-1.0, math.inf, "fast", True):
        with pytest.raises(ValueError, match="generation"):
            tm.phase_times({"generation": bad})
    assert tm.phase_times({"generation": torch.tensor(2.0), "update": math.nan}) == {"generation": 2.0}


def test_no_timer_name_stands_for_two_phases():
    """Across every framework's table a name means one phase (an extra key is recognised without its framework)."""
    seen: dict = {}
    for fw, table in tm.FRAMEWORK_TIMERS.items():
        assert set(table.values()) <= {*tm.PHASES, "step", None}, fw
        for name, phase in table.items():
            assert seen.setdefault(name, phase) == phase, name
    for name in ("generation", "step", "reward", "update"):
        assert name not in seen                       # our bare names are never a framework's


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 8, generator=g) - 0.01
    return TokenBatch.from_padded(lp, lp - 0.2 * torch.rand(4, 8, generator=g),
                                  torch.randn(4, 1, generator=g).expand(4, 8), torch.ones(4, 8, dtype=torch.bool))


def test_log_step_timings_land_in_the_steps_table(tmp_path):
    """timings= (our names or a framework's), extra keys time/<phase> and framework timer names: the time/ columns
    of the steps table, NaN where a phase was not timed; a user's "reward" extra stays the reward."""
    with MismatchMonitor(tmp_path / "run", MonitorConfig(), alerts=False) as mon:
        m0 = mon.log_step(0, batch(), extra={"reward": 0.7}, timings={"generation": 6.0, "step": 10.5,
                                                                      "timing_s/update_actor": 2.0})
        mon.log_step(1, batch(1), extra={"reward": 0.5, "time/update": 1.5, "timing/generation": 4.0})
        mon.log_step(2, batch(2), extra={"reward": 0.6, "timing_s/gen": 9.0}, timings={"generation": 3.0})
        mon.log_step(3, batch(3), extra={"reward": 0.4})
    assert m0["time/generation"] == 6.0 and math.isnan(m0["time/logprob"])
    steps = open_run(tmp_path / "run").steps()
    assert steps["time/generation"].tolist()[:3] == [6.0, 4.0, 3.0]          # timings= wins over the extra key
    assert steps["time/step"].tolist()[0] == 10.5 and steps["time/update"].tolist()[:2] == [2.0, 1.5]
    assert steps[[c for c in tm.TIME_COLUMNS]].iloc[3].isna().all()
    assert steps["reward"].tolist() == [0.7, 0.5, 0.6, 0.4]                   # "reward" is the user's, not a phase
    assert steps["timing/generation"].tolist()[1] == 4.0                       # a framework key stays an extra too
    assert "time/update" not in [c for c in steps.columns if c.startswith("time/") and c not in tm.TIME_COLUMNS]
    summary = tm.cycle_summary(steps)
    assert summary.steps == 3 and summary.generation_steps == 3


def test_the_time_columns_are_declared_in_order():
    cols = step_columns(["reward"])
    i = cols.index("time/generation")
    assert cols[i:i + len(tm.TIME_COLUMNS)] == tm.TIME_COLUMNS
    assert cols[i - 1] == "window/tau_tail" and cols[i + len(tm.TIME_COLUMNS)] == "reward"


def test_bad_timings_raise_and_record_nothing(tmp_path):
    with MismatchMonitor(tmp_path / "run", MonitorConfig(), alerts=False) as mon:
        with pytest.raises(ValueError, match=r"timings\['gpu_time'\]"):
            mon.log_step(0, batch(), timings={"gpu_time": 1.0})
        with pytest.raises(ValueError, match=r"timings\['generation'\] = -2.0"):
            mon.log_step(0, batch(), timings={"generation": -2.0})
        with pytest.raises(ValueError, match=r"time/update"):
            mon.log_step(0, batch(), extra={"time/update": math.inf})
        assert mon.steps_logged == 0
        mon.log_step(0, batch(), timings={"generation": np.float64(1.0)})
    assert open_run(tmp_path / "run").steps()["time/generation"].tolist() == [1.0]


def _monitored_run(path, steps, roll_steps=50):
    """A run whose rows carry no phase timings (as a framework worker writes them): rank 0, ``steps`` steps."""
    with MismatchMonitor(path, MonitorConfig(roll_steps=roll_steps), alerts=False) as mon:
        for s in steps:
            mon.log_step(s, batch(s))


def test_a_drivers_timers_fill_the_rows_written_before_them(tmp_path, caplog):
    """The OpenRLHF driver's status timers of steps 0-2, recorded after the rows (explicit step, then the run's
    newest step): steps() gets them in the time/ columns, the generation share and projection worked out by hand
    (6.0 of 10.5 s: g = 0.571, 1.48x at k 2.3); a phase the row timed itself is kept; other status keys are
    skipped; no new step is said once and nothing is written."""
    import logging

    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    with MismatchMonitor(run, MonitorConfig(), alerts=False) as mon:
        mon.log_step(0, batch(0), timings={"update": 9.9})          # the row's own reading stays
        mon.log_step(1, batch(1))
    status = {"timing/generation": 6.0, "timing/make_experience": 1.5, "timing/ppo_train": 2.5,
              "timing/broadcast": 0.5, "timing/step_total": 10.5, "policy_loss": 0.3, "triage/metrics_step": 0.0,
              "reward": 0.8, "step": 7}                          # a status's reward and step are no durations
    with TimingsWriter(run, framework="openrlhf") as tw:
        assert tw.record(status, step=0, framework_step=1) == 0
        assert tw.record({**status, "timing/generation": 4.0}, framework_step=2) == 1   # the run's newest step
        with caplog.at_level(logging.WARNING, logger="triage_monitor"):
            assert tw.record(status, framework_step=3) is None       # no step newer than 1 in the run
            assert tw.record(status, framework_step=4) is None
        assert tw.record({"policy_loss": 1.0}, step=1) is None        # no timer: nothing
    assert sum("no monitored step newer" in r.getMessage() for r in caplog.records) == 1
    steps = open_run(run).steps().set_index("step")
    assert steps["time/generation"].tolist() == [6.0, 4.0] and steps["time/step"].tolist() == [10.5, 10.5]
    assert steps["time/update"].tolist() == [9.9, 2.5] and steps["time/logprob"].tolist() == [1.5, 1.5]
    assert steps["time/weight_sync"].tolist() == [0.5, 0.5] and math.isnan(steps.loc[0, "time/reference"])
    assert steps["time/reward"].isna().all() and steps["time/step"].tolist() != [7.0, 7.0]
    frame = tm.cycle_frame(steps.reset_index())
    assert frame["g"].round(3).tolist()[0] == 0.571 and round(tm.projected_speedup(6.0 / 10.5, 2.3), 2) == 1.48
    late = open_run(run).timings()
    assert late["framework"].tolist() == ["openrlhf"] * 2 and late["framework_step"].tolist() == [1, 2]
    assert late.dtypes["step"] == "int64" and late.dtypes["rank"] == "int64" and late.dtypes["attempt"] == "int64"
    plain = pd.read_parquet(run / "timings")                         # a plain reader: the sealed block
    assert plain["step"].tolist() == [0, 1] and plain["time/generation"].tolist() == [6.0, 4.0]


def test_the_timings_table_rolls_keeps_a_killed_drivers_steps_and_takes_the_newest_row(tmp_path):
    """120 steps timed by a driver with roll_steps 50: 3 sealed blocks, no pending file; a driver killed before
    close leaves its steps in pending files, which steps() reads; a later driver's reading of a phase wins, the
    phases it did not time keep the earlier row's."""
    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    _monitored_run(run, range(120))
    tw = TimingsWriter(run, framework="skyrl")
    for s in range(120):
        tw.record({"timing/generate": 1.0 + s, "timing/step": 2.0 + s}, step=s)
    tw.close()
    names = sorted(p.name for p in (run / "timings").iterdir())
    assert len(names) == 3 and not [n for n in names if n.startswith(".")]
    killed = TimingsWriter(run, framework="skyrl")               # never closed: as if killed
    killed.record({"timing/generate": 0.5}, step=7)
    killed.record({"timing/sync_weights": 0.25}, step=8)
    assert len([p for p in (run / "timings").iterdir() if p.name.startswith(".pending-")]) == 2
    steps = open_run(run).steps().set_index("step")
    assert steps.loc[7, "time/generation"] == 0.5 and steps.loc[7, "time/step"] == 9.0     # newest per phase
    assert steps.loc[8, "time/weight_sync"] == 0.25 and steps.loc[9, "time/generation"] == 10.0
    assert steps["time/generation"].notna().all() and len(steps) == 120
    killed._closed = True                                        # keep its pending files past this test


def test_a_bad_reading_or_an_unwritable_run_never_raises(tmp_path, caplog):
    """A negative or non-numeric reading, or a run directory the driver cannot write: None and one warning, never
    an exception into the driver; an unsupported scheme is an error at construction, naming it."""
    import logging

    from triage_monitor.errors import UnsupportedLocationError
    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    _monitored_run(run, range(2))
    tw = TimingsWriter(run, framework="nemo_rl")
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        assert tw.record({"timing/train/generation": -1.0}, step=0) is None
        assert tw.record({"timing/train/generation": "fast"}, step=0) is None
        (run / "timings").write_text("not a directory")
        assert tw.record({"timing/train/generation": 1.0}, step=1) is None
    said = [r.getMessage() for r in caplog.records]
    assert any("-1.0" in m for m in said) and any("not written to" in m for m in said)
    tw.close()
    with pytest.raises(UnsupportedLocationError, match="gs://"):
        TimingsWriter("gs://bucket/run")


def test_a_monitors_late_timings_go_to_the_timings_table(tmp_path):
    """MismatchMonitor.add_timings after the step's row: the timings table, filled into the row where NaN;
    a name that is no timer raises, naming it."""
    run = tmp_path / "run"
    with MismatchMonitor(run, MonitorConfig(), alerts=False) as mon:
        mon.log_step(3, batch(3), timings={"generation": 2.0})
        mon.add_timings(3, {"perf/update_weights_time": 0.75, "perf/rollout_time": 5.0},
                        framework="slime", framework_step=12)
        with pytest.raises(ValueError, match="gpu_time"):
            mon.add_timings(3, {"gpu_time": 1.0})
    row = open_run(run).steps().iloc[0]
    assert (row["time/generation"], row["time/weight_sync"]) == (2.0, 0.75)
    assert open_run(run).timings()["framework_step"].tolist() == [12]


def test_a_reward_that_comes_after_the_row_fills_the_reward_column_and_a_row_keeps_its_own(tmp_path):
    """A framework's reward recorded after its step's row (a driver's TimingsWriter, MismatchMonitor.add_timings):
    steps() fills the reward column where the row has none and keeps a row's own; a NaN reading (every sample
    aborted) is no reading; a timings table without a reward adds no reward column."""
    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    with MismatchMonitor(run, MonitorConfig(), alerts=False) as mon:
        mon.log_step(0, batch(0), extra={"reward": 0.9})             # the row's own reward stays
        mon.log_step(1, batch(1), extra={"reward": float("nan")})
        mon.log_step(2, batch(2), extra={"reward": float("nan")})
        mon.add_timings(2, {}, reward=0.25)                          # the monitor's process, after the row
        with pytest.raises(ValueError, match="reward"):
            mon.add_timings(2, {}, reward=float("inf"))
    with TimingsWriter(run, framework="openrlhf") as tw:
        assert tw.record({"timing/generation": 1.0}, step=0, reward=0.1) == 0
        assert tw.record({"policy_loss": 1.0}, step=1, reward=0.5) == 1        # a reward alone is a reading
        assert tw.record({"policy_loss": 1.0}, step=2, reward=float("nan")) is None
    assert open_run(run).steps()["reward"].tolist() == [0.9, 0.5, 0.25]
    other = tmp_path / "timed"
    with MismatchMonitor(other, MonitorConfig(), alerts=False) as mon:
        mon.log_step(0, batch(0))
        mon.add_timings(0, {"generation": 1.0})
    steps = open_run(other).steps()
    assert steps["time/generation"].tolist() == [1.0] and "reward" not in steps.columns


def test_a_resumed_job_takes_its_own_timings_and_the_newest_step_of_its_own_attempt(tmp_path):
    """Attempt 1 times steps 0-9 (step=None: the newest step on disk); attempt 2 resumes from step 5 with a new
    driver: its readings land on its own steps 5-7 (not on attempt 1's step 9), a step it re-logged without timers
    is untimed (not attempt 1's reading), and steps it did not redo keep attempt 1's."""
    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    with MismatchMonitor(run, MonitorConfig(), alerts=False) as mon:
        tw = TimingsWriter(run, "nemo_rl")
        for s in range(10):
            mon.log_step(s, batch(s))
            mon.flush()                                             # as a Ray worker does at its optimizer step
            assert tw.record({"timing/train/total_step_time": 100.0 + s}) == s
        tw.close()
    with MismatchMonitor(run, MonitorConfig(), alerts=False, resume=True) as mon:
        tw = TimingsWriter(run, "nemo_rl")
        for s in (5, 6, 7):
            mon.log_step(s, batch(s))
            mon.flush()
            assert tw.record({"timing/train/total_step_time": 200.0 + s}) == s
        mon.log_step(8, batch(8))
        tw.close()
    got = open_run(run).steps().set_index("step")["time/step"]
    assert got.loc[[4, 5, 6, 7, 9]].tolist() == [104.0, 205.0, 206.0, 207.0, 109.0] and math.isnan(got.loc[8])


def test_each_rank_keeps_its_own_late_timings_and_takes_rank_0s_for_the_rest(tmp_path):
    """Two ranks writing rows (not synchronised): rank 0's and rank 1's add_timings differ; each row shows its own
    rank's reading, and a phase only rank 0 timed (the job's) fills rank 1's row too."""
    run = tmp_path / "run"
    mons = [MismatchMonitor(run, MonitorConfig(), alerts=False, rank=r, attempt=11) for r in (0, 1)]
    for s in range(3):
        for r, mon in enumerate(mons):
            mon.log_step(s, batch(10 * r + s))
        mons[0].add_timings(s, {"update": 1.0, "weight_sync": 0.5})
        mons[1].add_timings(s, {"update": 9.0})
    for mon in mons:
        mon.close()
    rows = open_run(run).steps(rank=None)
    assert rows.loc[rows["rank"] == 0, "time/update"].tolist() == [1.0] * 3
    assert rows.loc[rows["rank"] == 1, "time/update"].tolist() == [9.0] * 3
    assert (rows["time/weight_sync"] == 0.5).all()
    assert open_run(run).timings()[["step", "rank"]].values.tolist() == [[s, r] for s in range(3) for r in (0, 1)]


def test_the_driver_writer_never_raises_and_reads_only_the_frameworks_timer_names(tmp_path, caplog):
    """Not a dict, a reading that is no number (huge, a tensor of two values, a bool), a step that is no integer:
    None and a warning, never an exception; verl's bare metric keys (step, reward, values) are not its timers;
    an unknown framework or an empty run_dir is an error at construction; framework_step survives a later row
    that does not give it."""
    from triage_monitor.rundir.timings_writer import TimingsWriter

    run = tmp_path / "run"
    _monitored_run(run, range(3))
    tw = TimingsWriter(run, "openrlhf")
    for bad in (None, [1.0], {"timing/generation": 10 ** 400}, {"timing/generation": torch.tensor([1.0, 2.0])},
                {"timing/generation": True}):
        assert tw.record(bad, step=1) is None
    for step in (True, 2.7, "2"):
        assert tw.record({"timing/generation": 1.0}, step=step) is None
    assert tw.record({"timing/generation": 1.0}, step=np.int64(1), framework_step=7) == 1
    assert tw.record({"timing/broadcast": 0.5}, step=1) == 1
    tw.close()
    tv = TimingsWriter(run, "verl")
    assert tv.record({"timing_s/gen": 5.0, "timing_s/step": 9.0, "step": 2, "reward": 0.7, "values": 1.5}, step=2) == 2
    tv.close()
    late = open_run(run).timings().set_index("step")
    assert late.loc[1, "framework_step"] == 7 and late.loc[1, "time/weight_sync"] == 0.5
    assert late.loc[2, "time/step"] == 9.0 and math.isnan(late.loc[2, "time/reward"]) and math.isnan(late.loc[2, "time/other"])
    for kw, match in ((dict(run_dir=run, framework="OpenRLHF"), "'OpenRLHF' is not one of"),
                      (dict(run_dir=""), "run_dir")):
        with pytest.raises(ValueError, match=match):
            TimingsWriter(**kw)
    with MismatchMonitor(tmp_path / "other", MonitorConfig(), alerts=False) as mon:
        mon.log_step(0, batch())
        with pytest.raises(TypeError, match="dict"):
            mon.add_timings(0, None)
        with pytest.raises(ValueError, match="step = 0.5"):
            mon.add_timings(0.5, {"generation": 1.0})
