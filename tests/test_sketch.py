"""The fixed-size metric state: the δ quantile sketch against exact order statistics on adversarial data,
the C_tok count table against the per-segment ranking, and the state's size, merge and window."""

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from triage_monitor.metrics import sketch
from triage_monitor.batch import TokenBatch
from triage_monitor.metrics.stats import (MetricConfig, MetricTracker, MismatchStats, c_tok_from_segments,
                                    c_tok_from_table, state_layout)
from triage_monitor.offline.stages import tail_layout
from triage_monitor.metrics.sketch import quantile_error_bound, sketch_counts, sketch_quantiles

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=bool(os.environ.get("CI")))
LEVELS = (0.0, 0.01, 0.05, 0.25, 0.5, 0.95, 0.99, 1.0)

f32 = dict(width=32, allow_nan=False, allow_infinity=False)
# adversarial δ: exact zeros and signed zeros, subnormal-small values, heavy tails up to ±1000 nats (beyond ±40),
# and point masses (a few distinct values repeated)
wide = st.one_of(st.just(0.0), st.just(-0.0), st.floats(-2.0 ** -23, 2.0 ** -23, **f32), st.floats(-1000, 1000, **f32),
                 st.floats(-40, 40, **f32), st.sampled_from([-45.5, -0.2421875, 0.0, 2.0 ** -10, 60.0]))


def _check(values: np.ndarray):
    d = torch.from_numpy(values.astype(np.float32))
    exact = np.sort(d.double().numpy())
    got = sketch_quantiles(sketch_counts(d), LEVELS, float(exact[0]), float(exact[-1]))
    for q, g in zip(LEVELS, got):
        ref = float(np.quantile(exact, q))
        assert abs(g - ref) <= quantile_error_bound(exact, q) * (1 + 1e-12), (q, g, ref)


@SETTINGS
@given(arrays(np.float32, st.integers(1, 400), elements=wide))
def test_sketch_quantiles_within_the_stated_bound(values):
    _check(values)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.sampled_from(["cauchy", "zeros", "far", "lognormal"]))
def test_sketch_bound_on_large_heavy_tailed_samples(seed, kind):
    rng = np.random.default_rng(seed)
    n = 20_000
    if kind == "cauchy":              # heavy tails: |δ| up to 999 nats, inside the buckets' 2^11
        v = np.clip(rng.standard_cauchy(n) * 0.05, -999, 999)
    elif kind == "zeros":             # a point mass at 0 holding the median and most quantiles
        v = np.where(rng.random(n) < 0.9, 0.0, rng.normal(0, 0.3, n))
    elif kind == "far":               # a collapsed run: values beyond ±40 nats
        v = np.where(rng.random(n) < 0.2, -rng.uniform(40, 900, n), rng.normal(0, 1e-3, n))
    else:
        v = -np.minimum(rng.lognormal(-3, 3, n), 999)    # |δ| < 1000 nats: inside the buckets' 2^11
    _check(v)


def test_sketch_is_not_trivially_exact_and_its_bound_is_relative():
    v = torch.tensor([-0.2421, -0.2422, -0.1, 0.3], dtype=torch.float32)
    got = sketch_quantiles(sketch_counts(v), [1 / 3])[0]        # the 2nd smallest, -0.2421, by its bucket
    exact = float(v.double().sort().values[1])
    assert got != exact and abs(got - exact) <= sketch.RELATIVE_ERROR * abs(exact)
    assert sketch.RELATIVE_ERROR == 2 ** -9 and sketch.SIZE * 8 < 200_000     # ~0.2 %, fixed ~127 KB


def test_sketch_merges_by_sum_exactly():
    rng = np.random.default_rng(1)
    a, b = (torch.from_numpy(rng.normal(0, 1, 5000).astype(np.float32)) for _ in range(2))
    assert torch.equal(sketch_counts(a) + sketch_counts(b), sketch_counts(torch.cat([a, b])))
    assert sketch_quantiles(torch.zeros(sketch.SIZE, dtype=torch.float64), [0.5]) != [0.0]   # NaN when empty
    assert math.isnan(sketch_quantiles(torch.zeros(sketch.SIZE, dtype=torch.float64), [0.5])[0])


