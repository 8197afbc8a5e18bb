"""SkyRL hook: monitoring adapter and TRIAGE as a registered policy loss.

SkyRL's ``PolicyLossRegistry`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``, public repository
as of 2026) calls a policy loss as ``fn(log_probs, old_log_probs, advantages, config, loss_mask=None,
rollout_logprobs=None) -> (loss, metrics: dict)``; tensors ``(B, T)`` response-aligned and
right-padded, ``config`` is the ``AlgorithmConfig`` (``eps_clip_low``, ``eps_clip_high``,
``loss_reduction`` ∈ token_mean | sequence_mean | ...).  ``rollout_logprobs`` is present when the
generator returns log-probs (off-policy correction enabled).  Select the loss with
``trainer.algorithm.policy_loss_type=triage`` after :func:`register`.

SkyRL does not install on a CPU machine from PyPI; this adapter is exercised against tensors laid
out as SkyRL lays them out (see docs/hooks.md).
"""

from __future__ import annotations

from typing import Optional

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import LossHookSteps, gather_flat, triage_loss

REDUCTION_TO_NORMALIZATION = {"token_mean": "global_token", "sequence_mean": "per_response"}


def batch_from_skyrl(log_probs, rollout_logprobs, advantages, loss_mask, on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from SkyRL ``(B, T)`` tensors: learner ``log_probs`` vs generator ``rollout_logprobs``.

    Raises:
        ValueError: ``rollout_logprobs`` is None (generator log-probs not enabled).
    """
    if rollout_logprobs is None:
        raise ValueError("rollout_logprobs is None: enable generator log-probs (off-policy correction) in SkyRL")
    return TokenBatch.from_padded(log_probs, rollout_logprobs, advantages, loss_mask, on_invalid=on_invalid)


def _get(config, name, default):
    v = getattr(config, name, None) if config is not None else None
    if v is None and hasattr(config, "get"):
        v = config.get(name, None)
    return default if v is None else v


class SkyRLTriageLoss(LossHookSteps):
    """A SkyRL policy-loss function computing the TRIAGE loss.

    Set ``step`` to the optimizer step (unset, each call counts as a step, warned once); with a
    ``monitor`` the calls of one step are merged into one ``log_step`` (written when ``step``
    changes, on ``flush()`` / ``close()``).
    """

    def __init__(self, controller: Optional[TriageController] = None, monitor=None, on_invalid: str = "raise",
                 step: Optional[int] = None):
        self.controller = controller or TriageController()
        self.on_invalid = on_invalid
        self._init_steps(monitor, step)

    def __call__(self, log_probs, old_log_probs, advantages, config=None, loss_mask=None, rollout_logprobs=None):
        batch = batch_from_skyrl(log_probs, rollout_logprobs, advantages, loss_mask, self.on_invalid)
        old = gather_flat(batch, old_log_probs)
        step = self._call_step()
        norm = REDUCTION_TO_NORMALIZATION.get(_get(config, "loss_reduction", "token_mean"), "global_token")
        res = triage_loss(self.controller, batch, step, old_logp=old, clip_low=_get(config, "eps_clip_low", 0.2),
                          clip_high=_get(config, "eps_clip_high", 0.2), normalization=norm)
        self._finish_call(step, res)
        return res.loss, {f"triage/{k}": v for k, v in res.output.stats.items()}


def register(controller: Optional[TriageController] = None, name: str = "triage", monitor=None) -> SkyRLTriageLoss:
    """Register the TRIAGE loss in SkyRL's ``PolicyLossRegistry`` under ``name`` and return it.

    Raises:
        ImportError: SkyRL is not installed.
    """
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    fn = SkyRLTriageLoss(controller, monitor=monitor)
    PolicyLossRegistry.register(name, fn)
    return fn
