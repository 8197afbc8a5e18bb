"""The metric constants of docs/metrics.md pinned by values worked out independently of the product.

Every test here runs the product with its **defaults** (``MetricConfig()``, ``MetricTracker()``) and compares it
with a value worked out by hand in the comments, or with the reference implementation of tests/reference_metrics.py: a
plain-Python loop over responses and segments written from docs/metrics.md#localisation, with the documented
constants typed in (W = 64, small gap 0.05 nats, heavy fraction 10 %, top fraction 5 %, dilution 0.05 nats).  It
lives in tests/reference_metrics.py and imports nothing from the product.  Changing a default or a comparison (``<`` for ``<=``) in the product makes one of them
fail; docs/testing.md lists which test pins which constant.
"""

import math

import numpy as np
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.config import MonitorConfig
from triage_monitor.metrics.stats import MetricConfig, MetricTracker, compute_step_metrics

from reference_metrics import reference_metrics

# the documented constants, typed in (docs/metrics.md)
W = 64
SMALL_GAP = 0.05
HEAVY = 0.10
TOP = 0.05
DILUTION = 0.05
TAIL_Q = 0.05


def _batch(deltas, advs, positions=None):
    """Responses as float32 δ arrays (sampler_logp = −3, so learner − sampler = δ exactly for these values)."""
    sampler = [torch.full((len(d),), -3.0) for d in deltas]
    learner = [torch.as_tensor(np.asarray(d, dtype=np.float32)) - 3.0 for d in deltas]
    masks = None
    if positions is not None:                          # valid tokens at the given positions, the rest masked
        L = [int(p.max()) + 1 for p in positions]
        lp, sp, masks = [], [], []
        for d, p, n in zip(deltas, positions, L):
            full = torch.zeros(n)
            full[torch.as_tensor(p)] = torch.as_tensor(np.asarray(d, dtype=np.float32))
            m = torch.zeros(n, dtype=torch.bool)
            m[torch.as_tensor(p)] = True
            lp.append(full - 3.0)
            sp.append(torch.full((n,), -3.0))
            masks.append(m)
        learner, sampler = lp, sp
    return TokenBatch.from_list(learner, sampler, torch.tensor(advs, dtype=torch.float32), masks)


def _reference(responses, tau, **kw):
    """The independent implementation of tests/reference_metrics.py (documented constants as defaults)."""
    return reference_metrics(responses, tau, **kw)


