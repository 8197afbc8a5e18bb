"""OpenRLHF hook: monitoring adapter and a drop-in ``PolicyLoss`` replacement.

Checked against OpenRLHF 0.11.2 (``openrlhf/models/loss.py``, ``trainer/ray/ppo_actor.py``,
``trainer/ppo_utils/samples_generator.py``, ``utils/agent.py``):

* Tensors ``(B, A)``: ``action_log_probs`` (live learner), ``old_action_log_probs`` (learner
  recomputation), ``experience.rollout_log_probs`` (vLLM), ``advantages`` (per token),
  ``experience.action_mask``.  The A axis spans prompt + response shifted by one
  (``sequences[1:]``): prompt and tool-feedback columns hold rollout log-prob **0.0** and
  ``action_mask`` 0.  Positions are therefore counted from each row's first action column.
* No registry: ``PPOActor`` calls ``self.actor_loss_fn(log_probs, old_log_probs, advantages,
  action_mask=, rollout_log_probs=, dp_size=, batch_num_tokens=, global_batch_size=)`` and expects
  ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``.  :class:`TriagePolicyLoss` has exactly
  that signature; install it by assigning ``actor.actor_loss_fn = TriagePolicyLoss(...)``.
* Packed rows (several samples in one row) need ``TokenBatch.from_packed`` with the packed
  lengths; this adapter handles one sample per row.
"""

from __future__ import annotations

from typing import Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import LossHookSteps, gather_flat, leading_positions, triage_loss


def batch_from_openrlhf(log_probs, rollout_log_probs, advantages, action_mask, on_invalid: str = "raise",
                        sample_ids=None, group_ids=None) -> TokenBatch:
    """TokenBatch from OpenRLHF ``(B, A)`` tensors (learner ``log_probs``, vLLM ``rollout_log_probs``).

    Raises:
        ValueError: ``rollout_log_probs`` is None (the vLLM engine did not return log-probs).
    """
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is None: OpenRLHF only keeps vLLM log-probs when the rollout "
                         "returns them (vLLM logprobs enabled, e.g. with IS correction on)")
    return TokenBatch.from_padded(log_probs, rollout_log_probs, advantages, action_mask,
                                  positions=leading_positions(action_mask), sample_ids=sample_ids,
                                  group_ids=group_ids, on_invalid=on_invalid)


class TriagePolicyLoss(LossHookSteps, torch.nn.Module):
    """Drop-in for ``openrlhf.models.loss.PolicyLoss`` computing the TRIAGE loss.

    PPO ratio against ``old_log_probs``; TIS weight ``clamp(exp(old − rollout), lo, hi)`` and the
    Gate from δ = learner − rollout; ``token_level_loss=True`` → ``global_token`` normalisation,
    else ``per_response``.  ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` rescale the
    micro-batch loss as OpenRLHF's ``aggregate_loss`` does.  Set ``step`` to the optimizer step
    (unset, each call counts as a step, warned once); with a ``monitor`` the calls of one step are
    merged into one ``log_step`` (written when ``step`` changes, on ``flush()`` / ``close()``).
    """

    def __init__(self, controller: Optional[TriageController] = None, clip_eps_low: float = 0.2,
                 clip_eps_high: float = 0.2, token_level_loss: bool = True, monitor=None, on_invalid: str = "raise",
                 step: Optional[int] = None):
        super().__init__()
        self.controller = controller or TriageController()
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.normalization = "global_token" if token_level_loss else "per_response"
        self.on_invalid = on_invalid
        self._init_steps(monitor, step)

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                dp_size: int = 1, batch_num_tokens=None, global_batch_size=None):
        if action_mask is None:
            action_mask = torch.ones_like(log_probs, dtype=torch.bool)
        batch = batch_from_openrlhf(log_probs, rollout_log_probs, advantages, action_mask, self.on_invalid)
        old = gather_flat(batch, old_log_probs)
        step = self._call_step()
        res = triage_loss(self.controller, batch, step, old_logp=old, clip_low=self.clip_eps_low,
                          clip_high=self.clip_eps_high, normalization=self.normalization)
        scale = 1.0
        if self.normalization == "global_token" and batch_num_tokens is not None:
            scale = batch.num_tokens / float(batch_num_tokens) * dp_size
        elif self.normalization == "per_response" and global_batch_size is not None:
            scale = float((batch.num_valid > 0).sum()) / float(global_batch_size) * dp_size
        self._finish_call(step, res)
        with torch.no_grad():
            r = torch.exp(batch.learner_logp.float() - old.float())
            clip_ratio = ((r < 1 - self.clip_eps_low) | (r > 1 + self.clip_eps_high)).float().mean()
            ppo_kl = (old.float() - batch.learner_logp.float()).mean()
            vllm_kl = (batch.sampler_logp.float() - old.float()).mean()
            filt = torch.tensor(res.output.stats["gate_downweighted_frac"])
        return res.loss * scale, clip_ratio, ppo_kl, vllm_kl, filt
