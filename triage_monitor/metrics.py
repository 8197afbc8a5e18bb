"""Direction-aware mismatch metrics (SPEC.md §3), live and offline from one implementation.

Two layers, in the style of torchmetrics:

* pure tensor functions over a :class:`~triage_monitor.batch.TokenBatch`
  (:func:`region_codes`, :func:`segment_tail_stats`, :func:`c_tok_from_segments`,
  :func:`quantiles`), shapes stated;
* :class:`MismatchStats`, an accumulator that keeps *sums* (plus the δ values
  for quantiles and one (tail, valid) pair per segment for C_tok) with
  ``update`` / ``merge`` / ``compute`` / ``sync``.  A trailing window is the
  merge of its steps' accumulators, so window metrics pool the raw sums of the
  window instead of averaging per-step ratios (SPEC.md §3).

All arithmetic on the accumulated quantities is float64; the inputs are the
float32 values that the records store, so a recomputation from the Parquet
files reproduces the live values exactly.

Every ratio whose denominator is 0 is NaN, and :meth:`MismatchStats.compute`
records the reason in ``MetricResult.nan_reasons``; nothing is ever inf.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from .batch import TokenBatch
from .segments import segment_tokens

Tensor = torch.Tensor

#: Quantiles of δ reported per step / window (SPEC.md §3.1), name → q.
DELTA_QUANTILES = {"delta_q01": 0.01, "delta_q05": 0.05, "delta_q50": 0.50}
#: r = learner − sampler is clamped to ±R before exp() in k3_kl and chi2_token, as verl / slime do (SPEC.md §3.1).
LOG_RATIO_CLAMP = 20.0
REGIONS = ("amp_neg", "amp_pos", "con_neg", "con_pos")

# The additive state of MismatchStats, one float64 each (reduced with SUM across ranks).
SUM_FIELDS = (
    "n_tokens", "n_samples", "n_samples_nonempty", "small_gap_count", "delta_sum", "delta_abs_sum",
    "k3_sum", "exp_r_sq_sum", "log_ppl_diff_sum", "abs_adv_sum",
    *(f"mass_{r}" for r in REGIONS), *(f"count_{r}" for r in REGIONS),
    "lennorm_amp_neg", "lennorm_amp_pos",
    # localisation (SPEC.md §3.3), over responses with A < 0
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


@dataclass(frozen=True)
class MetricConfig:
    """Thresholds of SPEC.md §3 (defaults are the SPEC's).

    Attributes:
        small_gap_threshold: |δ| below this (nats) counts as a small gap (§3.1).
        segment_width: W, tokens per localisation segment (§3.3).
        tail_quantile: τ_tail is this quantile of δ over the reference window (§3.3).
        heavy_fraction: a segment is tail-heavy when its tail fraction exceeds this (§3.3).
        top_fraction: C_tok counts tail tokens inside the top ``ceil(top_fraction · segments)`` segments.
        dilution_threshold: |mean δ| of a response below this is "diluted" (§3.3).
    """

    small_gap_threshold: float = 0.05
    segment_width: int = 64
    tail_quantile: float = 0.05
    heavy_fraction: float = 0.10
    top_fraction: float = 0.05
    dilution_threshold: float = 0.05

    def __post_init__(self):
        for name in ("small_gap_threshold", "segment_width", "heavy_fraction", "top_fraction", "dilution_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MetricConfig.{name} must be > 0, got {getattr(self, name)}")
        if isinstance(self.segment_width, bool) or not isinstance(self.segment_width, numbers.Integral):
            raise ValueError(f"MetricConfig.segment_width must be an integer (tokens), got {self.segment_width!r}")
        if not 0 < self.tail_quantile < 1 or not self.top_fraction <= 1:
            raise ValueError(f"MetricConfig: tail_quantile must lie in (0, 1) and top_fraction in (0, 1], got "
                             f"{self.tail_quantile}, {self.top_fraction}")


@dataclass
class MetricResult:
    """Output of :meth:`MismatchStats.compute`: ``values`` (name → float, NaN allowed) and
    ``nan_reasons`` (name → why it is NaN)."""

    values: dict
    nan_reasons: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- pure functions
def region_codes(delta: Tensor, advantage: Tensor) -> Tensor:
    """``(N,)`` int64 region of each token: 0 amp_neg, 1 amp_pos, 2 con_neg, 3 con_pos, 4 none.

    Regions of SPEC.md §2 ("Quadrants"): amp_neg A<0, δ<0; amp_pos A>0, δ>0; con_neg A<0, δ>0;
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
                       dilution_threshold: float, delta: Optional[Tensor] = None) -> dict:
    """Localisation quantities of one batch (SPEC.md §3.3), over responses with A < 0.

    A response's advantage is the mean advantage of its valid tokens (the GRPO
    per-response value when advantages are broadcast).  A token is an
    amplifying-tail token when its A < 0 and δ < τ_tail.  Segments are cut by
    position (``width`` tokens) with :func:`~triage_monitor.segments.segment_tokens`.

    Returns a dict with ``seg_tail`` and ``seg_valid`` (``(K,)`` int64 per
    segment of the A<0 responses, in (sample, k) order) and the float sums
    ``neg_valid_tokens``, ``tail_tokens``, ``segments``, ``heavy_segments``,
    ``pairs`` (segments with a predecessor k−1 in the same response),
    ``pairs_heavy``, ``pairs_prev_heavy``, ``pairs_both_heavy``,
    ``responses_with_heavy`` and ``responses_diluted``.
    """
    delta = batch.delta if delta is None else delta         # (N,) float32; the caller may pass it precomputed
    adv = batch.advantage.float()
    S = batch.num_samples
    dev = delta.device
    nv = batch.num_valid.clamp(min=1).double()
    resp_adv = torch.zeros(S, dtype=torch.float64, device=dev).index_add(0, batch.sample_index, adv.double()) / nv
    neg = resp_adv[batch.sample_index] < 0                      # (N,) token belongs to an A<0 response
    idx = torch.nonzero(neg).squeeze(1)
    sub_sample = batch.sample_index[idx]
    seg = segment_tokens(sub_sample, batch.position[idx], width)
    tail = (adv[idx] < 0) & (delta[idx] < tau_tail)
    seg_tail = seg.sum(tail.long())
    heavy = seg_tail.double() > heavy_fraction * seg.count.double()
    prev = seg.predecessor()
    has_prev = prev >= 0
    prev_heavy = torch.zeros_like(heavy)
    prev_heavy[has_prev] = heavy[prev[has_prev]]
    # dilution: A<0 responses holding at least one tail-heavy segment whose signed mean δ is small
    resp_heavy = torch.zeros(S, dtype=torch.bool, device=dev)
    resp_heavy[seg.sample[heavy]] = True
    resp_mean = torch.zeros(S, dtype=torch.float64, device=dev).index_add(0, batch.sample_index, delta.double()) / nv
    diluted = resp_heavy & (resp_mean.abs() < dilution_threshold)
    return {
        "seg_tail": seg_tail, "seg_valid": seg.count,
        "neg_valid_tokens": float(idx.numel()), "tail_tokens": float(tail.sum()),
        "segments": float(seg.num_segments), "heavy_segments": float(heavy.sum()),
        "pairs": float(has_prev.sum()), "pairs_heavy": float((has_prev & heavy).sum()),
        "pairs_prev_heavy": float(prev_heavy.sum()), "pairs_both_heavy": float((prev_heavy & heavy).sum()),
        "responses_with_heavy": float(resp_heavy.sum()), "responses_diluted": float(diluted.sum()),
    }


