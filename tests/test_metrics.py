"""Metrics of docs/metrics.md#steps-and-windows on hand-built batches; expected values worked out by hand in the comments."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.metrics.stats import (MetricConfig, MetricTracker, MismatchStats, c_tok_from_segments, c_tok_from_table,
                                    compute_step_metrics)
from triage_monitor.metrics.sketch import quantile_error_bound

SAMPLER = -1.0


def _list_batch(deltas, advs, masks=None, sampler=SAMPLER, **kw):
    """Responses given as lists of δ (nats) with sampler_logp = ``sampler``."""
    s = [torch.full((len(d),), sampler) for d in deltas]
    lp = [torch.tensor(d, dtype=torch.float32) + sampler for d in deltas]
    m = None if masks is None else [torch.tensor(x, dtype=torch.bool) for x in masks]
    return TokenBatch.from_list(lp, s, torch.tensor(advs, dtype=torch.float32), m, **kw)


# ---------------------------------------------------------------- magnitude + direction
@pytest.fixture
def quadrant_batch():
    # s0: A=+1, δ=[.2,-.1,0,.03]   -> amp_pos {.2,.03} (mass 2), con_pos {-.1} (mass 1), δ=0 in no region
    # s1: A=-2, δ=[-.5,.1,-.01]    -> amp_neg {-.5,-.01} (mass 4), con_neg {.1} (mass 2)
    # s2: A=0,  δ=[-3]             -> no region (A = 0)
    # s3: A=-1, δ=[-.2, (masked -9), .04] -> amp_neg {-.2} (mass 1), con_neg {.04} (mass 1)
    return _list_batch([[.2, -.1, 0., .03], [-.5, .1, -.01], [-3.], [-.2, -9., .04]], [1., -2., 0., -1.],
                       masks=[[1, 1, 1, 1], [1, 1, 1], [1], [1, 0, 1]])


def test_quadrant_masses_and_rho(quadrant_batch):
    v = compute_step_metrics(quadrant_batch).values
    assert v["n_tokens"] == 10 and v["n_samples"] == 4
    assert (v["mass_amp_neg"], v["mass_amp_pos"], v["mass_con_neg"], v["mass_con_pos"]) == (5, 2, 3, 1)
    assert (v["count_amp_neg"], v["count_amp_pos"], v["count_con_neg"], v["count_con_pos"]) == (3, 2, 2, 1)
    assert v["rho_asym"] == pytest.approx(5 / 2)
    # |A|/n_i weights: n = (4, 3, 1, 2). amp_neg: 2·(2/3) + 1·(1/2) = 11/6; amp_pos: 2·(1/4) = 1/2
    assert v["rho_asym_lennorm"] == pytest.approx((11 / 6) / (1 / 2))
    # total |A| mass 4 + 6 + 0 + 2 = 12
    assert v["amp_share"] == pytest.approx(7 / 12)


def test_magnitude_metrics_against_numpy(quadrant_batch):
    v = compute_step_metrics(quadrant_batch).values
    d = quadrant_batch.delta.double().numpy()          # the float32 δ the monitor records
    assert v["small_gap_share"] == pytest.approx(4 / 10)  # 0, .03, -.01, .04
    assert v["delta_mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert v["delta_abs_mean"] == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert v["delta_min"] == pytest.approx(-3.0)
    for name, q in (("delta_q01", .01), ("delta_q05", .05), ("delta_q50", .5)):
        # quantiles come from the sketch: within its stated bound of numpy's exact value
        assert abs(v[name] - np.quantile(d, q)) <= quantile_error_bound(np.sort(d), q)
    assert v["k3_kl"] == pytest.approx(np.mean(np.exp(d) - d - 1), rel=1e-12)
    assert v["chi2_token"] == pytest.approx(np.mean(np.exp(d) ** 2) - 1, rel=1e-12)
    # verl's sign: mean over responses of (mean sampler log-prob − mean learner log-prob) = −mean of per-response mean δ
    resp = [np.mean(d[0:4]), np.mean(d[4:7]), d[7], np.mean(d[8:10])]
    assert v["log_ppl_diff"] == pytest.approx(-np.mean(resp), rel=1e-12)


def test_empty_region_is_nan_with_reason():
    # every A>0 token has δ<0: no amp_pos mass
    res = compute_step_metrics(_list_batch([[-.3, -.2], [-.1]], [1., -1.]))
    assert math.isnan(res.values["rho_asym"]) and "mass_amp_pos" in res.nan_reasons["rho_asym"]
    assert math.isnan(res.values["rho_asym_lennorm"])
    assert res.values["mass_amp_neg"] == 1.0
    assert not any(math.isinf(x) for x in res.values.values() if isinstance(x, float))


def test_k3_unclamped_chi2_clamped():
    # δ = −50: k3 = e^−50 + 50 − 1 (no clamp, as verl); chi2 clamps r to −20 before exp (verl's SAFETY_BOUND)
    res = compute_step_metrics(_list_batch([[-50.0]], [1.], sampler=-60.0)).values
    assert res["k3_kl"] == pytest.approx(math.exp(-50) + 50 - 1)
    assert res["chi2_token"] == pytest.approx(math.exp(-40) - 1)


@pytest.mark.framework
def test_k3_log_ppl_diff_chi2_equal_verls_own_offpolicy_metrics():
    """Same tensors through verl 0.9.1's ``compute_offpolicy_metrics`` (rollout_corr/*): k3_kl (beyond |δ| > 20,
    where a clamp would differ), log_ppl_diff (sign) and chi2_token agree."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    g = torch.Generator().manual_seed(3)
    sampler = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3 - 0.01
    delta = torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.5
    delta[0, 2], delta[1, 4] = -42.75, 25.0                                # the collapse regime
    sampler[1, 4] = -30.0                                                  # so that learner = −5 stays ≤ 0
    learner = (sampler + delta).clamp(max=-1e-6)
    mask = torch.ones(3, 6)
    mask[2, 4:] = 0
    theirs = helper.compute_offpolicy_metrics(learner, sampler, mask)
    ours = compute_step_metrics(TokenBatch.from_padded(learner.float(), sampler.float(), torch.ones(3), mask)).values
    theirs32 = helper.compute_offpolicy_metrics(learner.float().double(), sampler.float().double(), mask)
    assert ours["k3_kl"] == pytest.approx(theirs32["k3_kl"], rel=1e-6)
    assert ours["log_ppl_diff"] == pytest.approx(theirs32["log_ppl_diff"], rel=1e-6)
    assert ours["chi2_token"] == pytest.approx(theirs32["chi2_token"], rel=1e-6)
    assert theirs["k3_kl"] > 1e9 and ours["k3_kl"] > 1e9    # e^25 / 17 tokens: a ±20 clamp would give ~3e7



@pytest.mark.framework
def test_log_ppl_diff_differs_from_verls_where_a_response_has_no_valid_token():
    """docs/metrics.md#framework-metrics-of-the-same-name: verl averages log_ppl_diff over every response, one with no
    valid token counting as 0; ours leaves it out.  Two rows, row 1 empty: row 0's per-response value is
    mean(sampler − learner) = mean(−0.5 − (−1.0)) = 0.5, so ours 0.5, verl's (0.5 + 0) / 2 = 0.25."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    learner = torch.full((2, 3), -1.0, dtype=torch.float64)
    sampler = torch.full((2, 3), -0.5, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    theirs = helper.compute_offpolicy_metrics(learner, sampler, mask)
    ours = compute_step_metrics(TokenBatch.from_padded(learner.float(), sampler.float(), torch.ones(2), mask)).values
    assert ours["log_ppl_diff"] == pytest.approx(0.5)
    assert float(theirs["log_ppl_diff"]) == pytest.approx(0.25)


# ---------------------------------------------------------------- localisation
W = 4
TAU = -1.0


@pytest.fixture
def seg_batch():
    """W = 4, τ = −1.  A<0 responses s0, s2, s3; s1 (A>0) and s4 (A=0) are excluded from segments.

    s0 (A=-1, positions 0..9, position 5 masked): δ = +2 at 0,1; −2 (tail) at 6,7; 0 elsewhere.
        k0 = {0,1,2,3}: 0/4; k1 = {4,6,7}: 2/3 heavy; k2 = {8,9} (short): 0/2.   mean δ = 0 → diluted
    s1 (A=+1): δ = −5 everywhere (not tail: A > 0).
    s2 (A=-2, positions 0..7): tails (δ = −2) at 0 and 4 → k0 1/4 heavy, k1 1/4 heavy.   mean −0.5
    s3 (A=-1, positions 0..11, 4..7 masked): tail (δ = −1.5) at 8 → k0 0/4, k1 absent, k2 1/4 heavy (no predecessor).
        mean −1.5/8
    s4 (A=0): δ = −3.
    """
    return _list_batch(*_seg_lists(), sampler=-3.0)


def _seg_lists():
    """seg_batch's (δ lists, advantages, masks)."""
    s0 = [0.] * 10
    s0[0] = s0[1] = 2.
    s0[6] = s0[7] = -2.
    m0 = [1] * 10
    m0[5] = 0
    s2 = [0.] * 8
    s2[0] = s2[4] = -2.
    s3 = [0.] * 12
    s3[8] = -1.5
    m3 = [1] * 4 + [0] * 4 + [1] * 4
    return [s0, [-5.] * 3, s2, s3, [-3., -3.]], [-1., 1., -2., -1., 0.], [m0, [1] * 3, [1] * 8, m3, [1, 1]]


