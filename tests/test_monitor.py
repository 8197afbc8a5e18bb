"""MismatchMonitor → Parquet run directory → offline recomputation equals the live values."""

import json
import math
import re

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor.offline.analysis import RunDirError, compare_live, open_run, recompute
from triage_monitor.batch import TokenBatch
from triage_monitor.cli import main as cli_main
from triage_monitor.metrics.stats import METRIC_NAMES
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.metrics.sketch import quantile_error_bound

from reference_metrics import reference_metrics, responses_from_tokens


def _batch(step, B=8, T=96, on_invalid="raise", poison=False):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 4
    lp = (s + torch.randn(B, T, generator=g) * .1 - (torch.rand(B, T, generator=g) < .04) * 3).clamp(max=0)
    m = torch.rand(B, T, generator=g) < .9
    if poison:
        lp[0, 0], m[0, 0] = float("nan"), True
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), m, sample_ids=torch.arange(B) + 100 * step,
                                  group_ids=torch.arange(B) // 4, on_invalid=on_invalid)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    cfg = MonitorConfig(window=4, calibration_steps=3)
    with MismatchMonitor(d, cfg, manifest={"framework": "unit-test"}) as mon:
        live = [mon.log_step(step, _batch(step, on_invalid="quarantine", poison=step == 2),
                             extra={"reward": step / 10}) for step in range(7)]
    return d, live


def test_live_metrics_equal_an_independent_computation_from_the_records(run_dir):
    """Independent check of the live path (and so of every path that agrees with it): the step and window
    metrics of docs/metrics.md recomputed from the token records by tests/reference_metrics.py (plain loops, no
    product code) with the step's τ_tail and the run's W = 64; windows pool the 4 steps' tokens."""
    d, live = run_dir
    run = open_run(d)
    per_step = {s: responses_from_tokens(run.tokens(s)) for s in range(7)}
    names = ("small_gap_share", "delta_mean", "delta_abs_mean", "k3_kl", "rho_asym", "mass_amp_neg",
             "mass_con_pos", "r_amp", "h_seg", "c_tok", "p_adj", "dilution")
    for s, m in enumerate(live):
        ref = reference_metrics(per_step[s], m["tau_tail"])
        win = reference_metrics([r for t in range(max(0, s - 3), s + 1) for r in per_step[t]], m["tau_tail"])
        assert ref["n_tokens"] == m["n_tokens"]
        for k in names:
            if not (math.isnan(ref[k]) and math.isnan(m[k])):
                assert m[k] == pytest.approx(ref[k], rel=1e-9), (s, k)
            if s >= 6 and not (math.isnan(win[k]) and math.isnan(m[f"window/{k}"])):   # window of frozen-τ steps only
                assert m[f"window/{k}"] == pytest.approx(win[k], rel=1e-9), (s, k)


def test_recompute_equals_live_exactly(run_dir):
    """Agreement test: live monitor vs offline recomputation, both use ``MismatchStats`` (same code path);
    the independent check is test_live_metrics_equal_an_independent_computation_from_the_records."""
    d, live = run_dir
    run = open_run(d)
    rec = recompute(run)
    cmp = compare_live(run, rec, rtol=0.0)
    assert len(cmp) > 50 and cmp["equal"].all(), cmp[~cmp["equal"]]
    assert rec["rho_asym"].tolist() == pytest.approx([m["rho_asym"] for m in live], rel=0, abs=0)
    # the post-mortem uses one tau_tail for every step; the live steps 0-2 used provisional values, so
    # their localisation metrics (and the windows holding them) are left out of the comparison, not hidden
    assert [m["tau_tail_frozen"] for m in live] == [0, 0, 0, 1, 1, 1, 1]
    assert rec["tau_tail"].nunique() == 1 and rec["tau_tail"].iloc[0] == live[3]["tau_tail"]
    loc = cmp.set_index("metric")
    assert loc.at["c_tok", "provisional"] == 3 and loc.at["window/c_tok", "provisional"] == 6
    assert loc.at["rho_asym", "provisional"] == 0 and loc.at["rho_asym", "compared"] == 7


def test_recompute_in_live_tau_mode_reproduces_every_live_value(run_dir):
    """Agreement test: live vs recompute(tau_mode="live"), both use ``MismatchStats``; independent check:
    test_live_metrics_equal_an_independent_computation_from_the_records."""
    d, live = run_dir
    run = open_run(d)
    rec = recompute(run, tau_mode="live")
    cmp = compare_live(run, rec, rtol=0.0)
    assert cmp["equal"].all() and (cmp["provisional"] == 0).all(), cmp[~cmp["equal"]]
    assert rec["tau_tail"].tolist() == [m["tau_tail"] for m in live]
    assert len(set(rec["tau_tail"][:3])) == 3             # three different provisional values, replayed


