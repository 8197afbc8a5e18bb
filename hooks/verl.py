"""verl hook: monitoring from the actor ``DataProto`` and TRIAGE as a registered policy loss.

Checked against verl 0.9.1 (``verl/trainer/ppo/core_algos.py``, ``ray_trainer.py``,
``workers/utils/losses.py``, ``experimental/agent_loop/agent_loop.py``):

* Tensors (all ``(B, T)``, T = response length, right-padded): ``old_log_probs`` (learner
  recomputation), ``rollout_log_probs`` (needs ``actor_rollout_ref.rollout.calculate_log_probs=True``;
  padded with 0.0), ``advantages`` (per token), ``response_mask`` (0 for padding *and* for
  tool/observation tokens of multi-turn agent loops).  ``non_tensor_batch["uid"]`` is the prompt id.
* Policy loss registry: ``register_policy_loss(name)`` / ``get_policy_loss_fn(name)``, called by
  ``workers/utils/losses.ppo_loss`` as ``fn(old_log_prob=, log_prob=, advantages=, response_mask=,
  loss_agg_mode=, config=, rollout_is_weights=)``.  The rollout log-probs are *not* among the
  arguments: they reach a registered loss only in **bypass mode**
  (``algorithm.rollout_correction.bypass_mode=True``), where the trainer sets
  ``old_log_probs = rollout_log_probs``.  So the TRIAGE loss runs in bypass mode and reads
  ``old_log_prob`` as the sampler log-prob and ``log_prob`` as the live learner log-prob.
  The legacy ``RayPPOTrainer`` (``apply_bypass_mode``) also rewrites ``policy_loss.loss_mode`` to
  ``"bypass_mode"`` every step, so :func:`register` can install TRIAGE under that name too
  (``as_bypass_mode=True``); the v1 trainer keeps the configured ``loss_mode``.

No metric or controller logic here: conversion to :class:`TokenBatch` and calls into the core.
"""

from __future__ import annotations

from typing import Any, Optional

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import LossHookSteps, group_ids_from_keys, triage_loss

#: verl ``loss_agg_mode`` → TRIAGE normalisation (SPEC.md §4.2).
AGG_TO_NORMALIZATION = {"token-mean": "global_token", "seq-mean-token-mean": "per_response"}


