"""Direction-aware mismatch metrics (docs/metrics.md), live and offline from one implementation.

Two layers, in the style of torchmetrics:

* pure tensor functions over a :class:`~triage_monitor.batch.TokenBatch`
  (:func:`region_codes`, :func:`segment_tail_stats`, :func:`c_tok_from_segments`,
  :func:`quantiles`), shapes stated;
* :class:`MismatchStats`, an accumulator whose state is one fixed-size float64
  vector of declared fields, each merged by sum, min or max (:func:`state_layout`):
  the additive sums, a δ quantile sketch (:mod:`triage_monitor.sketch`), the table
  of segment counts by (valid, tail tokens) for an exact C_tok, and δ's min and
  max.  ``update`` / ``merge`` / ``compute`` / ``sync`` derive from the
  declarations; a trailing window is the merge of its steps' vectors, so window
  metrics pool the raw sums of the window instead of averaging per-step ratios,
  and a multi-rank sync is a fixed-size all-reduce (docs/metrics.md#state).

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
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from . import calibration, sketch, state_kernel
from .batch import TokenBatch
from .config import MetricConfig

Tensor = torch.Tensor

#: Quantiles of δ reported per step / window (docs/metrics.md#delta_quantiles), name → q.
DELTA_QUANTILES = {"delta_q01": 0.01, "delta_q05": 0.05, "delta_q50": 0.50}
#: r = learner − sampler is clamped to ±R before exp() in chi2_token, as verl does (its SAFETY_BOUND; docs/metrics.md#chi2_token).
#: k3_kl is not clamped (verl does not clamp it); float64 keeps it finite for r ≤ 709 nats.
LOG_RATIO_CLAMP = 20.0
REGIONS = ("amp_neg", "amp_pos", "con_neg", "con_pos")

# The additive state of MismatchStats, one float64 each (reduced with SUM across ranks).
SUM_FIELDS = (
    "n_tokens", "n_responses_all", "n_responses_nonempty", "small_gap_count", "delta_sum", "delta_abs_sum",
    "k3_sum", "exp_r_sq_sum", "log_ppl_diff_sum", "abs_adv_sum",
    *(f"mass_{r}" for r in REGIONS), *(f"count_{r}" for r in REGIONS),
    "lennorm_amp_neg", "lennorm_amp_pos",
    # localisation (docs/metrics.md#localisation), over responses with A < 0
    "neg_valid_tokens", "tail_tokens", "segments", "heavy_segments",
    "pairs", "pairs_heavy", "pairs_prev_heavy", "pairs_both_heavy",
    "responses_with_heavy", "responses_diluted",
)

#: Every metric name :meth:`MismatchStats.compute` returns, in display order.
METRIC_NAMES = (
    "n_tokens", "n_samples", "small_gap_share", "delta_mean", "delta_abs_mean",
    *DELTA_QUANTILES, "delta_min", "k3_kl", "log_ppl_diff", "chi2_token",
    *(f"mass_{r}" for r in REGIONS), *(f"count_{r}" for r in REGIONS),
    "rho_asym", "rho_asym_lennorm", "amp_share",
    "r_amp", "h_seg", "c_tok", "p_adj", "dilution", "tau_tail",
)


@dataclass
class MetricResult:
    """Output of :meth:`MismatchStats.compute`: ``values`` (name → float, NaN allowed) and
    ``nan_reasons`` (name → why it is NaN)."""

    values: dict
    nan_reasons: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- pure functions
def region_codes(delta: Tensor, advantage: Tensor) -> Tensor:
    """``(N,)`` int64 region of each token: 0 amp_neg, 1 amp_pos, 2 con_neg, 3 con_pos, 4 none.

    Regions of docs/metrics.md#regions: amp_neg A<0, δ<0; amp_pos A>0, δ>0; con_neg A<0, δ>0;
    con_pos A>0, δ<0.  Tokens with A = 0 or δ = 0 belong to no region.  One code per token, for ``bincount``.
    """
    a_neg, a_pos = advantage < 0, advantage > 0
    d_neg, d_pos = delta < 0, delta > 0
    code = torch.full(delta.shape, 4, dtype=torch.long, device=delta.device)
    code = torch.where(a_neg & d_neg, 0, code)
    code = torch.where(a_pos & d_pos, 1, code)
    code = torch.where(a_neg & d_pos, 2, code)
    return torch.where(a_pos & d_neg, 3, code)


def quantiles(values: Tensor, qs: Sequence[float]) -> list:
    """Quantiles of a 1-D tensor with linear interpolation (numpy's default ``method="linear"``).

    Uses order statistics by ``kthvalue`` (O(n) each), so it works beyond
    ``torch.quantile``'s 16M-element limit.  Returns NaN for an empty tensor.
    """
    n = values.numel()
    if n == 0:
        return [math.nan] * len(qs)
    v = values.double()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, frac = int(math.floor(pos)), pos - math.floor(pos)
        a = float(torch.kthvalue(v, lo + 1).values)
        b = float(torch.kthvalue(v, min(lo + 2, n)).values) if frac > 0 else a
        out.append(a + (b - a) * frac)
    return out


def segment_tail_stats(batch: TokenBatch, tau_tail: float, width: int, heavy_fraction: float,
                       dilution_threshold: float) -> dict:
    """Localisation quantities of one batch (docs/metrics.md#localisation), over responses with A < 0.

    A response's advantage is the mean advantage of its valid tokens (the GRPO
    per-response value when advantages are broadcast).  A token is an
    amplifying-tail token when its A < 0 and δ < τ_tail.  Segments are cut by
    position (``width`` tokens) by :func:`segment_tail_counts`.

    Returns a dict with ``seg_tail`` and ``seg_valid`` (``(K,)`` int64 per
    segment of the A<0 responses, in (sample, k) order) and the float sums
    ``neg_valid_tokens``, ``tail_tokens``, ``segments``, ``heavy_segments``,
    ``pairs`` (segments with a predecessor k−1 in the same response),
    ``pairs_heavy``, ``pairs_prev_heavy``, ``pairs_both_heavy``,
    ``responses_with_heavy`` and ``responses_diluted``.
    """
    return _localisation(batch.delta, batch.advantage.float(), batch.sample_index, batch.position, batch.num_samples,
                         float(tau_tail), width, heavy_fraction, dilution_threshold)


def c_tok_from_segments(seg_tail: Tensor, seg_valid: Tensor, top_fraction: float = 0.05) -> float:
    """C_tok (docs/metrics.md#c_tok): share of all amplifying-tail tokens inside the top segments.

    Segments are ranked by tail fraction ``seg_tail / seg_valid`` (descending),
    ties broken by tail count (descending), so the result does not depend on
    the order of the segments; the top ``ceil(top_fraction · K)`` are kept.

    Args:
        seg_tail, seg_valid: ``(K,)`` int64 per-segment tail and valid counts.

    Returns:
        float in [0, 1]; NaN when there is no tail token.
    """
    total = float(seg_tail.sum())
    K = seg_tail.numel()
    if K == 0 or total == 0:
        return math.nan
    top = math.ceil(top_fraction * K)
    frac = seg_tail.double() / seg_valid.double()
    by_count = torch.argsort(-seg_tail, stable=True)
    order = by_count[torch.argsort(-frac[by_count], stable=True)]
    return float(seg_tail[order[:top]].sum()) / total


def c_tok_from_table(table: Tensor, width: int, top_fraction: float = 0.05) -> float:
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
    counts = table.detach().cpu().numpy()[order] if isinstance(table, Tensor) else np.asarray(table)[order]
    K = float(counts.sum())
    total = float((counts * tails).sum())
    if K == 0 or total == 0:
        return math.nan
    top = math.ceil(top_fraction * K)
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, top))                    # first cell whose cumulative count reaches top
    taken = float((counts[:i] * tails[:i]).sum()) + (top - (float(cum[i - 1]) if i else 0.0)) * float(tails[i])
    return taken / total


@functools.lru_cache(maxsize=8)
def _cell_order(width: int) -> tuple:
    """Cells ``valid·(W+1) + tail`` (valid in 1..W, tail in 0..valid) by tail fraction then tail count,
    both descending; and the tail count of each.  Equal fractions are equal floats (IEEE division is
    correctly rounded), so the order is exact."""
    valid, tail = np.meshgrid(np.arange(1, width + 1), np.arange(width + 1), indexing="ij")
    ok = tail <= valid
    valid, tail = valid[ok], tail[ok]
    order = np.lexsort((-tail, -(tail / valid)))
    return (valid[order] * (width + 1) + tail[order]), tail[order].astype(np.float64)


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
        self.slices, self.ranges, start = {}, {}, 0
        for f in self.fields:
            self.slices[f.name] = slice(start, start + f.size)
            lo, _ = self.ranges.get(f.reduction, (start, start))
            self.ranges[f.reduction] = (lo, start + f.size)
            start += f.size
        self.size = start
        self._identity = torch.cat([torch.full((f.size,), _IDENTITY[f.reduction], dtype=torch.float64)
                                    for f in self.fields])

    def identity(self, device=None) -> Tensor:
        """``(size,)`` float64 state of an empty accumulator (0 for sums, +inf for min, -inf for max)."""
        return self._identity.to(device if device is not None else "cpu", copy=True)

    def merge_into(self, out: Tensor, other: Tensor) -> Tensor:
        """``out`` ⊕= ``other`` (in place) by each field's reduction; returns ``out``."""
        return self.merge_into_range(out, other, 0, self.size)

    def merge_into_range(self, out: Tensor, other: Tensor, lo: int, hi: int) -> Tensor:
        """:meth:`merge_into` restricted to the entries ``[lo, hi)`` of the state vector."""
        if out.device.type == "cpu" and other.device.type == "cpu":      # numpy views: a fraction of torch's
            o, t = out.numpy(), other.numpy()                            # per-call cost (same IEEE results)
            for red, (a, b) in self.ranges.items():
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    _NP_MERGE[red](o[a:b], t[a:b], out=o[a:b])
            return out
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

    def merge_all_into_spans(self, out: Tensor, others: Sequence[Tensor], spans: Sequence[tuple]) -> Tensor:
        """:meth:`merge_into_range` of each of ``others`` in turn (their order kept for every entry) over each
        ``[lo, hi)`` of ``spans``; returns ``out``.  On the CPU one numpy call per state and field group, the
        views prepared once (a trailing window of W steps costs W small calls, not 2W torch-to-numpy round trips)."""
        if out.device.type == "cpu" and all(t.device.type == "cpu" for t in others):
            o = out.numpy()
            groups = []                                   # (entries x:y, columns p:q of `rows`, reduction)
            width = 0
            for red, (a, b) in self.ranges.items():
                for lo, hi in spans:
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        groups.append((x, y, width, width + y - x, red))
                        width += y - x
            if not groups or not others:
                return out
            # row 0: out; row i: others[i-1]; each group reduced down the rows in one call, in row order (a
            # cumulative sum is a left fold: ((out + s1) + s2) + ..., the same IEEE result as merging one by one)
            rows = np.empty((len(others) + 1, width))
            for i, t in enumerate([out, *others]):
                tn = t.numpy()
                for x, y, p, q, _ in groups:
                    rows[i, p:q] = tn[x:y]
            for x, y, p, q, red in groups:
                if red == "sum":
                    o[x:y] = np.cumsum(rows[:, p:q], axis=0)[-1]
                else:
                    o[x:y] = _NP_MERGE[red].reduce(rows[:, p:q], axis=0)
            return out
        for t in others:
            for lo, hi in spans:
                self.merge_into_range(out, t, lo, hi)
        return out

    def reduce(self, states: Sequence[Tensor]) -> Tensor:
        """The merge of ``states`` in the given order (a trailing window), as a new tensor."""
        out = self.identity(states[0].device if states else None)
        for s in states:
            self.merge_into(out, s)
        return out

    def all_reduce(self, state: Tensor, group=None) -> Tensor:
        """All-reduce ``state`` in place across ``group``: one SUM all-reduce of the sum fields and one
        MAX all-reduce of the (negated min, max) fields -- fixed sizes whatever the tokens."""
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

    The state is one float64 vector (:attr:`state`) laid out by :func:`state_layout`: the additive
    sums of :data:`SUM_FIELDS`, the δ quantile sketch (:mod:`triage_monitor.sketch`), the table of
    segment counts by (valid tokens, tail tokens) for C_tok, and δ's min and max.  Its size depends
    only on the segment width (about 161 KB at W = 64), never on the tokens.

    ``update(batch, tau_tail)`` adds one batch; ``merge(other)`` adds another accumulator (a step of
    another rank, or the steps of a window); ``compute()`` turns the state into metrics;
    ``sync(group)`` all-reduces it across ``torch.distributed`` ranks.  ``tau_tail`` is the τ_tail
    the localisation quantities were computed with (a merge of accumulators with different τ
    reports the last one).
    """

    def __init__(self, config: Optional[MetricConfig] = None, device: Optional[torch.device] = None,
                 state: Optional[Tensor] = None, tau_tail: float = math.nan):
        self.config = config or MetricConfig()
        self.layout = state_layout(self.config.segment_width)
        if state is not None:
            if tuple(state.shape) != (self.layout.size,):
                raise ValueError(f"MismatchStats state must have shape ({self.layout.size},) for segment width "
                                 f"{self.config.segment_width}, got {tuple(state.shape)}")
            self.state = state.to(torch.float64)
            self.device = self.state.device
        else:
            self.device = torch.device(device) if device is not None else torch.device("cpu")
            self.state = self.layout.identity(self.device)
        self.tau_tail = float(tau_tail)

    def part(self, name: str) -> Tensor:
        """The view of one declared field of :attr:`state` (``sums``, ``delta_sketch``, ``c_tok_table``,
        ``delta_min``, ``delta_max``)."""
        return self.state[self.layout.slices[name]]

    @property
    def sums(self) -> Tensor:
        """``(len(SUM_FIELDS),)`` float64 view of the additive sums."""
        return self.part("sums")

    @property
    def nbytes(self) -> int:
        """Bytes of the state (what a multi-rank sync sends per rank and reduction pass)."""
        return self.state.numel() * self.state.element_size()

    # ---------------------------------------------------------------- update
    def update(self, batch: TokenBatch, tau_tail: float = math.nan) -> "MismatchStats":
        """Add one batch.  ``tau_tail`` (nats) is the amplifying-tail threshold in force; with NaN the
        localisation part is left empty (those metrics stay NaN)."""
        dev = self.device
        return self.update_flat(batch.delta.to(dev), batch.advantage.to(dev), batch.sample_index.to(dev),
                                batch.position.to(dev), batch.num_samples, tau_tail)

    def update_flat(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Tensor,
                    num_samples: int, tau_tail: float = math.nan) -> "MismatchStats":
        """Add one batch given as flat tensors in :class:`TokenBatch` order (what :meth:`update` and the
        offline recomputation both call, so they agree exactly).

        Args:
            delta: ``(N,)`` float32, δ = learner − sampler log-prob (nats).
            advantage: ``(N,)`` float.
            sample_index: ``(N,)`` int64 in ``[0, num_samples)``, ascending.
            position: ``(N,)`` int64, unique and ascending within each sample.
            num_samples: S.
            tau_tail: τ_tail (nats) or NaN (no localisation).
        """
        if self._fused(delta, advantage, sample_index, position, num_samples,
                       state_kernel.MAGNITUDE if math.isnan(tau_tail) else state_kernel.BOTH, tau_tail):
            self.tau_tail = float(tau_tail)
            return self
        prepared = self.add_magnitude(delta, advantage, sample_index, num_samples)
        if not math.isnan(tau_tail):
            self.add_localisation(delta, advantage, sample_index, position, num_samples, tau_tail, prepared)
        self.tau_tail = float(tau_tail)
        return self

    #: Update a CPU state with the one-pass kernel of :mod:`triage_monitor.state_kernel` (False: the torch
    #: operations, as on an accelerator; the tests compare the two).
    use_kernel = True

    def _fused(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Optional[Tensor],
               num_samples: int, mode: int, tau_tail: float = math.nan) -> bool:
        """Apply the one-pass CPU kernel when the state and the inputs live on the CPU; False otherwise
        (the caller then runs the torch operations)."""
        if not (self.use_kernel and self.device.type == "cpu" and delta.device.type == "cpu"):
            return False
        cfg = self.config
        pos = position if position is not None else torch.zeros_like(sample_index)
        as_np = (lambda t, dt: t.detach().to(dt).contiguous().numpy())
        status = state_kernel.update_state(
            self.state.numpy(), self.layout.slices, SUM_FIELDS, as_np(delta, torch.float32),
            as_np(advantage, torch.float32), as_np(sample_index, torch.int64), as_np(pos, torch.int64),
            int(num_samples), mode=mode, tau_tail=tau_tail, width=cfg.segment_width,
            small_gap_threshold=cfg.small_gap_threshold, heavy_fraction=cfg.heavy_fraction,
            dilution_threshold=cfg.dilution_threshold)
        return status == state_kernel.OK

    def add_magnitude(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, num_samples: int) -> dict:
        """The τ-independent part of :meth:`update_flat` (magnitude, direction, sketch, min/max).

        Returns the per-response intermediates that :meth:`add_localisation` reuses (``prepared``)."""
        if self._fused(delta, advantage, sample_index, None, num_samples, state_kernel.MAGNITUDE):
            return {"fused": True}
        chunks = _chunks(sample_index, int(num_samples), delta.device)
        prepared = []
        for a, b, s0, s1 in chunks:
            prepared.append(self._magnitude(delta[a:b], advantage[a:b], sample_index[a:b] - s0, s1 - s0))
        self.part("delta_sketch").add_(sketch.sketch_counts(delta))
        if delta.numel():
            mn, mx = torch.aminmax(delta)
            torch.minimum(self.part("delta_min"), mn.double().reshape(1), out=self.part("delta_min"))
            torch.maximum(self.part("delta_max"), mx.double().reshape(1), out=self.part("delta_max"))
        return {"chunks": chunks, "per_chunk": prepared}

    def _magnitude(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, S: int) -> dict:
        cfg = self.config
        dev = self.device
        d64 = delta.double()
        abs_a = advantage.double().abs()
        abs_d = d64.abs()
        r = d64.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        exp_r = torch.exp(r)                                                  # chi2_token: clamped r
        nv = torch.bincount(sample_index, minlength=S)
        per_resp = torch.bincount(sample_index, weights=d64, minlength=S)      # Σδ per response
        nonempty = nv > 0
        # quadrant key 3·sign(A) + sign(δ) + 4: 0 amp_neg, 8 amp_pos, 2 con_neg, 6 con_pos (A or δ = 0: none)
        key = torch.sign(advantage).mul_(3).add_(torch.sign(delta)).add_(4).long()
        # |A| mass per (response, quadrant key): the region masses, their length-normalised form and each
        # response's signed advantage sum (keys 0-2: A < 0, 6-8: A > 0) all come from this one table
        table = torch.bincount(sample_index * 9 + key, weights=abs_a, minlength=9 * S).view(S, 9)
        quad = [0, 8, 2, 6]                                                    # order of REGIONS
        mass = table.sum(0)[quad]
        count = torch.bincount(key, minlength=9)[quad].double()
        inv_len = 1.0 / nv.clamp(min=1).double()
        lennorm = (table[:, [0, 8]] * inv_len[:, None]).sum(0)
        resp_adv = table[:, 6:].sum(1) - table[:, :3].sum(1)                  # Σ A per response
        f64 = (lambda x: torch.as_tensor(x, dtype=torch.float64, device=dev))
        parts = [
            f64(float(delta.numel())), f64(float(S)), nonempty.sum().double(),
            (abs_d < cfg.small_gap_threshold).sum().double(), d64.sum(), abs_d.sum(),
            (torch.exp(d64) - d64 - 1).sum(), (exp_r * exp_r).sum(),           # k3 on the unclamped δ
            # verl's rollout_corr sign: mean log-prob (sampler) − mean log-prob (learner), per response
            -(per_resp[nonempty] / nv[nonempty].double()).sum(), abs_a.sum(),
            mass, count, lennorm,
        ]
        vec = torch.cat([p.reshape(-1) for p in parts])
        self.state[:vec.numel()] += vec                      # SUM_FIELDS starts with these, in this order
        return {"nv": nv, "per_resp_delta": per_resp, "per_resp_adv": resp_adv}

    def add_localisation(self, delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Tensor,
                         num_samples: int, tau_tail: float, prepared: Optional[dict] = None) -> None:
        """The τ_tail-dependent part of :meth:`update_flat`: segment sums and the C_tok table
        (``prepared``: what :meth:`add_magnitude` returned for the same batch, to skip recomputing it)."""
        if self._fused(delta, advantage, sample_index, position, num_samples, state_kernel.LOCALISATION,
                       tau_tail):
            return
        cfg = self.config
        W = cfg.segment_width
        if prepared is None or "chunks" not in prepared:
            prepared = {"chunks": _chunks(sample_index, int(num_samples), delta.device)}
        per_chunk = prepared.get("per_chunk") or [None] * len(prepared["chunks"])
        cells, sums = [], torch.zeros(len(_LOC_FIELDS), dtype=torch.float64)
        for (a, b, s0, s1), prep in zip(prepared["chunks"], per_chunk):
            loc = _localisation(delta[a:b], advantage[a:b], sample_index[a:b] - s0, position[a:b], s1 - s0,
                                float(tau_tail), W, cfg.heavy_fraction, cfg.dilution_threshold, prep)
            cells.append(loc.pop("seg_valid") * (W + 1) + loc.pop("seg_tail"))
            sums += torch.tensor([loc[k] for k in _LOC_FIELDS], dtype=torch.float64)
        if cells:
            self.part("c_tok_table").add_(torch.bincount(torch.cat(cells), minlength=(W + 1) ** 2).double())
        self.state[_LOC_START:_LOC_START + len(_LOC_FIELDS)] += sums.to(self.device)

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """Add ``other``'s state into this one (in place; returns self)."""
        self.layout.merge_into(self.state, other.state.to(self.device))
        if not math.isnan(other.tau_tail):
            self.tau_tail = other.tau_tail
        return self

    @classmethod
    def merged(cls, parts: Iterable["MismatchStats"], config: Optional[MetricConfig] = None) -> "MismatchStats":
        """A new accumulator holding the merge of ``parts`` in order (e.g. a trailing window)."""
        parts = list(parts)
        out = cls(config or (parts[0].config if parts else None), parts[0].device if parts else None)
        for p in parts:
            out.merge(p)
        return out

    def sync(self, group=None) -> "MismatchStats":
        """All-reduce the state across the ranks of ``group`` (torch.distributed): one SUM all-reduce
        of the fixed-size sum fields and one MAX all-reduce of δ's (−min, max).  Exact: the result equals
        the state of the concatenated batches.  A no-op when torch.distributed is not initialised."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.layout.all_reduce(self.state, group)
        return self

    # ---------------------------------------------------------------- compute
    def compute(self) -> MetricResult:
        """Turn the state into the metrics of docs/metrics.md (names in :data:`METRIC_NAMES`)."""
        host = self.state.detach().cpu()
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
            for name in ("r_amp", "h_seg", "c_tok", "p_adj", "dilution"):
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


_LOC_FIELDS = ("neg_valid_tokens", "tail_tokens", "segments", "heavy_segments", "pairs", "pairs_heavy",
               "pairs_prev_heavy", "pairs_both_heavy", "responses_with_heavy", "responses_diluted")
_LOC_START = SUM_FIELDS.index(_LOC_FIELDS[0])
assert SUM_FIELDS[_LOC_START:_LOC_START + len(_LOC_FIELDS)] == _LOC_FIELDS


# --------------------------------------------------------------------------- calibration state
def _calibration_part(stats: MismatchStats) -> Tensor:
    """``(sketch.SIZE + 2,)`` float64: the step's δ sketch, min and max (what τ_tail is calibrated from)."""
    return torch.cat([stats.part("delta_sketch"), stats.part("delta_min"), stats.part("delta_max")]).clone()


def tau_from_calibration(parts: Sequence[Tensor], q: float) -> float:
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
                 calibration_steps: int = 25, device=None):
        if window < 1 or calibration_steps < 1:
            raise ValueError(f"window and calibration_steps must be >= 1, got {window}, {calibration_steps}")
        if tau_tail is not None and not math.isfinite(tau_tail):
            raise ValueError(f"tau_tail must be a finite number of nats or None (calibrate), got {tau_tail}")
        self.config = config or MetricConfig()
        self.window = int(window)
        self.calibration_steps = int(calibration_steps)
        self.device = device
        self.tau_given = tau_tail is not None
        self.tau_tail = float(tau_tail) if tau_tail is not None else math.nan
        self.tau_frozen = self.tau_given
        self.reference = calibration.ReferenceWindow(self.calibration_steps, 1, repeated="replace")
        self._history: list = []        # [(step, MismatchStats)] of the trailing window
        self._running = None            # Σ of the window's integer count fields (sketch, C_tok table)

    def _calibrate(self, step: int, part: Tensor) -> None:
        if self.tau_frozen:
            return
        if self.reference.add(step, [part]):                     # first step after the reference window
            self.tau_frozen = True
            return
        if self.reference.parts:
            self.tau_tail = calibration.part_quantiles(self.reference.merged(0), [self.config.tail_quantile])[0]

    def step(self, step: int, batch: TokenBatch, group=None) -> tuple:
        """Add one step; returns ``(step_result, window_result)`` (:class:`MetricResult` each).

        With ``group`` (torch.distributed), the step's fixed-size state is all-reduced, so every rank
        reports the global metrics; while τ_tail is calibrating, the step's δ sketch is all-reduced
        first (fixed size too), so τ_tail comes from the global δ.
        """
        dev = self.device if self.device is not None else batch.device
        stats = MismatchStats(self.config, dev)
        delta, adv = batch.delta.to(dev), batch.advantage.to(dev)
        sample_index = batch.sample_index.to(dev)
        distributed = group is not None or _dist_ready()
        if self.tau_frozen:                                      # one pass: both parts with the frozen τ_tail
            stats.update_flat(delta, adv, sample_index, batch.position.to(dev), batch.num_samples, self.tau_tail)
            if distributed:
                stats.sync(group)
            return self.push(step, stats)
        prepared = stats.add_magnitude(delta, adv, sample_index, batch.num_samples)
        part = _calibration_part(stats)                          # calibrating: τ_tail from the steps so far
        self._calibrate(step, calibration.sync_part(part, group) if distributed else part)
        if not math.isnan(self.tau_tail):
            stats.add_localisation(delta, adv, sample_index, batch.position.to(dev), batch.num_samples,
                                   self.tau_tail, prepared)
        stats.tau_tail = self.tau_tail
        if distributed:
            stats.sync(group)
        return self.push(step, stats)

    def push(self, step: int, stats: MismatchStats) -> tuple:
        """Append a step's finished (synced) state to the trailing window; returns ``(step_result,
        window_result)``.  A repeated step replaces the earlier one."""
        layout = stats.layout
        counts = slice(layout.slices["delta_sketch"].start, layout.slices["c_tok_table"].stop)
        if self._running is None or self._running.device != stats.state.device:
            self._running = torch.zeros(counts.stop - counts.start, dtype=torch.float64, device=stats.state.device)
            for _, st in self._history:
                self._running += st.state[counts]
        if self._history and self._history[-1][0] == step:
            self._running -= self._history.pop()[1].state[counts]
        self._history.append((step, stats))
        self._running += stats.state[counts]
        for s, st in self._history:
            if s <= step - self.window:
                self._running -= st.state[counts]
        self._history = [(s, st) for s, st in self._history if s > step - self.window]
        # the window's state, equal to layout.reduce of its steps' states in step order: the sketch and the C_tok
        # table are integer counts (exact in any order, so kept as a running sum: the cost does not grow with the
        # window), the other fields are reduced in step order
        state = layout.identity(stats.state.device)
        layout.merge_all_into_spans(state, [st.state for _, st in self._history],
                                    [(0, counts.start), (counts.stop, layout.size)])
        state[counts] = self._running
        window = MismatchStats(self.config, state=state, tau_tail=stats.tau_tail)
        return stats.compute(), window.compute()

    def state_dict(self) -> dict:
        """Calibration state for resuming: τ_tail, whether it is frozen and, while the reference window is
        still filling, the calibration part of each step so far (``calib``: one ``(sketch.SIZE + 2,)``
        float64 CPU tensor per step, at most ``calibration_steps``), so a resumed job calibrates the same τ_tail."""
        return {"tau_tail": self.tau_tail, "tau_frozen": self.tau_frozen, "config": asdict(self.config),
                "window": self.window, "calibration_steps": self.calibration_steps, "calib_format": "sketch",
                "calib": [] if self.tau_frozen else [ps[0].clone() for ps in self.reference.parts],
                "calib_steps": [] if self.tau_frozen else list(self.reference.step_numbers)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (``calib`` optional; δ values saved by older versions are
        turned into sketches)."""
        self.tau_tail, self.tau_frozen = float(sd["tau_tail"]), bool(sd["tau_frozen"])
        calib = [] if self.tau_frozen else list(sd.get("calib", []))
        if sd.get("calib_format") != "sketch":
            calib = [_calibration_part(MismatchStats(self.config).update_flat(
                torch.as_tensor(c).float().cpu(), torch.zeros(len(c)), torch.zeros(len(c), dtype=torch.long),
                torch.arange(len(c)), 1)) for c in calib]
        self.reference = calibration.ReferenceWindow(self.calibration_steps, 1, repeated="replace")
        self.reference.frozen = self.tau_frozen
        self.reference.parts = [[torch.as_tensor(c, dtype=torch.float64).cpu()] for c in calib]
        self.reference.step_numbers = list(sd.get("calib_steps", range(-len(calib), 0)))


#: Tokens per piece of a CPU update: the batch is cut at response boundaries into pieces of about this
#: size, so each piece's intermediates stay in cache.  The cut depends only on the batch, so live and offline
#: updates of the same batch add the same partial sums in the same order.
CPU_CHUNK_TOKENS = 1 << 15


def _chunks(sample_index: Tensor, S: int, device) -> list:
    """``[(token start, token end, sample start, sample end)]`` pieces of a batch, cut at response boundaries
    (one piece on an accelerator)."""
    N = sample_index.numel()
    if torch.device(device).type != "cpu" or N <= CPU_CHUNK_TOKENS:
        return [(0, N, 0, S)]
    offsets = torch.zeros(S + 1, dtype=torch.long)
    torch.cumsum(torch.bincount(sample_index, minlength=S), 0, out=offsets[1:])
    targets = torch.arange(CPU_CHUNK_TOKENS, N, CPU_CHUNK_TOKENS)
    cuts = torch.unique(torch.searchsorted(offsets, targets)).tolist()       # first response at/after each target
    cuts = [c for c in cuts if 0 < c < S]
    samples = [0, *cuts, S]
    toks = offsets[samples].tolist()
    return [(toks[i], toks[i + 1], samples[i], samples[i + 1]) for i in range(len(samples) - 1)]


def segment_tail_counts(delta: Tensor, advantage: Tensor, sample_index: Tensor, position: Tensor,
                        response_advantage: Tensor, tau_tail: float, width: int) -> tuple:
    """The one definition of segments and amplifying-tail tokens (docs/metrics.md#localisation), used by the
    metrics, the stage table's shuffle null and the dashboard.

    Segments of ``width`` positions are cut over every response and those of A<0 responses (mean advantage of the
    valid tokens < 0, ``response_advantage``) kept; a tail token has A < 0 and δ < ``tau_tail`` (nats).

    Args:
        delta, advantage: ``(N,)`` per valid token, ordered by sample, then position (float32 δ, as
            :attr:`TokenBatch.delta <triage_monitor.batch.TokenBatch.delta>`).
        sample_index, position: ``(N,)`` int64.
        response_advantage: ``(S,)`` mean advantage of each response's valid tokens.

    Returns:
        ``(sample, number, valid, tail)``: ``(K,)`` int64 per kept segment (K in (sample, number) order): its
        response index, its index k (positions [kW, (k+1)W)), its valid tokens and its tail tokens.
    """
    dev = delta.device
    N = delta.numel()
    if N == 0:
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return e, e, e, e
    if width & (width - 1) == 0:                                  # positions are >= 0: a shift is a floor division
        number = position >> (width.bit_length() - 1)
    else:
        number = torch.div(position, width, rounding_mode="floor")
    start = torch.ones(N, dtype=torch.bool, device=dev)          # first token of each segment
    torch.ne(number[1:], number[:-1], out=start[1:])
    start[1:] |= sample_index[1:] != sample_index[:-1]
    first = torch.nonzero(start).squeeze(1)
    seg_sample, seg_number = sample_index[first], number[first]
    bounds = torch.cat([first, torch.tensor([N], device=dev)])
    count = bounds[1:] - bounds[:-1]                              # (K,) valid tokens per segment
    tail_cum = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    torch.cumsum((advantage < 0) & (delta < tau_tail), 0, out=tail_cum[1:])
    seg_tail = tail_cum[bounds[1:]] - tail_cum[bounds[:-1]]       # (K,) amplifying-tail tokens per segment
    keep = response_advantage[seg_sample] < 0                     # (K,) segment of an A<0 response
    return seg_sample[keep], seg_number[keep], count[keep], seg_tail[keep]


def _localisation(delta: Tensor, adv: Tensor, sample_index: Tensor, position: Tensor, S: int, tau_tail: float,
                  width: int, heavy_fraction: float, dilution_threshold: float,
                  prepared: Optional[dict] = None) -> dict:
    """Localisation sums of one batch (tokens ordered by sample, then position).  Segments are cut over every
    response (as :func:`~triage_monitor.segments.segment_tokens` would) and those of A<0 responses kept: a
    response's segments are kept or dropped together, so predecessors are unchanged."""
    dev = delta.device
    if prepared is None:
        prepared = {"nv": torch.bincount(sample_index, minlength=S),
                    "per_resp_delta": torch.bincount(sample_index, weights=delta.double(), minlength=S)}
    resp_adv = prepared.get("per_resp_adv")
    if resp_adv is None:
        resp_adv = torch.bincount(sample_index, weights=adv.double(), minlength=S)
    nv = prepared["nv"].clamp(min=1).double()
    if delta.numel() == 0:
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return {"seg_tail": e, "seg_valid": e, **{k: 0.0 for k in _LOC_FIELDS}}
    sample_k, number_k, seg_valid, seg_tail = segment_tail_counts(delta, adv, sample_index, position, resp_adv / nv,
                                                                  tau_tail, width)
    heavy = seg_tail.double() > heavy_fraction * seg_valid.double()
    has_prev = torch.zeros_like(heavy)
    prev_heavy = torch.zeros_like(heavy)
    if heavy.numel() > 1:
        has_prev[1:] = (sample_k[1:] == sample_k[:-1]) & (number_k[1:] == number_k[:-1] + 1)
        prev_heavy[1:] = has_prev[1:] & heavy[:-1]
    # dilution: A<0 responses holding at least one tail-heavy segment whose signed mean δ is small
    resp_heavy = torch.zeros(S, dtype=torch.bool, device=dev)
    resp_heavy[sample_k[heavy]] = True
    resp_mean = prepared["per_resp_delta"] / nv
    diluted = resp_heavy & (resp_mean.abs() < dilution_threshold)
    sums = torch.stack([seg_valid.sum().double(), seg_tail.sum().double(),
                        torch.tensor(float(seg_valid.numel()), dtype=torch.float64, device=dev),
                        heavy.sum().double(), has_prev.sum().double(), (has_prev & heavy).sum().double(),
                        prev_heavy.sum().double(), (prev_heavy & heavy).sum().double(),
                        resp_heavy.sum().double(), diluted.sum().double()]).tolist()
    return {"seg_tail": seg_tail, "seg_valid": seg_valid, **dict(zip(_LOC_FIELDS, sums))}


def _dist_ready() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def compute_step_metrics(batch: TokenBatch, tau_tail: float = math.nan,
                         config: Optional[MetricConfig] = None) -> MetricResult:
    """Metrics of a single batch with a given τ_tail (nats): the one-call form of :class:`MismatchStats`."""
    return MismatchStats(config, batch.device).update(batch, tau_tail).compute()