def test_segment_metrics_by_hand(seg_batch):
    res = compute_step_metrics(seg_batch, TAU, MetricConfig(segment_width=W))
    v = res.values
    assert v["r_amp"] == pytest.approx(5 / 25)      # 5 tail tokens / (9 + 8 + 8) valid tokens of A<0 responses
    assert v["h_seg"] == pytest.approx(4 / 7)       # heavy: s0k1, s2k0, s2k1, s3k2 of 7 segments
    assert v["c_tok"] == pytest.approx(2 / 5)       # top ceil(.05·7)=1 segment is s0k1 (2/3) holding 2 of 5 tails
    # with a predecessor: s0k1 (prev s0k0, not heavy), s0k2 (prev s0k1 heavy), s2k1 (prev s2k0 heavy)
    # P(heavy | prev heavy) = 1/2 ; P(heavy | has prev) = 2/3
    assert v["p_adj"] == pytest.approx((1 / 2) / (2 / 3))
    assert v["dilution"] == pytest.approx(1 / 3)    # s0 of {s0, s2, s3} has |mean δ| < 0.05
    assert v["tau_tail"] == TAU


def test_segment_metrics_nan_without_tau(seg_batch):
    res = compute_step_metrics(seg_batch, math.nan, MetricConfig(segment_width=W))
    assert math.isnan(res.values["c_tok"]) and "tau_tail" in res.nan_reasons["c_tok"]


def test_c_tok_ranking_ties_are_order_independent():
    # fractions: .5 (1/2), .5 (2/4), .25, 0 ... : ceil(.05·4) = 1 segment; the tie at .5 goes to the larger count
    tail = torch.tensor([1, 2, 1, 0])
    valid = torch.tensor([2, 4, 4, 4])
    assert c_tok_from_segments(tail, valid) == pytest.approx(2 / 4)
    perm = torch.tensor([3, 2, 0, 1])
    assert c_tok_from_segments(tail[perm], valid[perm]) == pytest.approx(2 / 4)
    assert math.isnan(c_tok_from_segments(torch.zeros(3, dtype=torch.long), valid[:3]))


def test_c_tok_uniform_vs_concentrated():
    # 100 segments of 64 tokens, 100 tail tokens: spread one per segment → top 5 hold 5 % ; packed → 100 %
    valid = torch.full((100,), 64)
    spread = torch.ones(100, dtype=torch.long)
    packed = torch.zeros(100, dtype=torch.long)
    packed[:5] = 20
    assert c_tok_from_segments(spread, valid) == pytest.approx(0.05)
    assert c_tok_from_segments(packed, valid) == pytest.approx(1.0)


# ---------------------------------------------------------------- layouts, windows, calibration
def _random_padded(seed, B=6, T=150):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2 - (torch.rand(B, T, generator=g) < .05) * 2).clamp(max=0)
    m = torch.rand(B, T, generator=g) < .85
    m[:, 120:] = False                      # right padding
    a = torch.randn(B, generator=g)
    return lp, s, a, m


def test_three_constructors_give_identical_metrics():
    """Agreement test: padded / packed / list constructors, all through ``MismatchStats``; independent
    checks: the hand-worked batches of tests/test_batch.py and the loop of tests/reference_metrics.py
    (tests/test_constants_metrics.py)."""
    lp, s, a, m = _random_padded(0)
    B, T = lp.shape
    ids = torch.tensor([11, 3, 7, 0, 25, 4])
    padded = TokenBatch.from_padded(lp, s, a, m, sample_ids=ids)
    packed = TokenBatch.from_packed(lp.reshape(-1), s.reshape(-1), a, torch.arange(B + 1) * T, m.reshape(-1),
                                    sample_ids=ids)
    lists = TokenBatch.from_list(list(lp), list(s), a, list(m), sample_ids=ids)
    cfg = MetricConfig(segment_width=16)
    ref = compute_step_metrics(padded, -0.5, cfg).values
    for other in (packed, lists):
        got = compute_step_metrics(other, -0.5, cfg).values
        for k, x in ref.items():
            assert got[k] == pytest.approx(x, rel=0, abs=0, nan_ok=True), k


def test_window_pools_sums_not_ratios():
    cfg = MetricConfig(segment_width=16)
    b1 = TokenBatch.from_padded(*_random_padded(1))
    b2 = TokenBatch.from_padded(*_random_padded(2), sample_ids=torch.arange(6) + 100)
    pooled = MismatchStats(cfg).update(b1, -0.5).merge(MismatchStats(cfg).update(b2, -0.5)).compute().values
    # independent: one batch holding both steps' responses
    lp1, s1, a1, m1 = _random_padded(1)
    lp2, s2, a2, m2 = _random_padded(2)
    both = TokenBatch.from_padded(torch.cat([lp1, lp2]), torch.cat([s1, s2]), torch.cat([a1, a2]), torch.cat([m1, m2]))
    direct = compute_step_metrics(both, -0.5, cfg).values
    for k, x in direct.items():
        assert pooled[k] == pytest.approx(x, rel=1e-12, nan_ok=True), k
    r1 = compute_step_metrics(b1).values["rho_asym"]
    r2 = compute_step_metrics(b2).values["rho_asym"]
    assert pooled["rho_asym"] != pytest.approx((r1 + r2) / 2)


def test_tracker_calibrates_tau_then_freezes_and_windows_trail():
    tr = MetricTracker(MetricConfig(segment_width=16), window=2, calibration_steps=2)
    batches = [TokenBatch.from_padded(*_random_padded(i)) for i in range(4)]
    taus = []
    for step, b in enumerate(batches):
        s, w = tr.step(step, b)
        taus.append(s.values["tau_tail"])
        if step == 3:
            # window of 2 = steps 2 and 3 pooled
            expect = MismatchStats(tr.config).update(batches[2], taus[2]).merge(
                MismatchStats(tr.config).update(batches[3], taus[3])).compute().values
            assert w.values["rho_asym"] == pytest.approx(expect["rho_asym"], rel=1e-12)
    d0 = batches[0].delta.double().numpy()
    d01 = np.concatenate([d0, batches[1].delta.double().numpy()])
    assert abs(taus[0] - np.quantile(d0, .05)) <= quantile_error_bound(np.sort(d0), .05)      # provisional
    assert abs(taus[1] - np.quantile(d01, .05)) <= quantile_error_bound(np.sort(d01), .05)   # reference complete
    assert taus[2] == taus[3] == taus[1]                                   # frozen
    assert tr.tau_frozen


def test_repeated_step_replaces_its_calibration_data():
    """A step logged twice (e.g. per micro-batch) counts once in the τ_tail reference window."""
    b = [TokenBatch.from_padded(*_random_padded(i)) for i in range(4)]
    once, twice = MetricTracker(calibration_steps=2), MetricTracker(calibration_steps=2)
    for step, batch in enumerate(b[:3]):
        once.step(step, batch)
    twice.step(0, b[3])          # replaced by the next call of step 0
    for step, batch in enumerate(b[:3]):
        twice.step(step, batch)
    assert twice.tau_tail == once.tau_tail and twice.tau_frozen and once.tau_frozen
    d01 = np.concatenate([b[0].delta.double().numpy(), b[1].delta.double().numpy()])
    assert abs(once.tau_tail - np.quantile(d01, .05)) <= quantile_error_bound(np.sort(d01), .05)


def test_n_samples_counts_responses_with_tokens():
    res = compute_step_metrics(_list_batch([[-.1, .2], [-.3]], [1., -1.], masks=[[1, 1], [0]])).values
    assert res["n_samples"] == 1 and res["n_tokens"] == 2


