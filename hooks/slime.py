"""slime hook: monitoring adapter for slime's per-sample lists.

slime (THUDM/slime, public repository as of 2026) keeps the training batch as lists of 1-D
per-sample tensors over the **response** tokens: ``log_probs`` (learner recomputation),
``rollout_log_probs`` (SGLang), ``advantages`` (per token), ``loss_masks`` (0 for tool/observation
tokens), with ``response_lengths`` / ``total_lengths``.  Extension points are dotted import paths:
``--custom-loss-function-path`` (``fn(args, batch, logits, sum_of_sample_mean) -> (loss, log)``) and
``--custom-tis-function-path`` (``fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)``).

Controller: the TIS-function hook receives no advantages, so the Gate (which needs the sign of the
segment advantage, SPEC.md §4.1) cannot run there; a custom loss function receives Megatron logits
and must recompute log-probs with slime's internal (version-dependent, tensor-parallel) helper.
TRIAGE is therefore **not** wired into slime here; monitoring works live (call
:func:`log_slime_batch` from a custom loss/TIS function or a patched actor) and offline with
``triage-monitor import slime`` on ``--save-debug-rollout-data`` dumps.  slime is not installable on
CPU from PyPI: tested against its documented layout.
"""

from __future__ import annotations

from triage_monitor.batch import TokenBatch


def batch_from_slime(batch: dict, learner_key: str = "log_probs", sampler_key: str = "rollout_log_probs",
                     on_invalid: str = "raise", sample_ids=None, group_ids=None) -> TokenBatch:
    """TokenBatch from a slime batch dict of per-sample lists (``loss_masks`` optional → all valid).

    Raises:
        KeyError: a required list is missing (names the key and what slime needs to produce it).
    """
    for key in (learner_key, sampler_key, "advantages"):
        if key not in batch:
            raise KeyError(f"slime batch has no {key!r} (rollout_log_probs needs log-probs returned by the "
                           f"rollout engine); keys: {sorted(batch)}")
    masks = batch.get("loss_masks")
    return TokenBatch.from_list(list(batch[learner_key]), list(batch[sampler_key]), list(batch["advantages"]),
                                None if masks is None else list(masks), sample_ids=sample_ids,
                                group_ids=group_ids, on_invalid=on_invalid)


def log_slime_batch(monitor, step: int, batch: dict, extra=None, **kw) -> dict:
    """``monitor.log_step(step, batch_from_slime(batch, **kw), extra)``; returns the metrics."""
    return monitor.log_step(step, batch_from_slime(batch, **kw), extra=extra)
