"""The TRIAGE controller: Gate weights, bounded Repair, TIS and their calibration (docs/metrics.md#controller).

One call per (micro-)batch; the loss itself is assembled by :func:`triage_monitor.triage.loss.triage_policy_loss`::

    ctrl = TriageController(TriageConfig())
    res = triage_policy_loss(ctrl, batch, step, old_logp=batch.gather(old_logp))   # controller + PPO + agg_loss

The controller changes the loss only.  All segment reductions go through
:mod:`triage_monitor.metrics.segments` (no Python loop over segments or responses).

Decisions the definitions in docs/metrics.md leave open (documented here and in the docstrings):

* **Valid repair segments** (docs/metrics.md#repair "Σφ / number of in-scope
  repair segments"): the *in-scope* segments, i.e. the repair segments (≥ 1 valid
  token) that can carry gradient: mean advantage > 0 for scopes
  ``adv_positive`` and ``q2``, every segment for ``whole``.  Both Σφ and the
  count run over these segments, so out-of-scope segments (whose φ would be a
  constant) neither add to the loss value nor dilute the pull-up (in the published
  runs only segments whose mean advantage is > 0 carry gradient).
* **per_response** normalisation averages over responses with ≥ 1 valid token;
  a response whose weight sum Σ_t w is 0 (all tokens gated or masked to 0)
  contributes 0 to the numerator and still counts in the denominator, so
  zeroing a whole response shrinks the step instead of inflating the others.
* **Distributed** (``group`` given): numerator and denominator are all-reduced
  (sum).  The returned value is the global loss on every rank, but the
  gradient flows only through this rank's tokens: it is the gradient of the
  global loss w.r.t. the local tokens.  A data-parallel wrapper that *averages*
  gradients over W ranks (DDP/FSDP) then divides by W; multiply the loss by W
  if you want the exact global gradient (verl does the same for its
  ``global_token`` mode).
* **Calibration** (docs/metrics.md#gate): during the reference window the fixed
  thresholds are used; calibrated ones apply from the first step after it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional, Tuple, TypedDict, Union, cast

import torch

from ..batch import TokenBatch
from ..metrics.calibration import ReferenceWindow, part_of
from .corrections import tis_weights as _tis_weights
from ..metrics.segments import Segments, broadcast_where_negative, coarsen, segment_sums, segment_tokens

Tensor = torch.Tensor

GATE_SCOPES = ("q3", "whole")
REPAIR_SCOPES = ("adv_positive", "q2", "whole")
NORMALIZATIONS = ("per_response", "global_token")
STATE_VERSION = 2


class Thresholds(TypedDict):
    """The Gate's thresholds in nats (:meth:`TriageController.effective_thresholds`), calibrated or fixed."""

    neg_threshold: float
    severe_threshold: float
    delta_bad: float


class ControllerState(TypedDict):
    """:meth:`TriageController.state_dict`: calibration and counters (plain values and CPU tensors)."""

    version: int
    config: dict[str, Any]
    calls: int
    last_step: Optional[int]
    thresholds: Optional[Thresholds]
    reference: dict


class RepairSegments(NamedTuple):
    """:meth:`TriageController._repair_segments`: the repair segments and which have a mean advantage > 0
    (``(K,)`` bool; None for the ``whole`` scope)."""

    segments: Segments
    positive: Optional[Tensor]


class RepairTerms(NamedTuple):
    """:func:`repair_terms`: the per-segment penalty φ, which segments are in scope, and the shortfall q."""

    phi: Tensor
    in_scope: Tensor
    shortfall: Tensor