def test_tracker_given_tau_and_repeated_step_replaces():
    with pytest.raises(ValueError, match="tau_tail must be a finite"):
        MetricTracker(tau_tail=float("nan"))      # would silently leave every localisation metric NaN
    tr = MetricTracker(window=3, tau_tail=-0.7)
    b = [TokenBatch.from_padded(*_random_padded(i)) for i in range(3)]
    tr.step(0, b[0])
    tr.step(1, b[1])
    _, w = tr.step(1, b[2])               # resumed job repeats step 1
    expect = MismatchStats().update(b[0], -0.7).merge(MismatchStats().update(b[2], -0.7)).compute().values
    assert w.values["n_tokens"] == expect["n_tokens"]
    assert w.values["rho_asym"] == pytest.approx(expect["rho_asym"], rel=1e-12)


def test_metric_config_validation():
    with pytest.raises(ValueError, match="segment_width"):
        MetricConfig(segment_width=0)
    with pytest.raises(ValueError, match="segment_width must be an integer"):
        MetricConfig(segment_width=32.5)
    with pytest.raises(ValueError, match="tail_quantile"):
        MetricConfig(tail_quantile=1.5)


# ---------------------------------------------------------------- pure functions, by hand
def test_tokens_with_a_zero_advantage_or_gap_are_in_no_region():
    """One token of each region (A, δ) = (−, −), (+, +), (−, +), (+, −) and four with A = 0 or δ = 0: each region
    counts one token of mass |A|, the other four are in none (docs/metrics.md#regions)."""
    delta = torch.tensor([-1.0, 1.0, 1.0, -1.0, 0.0, 0.0, -1.0, 1.0])
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 0.0, 0.0])
    b = TokenBatch.from_flat(delta - 2.0, torch.full((8,), -2.0), adv, torch.arange(8), torch.zeros(8, dtype=torch.long))
    st = MismatchStats().update(b)
    assert [st.sum(f"count_{r}") for r in ("amp_neg", "amp_pos", "con_neg", "con_pos")] == [1, 1, 1, 1]
    assert [st.sum(f"mass_{r}") for r in ("amp_neg", "amp_pos", "con_neg", "con_pos")] == [1, 1, 1, 1]
    assert st.sum("n_tokens") == 8 and st.sum("abs_adv_sum") == 6


def test_c_tok_single_segment_and_fraction_not_product():
    """One segment holding every tail token: C_tok = 1.  Two segments, top ceil(0.05·2) = 1: the one with the higher
    tail *fraction* (2 of 4 = 0.5) is taken over the one with more tail tokens (3 of 64): C_tok = 2 / 5."""
    assert c_tok_from_segments(torch.tensor([3]), torch.tensor([10])) == 1.0
    assert c_tok_from_segments(torch.tensor([3, 2]), torch.tensor([64, 4])) == pytest.approx(2 / 5)


def test_c_tok_equal_fractions_rank_by_tail_count_among_many_segments():
    """200 segments, all at tail fraction 1/2: 100 of (1 tail / 2 valid) and 100 of (32 / 64), interleaved.  The top
    ceil(0.05·200) = 10 are ten (32 / 64) segments: C_tok = 320 / (100 + 3200), in any input order."""
    tail = torch.tensor([1, 32] * 100)
    valid = torch.tensor([2, 64] * 100)
    assert c_tok_from_segments(tail, valid) == pytest.approx(320 / 3300)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    assert c_tok_from_segments(tail[perm], valid[perm]) == pytest.approx(320 / 3300)


def test_merge_reports_the_last_set_tau():
    """A merge takes the other accumulator's τ_tail when it has one and keeps its own when the other has none."""
    b = _list_batch([[-0.2, 0.1]], [1.0])
    out = MismatchStats().update(b).merge(MismatchStats().update(b, -0.5))
    assert out.tau_tail == -0.5
    assert out.merge(MismatchStats().update(b)).tau_tail == -0.5
    assert out.compute().values["n_tokens"] == 6            # 2 tokens, merged three times


# ---------------------------------------------------------------- tracker state while calibrating
def _delta_batch(values):
    return _list_batch([list(values)], [1.0], sampler=-20.0)


def _within_sketch(x, pool, q=0.05):
    pool = np.asarray(pool, dtype=np.float64)
    return abs(x - np.quantile(pool, q)) <= quantile_error_bound(np.sort(pool), q)


def test_tracker_state_dict_while_calibrating_and_after_freezing():
    """calibration_steps = 3: after steps 0 and 1 the state holds their two δ sketches and step numbers, and names the
    configuration; a resumed tracker that sees step 1 again (replacing it) and step 2 freezes at step 3 on the δ of
    steps 0, 1 (second version) and 2 — the same τ_tail as a tracker that never stopped.  Once frozen the state holds
    no calibration data."""
    cfg = MetricConfig(segment_width=16)
    d = {0: np.linspace(-1, 0, 50), 1: np.linspace(-9, -8, 50), "1b": np.linspace(-0.5, 0, 50),
         2: np.linspace(-0.3, 0, 50), 3: np.zeros(5)}
    tr = MetricTracker(cfg, window=4, calibration_steps=3)
    tr.step(0, _delta_batch(d[0]))
    tr.step(1, _delta_batch(d[1]))
    sd = tr.state_dict()
    assert sd["calib_steps"] == [0, 1] and len(sd["calib"]) == 2 and sd["calib_format"] == "sketch"
    assert sd["config"] == dataclasses.asdict(cfg) and sd["window"] == 4 and sd["calibration_steps"] == 3
    resumed = MetricTracker(cfg, window=4, calibration_steps=3)
    resumed.load_state_dict(sd)
    for t in (tr, resumed):
        t.step(1, _delta_batch(d["1b"]))
        t.step(2, _delta_batch(d[2]))
        t.step(3, _delta_batch(d[3]))
        assert t.tau_frozen
    assert resumed.tau_tail == tr.tau_tail
    assert _within_sketch(resumed.tau_tail, np.concatenate([d[0], d["1b"], d[2]]))
    sd = resumed.state_dict()
    assert sd["calib"] == [] and sd["calib_steps"] == [] and sd["tau_frozen"] is True


def test_tracker_refuses_calibration_data_not_in_the_sketch_format():
    """Calibration data without the ``"sketch"`` format tag (raw δ values: no release wrote them) is refused with
    a ValueError naming the format, before anything changes; a frozen state's calibration data is not read."""
    tr = MetricTracker(MetricConfig(segment_width=16), calibration_steps=3)
    raw = {"tau_tail": float("nan"), "tau_frozen": False, "calib": [np.linspace(-1, 0, 60).tolist()]}
    with pytest.raises(ValueError, match=r"calibration data of format None; this version loads the 'sketch' format"):
        tr.load_state_dict(raw)
    assert not tr.tau_frozen and math.isnan(tr.tau_tail) and tr.reference.parts == []
    with pytest.raises(ValueError, match=r"format 'values'"):
        tr.load_state_dict({**raw, "calib_format": "values"})
    tr.load_state_dict({**raw, "tau_tail": -0.5, "tau_frozen": True})
    assert tr.tau_frozen and tr.tau_tail == -0.5


def test_tracker_state_without_calibration_data_calibrates_from_scratch():
    """A state that only says "not frozen" (no ``calib``) starts an empty reference window."""
    tr = MetricTracker(calibration_steps=1)
    tr.load_state_dict({"tau_tail": float("nan"), "tau_frozen": False})
    d = np.linspace(-1, 0, 40)
    tr.step(5, _delta_batch(d))
    tr.step(6, _delta_batch(np.zeros(2)))
    assert tr.tau_frozen and _within_sketch(tr.tau_tail, d)


