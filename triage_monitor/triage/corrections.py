"""Baseline off-policy corrections the TRIAGE controller sits beside (docs/metrics.md#baselines).

Pure tensor functions in the style of verl's ``core_algos.py``: every input is
a flat per-token tensor ``(N,)`` (the :class:`~triage_monitor.batch.TokenBatch`
layout), log-probs in nats, outputs are detached weights ``(N,)`` float32
(or a per-token loss for the surrogates).  The per-token policy losses share one signature
(:class:`Surrogate`) and are registered by name, which is what :func:`triage_monitor.triage.loss.triage_policy_loss`
dispatches on::

    loss = get_surrogate("ppo_clip")(learner_logp, old_logp, advantage, clip_low=0.2, clip_high=0.28)

Naming: ``old_logp`` is the learner's log-prob at rollout time (verl
``old_log_probs``), ``sampler_logp`` the rollout engine's (verl
``rollout_log_probs``); the *rollout ratio* is ``exp(old_logp − sampler_logp)``.

Per-sequence corrections take ``seq`` = a TokenBatch, or a tuple
``(sample_index (N,) int64, num_samples)``; every sequence is reduced over its
valid tokens only (the flat layout holds nothing else).

Framework defaults (as documented by the frameworks; each option is configurable):

* PPO clip: symmetric ε = 0.2 (PPO paper, verl ``clip_ratio``); DAPO
  "clip-higher" [1 − 0.2, 1 + 0.28] is the default here because docs/metrics.md#published-reference
  (published TRIAGE runs) uses it.
* TIS: clamp(ratio, 0, C), C = 2 (docs/metrics.md#baselines, the published runs; verl
  ``rollout_is_threshold`` default 2.0, truncation only from above).
* IcePop: ratio kept inside [0.5, 2], zero outside (docs/metrics.md#baselines; the Ring/
  IcePop paper used [0.5, 5]).
* MIS / geometric sequence masking: band [1/1.001, 1.001] on the geometric
  mean ratio (verl ``rollout_rs: geometric``, typical threshold 1.0002–1.001,
  lower bound defaults to 1/upper).
* Sequence IS, product form: min(Π_t ratio_t, 2) (verl ``rollout_is: sequence``,
  threshold 2.0, log-ratio sum safety-bounded to ±20 before exp).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple, Union

import torch

from ..batch import TokenBatch

Tensor = torch.Tensor
SeqSpec = Union[TokenBatch, Tuple[Tensor, int]]

#: |log ratio| bound before exp, as verl/SkyRL do (exp(±20) ≈ 5e8 / 2e-9).
LOG_RATIO_BOUND = 20.0

class Surrogate(Protocol):
    """A per-token policy loss (verl's ``core_algos`` policy losses are the model: one typed signature, a registry
    used for dispatch): ``fn(learner_logp, old_logp, advantage, **options) -> (N,)`` float32, differentiable
    w.r.t. ``learner_logp`` (nats), ``old_logp`` the anchor (detached)."""

    def __call__(self, learner_logp: Tensor, old_logp: Tensor, advantage: Tensor, **options) -> Tensor: ...


#: the registered functions (:func:`register_surrogate` decorates functions: each has a ``__qualname__``)
_SURROGATES: Dict[str, Callable[..., Tensor]] = {}


def register_surrogate(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a :class:`Surrogate` under ``name`` (what ``triage_policy_loss(surrogate=name)``
    dispatches to).

    Raises:
        ValueError: ``name`` is already registered to a different function.
    """
    def deco(fn: Callable) -> Callable:
        if name in _SURROGATES and _SURROGATES[name] is not fn:
            raise ValueError(f"surrogate {name!r} is already registered ({_SURROGATES[name].__qualname__})")
        _SURROGATES[name] = fn
        return fn
    return deco


def get_surrogate(name: str) -> Surrogate:
    """The surrogate registered under ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return _SURROGATES[name]
    except KeyError:
        raise ValueError(f"unknown surrogate {name!r}; known: {list_surrogates()}") from None


def list_surrogates() -> List[str]:
    """Names of the registered surrogates, in registration order."""
    return list(_SURROGATES)


# ------------------------------------------------------------------ helpers
def _log_ratio(old_logp: Tensor, sampler_logp: Tensor) -> Tensor:
    if old_logp.shape != sampler_logp.shape:
        raise ValueError(f"old_logp has shape {tuple(old_logp.shape)}, sampler_logp has shape "
                         f"{tuple(sampler_logp.shape)}; they must match")
    return old_logp.detach().float() - sampler_logp.detach().float()


def _check_band(name: str, low: float, high: float) -> None:
    if not (0.0 <= low < high):
        raise ValueError(f"{name}: need 0 <= low < high, got low={low}, high={high}")


class SequenceIndex(NamedTuple):
    """:func:`_seq_index`: each token's sequence ``(N,)`` int64 and the number of sequences S."""

    sample_index: Tensor
    num_samples: int