def test_run_directory_readable_with_plain_pyarrow_and_pandas(run_dir):
    d, live = run_dir
    tokens = pd.read_parquet(d / "tokens")
    assert set(tokens.columns) >= {"step", "rank", "sample_id", "group_id", "position", "learner_logp",
                                   "sampler_logp", "advantage", "attempt"}
    assert len(tokens) == sum(m["n_tokens"] for m in live)
    steps = ds.dataset(d / "steps", partitioning="hive").to_table().to_pandas()
    assert sorted(steps["step"].tolist()) == list(range(7))
    assert steps.sort_values("step")["reward"].tolist() == pytest.approx([s / 10 for s in range(7)])
    manifest = json.loads((d / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["info"]["framework"] == "unit-test"
    assert manifest["monitor_config"]["metrics"]["segment_width"] == 64 and manifest["monitor_config"]["window"] == 4
    assert "segment_width" not in manifest and "tau_tail_calibrated" not in manifest     # one home per setting
    from triage_monitor.offline.analysis import open_run
    assert open_run(d).config.window == 4 and open_run(d).config.metrics.segment_width == 64
    # quarantined NaN token: counted in the metrics and visible in the records
    assert live[2]["nonfinite_count"] == 1 and live[2]["quarantined_count"] == 1
    q = pq.read_table(next((d / "quarantine").rglob("*.parquet"))).to_pandas()
    assert q["reason"].tolist() == ["nonfinite_learner_logp"] and math.isnan(q["learner_logp"][0])
    # NaN metrics carry their reason: every NaN metric of docs/metrics.md in a step row, and only those, has one
    names = {*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)}
    for _, row in open_run(d).steps().iterrows():
        reasons = json.loads(row["nan_reasons"])
        nan_cols = {k for k, x in row.items() if k in names and math.isnan(x)}
        assert set(reasons) == nan_cols, (row["step"], reasons, nan_cols)


def test_nan_metrics_carry_their_reasons(tmp_path):
    """One A<0 response, δ ∈ {−0.1, 0.2} (4 tokens, one segment), τ_tail = −0.5 given, window 1: no A>0 token →
    ρ_asym (both forms) NaN; no δ < τ → no tail token → C_tok NaN, no tail-heavy segment → dilution NaN; one
    segment → no predecessor → p_adj NaN.  r_amp and h_seg are 0, not NaN.  The reasons are in the live metrics
    and in the step row, for the step and for its window."""
    want = {
        "rho_asym": "mass_amp_pos = 0: no token with A > 0 and delta > 0",
        "rho_asym_lennorm": "length-normalised mass_amp_pos = 0: no token with A > 0 and delta > 0",
        "c_tok": "no amplifying-tail token",
        "p_adj": "no segment with a predecessor",
        "dilution": "no A<0 response holds a tail-heavy segment",
    }
    want = {**want, **{f"window/{k}": r for k, r in want.items()}}
    batch = TokenBatch.from_list([torch.tensor([-1.1, -0.8, -2.1, -1.8])], [torch.tensor([-1.0, -1.0, -2.0, -2.0])],
                                 torch.tensor([-1.0]))
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=1, tau_tail=-0.5)) as mon:
        live = mon.log_step(0, batch)
    names = {*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)}
    assert {k for k, x in live.items() if k in names and math.isnan(x)} == set(want)
    assert live["r_amp"] == 0.0 and live["h_seg"] == 0.0
    row = open_run(tmp_path / "r").steps().iloc[0]
    assert json.loads(row["nan_reasons"]) == want


def test_no_temporary_files_left_and_hidden_files_skipped(run_dir):
    d, _ = run_dir
    assert not list(d.rglob(".tmp-*"))
    (d / "tokens" / ".tmp-partial.parquet").write_bytes(b"garbage")
    assert len(recompute(open_run(d))) == 7


def test_resumed_run_keeps_latest_attempt(tmp_path):
    d = tmp_path / "run"
    with MismatchMonitor(d) as mon:
        for step in range(3):
            mon.log_step(step, _batch(step))
    with MismatchMonitor(d) as mon:                     # restart from the step-1 checkpoint
        again = mon.log_step(1, _batch(11))
    run = open_run(d)
    assert len(run.manifest.attempts) == 2
    assert run.steps().set_index("step").loc[1, "n_tokens"] == again["n_tokens"]
    assert len(run.tokens(1)) == again["n_tokens"]


