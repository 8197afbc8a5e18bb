"""Reading a run back: the recorded tokens as a TokenBatch, one step's metric state from its files, the per-step
state cache under ``RUN_DIR/analysis`` and the post-mortem frame (recomputed metrics joined with the live-only
columns)."""

import math
import os

import numpy as np
import pandas as pd
import pytest
import torch

from runfiles import file_of
from triage_monitor.offline.analysis import compare_live, open_run, postmortem_frame, recompute, recompute_states, step_state
from triage_monitor.batch import TokenBatch
from triage_monitor.metrics.stats import METRIC_NAMES, MismatchStats
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

STEPS = 5


def _batch(step, B=6, T=40):
    """Responses of different lengths (mask), advantages of both signs, groups of 3, sample ids 10·step + i."""
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2 - (torch.rand(B, T, generator=g) < 0.06) * 3).clamp(max=0)
    mask = torch.arange(T)[None] < torch.randint(8, T + 1, (B, 1), generator=g)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), mask, sample_ids=torch.arange(B) + 10 * step,
                                  group_ids=torch.arange(B) // 3)


def _write(d, cfg, record_tokens=True, steps=STEPS):
    cfg.record_tokens = record_tokens
    with MismatchMonitor(d, cfg) as mon:
        return [mon.log_step(s, _batch(s), extra={"reward": 0.5 * s}) for s in range(steps)]


@pytest.fixture
def run(tmp_path):
    """A 5-step run, window 2, τ_tail calibrated on the first 2 steps, every step's live row; a file per step
    (roll_steps 1), so that a test can damage one step's records."""
    d = tmp_path / "run"
    live = _write(d, MonitorConfig(window=2, calibration_steps=2, metrics={"segment_width": 8}, roll_steps=1))
    return open_run(d), live


# ------------------------------------------------------------------------------------ the recorded tokens
def test_token_batch_holds_the_logged_tokens_exactly(run):
    r, _ = run
    for s in (0, 3):
        b, got = _batch(s), r.token_batch(s)
        assert got.num_tokens == b.num_tokens
        for k in ("learner_logp", "sampler_logp", "advantage", "position"):     # as recorded: float32, exact
            assert torch.equal(getattr(got, k), getattr(b, k)), k
        assert got.learner_logp.dtype == torch.float32
        assert torch.equal(got.sample_id[got.sample_index], b.sample_id[b.sample_index])
        assert torch.equal(got.group_id[got.sample_index], b.group_id[b.sample_index])
    assert [s for s, _ in r.iter_batches()] == list(range(STEPS))
    assert [(s, b.num_tokens) for s, b in r.iter_batches([4, 1])] == [(4, _batch(4).num_tokens),
                                                                    (1, _batch(1).num_tokens)]


def test_token_files_name_each_ranks_file_of_the_latest_attempt(tmp_path):
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, tau_tail=-1.0)
    for attempt in (1, 2):
        for rank in (1, 0):
            with MismatchMonitor(d, cfg, rank=rank, attempt=attempt) as mon:
                mon.log_step(0, _batch(rank))
                if attempt == 1:
                    mon.log_step(1, _batch(5 + rank))
    r = open_run(d)
    assert [os.path.basename(f) for f in r.token_files(0)] == [
        "steps-00000000-00000000-rank-0000-attempt-2-part-0.parquet",
        "steps-00000000-00000000-rank-0001-attempt-2-part-0.parquet"]
    assert [os.path.basename(f) for f in r.token_files(1)] == [                  # the block of steps 0 and 1
        "steps-00000000-00000001-rank-0000-attempt-1-part-0.parquet",
        "steps-00000000-00000001-rank-0001-attempt-1-part-0.parquet"]
    with pytest.raises(KeyError, match="step 7 has no token records"):
        r.token_files(7)
    assert r.token_batch(0).num_tokens == _batch(0).num_tokens + _batch(1).num_tokens


