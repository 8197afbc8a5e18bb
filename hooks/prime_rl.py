"""prime-rl hook: per-sample monitoring adapter and a custom loss importable by path.

prime-rl ("Bring your own loss", ``prime_rl.trainer.rl.loss``, public repository as of 2026) calls a
custom loss once **per sample** as ``fn(inputs: LossInputs, **kwargs) -> LossOutputs`` with 1-D
tensors ``inputs.trainer_logprobs`` (live learner), ``inputs.inference_logprobs`` (vLLM),
``inputs.advantages`` (per token), ``inputs.loss_mask`` (bool) for one packed sequence.  Point the
trainer's custom-loss import path at ``triage_monitor.hooks.prime_rl.triage_loss_fn`` (see docs/hooks.md).

Because the call is per sample, the Gate and TIS weights are exactly the core API's (they are per
response), and the Repair term is the per-response average of φ; prime-rl then sums per-sample
losses and divides by its loss scale.  prime-rl is not installable on CPU from PyPI: tested
against its documented per-sample layout.
"""

from __future__ import annotations

from typing import Optional

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import LossHookSteps, triage_loss


def batch_from_prime_rl(trainer_logprobs, inference_logprobs, advantages, loss_mask, on_invalid: str = "raise",
                        sample_ids=None, group_ids=None) -> TokenBatch:
    """TokenBatch from prime-rl 1-D per-sample tensors (one sample, or lists of samples).

    A prime-rl sample spans prompt + completion (prompt: ``loss_mask`` False, inference log-prob 0.0);
    each sample is cut at its first loss token so that position 0 is the first completion token
    (SPEC.md §2); later masked tokens (tool output) keep counting.
    """
    if hasattr(trainer_logprobs, "dim") and trainer_logprobs.dim() == 1:
        trainer_logprobs, inference_logprobs = [trainer_logprobs], [inference_logprobs]
        advantages, loss_mask = [advantages], [loss_mask]
    starts = [int(m.float().argmax()) if bool(m.any()) else 0 for m in loss_mask]
    cut = lambda ts: [t[s:] for t, s in zip(ts, starts)]  # noqa: E731
    return TokenBatch.from_list(cut(trainer_logprobs), cut(inference_logprobs), cut(advantages), cut(loss_mask),
                                sample_ids=sample_ids, group_ids=group_ids, on_invalid=on_invalid)


class PrimeRLTriageLoss(LossHookSteps):
    """Per-sample TRIAGE loss for prime-rl.

    Set ``step`` to the optimizer step (unset, each call — one **sample** — counts as a step, warned
    once); with a ``monitor`` the samples of one step are merged into one ``log_step`` (written when
    ``step`` changes, on ``flush()`` / ``close()``).
    """

    def __init__(self, controller: Optional[TriageController] = None, clip_low: float = 0.2, clip_high: float = 0.28,
                 on_invalid: str = "raise", monitor=None, step: Optional[int] = None):
        self.controller = controller or TriageController()
        self.clip_low, self.clip_high, self.on_invalid = clip_low, clip_high, on_invalid
        self._init_steps(monitor, step)

    def __call__(self, inputs, **kwargs):
        batch = batch_from_prime_rl(inputs.trainer_logprobs, inputs.inference_logprobs, inputs.advantages,
                                    inputs.loss_mask, self.on_invalid)
        step = self._call_step()
        res = triage_loss(self.controller, batch, step, clip_low=self.clip_low, clip_high=self.clip_high,
                          normalization="per_response")
        self._finish_call(step, res)
        metrics = {f"triage/{k}": v for k, v in res.output.stats.items()}
        try:
            from prime_rl.trainer.rl.loss import LossOutputs
        except ImportError:
            return res.loss, metrics
        return LossOutputs(loss=res.loss, metrics=metrics)


#: The import path target: ``triage_monitor.hooks.prime_rl.triage_loss_fn`` (default TriageConfig).
triage_loss_fn = PrimeRLTriageLoss()