def c_tok_from_segments(seg_tail: Tensor, seg_valid: Tensor, top_fraction: float = 0.05) -> float:
    """C_tok (SPEC.md §3.3): share of all amplifying-tail tokens inside the top segments.

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


# --------------------------------------------------------------------------- accumulator
class MismatchStats:
    """Mergeable sums behind every metric of SPEC.md §3.1–3.3.

    ``update(batch, tau_tail)`` adds one batch; ``merge(other)`` adds another
    accumulator (a step from another rank, or the steps of a window);
    ``compute()`` turns the sums into metrics; ``sync(group)`` all-reduces the
    state across ``torch.distributed`` ranks.

    State: ``sums`` (``(len(SUM_FIELDS),)`` float64), ``delta_min``,
    ``deltas`` (list of float32 δ tensors, for exact pooled quantiles),
    ``seg_tail`` / ``seg_valid`` (int64 per segment, for C_tok) and ``tau_tail``
    (the τ_tail the localisation quantities were computed with; a merge of
    accumulators with different τ reports the last one).
    """

    def __init__(self, config: Optional[MetricConfig] = None, device: Optional[torch.device] = None):
        self.config = config or MetricConfig()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.sums = torch.zeros(len(SUM_FIELDS), dtype=torch.float64, device=self.device)
        self.delta_min = math.inf
        self.deltas: list = []
        self.seg_tail: list = []
        self.seg_valid: list = []
        self.tau_tail = math.nan

    # ---------------------------------------------------------------- update
    def update(self, batch: TokenBatch, tau_tail: float = math.nan) -> "MismatchStats":
        """Add one batch.  ``tau_tail`` (nats) is the amplifying-tail threshold
        in force; with NaN the localisation metrics stay NaN.  One pass of
        vectorised reductions; no host synchronisation except for the
        localisation part and ``delta_min``."""
        cfg = self.config
        dev = self.device
        delta = batch.delta.to(dev)
        adv = batch.advantage.to(dev).float()
        d64, abs_a = delta.double(), adv.double().abs()
        r = d64.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        exp_r = torch.exp(r)
        sample_index = batch.sample_index.to(dev)
        nv = batch.num_valid.to(dev)
        S = batch.num_samples
        per_resp = torch.zeros(S, dtype=torch.float64, device=dev).index_add(0, sample_index, d64)
        nonempty = nv > 0
        # region code per token: 0 amp_neg, 1 amp_pos, 2 con_neg, 3 con_pos, 4 none (SPEC §2 quadrants)
        code = region_codes(delta, adv)
        mass = torch.bincount(code, weights=abs_a, minlength=5)[:4]
        count = torch.bincount(code, minlength=5)[:4].double()
        inv_len = 1.0 / nv.clamp(min=1).double()
        lennorm = torch.bincount(code, weights=abs_a * inv_len[sample_index], minlength=5)[:2]
        parts = {
            "n_tokens": torch.tensor(float(delta.numel()), dtype=torch.float64, device=dev),
            "n_samples": torch.tensor(float(S), dtype=torch.float64, device=dev),
            "n_samples_nonempty": nonempty.sum().double(),
            "small_gap_count": (d64.abs() < cfg.small_gap_threshold).sum().double(),
            "delta_sum": d64.sum(), "delta_abs_sum": d64.abs().sum(),
            "k3_sum": (exp_r - r - 1).sum(), "exp_r_sq_sum": (exp_r * exp_r).sum(),
            # verl's rollout_corr sign: mean log-prob (sampler) − mean log-prob (learner), per response
            "log_ppl_diff_sum": -(per_resp[nonempty] / nv[nonempty].double()).sum(),
            "abs_adv_sum": abs_a.sum(),
        }
        for i, name in enumerate(REGIONS):
            parts[f"mass_{name}"] = mass[i]
            parts[f"count_{name}"] = count[i]
        parts["lennorm_amp_neg"], parts["lennorm_amp_pos"] = lennorm[0], lennorm[1]
        if not math.isnan(tau_tail):
            loc = segment_tail_stats(batch.to(dev).detach(), tau_tail, cfg.segment_width,
                                     cfg.heavy_fraction, cfg.dilution_threshold, delta=delta)
            self.seg_tail.append(loc.pop("seg_tail"))
            self.seg_valid.append(loc.pop("seg_valid"))
            parts.update({k: torch.tensor(v, dtype=torch.float64, device=dev) for k, v in loc.items()})
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        self.sums += torch.stack([parts.get(k, zero).to(torch.float64) for k in SUM_FIELDS])
        self.tau_tail = float(tau_tail)
        if delta.numel():
            self.delta_min = min(self.delta_min, float(delta.min()))
        self.deltas.append(delta)
        return self

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """Add ``other``'s state into this one (in place; returns self)."""
        self.sums += other.sums.to(self.device)
        self.delta_min = min(self.delta_min, other.delta_min)
        self.deltas.extend(d.to(self.device) for d in other.deltas)
        self.seg_tail.extend(t.to(self.device) for t in other.seg_tail)
        self.seg_valid.extend(t.to(self.device) for t in other.seg_valid)
        if not math.isnan(other.tau_tail):
            self.tau_tail = other.tau_tail
        return self

    @classmethod
    def merged(cls, parts: Iterable["MismatchStats"], config: Optional[MetricConfig] = None) -> "MismatchStats":
        """A new accumulator holding the merge of ``parts`` (e.g. a trailing window)."""
        parts = list(parts)
        out = cls(config or (parts[0].config if parts else None), parts[0].device if parts else None)
        for p in parts:
            out.merge(p)
        return out

    def sync(self, group=None) -> "MismatchStats":
        """All-reduce the state across the ranks of ``group`` (torch.distributed).

        Sums are reduced with SUM, ``delta_min`` with MIN, and the δ values and
        per-segment counts are all-gathered (exact: the merged quantiles and
        C_tok equal those of the concatenated batch).  A no-op when
        torch.distributed is not initialised.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        dist.all_reduce(self.sums, op=dist.ReduceOp.SUM, group=group)
        m = torch.tensor([self.delta_min], dtype=torch.float64, device=self.sums.device)
        dist.all_reduce(m, op=dist.ReduceOp.MIN, group=group)
        self.delta_min = float(m)
        self.deltas = _all_gather_varlen(self._cat(self.deltas, torch.float32), group)
        self.seg_tail = _all_gather_varlen(self._cat(self.seg_tail), group)
        self.seg_valid = _all_gather_varlen(self._cat(self.seg_valid), group)
        return self

    def _cat(self, parts: list, dtype=torch.long) -> Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.device)

    # ---------------------------------------------------------------- compute
    def compute(self) -> MetricResult:
        """Turn the accumulated sums into the metrics of SPEC.md §3.1–3.3 (names in :data:`METRIC_NAMES`)."""
        s = dict(zip(SUM_FIELDS, self.sums.tolist()))
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
        v["n_tokens"], v["n_samples"] = n, s["n_samples_nonempty"]
        ratio("small_gap_share", s["small_gap_count"], n, "no valid tokens")
        ratio("delta_mean", s["delta_sum"], n, "no valid tokens")
        ratio("delta_abs_mean", s["delta_abs_sum"], n, "no valid tokens")
        qs = quantiles(self._cat(self.deltas, torch.float32), list(DELTA_QUANTILES.values()))
        for name, q in zip(DELTA_QUANTILES, qs):
            v[name] = q
            if math.isnan(q):
                why[name] = "no valid tokens"
        v["delta_min"] = self.delta_min if n else math.nan
        if not n:
            why["delta_min"] = "no valid tokens"
        ratio("k3_kl", s["k3_sum"], n, "no valid tokens")
        ratio("log_ppl_diff", s["log_ppl_diff_sum"], s["n_samples_nonempty"], "no response with a valid token")
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
            v["c_tok"] = c_tok_from_segments(self._cat(self.seg_tail), self._cat(self.seg_valid),
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


# --------------------------------------------------------------------------- streaming tracker
class MetricTracker:
    """Per-step and trailing-window metrics over a stream of steps, with τ_tail calibration.

    τ_tail (SPEC.md §3.3) is ``tau_tail`` when given; otherwise the
    ``config.tail_quantile`` quantile of δ pooled over every valid token of the
    first ``calibration_steps`` steps.  While the reference window is still
    filling, the steps use the provisional value computed from the steps seen
    so far (current step included); it is frozen when the first step after
    the reference window arrives (steps counted as distinct step numbers with
    at least one valid token; a repeated step replaces its earlier δ values).

    ``observe(stats)`` takes a step's accumulator *before* its localisation
    part is filled (see :meth:`step`), which is why the tracker, not the
    caller, calls :meth:`MismatchStats.update`.

    Live monitoring and offline recomputation both drive this class, so they agree exactly.
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
        self._calib: list = []
        self._calib_steps: list = []    # step number of each entry of _calib
        self._history: list = []        # [(step, MismatchStats)] of the trailing window

    def _calibrate(self, step: int, delta: Tensor) -> None:
        if self.tau_frozen or delta.numel() == 0:
            return          # a step without valid tokens (no token file either) is no reference step
        if self._calib_steps and self._calib_steps[-1] == step:
            self._calib[-1] = delta.detach().float().cpu()      # a repeated step replaces the earlier one
        elif len(self._calib) >= self.calibration_steps:
            self.tau_frozen = True                               # first step after the reference window
            self._calib, self._calib_steps = [], []
            return
        else:
            self._calib.append(delta.detach().float().cpu())
            self._calib_steps.append(step)
        self.tau_tail = quantiles(torch.cat(self._calib), [self.config.tail_quantile])[0]

    def step(self, step: int, batch: TokenBatch, group=None) -> tuple:
        """Add one step; returns ``(step_result, window_result)`` (:class:`MetricResult` each).

        With ``group`` (torch.distributed), the step's state is all-reduced
        first, so every rank reports the global metrics; τ_tail is calibrated
        from the global δ values.
        """
        stats = MismatchStats(self.config, self.device)
        if group is not None or _dist_ready():
            # calibrate from the global δ: gather first (only while calibrating), then update with the shared τ
            if not self.tau_frozen:
                dev = self.device if self.device is not None else batch.device
                self._calibrate(step, torch.cat(_all_gather_varlen(batch.delta.to(dev), group)))
            stats.update(batch, self.tau_tail).sync(group)
        else:
            self._calibrate(step, batch.delta)
            stats.update(batch, self.tau_tail)
        if self._history and self._history[-1][0] == step:
            self._history.pop()          # a repeated step replaces the earlier one
        self._history.append((step, stats))
        self._history = [(s, st) for s, st in self._history if s > step - self.window]
        window = MismatchStats.merged([st for _, st in self._history], self.config)
        return stats.compute(), window.compute()

    def state_dict(self) -> dict:
        """Calibration state for resuming: τ_tail, whether it is frozen and, while the reference
        window is still filling, the δ values gathered so far (``calib``, one float32 CPU tensor per
        step; at most ``calibration_steps`` steps' worth), so a resumed job calibrates the same τ_tail."""
        return {"tau_tail": self.tau_tail, "tau_frozen": self.tau_frozen, "config": asdict(self.config),
                "window": self.window, "calibration_steps": self.calibration_steps,
                "calib": [c.clone() for c in self._calib], "calib_steps": list(self._calib_steps)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (``calib`` optional)."""
        self.tau_tail, self.tau_frozen = float(sd["tau_tail"]), bool(sd["tau_frozen"])
        self._calib = [torch.as_tensor(c).float().cpu() for c in sd.get("calib", [])] if not self.tau_frozen else []
        self._calib_steps = list(sd.get("calib_steps", range(-len(self._calib), 0)))


def _all_gather_varlen(t: Tensor, group=None) -> list:
    """All-gather a 1-D tensor whose length differs between ranks: ``[rank 0's, rank 1's, ...]``.

    Plain tensor collectives (sizes first, then the values padded to the largest size), no
    pickling (unlike ``all_gather_object``), on ``t``'s device (gloo: CPU, NCCL: CUDA).
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    size = torch.tensor([t.numel()], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(x) for x in sizes]
    if max(sizes) == 0:
        return [t[:0] for _ in sizes]
    padded = torch.zeros(max(sizes), dtype=t.dtype, device=t.device)
    padded[:t.numel()] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [o[:n] for o, n in zip(out, sizes)]


def _dist_ready() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def compute_step_metrics(batch: TokenBatch, tau_tail: float = math.nan,
                         config: Optional[MetricConfig] = None) -> MetricResult:
    """Metrics of a single batch with a given τ_tail (nats): the one-call form of :class:`MismatchStats`."""
    return MismatchStats(config, batch.device).update(batch, tau_tail).compute()
