"""Stage table (docs/metrics.md#stages) and the C_tok shuffle null (docs/metrics.md#localisation)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.metrics.stats import MetricConfig, MismatchStats, c_tok_from_segments
from reference_metrics import null_segment_counts, shuffle_null_c_tok
from triage_monitor.offline.stages import TailLayout, anchor_steps, format_stage_table, stage_table, tail_layout


def _layout_batch(n_resp: int, length: int, tails_per_resp: int, packed: bool, seed: int = 0) -> TokenBatch:
    """A<0 responses whose tail tokens (δ = -1 < τ = -0.5) sit uniformly at random or packed at the start."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.zeros(n_resp, length)
    for i in range(n_resp):
        idx = torch.arange(tails_per_resp) if packed else torch.randperm(length, generator=g)[:tails_per_resp]
        delta[i, idx] = -1.0
    sampler = torch.full((n_resp, length), -1.0)
    return TokenBatch.from_padded(sampler + delta, sampler, -torch.ones(n_resp), torch.ones(n_resp, length))


def test_two_segment_null_is_hypergeometric():
    # one response, 4 valid tokens in 2 segments of 2, 2 tail tokens:
    # P(first segment holds k tails) = C(2,k) C(2,2-k) / C(4,2) = 1/6, 4/6, 1/6
    lay = TailLayout(np.array([0, 0]), np.array([2, 2]), np.array([2, 0]))
    c = null_segment_counts(lay, draws=30000, seed=1)
    assert (c.sum(1) == 2).all()
    freq = np.bincount(c[:, 0], minlength=3) / len(c)
    np.testing.assert_allclose(freq, [1 / 6, 4 / 6, 1 / 6], atol=0.01)


def test_null_preserves_tail_counts_and_valid_positions():
    rng = np.random.default_rng(0)
    resp = np.repeat(np.arange(40), rng.integers(1, 7, 40))           # 1..6 segments per response
    valid = rng.integers(1, 65, resp.size)
    tail = rng.integers(0, valid + 1)
    lay = TailLayout(resp, valid, tail)
    c = null_segment_counts(lay, draws=2000, seed=3)
    assert c.shape == (2000, resp.size)
    assert (c >= 0).all() and (c <= valid).all()                      # labels only on valid positions
    per_resp = np.stack([np.bincount(resp, weights=row, minlength=40) for row in c[:50]])
    np.testing.assert_array_equal(per_resp, np.tile(np.bincount(resp, weights=tail, minlength=40), (50, 1)))
    # uniform placement: E[count_ij] = t_i * n_ij / n_i
    t_i = np.bincount(resp, weights=tail)[resp]
    n_i = np.bincount(resp, weights=valid)[resp]
    np.testing.assert_allclose(c.mean(0), t_i * valid / n_i, atol=0.35)
    # fixed seed: reproducible; another seed: different
    np.testing.assert_array_equal(c, null_segment_counts(lay, draws=2000, seed=3))
    assert not np.array_equal(c, null_segment_counts(lay, draws=2000, seed=4))


def test_uniform_tails_give_excess_near_zero():
    batch = _layout_batch(n_resp=200, length=256, tails_per_resp=13, packed=False)
    lay = tail_layout(batch, tau_tail=-0.5, width=64)
    null = shuffle_null_c_tok(lay, draws=499, seed=0)
    excess = lay.c_tok() - np.median(null)
    assert abs(excess) < 0.01
    lo, hi = np.quantile(null, [0.025, 0.975])
    assert lo - 0.005 <= lay.c_tok() <= hi + 0.005


def test_packed_tails_give_large_excess():
    batch = _layout_batch(n_resp=200, length=256, tails_per_resp=13, packed=True)
    lay = tail_layout(batch, tau_tail=-0.5, width=64)
    # every tail sits in segment 0 of its response: the top 5 % (40 of 800 segments) hold 40 * 13 / 2600 = 20 %
    assert lay.c_tok() == pytest.approx(0.20)
    null = shuffle_null_c_tok(lay, draws=199, seed=0)
    assert lay.c_tok() - np.median(null) > 0.08
    assert lay.c_tok() > np.quantile(null, 0.975)