def _loc_sums(st: MismatchStats) -> dict:
    """The localisation sums of a state by name, and its segments (tail, valid) listed from its C_tok table."""
    W1 = st.config.segment_width + 1
    table = st.part("c_tok_table").numpy()
    cells = [(c % W1, c // W1) for c in np.flatnonzero(table) for _ in range(int(table[c]))]
    return {**{k: st.sum(k) for k in ("neg_valid_tokens", "tail_tokens", "segments", "heavy_segments", "pairs",
                                      "pairs_heavy", "pairs_prev_heavy", "pairs_both_heavy", "responses_with_heavy",
                                      "responses_diluted")},
            "seg_tail": [t for t, _ in cells], "seg_valid": [v for _, v in cells]}


def test_segment_tail_stats_of_the_hand_worked_batch(seg_batch):
    """The localisation sums of seg_batch (worked out in its docstring): 25 valid tokens in A<0 responses, 5 tail
    tokens, 7 segments of which 4 heavy, 3 with a predecessor (1 heavy after a heavy one: s2k1; s0k2 after s0k1 is
    not heavy), 3 A<0 responses with a heavy segment, 1 of them diluted."""
    st = _loc_sums(MismatchStats(MetricConfig(segment_width=W)).update(seg_batch, TAU))
    assert (st["neg_valid_tokens"], st["tail_tokens"], st["segments"], st["heavy_segments"]) == (25, 5, 7, 4)
    assert (st["pairs"], st["pairs_heavy"], st["pairs_prev_heavy"], st["pairs_both_heavy"]) == (3, 2, 2, 1)
    assert (st["responses_with_heavy"], st["responses_diluted"]) == (3, 1)
    assert sorted(zip(st["seg_tail"], st["seg_valid"])) == sorted(
        [(0, 4), (2, 3), (0, 2), (1, 4), (1, 4), (0, 4), (1, 4)])


def test_merged_keeps_the_parts_config():
    """MismatchStats.merged of one part equals that part, and the merge keeps the parts' segment width."""
    cfg = MetricConfig(segment_width=16)
    b = TokenBatch.from_padded(*_random_padded(1))
    one = MismatchStats(cfg).update(b, -0.5)
    m = MismatchStats.merged([one])
    assert m.config.segment_width == 16 and torch.equal(m.state, one.state)
    two = MismatchStats.merged([one, MismatchStats(cfg).update(b, -0.5)])
    assert two.compute().values["n_tokens"] == 2 * one.compute().values["n_tokens"]


def test_dilution_uses_the_response_mean():
    """Three A<0 responses of 64 tokens, 10 tails (δ = −1, heavy) and 54 tokens at c, mean δ −0.04 (diluted), +0.06
    and −0.06 (not): dilution 1/3 — on the mean (Σδ / n), not the sum."""
    ds = []
    for mean in (-0.04, 0.06, -0.06):
        d = [(mean * 64 + 10) / 54] * 64
        d[:10] = [-1.0] * 10
        ds.append(d)
    v = compute_step_metrics(_list_batch(ds, [-1.0] * 3, sampler=-3.0), -0.5).values
    assert v["dilution"] == pytest.approx(1 / 3)


def test_hand_worked_batches_hold_when_the_update_is_cut_into_pieces(quadrant_batch, seg_batch, monkeypatch):
    """quadrant_batch and seg_batch (values worked out in their fixtures) when the state update cuts every batch
    into pieces of at most 4 tokens at response boundaries (``PIECE_TOKENS`` is 65,536 in use; no hand-worked batch
    is that long)."""
    from triage_monitor.metrics import state_kernel
    monkeypatch.setattr(state_kernel, "PIECE_TOKENS", 4)
    v = compute_step_metrics(quadrant_batch).values
    assert (v["mass_amp_neg"], v["mass_amp_pos"], v["mass_con_neg"], v["mass_con_pos"]) == (5, 2, 3, 1)
    assert v["rho_asym_lennorm"] == pytest.approx((11 / 6) / (1 / 2))
    assert v["small_gap_share"] == pytest.approx(4 / 10) and v["n_samples"] == 4 and v["n_tokens"] == 10
    assert v["delta_min"] == pytest.approx(-3.0)
    v = compute_step_metrics(seg_batch, TAU, MetricConfig(segment_width=W)).values
    assert (v["r_amp"], v["h_seg"], v["c_tok"]) == (pytest.approx(5 / 25), pytest.approx(4 / 7), pytest.approx(2 / 5))
    assert v["p_adj"] == pytest.approx((1 / 2) / (2 / 3)) and v["dilution"] == pytest.approx(1 / 3)


def _tail_layout(delta, adv, sample, pos, tau, width):
    """stages.tail_layout of flat tensors: (response, number, valid, tail) of the kept segments, as lists."""
    from triage_monitor.offline.stages import _layout
    n = int(sample.max()) + 1 if sample.numel() else 0
    lay = _layout(sample, pos, adv, delta, n, tau, width)
    return [lay.response.tolist(), lay.number.tolist(), lay.valid.tolist(), lay.tail.tolist()]


def test_segment_tail_counts_by_hand_for_a_power_of_two_and_another_width():
    """Positions 0, 1, 2, 3, 5, 6 of an A<0 response (4 masked) and 0, 1 of an A>0 response; tails (A<0, δ < −1) at
    positions 2 and 5.  W = 4: segments {0,1,2,3} 1 tail, {5,6} 1 tail.  W = 3 (floor division, not a shift):
    {0,1,2} 1 tail, {3,5} 1 tail, {6} 0 tails.  The A>0 response's segments are dropped.  (The segments of the
    stage table and the dashboard, stages.tail_layout; the state update's agree: tests/test_state_kernel.py.)"""
    delta = torch.tensor([0., 0., -2., 0., -3., 0., -5., -5.])
    adv = torch.tensor([-1.] * 6 + [1., 1.])
    sample = torch.tensor([0] * 6 + [1, 1])
    pos = torch.tensor([0, 1, 2, 3, 5, 6, 0, 1])
    assert _tail_layout(delta, adv, sample, pos, -1.0, 4) == [[0, 0], [0, 1], [4, 2], [1, 1]]
    assert _tail_layout(delta, adv, sample, pos, -1.0, 3) == [[0, 0, 0], [0, 1, 2], [3, 2, 1], [1, 1, 0]]
    one = _tail_layout(delta[2:3], adv[2:3], sample[:1], pos[2:3], -1.0, 4)
    assert one == [[0], [0], [1], [1]]                                           # a single token
    assert _tail_layout(delta[:0], adv[:0], sample[:0], pos[:0], -1.0, 4) == [[], [], [], []]


def test_segments_of_width_3_by_hand():
    """W = 3, τ = −1, one A<0 response, positions 0..5: tails at 0 and 4 → segments {0,1,2} 1/3 and {3,4,5} 1/3,
    both heavy (> 0.1), the second after a heavy predecessor: h_seg 1, P_adj = 1 / 1; r_amp 2/6."""
    v = compute_step_metrics(_list_batch([[-2., 0., 0., 0., -2., 0.]], [-1.], sampler=-3.0), -1.0,
                             MetricConfig(segment_width=3)).values
    assert v["h_seg"] == 1.0 and v["r_amp"] == pytest.approx(2 / 6) and v["p_adj"] == pytest.approx(1.0)


def test_heavy_is_a_strict_fraction_of_the_valid_tokens():
    """heavy ⇔ tail > 0.1 · valid.  W = 10: one tail in 10 tokens (exactly 0.1) is not heavy; W = 20: one in 20 is not
    heavy; two in 10 is.  So h_seg = 1/3 over the three one-segment responses."""
    def resp(n, tails):
        return [-2.] * tails + [0.] * (n - tails)
    cfg10, cfg20 = MetricConfig(segment_width=10), MetricConfig(segment_width=20)
    assert compute_step_metrics(_list_batch([resp(10, 1)], [-1.], sampler=-3.), -1., cfg10).values["h_seg"] == 0
    assert compute_step_metrics(_list_batch([resp(20, 1)], [-1.], sampler=-3.), -1., cfg20).values["h_seg"] == 0
    v = compute_step_metrics(_list_batch([resp(10, 1), resp(10, 2), resp(10, 1)], [-1.] * 3, sampler=-3.), -1.,
                             cfg10).values
    assert v["h_seg"] == pytest.approx(1 / 3)


def test_dilution_is_strictly_below_the_threshold_and_uses_one_token_means():
    """dilution_threshold 0.25, τ = −0.3, W = 4.  r0: δ = (−2, 1, 1, 1): heavy, mean δ exactly 0.25: not diluted.
    r1: one token δ = −0.4: heavy, mean −0.4 (÷ 1 token, not ÷ 2): not diluted.  r2: (−2, 1, 1, 0.5): mean 0.125:
    diluted.  dilution = 1/3."""
    cfg = MetricConfig(segment_width=4, dilution_threshold=0.25)
    v = compute_step_metrics(_list_batch([[-2., 1., 1., 1.], [-0.4], [-2., 1., 1., .5]], [-1.] * 3, sampler=-3.),
                             -0.3, cfg).values
    assert v["dilution"] == pytest.approx(1 / 3)


def test_predecessor_of_exactly_two_segments():
    """Two segments of one A<0 response, both heavy (W = 2, tails at positions 0 and 2, τ = −1): one pair, heavy
    after heavy: P(heavy | prev heavy) = 1 = P(heavy | has prev), P_adj = 1."""
    v = compute_step_metrics(_list_batch([[-2., 0., -2., 0.]], [-1.], sampler=-3.), -1.,
                             MetricConfig(segment_width=2)).values
    assert v["p_adj"] == pytest.approx(1.0) and v["h_seg"] == 1.0


def test_con_pos_counts_negative_gaps_not_zero_gaps():
    """A = +1: δ = (−0.1, −0.2, 0, 0.3): con_pos = the two δ<0 tokens (mass 2, count 2); δ = 0 is in no region;
    amp_pos = {0.3}.  A single-token amp_neg response (A = −2, δ = −0.5) has length weight 2/1 in the length-normalised
    mass; the A>0 response's 0.3 has 1/4: rho_asym_lennorm = 2 / 0.25 = 8."""
    v = compute_step_metrics(_list_batch([[-.1, -.2, 0., .3], [-.5]], [1., -2.])).values
    assert (v["mass_con_pos"], v["count_con_pos"], v["mass_amp_pos"], v["count_amp_pos"]) == (2, 2, 1, 1)
    assert v["rho_asym_lennorm"] == pytest.approx(8.0)


def test_response_advantage_sums_signed_token_advantages():
    """Per-token advantages (+3 on a δ<0 token, −1 on a tail token): the response's advantage is +2 > 0, so it has
    no segments and no tail (a response is A<0 by the sign of its mean advantage): r_amp NaN, no segments."""
    b = TokenBatch.from_list([torch.tensor([-1.5, -5.0])], [torch.tensor([-1.0, -1.0])], [torch.tensor([3.0, -1.0])])
    v = compute_step_metrics(b, -1.0, MetricConfig(segment_width=4)).values
    assert math.isnan(v["h_seg"]) and math.isnan(v["r_amp"])


def test_small_gap_is_strictly_below_the_threshold():
    """small_gap_threshold 0.25 (exact in float32): |δ| = 0.25 is not a small gap; 0.1 is: share 1/4."""
    v = compute_step_metrics(_list_batch([[.25, -.25, .1, .5]], [1.]), config=MetricConfig(small_gap_threshold=0.25))
    assert v.values["small_gap_share"] == pytest.approx(1 / 4)


def test_chi2_clamps_the_log_ratio_at_both_ends():
    """chi2_token's r is clamped to [−20, 20] before exp (verl's SAFETY_BOUND): its state sum Σ exp(r)² over δ = +25
    and −50 is e^40 + e^−40, not e^50 + e^−100."""
    from triage_monitor.metrics.stats import SUM_FIELDS
    st = MismatchStats().update(_list_batch([[25.0, -50.0]], [1.], sampler=-60.0))
    assert st.sums[SUM_FIELDS.index("exp_r_sq_sum")].item() == pytest.approx(math.exp(40) + math.exp(-40), rel=1e-12)
    lo = MismatchStats().update(_list_batch([[-50.0]], [1.], sampler=-60.0))
    assert lo.sums[SUM_FIELDS.index("exp_r_sq_sum")].item() == pytest.approx(math.exp(-40), rel=1e-9, abs=0)


def test_two_updates_add_up():
    """Two updates of one accumulator add: quadrant_batch twice has twice its masses and the same ratios."""
    b = _list_batch([[.2, -.1, 0., .03], [-.5, .1, -.01]], [1., -2.])
    v = MismatchStats().update(b).update(b).compute().values
    assert (v["n_tokens"], v["mass_amp_neg"], v["mass_amp_pos"]) == (14, 8, 4)


def test_merged_of_no_parts_is_empty():
    v = MismatchStats.merged([]).compute().values
    assert v["n_tokens"] == 0 and math.isnan(v["rho_asym"])


def test_empty_batch():
    """A batch whose only response is fully masked: no tokens, one response with none, metrics NaN."""
    v = compute_step_metrics(_list_batch([[-1.0, -2.0]], [-1.], masks=[[0, 0]]), -1.0).values
    assert v["n_tokens"] == 0 and v["n_samples"] == 0 and math.isnan(v["h_seg"]) and math.isnan(v["rho_asym"])


def test_segment_tail_stats_with_a_trailing_fully_masked_response(seg_batch):
    """seg_batch plus a last A<0 response whose tokens are all masked: the sums are seg_batch's (docstring of
    test_segment_tail_stats_of_the_hand_worked_batch)."""
    deltas, advs, masks = _seg_lists()
    b = _list_batch(deltas + [[-2., -2.]], advs + [-1.], masks=masks + [[0, 0]], sampler=-3.0)
    assert b.num_samples == 6
    st = _loc_sums(MismatchStats(MetricConfig(segment_width=W)).update(b, TAU))
    assert (st["neg_valid_tokens"], st["tail_tokens"], st["segments"], st["heavy_segments"]) == (25, 5, 7, 4)
    assert (st["pairs"], st["pairs_both_heavy"], st["responses_with_heavy"], st["responses_diluted"]) == (3, 1, 3, 1)


# ---------------------------------------------------------------- multi-rank sync (torch.distributed, gloo)
def _sync_part(rank):
    """Rank 0: A = −1, δ = (−2, 0.5, 3) (the global max); rank 1: A = +1, δ = (−4, 0.1) (the global min)."""
    return [_list_batch([[-2., .5, 3.]], [-1.], sampler=-5.), _list_batch([[-4., .1]], [1.], sampler=-5.)][rank]


def _sync_rank(rank, world, init_file, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        st = MismatchStats(MetricConfig(segment_width=4)).update(_sync_part(rank), -1.0).sync()
        torch.save(st.state, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sync_all_reduces_sums_and_extremes_across_two_ranks(tmp_path, plain_main):
    """Two gloo ranks (processes): after ``sync`` each rank holds the state of both parts — 5 tokens, 2 responses,
    δ min −4 (rank 1) and max 3 (rank 0), Σδ = −2.4, one tail (δ = −2 < −1, A < 0) — and it equals the state of
    one process updated with both responses.  In one process with a one-rank group, ``sync`` leaves the state
    as it is (the min is negated for the MAX all-reduce and back)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from triage_monitor.metrics.stats import SUM_FIELDS

    cfg = MetricConfig(segment_width=4)
    one = MismatchStats(cfg).update(_sync_part(0), -1.0)
    before = one.state.clone()
    assert one.sync() is one and torch.equal(one.state, before)       # no process group: a no-op
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        assert one.sync() is one
    finally:
        dist.destroy_process_group()
    assert torch.equal(one.state, before)

    mp.spawn(_sync_rank, args=(2, str(tmp_path / "rdv"), str(tmp_path / "state")), nprocs=2, join=True)
    states = [torch.load(tmp_path / f"state.{r}") for r in range(2)]
    whole = MismatchStats(cfg).update(_list_batch([[-2., .5, 3.], [-4., .1]], [-1., 1.], sampler=-5.), -1.0)
    for st in states:
        got = MismatchStats(cfg)
        got.state.copy_(st)
        got.tau_tail = -1.0
        v = got.compute().values
        assert (v["n_tokens"], v["n_samples"], v["delta_min"], got.part("delta_max").item()) == (5, 2, -4.0, 3.0)
        assert got.sums[SUM_FIELDS.index("delta_sum")].item() == pytest.approx(-2.4, rel=1e-6)
        assert got.sums[SUM_FIELDS.index("tail_tokens")].item() == 1
        assert torch.allclose(st, whole.state, rtol=1e-12, atol=0)


def _sync_calibration_rank(rank, world, init_file, out):
    import torch.distributed as dist

    from triage_monitor.metrics import calibration
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        values = [torch.tensor([-2., .5, 3.]), torch.tensor([-4., .1])][rank]
        torch.save(calibration.sync_part(calibration.part_of(values)), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_calibration_parts_sync_to_the_part_of_both_ranks_values(tmp_path, plain_main):
    """The τ_tail reference window's δ parts of two gloo ranks (the ranks' values differ, and so do their minima
    and maxima: −2 / 3 on rank 0, −4 / 0.1 on rank 1): after ``sync_part`` each rank holds the part of all five
    values — counts summed, the minimum −4 and the maximum 3 (not their sums −6 / 3.1, nor one rank's own) — so the
    0 and 1 quantiles are −4 and 3 and the part equals the merge of the two parts in one process."""
    import torch.multiprocessing as mp

    from triage_monitor.metrics import calibration

    mp.spawn(_sync_calibration_rank, args=(2, str(tmp_path / "rdv"), str(tmp_path / "part")), nprocs=2, join=True)
    whole = calibration.merge_parts([calibration.part_of(torch.tensor([-2., .5, 3.])),
                                     calibration.part_of(torch.tensor([-4., .1]))])
    for r in range(2):
        got = torch.load(tmp_path / f"part.{r}")
        assert torch.equal(got, whole), r
        assert calibration.part_count(got) == 5
        assert calibration.part_quantiles(got, [0.0, 1.0]) == [-4.0, 3.0]


def test_length_normalised_masses_are_the_documented_sums(quadrant_batch):
    """The state's length-normalised masses, not only their ratio (states are merged across
    ranks and steps): quadrant_batch's Σ |A|/n over amp_neg = 2·(2/3) + 1·(1/2) = 11/6 and over amp_pos = 2·(1/4)."""
    from triage_monitor.metrics.stats import SUM_FIELDS
    st = MismatchStats().update(quadrant_batch)
    assert st.sums[SUM_FIELDS.index("lennorm_amp_neg")].item() == pytest.approx(11 / 6, rel=1e-12)
    assert st.sums[SUM_FIELDS.index("lennorm_amp_pos")].item() == pytest.approx(1 / 2, rel=1e-12)



def test_a_tail_token_has_a_negative_advantage_and_a_gap_strictly_below_tau():
    """Per-token advantages inside one response of mean advantage −0.5 (so its segments are kept): A = −2, 0, 0.5,
    −1 with δ = −2, −2, −2, −1 and τ = −1: only the first token is a tail token (A = 0 and A > 0 are not, nor
    δ = τ exactly)."""
    got = _tail_layout(torch.tensor([-2., -2., -2., -1.]), torch.tensor([-2., 0., .5, -1.]),
                       torch.zeros(4, dtype=torch.long), torch.arange(4), -1.0, 4)
    assert got == [[0], [0], [4], [1]]


def test_localisation_of_one_token_and_of_no_token():
    """One A<0 token with δ = −2 < τ = −1: one segment of 1 valid token, 1 tail, heavy, the response heavy and
    not diluted (|mean δ| = 2).  No token: no segment (empty int64 arrays) and zero sums."""
    cfg = MetricConfig(segment_width=4)
    st = _loc_sums(MismatchStats(cfg).update(_list_batch([[-2.0]], [-1.0], sampler=-3.0), -1.0))
    assert (st["neg_valid_tokens"], st["tail_tokens"], st["segments"], st["heavy_segments"]) == (1, 1, 1, 1)
    assert (st["responses_with_heavy"], st["responses_diluted"]) == (1, 0)
    assert st["seg_tail"] == [1] and st["seg_valid"] == [1]
    st = _loc_sums(MismatchStats(cfg).update(_list_batch([[-2.0]], [-1.0], masks=[[0]], sampler=-3.0), -1.0))
    assert st["segments"] == 0 and st["tail_tokens"] == 0
    assert st["seg_tail"] == [] and st["seg_valid"] == []


def test_state_layout_groups_fields_by_reduction_by_hand():
    """Fields declared max(2), sum(3), min(1), sum(1) are laid out sums first (in declaration order), then min, then
    max: a 0:3, c 3:4, m 4:5, b 5:7; one range per reduction; the empty state is 0 for sums, +inf for min, −inf for
    max.  ``reduce`` of nothing is that empty state; of two states, sums add and extremes take the min / max."""
    from triage_monitor.metrics.stats import StateField, StateLayout
    lay = StateLayout([StateField("b", 2, "max"), StateField("a", 3, "sum"), StateField("m", 1, "min"),
                       StateField("c", 1, "sum")])
    assert [f.name for f in lay.fields] == ["a", "c", "m", "b"]
    assert lay.slices == {"a": slice(0, 3), "c": slice(3, 4), "m": slice(4, 5), "b": slice(5, 7)}
    assert lay.ranges == {"sum": (0, 4), "min": (4, 5), "max": (5, 7)} and lay.size == 7
    inf = math.inf
    assert lay.identity().dtype == torch.float64 and lay.identity().tolist() == [0, 0, 0, 0, inf, -inf, -inf]
    assert torch.equal(lay.reduce([]), lay.identity())
    x = torch.tensor([1., 2., 3., 4., 5., 6., -1.], dtype=torch.float64)
    y = torch.tensor([10., 20., 30., 40., 2., 1., 7.], dtype=torch.float64)
    assert lay.reduce([x, y]).tolist() == [11, 22, 33, 44, 2, 6, 7]


def test_merge_all_into_spans_merges_each_state_in_turn_over_the_spans_only_by_hand():
    """The trailing window's merge: sums a 0:3, c 3:4, min m 4:6, max b 6:8; spans [0, 2) and [3, 8) leave entry 2
    as it was.  Each entry is merged down the states in the given order: an order-sensitive one-entry sum equals
    the left fold ((out + s1) + s2) + ... of Python floats, not a pairwise sum."""
    import functools

    from triage_monitor.metrics.stats import StateField, StateLayout
    lay = StateLayout([StateField("a", 3, "sum"), StateField("c", 1, "sum"), StateField("m", 2, "min"),
                       StateField("b", 2, "max")])
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    out = f64([1, 1, 1, 1, 5, 5, 0, 0])
    x, y = f64([1, 2, 3, 4, 3, 9, 2, -1]), f64([10, 20, 30, 40, 7, 1, -5, 4])
    assert lay.merge_all_into_spans(out, [x, y], [(0, 2), (3, 8)]) is out
    assert out.tolist() == [12, 23, 1, 45, 3, 1, 2, 4]
    assert lay.merge_all_into_spans(out, [], [(0, 8)]).tolist() == [12, 23, 1, 45, 3, 1, 2, 4]
    assert lay.merge_all_into_spans(out, [x], []).tolist() == [12, 23, 1, 45, 3, 1, 2, 4]
    vals = [1e16] + [1.0] * 10 + [-1e16]                       # in order: 1e16 + 1 rounds back to 1e16, ten times
    out = lay.identity()
    out[3] = vals[0]
    others = []
    for v in vals[1:]:
        t = lay.identity()
        t[3] = v
        others.append(t)
    lay.merge_all_into_spans(out, others, [(3, 4)])
    assert out[3].item() == functools.reduce(lambda a, b: a + b, vals) == 0.0


def test_window_counts_stay_exact_beyond_float32s_integers():
    """A window of one step reports that step's values bit for bit, also when its sketch and C_tok table counts
    exceed 2**24 (float32 holds integers exactly only up to there; a 100-step window of a few million tokens a step
    gets there): the window's running count sum is float64."""
    st = MismatchStats(MetricConfig(segment_width=4)).update(
        _list_batch([[-2., .5, 3., -.2, -1.5], [-4., .1, .3]], [-1., 1.], sampler=-5.), -1.0)
    lay = st.layout
    counts = slice(lay.slices["delta_sketch"].start, lay.slices["c_tok_table"].stop)
    st.state[counts] *= 2 ** 24 + 1                 # odd counts above 2**24: exact in float64, not in float32
    assert st.state[counts].max().item() > 2 ** 24
    step_res, win_res = MetricTracker(MetricConfig(segment_width=4), tau_tail=-1.0, window=1).push(0, st)
    assert step_res.values == pytest.approx(win_res.values, rel=0, abs=0, nan_ok=True)


def test_localisation_added_apart_holds_the_hand_worked_values(seg_batch):
    """add_magnitude, then add_localisation called on its own (no intermediates passed): seg_batch's hand-worked
    localisation (see its fixture)."""
    b = seg_batch
    st = MismatchStats(MetricConfig(segment_width=W))
    st.add_magnitude(b.delta, b.advantage, b.sample_index, b.num_samples)
    st.add_localisation(b.delta, b.advantage, b.sample_index, b.position, b.num_samples, TAU)
    st.tau_tail = TAU
    v = st.compute().values
    assert (v["r_amp"], v["h_seg"], v["c_tok"]) == (pytest.approx(5 / 25), pytest.approx(4 / 7), pytest.approx(2 / 5))
    assert v["p_adj"] == pytest.approx((1 / 2) / (2 / 3)) and v["dilution"] == pytest.approx(1 / 3)
    # the sums themselves (the ratios hide a sign or a lost update): 25 valid, 5 tail, 7 segments, 4 heavy; twice
    from triage_monitor.metrics.stats import SUM_FIELDS
    pick = (lambda s: [s.sums[SUM_FIELDS.index(k)].item()
                       for k in ("neg_valid_tokens", "tail_tokens", "segments", "heavy_segments")])
    assert pick(st) == [25, 5, 7, 4]
    st.add_localisation(b.delta, b.advantage, b.sample_index, b.position, b.num_samples, TAU)
    assert pick(st) == [50, 10, 14, 8]


def _segment_table(W, segments):
    """(W+1)² float64 counts of segments given as {(valid, tail): count}: cell valid·(W+1) + tail."""
    table = torch.zeros((W + 1) ** 2, dtype=torch.float64)
    for (valid, tail), n in segments.items():
        table[valid * (W + 1) + tail] = n
    return table


@pytest.mark.parametrize("segments, expected", [
    # 40 segments: the top ceil(0.05·40) = 2 are the (4, 4) one and one (4, 2): 4 + 2 of 4 + 3·2 = 10 tail tokens
    ({(4, 4): 1, (4, 2): 3, (4, 0): 36}, 6 / 10),
    # the 2 are the (4, 4) and the (3, 3) segment, ranked before the (4, 3) ones: 4 + 3 of 4 + 3 + 3·3 = 16
    ({(4, 4): 1, (3, 3): 1, (4, 3): 3, (4, 0): 35}, 7 / 16),
    # the first cell in rank order alone holds the top 2: 2 · 4 of 3 · 4
    ({(4, 4): 3, (4, 0): 37}, 8 / 12),
    # one segment: it is the top segment, all its tail tokens
    ({(4, 2): 1}, 1.0),
    # no tail token, or no segment: NaN
    ({(4, 0): 5}, math.nan),
    ({}, math.nan),
])
def test_c_tok_from_the_segment_table_by_hand_with_its_default_top_5_percent(segments, expected):
    """C_tok from the (valid, tail) segment table with the default top fraction (5 %), W = 4, worked out by hand
    and by :func:`c_tok_from_segments` of the same segments listed one by one; a numpy table gives the same."""
    W = 4
    table = _segment_table(W, segments)
    valid = torch.tensor([v for (v, _), n in segments.items() for _ in range(n)], dtype=torch.long)
    tail = torch.tensor([t for (_, t), n in segments.items() for _ in range(n)], dtype=torch.long)
    for got in (c_tok_from_table(table, W), c_tok_from_table(table.numpy(), W), c_tok_from_segments(tail, valid)):
        assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, rel=1e-15, abs=0)


def test_an_update_without_tau_tail_adds_no_localisation(seg_batch):
    """With τ_tail NaN (not calibrated yet) the localisation part of the state stays empty:
    no segment sums, an empty C_tok table (seg_batch has 3 responses with A < 0 cut into 7 segments at τ = −1)."""
    from triage_monitor.metrics.stats import SUM_FIELDS

    loc = ("neg_valid_tokens", "tail_tokens", "segments", "heavy_segments", "pairs", "pairs_heavy",
           "pairs_prev_heavy", "pairs_both_heavy", "responses_with_heavy", "responses_diluted")
    cfg = MetricConfig(segment_width=4)
    without = MismatchStats(cfg).update(seg_batch)
    assert [without.sums[SUM_FIELDS.index(k)].item() for k in loc] == [0.0] * len(loc)
    assert without.part("c_tok_table").sum().item() == 0
    with_tau = MismatchStats(cfg).update(seg_batch, -1.0)
    assert with_tau.sums[SUM_FIELDS.index("segments")].item() == 7 and with_tau.part("c_tok_table").sum().item() == 7


def test_bfloat16_advantages_update_the_state_as_their_float32_values():
    """Advantages in bfloat16 (a low-precision trainer's dtype, kept by ``from_padded``) holding 1, −1 and 2
    exactly: the state equals that of the same batch with float32 advantages,."""
    g = torch.Generator().manual_seed(3)
    sampler = -torch.rand(3, 20, generator=g) * 3
    learner = sampler + torch.randn(3, 20, generator=g) * 0.5
    mask = torch.ones(3, 20, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 2.0])
    states = [MismatchStats(MetricConfig(segment_width=4)).update(
        TokenBatch.from_padded(learner.clamp(max=0), sampler, adv.to(dtype), mask), -0.5).state
        for dtype in (torch.bfloat16, torch.float32)]
    assert torch.equal(states[0], states[1])


_NO_TOKENS = {name: "no valid tokens" for name in (
    "small_gap_share", "delta_mean", "delta_abs_mean", "delta_q01", "delta_q05", "delta_q50", "delta_min", "k3_kl",
    "chi2_token")}
_NO_AMP_POS = {"rho_asym": "mass_amp_pos = 0: no token with A > 0 and delta > 0",
               "rho_asym_lennorm": "length-normalised mass_amp_pos = 0: no token with A > 0 and delta > 0"}
_NO_NEG_RESPONSE = {"r_amp": "no valid token in an A<0 response", "h_seg": "no segment in an A<0 response",
                    "c_tok": "no amplifying-tail token", "p_adj": "no segment with a predecessor",
                    "dilution": "no A<0 response holds a tail-heavy segment"}


def test_every_nan_metric_says_why_in_words_typed_out_here():
    """``nan_reasons`` of a step without valid tokens (τ_tail not calibrated, then −1) and of a step whose tokens
    all have A > 0 and δ < 0 (no amplifying mass, no A < 0 response): each NaN metric, and only those, with its
    reason."""
    nothing = TokenBatch.from_padded(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1., -1.]),
                                     torch.zeros(2, 3, dtype=torch.bool))
    empty = {**_NO_TOKENS, **_NO_AMP_POS, "log_ppl_diff": "no response with a valid token",
             "amp_share": "total |A| mass is 0"}
    uncalibrated = MismatchStats(MetricConfig()).update(nothing).compute()
    assert uncalibrated.nan_reasons == {**empty, "tau_tail": "not calibrated yet", **{
        k: "tau_tail not set (no calibration data yet)" for k in ("r_amp", "h_seg", "c_tok", "p_adj", "dilution")}}
    assert sorted(k for k, v in uncalibrated.values.items() if math.isnan(v)) == sorted(uncalibrated.nan_reasons)
    calibrated = MismatchStats(MetricConfig()).update(nothing, -1.0).compute()
    assert calibrated.nan_reasons == {**empty, **_NO_NEG_RESPONSE}
    assert sorted(k for k, v in calibrated.values.items() if math.isnan(v)) == sorted(calibrated.nan_reasons)
    con_pos = TokenBatch.from_padded(torch.full((2, 3), -1.3), torch.full((2, 3), -1.0), torch.tensor([1., 2.]),
                                     torch.ones(2, 3, dtype=torch.bool))
    r = MismatchStats(MetricConfig()).update(con_pos, -1.0).compute()
    assert r.nan_reasons == {**_NO_AMP_POS, **_NO_NEG_RESPONSE}
    assert sorted(k for k, v in r.values.items() if math.isnan(v)) == sorted(r.nan_reasons)


