"""The module verl imports in its processes to get the TRIAGE loss and the ``triage_*`` trainers.

Name it in ``actor_rollout_ref.model.external_lib`` (verl's ``HFModelConfig`` imports it in every worker, where
the loss runs) and in ``VERL_USE_EXTERNAL_MODULES`` (``import verl`` imports it in the trainer process, where
``trainer.v1.trainer_mode`` is looked up).  On import it registers, in this process, the policy loss ``triage``
(:class:`~triage_monitor.hooks.verl.VerlTriageLoss`, configured from the ``TRIAGE_MONITOR_*`` environment
variables) and, where verl's v1 trainer imports, the trainers ``triage_sync``, ``triage_colocate_async`` and
``triage_separate_async``.  docs/hooks.md#verl has the lines to copy.
"""

from __future__ import annotations

import logging

from .verl import register, register_trainers

LOSS = register()
try:
    TRAINERS = register_trainers()
except Exception as exc:  # noqa: BLE001 — e.g. no transfer_queue here: the loss still works in this process
    TRAINERS = []
    logging.getLogger("triage_monitor").warning(
        "triage-monitor: the triage_* verl trainers are not registered in this process (%s: %s); the policy loss "
        "'triage' is", type(exc).__name__, exc)