def test_steps_without_valid_tokens_do_not_count_as_calibration_steps(tmp_path):
    # steps 0 and 1 carry no valid token (all masked): they write no token file, so offline
    # recomputation never sees them; tau_tail must come from the first 2 steps with tokens (2 and 3),
    # not freeze at NaN after steps 0 and 1
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=3, calibration_steps=2)) as mon:
        for step in range(2):
            b = _batch(step)
            mon.log_step(step, TokenBatch.from_flat(b.learner_logp[:0], b.sampler_logp[:0], b.advantage[:0],
                                                    b.sample_index[:0], b.position[:0]))
        live = [mon.log_step(step, _batch(step)) for step in range(2, 6)]
    ref = torch.cat([_batch(2).delta, _batch(3).delta]).double().numpy()
    tau = float(pd.Series(ref).quantile(0.05))
    assert abs(live[1]["tau_tail"] - tau) <= quantile_error_bound(np.sort(ref), 0.05) and live[3]["tau_tail"] == live[1]["tau_tail"]
    assert json.loads((d / "run.json").read_text())["calibration"]["tau_tail"] == live[1]["tau_tail"]
    run = open_run(d)
    cmp = compare_live(run, recompute(run), rtol=0.0)
    assert cmp["equal"].all(), cmp[~cmp["equal"]]


def test_analyze_cli(run_dir, capsys, tmp_path):
    d, _ = run_dir
    out = tmp_path / "m.csv"
    assert cli_main(["analyze", str(d), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "equal the live values" in text
    assert len(pd.read_csv(out)) == 7
    assert cli_main(["analyze", str(tmp_path / "nope")]) == 2
    (tmp_path / "afile").write_text("")
    # an output path the OS refuses: exit 3 (docs/cli.md#exit-statuses), one line with the command's prefix
    assert cli_main(["analyze", str(d), "--out", str(tmp_path / "afile" / "m.csv")]) == 3
    err = capsys.readouterr().err
    assert "triage-monitor analyze: error: cannot save the table" in err and "Traceback" not in err
    # an unknown table format is refused before anything is computed
    assert cli_main(["analyze", str(d), "--out", str(tmp_path / "m.xlsx")]) == 2
    assert "'.xlsx'" in capsys.readouterr().err and not (tmp_path / "m.xlsx").exists()


def test_analyze_cli_corrupt_token_file_is_a_message(run_dir, capsys):
    d, _ = run_dir
    from runfiles import file_of

    bad = file_of(d, "tokens", 3)
    bad.write_bytes(b"not parquet")
    assert cli_main(["analyze", str(d)]) == 2
    err = capsys.readouterr().err
    assert bad.name in err.replace("\n", "") and err.startswith("triage-monitor analyze: ")


def test_close_records_the_status_steps_and_writer_counts_in_run_json_and_may_be_repeated(tmp_path):
    """run.json after ``close()`` (no argument: "finished"): 3 steps logged; the writer wrote every token row and
    one steps row a step (counted by hand from the batches), dropped none, had no error.  A second close (a
    ``finally`` after the ``with`` block) changes nothing and raises nothing."""
    d = tmp_path / "r"
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0))
    for s in range(3):
        mon.log_step(s, _batch(s))
    mon.close()
    m = json.loads((d / "run.json").read_text())
    assert [(a["attempt"], a["world_size"]) for a in m["attempts"]] == [(mon.attempt, 1)]     # one process
    rows = sum(_batch(s).num_tokens + 1 for s in range(3))
    assert (m["status"], m["steps_logged"]) == ("finished", 3)
    assert m["writer"] == {"written_rows": rows, "dropped_rows": 0, "last_error": None}
    mon.close()
    assert json.loads((d / "run.json").read_text()) == m


def test_a_run_json_that_cannot_be_written_is_warned_once_and_the_job_goes_on(tmp_path, caplog):
    """run.json replaced by a non-empty directory: the atomic rename onto it fails (a real OSError); the monitor
    names the file and the error once, and closes without raising."""
    d = tmp_path / "r"
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0))
    (d / "run.json").unlink()
    (d / "run.json" / "x").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="triage_monitor"):
        mon.log_step(0, _batch(0))
        mon.close()
        mon.close()
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warned) == 1, warned
    assert re.fullmatch(rf"triage-monitor could not write {re.escape(str(d / 'run.json'))} \(\[Errno \d+\] .+\); "
                        r"monitoring continues", warned[0]), warned[0]


def test_a_resumed_job_keeps_the_tau_tail_its_earlier_attempt_froze_and_says_so(tmp_path, caplog):
    """Attempt 1 calibrates τ_tail on 2 steps and freezes it at step 2 (run.json's ``calibration``).  A new monitor
    on the same directory (a restarted job) starts frozen at that value, logs where it came from, and its steps
    use it: no re-calibration on post-resume steps."""
    d = tmp_path / "r"
    cfg = MonitorConfig(window=2, calibration_steps=2)
    with MismatchMonitor(d, cfg) as first:
        for s in range(3):
            first.log_step(s, _batch(s))
        tau = first.tracker.tau_tail
    assert first.tracker.tau_frozen and json.loads((d / "run.json").read_text())["calibration"]["tau_tail"] == tau
    with caplog.at_level("INFO", logger="triage_monitor"):
        with MismatchMonitor(d, cfg) as again:
            assert again.tracker.tau_frozen and again.tracker.tau_tail == tau
            out = again.log_step(3, _batch(3))
    assert (out["tau_tail"], out["tau_tail_frozen"]) == (tau, 1.0)
    assert [r.getMessage() for r in caplog.records if "resumed run" in r.getMessage()] == [
        f"triage-monitor: resumed run, tau_tail = {tau:.6g} nats from {d / 'run.json'}"]