def test_tail_layout_matches_the_state_updates_segments():
    """The stage table's segments (triage_monitor.segments) against the state update's own count of them: the same
    (valid, tail) table of segments, the same tail tokens and C_tok."""
    g = torch.Generator().manual_seed(5)
    S, T = 12, 150
    sampler = -torch.rand(S, T, generator=g) * 2
    learner = (sampler + torch.randn(S, T, generator=g) * 0.3).clamp(max=0)
    mask = torch.rand(S, T, generator=g) > 0.2
    batch = TokenBatch.from_padded(learner, sampler, torch.randn(S, generator=g), mask)
    lay = tail_layout(batch, tau_tail=-0.2, width=16)
    st = MismatchStats(MetricConfig(segment_width=16)).update(batch, -0.2)
    table = np.bincount(lay.valid * 17 + lay.tail, minlength=17 ** 2)
    np.testing.assert_array_equal(table, st.part("c_tok_table").numpy())
    assert lay.c_tok() == st.compute().values["c_tok"] == c_tok_from_segments(torch.as_tensor(lay.tail),
                                                                             torch.as_tensor(lay.valid))
    assert int(lay.tail.sum()) == st.sum("tail_tokens") and lay.num_segments == st.sum("segments")


def test_shuffle_null_without_tails_is_nan():
    lay = TailLayout(np.array([0, 1]), np.array([3, 3]), np.array([0, 0]))
    assert np.isnan(shuffle_null_c_tok(lay, draws=5)).all()


def test_anchor_steps():
    assert anchor_steps(range(100)) == [24, 49, 74, 99]
    assert anchor_steps([3, 5, 9]) == [3, 5, 9, 9]          # ceil(0.25*3)=1, ceil(1.5)=2, ceil(2.25)=3, 3
    assert anchor_steps([7], (0.5,)) == [7]
    with pytest.raises(ValueError, match="no recorded steps"):
        anchor_steps([])
    with pytest.raises(ValueError, match="fraction"):
        anchor_steps([1, 2], (0.0,))


def test_stage_table_on_demo_run(demo_run_dir):
    """Agreement test: stage rows vs ``recompute`` windows and the live step table, all from
    ``MismatchStats`` states; independent check: test_stage_row_equals_an_independent_computation_from_the_records."""
    run = open_run(demo_run_dir)
    live = run.steps().set_index("step")
    t = stage_table(run, draws=99)
    assert list(t["stage"]) == ["25%", "50%", "75%", "100%"]
    assert list(t["step"]) == anchor_steps(run.step_numbers())
    window = run.config.window
    from triage_monitor.offline.analysis import recompute
    frozen = recompute(run).set_index("step")                   # one tau_tail for every step
    assert frozen["tau_tail"].nunique() == 1 and t["tau_frozen"].all()
    prov = set(live.index[live["tau_tail_frozen"] == 0])
    for _, row in t.iterrows():
        a = row["step"]
        assert row["first_step"] == max(a - window + 1, 0) and row["steps"] == a - row["first_step"] + 1
        live_frozen = not any(a - window < p <= a for p in prov)
        for name in ("rho_asym", "rho_asym_lennorm", "r_amp", "h_seg", "dilution", "small_gap_share", "delta_q05",
                     "c_tok", "tau_tail"):
            for ref_frame, must in ((frozen, True), (live, live_frozen or name not in ("r_amp", "h_seg", "dilution",
                                                                                        "c_tok", "tau_tail"))):
                ref = ref_frame.at[a, f"window/{name}"]
                if must:
                    assert (math.isnan(row[name]) and math.isnan(ref)) or row[name] == pytest.approx(ref, rel=1e-12)
        assert row["c_tok_null_lo"] <= row["c_tok_null_median"] <= row["c_tok_null_hi"]
        assert row["c_tok_excess"] == pytest.approx(row["c_tok"] - row["c_tok_null_median"])
    # the first stage's window holds the live provisional steps: it reads the frozen tau_tail, not theirs
    assert t["step"].iloc[0] - window < min(prov) and t["tau_tail"].iloc[0] == live["tau_tail"].iloc[-1]
    # user anchors and another window (recomputed)
    t2 = stage_table(run, anchors=[4, 20], window=3, draws=19)
    assert list(t2["stage"]) == ["step 4", "step 20"] and list(t2["first_step"]) == [2, 18]
    from triage_monitor.offline.analysis import recompute
    rec = recompute(run, window=3).set_index("step")
    assert t2["c_tok"].tolist() == pytest.approx(rec.loc[[4, 20], "window/c_tok"].tolist(), rel=1e-12)
    assert t2["rho_asym"].tolist() == pytest.approx(rec.loc[[4, 20], "window/rho_asym"].tolist(), rel=1e-12)
    with pytest.raises(ValueError, match=r"anchor step\(s\) \[999\] not recorded"):
        stage_table(run, anchors=[999])
    shown = format_stage_table(t)
    assert "C_tok %" in shown.columns and shown["C_tok %"].iloc[0] == pytest.approx(100 * t["c_tok"].iloc[0])


