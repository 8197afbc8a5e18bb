"""A fixed-size, mergeable quantile sketch of δ (nats): a log-spaced histogram on float32 bit patterns.

The quantiles of δ (``delta_q01``, ``delta_q05``, ``delta_q50``) and τ_tail come from this sketch
instead of exact order statistics, so a step's state has a fixed size whatever its token count, two
sketches merge by adding their counts (across steps of a window and across ranks, with one
all-reduce), and live and offline use the very same buckets.

Buckets.  A float32 δ is bucketed by its sign, its exponent and the top :data:`MANTISSA_BITS`
mantissa bits (integer operations on the bit pattern: no ``log``, so every device puts a value in
the same bucket).  Bucket ``[lo, hi)`` of \\|δ\\| has ``hi / lo ≤ 1 + 2^-m``; values with
\\|δ\\| < :data:`ZERO_BELOW` share one zero bucket; \\|δ\\| ≥ 2^11 nats (a learner that has diverged:
validated log-probs lie in (−1e8, 0]) is clamped into the last bucket; its estimate is then clamped to the
exact min / max, and beyond 2^11 nats the bound below does not hold.  The sketch holds
:data:`SIZE` float64 counts (~127 KB), bucket ``i`` ordered by value.

Error bound (docs/metrics.md#quantile-sketch).  Each order statistic ``x_(k)`` is estimated by the
representative ``2·lo·hi / (lo + hi)`` of its bucket (0 for the zero bucket), clamped to the exact
``[min, max]`` when those are given, so

    |x̂_(k) − x_(k)| ≤ :data:`RELATIVE_ERROR` · |x_(k)| + :data:`ZERO_BELOW`     (RELATIVE_ERROR = 2^-(m+1))

and the linearly interpolated quantile (numpy's default method) at ``h = q·(n−1)``, ``k = ⌊h⌋``,
``f = h − k``, satisfies ``|q̂ − q| ≤ RELATIVE_ERROR · ((1−f)|x_(k)| + f|x_(k+1)|) + ZERO_BELOW``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:                  # torch only where a tensor is bucketed: reading a sketch needs numpy alone
    from torch import Tensor

#: Mantissa bits kept per bucket: relative bucket width 2^-8.
MANTISSA_BITS = 8
#: Bound on the relative error of an estimated order statistic (outside the zero bucket): 2^-9 ≈ 0.195 %.
RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)
#: |δ| below this (nats) falls in the zero bucket (estimate 0): the absolute part of the bound.
ZERO_BELOW = 2.0 ** -20
#: Binades covered above ZERO_BELOW: |δ| up to 2^11 nats.
_BINADES = 31
_SHIFT = 23 - MANTISSA_BITS
_KEY_LO = (127 - 20) << MANTISSA_BITS           # key (exponent ‖ top mantissa bits) of ZERO_BELOW
#: Buckets per sign.
HALF = _BINADES << MANTISSA_BITS
#: Length of a sketch: HALF negative buckets, the zero bucket, HALF positive buckets.
SIZE = 2 * HALF + 1


def bucket_index(delta: Tensor) -> Tensor:
    """``(N,)`` int32 bucket of each δ in ``[0, SIZE)``, monotone in δ.

    Args:
        delta: ``(N,)`` float32 (nats), any device; other float dtypes are rounded to float32 first.
    """
    import torch

    d = delta.detach()
    if d.dtype != torch.float32:
        d = d.float()
    u = d.contiguous().view(torch.int32)
    k = ((u & 0x7FFFFFFF) >> _SHIFT).sub_(_KEY_LO - 1).clamp_(0, HALF)   # 1 = [2^-20, 2^-20·(1+2^-m)), 0 below
    sign = u >> 31                                                       # -1 for negative δ (and -0.0), else 0
    return k.bitwise_xor_(sign).sub_(sign).add_(HALF)                  # HALF ± k


def sketch_counts(delta: Tensor) -> Tensor:
    """``(SIZE,)`` float64 counts of ``delta`` (``(N,)`` float32 nats) per bucket, on ``delta``'s device."""
    import torch

    return torch.bincount(bucket_index(delta), minlength=SIZE).double()


def host_array(x) -> np.ndarray:
    """A numpy view (or host copy) of ``x``: an array, or a tensor on any device."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _representatives() -> np.ndarray:
    """``(SIZE,)`` float64 value reported for each bucket (see module docstring)."""
    keys = np.arange(_KEY_LO, _KEY_LO + HALF + 1, dtype=np.int64)      # lower edges of buckets 1..HALF, + one
    edges = (keys << _SHIFT).astype(np.int32).view(np.float32).astype(np.float64)
    lo, hi = edges[:-1], edges[1:]
    rep = 2.0 * lo * hi / (lo + hi)
    return np.concatenate([-rep[::-1], [0.0], rep])


REPRESENTATIVES = _representatives()


def sketch_quantiles(counts, qs: Sequence[float], lo: Optional[float] = None,
                     hi: Optional[float] = None) -> list[float]:
    """Quantiles of the values counted in ``counts``, linear interpolation between order statistics.

    Args:
        counts: ``(SIZE,)`` float64 bucket counts (tensor or array; integers stored as floats).
        qs: quantile levels in [0, 1].
        lo, hi: the exact minimum and maximum of the values (nats), if known: estimates are
            clamped to ``[lo, hi]``, which makes q = 0 and q = 1 exact and never widens the error.

    Returns:
        list of floats (nats); NaN for every level when the sketch is empty.
    """
    c = host_array(counts).astype(np.float64, copy=False)
    n = float(c.sum())
    if n <= 0:
        return [math.nan] * len(qs)
    cum = np.cumsum(c)

    def order_stat(j: int) -> float:        # j-th smallest (0-based)
        v = float(REPRESENTATIVES[int(np.searchsorted(cum, j + 0.5))])
        if lo is not None:
            v = max(v, lo)
        if hi is not None:
            v = min(v, hi)
        return v

    out: list[float] = []
    for q in qs:
        pos = q * (n - 1)
        k, f = int(math.floor(pos)), pos - math.floor(pos)
        a = order_stat(k)
        b = order_stat(min(k + 1, int(n) - 1)) if f > 0 else a
        out.append(a + (b - a) * f)
    return out


def quantile_error_bound(sorted_values: np.ndarray, q: float) -> float:
    """The bound of the module docstring for level ``q`` of the exact, ascending ``sorted_values``
    (float64 nats): what :func:`sketch_quantiles` may differ from ``numpy.quantile`` by."""
    n = sorted_values.size
    pos = q * (n - 1)
    k, f = int(math.floor(pos)), pos - math.floor(pos)
    a, b = abs(sorted_values[k]), abs(sorted_values[min(k + 1, n - 1)])
    return RELATIVE_ERROR * ((1 - f) * a + f * b) + ZERO_BELOW