def test_rows_dropped_by_a_full_queue_are_counted_and_warned_once(tmp_path, caplog, held_file):
    """backpressure="drop" with a 1-byte queue bound while the writer thread is busy with a held file: step 0's
    token file and steps row are dropped (its token count + 1 rows, counted from the batch); step 1 reports them
    in ``writer_dropped_rows`` and warns once, naming the metric; the job goes on."""
    import threading

    release = threading.Event()
    d = tmp_path / "r"
    with caplog.at_level("WARNING", logger="triage_monitor"):
        with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, max_queue_bytes=1,
                                              backpressure="drop")) as mon:
            mon.sink.submit("alerts", 0, 0, held_file(release))
            mon.log_step(0, _batch(0))
            outs = [mon.log_step(s, _batch(s)) for s in (1, 2)]
            release.set()
    assert outs[0]["writer_dropped_rows"] == _batch(0).num_tokens + 1
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage() and r.name == "triage_monitor"
              and r.levelname == "WARNING"]
    assert warned == [f"triage-monitor dropped {_batch(0).num_tokens + 1} record rows so far (writer queue full with "
                      "backpressure='drop'); training continues, see metric writer_dropped_rows"]
    # close() says it once more, as an ERROR line: the run lost records
    closing = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name == "triage_monitor"]
    assert len(closing) == 1 and "record row(s) of this run were not written" in closing[0]
    # the default records_dropped rule raises its alert once, as a line of the alerts logger
    alerted = [r.getMessage() for r in caplog.records if r.name == "triage_monitor.alerts"]
    assert len(alerted) == 1 and alerted[0].startswith("triage WARN (mismatch): records_dropped: writer_dropped_rows = ")


def test_log_step_after_close_warns_once_that_nothing_is_recorded(tmp_path, caplog):
    mon = MismatchMonitor(tmp_path / "r")
    mon.log_step(0, _batch(0))
    mon.close()
    with caplog.at_level("WARNING", logger="triage_monitor"):
        mon.log_step(1, _batch(1))
        last = mon.log_step(2, _batch(2))
    msgs = [r.getMessage() for r in caplog.records if "record" in r.getMessage() and r.name == "triage_monitor"]
    assert msgs == ["triage-monitor: log_step(step=1) after close(): metrics are returned but nothing is "
                    "recorded any more (rows counted in writer_dropped_rows)"]      # not "writer queue full"
    assert last["writer_dropped_rows"] == _batch(1).num_tokens + 1      # step 1's token rows + its step row
    assert open_run(tmp_path / "r").step_numbers() == [0]


def test_same_step_twice_in_one_process_warns_once(tmp_path, caplog):
    # e.g. one log_step per micro-batch: the later call replaces the earlier one's records, and says so
    d = tmp_path / "r"
    with caplog.at_level("WARNING", logger="triage_monitor"):
        with MismatchMonitor(d, MonitorConfig(window=3, tau_tail=-0.2)) as mon:
            for step in range(3):
                for micro in range(2):
                    mon.log_step(step, _batch(10 * step + micro))
    assert [r.getMessage() for r in caplog.records if "logged twice" in r.getMessage()] == [
        "triage-monitor: step 0 logged twice in a row by this process: the later call replaces the earlier one's "
        "records and window entry (log once per optimizer step, with its micro-batches merged)"]
    run = open_run(d)
    assert [len(run.tokens(s)) for s in range(3)] == [_batch(10 * s + 1).num_tokens for s in range(3)]
    cmp = compare_live(run, recompute(run), rtol=0.0)
    assert cmp["equal"].all(), cmp[~cmp["equal"]]


def test_open_run_rejects_non_run_dirs(tmp_path):
    with pytest.raises(RunDirError, match="no such directory"):
        open_run(tmp_path / "missing")
    with pytest.raises(RunDirError, match="not a triage-monitor run"):
        open_run(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match=r"file: not a directory$"):
        open_run(tmp_path / "file")
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(RunDirError, match=r"run\.json: unreadable manifest \(.*run\.json: not valid JSON"):
        open_run(tmp_path)


def test_monitor_config_takes_a_dict_of_metric_settings():
    assert MonitorConfig(metrics={"segment_width": 32}).metrics.segment_width == 32
    assert MonitorConfig.from_dict(MonitorConfig(metrics={"segment_width": 32}).to_dict()).metrics.segment_width == 32