def batch_from_dataproto(data, learner_key: str = "old_log_probs", sampler_key: str = "rollout_log_probs",
                         on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from a verl ``DataProto`` (after old-log-prob recomputation, before the actor update).

    Args:
        data: ``verl.DataProto`` with ``batch[learner_key]``, ``batch[sampler_key]``, ``batch["advantages"]``,
            ``batch["response_mask"]``, all ``(B, T)`` right-padded; optional ``non_tensor_batch["uid"]``
            (group ids).
        learner_key, sampler_key: tensor names (nats).
        on_invalid: see :meth:`TokenBatch.from_padded`.

    Raises:
        KeyError: a required tensor is missing (the message says which verl setting produces it).
    """
    td = data.batch
    for key, hint in ((learner_key, "decoupled mode recomputes it; in bypass mode it equals the rollout log-probs"),
                      (sampler_key, "set actor_rollout_ref.rollout.calculate_log_probs=True"),
                      ("advantages", "call after compute_advantage"), ("response_mask", "")):
        if key not in td.keys():
            raise KeyError(f"DataProto has no {key!r} ({hint}); it has {sorted(td.keys())}")
    uid = data.non_tensor_batch.get("uid") if getattr(data, "non_tensor_batch", None) is not None else None
    return TokenBatch.from_padded(td[learner_key], td[sampler_key], td["advantages"], td["response_mask"],
                                  group_ids=None if uid is None else group_ids_from_keys(uid),
                                  on_invalid=on_invalid)


def log_dataproto(monitor, step: int, data, extra: Optional[dict] = None, **kw) -> dict:
    """``monitor.log_step(step, batch_from_dataproto(data, **kw), extra)``; returns the metrics."""
    return monitor.log_step(step, batch_from_dataproto(data, **kw), extra=extra)


def _cfg(config, name: str, default):
    if config is None:
        return default
    v = config.get(name, None) if hasattr(config, "get") else getattr(config, name, None)
    return default if v is None else v


class VerlTriageLoss(LossHookSteps):
    """A verl ``PolicyLossFn`` computing the TRIAGE loss (use with bypass mode, see module docstring).

    Call signature and return value are verl's: ``(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``, all tensors ``(B, T)``.

    ``old_log_prob`` is read as the sampler log-prob (bypass mode), ``log_prob`` as the live learner
    log-prob; PPO clip range from ``config.clip_ratio_low/high`` (fallback ``clip_ratio``, 0.2);
    ``loss_agg_mode`` ``token-mean`` → ``global_token``, ``seq-mean-token-mean`` → ``per_response``.
    With verl's ``config.global_batch_info`` (dp_size, batch_num_tokens, global_batch_size) the
    micro-batch loss is rescaled as verl's ``agg_loss`` does, so micro-batches add up to the mini-batch.
    The registered loss receives no step number: set ``step`` to the optimizer step before each
    update (e.g. from a trainer hook); unset, every call counts as a step (warned once, see
    :class:`~hooks._common.LossHookSteps`).  With a ``monitor``, the calls of one step (micro-batches,
    PPO epochs) are merged into one ``log_step`` with the Gate weights as ``gate_weight``; it is
    written when ``step`` changes, on :meth:`flush` or :meth:`close`.

    Attributes: ``controller``, ``monitor`` (optional MismatchMonitor), ``last`` (the last
    :class:`~hooks._common.TriageLoss`), ``calls``, ``step``.
    """

    def __init__(self, controller: Optional[TriageController] = None, monitor=None, on_invalid: str = "raise",
                 step: Optional[int] = None):
        self.controller = controller or TriageController()
        self.on_invalid = on_invalid
        self._init_steps(monitor, step)

    def __call__(self, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                 config: Any = None, rollout_is_weights=None):
        if loss_agg_mode not in AGG_TO_NORMALIZATION:
            raise ValueError(f"TRIAGE supports loss_agg_mode in {sorted(AGG_TO_NORMALIZATION)}, got {loss_agg_mode!r}")
        step = self._call_step()
        batch = TokenBatch.from_padded(log_prob, old_log_prob, advantages, response_mask, on_invalid=self.on_invalid)
        clip = _cfg(config, "clip_ratio", 0.2)
        norm = AGG_TO_NORMALIZATION[loss_agg_mode]
        res = triage_loss(self.controller, batch, step, old_logp=batch.sampler_logp,
                          clip_low=_cfg(config, "clip_ratio_low", clip), clip_high=_cfg(config, "clip_ratio_high", clip),
                          normalization=norm)
        loss = res.loss * _global_scale(batch, norm, _cfg(config, "global_batch_info", {}) or {})
        self._finish_call(step, res)
        metrics = {f"triage/{k}": v for k, v in res.output.stats.items()}
        metrics["actor/ppo_kl"] = float(-batch.delta.mean()) if batch.num_tokens else 0.0
        return loss, metrics


def _global_scale(batch: TokenBatch, normalization: str, info: dict) -> float:
    """Factor that turns a micro-batch-local normalised loss into its share of verl's global mean."""
    dp = int(info.get("dp_size") or 1)
    if normalization == "global_token" and info.get("batch_num_tokens") is not None:
        return batch.num_tokens / float(info["batch_num_tokens"]) * dp
    if normalization == "per_response" and info.get("global_batch_size") is not None:
        return float((batch.num_valid > 0).sum()) / float(info["global_batch_size"]) * dp
    return 1.0


def register(controller: Optional[TriageController] = None, name: str = "triage", as_bypass_mode: bool = False,
             monitor=None, on_invalid: str = "raise") -> VerlTriageLoss:
    """Register the TRIAGE loss in verl's own policy-loss registry and return it.

    Args:
        controller: the TriageController (default: published configuration).
        name: registry name; select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>``.
        as_bypass_mode: also register under ``"bypass_mode"`` (needed with the legacy
            ``RayPPOTrainer``, whose ``apply_bypass_mode`` forces that loss mode).
        monitor: optional MismatchMonitor fed from inside the loss (one step per ``fn.step`` value,
            its micro-batches merged; call ``fn.close()`` before ``monitor.close()``).

    Raises:
        ImportError: verl is not installed.
    """
    from verl.trainer.ppo.core_algos import register_policy_loss

    fn = VerlTriageLoss(controller, monitor=monitor, on_invalid=on_invalid)
    register_policy_loss(name)(fn)
    if as_bypass_mode:
        register_policy_loss("bypass_mode")(fn)
    return fn