class SequenceSums(NamedTuple):
    """:func:`sequence_log_ratio_sum`: per sequence, the summed log-ratio ``(S,)`` and the valid tokens ``(S,)``
    int64."""

    log_ratio_sum: Tensor
    valid_tokens: Tensor


def _seq_index(seq: SeqSpec, n: int, device: torch.device) -> SequenceIndex:
    """Each of the ``n`` tokens' sequence, on ``device``, and the sequence count, from a :class:`TokenBatch` or an
    ``(sample_index, S)`` pair.

    Raises:
        ValueError: the sample index is not of shape ``(n,)``."""
    if isinstance(seq, TokenBatch):
        idx, s = seq.sample_index, seq.num_samples
    else:
        idx, s = seq
        idx = torch.as_tensor(idx)
    if idx.shape != (n,):
        raise ValueError(f"sample_index has shape {tuple(idx.shape)}, expected ({n},)")
    return SequenceIndex(idx.to(device).long(), int(s))


def sequence_log_ratio_sum(log_ratio: Tensor, seq: SeqSpec) -> SequenceSums:
    """Per-sequence ``(sum_t log_ratio_t, n_valid)``, both ``(S,)`` (float32, int64)."""
    idx, s = _seq_index(seq, log_ratio.shape[0], log_ratio.device)
    total = torch.zeros(s, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, idx, log_ratio)
    count = torch.bincount(idx, minlength=s) if idx.numel() else torch.zeros(s, dtype=torch.long,
                                                                             device=log_ratio.device)
    return SequenceSums(total, count)


