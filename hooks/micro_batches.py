"""Glue shared by the framework hooks: no metric or controller logic lives here.

Layout helpers (:func:`leading_positions`, :func:`group_ids_from_keys`) and :class:`StepAccumulator`, which
merges the loss calls (micro-batches) of one step into one ``monitor.log_step``.  The loss itself is
:func:`triage_monitor.triage.loss.triage_policy_loss`; the per-process state of a hook is in :mod:`._runtime`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Optional

import numpy as np
import torch

from triage_monitor.batch import TokenBatch

Tensor = torch.Tensor
log = logging.getLogger("triage_monitor")


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


class StepAccumulator:
    """Merges the loss calls (micro-batches, PPO epochs) of one optimizer step into one ``monitor.log_step``.

    ``add(step, batch, ...)`` buffers a call's detached tokens; the buffered calls are merged
    (:meth:`TokenBatch.cat <triage_monitor.batch.TokenBatch.cat>`) and logged once when a call with a different ``step`` arrives, on
    :meth:`flush` and on :meth:`close`.  Per-token ``token_extras`` (e.g. ``gate_weight``, ``(N_call,)``)
    are concatenated in the same order; scalar ``extra`` values are averaged over the step's calls.
    The merged step's metrics therefore equal those of one ``log_step`` on the concatenated tokens.
    Tokens of a step are held (detached, on their device) until it is flushed.

    Args:
        monitor: a :class:`~triage_monitor.monitor.MismatchMonitor` (or anything with its ``log_step``).
        timings_for: ``fn(step) -> {phase: seconds} or None``, asked when a step is logged: the step's phase
            timings (``log_step(timings=...)``, docs/metrics.md#step-time-and-the-full-cycle).
        extra_for: ``fn(step) -> {name: value} or None``, asked when a step is logged, after ``timings_for``:
            scalars of the step from outside the loss calls (the framework's ``reward``), put in ``extra`` over
            the calls' averages.
    """

    def __init__(self, monitor, timings_for: Optional[Callable[[int], Optional[dict]]] = None,
                 extra_for: Optional[Callable[[int], Optional[dict]]] = None):
        self.monitor = monitor
        self.timings_for = timings_for
        self.extra_for = extra_for
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
        batch = TokenBatch.cat([b for b, _, _ in parts])
        token_extras = {k: torch.cat([te[k] for _, te, _ in parts]) for k in parts[0][1]} or None
        scalars: dict = defaultdict(list)
        for _, _, ex in parts:
            for k, v in ex.items():
                scalars[k].append(float(v))
        extra = {k: sum(v) / len(v) for k, v in scalars.items()}
        timings = self.timings_for(step) if self.timings_for is not None else None
        if self.extra_for is not None:
            extra.update(self.extra_for(step) or {})
        if timings:
            return self.monitor.log_step(step, batch, extra=extra, token_extras=token_extras, timings=timings)
        return self.monitor.log_step(step, batch, extra=extra, token_extras=token_extras)

    def close(self) -> Optional[dict]:
        """Flush the last step (the monitor itself is left open: close it yourself)."""
        return self.flush()