def test_a_step_logged_again_on_one_rank_keeps_the_other_ranks_row(tmp_path):
    """Per-rank steps rows (``per_rank_steps``) of one attempt: rank 0 logs step 1 again (a newer part of its own
    file, other values), rank 1 logs it once.  The newest part is chosen per (step, rank): rank 0's second row
    and rank 1's only row of step 1 are both read (a choice per step alone drops rank 1's)."""
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, tau_tail=-1.0, per_rank_steps=True)
    logged = {}
    for rank in (0, 1):
        with MismatchMonitor(d, cfg, rank=rank, attempt=1) as mon:
            for s, seed in [(0, 10 + rank), (1, 20 + rank)] + ([(1, 30)] if rank == 0 else []):
                logged[(s, rank)] = mon.log_step(s, _batch(seed))["n_tokens"]
    rows = open_run(d).steps(rank=None)
    assert sorted(zip(rows["step"], rows["rank"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got = {(int(s), int(r)): n for s, r, n in zip(rows["step"], rows["rank"], rows["n_tokens"])}
    assert got == logged and logged[(1, 0)] == _batch(30).num_tokens != _batch(21).num_tokens == logged[(1, 1)]


def test_refresh_reads_a_resumed_jobs_new_attempt(tmp_path):
    """An open ``Run`` keeps its listings (and each step's attempt) until ``refresh()``: a resumed job then redoes
    step 0, where the first attempt raised an alert and the new one raises none.  Before the refresh the run reads
    the first attempt; after it, the step's attempt is the new one and the old alert is gone (the same step and
    part numbers, only the attempt differs)."""
    from triage_monitor.alerting.alert_rules import Rule
    from triage_monitor.alerting.alerts import AlertEngine

    def engine(threshold):
        return AlertEngine([Rule(name="many", metric="n_tokens", condition="above", threshold=threshold)])

    d, cfg = tmp_path / "run", MonitorConfig(window=2, tau_tail=-1.0)
    with MismatchMonitor(d, cfg, alerts=engine(0)) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
        a1 = mon.attempt
    r = open_run(d)
    assert r.alerts()["step"].tolist() == [0] and r.step_attempts()[0] == a1
    with MismatchMonitor(d, cfg, alerts=engine(1e9)) as mon:
        mon.log_step(0, _batch(7))
        a2 = mon.attempt
    assert r.alerts()["step"].tolist() == [0]                 # the open run's listing, until refreshed
    r.refresh()
    assert r.step_attempts() == {0: a2, 1: a1, 2: a1}
    assert r.alerts().empty and r.steps().set_index("step")["attempt"].to_dict() == {0: a2, 1: a1, 2: a1}
    assert r.token_batch(0).num_tokens == _batch(7).num_tokens


# ------------------------------------------------------------------------------ one step's state from its files
def test_state_of_a_steps_files_gives_the_live_step_metrics(tmp_path):
    """The offline state (numpy kernel over the decoded Parquet columns) against the live monitor's values (the
    torch tracker over the batch): with a given τ_tail every step metric is reproduced."""
    d = tmp_path / "run"
    cfg = MonitorConfig(window=3, tau_tail=-0.4, metrics={"segment_width": 8})
    live = _write(d, cfg)
    r = open_run(d)
    for s in (1, 4):
        state = step_state(r.token_source(s), -0.4, cfg.metrics)
        got = MismatchStats(cfg.metrics, state=torch.from_numpy(state), tau_tail=-0.4).compute().values
        for k in METRIC_NAMES:
            a, b = got[k], live[s][k]
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), (s, k, a, b)


# ------------------------------------------------------------------------------------------- the state cache
def _cache_files(r):
    return sorted((r.path / "analysis").glob("states-*.npz"))


def _same_states(a, b):
    assert a.steps == b.steps and a.taus == b.taus and np.array_equal(a.states, b.states)
    assert len(a.null_inputs) == len(b.null_inputs) == len(a.steps)
    for x, y in zip(a.null_inputs, b.null_inputs):
        assert len(x) == len(y) == 3 and all(np.array_equal(u, v) for u, v in zip(x, y))


def test_state_cache_is_saved_once_and_read_back_whole(run):
    r, _ = run
    fresh = recompute_states(r)
    first = recompute_states(r, cache=True)
    _same_states(first, fresh)
    (f,) = _cache_files(r)
    assert not list((r.path / "analysis").glob(".tmp-*"))
    # the steps' shuffle-null inputs have different lengths (step 0's is empty): each gets its own slice back
    assert [len(n[0]) for n in fresh.null_inputs] == [0, 5, 7, 8, 12]
    assert [len(n[1]) for n in fresh.null_inputs] == [0, 2, 2, 2, 3]
    again = recompute_states(r, cache=True, window=3)
    _same_states(again, fresh)
    assert again.window == 3 and again.tau_mode == "frozen" and again.config == fresh.config
    assert again.frame().equals(recompute(r, window=3))
    # a hit is read from the file, not recomputed: a planted value comes back
    with np.load(f) as z:
        arrays = dict(z)
    arrays["states"] = arrays["states"] + 1.0
    with open(f, "wb") as fh:
        np.savez(fh, **arrays)
    assert np.array_equal(recompute_states(r, cache=True).states, fresh.states + 1.0)


def test_state_cache_key_follows_the_settings_and_the_token_files(run):
    r, _ = run
    recompute_states(r, cache=True)
    recompute_states(r, cache=True, tau_mode="live")
    recompute_states(r, cache=True, tau_tail=-0.3)
    recompute_states(r, cache=True, calibration_steps=3)
    recompute_states(r, cache=True, steps=[1, 2])
    recompute_states(r, cache=True, config=r.metric_config().__class__(segment_width=16))
    assert len(_cache_files(r)) == 6
    recompute_states(r, cache=True, window=4)              # the window merges states: the same file
    assert len(_cache_files(r)) == 6
    f = r.token_files(3)[0]
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))   # the same records, another file time
    recompute_states(r, cache=True)
    assert len(_cache_files(r)) == 6
    with MismatchMonitor(r.path, r.config) as mon:                      # a resumed job redoes step 3
        mon.log_step(3, _batch(9))
    recompute_states(open_run(r.path), cache=True)
    assert len(_cache_files(r)) == 7
    # the key names the records (rank, attempt, part of each step), not files: a run copied elsewhere keeps it
    import shutil

    copy = open_run(shutil.copytree(r.path, r.path.parent / "elsewhere" / "run"))
    recompute_states(copy, cache=True)
    assert [f.name for f in _cache_files(copy)] == [f.name for f in _cache_files(r)]


def test_the_state_cache_follows_a_resume_that_reuses_part_and_step_numbers(tmp_path):
    """The default layout (one block of ``roll_steps`` steps per attempt, part 0): a resumed job redoes step 3 as part
    0 of its own attempt, the same step and part numbers as the records it replaces, with other values.  The cached
    states are then those of the new records (equal to a fresh recomputation), not the earlier attempt's; the cache
    of the first attempt is not read for them (docs/testing.md#test-data: a resume reuses part and step numbers)."""
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, tau_tail=-0.4, metrics={"segment_width": 8})         # default roll_steps
    _write(d, cfg)
    before = recompute_states(open_run(d), cache=True)
    with MismatchMonitor(d, cfg) as mon:
        mon.log_step(3, _batch(9))
    r = open_run(d)
    (new,) = r.index("tokens").for_step(3)
    (old,) = [p for p in r.index("tokens").covering(3) if p.attempt != new.attempt]
    assert (new.part, new.rank) == (old.part, old.rank) == (0, 0)                    # only the attempt differs
    after = recompute_states(r, cache=True)
    _same_states(after, recompute_states(r))
    assert not np.array_equal(after.states[3], before.states[3])
    np.testing.assert_array_equal(after.states[[0, 1, 2, 4]], before.states[[0, 1, 2, 4]])


def test_the_state_cache_reads_a_token_file_replaced_under_its_name_again(tmp_path):
    """Two runs with the same file names (attempt 1, the same steps and parts) and other values: once run A's states
    are cached, A's token file is replaced by B's under its own name (a run copied over another).  The cache is then
    not read for it: the states equal a fresh recomputation of A's files as they now are, B's values."""
    import shutil

    cfg = MonitorConfig(window=2, tau_tail=-0.4, metrics={"segment_width": 8})
    for name, offset in (("a", 0), ("b", 50)):
        with MismatchMonitor(tmp_path / name, cfg, attempt=1) as mon:
            for s in range(3):
                mon.log_step(s, _batch(s + offset))
    a = open_run(tmp_path / "a")
    before = recompute_states(a, cache=True)
    (fa,), (fb,) = a.token_files(1), open_run(tmp_path / "b").token_files(1)
    assert os.path.basename(fa) == os.path.basename(fb)
    shutil.copyfile(fb, fa)
    a = open_run(tmp_path / "a")
    after = recompute_states(a, cache=True)
    _same_states(after, recompute_states(a))
    assert not np.array_equal(after.states, before.states)


def test_a_damaged_or_unwritable_cache_is_recomputed_without_error(run):
    r, _ = run
    fresh = recompute_states(r)
    recompute_states(r, cache=True)
    (f,) = _cache_files(r)
    f.write_bytes(b"not an npz")
    _same_states(recompute_states(r, cache=True), fresh)
    with np.load(f) as z:                                  # rewritten whole
        assert np.array_equal(z["states"], fresh.states)
    arrays = dict(np.load(f))
    del arrays["taus"]                                     # an older cache format
    with open(f, "wb") as fh:
        np.savez(fh, **arrays)
    _same_states(recompute_states(r, cache=True), fresh)
    # a run directory where analysis/ cannot be created (here: a regular file): no cache, same result
    d2 = r.path.parent / "run2"
    _write(d2, MonitorConfig(window=2, calibration_steps=2, metrics={"segment_width": 8}))
    (d2 / "analysis").write_text("")
    _same_states(recompute_states(open_run(d2), cache=True), fresh)