def test_log_step_argument_errors(tmp_path):
    with MismatchMonitor(tmp_path / "r") as mon:
        with pytest.raises(TypeError, match="step must be an int"):
            mon.log_step(1.5, _batch(0))
        with pytest.raises(TypeError, match=r"^batch must be a TokenBatch, got dict$"):
            mon.log_step(0, {"learner_logp": 1})
        with pytest.raises(ValueError, match="extra\\['reward'\\]"):
            mon.log_step(0, _batch(0), extra={"reward": "high"})
        b = _batch(0)
        with pytest.raises(ValueError, match="token_extras\\['advantage'\\]: reserved"):
            mon.log_step(0, b, token_extras={"advantage": torch.ones(b.num_tokens)})
        with pytest.raises(ValueError, match="token_extras\\['w'\\] has 3 values"):
            mon.log_step(0, b, token_extras={"w": torch.ones(3)})
        assert mon.steps_logged == 0 and not mon.tracker._history      # rejected before any state changed


def test_extra_may_not_overwrite_a_computed_metric(tmp_path):
    with MismatchMonitor(tmp_path / "r") as mon:
        with pytest.raises(ValueError, match="rho_asym"):
            mon.log_step(0, _batch(0), extra={"rho_asym": 1.0})


def test_manifest_status_failed_when_the_loop_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with MismatchMonitor(tmp_path / "r") as mon:
            mon.log_step(0, _batch(0))
            raise RuntimeError("training diverged")
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "failed"


def test_manifest_status_interrupted_when_the_loop_is_stopped_by_ctrl_c(tmp_path):
    """A KeyboardInterrupt out of the ``with`` block (Ctrl-C) is not a failure of the job: run.json says
    "interrupted", and the steps logged before it are on disk."""
    with pytest.raises(KeyboardInterrupt):
        with MismatchMonitor(tmp_path / "r", MonitorConfig(tau_tail=-1.0)) as mon:
            mon.log_step(0, _batch(0))
            raise KeyboardInterrupt
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "interrupted"
    from triage_monitor.offline.analysis import open_run
    assert open_run(tmp_path / "r").step_numbers() == [0]


def test_attempt_id_is_rank_zeros_broadcast_over_the_process_group(tmp_path, monkeypatch):
    """One job start, one attempt id on every rank: `_shared_attempt_id` broadcasts rank 0's id over the group
    (a real gloo group of one process here; the multi-process case runs in tests/test_distributed.py)."""
    import time

    import torch.distributed as dist

    import triage_monitor.monitor as monitor_mod

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        before = time.time_ns()
        first = monitor_mod._shared_attempt_id()
        assert isinstance(first, int) and before <= first <= time.time_ns()
        monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: 2**62 + 5)   # beyond float64's integers
        assert monitor_mod._shared_attempt_id(dist.new_group([0])) == 2**62 + 5
        with MismatchMonitor(tmp_path / "r") as mon:      # world of one: its own id, no broadcast needed
            assert mon.attempt == 2**62 + 5 and mon.rank == 0 and mon.world_size == 1
    finally:
        dist.destroy_process_group()


def _subgroup_rank(rank, world, init_file, out):
    """One rank of the group tests: monitors, a metric tracker, a controller and a hooked worker's attempt id, each
    on this rank's one-rank group and on the default group; results saved to ``out/result.<rank>``."""
    import datetime

    import torch.distributed as dist

    from triage_monitor.triage.controller import CalibrationConfig, TriageConfig, TriageController
    from triage_monitor.hooks.worker_runtime import _worker_attempt
    from triage_monitor.metrics.stats import MetricTracker
    from triage_monitor.monitor import _shared_attempt_id

    # a collective that never completes (a broadcast from a rank outside the group) fails after a minute, not hangs
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        own = [dist.new_group([r]) for r in range(world)][rank]          # every rank creates every group
        b = _batch(rank, B=2 + rank, T=8)
        res = {}
        for name, group in (("own", own), ("world", None)):
            with MismatchMonitor(f"{out}/{name}", MonitorConfig(window=2, tau_tail=-1.0), group=group,
                                 attempt=1) as mon:
                v = mon.log_step(0, b)
                res[name] = (v["n_tokens"], v["n_samples"], v["window/n_tokens"])
                res[name + "-min"] = v["delta_min"]                      # a MIN-reduced state field
            with MismatchMonitor(f"{out}/{name}-cal", MonitorConfig(window=2, calibration_steps=3), group=group,
                                 attempt=1) as mon:                  # τ_tail calibrating from the first steps
                v = mon.log_step(0, b)
                res[name + "-tau"], res[name + "-cal"] = v["tau_tail"], (v["n_tokens"], v["n_samples"])
        for name, group in (("auto", None), ("own-auto", own)):   # rank, world size and attempt id not given
            with MismatchMonitor(f"{out}/{name}", MonitorConfig(window=2, tau_tail=-1.0), group=group) as mon:
                res[name] = (mon.rank, mon.world_size, mon.attempt)
        for name, group in (("own", own), ("world", dist.group.WORLD)):
            step, _ = MetricTracker(tau_tail=-1.0).step(0, b, group=group)     # the tracker given a group
            res[name + "-tracker"] = (step.values["n_tokens"], step.values["delta_min"])
            ctl = TriageController(TriageConfig(repair_scope="whole"), group=group)   # every repair segment counts
            res[name + "-repair"] = ctl.repair_segment_count(b).item()
        for name, group in (("own", own), ("world", dist.group.WORLD), ("alone", None)):
            # Gate thresholds calibrated on a one-step reference window (step 0), set at step 1; the Repair loss
            ctl = TriageController(TriageConfig(repair_scope="whole", calibration=CalibrationConfig(window=1)),
                                   group=group)
            ctl(b, 0)
            res[name + "-repair-loss"] = ctl(b, 1).stats["repair_loss"]
            res[name + "-thresholds"] = ctl.thresholds
        res["own-id"] = _shared_attempt_id(own)
        res["worker-attempt"] = _worker_attempt()                 # a hooked worker's id (the default group)
        torch.save(res, f"{out}/result.{rank}")
    finally:
        dist.destroy_process_group()


