"""The one loss-assembly path: per-token policy loss × TRIAGE weights → the trainer's aggregation convention.

Every framework hook and every hand-written training loop builds the TRIAGE loss through
:func:`triage_policy_loss`::

    res = triage_policy_loss(controller, batch, step, old_logp=batch.gather(old_log_prob),
                             agg_mode="token_mean", denominator=global_valid_tokens)
    res.loss.backward()

It runs the controller (Gate, TIS, Repair; docs/metrics.md#controller) on the batch, the PPO-clip
surrogate (with optional dual clip) against ``old_logp``, and reduces with :func:`agg_loss`, the one function
that owns every loss-normalisation mode (in the spirit of verl's ``core_algos.agg_loss``):

=========================  ================================================  =====================================
mode                       value (w = token weight, ℓ = per-token loss)      used by
=========================  ================================================  =====================================
``token_mean``             Σ_t w ℓ / D,  D = Σ_t w  (or the given count)     verl ``token-mean``, TRL ``dapo`` /
                                                                             ``bnpo``, NeMo RL token-level,
                                                                             OpenRLHF (token mean)
``seq_mean_token_mean``    Σ_s (Σ_{t∈s} w ℓ / Σ_{t∈s} w) / D, D = #responses  verl ``seq-mean-token-mean``, TRL
                                                                             ``grpo``, the TRIAGE paper's form
``seq_mean_token_sum``     Σ_s Σ_{t∈s} w ℓ / D,  D = #responses              verl ``seq-mean-token-sum``
``token_sum``              Σ_t w ℓ / D,  D = 1 (or the given scale)          SkyRL (masked sum), prime-rl
                                                                             (per-sample sum, ÷ ``rl_scale`` by
                                                                             the caller), verl
                                                                             ``seq-mean-token-sum-norm`` /
                                                                             Dr. GRPO with D = B · T_max
=========================  ================================================  =====================================

``response_denominator`` (``seq_mean_token_mean`` only) replaces each response's own Σ_{t∈s} w by a given
per-response count: slime divides every sample by the loss-mask total of its whole rollout (``rollout_mask_sums``;
one trajectory split into several samples shares it): Σ_s (Σ_{t∈s} w ℓ / n_s) / D with D = 1.

``denominator`` is the framework's own normaliser for the whole update (e.g. NeMo RL's
``global_valid_toks``, verl's global token count, a fixed ``B·T_max``); it is used as given and never
reduced again.  Without it, the sums in D are those of this call, all-reduced over ``group`` when given.

**Weights and micro-batches.**  With ``denominator`` given, the loss of a micro-batch is one addend of the
update's loss, and the weights must not depend on how the update is split.  :func:`triage_policy_loss` then
renormalises the weights **per response** (``w_t · n_s / Σ_{t∈s} w``: each response keeps its total weight n_s,
down-weighting moves gradient between the tokens of one response) — exact under any split of the update into
micro-batches, since no framework splits a response.  Without ``denominator`` (one call per update, or a
``group`` all-reduce) ``token_mean`` divides by Σ w over the update: the TRIAGE "global_token" form.
With all weights 1 (Gate, TIS and Repair off) every mode equals the framework's own loss exactly.

What the per-response renormalisation does (docs/hooks.md#triage-weights-under-a-frameworks-normaliser): a response
whose tokens all carry the same weight trains exactly as with the Gate off, and the other tokens of a partly
down-weighted response are scaled up by n_s / Σ_{t∈s} w (with the Gate alone below 1 / min(severe_weight,
tail_floor) = 10 at the defaults; the published method states no bound, and none is applied here).  A controller
configured with ``normalization="global_token"`` is therefore refused where a denominator is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..batch import TokenBatch
from .controller import NORMALIZATIONS, TriageController, TriageOutput, _all_reduce_sum
from .corrections import get_surrogate, list_surrogates

Tensor = torch.Tensor

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum")

#: Per-token policy losses :func:`triage_policy_loss` can weight: PPO-clip (verl, TRL, OpenRLHF, SkyRL, NeMo RL)
#: and DPPO-Binary-TV + squared-log-ratio KL (prime-rl's default), both from :mod:`triage_monitor.triage.corrections`.
#: The shipped per-token policy losses (more can be registered: :func:`triage_monitor.triage.corrections.register_surrogate`).
SURROGATES = tuple(list_surrogates())

#: ``TriageConfig.normalization`` → aggregation mode.
NORMALIZATION_TO_AGG = {"global_token": "token_mean", "per_response": "seq_mean_token_mean"}


def _per_response(values: Tensor, batch: TokenBatch) -> Tensor:
    return torch.zeros(batch.num_samples, dtype=values.dtype, device=values.device).index_add(
        0, batch.sample_index, values)


def _global_ratio(num: Tensor, den: Tensor, group, den_given: bool) -> Tensor:
    """``num / den`` with ``num`` (and ``den`` unless given) summed over ``group``; 0 where den == 0.

    The value is global; the gradient flows through the local ``num`` only.
    """
    if group is not None:
        red = _all_reduce_sum(torch.stack([num.detach(), den.detach().to(num.dtype)]), group)
        num = num + (red[0] - num.detach())
        if not den_given:
            den = red[1]
    den = den.to(num.dtype)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num * 0.0)


def agg_loss(per_token_loss: Tensor, token_weights: Tensor, batch: TokenBatch, mode: str = "token_mean", *,
             denominator: Optional[Union[Tensor, float]] = None, group=None,
             response_denominator: Optional[Tensor] = None) -> Tensor:
    """Aggregate a weighted per-token loss with one of the trainers' conventions, 0-dim float32.

    Args:
        per_token_loss: ``(N,)`` differentiable loss per valid token (e.g. PPO-clip), in the batch's flat order.
        token_weights: ``(N,)`` weights (detached here), ≥ 0; all ones = unweighted.
        batch: the :class:`TokenBatch` the tokens belong to (``sample_index``, ``num_valid``).
        mode: one of :data:`AGG_MODES` (table in the module docstring).
        denominator: the framework's normaliser for the whole update, used as given (not reduced).
            Default: ``token_mean`` Σ w, ``seq_mean_*`` the number of responses with ≥ 1 valid token,
            ``token_sum`` 1; summed over ``group`` when given.
        group: ``torch.distributed`` process group: the value is the global loss, the gradient flows
            through this rank's tokens only.
        response_denominator: ``(S,)`` per-response divisors (``seq_mean_token_mean`` only) in place of
            Σ_{t∈s} w; values below 1 count as 1 (slime's ``clamp_min(denom, 1)``).

    Returns:
        0-dim float32; 0 when the denominator is 0.

    Raises:
        ValueError: unknown ``mode``, ``per_token_loss`` / ``token_weights`` not ``(N,)``, or
            ``response_denominator`` not ``(S,)`` or given with another mode.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg_loss: mode must be one of {AGG_MODES}, got {mode!r}")
    n = batch.num_tokens
    for name, t in (("per_token_loss", per_token_loss), ("token_weights", token_weights)):
        if tuple(t.shape) != (n,):
            raise ValueError(f"agg_loss: {name} has shape {tuple(t.shape)}, expected ({n},) = the batch's valid tokens")
    w = token_weights.detach().float()
    wl = w * per_token_loss.float()
    if response_denominator is not None:
        if mode != "seq_mean_token_mean":
            raise ValueError(f"agg_loss: response_denominator needs mode 'seq_mean_token_mean', got {mode!r}")
        if tuple(response_denominator.shape) != (batch.num_samples,):
            raise ValueError(f"agg_loss: response_denominator has shape {tuple(response_denominator.shape)}, "
                             f"expected ({batch.num_samples},) = one per response")
        rd = response_denominator.detach().to(wl.device, torch.float32).clamp_min(1.0)
        num = (_per_response(wl, batch) / rd).sum()
    elif mode == "seq_mean_token_mean":
        num_s, den_s = _per_response(wl, batch), _per_response(w, batch)
        num = torch.where(den_s > 0, num_s / torch.where(den_s > 0, den_s, torch.ones_like(den_s)), num_s * 0.0).sum()
    else:
        num = wl.sum()
    if denominator is not None:
        den = torch.as_tensor(denominator, dtype=num.dtype, device=num.device)
    elif mode == "token_mean":
        den = w.sum()
    elif mode == "token_sum":
        den = torch.ones((), dtype=num.dtype, device=num.device)
        if group is not None:   # a sum needs no global denominator: reduce the value only
            return _global_ratio(num, den, group, den_given=True)
    else:
        den = (batch.num_valid > 0).sum().to(num.device, num.dtype)
    return _global_ratio(num, den, group, den_given=denominator is not None)


def renormalize_per_response(token_weights: Tensor, batch: TokenBatch) -> Tensor:
    """``(N,)`` float32 weights rescaled so each response keeps its token count: ``w_t · n_s / Σ_{t∈s} w``.

    A response whose weights are all 0 stays 0.  All-ones weights come back unchanged.  Independent of how the
    update is split into micro-batches (responses are never split), hence the weighting used with a
    framework-given denominator (module docstring).

    Raises:
        ValueError: ``token_weights`` not ``(N,)``.
    """
    if tuple(token_weights.shape) != (batch.num_tokens,):
        raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, expected ({batch.num_tokens},)")
    w = token_weights.detach().float()
    den_s = _per_response(w, batch)
    cnt_s = _per_response(torch.ones_like(w), batch)
    scale = torch.where(den_s > 0, cnt_s / torch.where(den_s > 0, den_s, torch.ones_like(den_s)), den_s * 0.0)
    return w * scale[batch.sample_index]


@dataclass
class TriageLoss:
    """One TRIAGE loss evaluation (N valid tokens).

    Attributes:
        loss: 0-dim float32, differentiable: aggregated weighted policy loss + Repair (docs/metrics.md#repair).
        policy_loss: 0-dim float32, the aggregated policy part alone.
        per_token_loss: ``(N,)`` float32 PPO-clip surrogate (× ``token_scale`` when given) before weighting.
        token_weights: ``(N,)`` float32 weights the aggregation used (Gate × TIS, renormalised per response
            when a denominator was given).
        output: the controller's :class:`~triage_monitor.triage.controller.TriageOutput` (weights, Repair, stats).
        batch: the TokenBatch the loss was computed on.
        agg_mode: the aggregation mode used.
    """

    loss: Tensor
    policy_loss: Tensor
    per_token_loss: Tensor
    token_weights: Tensor
    output: TriageOutput
    batch: TokenBatch
    agg_mode: str


def _finite_old_logp(old_logp: Tensor, batch: TokenBatch) -> Tensor:
    """``old_logp`` detached, refused when a value is NaN or ±inf: the PPO ratio and the TIS weight would then be
    NaN / inf, and the loss NaN with nothing pointing at its cause.  A shape other than ``(N,)`` is left to the
    controller's own check (its message)."""
    old = old_logp.detach()
    if tuple(old.shape) != (batch.num_tokens,):
        return old
    finite = torch.isfinite(old)
    if not bool(finite.all()):
        i = int(torch.nonzero(~finite)[0])
        sample = int(batch.sample_id[batch.sample_index[i]])
        raise ValueError(f"triage_policy_loss: old_logp[sample={sample}, position={int(batch.position[i])}] = "
                         f"{float(old[i])!r} is not finite ({int((~finite).sum())} such token(s) in this batch): the "
                         "PPO / TIS anchor, the learner's log-prob at rollout time (nats), must be finite")
    return old


def triage_policy_loss(controller: TriageController, batch: TokenBatch, step: int, *,
                       old_logp: Optional[Tensor] = None, clip_low: float = 0.2, clip_high: float = 0.28,
                       dual_clip: Optional[float] = None, agg_mode: Optional[str] = None,
                       denominator: Optional[Union[Tensor, float]] = None, loss_scale: float = 1.0,
                       token_scale: Optional[Tensor] = None,
                       repair_denominator: Optional[Union[Tensor, float]] = None, group=None,
                       response_denominator: Optional[Tensor] = None,
                       surrogate: str = "ppo_clip", surrogate_kwargs: Optional[dict] = None) -> TriageLoss:
    """The TRIAGE loss of one (micro-)batch with the trainer's aggregation convention.

    ``out = controller(batch, step, old_logp)``; ``ℓ = ppo_clip_loss(learner_logp, old_logp, A, clip_low,
    clip_high, dual_clip)`` (or, with ``surrogate="dppo_kl"``, ``dppo_kl_loss(learner_logp, old_logp, A,
    **surrogate_kwargs)``); ``loss = loss_scale · agg_loss(ℓ, w, batch, agg_mode, denominator) + out.repair_loss``
    with ``w = out.token_weights`` (Gate × TIS), renormalised per response when ``denominator`` is given
    (module docstring), and ``ℓ`` multiplied by ``token_scale`` when given.  With Gate, TIS and Repair off the
    value equals the trainer's own PPO loss.

    Args:
        controller: the :class:`TriageController` (config, calibration state).
        batch: TokenBatch whose ``learner_logp`` is the live (grad-carrying) learner log-prob, nats.
        step: optimizer update index.
        old_logp: ``(N,)`` PPO anchor log-probs in the batch's flat order (``batch.gather(old)``), nats; also the
            TIS numerator.  Default ``batch.learner_logp.detach()`` (one update per rollout).
        clip_low, clip_high: PPO clip range [1 − clip_low, 1 + clip_high]; ``dual_clip``: verl's ``clip_ratio_c``.
        agg_mode: one of :data:`AGG_MODES`; default from ``controller.config.normalization``.
        denominator: the framework's normaliser for the whole update (:func:`agg_loss`).
        loss_scale: multiplies the policy part (a framework convention such as verl's ``dp_size`` factor).
        token_scale: ``(N,)`` per-token factors (detached) the framework multiplies its per-token loss by before
            aggregating, outside the normaliser: masks and importance ratios of its own (e.g. TRL's
            ``top_entropy_quantile`` mask, off-policy sequence mask, vLLM importance-sampling ratio).  Unlike the
            weights they never enter a denominator (SkyRL's TIS ratio × masks, OpenRLHF's IS-correction
            coefficient: a token they zero still counts in the trainer's denominator, as in its own loss).
        repair_denominator: the number of valid Repair segments of the whole update, for micro-batches
            (:meth:`TriageController.repair_segment_count`).
        group: process group for the global sums.
        response_denominator: ``(S,)`` per-response divisors for ``seq_mean_token_mean`` (:func:`agg_loss`;
            slime's ``rollout_mask_sums``); the weights are then renormalised per response, as with ``denominator``.
        surrogate: the per-token policy loss, one of :data:`SURROGATES`; ``"dppo_kl"`` takes its anchor from
            ``old_logp`` and its options (``mask_low``, ``mask_high``, ``adv_tau``, ``kl_tau``) from
            ``surrogate_kwargs`` (the clip arguments are then unused).

    Raises:
        ValueError: a NaN or ±inf in ``old_logp`` (the message names ``old_logp``, the token's ``sample_id`` and
            position, its value and how many such tokens the batch has).
        ValueError: shapes (``old_logp`` or ``token_scale`` not ``(N,)``), unknown ``agg_mode`` or ``surrogate``;
            ``normalization="global_token"`` in the controller's config together with a ``denominator`` /
            ``response_denominator`` (the weights are then renormalised per response) or an ``agg_mode`` other
            than ``token_mean``: that normalisation would be silently replaced, so it is refused.
    """
    if token_scale is not None and tuple(token_scale.shape) != (batch.num_tokens,):
        raise ValueError(f"triage_policy_loss: token_scale has shape {tuple(token_scale.shape)}, expected "
                         f"({batch.num_tokens},) = the batch's valid tokens")
    mode = agg_mode or NORMALIZATION_TO_AGG[controller.config.normalization]
    if mode not in AGG_MODES:
        raise ValueError(f"triage_policy_loss: agg_mode must be one of {AGG_MODES}, got {mode!r}")
    fixed = denominator is not None or response_denominator is not None
    if controller.config.normalization == "global_token" and (fixed or mode != "token_mean"):
        how = ("with a given denominator / response_denominator the weights are renormalised per response"
               if fixed else f"agg_mode={mode!r} is not the global token mean")
        raise ValueError("triage_policy_loss: TriageConfig.normalization='global_token' (Σ w ℓ / Σ w over the update) "
                         f"cannot be honoured here: {how} (docs/hooks.md#triage-weights-under-a-frameworks-normaliser)"
                         "; use normalization='per_response', or weighted_policy_loss with policy_loss_denominator")
    surrogate_fn = get_surrogate(surrogate)            # ValueError naming the registered ones
    old = batch.learner_logp.detach() if old_logp is None else _finite_old_logp(old_logp, batch)
    out = controller(batch, step=step, old_logp=old, repair_denominator=repair_denominator)
    options = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip) if surrogate == "ppo_clip" else {}
    ptl = surrogate_fn(batch.learner_logp, old, batch.advantage, **{**options, **(surrogate_kwargs or {})})
    if token_scale is not None:
        ptl = ptl * token_scale.detach().float()
    w = renormalize_per_response(out.token_weights, batch) if fixed else out.token_weights
    pol = loss_scale * agg_loss(ptl, w, batch, mode, denominator=denominator, group=group,
                                response_denominator=response_denominator)
    return TriageLoss(loss=pol + out.repair_loss, policy_loss=pol, per_token_loss=ptl, token_weights=w,
                      output=out, batch=batch, agg_mode=mode)