@pytest.mark.parametrize("tail_at, reason", [(0, "no tail-heavy segment among those with a predecessor"),
                                             (4, "no tail-heavy predecessor segment")])
def test_p_adj_says_which_pair_count_is_zero(tail_at, reason):
    """One A < 0 response of 8 tokens, W = 4, τ = −1, one tail token (δ = −2): in segment 0 it makes the
    predecessor heavy and no segment with a predecessor heavy; in segment 1 the reverse.  p_adj is NaN, saying
    which."""
    learner = torch.full((1, 8), -1.0)
    learner[0, tail_at] = -3.0
    batch = TokenBatch.from_padded(learner, torch.full((1, 8), -1.0), torch.tensor([-1.]),
                                   torch.ones(1, 8, dtype=torch.bool))
    r = MismatchStats(MetricConfig(segment_width=4)).update(batch, -1.0).compute()
    assert math.isnan(r.values["p_adj"]) and r.nan_reasons["p_adj"] == reason


@pytest.mark.parametrize("delta", [-2.2, -0.7, -0.3, 0.45, 1.1])
def test_quantiles_of_one_repeated_gap_are_that_gap_exactly(delta):
    """Every token with the same δ: the sketch's bucket representative is clamped to the exact minimum and
    maximum, so δ's 1 %, 5 % and 50 % quantiles are δ itself (float32 δ, as computed)."""
    sampler = torch.full((2, 5), -1.5)
    learner = sampler + delta
    d = float((learner - sampler)[0, 0])
    v = MismatchStats(MetricConfig()).update(TokenBatch.from_padded(
        learner, sampler, torch.tensor([1., -1.]), torch.ones(2, 5, dtype=torch.bool))).compute().values
    assert (v["delta_q01"], v["delta_q05"], v["delta_q50"], v["delta_min"]) == (d, d, d, d)


