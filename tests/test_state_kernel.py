"""The one update of the metric state (triage_monitor.state_kernel) against independent counts.

The kernel is the only code that writes the state from tokens.  Here it is checked against plain numpy
written from docs/metrics.md (every count exact, the float64 sums to rounding, rel 1e-12), its segments against
:mod:`triage_monitor.metrics.segments` (the segments the controller and the stage table cut: the C_tok table of
(valid, tail) counts per segment must be equal cell for cell), and its declaration: a declared field it does not
write fails the first update.
"""

import math

import numpy as np
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.metrics.stats import SUM_FIELDS, MetricConfig, MismatchStats, MetricTracker
from triage_monitor.metrics.segments import segment_tokens

ROUNDED = {"delta_sum", "delta_abs_sum", "k3_sum", "exp_r_sq_sum", "log_ppl_diff_sum", "abs_adv_sum",
           "mass_amp_neg", "mass_amp_pos", "mass_con_neg", "mass_con_pos", "lennorm_amp_neg", "lennorm_amp_pos"}


def _batch(seed, B=40, T=300, big=False, zero_adv=False):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(B, T, generator=g) * 3
    noise = torch.randn(B, T, generator=g) * (30.0 if big else 0.1)       # big: δ beyond the ±20 clamp
    lp = (s + noise - (torch.rand(B, T, generator=g) < 0.05) * 4).clamp(max=0)
    lp = torch.where(torch.rand(B, T, generator=g) < 0.05, s, lp)          # point mass at δ = 0
    mask = (torch.arange(T)[None] < torch.randint(0, T + 1, (B, 1), generator=g)) & \
        (torch.rand(B, T, generator=g) < 0.9)                               # empty responses, holes
    adv = torch.randn(B, T, generator=g)                                    # per token, not constant
    if zero_adv:
        adv[::3] = 0.0
    return TokenBatch.from_padded(lp, s, adv, mask)