def test_monitors_trackers_and_controllers_on_a_one_rank_subgroup_see_their_own_rank_only(tmp_path, plain_main):
    """Two gloo ranks (processes), each with a monitor, a metric tracker and a controller whose ``group`` holds
    that rank alone (one per replica): the step and window metrics, the calibrating τ_tail and the Repair segment
    count are its own batch's; on the default group they are both ranks' (sums add, the MIN field is the smaller).
    Token counts and δ minima are taken from the batches themselves.  Rank, world size and the attempt id come
    from the process group: one attempt id on the default group (rank 0's, broadcast), each rank's own on its
    one-rank group.  The controller's Gate thresholds calibrated on the group and its Repair loss: on the one-rank
    group as without a group; on the default group pooled (thresholds) and weighted by repair segment counts (loss).

    First the same code runs in this process with a world of one, where the two groups must agree (and so that
    mutmut, which maps tests to the functions they call in the test process, runs this test for them)."""
    import torch.multiprocessing as mp

    _subgroup_rank(0, 1, str(tmp_path / "rdv1"), str(tmp_path / "one"))
    one = torch.load(tmp_path / "one" / "result.0")
    b = _batch(0, B=2, T=8)
    assert one["own"] == one["world"] == (b.num_tokens, 2, b.num_tokens) and one["own-tau"] == one["world-tau"]
    assert one["own-tracker"] == one["world-tracker"] == (b.num_tokens, b.delta.min().item())
    assert one["own-repair"] == one["world-repair"] > 0 and one["auto"][:2] == (0, 1)
    assert one["own-thresholds"] == one["world-thresholds"] == one["alone-thresholds"] is not None
    assert one["own-repair-loss"] == one["world-repair-loss"] == one["alone-repair-loss"] != 0

    mp.spawn(_subgroup_rank, args=(2, str(tmp_path / "rdv"), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"result.{r}") for r in range(2)]
    n = [(_batch(r, B=2 + r, T=8).num_tokens, 2 + r) for r in range(2)]
    both = (n[0][0] + n[1][0], n[0][1] + n[1][1])
    lo = [_batch(r, B=2 + r, T=8).delta.min().item() for r in range(2)]
    assert lo[0] != lo[1]
    for r, got in enumerate(res):
        assert got["own"] == (n[r][0], n[r][1], n[r][0]), (r, got)
        assert got["world"] == (both[0], both[1], both[0]), (r, got)
        assert got["own-cal"] == n[r] and got["world-cal"] == both, (r, got)
        assert got["own-min"] == lo[r] and got["world-min"] == min(lo), (r, got, lo)
        assert got["own-tracker"] == (n[r][0], lo[r]) and got["world-tracker"] == (both[0], min(lo)), (r, got)
    # the provisional τ_tail of step 0 is the quantile of the group's δ: each rank's own, both ranks' pooled
    assert res[0]["world-tau"] == res[1]["world-tau"]
    taus = {res[0]["own-tau"], res[1]["own-tau"], res[0]["world-tau"]}
    assert len(taus) == 3 and all(math.isfinite(t) for t in taus), taus
    # the Repair segment count sums over the group
    own = [r["own-repair"] for r in res]
    assert min(own) > 0 and own[0] != own[1] and res[0]["world-repair"] == res[1]["world-repair"] == sum(own)
    # a controller on its own rank's group calibrates and repairs as one without a group; on the default group the
    # Gate thresholds are the pooled reference window's (the same on both ranks), and the Repair loss is the ranks'
    # own losses weighted by their repair segment counts (Σ num / Σ segments)
    for got in res:
        assert got["own-thresholds"] == got["alone-thresholds"] and got["own-repair-loss"] == got["alone-repair-loss"]
    assert res[0]["world-thresholds"] == res[1]["world-thresholds"] != res[0]["own-thresholds"]
    assert res[0]["own-thresholds"] != res[1]["own-thresholds"]
    loss = [r["own-repair-loss"] for r in res]
    assert loss[0] != loss[1]
    assert res[0]["world-repair-loss"] == res[1]["world-repair-loss"] == pytest.approx(
        (loss[0] * own[0] + loss[1] * own[1]) / sum(own), rel=1e-5)
    assert [r["auto"][:2] for r in res] == [(0, 2), (1, 2)]
    assert res[0]["auto"][2] == res[1]["auto"][2] and res[0]["worker-attempt"] == res[1]["worker-attempt"]
    assert res[0]["own-auto"][2] != res[1]["own-auto"][2] and res[0]["own-id"] != res[1]["own-id"]
    attempts = json.loads((tmp_path / "auto" / "run.json").read_text())["attempts"]
    assert [(a["attempt"], a["world_size"]) for a in attempts] == [(res[0]["auto"][2], 2)]