@pytest.mark.parametrize("top_fraction, c_tok", [(0.05, 2 / 5), (0.3, 4 / 5), (0.5, 5 / 5)])
def test_c_tok_takes_the_configured_top_fraction_of_segments(seg_batch, top_fraction, c_tok):
    """seg_batch's 7 segments (W = 4, τ = −1) hold 5 tail tokens: 2 in one segment of 3 valid tokens, 1 in each of
    three segments of 4.  The top ceil(f · 7) segments: f = 0.05 takes 1 (2 tails), 0.3 takes 3 (2 + 1 + 1),
    0.5 takes 4 (all 5)."""
    v = MismatchStats(MetricConfig(segment_width=4, top_fraction=top_fraction)).update(seg_batch, -1.0).compute()
    assert v.values["c_tok"] == pytest.approx(c_tok, rel=1e-15, abs=0)


def test_a_state_given_must_have_the_layouts_size_and_becomes_float64():
    """``MismatchStats(state=...)`` (a saved state): one of another size is refused naming both sizes and the
    segment width (message typed out); a float32 one is held as float64.  A new state is made on the device
    on the host, where the state update runs."""
    cfg = MetricConfig(segment_width=4)
    size = MismatchStats(cfg).state.numel()
    with pytest.raises(ValueError) as err:
        MismatchStats(cfg, state=torch.zeros(5))
    assert str(err.value) == f"MismatchStats state must have shape ({size},) for segment width 4, got (5,)"
    kept = MismatchStats(cfg, state=MismatchStats(cfg).state.float())
    assert kept.state.dtype == torch.float64 and kept.state.device == torch.device("cpu")
    assert MismatchStats(cfg).state.shape == (size,) and MismatchStats(cfg).state.dtype == torch.float64