# ------------------------------------------------------------------------------------------ the post-mortem
def test_postmortem_frame_joins_recomputed_metrics_with_live_only_columns(run):
    r, live = run
    frame, states = postmortem_frame(r)
    rec = recompute(r)                          # the same computation: postmortem_frame uses recompute_states
    assert states is not None and states.steps == list(range(STEPS))
    assert list(frame["step"]) == list(range(STEPS))
    pd.testing.assert_frame_equal(frame[list(rec.columns)], rec)
    assert list(frame["reward"]) == [0.5 * s for s in range(STEPS)]
    assert list(frame["tau_tail_frozen"]) == [row["tau_tail_frozen"] for row in live]
    assert frame.attrs["tau_mode"] == "frozen" and frame.attrs["window"] == 2
    # independent check: once τ_tail froze (step 1), the frozen-τ post-mortem equals the live monitor
    for s in (2, 4):
        for k in ("rho_asym", "c_tok", "window/r_amp", "n_tokens"):
            a, b = frame.loc[s, k], live[s][k]
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9), (s, k)
    # the steps a page listed earlier (a run still being written): those with tokens, a snapshot of the prefix
    only, _ = postmortem_frame(r, window=3, steps=[2, 0, 1, 9])
    assert list(only["step"]) == [0, 1, 2] and only.attrs["window"] == 3
    pd.testing.assert_frame_equal(only, postmortem_frame(r, window=3)[0].iloc[:3])
    assert _cache_files(r)                      # the post-mortem fills the shared cache


def test_postmortem_frame_without_token_records_is_the_live_rows(tmp_path):
    d = tmp_path / "run"
    _write(d, MonitorConfig(window=2, calibration_steps=2), record_tokens=False)
    r = open_run(d)
    frame, states = postmortem_frame(r)
    assert states is None
    pd.testing.assert_frame_equal(frame, r.steps())
    given = r.steps().iloc[:2]
    assert postmortem_frame(r, live=given)[0] is given


# ---------------------------------------------------------------------------------------- Run.tokens
def _two_ranks(d, extras_on_rank0=False):
    """Step 0 on two ranks of one attempt; rank 1 holds the lower sample ids, so file order is not row order."""
    cfg = MonitorConfig(window=2, tau_tail=-1.0)
    for rank, ids in ((0, [7, 3]), (1, [2, 5])):
        b = TokenBatch.from_list([torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.25, -3.0])],
                                 [torch.tensor([-1.5, -2.0, -0.5]), torch.tensor([-0.5, -2.0])],
                                 torch.tensor([1.0, -1.0]) * (rank + 1), sample_ids=torch.tensor(ids))
        ex = {"gate_weight": torch.arange(5, dtype=torch.float32)} if extras_on_rank0 and rank == 0 else None
        with MismatchMonitor(d, cfg, rank=rank, attempt=1) as mon:
            mon.log_step(0, b, token_extras=ex)


def test_tokens_of_all_ranks_sorted_by_sample_and_position(tmp_path):
    d = tmp_path / "run"
    _two_ranks(d, extras_on_rank0=True)
    df = open_run(d).tokens(0)
    assert list(zip(df["sample_id"], df["position"])) == [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (5, 0), (5, 1),
                                                          (7, 0), (7, 1), (7, 2)]
    assert list(df.index) == list(range(10))
    assert df["rank"].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert df["learner_logp"].tolist()[:3] == [-1.0, -2.0, -0.5]
    # a token column one rank has and the other not: the other rank's rows hold NaN
    # (token_extras follow the batch's token order: sample 3's tokens, then sample 7's)
    assert df["gate_weight"].tolist()[3:5] == [0.0, 1.0] and df["gate_weight"].tolist()[7:] == [2.0, 3.0, 4.0]
    assert df["gate_weight"][:3].isna().all()
    part = open_run(d).tokens(0, columns=["sample_id", "advantage"])
    assert list(part.columns) == ["sample_id", "advantage", "rank"]
    assert part["advantage"].tolist() == [2.0] * 3 + [-1.0] * 2 + [-2.0] * 2 + [1.0] * 3


