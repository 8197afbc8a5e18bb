"""NeMo RL hook: monitoring adapter and a ``LossFunction``-protocol object.

NeMo RL (``nemo_rl.algorithms.loss_functions.ClippedPGLossFn``, public repository as of 2026) gets
``data`` (a ``BatchedDataDict``) with ``prev_logprobs`` (learner recomputation),
``generation_logprobs`` (vLLM), ``advantages``, ``token_mask`` and ``sample_mask``, all ``(B, S)``
over prompt + response; the loss drops the first column (``[:, 1:]``) to align log-probs with
next-token logits.  Prompt and environment/tool tokens carry ``token_mask`` 0 and
``generation_logprobs`` 0.0; positions are counted from each row's first response token.

:class:`NemoRLTriageLoss` follows the protocol ``__call__(next_token_logits, data, global_valid_seqs,
global_valid_toks) -> (loss, metrics)``; it computes the live log-probs from full-vocabulary logits
(no tensor/vocab parallelism: with a vocab-parallel DTensor use NeMo's own helper first).  NeMo RL
is not installable on CPU from PyPI: tested against its documented layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import LossHookSteps, gather_flat, leading_positions, triage_loss


def batch_from_nemo_rl(data, learner_key: str = "prev_logprobs", on_invalid: str = "raise",
                       learner_logp=None) -> TokenBatch:
    """TokenBatch from a NeMo RL data dict (``(B, S)`` tensors, first column dropped as NeMo does).

    ``learner_logp`` (``(B, S-1)``, already aligned) overrides ``data[learner_key][:, 1:]``.
    """
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    learner = data[learner_key][:, 1:] if learner_logp is None else learner_logp
    adv = data["advantages"][:, 1:]
    return TokenBatch.from_padded(learner, data["generation_logprobs"][:, 1:], adv, mask,
                                  positions=leading_positions(mask), on_invalid=on_invalid)


class NemoRLTriageLoss(LossHookSteps):
    """TRIAGE loss as a NeMo RL ``LossFunction`` (token-level).

    Set ``step`` to the optimizer step (unset, each call counts as a step, warned once); with a
    ``monitor`` the calls of one step are merged into one ``log_step`` (written when ``step``
    changes, on ``flush()`` / ``close()``).
    """

    loss_type = "token_level"

    def __init__(self, controller: Optional[TriageController] = None, clip_low: float = 0.2, clip_high: float = 0.28,
                 on_invalid: str = "raise", monitor=None, step: Optional[int] = None):
        self.controller = controller or TriageController()
        self.clip_low, self.clip_high, self.on_invalid = clip_low, clip_high, on_invalid
        self._init_steps(monitor, step)

    def __call__(self, next_token_logits, data, global_valid_seqs=None, global_valid_toks=None, **kwargs):
        logits = next_token_logits[:, :-1].float()
        ids = data["input_ids"][:, 1:]
        live = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        batch = batch_from_nemo_rl(data, on_invalid=self.on_invalid, learner_logp=live)
        old = gather_flat(batch, data["prev_logprobs"][:, 1:])
        step = self._call_step()
        res = triage_loss(self.controller, batch, step, old_logp=old, clip_low=self.clip_low,
                          clip_high=self.clip_high, normalization="global_token",
                          global_denominator=None)
        self._finish_call(step, res)
        loss = res.loss
        if global_valid_toks is not None:   # NeMo sums micro-batch losses: scale to the global token mean
            loss = loss * (batch.num_tokens / torch.as_tensor(global_valid_toks, dtype=torch.float32).clamp(min=1))
        return loss, {f"triage/{k}": v for k, v in res.output.stats.items()}