__all__ = ["AGG_MODES", "SURROGATES", "agg_loss", "renormalize_per_response", "TriageLoss", "triage_policy_loss",
           "weighted_policy_loss", "policy_loss_denominator"]


def _normalization_mode(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    return NORMALIZATION_TO_AGG[normalization]


def weighted_policy_loss(per_token_loss: Tensor, token_weights: Tensor, batch: TokenBatch,
                         normalization: str = "per_response", group=None,
                         global_denominator: Optional[Union[Tensor, float]] = None) -> Tensor:
    """The TRIAGE-normalised policy loss (docs/metrics.md#normalization), 0-dim float32: :func:`agg_loss` with
    ``per_response`` → ``seq_mean_token_mean`` (mean over responses of Σ w ℓ / Σ w) or ``global_token`` →
    ``token_mean`` (Σ w ℓ / Σ w); ``global_denominator`` (from :func:`policy_loss_denominator` over the whole
    update) is used as given, so micro-batch losses add up to the update's loss.

    Raises:
        ValueError: unknown ``normalization``, or shapes not ``(N,)``.
    """
    return agg_loss(per_token_loss, token_weights, batch, _normalization_mode(normalization),
                    denominator=global_denominator, group=group)


def policy_loss_denominator(token_weights: Tensor, batch: TokenBatch, normalization: str = "per_response",
                            group=None) -> Tensor:
    """The denominator :func:`weighted_policy_loss` uses for ``batch``, 0-dim float32: ``per_response`` the
    number of responses with ≥ 1 valid token, ``global_token`` Σ_t w_t; summed over ``group`` when given.

    Raises:
        ValueError: unknown ``normalization`` or ``token_weights`` not ``(N,)``.
    """
    _normalization_mode(normalization)
    if tuple(token_weights.shape) != (batch.num_tokens,):
        raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, expected ({batch.num_tokens},)")
    if normalization == "per_response":
        den = (batch.num_valid > 0).sum().float()
    else:
        den = token_weights.detach().float().sum()
    return _all_reduce_sum(den, group) if group is not None else den