def test_tokens_skip_an_unreadable_rank_file_and_name_every_file_when_none_reads(tmp_path):
    d = tmp_path / "run"
    _two_ranks(d)
    r = open_run(d)
    f0, f1 = r.token_files(0)
    with open(f0, "r+b") as fh:
        fh.truncate(100)
    assert sorted(r.tokens(0)["sample_id"].unique()) == [2, 5]            # rank 1's rows still read
    assert [p for p, _ in r.unreadable] == [f0]
    with open(f1, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(KeyError) as err:
        open_run(d).tokens(0)
    assert f"step 0: every token file is unreadable ({f0}, {f1})" in str(err.value)
    with pytest.raises(KeyError) as err:
        r.tokens(3)
    assert str(err.value) == repr(f"step 3 has no token records in {d}")


# ------------------------------------------------------------------------------------------- compare_live
def test_compare_live_relative_differences_worked_by_hand(run):
    """Hand-made live and recomputed rows: |live − rec| / max(|live|, |rec|) per metric; NaN on both sides is equal,
    on one side inf; with a frozen-τ recomputation the τ-dependent metrics of the provisional live steps
    (tau_tail_frozen = 0: step 0) and the windows holding them (window 2: steps 0 and 1) are not compared."""
    r, _ = run
    live = pd.DataFrame({"step": [0, 1, 2, 3], "tau_tail_frozen": [0.0, 1.0, 1.0, 1.0],
                         "rho_asym": [1.0, 2.0, math.nan, -4.0], "c_tok": [9.0, 0.5, 0.25, 0.0],
                         "window/c_tok": [9.0, 9.0, 0.5, 0.5], "delta_mean": [0.0, 1.0, 1.0, 1.0],
                         "reward": [1.0, 1.0, 1.0, 1.0]})
    rec = pd.DataFrame({"step": [0, 1, 2, 3, 4], "rho_asym": [1.0, 2.2, math.nan, -4.0, 7.0],
                        "c_tok": [1.0, 0.5, 0.2, 0.0, 1.0], "window/c_tok": [1.0, 3.0, 0.5, 0.4, 1.0],
                        "delta_mean": [0.0, math.nan, 1.0, 1.0, 1.0], "p_adj": [0.1] * 5})
    rec.attrs.update(tau_mode="frozen", window=2)
    got = compare_live(r, rec, live=live).set_index("metric")
    assert list(got.index) == ["rho_asym", "c_tok", "window/c_tok", "delta_mean"]   # p_adj: no live column
    assert got.at["rho_asym", "max_rel_diff"] == pytest.approx(0.2 / 2.2, rel=1e-12)
    assert not got.at["rho_asym", "equal"] and got.at["rho_asym", "compared"] == 4
    assert got.at["rho_asym", "provisional"] == 0
    assert got.at["c_tok", "max_rel_diff"] == pytest.approx(0.05 / 0.25) and got.at["c_tok", "provisional"] == 1
    assert got.at["c_tok", "compared"] == 3
    assert got.at["window/c_tok", "max_rel_diff"] == pytest.approx(0.1 / 0.5)
    assert got.at["window/c_tok", "provisional"] == 2 and got.at["window/c_tok", "compared"] == 2
    assert got.at["delta_mean", "max_rel_diff"] == math.inf and not got.at["delta_mean", "equal"]
    loose = compare_live(r, rec, rtol=0.2, live=live).set_index("metric")["equal"]
    assert loose.to_dict() == {"rho_asym": True, "c_tok": True, "window/c_tok": True, "delta_mean": False}
    # one side 0: bounded by 1, not 1e300
    zero = compare_live(r, rec.assign(rho_asym=[0.0, 2.0, math.nan, -4.0, 7.0]), live=live).set_index("metric")
    assert zero.at["rho_asym", "max_rel_diff"] == 1.0
    # live τ mode: every step compared; without attrs the run's window (2) is used
    rec.attrs.update(tau_mode="live")
    assert (compare_live(r, rec, live=live)["provisional"] == 0).all()
    rec.attrs.clear()
    assert compare_live(r, rec, live=live).set_index("metric").at["window/c_tok", "provisional"] == 2
    rec.attrs.update(tau_mode="frozen", window=3)
    assert compare_live(r, rec, live=live).set_index("metric").at["window/c_tok", "provisional"] == 3
    empty = compare_live(r, rec.iloc[4:], live=live)
    assert (empty["max_rel_diff"] == 0.0).all() and (empty["compared"] == 0).all()


# ---------------------------------------------------------------------------------- τ_tail of a recomputation
def test_a_run_stopped_inside_its_reference_window_recomputes_with_its_last_live_tau(tmp_path):
    """calibration_steps=4, 3 steps logged: τ_tail never froze (run.json has none); the frozen post-mortem uses
    the value the live monitor reached at its last reference step, the 5 % quantile of the 3 steps' δ (checked
    against pandas within the sketch's error bound)."""
    from triage_monitor.metrics.sketch import quantile_error_bound

    d = tmp_path / "run"
    live = _write(d, MonitorConfig(window=2, calibration_steps=4), steps=3)
    r = open_run(d)
    assert r.tau_tail is None and [o["tau_tail_frozen"] for o in live] == [0.0, 0.0, 0.0]
    rec = recompute(r)
    assert rec["tau_tail"].tolist() == [live[2]["tau_tail"]] * 3
    ref = torch.cat([_batch(s).delta for s in range(3)]).double().numpy()
    assert abs(live[2]["tau_tail"] - np.quantile(ref, 0.05)) <= quantile_error_bound(np.sort(ref), 0.05)
    # the live replay: each reference step's own provisional value
    assert recompute(r, tau_mode="live")["tau_tail"].tolist() == [o["tau_tail"] for o in live]
    # without the steps table the same values come from the token files' sketches alone
    for f in (d / "steps").iterdir():
        f.unlink()
    assert recompute(open_run(d))["tau_tail"].tolist() == [live[2]["tau_tail"]] * 3
    assert recompute(open_run(d), tau_mode="live")["tau_tail"].tolist() == [o["tau_tail"] for o in live]


def test_recompute_arguments_are_checked(run):
    r, _ = run
    with pytest.raises(ValueError, match=r"tau_mode must be one of \('frozen', 'live'\), got 'both'"):
        recompute(r, tau_mode="both")
    with pytest.raises(KeyError, match=r"step\(s\) \[7, 9\] have no token records"):
        recompute(r, steps=[1, 9, 7])
    assert recompute(r, steps=[3, 1])["step"].tolist() == [1, 3]
    assert len(recompute(r, steps=[])) == 0


# ------------------------------------------------------------------------------------------ Run.steps by rank
def test_steps_by_rank_and_empty_tables(tmp_path):
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, tau_tail=-1.0)
    for rank in (1, 0):
        with MismatchMonitor(d, cfg, rank=rank, attempt=3) as mon:
            for s in (2, 0, 1):
                mon.log_step(s, _batch(10 * s + rank), extra={"who": float(10 * s + rank)})
    r = open_run(d)
    both = r.steps(rank=None)
    assert list(zip(both["step"], both["rank"])) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert both["who"].tolist() == [0.0, 1.0, 10.0, 11.0, 20.0, 21.0] and list(both.columns[:2]) == ["step", "rank"]
    assert r.steps()["who"].tolist() == [0.0, 10.0, 20.0] and r.steps(rank=1)["who"].tolist() == [1.0, 11.0, 21.0]
    assert list(both.index) == list(range(6))
    assert r.steps(rank=5).columns.tolist() == ["step"] and str(r.steps(rank=5)["step"].dtype) == "int64"
    assert len(r.alerts()) == 0 and r.alerts().columns.tolist() == ["step"]
    assert len(r.quarantine()) == 0 and r.quarantine().columns.tolist() == ["step"]
    assert r.step_numbers() == [0, 1, 2]



def test_postmortem_frame_keeps_token_steps_without_a_live_row(run):
    r, live = run
    rec = recompute(r)
    only_reward = r.steps()[["step", "reward"]]
    frame, _ = postmortem_frame(r, live=only_reward.iloc[[0, 1, 3, 4]])     # step 2's row lost
    assert list(frame.columns) == [*rec.columns, "reward"] and frame["step"].tolist() == list(range(STEPS))
    assert frame["reward"].tolist()[:2] == [0.0, 0.5] and math.isnan(frame["reward"][2])
    pd.testing.assert_frame_equal(postmortem_frame(r, live=pd.DataFrame())[0], rec)    # nothing live to join
    pd.testing.assert_frame_equal(postmortem_frame(r, live=r.steps()[["step"]])[0], rec)


