"""The default bounds of the off-policy corrections (docs/metrics.md#baselines) at, just inside and just outside
each bound: TIS [0, 2], IcePop [0.5, 2] (closed band), MIS [1/1.001, 1.001] on π_sampler/π_old (closed band).

The ratios are float32 ``exp`` of float32 log-ratios; ``_exact`` searches the float32 log-ratio whose ``exp`` is the
bound exactly (and its neighbours), so that ``<`` and ``<=`` give different answers.
"""

import math

import numpy as np
import pytest
import torch

from triage_monitor.triage.corrections import icepop_weights, mis_weights, tis_weights


def _exact(target, f=lambda x: torch.exp(torch.tensor(x, dtype=torch.float32)).item()):
    """float32 log-ratios (just below, at, just above) with f(x) <, ==, > float32(target)."""
    t = float(np.float32(target))
    x = np.float32(math.log(target))
    for _ in range(200):
        e = f(x)
        if e == t:
            break
        x = np.nextafter(x, np.float32(np.inf if e < t else -np.inf), dtype=np.float32)
    else:
        raise AssertionError(f"no float32 x with f(x) == {target}")
    lo = hi = x
    while f(lo) >= t:
        lo = np.nextafter(lo, np.float32(-np.inf), dtype=np.float32)
    while f(hi) <= t:
        hi = np.nextafter(hi, np.float32(np.inf), dtype=np.float32)
    return [float(lo), float(x), float(hi)]


def _ratios(log_ratios):
    old = torch.tensor(log_ratios, dtype=torch.float32)       # sampler 0: old − sampler = old exactly
    return old, torch.zeros_like(old)


def test_tis_default_band_zero_to_two():
    old, samp = _ratios(_exact(2.0) + [-30.0, 0.0])
    w = tis_weights(old, samp)
    r = torch.exp(old)
    assert w[:3].tolist() == [r[0].item(), 2.0, 2.0] and r[0].item() < 2.0 < r[2].item()
    assert w[3].item() == pytest.approx(math.exp(-30.0), rel=1e-5) and w[4].item() == 1.0   # lower bound 0: no floor


def test_icepop_default_closed_band_half_to_two():
    """Ratios just below / at / just above 0.5 and 2: the ones at the bounds are kept (closed band), the outer
    neighbours are zeroed, and a kept token keeps its ratio."""
    lr = _exact(0.5) + _exact(2.0)
    old, samp = _ratios(lr)
    r = torch.exp(old).tolist()
    assert icepop_weights(old, samp).tolist() == [0.0, 0.5, r[2], r[3], 2.0, 0.0]
    assert icepop_weights(old, samp, keep_ratio=False).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def _around(target, f):
    """float32 x just below and just above the line f(x) = float32(target) (no x need hit it exactly)."""
    t = float(np.float32(target))
    x = np.float32(math.log(target))
    step = np.float32(-np.inf) if f(x) > t else np.float32(np.inf)
    while (f(x) > t) == (step < 0):
        x = np.nextafter(x, step, dtype=np.float32)
    other = np.nextafter(x, -step, dtype=np.float32)
    below, above = (x, other) if f(x) < t else (other, x)
    assert f(below) < t < f(above) or f(below) < t == f(above) or f(below) == t < f(above)
    return float(below), float(above)


def test_mis_default_band_on_sampler_over_old():
    """One-token sequences: ρ = π_sampler/π_old = 1/exp(old − sampler) (float32, as the product computes it) just
    below / at / just above 1.001, and on each side of 1/1.001 (no float32 ρ equals float32(1/1.001) exactly:
    there the strictness cannot show).  Kept: inside or on the band; dropped: outside."""
    def rho(x):
        return (1.0 / torch.exp(torch.tensor(-x, dtype=torch.float32))).item()    # x = log ρ = −(old − sampler)

    hi = _exact(1.001, rho)
    lo_below, lo_above = _around(1.0 / 1.001, rho)
    xs = [lo_below, lo_above] + hi
    r = [rho(x) for x in xs]
    assert r[0] < float(np.float32(1 / 1.001)) <= r[1] and r[2] < float(np.float32(1.001)) == r[3] < r[4]
    old, samp = _ratios([-x for x in xs])
    w = mis_weights(old, samp, (torch.arange(5), 5))
    keep_lo = 1.0 if r[1] >= float(np.float32(1 / 1.001)) else 0.0
    assert w.tolist() == [0.0, keep_lo, 1.0, 1.0, 0.0]


def test_mis_band_is_closed_at_both_ends():
    """Band [0.5, 2] (reachable exactly in float32): ρ = 0.5 and ρ = 2 are kept, their outer neighbours dropped."""
    def rho(x):
        return (1.0 / torch.exp(torch.tensor(-x, dtype=torch.float32))).item()

    xs = _exact(0.5, rho) + _exact(2.0, rho)
    old, samp = _ratios([-x for x in xs])
    w = mis_weights(old, samp, (torch.arange(6), 6), high=2.0, low=0.5)
    assert w.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_sequence_forms_default_caps():
    """Sequence mask (product form): kept with weight ρ_s = exp(Σ log r) up to 3.0, dropped above (float64 ρ of a
    float32 log-ratio: no ρ equals 3 exactly, so the neighbours on each side pin it); no lower bound.  Sequence IS,
    product and geometric forms: capped at 2.  Two-token sequences with log-ratios (a, a)."""
    from triage_monitor.triage.corrections import (sequence_is_geometric_weights, sequence_is_product_weights,
                                            sequence_mask_weights)

    def rho(x):                                    # x = the float32 log-ratio of a one-token sequence
        return math.exp(float(np.float32(x)))

    below, above = _around(3.0, rho)
    old, samp = _ratios([below, above, -1.0])
    w = sequence_mask_weights(old, samp, (torch.arange(3), 3))
    assert w.tolist() == [pytest.approx(rho(below), rel=1e-6), 0.0, pytest.approx(math.exp(-1.0), rel=1e-6)]
    old, samp = _ratios([0.5, 0.5, 0.25, 0.25])    # sequence 0: Σ = 1 (e = 2.72 → 2), mean 0.5 (1.65); seq 1: Σ 0.5
    seq = (torch.tensor([0, 0, 1, 1]), 2)
    assert sequence_is_product_weights(old, samp, seq).tolist() == pytest.approx(
        [2.0, 2.0, math.exp(0.5), math.exp(0.5)], rel=1e-6)
    old, samp = _ratios([1.0, 1.0, 0.25, 0.25])    # geometric: mean 1 → e → 2; mean 0.25 → 1.28
    assert sequence_is_geometric_weights(old, samp, seq).tolist() == pytest.approx(
        [2.0, 2.0, math.exp(0.25), math.exp(0.25)], rel=1e-6)


def test_a_band_needs_low_strictly_below_high():
    """low = high is an empty band: refused, naming the correction and both bounds; low = 0 is allowed."""
    old, samp = _ratios([0.0, 0.5])
    for fn in (tis_weights, icepop_weights):
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: need 0 <= low < high, got low=1.0, high=1.0$"):
            fn(old, samp, low=1.0, high=1.0)
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: need 0 <= low < high, got low=-0.5, high=2.0$"):
            fn(old, samp, low=-0.5, high=2.0)
    assert tis_weights(old, samp, low=0.0, high=1.5).tolist() == pytest.approx([1.0, 1.5])