def _expected_sums(b: TokenBatch, tau: float, cfg: MetricConfig) -> dict:
    """The additive state of docs/metrics.md#state for ``b``, token by token and segment by segment (numpy)."""
    d = b.delta.numpy().astype(np.float64)
    a = b.advantage.numpy().astype(np.float64)
    si, pos = b.sample_index.numpy(), b.position.numpy()
    d32, a32 = b.delta.numpy(), b.advantage.numpy()
    region = np.select([(a32 < 0) & (d32 < 0), (a32 > 0) & (d32 > 0), (a32 < 0) & (d32 > 0), (a32 > 0) & (d32 < 0)],
                       [0, 1, 2, 3], 4)
    nv = np.bincount(si, minlength=b.num_samples)
    out = {"n_tokens": len(d), "n_responses_all": b.num_samples, "n_responses_nonempty": int((nv > 0).sum()),
           "small_gap_count": int((np.abs(d) < cfg.small_gap_threshold).sum()), "delta_sum": d.sum(),
           "delta_abs_sum": np.abs(d).sum(), "k3_sum": (np.exp(d) - d - 1).sum(),
           "exp_r_sq_sum": (np.exp(np.clip(d, -20, 20)) ** 2).sum(),
           "log_ppl_diff_sum": -sum(d[si == s].mean() for s in range(b.num_samples) if nv[s]),
           "abs_adv_sum": np.abs(a).sum()}
    for r, name in enumerate(("amp_neg", "amp_pos", "con_neg", "con_pos")):
        out[f"mass_{name}"] = np.abs(a[region == r]).sum()
        out[f"count_{name}"] = int((region == r).sum())
    for r, name in ((0, "amp_neg"), (1, "amp_pos")):
        out[f"lennorm_{name}"] = sum(np.abs(a[(region == r) & (si == s)]).sum() / nv[s] for s in range(b.num_samples)
                                     if nv[s])
    loc = dict.fromkeys(("neg_valid_tokens", "tail_tokens", "segments", "heavy_segments", "pairs", "pairs_heavy",
                         "pairs_prev_heavy", "pairs_both_heavy", "responses_with_heavy", "responses_diluted"), 0)
    if not math.isnan(tau):
        for s in range(b.num_samples):
            sel = si == s
            if not sel.any() or a[sel].sum() >= 0:
                continue
            segs = {}
            for p, t in zip(pos[sel], (a32[sel] < 0) & (d32[sel] < np.float32(tau))):
                v = segs.setdefault(int(p) // cfg.segment_width, [0, 0])
                v[0] += 1
                v[1] += int(t)
            heavy = {k: t > cfg.heavy_fraction * v for k, (v, t) in segs.items()}
            loc["neg_valid_tokens"] += int(sel.sum())
            loc["tail_tokens"] += sum(t for _, t in segs.values())
            loc["segments"] += len(segs)
            loc["heavy_segments"] += sum(heavy.values())
            for k in segs:
                if k - 1 in segs:
                    loc["pairs"] += 1
                    loc["pairs_heavy"] += heavy[k]
                    loc["pairs_prev_heavy"] += heavy[k - 1]
                    loc["pairs_both_heavy"] += heavy[k] and heavy[k - 1]
            if any(heavy.values()):
                loc["responses_with_heavy"] += 1
                loc["responses_diluted"] += abs(d[sel].mean()) < cfg.dilution_threshold
    return {**out, **loc}


def _assert_sums(stats: MismatchStats, want: dict):
    for name in SUM_FIELDS:
        got = stats.sum(name)
        if name in ROUNDED:
            assert got == pytest.approx(want[name], rel=1e-12, abs=1e-300), name
        else:
            assert got == want[name], name


@pytest.mark.parametrize("width", [64, 16, 50])
@pytest.mark.parametrize("seed,big,zero_adv", [(0, False, False), (1, True, False), (2, False, True)])
def test_the_state_equals_the_definitions_counted_by_hand(width, seed, big, zero_adv):
    """Every additive field against numpy loops; δ's min and max exact; the sketch holds every token once."""
    cfg = MetricConfig(segment_width=width)
    b = _batch(seed, big=big, zero_adv=zero_adv)
    for tau in (-0.2, math.nan):
        st = MismatchStats(cfg).update(b, tau)
        _assert_sums(st, _expected_sums(b, tau, cfg))
        assert float(st.part("delta_min")[0]) == float(b.delta.min())
        assert float(st.part("delta_max")[0]) == float(b.delta.max())
        assert float(st.part("delta_sketch").sum()) == b.num_tokens


@pytest.mark.parametrize("width", [64, 16, 3])
def test_the_kernels_segments_are_the_segments_module_s(width):
    """The C_tok table counts the A<0 responses' segments by (valid, tail): built from
    triage_monitor.segments.segment_tokens (the Gate's and the stage table's segments) it is equal cell for cell."""
    cfg = MetricConfig(segment_width=width)
    b = _batch(4, B=30, T=200)
    tau = -0.1
    seg = segment_tokens(b.sample_index, b.position, width)
    tail = seg.sum(((b.advantage < 0) & (b.delta < tau)).long())
    nv = torch.bincount(b.sample_index, minlength=b.num_samples).clamp(min=1).double()
    resp_adv = torch.zeros(b.num_samples, dtype=torch.float64).index_add(0, b.sample_index, b.advantage.double())
    keep = (resp_adv / nv)[seg.sample] < 0
    table = torch.bincount(seg.count[keep] * (width + 1) + tail[keep], minlength=(width + 1) ** 2).double()
    got = MismatchStats(cfg).update(b, tau).part("c_tok_table")
    assert torch.equal(got, table) and got.sum() == keep.sum() > 10


def test_a_declared_field_the_kernel_does_not_write_fails_the_first_update(monkeypatch):
    from triage_monitor.metrics import state_kernel as K

    fields = (*K.SUM_FIELD_PASSES, ("new_sum", K.MAGNITUDE))
    monkeypatch.setattr(K, "SUM_FIELD_PASSES", fields)
    monkeypatch.setattr(K, "N_SUMS", len(fields))
    state = np.zeros(200_000)
    slices = {"sums": slice(0, len(fields)), "delta_sketch": slice(100, 100 + 1000), "c_tok_table": slice(5000, 6000),
              "delta_min": slice(7000, 7001), "delta_max": slice(7001, 7002)}
    with pytest.raises(AssertionError, match=r"declared state field\(s\) \['new_sum'\] not written by the kernel"):
        K.update_state(state, slices, np.zeros(3, np.float32), np.ones(3, np.float32), np.zeros(3, np.int64),
                       np.arange(3), 1, mode=K.BOTH, tau_tail=-0.2, width=16, small_gap_threshold=0.05,
                       heavy_fraction=0.1, dilution_threshold=0.05)


def test_tracker_split_update_equals_one_pass():
    """While τ_tail calibrates, the tracker adds the magnitude part, calibrates, then the localisation part: the
    two passes give the state of one update, bit for bit."""
    cfg = MetricConfig(segment_width=16)
    tr = MetricTracker(cfg, window=2, calibration_steps=2)
    for i in range(4):
        b = _batch(10 + i)
        tr.step(i, b)
        one = MismatchStats(cfg).update(b, tr.tau_tail)
        assert np.array_equal(one.state.numpy(), tr._history[-1][1].state.numpy())


def test_unsorted_rows_are_refused():
    """Rows out of (sample, position) order are refused by the kernel (nothing added), and by update_flat with a
    clear error."""
    from triage_monitor.metrics import state_kernel as K

    st = MismatchStats(MetricConfig(segment_width=16))
    before = st.state.numpy().copy()
    args = (np.zeros(3, np.float32), np.ones(3, np.float32), np.array([0, 1, 0]), np.array([0, 0, 1]), 2)
    status = K.update_state(st.state.numpy(), st.layout.slices, *args, mode=K.BOTH, tau_tail=-0.2,
                            width=16, small_gap_threshold=0.05, heavy_fraction=0.1, dilution_threshold=0.05)
    assert status == K.UNSORTED and np.array_equal(st.state.numpy(), before)
    with pytest.raises(ValueError, match=r"not ordered by \(sample, position\)"):
        st.update_flat(*(torch.as_tensor(x) for x in args[:4]), 2, -0.2)


def test_pieces_do_not_change_the_counts(monkeypatch):
    """A batch is cut into response-aligned pieces whose sums are added in piece order: the counts equal the
    one-piece state's, the float sums agree to rounding."""
    from triage_monitor.metrics import state_kernel as K

    cfg = MetricConfig(segment_width=16)
    b = _batch(5, B=80, T=300)
    whole = MismatchStats(cfg).update(b, -0.2)
    monkeypatch.setattr(K, "PIECE_TOKENS", 500)
    assert len(K._cuts(b.sample_index.numpy(), 500)) > 10
    pieces = MismatchStats(cfg).update(b, -0.2)
    _assert_sums(pieces, {n: whole.sum(n) for n in SUM_FIELDS})
    for part in ("delta_sketch", "c_tok_table", "delta_min", "delta_max"):
        assert torch.equal(pieces.part(part), whole.part(part)), part


def test_tracker_window_equals_the_ordered_merge_bit_for_bit():
    """The tracker keeps the window's integer count fields as a running sum (added on entry, subtracted on
    expiry or replacement): its window state equals the in-order merge of the window's step states exactly."""
    from triage_monitor.metrics.stats import state_layout

    cfg = MetricConfig(segment_width=16)
    tr = MetricTracker(cfg, window=3, tau_tail=-0.2)
    for step in (0, 1, 2, 2, 3, 5, 6, 7, 7, 9):                    # repeated steps replace, gaps expire
        b = _batch(100 + step)
        tr.step(step, b)
        hist = [st.state for _, st in tr._history]
        ref = state_layout(16).reduce(hist)
        window = MismatchStats(cfg, state=ref, tau_tail=-0.2).compute().values
        _, got = tr.push(step, tr._history[-1][1])                  # the same step again: replaced, recomputed
        for k, v in window.items():
            assert got.values[k] == v or (math.isnan(v) and math.isnan(got.values[k])), (step, k)


def test_vectorised_exp_within_one_ulp_of_the_library_exp():
    """The kernel's exp(δ) (state_kernel._exp_into) against math.exp, an independent implementation: within 1 ulp
    on δ from the realistic (|δ| < 1) to the extreme (±745 nats, beyond which exp over- or underflows), exactly 1
    at δ = 0 (so k3 = 0 there), and the library's own value for inf, -inf, NaN, overflow and underflow."""
    import math

    from triage_monitor.metrics.state_kernel import _exp_into

    rng = np.random.default_rng(7)
    special = [0.0, -0.0, 1e-30, -1e-30, 700.0, -700.0, 709.7, 709.8, -745.0, -746.0, 88.7, -103.9,
               np.inf, -np.inf, np.nan]
    d = np.concatenate([rng.standard_normal(200_000) * 0.05, rng.standard_normal(50_000) * 5,
                        rng.uniform(-760, 760, 50_000), special]).astype(np.float32)
    out, work = np.empty(d.size), np.empty(d.size)
    _exp_into(d, out, work)
    def library_exp(x):
        try:
            return math.exp(x)
        except OverflowError:
            return math.inf

    ref = np.array([library_exp(float(x)) for x in d.astype(np.float64)])
    ref[np.isnan(d)] = np.nan
    normal = np.isfinite(ref) & (ref > 2.3e-308)
    assert np.all(np.abs(out[normal] - ref[normal]) <= np.spacing(ref[normal]))
    np.testing.assert_array_equal(out[~normal], ref[~normal])
    assert out[d.size - len(special)] == 1.0 and out[d.size - len(special) + 1] == 1.0


def test_trailing_window_is_the_step_order_merge_bit_for_bit():
    """MetricTracker.push's window (count fields as a running sum, the float sums and min/max merged state by
    state) equals the metrics of StateLayout.reduce of the window's step states in step order, bit for bit, with
    float sums whose total depends on the order of addition (1e16 + 1 - 1e16); and merge_all_into_spans over
    the whole state equals reduce."""
    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.metrics.stats import MetricConfig, MetricTracker, MismatchStats

    cfg = MetricConfig(segment_width=16)
    tr = MetricTracker(cfg, window=3, tau_tail=-0.5)
    rng = np.random.default_rng(3)
    pushed = []
    for step in range(6):
        lp = torch.tensor(rng.normal(-3, 0.3, (4, 40)), dtype=torch.float32)
        sp = (lp + torch.tensor(rng.normal(0, 0.2, (4, 40)), dtype=torch.float32)).clamp(max=-1e-3)
        adv = torch.tensor(rng.normal(0, 1, (4, 1)), dtype=torch.float32).expand(4, 40)
        stats = MismatchStats(cfg).update(TokenBatch.from_padded(lp, sp, adv, torch.ones(4, 40)), -0.5)
        sums = stats.layout.slices["sums"]
        stats.state[sums] += torch.tensor(rng.choice([1e16, 1.0, -1e16, 0.1], sums.stop - sums.start))
        pushed.append(stats)
        _, window = tr.push(step, stats)
        layout = stats.layout
        last = [st.state for st in pushed[-3:]]
        expect = layout.reduce(last)
        assert torch.equal(layout.merge_all_into_spans(layout.identity(), last, [(0, layout.size)]), expect)
        want = MismatchStats(cfg, state=expect, tau_tail=-0.5).compute().values
        assert window.values.keys() == want.keys()
        for k, v in want.items():
            assert (v == window.values[k]) or (v != v and window.values[k] != window.values[k]), k
