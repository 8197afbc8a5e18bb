"""Glue shared by the framework hooks: no metric or controller logic lives here.

Each hook converts its framework's tensors to a :class:`~triage_monitor.batch.TokenBatch`
(the layout-specific part, in the hook module) and then calls the core APIs
through :func:`triage_loss`, so every framework computes the TRIAGE loss with
exactly the same code as a user calling the core API directly.  Loss hooks are called once per
micro-batch; :class:`StepAccumulator` merges a step's calls into one ``monitor.log_step``.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController, TriageOutput, weighted_policy_loss
from triage_monitor.corrections import ppo_clip_loss

Tensor = torch.Tensor
log = logging.getLogger("triage_monitor")


@dataclass
class TriageLoss:
    """One TRIAGE loss evaluation (N valid tokens).

    Attributes:
        loss: 0-dim float32, differentiable: weighted PPO-clip loss (docs/metrics.md#normalization) + Repair (§4.3).
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
            (one update per rollout).  Also the TIS numerator (docs/metrics.md#baselines).
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
    tokens inside the response keep counting (docs/metrics.md#terms: position before masking).
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


def concat_batches(parts: Sequence[TokenBatch]) -> TokenBatch:
    """One flat :class:`TokenBatch` holding the micro-batches ``parts`` of one step, in order.

    Tokens, per-sample ``group_id`` / ``num_valid`` (responses without valid tokens included) and the
    quarantine counts and rows are concatenated; sample ids are renumbered ``0 … S−1`` over the parts
    (a running sample counter, so equal row indices of two micro-batches stay distinct responses).
    ``group_id`` is taken as given: it must mean the same prompt in every part (e.g. a rollout-wide
    prompt index), or be −1.  Built field by field rather than via ``from_flat``: the parts are
    validated and in canonical order already, and ``from_flat`` would drop zero-token responses.
    ``learner_logp`` is detached.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("concat_batches: no micro-batches to merge")
    counts = [b.num_samples for b in parts]
    offsets = [0] + list(np.cumsum(counts)[:-1])
    cat = lambda name: torch.cat([getattr(b, name) for b in parts])  # noqa: E731
    quarantine: Counter = Counter()
    rows = []
    for b, off in zip(parts, offsets):
        quarantine.update(b.quarantine)
        if b.quarantined is not None:             # caller's sample ids → merged ids (rank in the part + offset)
            q = dict(b.quarantined)
            q["sample_id"] = torch.searchsorted(b.sample_id.cpu(), q["sample_id"]) + int(off)
            rows.append(q)
    quarantined = {k: torch.cat([q[k] for q in rows]) for k in rows[0]} if rows else None
    dev = parts[0].device
    return TokenBatch(
        learner_logp=torch.cat([b.learner_logp.detach() for b in parts]), sampler_logp=cat("sampler_logp"),
        advantage=cat("advantage"), position=cat("position"),
        sample_index=torch.cat([b.sample_index + int(off) for b, off in zip(parts, offsets)]),
        sample_id=torch.arange(sum(counts), device=dev), group_id=cat("group_id"), num_valid=cat("num_valid"),
        quarantine=dict(quarantine), quarantined=quarantined)


class StepAccumulator:
    """Merges the loss calls (micro-batches, PPO epochs) of one optimizer step into one ``monitor.log_step``.

    ``add(step, batch, ...)`` buffers a call's detached tokens; the buffered calls are merged
    (:func:`concat_batches`) and logged once when a call with a different ``step`` arrives, on
    :meth:`flush` and on :meth:`close`.  Per-token ``token_extras`` (e.g. ``gate_weight``, ``(N_call,)``)
    are concatenated in the same order; scalar ``extra`` values are averaged over the step's calls.
    The merged step's metrics therefore equal those of one ``log_step`` on the concatenated tokens.
    Tokens of a step are held (detached, on their device) until it is flushed.

    Args:
        monitor: a :class:`~triage_monitor.monitor.MismatchMonitor` (or anything with its ``log_step``).
    """

    def __init__(self, monitor):
        self.monitor = monitor
        self.step: Optional[int] = None
        self._parts: list = []

    def add(self, step: int, batch: TokenBatch, token_extras: Optional[dict] = None,
            extra: Optional[dict] = None) -> Optional[dict]:
        """Buffer one call's tokens under ``step``; returns the metrics of the previous step if this flushed it."""
        out = self.flush() if self.step is not None and int(step) != self.step else None
        self.step = int(step)
        extras = {k: torch.as_tensor(v).detach().reshape(-1) for k, v in (token_extras or {}).items()}
        self._parts.append((batch.detach(), extras, dict(extra or {})))
        return out

    def flush(self) -> Optional[dict]:
        """Log the buffered step (one ``log_step``) and return its metrics; None when nothing is buffered."""
        parts, step = self._parts, self.step
        self._parts, self.step = [], None
        if not parts:
            return None
        batch = concat_batches([b for b, _, _ in parts])
        token_extras = {k: torch.cat([te[k] for _, te, _ in parts]) for k in parts[0][1]} or None
        scalars: dict = defaultdict(list)
        for _, _, ex in parts:
            for k, v in ex.items():
                scalars[k].append(float(v))
        extra = {k: sum(v) / len(v) for k, v in scalars.items()}
        return self.monitor.log_step(step, batch, extra=extra, token_extras=token_extras)

    def close(self) -> Optional[dict]:
        """Flush the last step (the monitor itself is left open: close it yourself)."""
        return self.flush()


class LossHookSteps:
    """Step numbering and step-merged monitoring shared by the loss hooks (verl, OpenRLHF, SkyRL, NeMo RL, prime-rl).

    Attributes used: ``step`` (the optimizer step the user sets, or None), ``calls`` (loss calls so far),
    ``monitor`` (optional), ``last``.  With ``step`` set, every call of that step feeds the controller with
    that step number and is merged into ONE monitored step (:class:`StepAccumulator`).  With ``step=None``
    the frameworks pass no step number, so each loss call counts as its own step (controller calibration
    window, ``repair_start_step``, monitor window all count calls) and is logged at once; a warning says so once.
    """

    def _init_steps(self, monitor=None, step: Optional[int] = None) -> None:
        self.monitor, self.step, self.calls, self.last = monitor, step, 0, None
        self._acc: Optional[StepAccumulator] = None
        self._warned_calls = False

    def _call_step(self) -> int:
        """The step of the current call: ``self.step``, else the call count (warned once)."""
        if self.step is not None:
            return int(self.step)
        if not self._warned_calls:
            self._warned_calls = True
            log.warning("triage-monitor: %s.step is not set, so every loss call (micro-batch, PPO epoch) counts as "
                        "one step for the controller and the monitor; set .step to the optimizer step each update "
                        "(docs/hooks.md)", type(self).__name__)
        return self.calls

    def _finish_call(self, step: int, res: TriageLoss) -> None:
        """Record the call: ``last``, ``calls`` and (with a monitor) the tokens and Gate weights for ``step``."""
        self.last, self.calls = res, self.calls + 1
        if self.monitor is None:
            return
        if self._acc is None or self._acc.monitor is not self.monitor:
            if self._acc is not None:
                self._acc.flush()
            self._acc = StepAccumulator(self.monitor)
        self._acc.add(step, res.batch, {"gate_weight": res.output.gate_weights}, res.output.stats)
        if self.step is None:             # each call is its own step: nothing to merge, log it now
            self._acc.flush()

    def flush(self) -> Optional[dict]:
        """Log the buffered step now (e.g. at the end of each optimizer step); returns its metrics or None."""
        return self._acc.flush() if self._acc is not None else None

    def close(self) -> Optional[dict]:
        """Flush the last step; call before ``monitor.close()``."""
        return self.flush()