def test_bucket_index_is_monotone_and_sign_symmetric():
    x = torch.tensor([-2000.0, -40.0, -1.0, -1e-6, -1e-9, -0.0, 0.0, 1e-9, 1e-6, 1.0, 40.0, 2000.0])
    idx = sketch.bucket_index(x)
    assert (idx[1:] >= idx[:-1]).all() and idx[0] >= 0 and idx[-1] < sketch.SIZE
    assert (idx + idx.flip(0) == 2 * sketch.HALF).all()
    assert idx[4] == idx[5] == idx[6] == idx[7] == sketch.HALF        # |δ| < 2^-20: the zero bucket


# --------------------------------------------------------------------------- C_tok from counts
@SETTINGS
@given(st.integers(1, 12).flatmap(lambda W: st.tuples(
    st.just(W), st.lists(st.integers(1, W).flatmap(lambda v: st.tuples(st.just(v), st.integers(0, v))),
                         max_size=300))), st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_c_tok_from_counts_equals_per_segment_ranking(data, top):
    W, segs = data
    valid = torch.tensor([v for v, _ in segs], dtype=torch.long)
    tail = torch.tensor([t for _, t in segs], dtype=torch.long)
    table = torch.bincount(valid * (W + 1) + tail, minlength=(W + 1) ** 2).double()
    ref = c_tok_from_segments(tail, valid, top)
    got = c_tok_from_table(table, W, top)
    assert (math.isnan(ref) and math.isnan(got)) or got == pytest.approx(ref, rel=1e-15, abs=0)


def _random_batch(seed, B=40, T=300):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1 - (torch.rand(B, T, generator=g) < 0.05) * 4).clamp(max=0)
    mask = (torch.arange(T)[None] < torch.randint(10, T + 1, (B, 1), generator=g)) & \
        (torch.rand(B, T, generator=g) < 0.9)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), mask)


def test_state_is_fixed_size_and_c_tok_exact_on_batches():
    cfg = MetricConfig(segment_width=16)
    sizes = set()
    for seed, (B, T) in enumerate([(4, 20), (40, 300), (200, 800)]):
        b = _random_batch(seed, B, T)
        st_ = MismatchStats(cfg).update(b, -0.2)
        sizes.add(st_.nbytes)
        ref = tail_layout(b, -0.2, 16)                          # the segments listed one by one
        assert st_.compute().values["c_tok"] == c_tok_from_segments(torch.as_tensor(ref.tail), torch.as_tensor(ref.valid))
    assert sizes == {state_layout(16).size * 8} and state_layout(64).size * 8 < 200_000


def test_window_is_the_merge_of_its_step_states():
    tr = MetricTracker(MetricConfig(segment_width=16), window=3, tau_tail=-0.2)
    bs = [_random_batch(10 + i) for i in range(5)]
    for i, b in enumerate(bs):
        _, w = tr.step(i, b)
    pooled = MismatchStats(tr.config)
    for b in bs[2:]:
        pooled.update(b, -0.2)
    assert w.values["n_tokens"] == pooled.compute().values["n_tokens"]
    for k, v in pooled.compute().values.items():
        assert (math.isnan(v) and math.isnan(w.values[k])) or w.values[k] == pytest.approx(v, rel=1e-12), k
    assert len(tr._history) == 3          # the window keeps 3 fixed-size vectors, never token values


def test_cpu_update_in_response_aligned_pieces_equals_one_piece(monkeypatch):
    import triage_monitor.metrics.state_kernel as K

    cfg = MetricConfig(segment_width=16)
    b = _random_batch(3, B=60, T=300)
    whole = MismatchStats(cfg).update(b, -0.2).compute().values
    monkeypatch.setattr(K, "PIECE_TOKENS", 97)                    # many pieces, cut at response boundaries
    assert len(K._cuts(b.sample_index.numpy(), 97)) > 20
    pieces = MismatchStats(cfg).update(b, -0.2).compute().values
    for k, v in whole.items():
        assert (math.isnan(v) and math.isnan(pieces[k])) or pieces[k] == pytest.approx(v, rel=1e-12), k
    for k in ("n_tokens", "n_samples", "c_tok", "h_seg", "r_amp", "p_adj", "dilution", "delta_q05", "delta_min"):
        assert pieces[k] == whole[k] or (math.isnan(whole[k]) and math.isnan(pieces[k])), k


