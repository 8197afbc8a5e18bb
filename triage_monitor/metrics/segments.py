"""Position-based segments and vectorised segment reductions (docs/metrics.md#localisation, docs/metrics.md#gate, docs/metrics.md#repair).

A response is cut by ``position`` into non-overlapping segments of ``width``
tokens: segment k holds positions ``[k·W, (k+1)·W)``.  Masked positions are
dropped without reindexing, the last short segment is kept, and a segment
with no valid token does not exist.  Shared by the metrics (W = 64), the
Gate (W_gate = 64) and the Repair (W_rep = 128): no Python loop over segments
or responses anywhere.

On the CPU the Gate's segments and their sums come from one compiled pass over the tokens
(:func:`segment_sums`, numba), the twin of :func:`segment_tokens` and :meth:`Segments.sum`: the same integers,
and the same sequential float additions in token order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
from numba import njit

from .definitions import segment_number, segment_shift
from .state_kernel import segment_number_nb, segment_shift_nb

Tensor = torch.Tensor

#: Whether CPU tensors take the compiled passes (:func:`segment_sums`, :func:`broadcast_where_negative`,
#: :meth:`Segments.broadcast`); False: the torch operations everywhere (the tests compare both, bit for bit).
COMPILED_ON_CPU = True


@dataclass(frozen=True)
class Segments:
    """Segment layout of a flat token batch.

    Attributes (N tokens, K segments):
        index: ``(N,)`` int64, segment of each token, in ``[0, K)``.
        sample: ``(K,)`` int64, sample index of each segment.
        number: ``(K,)`` int64, k = position // width of each segment.
        count: ``(K,)`` int64, valid tokens in each segment (≥ 1).
        width: segment width W in tokens.
    """

    index: Tensor
    sample: Tensor
    number: Tensor
    count: Tensor
    width: int

    @property
    def num_segments(self) -> int:
        return int(self.sample.shape[0])

    def sum(self, values: Tensor) -> Tensor:
        """``(K,)`` per-segment sum of per-token ``values`` ``(N,)`` (dtype of ``values``; differentiable).

        Each segment's tokens are added in token order, in the dtype of ``values``.  A segment's tokens are one
        contiguous run (:func:`segment_tokens` cuts runs), so on the CPU a float32 / float64 sum is a sum over runs
        of ``count`` tokens (``torch.segment_reduce``, the same sequential IEEE additions as ``index_add``'s
        token-order accumulation, at about half its cost); other dtypes and devices use ``index_add``."""
        if (values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and self.num_segments
                and values.dim() == 1):
            return torch.segment_reduce(values, "sum", lengths=self.count.to(values.device))
        out = torch.zeros(self.num_segments, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.index, values)

    def mean(self, values: Tensor) -> Tensor:
        """``(K,)`` per-segment mean over valid tokens (differentiable)."""
        return self.sum(values) / self.count.to(values.dtype)

    def broadcast(self, per_segment: Tensor) -> Tensor:
        """``(N,)``: each token gets its segment's value from ``per_segment`` ``(K,)`` (differentiable; on the CPU
        without a gradient one compiled pass)."""
        if (COMPILED_ON_CPU and per_segment.device.type == "cpu" and self.index.device.type == "cpu"
                and not per_segment.requires_grad and self.index.numel() and per_segment.dim() == 1):
            return torch.from_numpy(_take(per_segment.detach().contiguous().numpy(), self.index.numpy()))
        return per_segment[self.index]

    def predecessor(self) -> Tensor:
        """``(K,)`` int64: index of segment k−1 of the same response, or −1 when it does not exist."""
        K = self.num_segments
        prev = torch.full((K,), -1, dtype=torch.long, device=self.sample.device)
        if K > 1:
            has = (self.sample[1:] == self.sample[:-1]) & (self.number[1:] == self.number[:-1] + 1)
            idx = torch.arange(K - 1, device=self.sample.device)
            prev[1:] = torch.where(has, idx, prev[1:])
        return prev


def coarsen(seg: Segments, width: int) -> Segments:
    """The segments of width ``width`` of the tokens ``seg`` cut, when ``width`` is a multiple of ``seg.width``:
    segment k of a response at width m·W is the union of its segments m·k … m·k + m − 1 at width W, so the wide
    segments are found among the K narrow ones instead of the N tokens.  Equal, field by field, to
    :func:`segment_tokens` of the same tokens at ``width``.

    Raises:
        ValueError: ``width`` is not a positive multiple of ``seg.width``."""
    if int(width) <= 0 or int(width) % seg.width:
        raise ValueError(f"coarsen: width {width} is not a positive multiple of the segments' width {seg.width}")
    m = int(width) // seg.width
    if m == 1 or not seg.num_segments:
        return Segments(seg.index, seg.sample, seg.number, seg.count, int(width))
    # segment_number(position, width) = segment_number(position, seg.width) // m for width = m · seg.width: the same
    # cut as segment_tokens at ``width``, without the positions
    number = segment_number(seg.number, m)
    stride = int(number.max()) + 1
    uniq, inverse = torch.unique_consecutive(seg.sample * stride + number, return_inverse=True)
    count = torch.zeros(uniq.numel(), dtype=seg.count.dtype, device=seg.count.device).index_add(0, inverse, seg.count)
    return Segments(index=inverse[seg.index], sample=torch.div(uniq, stride, rounding_mode="floor"),
                    number=uniq % stride, count=count, width=int(width))


def segment_tokens(sample_index: Tensor, position: Tensor, width: int) -> Segments:
    """Assign each valid token to its segment.

    Args:
        sample_index: ``(N,)`` int64, sorted ascending (TokenBatch order).
        position: ``(N,)`` int64, ascending within each sample.
        width: segment width W > 0 (tokens).

    Returns:
        :class:`Segments`, ordered by (sample, k).

    Raises:
        ValueError: ``width`` ≤ 0 or shapes differ.
    """
    if int(width) <= 0:
        raise ValueError(f"segment width must be a positive number of tokens, got {width}")
    if sample_index.shape != position.shape:
        raise ValueError(f"sample_index {tuple(sample_index.shape)} and position {tuple(position.shape)} differ")
    dev = sample_index.device
    n = sample_index.numel()
    if n == 0:
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return Segments(e, e, e, e, int(width))
    number = segment_number(position, int(width), segment_shift(int(width)))
    stride = int(number.max()) + 1
    key = sample_index.long() * stride + number
    uniq, inverse, counts = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    return Segments(index=inverse, sample=torch.div(uniq, stride, rounding_mode="floor"),
                    number=uniq % stride, count=counts, width=int(width))


@njit(nogil=True, cache=True)
def _cut_and_sum(sample, position, width, a, b, flag):               # pragma: no cover - compiled
    """One pass over tokens in (sample, position) order: each token's segment (a new one wherever the sample or
    the segment number (:func:`~triage_monitor.metrics.definitions.segment_number`) changes), each segment's sample, number and token count, and per segment the sums of
    ``a`` and of ``b`` (added in token order from 0, in their dtype) and the number of ``flag`` tokens (``b`` and
    ``flag`` of length 0: not summed)."""
    n = sample.shape[0]
    has_b, has_flag = b.shape[0] == n, flag.shape[0] == n
    index = np.empty(n, np.int64)
    seg_sample = np.empty(n, np.int64)
    seg_number = np.empty(n, np.int64)
    count = np.empty(n, np.int64)
    sum_a = np.empty(n, a.dtype)
    sum_b = np.empty(n, b.dtype)
    flagged = np.empty(n, a.dtype)
    k = -1
    cur_s, cur_n, c = -1, -1, 0
    za, zb = a[:0].sum(), b[:0].sum()                   # 0 in each dtype
    ta, tb, tf = za, zb, 0
    shift = segment_shift_nb(width)
    for i in range(n):
        num = segment_number_nb(position[i], width, shift)
        if k < 0 or sample[i] != cur_s or num != cur_n:
            if k >= 0:                                  # close the previous segment
                count[k], sum_a[k], sum_b[k], flagged[k] = c, ta, tb, tf
            k += 1
            cur_s, cur_n = sample[i], num
            seg_sample[k], seg_number[k] = cur_s, cur_n
            c, ta, tb, tf = 0, za, zb, 0
        index[i] = k
        c += 1
        ta += a[i]                                      # in token order, from 0, in the values' dtype
        if has_b:
            tb += b[i]
        if has_flag:
            tf += 1 if flag[i] else 0
    if k >= 0:
        count[k], sum_a[k], sum_b[k], flagged[k] = c, ta, tb, tf
    k += 1
    return index, seg_sample[:k].copy(), seg_number[:k].copy(), count[:k].copy(), sum_a[:k].copy(), \
        sum_b[:k].copy(), flagged[:k].copy()


class SegmentSums(NamedTuple):
    """What :func:`segment_sums` returns: the segments and, per segment, the sums of ``a``, of ``b`` and the count of
    flagged tokens (``(K,)`` each, in ``a``'s dtype; None where not asked for)."""

    segments: Segments
    sum_a: Tensor
    sum_b: Optional[Tensor]
    flagged: Optional[Tensor]


def segment_sums(sample_index: Tensor, position: Tensor, width: int, a: Tensor, b: Optional[Tensor] = None,
                 flag: Optional[Tensor] = None) -> SegmentSums:
    """:func:`segment_tokens` and, per segment, ``seg.sum(a)``, ``seg.sum(b)`` and ``seg.sum(flag.to(a.dtype))``,
    in one pass over the tokens: compiled on the CPU (equal to the torch operations bit for bit: the same
    integers, the same additions in token order), the torch operations elsewhere.

    Args:
        sample_index, position: ``(N,)`` int64 in TokenBatch order; width: W > 0 (tokens).
        a, b: ``(N,)`` float32 or float64 values (the same dtype; ``b`` optional); flag: ``(N,)`` bool, optional.

    Returns:
        :class:`SegmentSums` ``(segments, sum of a (K,), sum of b (K,) or None, flagged tokens (K,) in a's dtype or
        None)``.

    Raises:
        ValueError: ``width`` ≤ 0 or shapes differ.
    """
    given = [t for t in (sample_index, position, a, b, flag) if t is not None]
    cpu = COMPILED_ON_CPU and all(t.device.type == "cpu" for t in given)
    if (not cpu or (b is not None and a.dtype != b.dtype) or a.dtype not in (torch.float32, torch.float64)
            or not sample_index.numel()):
        seg = segment_tokens(sample_index, position, width)
        return SegmentSums(seg, seg.sum(a), None if b is None else seg.sum(b),
                           None if flag is None else seg.sum(flag.to(a.dtype)))
    if int(width) <= 0:
        raise ValueError(f"segment width must be a positive number of tokens, got {width}")
    if any(t.shape != sample_index.shape for t in given):
        raise ValueError(f"segment_sums: the per-token tensors' shapes {[tuple(t.shape) for t in given]} differ")
    host = (lambda t, like: t.detach().contiguous().numpy() if t is not None else like[:0])
    a_np = host(a, None)
    index, sample, number, count, sum_a, sum_b, flagged = (torch.from_numpy(x) for x in _cut_and_sum(
        sample_index.long().contiguous().numpy(), position.long().contiguous().numpy(), int(width), a_np,
        host(b, a_np), host(None if flag is None else flag.bool(), np.zeros(1, np.bool_))))
    return SegmentSums(Segments(index, sample, number, count, int(width)), sum_a, None if b is None else sum_b,
                       None if flag is None else flagged)


@njit(nogil=True, cache=True)
def _take(values, index):                                             # pragma: no cover - compiled
    out = np.empty(index.shape[0], values.dtype)
    for i in range(index.shape[0]):
        out[i] = values[index[i]]
    return out


@njit(nogil=True, cache=True)
def _broadcast_where_negative(per_segment, index, values, fill):      # pragma: no cover - compiled
    out = np.empty(index.shape[0], per_segment.dtype)
    for i in range(index.shape[0]):
        w = per_segment[index[i]]
        out[i] = w if values[i] < 0 else fill             # a select, no branch
    return out


def broadcast_where_negative(seg: Segments, per_segment: Tensor, values: Tensor, fill: float) -> Tensor:
    """``torch.where(values < 0, seg.broadcast(per_segment), fill)``, ``(N,)`` in ``per_segment``'s dtype, in one
    compiled pass on the CPU (a selection: the same values)."""
    if (not COMPILED_ON_CPU or per_segment.device.type != "cpu" or values.device.type != "cpu"
            or per_segment.requires_grad or values.dtype != per_segment.dtype or not seg.index.numel()):
        return torch.where(values < 0, seg.broadcast(per_segment),
                           torch.full_like(values, fill, dtype=per_segment.dtype))
    return torch.from_numpy(_broadcast_where_negative(per_segment.detach().contiguous().numpy(), seg.index.numpy(),
                                                      values.detach().contiguous().numpy(),
                                                      per_segment.new_full((), fill).item()))