# ------------------------------------------------------------------ config
@dataclass
class CalibrationConfig:
    """Calibrated Gate thresholds from a reference window (docs/metrics.md#gate).

    Over the first ``window`` steps the controller keeps the quantile sketches of the gate-segment mean δ and
    of the token δ (:class:`~triage_monitor.metrics.calibration.ReferenceWindow`, the same reference-window
    implementation as the monitor's τ_tail); at the first later step it sets ``neg_threshold`` /
    ``severe_threshold`` to the ``neg_quantile`` / ``severe_quantile`` of the segment means and ``delta_bad`` to
    the ``bad_quantile`` of the token δ (nats), read from the sketches (error bound: docs/metrics.md#accuracy).
    With a process group the sketches are summed across ranks first (global quantiles).  The micro-batch calls of
    one step add up; a step counts once.
    """

    window: int = 25
    neg_quantile: float = 0.05
    severe_quantile: float = 0.01
    bad_quantile: float = 0.001

    def __post_init__(self):
        if int(self.window) <= 0:
            raise ValueError(f"CalibrationConfig.window must be a positive number of steps, got {self.window}")
        if not (0.0 < self.severe_quantile < self.neg_quantile < 1.0):
            raise ValueError("CalibrationConfig needs 0 < severe_quantile < neg_quantile < 1, got "
                             f"severe_quantile={self.severe_quantile}, neg_quantile={self.neg_quantile}")
        if not (0.0 < self.bad_quantile < 1.0):
            raise ValueError(f"CalibrationConfig.bad_quantile must be in (0, 1), got {self.bad_quantile}")