def test_side_tables_keep_their_columns_and_skip_only_the_unreadable_file(tmp_path):
    from triage_monitor.rundir.records import ALERT_SCHEMA

    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, roll_steps=1), alerts=_EveryStep()) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
    r = open_run(d)
    assert list(r.alerts().columns) == ALERT_SCHEMA.names and r.alerts()["step"].tolist() == [0, 1, 2]
    file_of(d, "alerts", 0).write_bytes(b"broken")
    assert r.alerts()["step"].tolist() == [1, 2]


class _EveryStep:
    def observe(self, step, metrics):
        return [{"rule": "every", "metric": "n_tokens", "value": metrics["n_tokens"], "threshold": 0.0, "window": 1,
                 "level": "INFO", "title": "t", "text": "x"}]


def test_step_state_names_the_file_with_a_repeated_token(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from triage_monitor.config import MetricConfig

    f = tmp_path / "step-00000000-rank-0000-attempt-1.parquet"
    pq.write_table(pa.table({"sample_id": [1, 1, 1], "position": [0, 1, 1], "learner_logp": [-1.0, -1.0, -1.0],
                             "sampler_logp": [-1.0, -1.0, -1.0], "advantage": [1.0, 1.0, 1.0]},
                            schema=pa.schema([("sample_id", pa.int64()), ("position", pa.int64()),
                                              ("learner_logp", pa.float32()), ("sampler_logp", pa.float32()),
                                              ("advantage", pa.float32())])), f)
    with pytest.raises(ValueError, match=rf"^{f}: a \(sample_id, position\) pair occurs twice in the token records$"):
        step_state([f], -1.0, MetricConfig())
    empty = step_state([], -1.0, MetricConfig())                  # no file: the empty state, no token
    assert MismatchStats(MetricConfig(), state=torch.from_numpy(empty)).compute().values["n_tokens"] == 0


def test_a_broken_rank_file_skips_only_that_rank_and_the_rows_are_numbered_afresh(tmp_path, monkeypatch):
    """Alerts files of two ranks at steps 0 and 1: with rank 0's file of step 0 broken, rank 1's row of step 0 is
    still read; the frame's index is 0..n−1 (one row per alert), not each file's own 0.  (The monitor raises
    alerts on rank 0 only; rank 1's alert files are written through its writer, as a run of an older release or
    a merged import could hold them.)"""
    import triage_monitor.monitor as monitor_mod

    d = tmp_path / "run"
    monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: 7)    # one attempt shared by the two "ranks"
    mons = [MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, roll_steps=1), rank=r, attempt=7, alerts=_EveryStep())
            for r in (0, 1)]
    for s in range(2):
        for m in mons:
            metrics = m.log_step(s, _batch(s))
            if m.rank == 1:
                m.writer.record_alerts(s, _EveryStep().observe(s, metrics))
    for m in mons:
        m.close()
    r = open_run(d)
    a = r.alerts()
    assert list(zip(a["step"], a["rank"])) == [(0, 0), (0, 1), (1, 0), (1, 1)] and list(a.index) == [0, 1, 2, 3]
    file_of(d, "alerts", 0).write_bytes(b"broken")
    a = r.alerts()
    assert list(zip(a["step"], a["rank"])) == [(0, 1), (1, 0), (1, 1)] and list(a.index) == [0, 1, 2]
    assert r.unreadable[0][1].startswith("ArrowInvalid: ")          # the reason names the error's type
    # the live rows likewise: a broken rank-0 file at step 0, a rank-0 file of two rows at step 1
    import pyarrow as pa
    import pyarrow.parquet as pq
    file_of(d, "steps", 0).write_bytes(b"broken")
    f1 = file_of(d, "steps", 1)
    t = pq.read_table(f1)
    pq.write_table(pa.concat_tables([t, t]), f1)
    rows = open_run(d).steps(rank=None)
    assert list(zip(rows["step"], rows["rank"])) == [(0, 1), (1, 1)]


def test_tokens_keep_each_responses_position_order_without_the_position_column(tmp_path, monkeypatch):
    """Two ranks, responses 0 and 2 on rank 0 and 1 and 3 on rank 1, 400 tokens each, learner log-probs increasing
    with the position: read without the position column, each response's tokens still come in position order (the
    sort by sample_id keeps the recorded order of equal ids)."""
    import triage_monitor.monitor as monitor_mod

    d = tmp_path / "run"
    monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: 7)
    T = 400
    lp = -1.0 - torch.arange(T, 0, -1, dtype=torch.float32) / T            # increasing along the response
    mons = [MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=r, attempt=7) for r in (0, 1)]
    for r, m in enumerate(mons):
        ids = torch.tensor([r, r + 2])
        m.log_step(0, TokenBatch.from_padded(lp.repeat(2, 1), lp.repeat(2, 1) - 0.1, torch.ones(2),
                                             torch.ones(2, T, dtype=torch.bool), sample_ids=ids))
        m.close()
    df = open_run(d).tokens(0, ["sample_id", "learner_logp"])
    assert df["sample_id"].tolist() == [i for i in range(4) for _ in range(T)]
    for i in range(4):
        assert np.array_equal(df.loc[df.sample_id == i, "learner_logp"].to_numpy(), lp.numpy()), i


def test_recompute_takes_its_window_tau_calibration_and_config_arguments(run, capsys, monkeypatch):
    """What-if arguments reach the recomputation: window 1 makes every window metric its step's; a given τ_tail is
    every step's; a calibration over 3 steps gives another τ_tail than the run's 2; segment width 16 other
    localisation values.  Without ``progress``/``cache`` nothing is printed and no cache is written; with them, the
    progress bar is asked for and the states are saved under analysis/."""
    from triage_monitor.config import MetricConfig

    r, _ = run
    base = recompute(r)
    assert capsys.readouterr().err == "" and not (r.path / "analysis").exists()
    one = recompute(r, window=1)
    assert one.attrs["window"] == 1
    assert one["window/n_tokens"].tolist() == one["n_tokens"].tolist() != base["window/n_tokens"].tolist()
    assert recompute(r, tau_tail=-0.75)["tau_tail"].tolist() == [-0.75] * STEPS
    assert recompute(r, calibration_steps=3)["tau_tail"].iloc[0] != base["tau_tail"].iloc[0]
    wide = recompute(r, config=MetricConfig(segment_width=16))
    assert wide["h_seg"].tolist() != base["h_seg"].tolist()
    import triage_monitor.offline.engines as engines
    shown, real = [], engines._progress
    monkeypatch.setattr(engines, "_progress", lambda show, *a: shown.append(show) or real(show, *a))
    recompute(r, progress=True, cache=True)
    assert shown == [True] and list((r.path / "analysis").glob("states-*.npz"))
    fr, _ = postmortem_frame(r, window=1)
    assert fr["window/n_tokens"].tolist() == fr["n_tokens"].tolist() and fr.attrs["window"] == 1