def test_a_checkpoint_state_of_another_version_is_refused_naming_it(tmp_path):
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2, calibration_steps=2)) as mon:
        state = mon.state_dict()
        assert state["version"] == 1
        with pytest.raises(ValueError, match=r"^MismatchMonitor state version 7 is not 1$"):
            mon.load_state_dict({**state, "version": 7})
        with pytest.raises(ValueError, match=r"^MismatchMonitor state version None is not 1$"):
            mon.load_state_dict({"tracker": state["tracker"]})


class _Logger:
    """A user's metrics logger (the protocol W&B's adapter follows): records what the monitor hands it."""

    def __init__(self, fail_on=()):
        self.calls, self.fail_on = [], set(fail_on)

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name in self.fail_on:
            raise RuntimeError(f"{name} is down")

    def log_config(self, config):
        self._call("log_config", config)

    def log_metrics(self, step, metrics):
        self._call("log_metrics", step, metrics)

    def close(self):
        self._call("close")


class _Alerts:
    def __init__(self):
        self.seen = []

    def observe(self, step, metrics):
        self.seen.append(step)
        return [{"rule": "r", "metric": "reward", "value": metrics["reward"], "threshold": 1.0, "window": 1,
                 "level": "WARN", "title": "t", "text": "x"}] if metrics["reward"] > 1 else []

    def close(self):
        self.seen.append("closed")


class _NoCloseLogger:
    """A logger with nothing to close: the monitor does not call a close it lacks."""

    def log_config(self, config):
        pass

    def log_metrics(self, step, metrics):
        pass


def test_loggers_and_alerts_get_every_step_and_a_failing_one_is_skipped_once(tmp_path, caplog):
    ok, bad, alerts = _Logger(), _Logger(fail_on={"log_metrics"}), _Alerts()
    d = tmp_path / "r"
    with caplog.at_level("WARNING", logger="triage_monitor"):
        with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), manifest={"model": "m"},
                             loggers=[bad, ok, _NoCloseLogger()], alerts=alerts) as mon:
            outs = [mon.log_step(s, _batch(s), extra={"reward": float(s)}) for s in range(3)]
    assert ok.calls[0][0] == "log_config" and ok.calls[0][1]["info"] == {"model": "m"}
    assert [c[1] for c in ok.calls if c[0] == "log_metrics"] == [0, 1, 2]
    assert [c[2] for c in ok.calls if c[0] == "log_metrics"] == outs
    assert ok.calls[-1] == ("close",) and bad.calls[-1] == ("close",)
    assert [c[0] for c in bad.calls] == ["log_config", "log_metrics", "close"]      # skipped after its failure
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert warned == ["triage-monitor: _Logger.log_metrics failed (RuntimeError: log_metrics is down); it is "
                      "skipped from now on"]
    assert alerts.seen == [0, 1, 2, "closed"]
    rows = open_run(d).alerts()
    assert rows["step"].tolist() == [2] and rows["value"].tolist() == [2.0] and rows["rule"].tolist() == ["r"]
    from triage_monitor.rundir.records import ALERT_SCHEMA               # one schema for plain readers of alerts/

    (f,) = (d / "alerts").iterdir()
    assert pq.read_schema(f).remove_metadata() == ALERT_SCHEMA
    assert pq.read_table(f).column("step").to_pylist() == [2]
    assert json.loads((d / "run.json").read_text())["status"] == "finished"


def test_tau_tail_is_saved_once_when_it_freezes(tmp_path):
    d = tmp_path / "r"
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2)) as mon:
        outs = [mon.log_step(s, _batch(s)) for s in range(4)]
    assert [o["tau_tail_frozen"] for o in outs] == [0.0, 0.0, 1.0, 1.0]
    cal = json.loads((d / "run.json").read_text())["calibration"]
    assert cal["tau_tail"] == outs[2]["tau_tail"] and cal["frozen_at_step"] == 2 and cal["attempt"] == mon.attempt
    with MismatchMonitor(tmp_path / "g", MonitorConfig(window=2, tau_tail=-0.5)) as mon:   # a given τ_tail
        assert mon.log_step(0, _batch(0))["tau_tail_frozen"] == 1.0
    assert json.loads((tmp_path / "g" / "run.json").read_text())["calibration"] is None


