"""Glue shared by the framework hooks: no metric or controller logic lives here.

Each hook converts its framework's tensors to a :class:`~triage_monitor.batch.TokenBatch`
(the layout-specific part, in the hook module) and then calls the core APIs
through :func:`triage_loss`, so every framework computes the TRIAGE loss with
exactly the same code as a user calling the core API directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController, TriageOutput, weighted_policy_loss
from triage_monitor.corrections import ppo_clip_loss

Tensor = torch.Tensor


@dataclass
class TriageLoss:
    """One TRIAGE loss evaluation (N valid tokens).

    Attributes:
        loss: 0-dim float32, differentiable: weighted PPO-clip loss (SPEC.md §4.2) + Repair (§4.3).
        policy_loss: 0-dim float32, the weighted PPO-clip part alone.
        per_token_loss: ``(N,)`` float32 PPO-clip surrogate before weighting.
        output: the controller's :class:`~triage_monitor.controller.TriageOutput`.
        batch: the TokenBatch the loss was computed on.
    """

    loss: Tensor
    policy_loss: Tensor
    per_token_loss: Tensor
    output: TriageOutput
    batch: TokenBatch


def triage_loss(controller: TriageController, batch: TokenBatch, step: int, old_logp: Optional[Tensor] = None,
                clip_low: float = 0.2, clip_high: float = 0.28, normalization: Optional[str] = None,
                dual_clip: Optional[float] = None, group=None, global_denominator=None) -> TriageLoss:
    """TRIAGE loss of one (micro-)batch from the core APIs.

    ``out = controller(batch, step, old_logp)``;
    ``ℓ_t = ppo_clip_loss(learner_logp, old_logp, A, clip_low, clip_high)``;
    ``loss = weighted_policy_loss(ℓ, out.token_weights, batch, normalization) + out.repair_loss``.

    Args:
        controller: the :class:`TriageController` (holds config and calibration state).
        batch: TokenBatch whose ``learner_logp`` is the live (grad-carrying) learner log-prob, nats.
        step: optimizer update index.
        old_logp: ``(N,)`` PPO anchor log-probs (nats); default ``batch.learner_logp.detach()``
            (one update per rollout).  Also the TIS numerator (SPEC.md §4.5).
        clip_low, clip_high: PPO clip range [1 − clip_low, 1 + clip_high].
        normalization: ``"per_response"`` | ``"global_token"``; default the controller's config.

    Raises:
        ValueError: from the core APIs on shape mismatches.
    """
    old = batch.learner_logp.detach() if old_logp is None else old_logp.detach()
    out = controller(batch, step=step, old_logp=old)
    ptl = ppo_clip_loss(batch.learner_logp, old, batch.advantage, clip_low, clip_high, dual_clip)
    norm = normalization or controller.config.normalization
    pol = weighted_policy_loss(ptl, out.token_weights, batch, norm, group=group,
                               global_denominator=global_denominator)
    return TriageLoss(loss=pol + out.repair_loss, policy_loss=pol, per_token_loss=ptl, output=out, batch=batch)


def leading_positions(mask: Tensor) -> Tensor:
    """``(B, T)`` int64 positions counted from each row's first masked-in column.

    For layouts whose per-token tensors span prompt + response (OpenRLHF's action
    mask, NeMo RL's token mask): position 0 is the first response token, tool-output
    tokens inside the response keep counting (SPEC.md §2: position before masking).
    Rows without any valid token get the column index (never read).
    """
    m = mask.bool()
    T = m.shape[-1]
    cols = torch.arange(T, device=m.device).expand_as(m)
    first = torch.where(m.any(-1), m.float().argmax(-1), torch.zeros_like(m[:, 0], dtype=torch.long))
    return cols - first.unsqueeze(-1)


def group_ids_from_keys(keys) -> Tensor:
    """``(B,)`` int64 group ids from per-sample keys (e.g. verl's ``uid`` strings): index of the key in sorted order."""
    return torch.from_numpy(np.unique(np.asarray(keys), return_inverse=True)[1].reshape(-1).astype(np.int64))


def gather_flat(batch: TokenBatch, values: Tensor) -> Tensor:
    """``(N,)``: a tensor in the caller's layout (same shape as the one the batch was built from)
    read at the batch's valid tokens, in the batch's flat order (the inverse of ``batch.scatter``)."""
    return batch.gather(values)