def test_a_window_before_every_step_is_empty(run):
    """Also: no step asked for gives no state row (of the run's state size)."""
    from triage_monitor.metrics.stats import state_layout
    r, _ = run
    assert recompute_states(r, steps=[]).states.shape == (0, state_layout(8).size)
    states = recompute_states(r)
    empty = states.window_stats(-1)
    assert math.isnan(empty.tau_tail) and empty.compute().values["n_tokens"] == 0


def test_compare_live_reports_every_metric_both_sides_have(run):
    """A live frame without one of the recomputed columns: that column is left out, every other one compared."""
    r, _ = run
    rec = recompute(r)
    live = r.steps().drop(columns=["n_samples"])
    got = compare_live(r, rec, live=live)["metric"].tolist()
    assert got == [c for c in rec.columns if c not in ("step", "n_samples") and c in live.columns]
    assert "window/n_samples" in got and "rho_asym" in got


def _mapped_steps(monkeypatch) -> list:
    """A spy on the map over the steps: each call's steps, in order, appended to the list returned."""
    import triage_monitor.offline.engines as engines
    calls, real = [], engines.map_ordered
    monkeypatch.setattr(engines, "map_ordered", lambda fn, items, **kw: calls.append(
        [int(args[0].step) for args in items]) or real(fn, items, **kw))
    return calls


def test_the_steps_are_read_once_when_the_live_run_recorded_its_tau(run, monkeypatch, caplog):
    """The frozen τ_tail of run.json, or the live rows' τ_tail per step (tau_mode="live"), is the right one here, so
    each step's tokens are decoded once: the 2 reference steps, then the others (which the reference steps' τ_tail
    is known for); nothing is logged."""
    r, live = run
    calls = _mapped_steps(monkeypatch)
    frozen = recompute_states(r)
    assert calls == [[0, 1], [2, 3, 4]] and frozen.taus == [r.tau_tail] * STEPS
    assert not (r.path / "analysis").exists()                   # no cache unless asked for
    calls.clear()
    replay = recompute_states(r, tau_mode="live")
    assert calls == [[0, 1], [2, 3, 4]] and replay.taus == pytest.approx([row["tau_tail"] for row in live])
    assert "differs" not in caplog.text


def test_a_wrong_recorded_tau_is_said_in_one_line_and_every_step_computed_once(run, monkeypatch, caplog):
    """run.json's τ_tail differs from the one the reference steps' records give (here: rewritten): one WARNING line
    says so and what is done; the 2 reference steps are mapped again, every other step once, with the recalibrated
    τ_tail — the states of the run with its right τ_tail, bit for bit."""
    import json
    import logging

    r, _ = run
    right = recompute_states(r)
    man = json.loads((r.path / "run.json").read_text())
    man["calibration"]["tau_tail"] = r.tau_tail - 0.25
    (r.path / "run.json").write_text(json.dumps(man))
    wrong = open_run(r.path)
    assert wrong.tau_tail == r.tau_tail - 0.25
    calls = _mapped_steps(monkeypatch)
    with caplog.at_level(logging.WARNING, "triage_monitor.analysis"):
        got = recompute_states(wrong)
    assert calls == [[0, 1], [0, 1], [2, 3, 4]]
    said = [rec.getMessage() for rec in caplog.records if "differs" in rec.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "run.json" in said[0] and "computed once" in said[0]
    assert got.taus == right.taus and np.array_equal(got.states, right.states)


def test_a_step_without_its_live_row_is_recomputed_with_the_right_tau(run, monkeypatch):
    """tau_mode="live" guesses each step's τ_tail from its live row; step 3's row is gone (its steps file deleted):
    step 3 is after the 2 reference steps, mapped once with the τ_tail calibrated on them — the same state as in
    the frozen mode."""
    r, _ = run
    file_of(r.path, "steps", 3).unlink()
    calls = _mapped_steps(monkeypatch)
    replay = recompute_states(r, tau_mode="live")
    assert calls == [[0, 1], [2, 3, 4]]
    frozen = recompute_states(r)
    i = replay.steps.index(3)
    assert replay.taus[i] == frozen.taus[i] == r.tau_tail
    assert np.array_equal(replay.states[i], frozen.states[i])


def test_recorded_null_inputs_match_the_tail_layout_of_the_tokens(run):
    """The C_tok shuffle-null input each step's state update records (kernel) against the segments cut from the
    decoded tokens by stages.tail_layout_from_arrays (numpy): per A<0 response holding a tail token, its segments'
    valid counts, its segment count and its tail count."""
    from triage_monitor.offline.analysis import read_token_arrays
    from triage_monitor.offline.stages import tail_layout_from_arrays

    r, _ = run
    states = recompute_states(r)
    held = 0
    for i, s in enumerate(states.steps):
        seg_valid, resp_segs, resp_tails = states.null_inputs[i]
        lay = tail_layout_from_arrays(read_token_arrays(r.token_source(s)), states.taus[i], 8)
        keep = [x for x in np.unique(lay.response) if lay.tail[lay.response == x].sum() > 0]
        assert resp_segs.tolist() == [int((lay.response == x).sum()) for x in keep], s
        assert resp_tails.tolist() == [int(lay.tail[lay.response == x].sum()) for x in keep], s
        assert seg_valid.tolist() == [int(v) for x in keep for v in lay.valid[lay.response == x]], s
        held += len(keep)
    assert held >= 5


def test_recompute_names_the_token_file_with_a_repeated_token(run):
    """A token file of step 3 with one row written twice: recompute stops with that file's path in the message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    r, _ = run
    (f,) = r.token_files(3)
    t = pq.read_table(f)
    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), f)
    with pytest.raises(ValueError, match=rf"^{f}: a \(sample_id, position\) pair occurs twice in the token records$"):
        recompute(r, tau_tail=-1.0)


def test_a_run_stopped_while_calibrating_is_read_once_too(tmp_path, monkeypatch):
    """A run of 3 steps whose reference window is 10 steps: run.json has no τ_tail, but the live row of its last
    step holds the τ_tail of the 3 steps pooled, which is the frozen one; so the steps are decoded once (without
    that row, the τ_tail is calibrated first: the same values).  Bad what-if arguments are refused before any
    work."""
    d = tmp_path / "run"
    _write(d, MonitorConfig(window=2, calibration_steps=10, metrics={"segment_width": 8}, roll_steps=1), steps=3)
    r = open_run(d)
    assert r.tau_tail is None
    calls = _mapped_steps(monkeypatch)
    states = recompute_states(r)
    assert calls == [[0, 1, 2]] and states.taus == [r.steps()["tau_tail"].iloc[-1]] * 3
    file_of(d, "steps", 2).unlink()                               # the last live row lost: no guess, same result
    calls.clear()
    assert recompute_states(r).taus == states.taus
    assert calls == [[0, 1, 2], [0, 1, 2]]                        # calibrating first, then with its τ_tail
    calls.clear()
    assert recompute_states(r, tau_tail=-0.5).taus == [-0.5] * 3 and calls == [[0, 1, 2]]
    with pytest.raises(ValueError, match="tau_tail"):
        recompute_states(r, tau_tail=float("nan"))
    with pytest.raises(ValueError, match="calibration"):
        recompute_states(r, calibration_steps=0)


def test_step_state_merges_rank_files_sorts_unsorted_rows_and_skips_empty_files(tmp_path, monkeypatch):
    """Two ranks' token files of one step: the state holds every token (n_tokens and Σδ worked out with numpy from
    the files) and equals the live monitors' two step states merged.  Rows written in another order (reversed) are
    sorted first; a file with no row and one with a single token count as such.  Without τ_tail the state has
    no localisation (no segment, an empty C_tok table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import triage_monitor.monitor as monitor_mod
    from triage_monitor.config import MetricConfig
    from triage_monitor.metrics.stats import SUM_FIELDS

    d = tmp_path / "run"
    monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: 7)
    cfg = MetricConfig(segment_width=8)
    mons = [MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, metrics={"segment_width": 8}), rank=r,
                            attempt=7)
            for r in (0, 1)]
    batches = [_batch(0), _batch(1)]
    for m, b in zip(mons, batches):
        m.log_step(0, b)
        m.close()
    files = open_run(d).token_files(0)
    tables = [pq.read_table(f) for f in files]
    live = MismatchStats(cfg).update(batches[0], -1.0).merge(MismatchStats(cfg).update(batches[1], -1.0))
    got = step_state(files, -1.0, cfg)
    sums = dict(zip(SUM_FIELDS, got[:len(SUM_FIELDS)]))
    d32 = [(t.column("learner_logp").to_numpy() - t.column("sampler_logp").to_numpy()).astype(np.float64) for t in tables]
    assert sums["n_tokens"] == sum(t.num_rows for t in tables)
    assert sums["delta_sum"] == pytest.approx(sum(x.sum() for x in d32), rel=1e-12)
    assert np.allclose(got, live.state.numpy(), rtol=1e-12, atol=0)
    rev = tmp_path / "reversed.parquet"
    pq.write_table(tables[1].take(pa.array(np.arange(tables[1].num_rows)[::-1])), rev)
    empty = tmp_path / "empty.parquet"
    pq.write_table(tables[0].slice(0, 0), empty)
    assert np.allclose(step_state([empty, files[0], rev], -1.0, cfg), got, rtol=1e-12, atol=0)
    one = tmp_path / "one.parquet"
    pq.write_table(tables[0].slice(0, 1), one)
    assert step_state([one], -1.0, cfg)[SUM_FIELDS.index("n_tokens")] == 1
    no_tau = MismatchStats(cfg, state=torch.from_numpy(step_state(files, math.nan, cfg)))
    assert no_tau.part("c_tok_table").sum() == 0 and no_tau.sums[SUM_FIELDS.index("segments")] == 0