ZERO_STEPS = (9, 19, 29)          # exact zeros of the three reference steps, each step also holding one δ = −2


def _zero_step(zeros: int) -> torch.Tensor:
    return torch.tensor([-2.0] + [0.0] * zeros)


def test_tau_tail_counts_the_exact_zeros_of_every_reference_step(tmp_path):
    """τ_tail over reference steps holding exact zeros (δ = 0: learner == sampler) depends on every step's zero
    bucket.  By hand: 3 values −2 and 9 + 19 + 29 = 57 zeros, 60 in all; the 5 % quantile sits at h = 0.05 · 59 =
    2.95 between x₍₂₎ = −2 and x₍₃₎ = 0: −2 + 0.95 · 2 = −0.1 (the sketch is exact here: 0 is the zero bucket's
    estimate and −2 the exact minimum).  A merge that dropped the zero bucket of the steps after the first would
    hold 3 + 9 values and give −2.  Checked on the merge itself, the reference window the live monitor and the
    controller use, the live tracker and monitor, and the offline recomputation."""
    from triage_monitor.metrics import calibration
    from triage_monitor.offline.analysis import open_run, recompute
    from triage_monitor.metrics.stats import tau_from_calibration
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    parts = [calibration.part_of(_zero_step(z)) for z in ZERO_STEPS]
    merged = calibration.merge_parts(parts)
    assert merged[sketch.HALF].item() == 57 and calibration.part_count(merged) == 60
    assert (merged[sketch.SIZE].item(), merged[sketch.SIZE + 1].item()) == (-2.0, 0.0)
    values = np.concatenate([_zero_step(z).numpy() for z in ZERO_STEPS]).astype(np.float64)
    assert float(np.quantile(values, 0.05)) == pytest.approx(-0.1, abs=1e-12)
    assert calibration.part_quantiles(merged, [0.05])[0] == pytest.approx(-0.1, abs=1e-12)
    assert tau_from_calibration(parts, 0.05) == pytest.approx(-0.1, abs=1e-12)           # the offline reading

    window = calibration.ReferenceWindow(3)
    for step, part in enumerate(parts):
        assert not window.add(step, [part])
    assert window.add(3, [calibration.part_of(_zero_step(1))]) and window.frozen        # step 3: frozen, not added
    assert window.quantiles(0, [0.05])[0] == pytest.approx(-0.1, abs=1e-12)

    def batch(zeros):
        d = _zero_step(zeros)
        sampler = torch.where(d == 0, torch.tensor(-0.7), torch.tensor(-0.5))
        return TokenBatch.from_flat(sampler + d, sampler, -torch.ones(d.numel()), torch.zeros(d.numel(), dtype=torch.long),
                                    torch.arange(d.numel()))

    assert batch(9).delta.tolist() == [-2.0] + [0.0] * 9                                    # exact zeros
    tracker = MetricTracker(window=5, calibration_steps=3)
    for step, z in enumerate((*ZERO_STEPS, 1)):
        tracker.step(step, batch(z))
    assert tracker.tau_frozen and tracker.tau_tail == pytest.approx(-0.1, abs=1e-12)

    with MismatchMonitor(tmp_path / "run", MonitorConfig(calibration_steps=3)) as mon:
        for step, z in enumerate((*ZERO_STEPS, 1)):
            mon.log_step(step, batch(z))
    run = open_run(tmp_path / "run")
    live = run.steps().set_index("step")
    assert live.loc[3, "tau_tail"] == pytest.approx(-0.1, abs=1e-12) and live.loc[3, "tau_tail_frozen"] == 1.0
    assert run.tau_tail == pytest.approx(-0.1, abs=1e-12)
    offline = recompute(run)
    assert offline["tau_tail"].tolist() == pytest.approx([-0.1] * 4, abs=1e-12)
