"""The one-pass CPU kernel (triage_monitor.state_kernel) and the torch path compute the same state.

Two implementations of the same definitions (docs/metrics.md#state): the torch operations (used on
accelerators) and the compiled CPU loop.  Every count (tokens, responses, region counts, segments, the C_tok
table, the δ sketch, min and max) must be equal; the float64 sums agree to rounding (rel 1e-12).
"""

import math

import numpy as np
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.metrics import SUM_FIELDS, MetricConfig, MismatchStats, MetricTracker

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


def _torch_path(monkeypatch, fn):
    monkeypatch.setattr(MismatchStats, "use_kernel", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(MismatchStats, "use_kernel", True)


def _assert_same(kernel: MismatchStats, reference: MismatchStats):
    k, r = kernel.state.numpy(), reference.state.numpy()
    sl = kernel.layout.slices
    for name, a, b in zip(SUM_FIELDS, k[sl["sums"]], r[sl["sums"]]):
        if name in ROUNDED:
            assert a == pytest.approx(b, rel=1e-12, abs=1e-300), name
        else:
            assert a == b, name
    for part in ("delta_sketch", "c_tok_table", "delta_min", "delta_max"):
        assert np.array_equal(k[sl[part]], r[sl[part]]), part


@pytest.mark.parametrize("width", [64, 16, 50])
@pytest.mark.parametrize("seed,big,zero_adv", [(0, False, False), (1, True, False), (2, False, True)])
def test_kernel_state_equals_torch_state(monkeypatch, width, seed, big, zero_adv):
    cfg = MetricConfig(segment_width=width)
    b = _batch(seed, big=big, zero_adv=zero_adv)
    for tau in (-0.2, math.nan):
        kernel = MismatchStats(cfg).update(b, tau)
        reference = _torch_path(monkeypatch, lambda: MismatchStats(cfg).update(b, tau))
        _assert_same(kernel, reference)
        kv, rv = kernel.compute().values, reference.compute().values
        for name in ("c_tok", "h_seg", "r_amp", "p_adj", "dilution", "delta_q05", "delta_min", "n_samples"):
            assert kv[name] == rv[name] or (math.isnan(kv[name]) and math.isnan(rv[name])), name


def test_tracker_split_update_equals_one_pass(monkeypatch):
    """While τ_tail calibrates, the tracker adds the magnitude part, calibrates, then the localisation part:
    the two kernel calls give the state of one update, and the torch path's."""
    cfg = MetricConfig(segment_width=16)
    bs = [_batch(10 + i) for i in range(4)]
    tr = MetricTracker(cfg, window=2, calibration_steps=2)
    ref = _torch_path(monkeypatch, lambda: MetricTracker(cfg, window=2, calibration_steps=2))
    for i, b in enumerate(bs):
        tr.step(i, b)
        _torch_path(monkeypatch, lambda: ref.step(i, b))
        assert tr.tau_tail == ref.tau_tail
        _assert_same(tr._history[-1][1], ref._history[-1][1])
        one = MismatchStats(cfg).update(b, tr.tau_tail)
        assert np.array_equal(one.state.numpy(), tr._history[-1][1].state.numpy())


def test_unsorted_rows_fall_back_to_torch_order_check():
    """Rows out of (sample, position) order are refused by the kernel (nothing added)."""
    from triage_monitor import state_kernel as K

    st = MismatchStats(MetricConfig(segment_width=16))
    before = st.state.numpy().copy()
    args = (np.zeros(3, np.float32), np.ones(3, np.float32), np.array([0, 1, 0]), np.array([0, 0, 1]), 2)
    status = K.update_state(st.state.numpy(), st.layout.slices, SUM_FIELDS, *args, mode=K.BOTH, tau_tail=-0.2,
                            width=16, small_gap_threshold=0.05, heavy_fraction=0.1, dilution_threshold=0.05)
    assert status == K.UNSORTED and np.array_equal(st.state.numpy(), before)


def test_pieces_and_threads_do_not_change_the_state(monkeypatch):
    """A batch is cut into response-aligned pieces whose sums are added in piece order: the state is the same
    bits on 1 or 2 threads, and its counts equal the one-piece state's."""
    from triage_monitor import state_kernel as K

    cfg = MetricConfig(segment_width=16)
    b = _batch(5, B=80, T=300)
    whole = MismatchStats(cfg).update(b, -0.2)
    monkeypatch.setattr(K, "PIECE_TOKENS", 500)
    assert len(K._cuts(b.sample_index.numpy(), 500)) > 10
    one = MismatchStats(cfg).update(b, -0.2)
    monkeypatch.setattr(K, "THREADS", 2)
    two = MismatchStats(cfg).update(b, -0.2)
    assert np.array_equal(one.state.numpy(), two.state.numpy())
    _assert_same(one, whole)


def test_tracker_window_equals_the_ordered_merge_bit_for_bit():
    """The tracker keeps the window's integer count fields as a running sum (added on entry, subtracted on
    expiry or replacement): its window state equals the in-order merge of the window's step states exactly."""
    from triage_monitor.metrics import state_layout

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

    from triage_monitor.state_kernel import _exp_into

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
    from triage_monitor.metrics import MetricConfig, MetricTracker, MismatchStats

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