def test_an_empty_step_selection_gives_no_states_and_is_cached_like_any_other(run):
    """``steps=[]``: no states (a 0-row matrix of the state's width), no null inputs, no error; with ``cache`` the
    empty result is saved (one cache file) and read back the same."""
    r, _ = run
    width = MismatchStats(r.config.metrics).state.numel()
    for _ in range(2):                                   # computed and saved, then read from the cache
        st = recompute_states(r, steps=[], cache=True)
        assert st.steps == [] and st.states.shape == (0, width) and st.taus == [] and st.null_inputs == []
    assert len(list((r.path / "analysis").glob("states-*.npz"))) == 1


def test_the_engine_workers_and_address_asked_for_reach_the_map_over_the_steps(run, monkeypatch):
    """``recompute`` and ``recompute_states`` hand ``engine``, ``workers`` and ``address`` to the map over the steps
    as given (the map is computed in this process here: the spy runs it with the local engine, one worker)."""
    import triage_monitor.offline.analysis as analysis
    import triage_monitor.offline.engines as engines
    r, _ = run
    seen, real = [], engines.map_ordered
    monkeypatch.setattr(analysis, "WORKER_MIN_BYTES", 1)            # workers are not cut down on this small run
    monkeypatch.setattr(analysis, "WORKER_MIN_CORES", 1)            # nor on this machine

    def spy(fn, items, **kw):
        seen.append({k: kw[k] for k in ("engine", "workers", "address")})
        return real(fn, items, **{**kw, "engine": "local", "workers": 1, "address": None})

    monkeypatch.setattr(engines, "map_ordered", spy)
    recompute(r, workers=3)
    recompute(r, engine="ray", address="ray://head:10001")
    recompute_states(r, workers=2)
    recompute_states(r, engine="ray", address="auto")
    # each: the 2 reference steps first (local workers: in this process, the pool started once, for the others)
    assert seen == [{"engine": "local", "workers": 1, "address": None}, {"engine": "local", "workers": 3, "address": None},
                    {"engine": "ray", "workers": 1, "address": "ray://head:10001"},
                    {"engine": "ray", "workers": 1, "address": "ray://head:10001"},
                    {"engine": "local", "workers": 1, "address": None}, {"engine": "local", "workers": 2, "address": None},
                    {"engine": "ray", "workers": 1, "address": "auto"}, {"engine": "ray", "workers": 1, "address": "auto"}]