def _float64_reference(learner: torch.Tensor, sampler: torch.Tensor) -> dict:
    """k3_kl and delta_abs_mean from δ = learner − sampler taken exactly (float64 difference of the float32
    inputs), summed with math.fsum: what the metrics would be without the float32 rounding of δ."""
    d = (learner.double() - sampler.double()).tolist()
    n = len(d)
    return {"k3_kl": math.fsum(math.expm1(x) - x for x in d) / n, "delta_abs_mean": math.fsum(abs(x) for x in d) / n,
            "delta_max": max(d)}


def _metrics_of(learner, sampler):
    n = learner.numel()
    b = TokenBatch.from_flat(learner, sampler, torch.ones(n), torch.arange(n) // 8, torch.arange(n) % 8)
    st = MismatchStats()
    st.update(b, tau_tail=-0.1)
    return st.compute().values


def test_k3_kl_rounding_of_delta_to_float32_stays_within_the_stated_bound():
    """docs/metrics.md#rounding-of-δ: δ is rounded to float32 once, so k3_kl is within 2⁻²⁴ · (2 + max(0, δ_max))
    relative of its value on the exact δ (not ~1e-15), delta_abs_mean within 2⁻²⁴.  By hand: learner −10 + 2⁻¹⁹,
    sampler −70: δ = 60 + 2⁻¹⁹ is half-way between two float32 (their spacing at 60 is 2⁻¹⁸) and rounds to even,
    60.0; the e^δ term dominates k3, so k3 is off by a factor e^(−2⁻¹⁹): relative 2⁻¹⁹ = 1.907e-6, under the
    bound 2⁻²⁴ · 62 = 3.70e-6.  Then 4,096 tokens with δ uniform in (−60, 60)."""
    learner = torch.tensor([-10 + 2 ** -19, -0.5, -0.5])
    sampler = torch.tensor([-70.0, -0.5, -0.75])
    assert learner[0].item() == -10 + 2 ** -19 and (learner[0] - sampler[0]).item() == 60.0
    ref, got = _float64_reference(learner, sampler), _metrics_of(learner, sampler)
    rel = abs(got["k3_kl"] - ref["k3_kl"]) / ref["k3_kl"]
    assert rel == pytest.approx(2 ** -19, rel=1e-4)
    assert rel <= 2 ** -24 * (2 + ref["delta_max"]) == pytest.approx(3.6955e-6, rel=1e-4)
    assert abs(got["delta_abs_mean"] - ref["delta_abs_mean"]) <= 2 ** -24 * ref["delta_abs_mean"]
    g = torch.Generator().manual_seed(7)
    sampler = -70 + 10 * torch.rand(4096, generator=g)                   # log-probs in (−70, −60)
    learner = (sampler + 120 * torch.rand(4096, generator=g) - 60).clamp(max=0)
    ref, got = _float64_reference(learner, sampler), _metrics_of(learner, sampler)
    assert 59 < ref["delta_max"] < 60
    assert abs(got["k3_kl"] - ref["k3_kl"]) <= 2 ** -24 * (2 + ref["delta_max"]) * ref["k3_kl"]
    assert abs(got["delta_abs_mean"] - ref["delta_abs_mean"]) <= 2 ** -24 * ref["delta_abs_mean"]


def _bits(values: dict) -> dict:
    """Metric values as their IEEE bit patterns (NaN compared as NaN: equal bits here)."""
    return {k: np.float64(v).view(np.int64).item() if not math.isnan(v) else "nan" for k, v in values.items()}


@pytest.mark.parametrize("window", [1, 3, 7])
def test_tracker_window_equals_the_step_order_reduce_of_its_steps_bit_for_bit(window):
    """The trailing window of every push equals ``layout.reduce`` of its steps' states in their order (what the
    offline recomputation computes), bit for bit, on states whose float sums differ by 20 orders of magnitude (so
    that any other summation order changes the result): steps that repeat (replacing the earlier state), jump
    ahead (evicting several steps at once) and go back (a resumed job), and windows of 1, 3 and 7 steps."""
    g = torch.Generator().manual_seed(window)
    cfg = MetricConfig(segment_width=4)
    tracker = MetricTracker(cfg, tau_tail=-0.5, window=window)
    lay = MismatchStats(cfg).layout
    sums = lay.slices["sums"]
    history = []                                     # the window's (step, state) as the definition keeps them
    for step in (0, 1, 2, 2, 3, 5, 6, 6, 20, 21, 22, 23, 12, 13, 13, 30, 31, 32, 33, 34):
        deltas = [(-torch.rand(int(torch.randint(1, 9, (1,), generator=g)), generator=g) * 3).tolist()
                  for _ in range(3)]
        st = MismatchStats(cfg).update(_list_batch(deltas, torch.randn(3, generator=g).tolist()), -0.5)
        scale = 10.0 ** torch.randint(-10, 11, (sums.stop - sums.start,), generator=g).double()
        st.state[sums] *= scale                    # order-sensitive float sums (integer counts stay integers)
        if history and history[-1][0] == step:
            history.pop()
        history.append((step, st))
        history = [(s, x) for s, x in history if s > step - window]
        want = MismatchStats(cfg, state=lay.reduce([x.state for _, x in history]), tau_tail=-0.5).compute()
        step_res, win_res = tracker.push(step, st)
        assert _bits(win_res.values) == _bits(want.values), step
        assert _bits(step_res.values) == _bits(st.compute().values)
        assert win_res.nan_reasons == want.nan_reasons


def test_state_assignment_strides_and_an_older_pickle_keep_working():
    """``MismatchStats.state`` (a tensor view of the numpy ``array``) can be assigned; a numpy state with negative
    strides is copied (torch cannot view it); an accumulator pickled when the state was a tensor attribute loads."""
    import pickle

    cfg = MetricConfig(segment_width=8)
    a = MismatchStats(cfg)
    a.update(TokenBatch.from_padded(torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.2, -1.0, -0.5]]),
                                    torch.tensor([-1.0]), torch.ones(1, 3)), -0.5)
    b = MismatchStats(cfg)
    b.state = a.state.clone()
    assert b.compute().values["n_tokens"] == 3 and np.array_equal(b.array, a.array)
    rev = MismatchStats(cfg, state=a.array[::-1].copy()[::-1])
    assert torch.equal(rev.state, a.state)
    old = MismatchStats.__new__(MismatchStats)
    old.__dict__.update({k: v for k, v in a.__dict__.items() if k != "array"}, state=a.state.clone())
    back = pickle.loads(pickle.dumps(old))
    assert back.compute().values["n_tokens"] == 3 and np.array_equal(back.array, a.array)