def test_null_ranking_equals_c_tok_from_segments_per_draw():
    """Agreement test: the vectorised null ranking vs ``metrics.c_tok_from_segments`` (both product code);
    independent checks: test_two_segment_null_is_hypergeometric (by hand) and tests/test_constants_metrics.py."""
    # the vectorised O(K) ranking of shuffle_null_c_tok equals metrics.c_tok_from_segments applied to each draw
    rng = np.random.default_rng(7)
    resp = np.repeat(np.arange(300), rng.integers(1, 5, 300))
    valid = rng.integers(1, 9, resp.size)                             # small segments: many exact ties
    tail = rng.binomial(valid, 0.15)
    tail[resp < 60] = 0                                               # responses without tails still count in K
    lay = TailLayout(resp, valid, tail)
    keep = np.bincount(resp, weights=tail)[resp] > 0
    counts = null_segment_counts(TailLayout(resp[keep], valid[keep], tail[keep]), draws=40, seed=2)
    null = shuffle_null_c_tok(lay, draws=40, seed=2)
    for d in range(40):
        full = np.zeros(resp.size, dtype=np.int64)
        full[keep] = counts[d]
        ref = c_tok_from_segments(torch.as_tensor(full), torch.as_tensor(valid))
        assert null[d] == pytest.approx(ref, abs=1e-15)