def test_workers_are_cut_to_what_the_token_records_pay_for(run, monkeypatch):
    """``planned_workers``: one worker process per WORKER_MIN_BYTES of token records to map (a block's bytes shared
    by its steps), at least 1, at most the number asked for: the bytes of the 5 one-step files worked out here; none
    (1: this process) with fewer than WORKER_MIN_CORES usable cores."""
    from triage_monitor.offline.analysis import planned_workers

    r, _ = run
    sources = [r.token_source(s) for s in r.step_numbers()]
    total = sum(p.size for src in sources for p in src.parts)
    assert planned_workers(sources, 4) == 1 and planned_workers(sources, 1) == 1 and planned_workers([], 3) == 1
    import triage_monitor.offline.analysis as analysis

    monkeypatch.setattr(analysis, "WORKER_MIN_BYTES", total // 3)
    monkeypatch.setattr(analysis, "usable_cores", lambda: 8)
    assert planned_workers(sources, 8) == 3 and planned_workers(sources, 2) == 2
    monkeypatch.setattr(analysis, "usable_cores", lambda: 2)       # one process already keeps two cores busy
    assert planned_workers(sources, 8) == 1 and planned_workers(sources, 2) == 1


def test_the_post_mortem_commands_never_import_torch(run, tmp_path):
    """`analyze`, `report` and the stage table work on numpy states and compiled passes: none of them imports
    torch (1-1.5 s of a cold command on the 2-core machine), and their values are the live monitor's."""
    import json
    import subprocess
    import sys

    r, live = run
    code = f"""
import json, sys
from triage_monitor.cli import main
for argv in (["analyze", {str(r.path)!r}, "--out", {str(tmp_path / "m.csv")!r}],
             ["report", {str(r.path)!r}, "--out", {str(tmp_path / "r.html")!r}]):
    assert main(argv) == 0, argv
from triage_monitor.analysis import open_run
from triage_monitor.stages import stage_table
t = stage_table(open_run({str(r.path)!r}), window=2, draws=19)
print(json.dumps({{"torch": "torch" in sys.modules, "c_tok": float(t["c_tok"].iloc[-1])}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False, out.stdout[-2000:]
    assert got["c_tok"] == live[-1]["window/c_tok"]
    frame = pd.read_csv(tmp_path / "m.csv")
    assert frame["window/rho_asym"].tolist() == pytest.approx([m["window/rho_asym"] for m in live], rel=1e-12,
                                                              nan_ok=True)


def test_a_row_group_shared_by_small_steps_is_decoded_once_for_all_of_them(tmp_path, monkeypatch):
    """A rank's small steps share a row group (the writer gathers them): reading the steps one by one decodes that
    row group once, not once per step, and each step's rows are what a filter of the whole file gives (columns
    asked for or all, in file order); a step read again, or read after its kept rows were dropped (a cache of 1
    byte, forget_shared_groups), is decoded again with the same rows.  A row group whose steps are not in order
    (another writer) is split by value; a file without step statistics is filtered as before."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    import triage_monitor.rundir.blocks as blocks
    from triage_monitor.rundir.blocks import BlockWriter, forget_shared_groups, read_part
    from triage_monitor.rundir.layout import RunLayout
    from triage_monitor.rundir.storage import open_store

    def step_rows(s, n):
        return pa.table({"step": np.full(n, s, np.int64), "rank": np.zeros(n, np.int64),
                         "x": np.arange(n, dtype=np.float32) * 0.5 + s, "y": np.arange(n, dtype=np.int64) - s})

    store = open_store(tmp_path)
    w = BlockWriter(store, "tokens", 0, 1, roll_steps=8)
    for s in range(8):
        w.write(s, step_rows(s, 5 + s))
    w.close()
    part = RunLayout(tmp_path).index("tokens").for_step(3)[0]
    whole = pq.read_table(tmp_path / part.name)
    assert pq.read_metadata(tmp_path / part.name).num_row_groups == 1
    decoded = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: decoded.append(list(groups)) or real(self, groups, **kw))

    def expect(s, cols=None):
        t = whole.filter(pc.equal(whole.column("step"), s))
        return t if cols is None else t.select(cols)

    for s in range(8):
        assert read_part(store, part, ["x", "y"], s).equals(expect(s, ["x", "y"]))
    assert decoded == [[0]]                                          # one decode for the 8 steps
    assert read_part(store, part, ["x", "y"], 2).equals(expect(2, ["x", "y"]))      # handed out once: again
    assert len(decoded) == 2
    forget_shared_groups()
    for s in (5, 1):
        assert read_part(store, part, None, s).equals(expect(s))     # every column
    assert len(decoded) == 3
    forget_shared_groups()
    monkeypatch.setattr(blocks, "SHARED_GROUP_BYTES", 1)              # nothing kept: decoded for each step
    decoded.clear()
    for s in range(8):
        assert read_part(store, part, ["y"], s).equals(expect(s, ["y"]))
    assert len(decoded) == 8
    forget_shared_groups()
    # steps out of order in one row group (not this project's writer), and a file without step statistics
    for name, stats in (("steps-00000000-00000002-rank-0001-attempt-1-part-0.parquet", ["step"]),
                        ("steps-00000000-00000002-rank-0002-attempt-1-part-0.parquet", False)):
        mixed = pa.table({"step": np.array([1, 0, 2, 1, 0, 2, 2], np.int64), "rank": np.ones(7, np.int64),
                          "x": np.arange(7, dtype=np.float32), "y": np.arange(7, dtype=np.int64)})
        pq.write_table(mixed, tmp_path / "tokens" / name, write_statistics=stats)
        p = next(q for q in RunLayout(tmp_path).index("tokens").for_step(1) if q.name.endswith(name))
        for s in (0, 1, 2):
            assert read_part(store, p, ["x"], s).equals(mixed.filter(pc.equal(mixed.column("step"), s)).select(["x"]))
    forget_shared_groups()


def _many_rank_run(d):
    """Four ranks of small steps, 9 steps in blocks of 6: their blocks' row groups each shared by several steps."""
    from triage_monitor.rundir.records import RunWriter

    cfg = MonitorConfig(tau_tail=-0.5, alignment_check_steps=0, roll_steps=6)
    writers = [RunWriter(str(d), 1, k, 4, cfg.to_dict(), {"framework": "test"}, {"tool_version": "t"})
               for k in range(4)]
    for s in range(9):
        for k, w in enumerate(writers):
            w.record_step(s, _batch(10 * s + k), {"step": s}, {}, None, steps_row=False)
    for w in writers:
        w.close("finished", 9)
    return open_run(d)


def test_the_states_of_a_many_rank_run_are_those_of_its_steps_read_one_by_one(tmp_path):
    """The recomputed states of a many-rank run (row groups shared by steps, each decoded once) equal step_state
    of each step read alone, bit for bit."""
    from triage_monitor.rundir.blocks import forget_shared_groups

    r = _many_rank_run(tmp_path / "r")
    one_by_one = []
    for s in r.step_numbers():
        forget_shared_groups()
        one_by_one.append(step_state(r.token_source(s), -0.5, r.metric_config()))
    assert np.array_equal(recompute_states(r).states, np.stack(one_by_one))


@pytest.mark.multiprocess
def test_worker_processes_map_contiguous_chunks_of_steps_to_the_same_states(tmp_path, monkeypatch, plain_main):
    """2 worker processes, each given contiguous chunks of the steps (a shared row group read once in a chunk):
    the states and τ_tail of one process, bit for bit."""
    import triage_monitor.offline.analysis as analysis

    r = _many_rank_run(tmp_path / "r")
    here = recompute_states(r)
    monkeypatch.setattr(analysis, "WORKER_MIN_BYTES", 1)
    monkeypatch.setattr(analysis, "WORKER_MIN_CORES", 1)
    two = recompute_states(open_run(tmp_path / "r"), workers=2)
    assert np.array_equal(two.states, here.states) and two.taus == here.taus