def test_log_step_accepts_numpy_steps_and_scalar_tensors_and_names_bad_extras(tmp_path):
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        out = mon.log_step(np.int64(4), _batch(0), extra={"kl": torch.tensor(0.25), "n": np.float32(2)})
        assert out["step"] == 4 and type(out["step"]) is int and out["kl"] == 0.25 and out["n"] == 2.0
        with pytest.raises(TypeError, match=r"^step must be an int, got True$"):
            mon.log_step(True, _batch(0))
        with pytest.raises(ValueError, match=r"^extra\['kl'\] must be a scalar, got a tensor of shape \(2,\)$"):
            mon.log_step(5, _batch(0), extra={"kl": torch.ones(2)})
        with pytest.raises(ValueError, match=r"^extra\['r'\] must be a number, got None$"):
            mon.log_step(5, _batch(0), extra={"r": None})
        with pytest.raises(ValueError, match=r"^extra keys \['c_tok', 'window/p_adj'\] are names of computed metrics; "
                                             r"rename them \(e.g. 'user/c_tok'\)$"):
            mon.log_step(5, _batch(0), extra={"window/p_adj": 1, "c_tok": 1, "ok": 2})
        b = _batch(0)
        for name in ("step", "rank", "attempt", "sample_id", "position"):
            with pytest.raises(ValueError, match=rf"^token_extras\['{name}'\]: reserved column name \(reserved: step, "
                                                 r"rank, sample_id, group_id, position, learner_logp, sampler_logp, "
                                                 r"advantage, attempt, step, rank\)$"):
                mon.log_step(5, b, token_extras={name: torch.ones(b.num_tokens)})
        with pytest.raises(ValueError, match=rf"^token_extras\['w'\] has {b.num_tokens + 1} values, batch has "
                                             rf"{b.num_tokens}$"):
            mon.log_step(5, b, token_extras={"w": torch.ones(b.num_tokens + 1)})
        assert mon.steps_logged == 1


def test_padding_and_offset_warnings_read_in_full(tmp_path, caplog):
    """One valid token with learner log-prob exactly 0.0 (sampler −9) and no padding run: the padding warning
    fires on the zero count alone; a response whose first valid token is at position 2: the offset warning."""
    import logging

    learner = torch.tensor([[0.0, -1.0, -2.0, -0.5], [-1.0, -1.2, -0.3, -0.7]])
    sampler = torch.tensor([[-9.0, -1.1, -2.1, -0.6], [-1.1, -1.3, -0.4, -0.8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, tau_tail=-1.0)) as mon:
            out = mon.log_step(0, TokenBatch.from_padded(learner, sampler, torch.ones(2), mask))
    assert (out["zero_logp_count"], out["padding_run_count"], out["offset_response_count"]) == (1, 0, 1)
    msgs = [r.getMessage() for r in caplog.records]
    assert ("triage-monitor step 0: 1 valid token(s) with log-prob exactly 0.0 on one side only and 0 response(s) "
            "ending in a run of identical values: padding leaking into the loss mask? (metrics zero_logp_count, "
            "padding_run_count)") in msgs
    assert ("triage-monitor step 0: 1 response(s) whose first valid token is not at position 0: left padding or a "
            "prompt in the tensor without positions=? Segments are cut by position (metric "
            "offset_response_count)") in msgs


def test_one_host_copy_of_a_step_serves_the_metrics_the_input_checks_and_the_writer(tmp_path, monkeypatch):
    """A step's token columns are copied off their device (here: a bfloat16 learner, converted to float32) once:
    :meth:`TokenBatch.host` builds one :class:`~triage_monitor.batch.HostTokens` a step, read by the metrics, the
    padding diagnostics and the record writer alike."""
    import triage_monitor.batch as batch_mod
    import triage_monitor.metrics.alignment as alignment

    built, scanned = [], []
    real, real_scan = batch_mod.HostTokens, alignment._padding_scan

    def counting(*cols):
        built.append(cols[0])
        return real(*cols)

    def scan(learner, *rest):
        scanned.append(learner)
        return real_scan(learner, *rest)

    monkeypatch.setattr(batch_mod, "HostTokens", counting)
    monkeypatch.setattr(alignment, "_padding_scan", scan)
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, calibration_steps=2)) as mon:
        for step in range(3):
            b = _batch(step)
            b.learner_logp = b.learner_logp.to(torch.bfloat16)
            mon.log_step(step, b)
    assert [c.dtype for c in built] == [torch.float32] * 3
    assert len(scanned) == 3 and all(np.shares_memory(a, c.numpy()) for a, c in zip(scanned, built))
    assert open_run(tmp_path / "run").tokens(2)["learner_logp"].dtype == np.float32