def test_tail_layout_from_tokens_equals_batch_path(demo_run_dir):
    """Agreement test: token-table path vs TokenBatch path of ``tail_layout``; independent check:
    test_tail_layout_matches_metrics_segments and the hand-worked null tests above."""
    from triage_monitor.offline.stages import tail_layout_from_tokens

    run = open_run(demo_run_dir)
    for step in (0, 12, 29):
        a = tail_layout(run.token_batch(step), -0.05, 4)
        b = tail_layout_from_tokens(run.tokens(step), -0.05, 4)
        for f in ("response", "valid", "tail", "number"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_null_from_state_hand_worked_distribution():
    """Three A<0 responses, W = 4: r0 has segments of 2 and 2 valid tokens and 2 tail tokens, r1 segments of 4 and
    1 and 1 tail token, r2 one segment of 3 and no tail; top = ceil(0.3 · 5) = 2 segments, 3 tail tokens.
    r0's two tails share a segment with probability 2/6 (cell (2,2), fraction 1): the top two then hold all 3
    tails whatever r1 does (C_tok = 1).  Otherwise r0 gives two (2,1) cells (fraction 1/2): with r1's tail in its
    1-token segment (fraction 1) the top two are (1,1) and one (2,1), else the two (2,1): C_tok = 2/3.
    So P(C_tok = 1) = 1/3, P(2/3) = 2/3 -- for the new sampler and the token-shuffle one alike (4 σ)."""
    from triage_monitor.offline.stages import NullInput, shuffle_null_from_state

    resp, valid, tail = np.array([0, 0, 1, 1, 2]), np.array([2, 2, 4, 1, 3]), np.array([2, 0, 1, 0, 0])
    table = np.zeros(25)
    np.add.at(table, valid * 5 + tail, 1)
    null_input = NullInput(np.array([2, 2, 4, 1], np.int32), np.array([2, 2], np.int32), np.array([2, 1], np.int32))
    n = 6000
    new = shuffle_null_from_state(null_input, table, 4, draws=n, seed=3, top_fraction=0.3)
    old = shuffle_null_c_tok(TailLayout(resp, valid, tail), draws=n, seed=3, top_fraction=0.3)
    sigma = math.sqrt(1 / 3 * 2 / 3 / n)
    for draws in (new, old):
        assert set(np.round(draws, 12)) <= {round(2 / 3, 12), 1.0}
        assert abs(np.mean(draws == 1.0) - 1 / 3) < 4 * sigma
    # reproducible for a seed, different for another
    again = shuffle_null_from_state(null_input, table, 4, draws=n, seed=3, top_fraction=0.3)
    assert np.array_equal(new, again)
    assert not np.array_equal(new, shuffle_null_from_state(null_input, table, 4, draws=n, seed=4, top_fraction=0.3))


def test_null_from_state_width_not_a_power_of_two():
    """W = 3, one A<0 response of 4 valid tokens in segments of 3 and 1, with 2 tail tokens; top = ceil(0.5 · 2)
    = 1 segment.  Of the C(4,2) = 6 placements, 3 put both tails in the first segment (cell (3,2), fraction 2/3:
    the top segment holds both tails, C_tok = 1) and 3 put one in each (the top segment is (1,1), fraction 1:
    C_tok = 1/2).  So P(C_tok = 1) = 1/2 (4 σ), for the sampler and the token shuffle alike."""
    from triage_monitor.offline.stages import NullInput, shuffle_null_from_state

    table = np.zeros(16)
    np.add.at(table, np.array([3, 1]) * 4 + np.array([2, 0]), 1)
    null_input = NullInput(np.array([3, 1], np.int32), np.array([2], np.int32), np.array([2], np.int32))
    n = 4000
    new = shuffle_null_from_state(null_input, table, 3, draws=n, seed=5, top_fraction=0.5)
    old = shuffle_null_c_tok(TailLayout(np.array([0, 0]), np.array([3, 1]), np.array([2, 0])), draws=n, seed=5,
                             top_fraction=0.5)
    for draws in (new, old):
        assert set(np.round(draws, 12)) == {0.5, 1.0}
        assert abs(np.mean(draws == 1.0) - 0.5) < 4 * math.sqrt(0.25 / n)


def test_null_from_states_equals_token_shuffle_in_distribution(demo_run_dir):
    """On a real run, the stage window's null drawn from the recorded states equals the token-shuffle null of
    the window's token records in distribution: two-sample Kolmogorov-Smirnov statistic below its 0.1 %
    critical value (1.95 · sqrt(2/n)), and their medians within 3 Monte-Carlo standard errors."""
    from triage_monitor.offline.analysis import read_token_arrays, recompute_states
    from triage_monitor.offline.stages import NullInput, shuffle_null_from_state, tail_layout_from_arrays

    run = open_run(demo_run_dir)
    states = recompute_states(run)
    cfg = run.config.metrics
    win = states.steps[-10:]
    tau = states.taus[-1]
    layout = TailLayout.concat([tail_layout_from_arrays(read_token_arrays(run.token_source(s)), tau,
                                                        cfg.segment_width) for s in win])
    idx = [states.steps.index(s) for s in win]
    null_input = NullInput.concat([NullInput(*states.null_inputs[i]) for i in idx])
    # the recorded input is the token layout's tail-holding responses, segment for segment
    keep = np.bincount(layout.response, weights=layout.tail)[layout.response] > 0
    np.testing.assert_array_equal(null_input.segment_valid, layout.valid[keep])
    assert null_input.response_tails.sum() == layout.tail.sum()
    table = states.window_stats(win[-1], 10).part("c_tok_table").numpy()
    n = 1000
    new = shuffle_null_from_state(null_input, table, cfg.segment_width, draws=n, seed=1, top_fraction=cfg.top_fraction)
    old = shuffle_null_c_tok(layout, draws=n, seed=1, top_fraction=cfg.top_fraction)
    grid = np.union1d(new, old)
    ks = np.max(np.abs(np.searchsorted(np.sort(new), grid, side="right") / n
                       - np.searchsorted(np.sort(old), grid, side="right") / n))
    assert ks < 1.95 * math.sqrt(2 / n)
    assert abs(np.median(new) - np.median(old)) < 3 * 1.253 * np.std(old) / math.sqrt(n) * math.sqrt(2) + 1e-12


def test_stage_row_equals_an_independent_computation_from_the_records(demo_run_dir):
    """Independent check of the stage table: each anchor's window metrics recomputed from the token records of the
    window's steps by tests/reference_metrics.py (plain loops, no product code), with the row's frozen τ_tail and
    the run's segment width."""
    from reference_metrics import reference_metrics, responses_from_tokens

    run = open_run(demo_run_dir)
    t = stage_table(run, draws=19)
    width = run.config.metrics.segment_width
    for _, row in t.iterrows():
        resp = [r for s in range(int(row["first_step"]), int(row["step"]) + 1)
                for r in responses_from_tokens(run.tokens(s))]
        ref = reference_metrics(resp, float(row["tau_tail"]), width=width)
        for k in ("rho_asym", "small_gap_share", "r_amp", "h_seg", "c_tok", "dilution"):
            assert (math.isnan(row[k]) and math.isnan(ref[k])) or row[k] == pytest.approx(ref[k], rel=1e-9), (row["step"], k)


def test_a_windows_null_is_drawn_once_and_kept_in_the_run(demo_run_dir, tmp_path):
    """The C_tok null of each stage window is kept in ``analysis/null-<key>.npy``: a second stage table reads it
    back (a planted value comes back: it is read, not drawn again), and another seed draws and keeps anew."""
    import shutil

    import numpy as np

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.offline.stages import stage_table

    d = shutil.copytree(demo_run_dir, tmp_path / "run")
    for f in (d / "analysis").glob("null-*.npy"):                    # nulls other tests' reads of the shared run kept
        f.unlink()
    first = stage_table(open_run(d), draws=49)
    kept = sorted((d / "analysis").glob("null-*.npy"))
    assert len(kept) == len(first) and all(np.load(f).shape == (49,) for f in kept)
    again = stage_table(open_run(d), draws=49)
    assert again.equals(first)
    for f in kept:
        np.save(f, np.full(49, 0.5))                                   # a planted null
    planted = stage_table(open_run(d), draws=49)
    assert (planted["c_tok_null_median"] == 0.5).all()
    stage_table(open_run(d), draws=49, seed=1)
    assert len(list((d / "analysis").glob("null-*.npy"))) == 2 * len(first)


def test_a_window_without_recorded_null_inputs_draws_the_same_null_from_its_tokens(demo_run_dir, tmp_path):
    """The stage table's one null path: states computed without shuffle-null inputs (``null_inputs`` None) make
    each window recompute them from its token records with the window's τ_tail, which are the inputs the states
    would have recorded — so the table (the null's median and interval included) equals the recorded path's."""
    import shutil

    from triage_monitor.offline.analysis import recompute_states

    d = shutil.copytree(demo_run_dir, tmp_path / "run")
    run = open_run(d)
    states = recompute_states(run)
    recorded = stage_table(run, window=10, draws=199, seed=3, states=states)
    states.null_inputs = None
    shutil.rmtree(d / "analysis", ignore_errors=True)           # no cached null: draw it again
    from_tokens = stage_table(open_run(d), window=10, draws=199, seed=3, states=states)
    assert recorded["c_tok_null_median"].notna().any()
    pd.testing.assert_frame_equal(recorded, from_tokens, check_exact=True)