def _planted_run(seed=0, n_neg=40):
    """``n_neg`` A<0 responses of 100–400 tokens (≈ 100+ segments of W = 64), some positions masked, plus A > 0
    and A = 0 responses.  Tail tokens (δ = −1) are planted at 0–20 % per segment so that many segments sit near the
    10 % heavy line; the other tokens get one constant chosen so that the response's mean δ is one of
    ±0.02, ±0.04, ±0.06, ±0.08 (dilution 0.05 vs 0.10 gives different answers), with |δ| straddling the 0.05 small gap.
    """
    rng = np.random.default_rng(seed)
    deltas, positions, advs, resp = [], [], [], []
    for i in range(n_neg + 6):
        L = int(rng.integers(100, 400))
        pos = np.sort(rng.choice(L + 20, size=L, replace=False))     # ~5 % of positions masked, not reindexed
        d = np.zeros(L)
        tail = np.zeros(L, dtype=bool)
        for k in np.unique(pos // W):
            idx = np.flatnonzero(pos // W == k)
            n_t = int(round(rng.choice([0, 0.05, 0.09, 0.11, 0.15, 0.2, 0.3]) * len(idx)))
            tail[rng.choice(idx, size=n_t, replace=False)] = True
        d[tail] = -1.0
        target = rng.choice([-0.08, -0.06, -0.04, -0.02, 0.02, 0.04, 0.06, 0.08])
        rest = ~tail
        if rest.any():
            d[rest] = (target * L - d[tail].sum()) / rest.sum()
        a = -1.0 - i % 3 if i < n_neg else (0.0 if i % 2 else 1.5)
        d = d.astype(np.float32)
        deltas.append(d)
        positions.append(pos)
        advs.append(a)
        seen = ((d + np.float32(-3.0)) - np.float32(-3.0)).astype(np.float64)   # δ as the product sees it
        resp.append((seen, pos, a))
    return deltas, positions, advs, resp


def test_localisation_defaults_equal_an_independent_loop():
    """W = 64, heavy 10 %, top 5 %, dilution 0.05, small gap 0.05 (docs/metrics.md#localisation), on ~120
    segments: every default and every comparison of the localisation metrics changes at least one value here."""
    deltas, positions, advs, resp = _planted_run()
    tau = -0.5
    ref = _reference(resp, tau)
    got = compute_step_metrics(_batch(deltas, advs, positions), tau, MetricConfig()).values
    for k in ("small_gap_share", "delta_mean", "delta_abs_mean", "k3_kl", "mass_amp_neg", "mass_amp_pos",
              "mass_con_neg", "mass_con_pos", "rho_asym", "r_amp", "h_seg", "c_tok", "p_adj", "dilution"):
        assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=0), k
    # the data distinguish each documented constant from a neighbouring value (else the test would be blind)
    assert ref["segments"] >= 40 and math.ceil(TOP * ref["segments"]) != math.ceil(0.10 * ref["segments"])
    for kw, keys in (({"width": 65}, ("h_seg",)), ({"width": 32}, ("h_seg",)), ({"heavy": 0.2}, ("h_seg",)),
                     ({"top": 0.10}, ("c_tok",)), ({"dilution": 0.10}, ("dilution",)),
                     ({"dilution": 0.025}, ("dilution",)), ({"small": 0.10}, ("small_gap_share",))):
        other = _reference(resp, tau, **kw)
        assert any(other[k] != ref[k] for k in keys), kw


def test_metric_and_monitor_defaults_are_the_documented_ones():
    """The documented defaults themselves (docs/metrics.md: W = 64, 0.05 nats, 10 %, 5 %, 0.05 nats, q = 5 %;
    window and reference window of 25 steps)."""
    c = MetricConfig()
    assert (c.segment_width, c.small_gap_threshold, c.heavy_fraction, c.top_fraction, c.dilution_threshold,
            c.tail_quantile) == (W, SMALL_GAP, HEAVY, TOP, DILUTION, TAIL_Q)
    m = MonitorConfig()
    assert (m.window, m.calibration_steps, m.tau_tail) == (25, 25, None)
    t = MetricTracker()
    assert (t.window, t.calibration_steps) == (25, 25)


def test_segment_boundary_is_position_64():
    """One A<0 response, positions 0..127, tail tokens (δ = −1 < τ = −0.5) at positions 57..63 only.

    W = 64: segment 0 holds 7 tails of 64 valid (7 > 6.4: heavy), segment 1 none → h_seg = 1/2, and the top
    ceil(0.05·2) = 1 segment holds all 7 tails → c_tok = 1.  W = 65 would give segment 0 = 65 valid, 7 tails
    (7 > 6.5, still heavy) but segment 1 = 63 valid; W = 63 puts position 63 into segment 1 (1/63: not heavy):
    6/63 tails → 6 > 6.3 is false → h_seg = 0.
    """
    d = np.zeros(128, dtype=np.float32)
    d[57:64] = -1.0
    v = compute_step_metrics(_batch([d], [-1.0]), -0.5).values
    assert v["h_seg"] == 0.5 and v["c_tok"] == 1.0 and v["r_amp"] == 7 / 128
    d2 = np.zeros(128, dtype=np.float32)
    d2[64:71] = -1.0
    v2 = compute_step_metrics(_batch([d2], [-1.0]), -0.5).values
    assert v2["h_seg"] == 0.5
    assert math.isnan(v2["p_adj"])


def test_heavy_line_is_strictly_more_than_ten_percent():
    """Segments of exactly 10 valid tokens (positions 0..9 of separate responses): 1 tail = 10 % is **not** heavy
    (1 > 1.0 is false), 2 tails = 20 % is."""
    d1 = np.zeros(10, dtype=np.float32)
    d1[0] = -1.0
    d2 = np.zeros(10, dtype=np.float32)
    d2[:2] = -1.0
    v = compute_step_metrics(_batch([d1, d2], [-1.0, -1.0]), -0.5).values
    assert v["h_seg"] == 0.5


def test_tail_is_strictly_below_tau_and_needs_negative_advantage():
    """τ = −0.5 (exact in float32): δ = −0.5 is not a tail token, δ = −0.5 − 2⁻²⁰ is; A = 0 and A > 0 responses
    with δ far below τ add no tail token and no A<0 valid token."""
    below = np.float32(-0.5) - np.float32(2 ** -20)
    d = np.array([-0.5, below, 0.0, 0.0], dtype=np.float32)
    v = compute_step_metrics(_batch([d, np.full(4, -9, np.float32), np.full(4, -9, np.float32)],
                                    [-1.0, 0.0, 2.0]), -0.5).values
    assert v["r_amp"] == 1 / 4


def test_top_fraction_five_percent_of_forty_segments():
    """40 A<0 responses of one 64-token segment each; response i has 40 − i tail tokens, so the fractions all
    differ.  ceil(0.05·40) = 2 segments (0.10 would take 4): the top two hold 40 + 39 of Σ = 820 tail tokens."""
    ds = []
    for i in range(40):
        d = np.zeros(64, dtype=np.float32)
        d[: 40 - i] = -1.0
        ds.append(d)
    v = compute_step_metrics(_batch(ds, [-1.0] * 40), -0.5).values
    assert v["c_tok"] == pytest.approx(79 / 820, rel=1e-12)
    # ceil, not round/floor: 41 segments → ceil(2.05) = 3 segments: 40 + 39 + 38 of 820 + 1
    d = np.zeros(64, dtype=np.float32)
    d[0] = -1.0
    v = compute_step_metrics(_batch(ds + [d], [-1.0] * 41), -0.5).values
    assert v["c_tok"] == pytest.approx(117 / 821, rel=1e-12)


def test_dilution_line_is_005_nats_on_the_response_mean():
    """Three A<0 responses of 64 tokens, each with 10 tails (δ = −1, heavy) and 54 tokens at c, mean δ m:
    m = −0.04 → diluted; m = +0.06 and −0.06 → not diluted (0.10 would count both).  dilution = 1/3."""
    ds = []
    for m in (-0.04, 0.06, -0.06):
        d = np.full(64, (m * 64 + 10) / 54, dtype=np.float64)
        d[:10] = -1.0
        ds.append(d.astype(np.float32))
    v = compute_step_metrics(_batch(ds, [-1.0] * 3), -0.5).values
    assert v["dilution"] == pytest.approx(1 / 3)
    # the comparison is strict and on |mean|: threshold 0.0625 (exact in binary) with a mean of exactly −0.0625
    exact = np.zeros(64, dtype=np.float32)
    exact[:8] = -0.5                                  # 8 tails at τ = −0.25: 8 > 6.4 heavy; mean δ = −4/64 = −0.0625
    cfg = MetricConfig(dilution_threshold=0.0625)
    assert compute_step_metrics(_batch([exact], [-1.0]), -0.25, cfg).values["dilution"] == 0.0
    cfg2 = MetricConfig(dilution_threshold=0.0625 + 2 ** -20)
    assert compute_step_metrics(_batch([exact], [-1.0]), -0.25, cfg2).values["dilution"] == 1.0


def test_small_gap_line_is_strict_and_005_nats():
    """|δ| ∈ {0, 0.03, 0.049, 0.051, 0.07, 0.2}: 3 of 6 below 0.05 (0.10 would give 5/6).  Strictness with a
    binary-exact threshold 0.0625: |δ| = 0.0625 is not a small gap."""
    d = np.array([0.0, -0.03, 0.049, -0.051, 0.07, -0.2], dtype=np.float32)
    assert compute_step_metrics(_batch([d], [1.0])).values["small_gap_share"] == 0.5
    d = np.array([0.0625, -0.0625, 0.0624], dtype=np.float32)
    v = compute_step_metrics(_batch([d], [1.0]), config=MetricConfig(small_gap_threshold=0.0625)).values
    assert v["small_gap_share"] == pytest.approx(1 / 3)


def test_tau_tail_is_the_five_percent_quantile_of_the_first_25_steps():
    """MetricTracker() with no τ: steps 0..24 are the reference window.  Step s has 100 tokens δ = −(s + 1)·j/100,
    j = 0..99; τ_tail = numpy's 5 % quantile of all 2,500 values (within the sketch bound 2⁻⁹·|x| + 2⁻²⁰ of
    docs/metrics.md#accuracy); step 25 (the 26th) must not move it, whatever its δ."""
    tr = MetricTracker()
    pool = []
    for s in range(25):
        d = (-(s + 1) * np.arange(100) / 100).astype(np.float32)
        pool.append(d.astype(np.float64))
        tr.step(s, _batch([d], [-1.0]))
        assert not tr.tau_frozen
    expect = float(np.quantile(np.concatenate(pool), TAIL_Q))
    tr.step(25, _batch([np.full(100, -50.0, np.float32)], [-1.0]))
    assert tr.tau_frozen
    assert tr.tau_tail == pytest.approx(expect, rel=2 ** -9, abs=2 ** -20)
    # the 1 % and 10 % quantiles are far from it: the data tell 5 % from its neighbours
    for q in (0.01, 0.10):
        assert abs(float(np.quantile(np.concatenate(pool), q)) - expect) > 10 * 2 ** -9 * abs(expect)


def test_regions_leave_a_zero_and_delta_zero_out():
    """docs/metrics.md#regions: A = 0 or δ = 0 → no region; the four sign combinations → their region."""
    from triage_monitor.batch import TokenBatch
    from triage_monitor.metrics.stats import REGIONS, MismatchStats
    delta = torch.tensor([-1.0, 1.0, 1.0, -1.0, 0.0, 0.0, -1.0, 1.0])
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 0.0, 0.0])
    names = []
    for d, a in zip(delta, adv):           # one token at a time: the region (if any) whose count it raises
        st = MismatchStats().update(TokenBatch.from_flat(d.reshape(1) - 2, torch.tensor([-2.0]), a.reshape(1),
                                                         torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)))
        hit = [r for r in REGIONS if st.sum(f"count_{r}") == 1]
        names.append(hit[0] if hit else None)
    assert names == ["amp_neg", "amp_pos", "con_neg", "con_pos", None, None, None, None]