@dataclass
class TriageConfig:
    """TRIAGE settings; defaults are the published configuration (docs/metrics.md#controller).

    Gate (§4.1): ``gate_width`` W_gate tokens; ``neg_threshold`` / ``severe_threshold``
    (nats, on the segment mean δ) with weights ``neg_weight`` / ``severe_weight``;
    tail: ``k`` = #tokens with δ < ``delta_bad`` and tail weight
    ``1 − (1 − tail_floor)·min(k / tail_count, 1)``; ``gate_scope`` ``"q3"`` | ``"whole"``.
    Repair (§4.3): ``repair_width`` W_rep, ``repair_tau`` τ, ``repair_beta`` β,
    ``repair_coef``, ``repair_scope`` ``"adv_positive"`` | ``"q2"`` | ``"whole"``,
    ``repair_start_step`` (repair is 0 for ``step < repair_start_step``).
    ``normalization`` (§4.2) is the default for :func:`weighted_policy_loss` users;
    ``tis_clip`` = (lo, hi) for TIS (§4.5); ``calibration`` = None, a
    :class:`CalibrationConfig` or a dict of its fields (§4.4).

    Raises:
        ValueError: on construction, naming the field and value, if
            ``0 < severe_weight <= neg_weight <= 1``, ``severe_threshold < neg_threshold``,
            positive widths / ``tail_count``, ``0 <= tail_floor <= 1``, ``repair_beta > 0``,
            ``repair_coef >= 0``, ``repair_start_step >= 0``, ``0 <= lo < hi`` or a known
            scope / normalisation does not hold.
    """

    gate: bool = True
    repair: bool = True
    tis: bool = True
    gate_width: int = 64
    gate_scope: str = "q3"
    neg_threshold: float = -0.5
    severe_threshold: float = -1.5
    neg_weight: float = 0.3
    severe_weight: float = 0.1
    delta_bad: float = -6.0
    tail_count: int = 2
    tail_floor: float = 0.1
    repair_width: int = 128
    repair_tau: float = -0.03
    repair_beta: float = math.sqrt(5e-4)
    repair_coef: float = 0.015
    repair_scope: str = "adv_positive"
    repair_start_step: int = 0
    normalization: str = "per_response"
    tis_clip: Tuple[float, float] = (0.0, 2.0)
    calibration: Optional[CalibrationConfig] = None

    def __post_init__(self):
        def bad(name, need):
            raise ValueError(f"TriageConfig.{name} = {getattr(self, name)!r}: {need}")

        for name in ("gate_width", "repair_width", "tail_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(name, "must be a positive integer")
        if not (0.0 < self.severe_weight <= self.neg_weight <= 1.0):
            raise ValueError("TriageConfig needs 0 < severe_weight <= neg_weight <= 1, got "
                             f"severe_weight={self.severe_weight}, neg_weight={self.neg_weight}")
        for name in ("neg_threshold", "severe_threshold", "delta_bad", "repair_tau"):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be finite (nats)")
        if not self.severe_threshold < self.neg_threshold:
            raise ValueError("TriageConfig needs severe_threshold < neg_threshold, got "
                             f"severe_threshold={self.severe_threshold}, neg_threshold={self.neg_threshold}")
        if not (0.0 <= self.tail_floor <= 1.0):
            bad("tail_floor", "must be in [0, 1]")
        if not (self.repair_beta > 0 and math.isfinite(self.repair_beta)):
            bad("repair_beta", "must be > 0")
        if not (self.repair_coef >= 0 and math.isfinite(self.repair_coef)):
            bad("repair_coef", "must be >= 0")
        if not (isinstance(self.repair_start_step, int) and self.repair_start_step >= 0):
            bad("repair_start_step", "must be an integer >= 0")
        if self.gate_scope not in GATE_SCOPES:
            bad("gate_scope", f"must be one of {GATE_SCOPES}")
        if self.repair_scope not in REPAIR_SCOPES:
            bad("repair_scope", f"must be one of {REPAIR_SCOPES}")
        if self.normalization not in NORMALIZATIONS:
            bad("normalization", f"must be one of {NORMALIZATIONS}")
        try:
            lo, hi = (float(x) for x in self.tis_clip)
        except (TypeError, ValueError):
            bad("tis_clip", "must be a pair (lo, hi) of floats")
        if not (0.0 <= lo < hi):
            bad("tis_clip", "needs 0 <= lo < hi")
        self.tis_clip = (lo, hi)
        if isinstance(self.calibration, dict):
            self.calibration = CalibrationConfig(**self.calibration)
        elif self.calibration is not None and not isinstance(self.calibration, CalibrationConfig):
            bad("calibration", "must be None, a CalibrationConfig or a dict of its fields")


# ------------------------------------------------------------------ output
@dataclass
class TriageOutput:
    """Result of one controller call (N valid tokens of the batch).

    Attributes:
        gate_weights: ``(N,)`` float32, detached; 1.0 where the gate is off or not eligible.
        tis_weights: ``(N,)`` float32, detached; ``clamp(exp(old_logp − sampler_logp), lo, hi)``
            (ones when ``tis=False``).
        token_weights: ``(N,)`` float32, detached; ``gate_weights · tis_weights``.
        repair_loss: 0-dim float32, differentiable w.r.t. ``batch.learner_logp``.
        stats: floats ``gate_weight_mean``, ``gate_downweighted_frac``, ``repair_loss``,
            ``repair_active_frac``, ``tis_clip_frac`` (NaN for a ratio over zero tokens).
    """

    gate_weights: Tensor
    tis_weights: Tensor
    token_weights: Tensor
    repair_loss: Tensor
    stats: dict = field(default_factory=dict)


# --------------------------------------------------------------- functions
def gate_segment_weights(delta: Tensor, advantage: Tensor, seg: Segments, neg_threshold: float,
                         severe_threshold: float, delta_bad: float, neg_weight: float, severe_weight: float,
                         tail_count: int, tail_floor: float) -> Tensor:
    """Gate weight per segment ``(K,)`` float32 (docs/metrics.md#gate).

    Over each segment's valid tokens: ``seg_adv`` = mean A, ``seg_delta`` = mean δ,
    ``k`` = #(δ < ``delta_bad``).  Mean tier = ``severe_weight`` if seg_delta < severe_threshold,
    else ``neg_weight`` if seg_delta < neg_threshold, else 1; tail =
    ``1 − (1 − tail_floor)·min(k / tail_count, 1)``; weight = min(tier, tail) where
    seg_adv < 0, else 1.  ``delta`` (nats) and ``advantage`` are ``(N,)``.
    """
    delta = delta.float()
    return _gate_weights(seg.mean(advantage.float()), seg.mean(delta), seg.sum((delta < delta_bad).float()),
                         neg_threshold, severe_threshold, neg_weight, severe_weight, tail_count, tail_floor)


def _gate_weights(seg_adv: Tensor, seg_delta: Tensor, k: Tensor, neg_threshold: float, severe_threshold: float,
                  neg_weight: float, severe_weight: float, tail_count: int, tail_floor: float) -> Tensor:
    """:func:`gate_segment_weights` from the segments' mean advantage, mean δ and count of δ < ``delta_bad``."""
    one = torch.ones_like(seg_delta)
    tier = torch.where(seg_delta < severe_threshold, one * severe_weight,
                       torch.where(seg_delta < neg_threshold, one * neg_weight, one))
    tail = 1.0 - (1.0 - tail_floor) * (k / tail_count).clamp(max=1.0)
    return torch.where(seg_adv < 0, torch.minimum(tier, tail), one)


def pseudo_huber(q: Tensor, beta: float) -> Tensor:
    """``φ(q) = β²(sqrt(1 + (q/β)²) − 1)`` (docs/metrics.md#repair); ``|dφ/dq| = |q|/sqrt(1+(q/β)²) < β``."""
    return beta * beta * (torch.sqrt(1.0 + (q / beta) ** 2) - 1.0)


def repair_terms(learner_logp: Tensor, sampler_logp: Tensor, advantage: Tensor, seg: Segments, tau: float,
                 beta: float, scope: str, in_scope: Optional[Tensor] = None) -> RepairTerms:
    """Per-segment Repair penalty (docs/metrics.md#repair).

    ``d_S`` = mean over the segment's valid tokens of δ = learner_logp − sampler_logp with the
    **live** ``learner_logp`` for in-scope tokens and a detached copy for the others
    (``x.detach() + m·(x − x.detach())``: same value, gradient only through ``m = 1``);
    ``q = max(τ − d_S, 0)``; ``φ = pseudo_huber(q, β)``.

    Token scope ``m``: ``whole`` every token; ``adv_positive`` tokens of segments with mean
    advantage > 0; ``q2`` the δ < 0 tokens (δ detached) of those segments.

    ``in_scope``: ``(K,)`` bool, the segments' mean advantage > 0 when the caller has it (scopes ``adv_positive``
    and ``q2``; computed here otherwise).

    Returns:
        :class:`RepairTerms` ``(phi (K,) float32 differentiable, in_scope (K,) bool, shortfall q (K,) float32
        detached)``; ``in_scope`` marks the valid repair segments (see module docstring).
    """
    live = learner_logp.float() - sampler_logp.detach().float()
    det = live.detach()
    if scope == "whole":
        in_scope = torch.ones(seg.num_segments, dtype=torch.bool, device=live.device)
        tok = torch.ones_like(det, dtype=torch.bool)
    else:
        if in_scope is None:
            in_scope = seg.mean(advantage.detach().float()) > 0
        tok = seg.broadcast(in_scope)
        if scope == "q2":
            tok = tok & (det < 0)
    d_tok = det + tok.to(det.dtype) * (live - det)
    d_seg = seg.mean(d_tok)
    q = (tau - d_seg).clamp(min=0.0)
    return RepairTerms(pseudo_huber(q, beta), in_scope, q.detach())


def _all_reduce_sum(t: Tensor, group) -> Tensor:
    import torch.distributed as dist
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


# -------------------------------------------------------------- controller
class TriageController:
    """Per-token TRIAGE weights and the Repair loss for one (micro-)batch (docs/metrics.md#controller).

    Args:
        config: :class:`TriageConfig` (default: the published configuration).
        group: optional ``torch.distributed`` process group; the Repair sums and the
            calibration thresholds are reduced over it.
    """

    def __init__(self, config: Optional[TriageConfig] = None, group=None):
        self.config = config or TriageConfig()
        self.group = group
        self.calls = 0
        self.last_step: Optional[int] = None
        self.thresholds: Optional[Thresholds] = None     # calibrated {neg_threshold, severe_threshold, delta_bad}
        window = self.config.calibration.window if self.config.calibration is not None else 1
        self.reference = ReferenceWindow(window, streams=2, repeated="accumulate")   # segment-mean δ, token δ

    # ------------------------------------------------------------ thresholds
    def effective_thresholds(self) -> Thresholds:
        """``{neg_threshold, severe_threshold, delta_bad}`` in use now (calibrated or fixed), nats (a new dict)."""
        c = self.config
        return self.thresholds.copy() if self.thresholds else Thresholds(
            neg_threshold=c.neg_threshold, severe_threshold=c.severe_threshold, delta_bad=c.delta_bad)

    def _calibrate(self, step: int, delta: Tensor, seg: Segments) -> None:
        cal = self.config.calibration
        if cal is None or self.thresholds is not None:
            return
        if self.reference.add(step, [part_of(seg.mean(delta)), part_of(delta)]):   # first step after the window
            neg, sev = self.reference.quantiles(0, [cal.neg_quantile, cal.severe_quantile], self.group)
            bad = self.reference.quantiles(1, [cal.bad_quantile], self.group)[0]
            self.thresholds = Thresholds(neg_threshold=neg, severe_threshold=min(sev, neg), delta_bad=bad)

    # ------------------------------------------------------------------ call
    def _repair_segments(self, batch: TokenBatch, gate_segments: Optional[Segments]) -> RepairSegments:
        """The repair segments of ``batch`` and, for the scopes that need it, which have a mean advantage > 0 (None
        for ``whole``): on the CPU one compiled pass (:func:`segment_sums`), elsewhere the unions of the gate
        segments when W_rep is a multiple of W_gate (:func:`coarsen`: the same segments) or a cut of their own."""
        c = self.config
        adv = batch.advantage.detach().float()
        if (batch.device.type != "cpu" and gate_segments is not None and c.repair_width % gate_segments.width == 0):
            rseg = coarsen(gate_segments, c.repair_width)
            return RepairSegments(rseg, None if c.repair_scope == "whole" else rseg.mean(adv) > 0)
        if c.repair_scope == "whole":
            return RepairSegments(segment_tokens(batch.sample_index, batch.position, c.repair_width), None)
        rseg, s_adv, _, _ = segment_sums(batch.sample_index, batch.position, c.repair_width, adv)
        return RepairSegments(rseg, s_adv / rseg.count.to(s_adv.dtype) > 0)

    def repair_segment_count(self, batch: TokenBatch) -> Tensor:
        """Number of valid repair segments of ``batch`` (0-dim float32, summed over the group).

        For gradient accumulation: call it on the whole update (or sum it over the
        micro-batches, split by response) and pass it as ``repair_denominator`` to every
        micro-batch call; the micro-batch repair losses then add up to the full-batch one.
        """
        c = self.config
        rseg = segment_tokens(batch.sample_index, batch.position, c.repair_width)
        if c.repair_scope == "whole":
            den = torch.tensor(float(rseg.num_segments), device=batch.device)
        else:
            den = (rseg.mean(batch.advantage.float()) > 0).float().sum()
        return _all_reduce_sum(den, self.group) if self.group is not None else den

    def __call__(self, batch: TokenBatch, step: int, old_logp: Optional[Tensor] = None,
                 repair_denominator: Optional[Union[Tensor, float]] = None) -> TriageOutput:
        """Compute the weights and the Repair loss for ``batch`` at optimizer step ``step``.

        Args:
            batch: TokenBatch (N valid tokens); ``learner_logp`` may carry grad (Repair).
            step: optimizer update index (docs/metrics.md#terms).
            old_logp: ``(N,)`` learner log-probs at rollout time for TIS (nats, detached);
                default ``batch.learner_logp.detach()``.
            repair_denominator: optional number of valid repair segments of the whole
                update (:meth:`repair_segment_count`), used as given instead of this
                batch's (group-summed) count; for gradient accumulation.

        Returns:
            :class:`TriageOutput`.

        Raises:
            ValueError: ``old_logp`` is not ``(N,)``.
        """
        c = self.config
        n = batch.num_tokens
        dev = batch.device
        delta = batch.delta
        ones = torch.ones(n, dtype=torch.float32, device=dev)

        gate = ones
        seg = None
        if c.gate:
            adv = batch.advantage.float()
            if c.calibration is None or self.thresholds is not None:     # the thresholds are known: one pass
                th = self.effective_thresholds()
                seg, s_adv, s_delta, k = segment_sums(batch.sample_index, batch.position, c.gate_width, adv, delta,
                                                      delta < th["delta_bad"])
                assert s_delta is not None and k is not None      # b and flag given: both are summed
            else:                                    # calibrating: the thresholds may change with this step
                seg = segment_tokens(batch.sample_index, batch.position, c.gate_width)
                self._calibrate(int(step), delta, seg)
                th = self.effective_thresholds()
                s_adv, s_delta, k = seg.sum(adv), seg.sum(delta), seg.sum((delta < th["delta_bad"]).float())
            cnt = seg.count.to(delta.dtype)
            w_seg = _gate_weights(s_adv / cnt, s_delta / cnt, k, th["neg_threshold"], th["severe_threshold"],
                                  c.neg_weight, c.severe_weight, c.tail_count, c.tail_floor)
            gate = broadcast_where_negative(seg, w_seg, delta, 1.0) if c.gate_scope == "q3" else seg.broadcast(w_seg)

        tis, clip_frac = ones, torch.zeros((), device=dev)
        if c.tis:
            old = batch.learner_logp.detach() if old_logp is None else old_logp.detach()
            if tuple(old.shape) != (n,):
                raise ValueError(f"old_logp has shape {tuple(old.shape)}, expected ({n},) = the batch's valid "
                                 "tokens (batch.gather(old_logp) reads a tensor of your layout at them)")
            lo, hi = c.tis_clip
            raw = torch.exp(old.float() - batch.sampler_logp.float())      # the rollout ratio, once
            tis = _tis_weights(old, batch.sampler_logp, lo, hi, ratio=raw)
            clip_frac = ((raw < lo) | (raw > hi)).float().mean() if n else torch.full((), float("nan"), device=dev)

        repair = torch.zeros((), dtype=torch.float32, device=dev)
        if batch.learner_logp.requires_grad:
            repair = repair + batch.learner_logp.float().sum() * 0.0
        active = torch.zeros((), device=dev)
        if c.repair and step >= c.repair_start_step:
            rseg, scope = self._repair_segments(batch, seg)
            phi, in_scope, q = repair_terms(batch.learner_logp, batch.sampler_logp, batch.advantage, rseg,
                                            c.repair_tau, c.repair_beta, c.repair_scope, in_scope=scope)
            m = in_scope.float()
            num = (phi * m).sum()
            den = m.sum()
            n_active = ((q > 0).float() * m).sum()
            if self.group is not None:
                red = _all_reduce_sum(torch.stack([num.detach(), den, n_active]), self.group)
                num, den, n_active = num + (red[0] - num.detach()), red[1], red[2]
            if repair_denominator is not None:
                den = torch.as_tensor(repair_denominator, dtype=num.dtype, device=num.device)
            repair = repair + c.repair_coef * num / den.clamp(min=1.0)
            active = n_active / den.clamp(min=1.0)

        token_weights = gate * tis
        nan = torch.full((), float("nan"), device=dev)
        stats_t = torch.stack([
            gate.mean() if n else nan,
            (gate < 1).float().mean() if n else nan,
            repair.detach().float(), active.float(), clip_frac.float()])
        names = ("gate_weight_mean", "gate_downweighted_frac", "repair_loss", "repair_active_frac", "tis_clip_frac")
        stats = dict(zip(names, (float(x) for x in stats_t.tolist())))
        self.calls += 1
        self.last_step = int(step)
        return TriageOutput(gate_weights=gate.detach(), tis_weights=tis.detach(), token_weights=token_weights.detach(),
                            repair_loss=repair, stats=stats)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> ControllerState:
        """Calibration and counters (plain Python values and CPU tensors; ``torch.save``-able)."""
        return {
            "version": STATE_VERSION,
            "config": asdict(self.config),
            "calls": self.calls,
            "last_step": self.last_step,
            "thresholds": self.thresholds.copy() if self.thresholds else None,
            "reference": self.reference.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; the config stays this controller's own.

        Raises:
            ValueError: unknown state version.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TriageController state version {state.get('version')!r} is not {STATE_VERSION}")
        self.calls = int(state["calls"])
        self.last_step = state["last_step"]
        self.thresholds = cast(Thresholds, dict(state["thresholds"])) if state["thresholds"] else None
        self.reference.load_state_dict(state["reference"])


__all__ = [
    "TriageConfig", "CalibrationConfig", "TriageController", "TriageOutput", "gate_segment_weights", "repair_terms",
    "pseudo_huber",
]