# --------------------------------------------------------------- per token
@register_surrogate("ppo_clip")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantage: Tensor, clip_low: float = 0.2,
                  clip_high: float = 0.28, dual_clip: Optional[float] = None) -> Tensor:
    """Per-token PPO clipped surrogate loss, ``(N,)`` float32, differentiable w.r.t. ``logp``.

    ``r = exp(logp − old_logp)``;
    ``loss = −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)`` (Schulman et al. 2017, with
    DAPO's asymmetric "clip-higher"; default [0.8, 1.28] as in docs/metrics.md#published-reference).  With
    ``dual_clip = c > 1`` (Ye et al. 2020, verl ``clip_ratio_c`` = 3.0) tokens with A < 0 use
    ``min(loss, −c·A)``.  Reduce with
    :func:`triage_monitor.triage.loss.agg_loss`.

    Args: ``logp`` (live, nats), ``old_logp`` (nats), ``advantage``: all ``(N,)``.

    Raises:
        ValueError: shapes differ, or clip values negative, or ``dual_clip`` ≤ 1.
    """
    if not (logp.shape == old_logp.shape == advantage.shape):
        raise ValueError(f"ppo_clip_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and "
                         f"advantage {tuple(advantage.shape)} must have the same shape")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"ppo_clip_loss: clip_low={clip_low}, clip_high={clip_high} must be >= 0")
    adv = advantage.detach().float()
    ratio = torch.exp((logp.float() - old_logp.detach().float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = -torch.min(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"ppo_clip_loss: dual_clip must be > 1, got {dual_clip}")
        # min(loss, −c·A) where A < 0, as one minimum against a cap of +inf elsewhere (one backward, the same tie rule)
        loss = torch.minimum(loss, torch.where(adv < 0, -dual_clip * adv, math.inf))
    return loss


@register_surrogate("dppo_kl")
def dppo_kl_loss(logp: Tensor, anchor_logp: Tensor, advantage: Tensor, mask_low: float = 0.2,
                 mask_high: float = 0.2, adv_tau: float = 1.0, kl_tau: float = 1e-3,
                 return_masks: bool = False):
    """Per-token DPPO-Binary-TV policy loss with a squared-log-ratio KL term, ``(N,)`` float32 (prime-rl's
    default RL loss; docs/hooks.md#prime-rl).

    ``r = exp(logp − anchor_logp)``, ``Δp = exp(logp) − exp(anchor_logp)`` (probabilities, not log-probs);
    a token is *masked* (trust-region violation in the direction its advantage pushes) when
    ``A > 0 and Δp > mask_high`` or ``A ≤ 0 and Δp < −mask_low``;
    ``loss = −keep · adv_tau · A · r + kl_tau · (log r)²`` with ``keep = not masked``.
    The KL term applies to every token, masked or not.  No clamp on ``log r`` (prime-rl applies none).

    Args: ``logp`` (live, nats), ``anchor_logp`` (nats; prime-rl: the inference engine's log-probs),
        ``advantage``: all ``(N,)``.  ``return_masks``: also return ``(is_masked, is_masked_low,
        is_masked_high)``, ``(N,)`` bool (``_low``: A < 0 and Δp < −mask_low; ``_high``: A > 0 and Δp > mask_high).

    Raises:
        ValueError: shapes differ, or a threshold / temperature is negative.
    """
    if not (logp.shape == anchor_logp.shape == advantage.shape):
        raise ValueError(f"dppo_kl_loss: logp {tuple(logp.shape)}, anchor_logp {tuple(anchor_logp.shape)} and "
                         f"advantage {tuple(advantage.shape)} must have the same shape")
    for name, v in (("mask_low", mask_low), ("mask_high", mask_high), ("adv_tau", adv_tau), ("kl_tau", kl_tau)):
        if v < 0:
            raise ValueError(f"dppo_kl_loss: {name} must be >= 0, got {v}")
    lp, anchor, adv = logp.float(), anchor_logp.detach().float(), advantage.detach().float()
    log_ratio = lp - anchor
    probs_diff = torch.exp(lp) - torch.exp(anchor)
    high, low = probs_diff > mask_high, probs_diff < -mask_low
    pos, neg = adv > 0, adv < 0
    masked = torch.where(pos, high, low)
    loss = -(~masked).float() * (adv_tau * adv) * torch.exp(log_ratio) + kl_tau * log_ratio ** 2
    if return_masks:
        return loss, (masked.detach(), (neg & low).detach(), (pos & high).detach())
    return loss


def reference_kl(logp: Tensor, ref_logp: Tensor, kl_type: str = "k3", input_clamp: Optional[float] = 20.0,
                 output_clamp: Optional[float] = 10.0, score_function: bool = True) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate, ``(N,)`` float32, differentiable w.r.t. ``logp`` (Schulman's k1/k2/k3,
    NeMo RL's reference-policy KL penalty).

    ``x = clamp(ref_logp − logp, ±input_clamp)``; k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x; with ``score_function``
    the estimate is multiplied by ``w = exp(logp − sg(logp))`` (value 1, adds the score-function gradient
    k·∇log π; ``w`` is detached where the input clamp is active); then clamped to ±output_clamp.

    Raises:
        ValueError: shapes differ or an unknown ``kl_type``.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"reference_kl: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    lp = logp.float()
    x = ref_logp.detach().float() - lp
    w = torch.exp(lp - lp.detach()) if score_function else None
    if input_clamp is not None:
        xc = x.clamp(-input_clamp, input_clamp)
        if w is not None:
            w = torch.where(x == xc, w, w.detach())
        x = xc
    if kl_type == "k1":
        kl = -x
    elif kl_type == "k2":
        kl = x * x / 2
    elif kl_type == "k3":
        kl = torch.exp(x) - 1 - x
    else:
        raise ValueError(f"reference_kl: kl_type must be 'k1', 'k2' or 'k3', got {kl_type!r}")
    if w is not None:
        kl = w * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def tis_weights(old_logp: Tensor, sampler_logp: Tensor, low: float = 0.0, high: float = 2.0,
                ratio: Optional[Tensor] = None) -> Tensor:
    """Truncated importance sampling weight ``(N,)`` float32, detached (docs/metrics.md#baselines).

    ``w = clamp(exp(old_logp − sampler_logp), low, high)``, default [0, 2] (published runs;
    verl 0.9.1's ``rollout_is: token`` with ``rollout_is_threshold: 2.0`` truncates at 2.0 from above).  ``exp`` of a large gap gives ``inf`` → ``high``.
    ``ratio``: ``exp(old_logp − sampler_logp)`` (float32) when the caller has it already (it is not computed again).

    Raises:
        ValueError: shapes differ or not ``0 <= low < high``.
    """
    _check_band("tis_weights", low, high)
    if ratio is None:
        ratio = torch.exp(_log_ratio(old_logp, sampler_logp))
    elif ratio.shape != old_logp.shape or old_logp.shape != sampler_logp.shape:
        raise ValueError(f"tis_weights: ratio {tuple(ratio.shape)}, old_logp {tuple(old_logp.shape)} and "
                         f"sampler_logp {tuple(sampler_logp.shape)} must have the same shape")
    return ratio.detach().clamp(low, high)


def icepop_weights(old_logp: Tensor, sampler_logp: Tensor, low: float = 0.5, high: float = 2.0,
                   keep_ratio: bool = True) -> Tensor:
    """IcePop token masking ``(N,)`` float32, detached (docs/metrics.md#baselines; Ring-1T/IcePop).

    ``r = exp(old_logp − sampler_logp)``; ``w = r`` (``keep_ratio=True``, IcePop's
    ``M(r) = r·1[low ≤ r ≤ high]``) or ``1`` (``keep_ratio=False``, a pure mask) inside the
    closed band ``[low, high]``, and ``0`` outside.  Default band [0.5, 2] (docs/metrics.md#baselines).

    Raises:
        ValueError: shapes differ or not ``0 <= low < high``.
    """
    _check_band("icepop_weights", low, high)
    ratio = torch.exp(_log_ratio(old_logp, sampler_logp))
    inside = (ratio >= low) & (ratio <= high)
    kept = ratio if keep_ratio else torch.ones_like(ratio)
    return torch.where(inside, kept, torch.zeros_like(ratio))


# ------------------------------------------------------------ per sequence
def geometric_mean_ratio(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec) -> Tensor:
    """``(S,)`` float32: ``exp(mean_t (old_logp − sampler_logp))`` over each sequence's valid tokens.

    A sequence with no valid token gets 1.0 (log-mean 0).  The log-mean is bounded to ±20.
    """
    total, count = sequence_log_ratio_sum(_log_ratio(old_logp, sampler_logp), seq)
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.exp(mean.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def mis_weights(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec, high: float = 1.001,
                low: Optional[float] = None) -> Tensor:
    """MIS / geometric sequence masking ``(N,)`` float32 in {0, 1}, detached (docs/metrics.md#baselines).

    The band bounds the geometric-mean ratio **sampler over learner**, verl's convention:
    ``ρ_s = exp(mean_{t∈s}(sampler_logp − old_logp))`` (π_rollout / π_old); every token of s gets ``1`` if
    ``low ≤ ρ_s ≤ high`` else ``0`` (the sequence is dropped).  This reproduces verl 0.9.1's
    ``algorithm.rollout_correction.rollout_rs: seq_mean_k1`` with ``rollout_rs_threshold: "<low>_<high>"``
    (``compute_rollout_rejection_mask``: k1 = −log(π_train/π_rollout), sequence mean, kept where
    log(low) ≤ mean k1 ≤ log(high)); checked against verl's function in tests/test_corrections.py.
    Default ``high = 1.001``, ``low = 1/high`` (symmetric, where both conventions agree).

    Raises:
        ValueError: shapes differ or not ``0 <= low < high``.
    """
    low = 1.0 / high if low is None else low
    _check_band("mis_weights", low, high)
    rho = 1.0 / geometric_mean_ratio(old_logp, sampler_logp, seq)
    keep = ((rho >= low) & (rho <= high)).float()
    idx, _ = _seq_index(seq, old_logp.shape[0], old_logp.device)
    return keep[idx]


def sequence_is_product_weights(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec,
                                high: float = 2.0) -> Tensor:
    """Sequence IS, **product form**, ``(N,)`` float32, detached (docs/metrics.md#baselines).

    ``w_s = min(exp(clamp(Σ_{t∈s}(old_logp − sampler_logp), −20, 20)), high)`` = truncated
    ``Π_t r_t``, broadcast to every token of s.  Default ``high = 2`` (verl 0.9.1
    ``rollout_is: sequence``, ``rollout_is_threshold`` 2.0).  Grows with length: a 1000-token
    response with a mean log-ratio of 0.001 already has Π r = e ≈ 2.72.

    Raises:
        ValueError: shapes differ or ``high`` ≤ 0.
    """
    _check_band("sequence_is_product_weights", 0.0, high)
    total, _ = sequence_log_ratio_sum(_log_ratio(old_logp, sampler_logp), seq)
    w = torch.exp(total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).clamp(max=high)
    idx, _ = _seq_index(seq, old_logp.shape[0], old_logp.device)
    return w[idx]


def sequence_mask_weights(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec, high: Optional[float] = 3.0,
                          low: Optional[float] = None) -> Tensor:
    """Sequence-level **masked** IS, product form, ``(N,)`` float32, detached (docs/metrics.md#baselines).

    ``ρ_s = exp(Σ_{t∈s}(old_logp − sampler_logp))`` (the product of the token ratios, not clamped); every token of
    s gets ``ρ_s`` when ``low ≤ ρ_s ≤ high`` and ``0`` otherwise (a bound given as None is open).  This is TRL's
    default vLLM correction (checked against TRL 1.16.0 and 1.13.0): ``vllm_importance_sampling_mode =
    "sequence_mask"``, ``vllm_importance_sampling_clip_max = 3.0`` (``high``),
    ``vllm_importance_sampling_clip_min = None`` (``low``).

    Raises:
        ValueError: shapes differ or ``low > high``.
    """
    if low is not None and high is not None and low > high:
        raise ValueError(f"sequence_mask_weights: low={low} must be <= high={high}")
    total, _ = sequence_log_ratio_sum(_log_ratio(old_logp, sampler_logp).double(), seq)
    rho = torch.exp(total)
    keep = torch.ones_like(rho, dtype=torch.bool)
    if high is not None:
        keep &= rho <= high
    if low is not None:
        keep &= rho >= low
    w = torch.where(keep, rho, torch.zeros_like(rho)).float()
    idx, _ = _seq_index(seq, old_logp.shape[0], old_logp.device)
    return w[idx]


def geometric_sequence_mask_weights(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec,
                                    high: float = 2.0) -> Tensor:
    """Token IS ratio inside sequences whose **geometric-mean** ratio is at most ``high``, ``(N,)`` float32,
    detached (docs/metrics.md#baselines).

    ``r_t = exp(clamp(old_logp − sampler_logp, ±20))``; ``g_s = exp(mean_{t∈s} log r_t)``; every token of s gets
    ``r_t`` when ``g_s ≤ high`` and ``0`` otherwise.  This is ms-swift's ``rollout_importance_sampling_mode =
    "sequence_mask"`` (``rollout_importance_sampling_threshold`` = ``high``, default 2.0; checked against ms-swift
    4.4.0 and 4.6.0).  Unlike :func:`sequence_mask_weights` (product form, TRL) the sequence test uses the
    geometric mean, and the kept tokens keep their own ratio.

    Raises:
        ValueError: shapes differ or ``high`` ≤ 0.
    """
    _check_band("geometric_sequence_mask_weights", 0.0, high)
    log_ratio = _log_ratio(old_logp, sampler_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    total, count = sequence_log_ratio_sum(log_ratio, seq)
    keep = torch.exp(total / count.clamp(min=1).to(total.dtype)) <= high
    idx, _ = _seq_index(seq, old_logp.shape[0], old_logp.device)
    return torch.where(keep[idx], torch.exp(log_ratio), torch.zeros_like(log_ratio))


def sequence_is_geometric_weights(old_logp: Tensor, sampler_logp: Tensor, seq: SeqSpec,
                                  high: float = 2.0) -> Tensor:
    """Sequence IS, **geometric form**, ``(N,)`` float32, detached (docs/metrics.md#baselines; GSPO-style).

    ``w_s = min(exp(mean_{t∈s}(old_logp − sampler_logp)), high)`` = truncated
    ``(Π_t r_t)^(1/n_s)``, broadcast to every token of s.  Unlike the product form it does
    not grow with length.  Default ``high = 2``.

    Raises:
        ValueError: shapes differ or ``high`` ≤ 0.
    """
    _check_band("sequence_is_geometric_weights", 0.0, high)
    w = geometric_mean_ratio(old_logp, sampler_logp, seq).clamp(max=high)
    idx, _ = _seq_index(seq, old_logp.shape[0], old_logp.device)
    return w[idx]


__all__ = [
    "Surrogate", "register_surrogate", "get_surrogate", "list_surrogates", "ppo_clip_loss", "tis_weights",
    "icepop_weights", "geometric_mean_ratio", "mis_weights", "sequence_is_product_weights",
    "sequence_is_geometric_weights", "geometric_sequence_mask_weights", "sequence_mask_weights",
    "sequence_log_ratio_sum", "LOG_RATIO_BOUND",
]
