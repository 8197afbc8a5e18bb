"""Position-based segments and vectorised segment reductions (docs/metrics.md#localisation, docs/metrics.md#gate, docs/metrics.md#repair).

A response is cut by ``position`` into non-overlapping segments of ``width``
tokens: segment k holds positions ``[k·W, (k+1)·W)``.  Masked positions are
dropped without reindexing, the last short segment is kept, and a segment
with no valid token does not exist.  Shared by the metrics (W = 64), the
Gate (W_gate = 64) and the Repair (W_rep = 128): no Python loop over segments
or responses anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


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
        """``(N,)``: each token gets its segment's value from ``per_segment`` ``(K,)``."""
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
    number = torch.div(seg.number, m, rounding_mode="floor")
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
    number = torch.div(position, width, rounding_mode="floor")
    stride = int(number.max()) + 1
    key = sample_index.long() * stride + number
    uniq, inverse, counts = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    return Segments(index=inverse, sample=torch.div(uniq, stride, rounding_mode="floor"),
                    number=uniq % stride, count=counts, width=int(width))
