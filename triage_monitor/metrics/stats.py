"""Direction-aware mismatch metrics (docs/metrics.md), live and offline from one implementation.

In the style of torchmetrics: :class:`MismatchStats` is an accumulator whose state is one fixed-size float64
vector of declared fields, each merged by sum, min or max (:func:`state_layout`): the additive sums
(:data:`~triage_monitor.metrics.state_kernel.SUM_FIELDS`, declared once, in the kernel that writes them), a δ quantile
sketch (:mod:`triage_monitor.metrics.sketch`), the table of segment counts by (valid, tail tokens) for an exact C_tok,
and δ's min and max.  ``update`` runs the one compiled pass of :mod:`triage_monitor.metrics.state_kernel` on the host
copy of the tokens (whatever device the trainer uses); ``merge`` / ``sync`` / ``compute`` derive from the
declarations; a trailing window is the merge of its steps' vectors, so window metrics pool the raw sums of the
window instead of averaging per-step ratios, and a multi-rank sync is a fixed-size all-reduce
(docs/metrics.md#state).

All arithmetic on the accumulated quantities is float64; the inputs are the
float32 values that the records store, so a recomputation from the Parquet
files reproduces the live values exactly.

Every ratio whose denominator is 0 is NaN, and :meth:`MismatchStats.compute`
records the reason in ``MetricResult.nan_reasons``; nothing is ever inf.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
from numba import njit

from . import calibration, sketch, state_kernel
from ..config import MetricConfig
from .names import DELTA_QUANTILES, LOCALISATION, METRIC_NAMES, REGIONS  # noqa: F401  (public here since 0.1)

if TYPE_CHECKING:                  # torch is imported where a tensor is handled, so that the offline path (analyze,
    from torch import Tensor       # report, the dashboard: numpy states) never imports it

    from ..batch import TokenBatch

#: A state vector or a part of one: a float64 numpy array (offline) or a CPU tensor (live); the layout's operations
#: take either.
Array = Union["Tensor", np.ndarray]

#: r = learner − sampler is clamped to ±R before exp() in chi2_token, as verl does (its SAFETY_BOUND;
#: docs/metrics.md#chi2_token); the kernel holds the same bound.  k3_kl is not clamped (verl does not clamp it);
#: float64 keeps it finite for r ≤ 709 nats.
LOG_RATIO_CLAMP = 20.0
SUM_FIELDS = state_kernel.SUM_FIELDS
# DELTA_QUANTILES, METRIC_NAMES (every metric compute() returns, in display order), REGIONS: declared once in
# triage_monitor.metrics.names (with labels, units and τ-dependence), read here


@dataclass
class MetricResult:
    """Output of :meth:`MismatchStats.compute`: ``values`` (name → float, NaN allowed) and
    ``nan_reasons`` (name → why it is NaN)."""

    values: dict
    nan_reasons: dict = field(default_factory=dict)


class StepMetrics(NamedTuple):
    """A step's metrics and its trailing window's (:meth:`MetricTracker.step`)."""

    step: MetricResult
    window: MetricResult


# --------------------------------------------------------------------------- pure functions
def c_tok_from_segments(seg_tail: Tensor, seg_valid: Tensor, top_fraction: float = 0.05) -> float:
    """C_tok (docs/metrics.md#c_tok): share of all amplifying-tail tokens inside the top segments.

    Segments are ranked by tail fraction ``seg_tail / seg_valid`` (descending),
    ties broken by tail count (descending), so the result does not depend on
    the order of the segments; the top ``ceil(top_fraction · K)`` are kept.  The segments are counted into
    their (valid, tail) cells and read by :func:`c_tok_from_table` (the one ranking; exact, see there).

    Args:
        seg_tail, seg_valid: ``(K,)`` int64 per-segment tail and valid counts (tensors or numpy arrays).

    Returns:
        float in [0, 1]; NaN when there is no tail token.
    """
    tail, valid = _host(seg_tail, np.int64), _host(seg_valid, np.int64)
    if tail.size == 0 or not tail.any():
        return math.nan
    width = int(valid.max())
    table = np.bincount(valid * (width + 1) + tail, minlength=(width + 1) ** 2).astype(np.float64)
    return c_tok_from_table(table, width, top_fraction)


def c_tok_from_table(table: Array, width: int, top_fraction: float = 0.05) -> float:
    """C_tok (docs/metrics.md#localisation) from segment counts by (valid tokens, tail tokens).

    Exact: equals :func:`c_tok_from_segments` of the segments counted in ``table``.  Segments with the
    same (valid, tail) cell have the same tail fraction and tail count, so ranking cells by tail
    fraction (descending), ties by tail count (descending), ranks the segments exactly as
    :func:`c_tok_from_segments` does; the top ``ceil(top_fraction · K)`` segments are taken from the
    cells in that order (the last one partly).

    Args:
        table: ``((W+1)²,)`` float64 counts, cell ``valid · (W+1) + tail`` (integers stored as floats).
        width: W, the segment width in tokens.

    Returns:
        float in [0, 1]; NaN when there is no tail token.
    """
    order, tails = _cell_order(int(width))
    counts = sketch.host_array(table)[order]
    K = float(counts.sum())
    total = float((counts * tails).sum())
    if K == 0 or total == 0:
        return math.nan
    return top_tail_tokens(sketch.host_array(table), order, tails, math.ceil(top_fraction * K)) / total


@njit(cache=True, nogil=True)
def top_tail_tokens(cells, order, order_tails, top):         # pragma: no cover - compiled
    """The amplifying-tail tokens of the ``top`` highest-ranked segments (docs/metrics.md#c_tok): ``cells`` holds
    the number of segments of each (valid, tail) cell (``valid · (W+1) + tail``; int64 or integer-valued float64),
    ``order`` / ``order_tails`` the cells in ranking order and their tail counts (:func:`_cell_order`); the cells
    are taken in that order, the last one partly.  Exact (integer arithmetic in float64).  The one read of the
    ranking: :func:`c_tok_from_table` and the C_tok shuffle null
    (:func:`triage_monitor.offline.stages.shuffle_null_from_state`) both call it."""
    left = top
    got = 0.0
    for i in range(order.shape[0]):
        c = cells[order[i]]
        if c:
            take = min(c, left)
            got += take * order_tails[i]
            left -= take
            if left == 0:
                break
    return got


def _host(t, dtype) -> np.ndarray:
    """A contiguous host array of ``t`` (a numpy array, or a tensor on any device) in numpy ``dtype``: a tensor
    is converted by torch (bfloat16 included), as the records store its values."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t, dtype)
    import torch

    to = {np.float32: torch.float32, np.int64: torch.int64}[dtype]
    return t.detach().to("cpu", to).contiguous().numpy()


def _state_array(state) -> np.ndarray:
    """A given state (array or tensor) as a writable float64 host array; shares memory where it can."""
    if isinstance(state, np.ndarray):
        out = np.asarray(state, np.float64)
        return out if out.flags.writeable and min(out.strides) > 0 else out.copy()    # torch needs strides > 0
    import torch

    return state.detach().to("cpu", torch.float64).numpy()


def _on_host(x) -> bool:
    """True for a numpy array or a CPU tensor (merged through numpy views)."""
    return isinstance(x, np.ndarray) or x.device.type == "cpu"


class CellOrder(NamedTuple):
    """The C_tok table's cells in ranking order (:func:`_cell_order`) and the tail count of each."""

    cells: np.ndarray      # int64 cell index valid·(W+1) + tail
    tails: np.ndarray      # float64


@functools.lru_cache(maxsize=8)
def _cell_order(width: int) -> CellOrder:
    """Cells ``valid·(W+1) + tail`` (valid in 1..W, tail in 0..valid) by tail fraction then tail count,
    both descending; and the tail count of each.  Equal fractions are equal floats (IEEE division is
    correctly rounded), so the order is exact."""
    valid, tail = np.meshgrid(np.arange(1, width + 1), np.arange(width + 1), indexing="ij")
    ok = tail <= valid
    valid, tail = valid[ok], tail[ok]
    order = np.lexsort((-tail, -(tail / valid)))
    return CellOrder(valid[order] * (width + 1) + tail[order], tail[order].astype(np.float64))


# --------------------------------------------------------------------------- declared state
@dataclass(frozen=True)
class StateField:
    """One declared piece of :class:`MismatchStats`' state: ``size`` float64 values reduced by
    ``reduction`` ("sum", "min" or "max") when steps or ranks merge."""

    name: str
    size: int
    reduction: str


_IDENTITY = {"sum": 0.0, "min": math.inf, "max": -math.inf}
_NP_MERGE = {"sum": np.add, "min": np.minimum, "max": np.maximum}


class StateLayout:
    """Where each :class:`StateField` sits in the flat float64 state vector, fields grouped by
    reduction (sum, then min, then max) so that merging, syncing and windows are one vector
    operation per reduction.  One layout per segment width (the C_tok table's size depends on it)."""

    def __init__(self, fields: Sequence[StateField]):
        order = {"sum": 0, "min": 1, "max": 2}
        self.fields = tuple(sorted(fields, key=lambda f: order[f.reduction]))
        self.slices: dict[str, slice] = {}
        self.ranges: dict[str, tuple[int, int]] = {}
        start = 0
        for f in self.fields:
            self.slices[f.name] = slice(start, start + f.size)
            lo, _ = self.ranges.get(f.reduction, (start, start))
            self.ranges[f.reduction] = (lo, start + f.size)
            start += f.size
        self.size = start
        self._span_columns: dict = {}
        self._identity = np.concatenate([np.full(f.size, _IDENTITY[f.reduction]) for f in self.fields])

    def identity_array(self) -> np.ndarray:
        """``(size,)`` float64 numpy state of an empty accumulator (0 for sums, +inf for min, -inf for max)."""
        return self._identity.copy()

    def identity(self, device=None) -> Tensor:
        """:meth:`identity_array` as a new float64 tensor on ``device`` (default the CPU)."""
        import torch

        return torch.from_numpy(self._identity.copy()).to(device if device is not None else "cpu")

    def merge_into(self, out: Array, other: Array) -> Array:
        """``out`` ⊕= ``other`` (in place) by each field's reduction; returns ``out``.  Both numpy arrays or
        both tensors (a CPU tensor and an array mix)."""
        return self.merge_into_range(out, other, 0, self.size)

    def merge_into_range(self, out: Array, other: Array, lo: int, hi: int) -> Array:
        """:meth:`merge_into` restricted to the entries ``[lo, hi)`` of the state vector."""
        if _on_host(out) and _on_host(other):                          # numpy views: a fraction of torch's
            o, t = sketch.host_array(out), sketch.host_array(other)    # per-call cost (same IEEE results)
            for red, (a, b) in self.ranges.items():
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    _NP_MERGE[red](o[a:b], t[a:b], out=o[a:b])
            return out
        import torch

        assert isinstance(out, torch.Tensor) and isinstance(other, torch.Tensor)    # not both on the host: tensors
        for red, (a, b) in self.ranges.items():
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            if red == "sum":
                out[a:b] += other[a:b]
            elif red == "min":
                torch.minimum(out[a:b], other[a:b], out=out[a:b])
            else:
                torch.maximum(out[a:b], other[a:b], out=out[a:b])
        return out

    def span_columns(self, spans: Sequence[tuple]) -> "SpanColumns":
        """The entries of the state inside ``spans`` (each ``[lo, hi)``) as the columns of one row, grouped by
        reduction (:class:`SpanColumns`; cached per ``spans``)."""
        key = tuple((int(lo), int(hi)) for lo, hi in spans)
        cols = self._span_columns.get(key)
        if cols is None:
            groups = []                                   # (entries x:y, columns p:q of a row, reduction)
            width = 0
            for red, (a, b) in self.ranges.items():
                for lo, hi in key:
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        groups.append((x, y, width, width + y - x, red))
                        width += y - x
            cols = self._span_columns[key] = SpanColumns(tuple(groups), width)
        return cols

    def merge_all_into_spans(self, out: Tensor, others: Sequence[Tensor], spans: Sequence[tuple]) -> Tensor:
        """:meth:`merge_into_range` of each of ``others`` in turn (their order kept for every entry) over each
        ``[lo, hi)`` of ``spans``; returns ``out``.  On the CPU the spans' entries of every state are gathered
        into one array and each field group is folded down it in one numpy call (:class:`SpanColumns`)."""
        if _on_host(out) and all(_on_host(t) for t in others):
            cols = self.span_columns(spans)
            if not cols.groups or not others:
                return out
            rows = np.stack([cols.row(sketch.host_array(t)) for t in [out, *others]])
            cols.fold(rows, sketch.host_array(out))
            return out
        for t in others:
            for lo, hi in spans:
                self.merge_into_range(out, t, lo, hi)
        return out

    def reduce(self, states: Sequence[Tensor]) -> Tensor:
        """The merge of ``states`` in the given order (a trailing window), as a new array (numpy ``states``) or
        tensor."""
        out = (self.identity_array() if states and isinstance(states[0], np.ndarray)
               else self.identity(states[0].device if states else None))
        for s in states:
            self.merge_into(out, s)
        return out

    def all_reduce(self, state: Tensor, group=None) -> Tensor:
        """All-reduce ``state`` in place across ``group``: one SUM all-reduce of the sum fields and one
        MAX all-reduce of the (negated min, max) fields -- fixed sizes whatever the tokens."""
        import torch
        import torch.distributed as dist

        if "sum" in self.ranges:
            a, b = self.ranges["sum"]
            buf = state[a:b].contiguous()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            state[a:b] = buf
        ext = [(red, rng) for red, rng in self.ranges.items() if red != "sum"]
        if ext:
            buf = torch.cat([-state[a:b] if red == "min" else state[a:b] for red, (a, b) in ext])
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            i = 0
            for red, (a, b) in ext:
                state[a:b] = -buf[i:i + b - a] if red == "min" else buf[i:i + b - a]
                i += b - a
        return state


class SpanColumns:
    """Some entries of a state vector as the columns of a row (:meth:`StateLayout.span_columns`): ``groups`` holds,
    for each run of entries ``x:y`` of one reduction, the columns ``p:q`` of the row it occupies, so that the rows
    of several states (one per step) fold into the merged entries in one numpy call per group."""

    def __init__(self, groups: tuple, width: int):
        self.groups, self.width = groups, width
        self.index = np.concatenate([np.arange(x, y) for x, y, *_ in groups]) if groups else np.zeros(0, np.int64)

    def row(self, state: np.ndarray) -> np.ndarray:
        """``(width,)`` float64: the entries of ``state`` (a float64 state vector) in column order."""
        return state[self.index]

    def fold(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the merge of ``rows`` (``(k, width)``, merged in row order) into the entries of ``out`` (a state
        vector, in place) and return it.  A sum is the cumulative sum down the rows, a left fold ((r0 + r1) + r2) +
        ..., the same IEEE result as merging the rows one by one; min and max are exact in any order."""
        for x, y, p, q, red in self.groups:
            if red == "sum":
                out[x:y] = np.cumsum(rows[:, p:q], axis=0)[-1]
            else:
                out[x:y] = _NP_MERGE[red].reduce(rows[:, p:q], axis=0)
        return out


@functools.lru_cache(maxsize=8)
def state_layout(segment_width: int) -> StateLayout:
    """The :class:`StateLayout` of :class:`MismatchStats` for segment width W (tokens)."""
    return StateLayout((
        StateField("sums", len(SUM_FIELDS), "sum"),                 # every additive metric input
        StateField("delta_sketch", sketch.SIZE, "sum"),             # quantiles of δ (sketch.py)
        StateField("c_tok_table", (segment_width + 1) ** 2, "sum"),  # segments by (valid, tail): exact C_tok
        StateField("delta_min", 1, "min"),
        StateField("delta_max", 1, "max"),
    ))


# --------------------------------------------------------------------------- accumulator
class MismatchStats:
    """Fixed-size, mergeable state behind every metric of docs/metrics.md, torchmetrics-style.

    The state is one float64 vector on the host (:attr:`array`, a numpy array; :attr:`state` is the same memory
    as a tensor) laid out by :func:`state_layout`: the additive
    sums of :data:`SUM_FIELDS`, the δ quantile sketch (:mod:`triage_monitor.metrics.sketch`), the table of segment
    counts by (valid tokens, tail tokens) for C_tok, and δ's min and max.  Its size depends only on the segment
    width (about 161 KB at W = 64), never on the tokens.

    ``update(batch, tau_tail)`` adds one batch (the compiled pass of :mod:`triage_monitor.metrics.state_kernel`, on
    the batch's host copy); ``merge(other)`` adds another accumulator (a step of another rank, or the steps of
    a window); ``compute()`` turns the state into metrics; ``sync(group)`` all-reduces it across
    ``torch.distributed`` ranks.  ``tau_tail`` is the τ_tail the localisation quantities were computed with (a
    merge of accumulators with different τ reports the last one).

    Raises:
        ValueError: a given ``state`` of the wrong shape for the segment width.
    """

    def __init__(self, config: Optional[MetricConfig] = None, state: Optional[Array] = None,
                 tau_tail: float = math.nan):
        self.config = config or MetricConfig()
        self.layout = state_layout(self.config.segment_width)
        if state is not None:
            if tuple(state.shape) != (self.layout.size,):
                raise ValueError(f"MismatchStats state must have shape ({self.layout.size},) for segment width "
                                 f"{self.config.segment_width}, got {tuple(state.shape)}")
            self.array = _state_array(state)
        else:
            self.array = self.layout.identity_array()
        self.tau_tail = float(tau_tail)

    @property
    def state(self) -> Tensor:
        """:attr:`array` as a ``(size,)`` float64 CPU tensor sharing its memory (what ``torch.distributed``
        reduces; writes to it are writes to the state)."""
        import torch

        return torch.from_numpy(self.array)

    @state.setter
    def state(self, value) -> None:
        if tuple(value.shape) != (self.layout.size,):
            raise ValueError(f"MismatchStats state must have shape ({self.layout.size},), got {tuple(value.shape)}")
        self.array = _state_array(value)

    def __setstate__(self, d: dict) -> None:
        """Unpickle, also an accumulator pickled before the state was a numpy vector (its ``state`` tensor)."""
        if "array" not in d and "state" in d:
            d = dict(d)
            d["array"] = _state_array(d.pop("state"))
        self.__dict__.update(d)

    def part(self, name: str) -> Tensor:
        """The tensor view of one declared field of :attr:`state` (``sums``, ``delta_sketch``, ``c_tok_table``,
        ``delta_min``, ``delta_max``); ``array[layout.slices[name]]`` is the numpy view."""
        return self.state[self.layout.slices[name]]

    @property
    def sums(self) -> Tensor:
        """``(len(SUM_FIELDS),)`` float64 view of the additive sums."""
        return self.part("sums")

    def sum(self, name: str) -> float:
        """One additive sum of :data:`SUM_FIELDS` by name."""
        return float(self.array[self.layout.slices["sums"]][SUM_FIELDS.index(name)])

    @property
    def nbytes(self) -> int:
        """Bytes of the state (what a multi-rank sync sends per rank and reduction pass)."""
        return self.array.nbytes

    # ---------------------------------------------------------------- update
    def update(self, batch: TokenBatch, tau_tail: float = math.nan) -> "MismatchStats":
        """Add one batch.  ``tau_tail`` (nats) is the amplifying-tail threshold in force; with NaN the
        localisation part is left empty (those metrics stay NaN)."""
        return self.update_flat(batch.delta, batch.advantage, batch.sample_index, batch.position, batch.num_samples,
                                tau_tail)

    def update_flat(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Tensor,
                    num_samples: int, tau_tail: float = math.nan) -> "MismatchStats":
        """Add one batch given as flat tensors in :class:`TokenBatch` order (what :meth:`update` and the
        offline recomputation both call, so they agree exactly).

        Args:
            delta: ``(N,)`` float32, δ = learner − sampler log-prob (nats), on any device.
            advantage: ``(N,)`` float.
            sample_index: ``(N,)`` int64 in ``[0, num_samples)``, ascending.
            position: ``(N,)`` int64, unique and ascending within each sample.
            num_samples: S.
            tau_tail: τ_tail (nats) or NaN (no localisation).

        Raises:
            ValueError: the rows are not in (sample, position) order or a pair repeats.
        """
        mode = state_kernel.MAGNITUDE if math.isnan(tau_tail) else state_kernel.BOTH
        self._kernel(delta, advantage, sample_index, position, num_samples, mode, tau_tail)
        self.tau_tail = float(tau_tail)
        return self

    def add_magnitude(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, num_samples: int
                      ) -> "MismatchStats":
        """The τ-independent part of :meth:`update_flat` (magnitude, direction, sketch, min/max): what τ_tail's
        calibration reads before the step's localisation can be added (:meth:`add_localisation`)."""
        return self._kernel(delta, advantage, sample_index, None, num_samples, state_kernel.MAGNITUDE)

    def add_localisation(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Tensor,
                         num_samples: int, tau_tail: float) -> "MismatchStats":
        """The τ_tail-dependent part of :meth:`update_flat`: the segment sums and the C_tok table."""
        return self._kernel(delta, advantage, sample_index, position, num_samples, state_kernel.LOCALISATION,
                            tau_tail)

    def update_arrays(self, delta: np.ndarray, advantage: np.ndarray, sample_index: np.ndarray,
                      position: np.ndarray, num_samples: int, mode: int, tau_tail: float = math.nan,
                      null_input: Optional[list] = None) -> int:
        """Add one batch given as host numpy arrays: the one call of the compiled state update
        (:func:`~triage_monitor.metrics.state_kernel.update_state`) with this accumulator's :class:`MetricConfig`
        (segment width, small-gap threshold, heavy fraction, dilution threshold), shared by the live monitor and the
        offline recomputation (:func:`triage_monitor.offline.analysis.state_of_arrays`).

        Args:
            delta: ``(N,)`` float32 δ (nats); advantage: ``(N,)`` float32.
            sample_index: ``(N,)`` int64, the response of each token (an index, or the recorded sample id with
                ``num_samples`` = -1); position: ``(N,)`` int64.
            mode: ``state_kernel.MAGNITUDE``, ``LOCALISATION`` or ``BOTH``; tau_tail: τ_tail (nats) or NaN.
            null_input: a list to which the batch's C_tok shuffle-null input is appended, or None.

        Returns:
            ``state_kernel.OK``, or the status of rows out of (sample, position) order (the state is then
            unchanged: the caller sorts and retries, or refuses).
        """
        cfg = self.config
        return state_kernel.update_state(
            self.array, self.layout.slices, delta, advantage, sample_index, position, int(num_samples), mode=mode,
            tau_tail=tau_tail, width=cfg.segment_width, small_gap_threshold=cfg.small_gap_threshold,
            heavy_fraction=cfg.heavy_fraction, dilution_threshold=cfg.dilution_threshold, null_input=null_input)

    def _kernel(self, delta, advantage, sample_index, position, num_samples, mode, tau_tail=math.nan):
        pos = _host(position, np.int64) if position is not None else np.zeros(len(delta), np.int64)
        status = self.update_arrays(_host(delta, np.float32), _host(advantage, np.float32),
                                    _host(sample_index, np.int64), pos, num_samples, mode, tau_tail)
        if status != state_kernel.OK:
            raise ValueError("MismatchStats: the tokens are not ordered by (sample, position) with unique pairs "
                             "(build them with TokenBatch, which sorts them)")
        return self

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """Add ``other``'s state into this one (in place; returns self)."""
        self.layout.merge_into(self.array, other.array)
        if not math.isnan(other.tau_tail):
            self.tau_tail = other.tau_tail
        return self

    @classmethod
    def merged(cls, parts: Iterable["MismatchStats"], config: Optional[MetricConfig] = None) -> "MismatchStats":
        """A new accumulator holding the merge of ``parts`` in order (e.g. a trailing window)."""
        parts = list(parts)
        out = cls(config or (parts[0].config if parts else None))
        for p in parts:
            out.merge(p)
        return out

    def sync(self, group=None) -> "MismatchStats":
        """All-reduce the state across the ranks of ``group`` (torch.distributed): one SUM all-reduce
        of the fixed-size sum fields and one MAX all-reduce of δ's (−min, max).  Exact: the result equals
        the state of the concatenated batches.  A no-op when torch.distributed is not initialised."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if dist.get_backend(group) == "nccl":      # NCCL reduces device tensors: a device copy of the state
                buf = self.state.to(torch.device("cuda", torch.cuda.current_device()))
                self.state.copy_(self.layout.all_reduce(buf, group).cpu())
            else:
                self.layout.all_reduce(self.state, group)
        return self

    # ---------------------------------------------------------------- compute
    def compute(self) -> MetricResult:
        """Turn the state into the metrics of docs/metrics.md (names in :data:`METRIC_NAMES`)."""
        host = self.array
        s = dict(zip(SUM_FIELDS, host[self.layout.slices["sums"]].tolist()))
        dmin = float(host[self.layout.slices["delta_min"]][0])
        dmax = float(host[self.layout.slices["delta_max"]][0])
        v: dict = {}
        why: dict = {}

        def ratio(name, num, den, reason):
            if den == 0:
                v[name] = math.nan
                why[name] = reason
            else:
                v[name] = num / den

        n = s["n_tokens"]
        # n_samples counts responses with >= 1 valid token (a fully masked response leaves no record,
        # so this is what a recomputation from the records can reproduce; see empty_response_count)
        v["n_tokens"], v["n_samples"] = n, s["n_responses_nonempty"]
        ratio("small_gap_share", s["small_gap_count"], n, "no valid tokens")
        ratio("delta_mean", s["delta_sum"], n, "no valid tokens")
        ratio("delta_abs_mean", s["delta_abs_sum"], n, "no valid tokens")
        qs = sketch.sketch_quantiles(host[self.layout.slices["delta_sketch"]], list(DELTA_QUANTILES.values()),
                                     dmin, dmax)
        for name, q in zip(DELTA_QUANTILES, qs):
            v[name] = q
            if math.isnan(q):
                why[name] = "no valid tokens"
        v["delta_min"] = dmin if n else math.nan
        if not n:
            why["delta_min"] = "no valid tokens"
        ratio("k3_kl", s["k3_sum"], n, "no valid tokens")
        ratio("log_ppl_diff", s["log_ppl_diff_sum"], s["n_responses_nonempty"], "no response with a valid token")
        if n:
            v["chi2_token"] = s["exp_r_sq_sum"] / n - 1.0
        else:
            v["chi2_token"], why["chi2_token"] = math.nan, "no valid tokens"
        for r in REGIONS:
            v[f"mass_{r}"] = s[f"mass_{r}"]
            v[f"count_{r}"] = s[f"count_{r}"]
        ratio("rho_asym", s["mass_amp_neg"], s["mass_amp_pos"],
              "mass_amp_pos = 0: no token with A > 0 and delta > 0")
        ratio("rho_asym_lennorm", s["lennorm_amp_neg"], s["lennorm_amp_pos"],
              "length-normalised mass_amp_pos = 0: no token with A > 0 and delta > 0")
        ratio("amp_share", s["mass_amp_neg"] + s["mass_amp_pos"], s["abs_adv_sum"], "total |A| mass is 0")
        if math.isnan(self.tau_tail):
            for name in LOCALISATION:
                v[name], why[name] = math.nan, "tau_tail not set (no calibration data yet)"
        else:
            ratio("r_amp", s["tail_tokens"], s["neg_valid_tokens"], "no valid token in an A<0 response")
            ratio("h_seg", s["heavy_segments"], s["segments"], "no segment in an A<0 response")
            v["c_tok"] = c_tok_from_table(host[self.layout.slices["c_tok_table"]], self.config.segment_width,
                                          self.config.top_fraction)
            if math.isnan(v["c_tok"]):
                why["c_tok"] = "no amplifying-tail token"
            if s["pairs_prev_heavy"] == 0 or s["pairs"] == 0 or s["pairs_heavy"] == 0:
                v["p_adj"] = math.nan
                why["p_adj"] = ("no segment with a predecessor" if s["pairs"] == 0 else
                                "no tail-heavy predecessor segment" if s["pairs_prev_heavy"] == 0 else
                                "no tail-heavy segment among those with a predecessor")
            else:
                v["p_adj"] = (s["pairs_both_heavy"] / s["pairs_prev_heavy"]) / (s["pairs_heavy"] / s["pairs"])
            ratio("dilution", s["responses_diluted"], s["responses_with_heavy"],
                  "no A<0 response holds a tail-heavy segment")
        v["tau_tail"] = self.tau_tail
        if math.isnan(self.tau_tail):
            why["tau_tail"] = "not calibrated yet"
        return MetricResult({k: v[k] for k in METRIC_NAMES}, why)


# --------------------------------------------------------------------------- calibration state
def _calibration_part(stats: MismatchStats) -> np.ndarray:
    """``(sketch.SIZE + 2,)`` float64 (a new array): the step's δ sketch, min and max (what τ_tail is calibrated
    from; :mod:`triage_monitor.metrics.calibration`'s part)."""
    sl = stats.layout.slices
    return np.concatenate([stats.array[sl["delta_sketch"]], stats.array[sl["delta_min"]], stats.array[sl["delta_max"]]])


def tau_from_calibration(parts: Sequence, q: float) -> float:
    """τ_tail (nats): the ``q`` quantile of the merged calibration parts (sketch, min, max), read from the
    sketch (docs/metrics.md#quantile-sketch); NaN when they hold no token."""
    return calibration.part_quantiles(calibration.merge_parts(parts), [q])[0]


# --------------------------------------------------------------------------- streaming tracker
class MetricTracker:
    """Per-step and trailing-window metrics over a stream of steps, with τ_tail calibration.

    τ_tail (docs/metrics.md#tau_tail) is ``tau_tail`` when given; otherwise the
    ``config.tail_quantile`` quantile of δ pooled over every valid token of the first
    ``calibration_steps`` steps, read from the merged δ sketches of those steps.  While the reference
    window is still filling, the steps use the provisional value computed from the steps seen so far
    (current step included; ``tau_frozen`` False); it is frozen when the first step after the
    reference window arrives (steps counted as distinct step numbers with at least one valid token; a
    repeated step replaces its earlier sketch).

    State: one fixed-size :class:`MismatchStats` vector per step of the trailing window; a window is
    the merge of its steps' vectors, so its cost does not depend on the tokens per step.  Live
    monitoring and offline recomputation both drive this class (or its pieces), so they agree exactly.
    """

    def __init__(self, config: Optional[MetricConfig] = None, window: int = 25, tau_tail: Optional[float] = None,
                 calibration_steps: int = 25):
        if window < 1 or calibration_steps < 1:
            raise ValueError(f"window and calibration_steps must be >= 1, got {window}, {calibration_steps}")
        if tau_tail is not None and not math.isfinite(tau_tail):
            raise ValueError(f"tau_tail must be a finite number of nats or None (calibrate), got {tau_tail}")
        self.config = config or MetricConfig()
        self.window = int(window)
        self.calibration_steps = int(calibration_steps)
        self.tau_given = tau_tail is not None
        self.tau_tail = float(tau_tail) if tau_tail is not None else math.nan
        self.tau_frozen = self.tau_given
        self.reference = calibration.ReferenceWindow(self.calibration_steps, 1, repeated="replace")
        self._history: list = []        # [(step, MismatchStats)] of the trailing window
        self._running: Optional[np.ndarray] = None   # Σ of the window's integer count fields (sketch, C_tok table)
        self._rows: Optional[np.ndarray] = None      # the other fields of each state (SpanColumns rows): row 0 empty, then _history

    def _calibrate(self, step: int, part) -> None:
        if self.tau_frozen:
            return
        if self.reference.add(step, [part]):                     # first step after the reference window
            self.tau_frozen = True
            return
        merged = self.reference.merged(0) if self.reference.parts else None
        if merged is not None:
            self.tau_tail = calibration.part_quantiles(merged, [self.config.tail_quantile])[0]

    def step(self, step: int, batch: TokenBatch, group=None) -> "StepMetrics":
        """Add one step; returns ``(step_result, window_result)`` (:class:`MetricResult` each).

        With ``group`` (torch.distributed), the step's fixed-size state is all-reduced, so every rank
        reports the global metrics; while τ_tail is calibrating, the step's δ sketch is all-reduced
        first (fixed size too), so τ_tail comes from the global δ.
        """
        import torch

        stats = MismatchStats(self.config)
        # the host copy of the tokens the state update reads (one per batch, shared with the writer; a no-op on CPU)
        host = batch.host()
        delta, adv, sample_index, position = host.delta, host.advantage, host.sample_index, host.position
        distributed = group is not None or _dist_ready()
        if self.tau_frozen:                                      # one pass: both parts with the frozen τ_tail
            stats.update_flat(delta, adv, sample_index, position, batch.num_samples, self.tau_tail)
            if distributed:
                stats.sync(group)
            return self.push(step, stats)
        stats.add_magnitude(delta, adv, sample_index, batch.num_samples)
        part = torch.from_numpy(_calibration_part(stats))        # calibrating: τ_tail from the steps so far
        self._calibrate(step, calibration.sync_part(part, group) if distributed else part)
        if not math.isnan(self.tau_tail):
            stats.add_localisation(delta, adv, sample_index, position, batch.num_samples, self.tau_tail)
        stats.tau_tail = self.tau_tail
        if distributed:
            stats.sync(group)
        return self.push(step, stats)

    def push(self, step: int, stats: MismatchStats) -> "StepMetrics":
        """Append a step's finished (synced) state to the trailing window; returns ``(step_result,
        window_result)``.  A repeated step replaces the earlier one."""
        layout = stats.layout
        counts = slice(layout.slices["delta_sketch"].start, layout.slices["c_tok_table"].stop)
        # the window's state, equal to layout.reduce of its steps' states in their order: the sketch and the C_tok
        # table are integer counts (exact in any order, so kept as a running sum: the cost does not grow with the
        # window); the other fields (the float sums, min and max: a few dozen entries) are kept as one row per
        # step, folded in step order, so that the only per-step work that grows with the window is small numpy
        # calls over a (window × a few dozen) array
        cols = layout.span_columns(((0, counts.start), (counts.stop, layout.size)))
        if self._running is None or self._rows is None or self._rows.shape[1] != cols.width:
            self._running = np.zeros(counts.stop - counts.start)
            self._rows = cols.row(layout.identity_array())[None]         # row 0: the empty state's
            for _, st in self._history:
                self._running += st.array[counts]
                self._rows = np.concatenate([self._rows, cols.row(st.array)[None]])
        if self._history and self._history[-1][0] == step:
            self._running -= self._history.pop()[1].array[counts]
            self._rows = self._rows[:-1]
        self._history.append((step, stats))
        self._running += stats.array[counts]
        self._rows = np.concatenate([self._rows, cols.row(stats.array)[None]])
        keep = [s > step - self.window for s, _ in self._history]
        if not all(keep):
            for (_, st), k in zip(self._history, keep):
                if not k:
                    self._running -= st.array[counts]
            self._history = [h for h, k in zip(self._history, keep) if k]
            self._rows = self._rows[np.array([True, *keep])]
        state = np.empty(layout.size)
        cols.fold(self._rows, state)
        state[counts] = self._running
        window = MismatchStats(self.config, state=state, tau_tail=stats.tau_tail)
        return StepMetrics(stats.compute(), window.compute())

    def state_dict(self) -> dict[str, Any]:
        """Calibration state for resuming: τ_tail, whether it is frozen and, while the reference window is
        still filling, the calibration part of each step so far (``calib``: one ``(sketch.SIZE + 2,)``
        float64 CPU tensor per step, at most ``calibration_steps``), so a resumed job calibrates the same τ_tail."""
        return {"tau_tail": self.tau_tail, "tau_frozen": self.tau_frozen, "config": asdict(self.config),
                "window": self.window, "calibration_steps": self.calibration_steps, "calib_format": "sketch",
                "calib": [] if self.tau_frozen else [ps[0].clone() for ps in self.reference.parts],
                "calib_steps": [] if self.tau_frozen else list(self.reference.step_numbers)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (``calib`` optional: a state that only says ``tau_tail`` /
        ``tau_frozen`` starts an empty reference window).

        Raises:
            ValueError: calibration data not in the sketch format :meth:`state_dict` writes
                (``calib_format`` other than ``"sketch"``)."""
        frozen = bool(sd["tau_frozen"])
        calib = [] if frozen else list(sd.get("calib", []))
        if calib and sd.get("calib_format") != "sketch":
            raise ValueError(f"MetricTracker state: calibration data of format {sd.get('calib_format')!r}; this "
                             f"version loads the 'sketch' format its state_dict writes")
        self.tau_tail, self.tau_frozen = float(sd["tau_tail"]), frozen
        self.reference = calibration.ReferenceWindow(self.calibration_steps, 1, repeated="replace")
        self.reference.frozen = self.tau_frozen
        import torch

        self.reference.parts = [[torch.as_tensor(c, dtype=torch.float64).cpu()] for c in calib]
        self.reference.step_numbers = list(sd.get("calib_steps", range(-len(calib), 0)))


def _dist_ready() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def compute_step_metrics(batch: TokenBatch, tau_tail: float = math.nan,
                         config: Optional[MetricConfig] = None) -> MetricResult:
    """Metrics of a single batch with a given τ_tail (nats): the one-call form of :class:`MismatchStats`."""
    return MismatchStats(config).update(batch, tau_tail).compute()
