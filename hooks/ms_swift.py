"""ms-swift hook: a subclass of ms-swift's GRPO trainer that monitors every optimizer step and (optionally) trains
with TRIAGE (docs/hooks.md#ms-swift).

Checked against ms-swift 4.6.0 (newest) and 4.4.0 (the first release whose ``GRPOTrainer._compute_loss_and_metrics``
takes ``(model, model_inputs, grpo_batch)``; ``swift/rlhf_trainers/grpo_trainer.py``).  ms-swift's ``GRPOTrainer``
subclasses TRL's (ms-swift pins ``trl<1.0``) but computes its loss itself, so the hook follows the TRL hook's
approach (:mod:`triage_monitor.hooks.trainer_mixin`) at ms-swift's own methods:

* ``_get_per_token_logps_and_entropies``: the live learner log-probs of the loss forward, ``(B, T)`` — in
  padding-free mode ms-swift has already padded them back (``pad_logps_back_to_batch``: each row's completion
  right-aligned, left padding ``-1e10``), otherwise the completion-region frame (``labels[:, -logits_to_keep:]``,
  right padding).  Positions count from each row's first completion token (:func:`leading_positions`).
* ``_compute_loss_and_metrics``: ms-swift's own runs first — its metrics (``clip_ratio/*``, ``entropy/*``,
  ``rollout_correction/*``: ``kl``, ``k3_kl``, ``training_ppl``, ``rollout_ppl``, ``log_ppl_diff``, ``ppl_ratio``,
  ``chi2_token``, ``chi2_seq``, ``is_weight_mean``, ``ess``, ``clipped_frac``) are ms-swift's values.  Without a
  controller its loss is returned.  With one, :func:`~triage_monitor.triage.loss.triage_policy_loss` on the same live
  log-probs, with ms-swift's aggregation for its ``loss_type`` and, when ``rollout_importance_sampling_mode`` is set,
  ms-swift's rollout importance-sampling weights reproduced by our corrections (:data:`ROLLOUT_IS_CORRECTIONS`) as a
  per-token factor outside the normaliser, where ms-swift multiplies them.
* ``log`` (the mixin's): the curated ``triage/*`` metrics of the step just completed join ms-swift's log.

The sampler log-probs are ``grpo_batch.rollout_per_token_logps``: vLLM's (``use_vllm``, vLLM ≥ 0.10.2; ms-swift asks
for ``processed_logprobs``), or, without vLLM, those of ms-swift's own ``TransformersEngine``, which the hook asks
for (``record_sampler_logps=True``: ``RequestConfig.logprobs``; the engine takes ``log_softmax`` of the raw logits,
so temperature 1.0 only).

From ms-swift's command line (``swift rlhf --rlhf_type grpo ...``) the trainer is selected by a plugin
(``--external_plugins triage_plugin.py``) that calls :func:`register`.
"""

from __future__ import annotations

from typing import Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.triage.corrections import (geometric_sequence_mask_weights, icepop_weights,
                                        sequence_is_geometric_weights, tis_weights)
from triage_monitor.exits import quiet_imports
from triage_monitor.monitor import MonitorConfig

from .micro_batches import leading_positions
from .loss_hook_options import hook_options
from .trainer_mixin import TrainerHookMixin, last_stats
from .option_strings import check_normalization
from .worker_runtime import HookSettings

with quiet_imports():          # ms-swift loads transformers, which loads torchao (failed CUDA-extension loads on a CPU)
    from swift.rlhf_trainers import GRPOTrainer as SwiftGRPOTrainer

#: ms-swift ``loss_type`` → :func:`~triage_monitor.triage.loss.agg_loss` mode (denominators:
#: :meth:`TriageSwiftGRPOTrainer._triage_denominator`).  ``cispo``, ``sapo``, ``real``, ``fipo`` are not a PPO-clip
#: surrogate and are refused with a controller.
LOSS_TYPE_AGG = {
    "grpo": "seq_mean_token_mean",   # Σ_s (Σ_t ℓ / n_s) / B
    "bnpo": "token_mean",            # Σ ℓ / max(1, tokens of the micro-batch)
    "dr_grpo": "token_sum",          # Σ ℓ / (B · max_completion_length)
    "dapo": "token_mean",            # Σ ℓ / (num_items_in_batch / processes) [× GA since 4.6]
}

#: ms-swift ``rollout_importance_sampling_mode`` → the correction of :mod:`triage_monitor.triage.corrections` that
#: reproduces its weights (``threshold`` = ``rollout_importance_sampling_threshold``; tests/swift_checks.py compares
#: each with ms-swift's ``_apply_rollout_importance_sampling``).
ROLLOUT_IS_CORRECTIONS = {
    "token_truncate": "tis_weights(old, sampler, low=0, high=threshold)",
    "token_mask": "icepop_weights(old, sampler, low=0, high=threshold)",
    "sequence_truncate": "sequence_is_geometric_weights(old, sampler, seq, high=threshold)",
    "sequence_mask": "geometric_sequence_mask_weights(old, sampler, seq, high=threshold)",
}

#: What the sampler log-probs recorded without vLLM are.
SAMPLER_LOGP_KIND = "ms-swift TransformersEngine logprobs: log_softmax(raw logits) of the sampled token"

#: Settings :func:`register` stored for trainers built without ``triage=`` (ms-swift's command line).
_REGISTERED: Optional[HookSettings] = None


def rollout_is_weights(mode: str, threshold: float, old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                       batch: TokenBatch) -> torch.Tensor:
    """ms-swift's rollout importance-sampling weights of ``mode``, computed by our corrections, ``(N,)`` float32,
    detached (:data:`ROLLOUT_IS_CORRECTIONS`).

    Args:
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``.
        threshold: ``rollout_importance_sampling_threshold`` (upper bound, > 0).
        old_logp, sampler_logp: ``(N,)`` the learner's log-probs at rollout time and the sampler's, nats.
        batch: the :class:`TokenBatch` the tokens belong to (sequences for the sequence modes).

    Raises:
        ValueError: an unknown ``mode`` or a threshold ≤ 0.
    """
    if mode == "token_truncate":
        return tis_weights(old_logp, sampler_logp, 0.0, threshold)
    if mode == "token_mask":
        return icepop_weights(old_logp, sampler_logp, 0.0, threshold)
    if mode == "sequence_truncate":
        return sequence_is_geometric_weights(old_logp, sampler_logp, batch, high=threshold)
    if mode == "sequence_mask":
        return geometric_sequence_mask_weights(old_logp, sampler_logp, batch, high=threshold)
    raise ValueError(f"rollout_importance_sampling_mode={mode!r} is not one of {sorted(ROLLOUT_IS_CORRECTIONS)}")


def batch_from_swift(learner_logp: torch.Tensor, grpo_batch, mask: torch.Tensor,
                     on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from ms-swift's loss call: learner ``(B, T)`` vs ``grpo_batch.rollout_per_token_logps`` ``(B, T)``,
    per-token ``grpo_batch.advantages`` ``(B, T)``, ``mask`` ``(B, T)`` (ms-swift's loss mask); positions count from
    each row's first completion token.

    Raises:
        RuntimeError: the batch carries no sampler log-probs (names the fix).
        triage_monitor.batch.InvalidTokenError: invalid values with ``on_invalid="raise"``.
    """
    sampler = grpo_batch.rollout_per_token_logps
    if sampler is None:
        raise RuntimeError("triage-monitor: ms-swift's batch has no rollout log-probs (grpo_batch.rollout_per_token_logps"
                           " is None): use vLLM >= 0.10.2, or the transformers engine with record_sampler_logps=True, "
                           "and a rollout that returns log-probs for every completion token (docs/hooks.md#ms-swift)")
    return TokenBatch.from_padded(learner_logp, sampler.to(learner_logp.dtype), grpo_batch.advantages, mask,
                                  positions=leading_positions(mask), on_invalid=on_invalid)


class TriageSwiftGRPOTrainer(TrainerHookMixin, SwiftGRPOTrainer):
    """ms-swift's ``GRPOTrainer`` with triage-monitor attached (docs/hooks.md#ms-swift).

    Args (besides ms-swift's):
        triage: :class:`~triage_monitor.hooks.worker_runtime.HookSettings` (``run_dir``, ``monitor``, ``triage`` — a
            :class:`~triage_monitor.triage.controller.TriageConfig`, None keeps ms-swift's loss —, ``alerts``, ``loggers``,
            ``framework_keys``, ...); default: the settings given to :func:`register`; neither: a plain trainer.
        record_sampler_logps: without vLLM, ask ms-swift's ``TransformersEngine`` for the sampled tokens'
            log-probs (default True).

    Raises:
        ValueError: at construction, a set-up that gives the hook no sampler or learner log-probs, or counts a
            token twice (:meth:`_check_monitoring`), or, with a controller, an option the TRIAGE loss cannot
            honour (:meth:`_check_triage`).
    """

    def __init__(self, *args, triage: Optional[HookSettings] = None, record_sampler_logps: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_sampler_logps = record_sampler_logps
        import swift

        triage = self._tm_attach(triage if triage is not None else _REGISTERED,
                                 {"framework": "ms-swift", "framework_version": swift.__version__})
        if triage is None:
            return
        self._check_monitoring()
        if triage.triage is not None:
            self._check_triage()
            triage.manifest.setdefault("swift_loss_type", self.loss_type)
        if not self.use_fast_infer and record_sampler_logps:
            self.request_config.logprobs = True           # the TransformersEngine returns the sampled tokens' logprobs
        triage.manifest.setdefault("sampler_logp_kind", "vllm processed_logprobs of the sampled token"
                                   if self.use_fast_infer else SAMPLER_LOGP_KIND)
        if self.rollout_importance_sampling_mode is not None:
            triage.manifest.setdefault("swift_rollout_importance_sampling", {
                "mode": self.rollout_importance_sampling_mode,
                "threshold": self.rollout_importance_sampling_threshold,
                "reproduced_by": ROLLOUT_IS_CORRECTIONS[self.rollout_importance_sampling_mode]})

    # ------------------------------------------------------------ timings
    # the methods ms-swift profiles as spans sent to W&B / SwanLab only (rlhf_trainers/utils.py profiling_context),
    # timed by the hook; the old / reference log-probs, the update and TRL's step_time: the mixin's
    def _engine_infer(self, *args, **kwargs):               # ms-swift's 'generate' span (rollout_mixin.py)
        return self._tm_timed("generation", super()._engine_infer, *args, **kwargs)

    def _move_model_to_vllm(self, *args, **kwargs):         # the weights handed to vLLM
        return self._tm_timed("weight_sync", super()._move_model_to_vllm, *args, **kwargs)

    def _score_completions(self, *args, **kwargs):          # rewards (and their per-function metrics)
        return self._tm_timed("reward", super()._score_completions, *args, **kwargs)

    # ------------------------------------------------------------ checks
    def _check_monitoring(self) -> None:
        """Refuse set-ups where the hook would see no learner or sampler log-probs, or a token twice.

        Raises:
            ValueError: ``use_liger_kernel`` (ms-swift's Liger loss: no log-probs reach the hook), sequence
                parallelism (every rank of a sequence-parallel group holds the gathered completion: each token would be
                recorded once per rank), a multi-turn server rollout with a dynamic sample count (chunked loss with
                dummy chunks), or, without vLLM, ``record_sampler_logps=False`` or a temperature other than 1.0 (the
                TransformersEngine's log-probs are those of the raw logits).
        """
        bad = []
        if getattr(self, "use_liger_loss", False):
            bad.append("use_liger_kernel=True (ms-swift's Liger loss computes the loss inside the kernel; no "
                       "log-probs reach the hook)")
        if self.template.sequence_parallel_size > 1:
            bad.append(f"sequence_parallel_size={self.template.sequence_parallel_size} (every rank of a sequence-"
                       "parallel group holds the gathered completions: tokens would be recorded once per rank)")
        if getattr(self, "dynamic_num_samples", False):
            bad.append("a multi-turn server rollout with a dynamic sample count (ms-swift's chunked loss adds dummy "
                       "chunks)")
        if not self.use_fast_infer:
            if not self.record_sampler_logps:
                bad.append("use_vllm=False with record_sampler_logps=False (no sampler log-probs)")
            elif float(self.temperature) != 1.0:
                bad.append(f"use_vllm=False with temperature={self.temperature} (ms-swift's TransformersEngine returns "
                           "log_softmax of the raw logits, not of logits / temperature; use temperature=1.0 or vLLM)")
        if bad:
            raise ValueError("TriageSwiftGRPOTrainer: cannot monitor with " + "; ".join(bad)
                             + " (docs/hooks.md#ms-swift)")

    def _check_triage(self) -> None:
        """Refuse, at construction, every ms-swift option the TRIAGE loss path cannot honour.

        Honoured: ``loss_type`` in :data:`LOSS_TYPE_AGG`, ``epsilon`` / ``epsilon_high``, ``delta`` (≥ 1 +
        epsilon_high: the dual clip), ``overlong_filter``, ``rollout_importance_sampling_mode`` (reproduced:
        :data:`ROLLOUT_IS_CORRECTIONS`, with TRIAGE's TIS off), ``beta`` with ``kl_in_reward``, OPD-RL teacher
        advantages (they arrive in ``grpo_batch.advantages``).

        Raises:
            ValueError: naming the setting, its value and the fix; ``TriageConfig.normalization="global_token"``.
        """
        cfg = self.triage_hook.settings.triage
        bad = []
        if self.loss_type not in LOSS_TYPE_AGG:
            bad.append(f"loss_type={self.loss_type!r} (not a PPO-clip surrogate; use one of {sorted(LOSS_TYPE_AGG)})")
        if self.beta != 0.0 and not self.kl_in_reward:
            bad.append(f"beta={self.beta} (KL term in the loss; use beta=0.0 or kl_in_reward=True)")
        if self.top_entropy_quantile < 1.0:
            bad.append(f"top_entropy_quantile={self.top_entropy_quantile} (use 1.0)")
        if self.importance_sampling_level != "token":
            bad.append(f"importance_sampling_level={self.importance_sampling_level!r} (use 'token')")
        if self.off_policy_sequence_mask_delta is not None:
            bad.append(f"off_policy_sequence_mask_delta={self.off_policy_sequence_mask_delta} (it changes ms-swift's "
                       "normaliser; the Gate down-weights instead)")
        if getattr(self, "chord_sft_iterator", None) is not None:
            bad.append("chord_sft_dataset (an SFT term beside the policy loss)")
        if getattr(self, "sdar_loss_coef", 0) > 0:
            bad.append(f"sdar_loss_coef={self.sdar_loss_coef} (a distillation term beside the policy loss)")
        if self.args.delta is not None and self.args.delta < 1.0 + self.epsilon_high:
            bad.append(f"delta={self.args.delta} (< 1 + epsilon_high = {1 + self.epsilon_high}: not a dual clip)")
        if self.is_multimodal:
            bad.append("a multimodal model (untested with the TRIAGE loss; monitoring alone works)")
        if self.rollout_importance_sampling_mode is not None and cfg.tis:
            bad.append(f"rollout_importance_sampling_mode={self.rollout_importance_sampling_mode!r} with "
                       "TriageConfig(tis=True) (two importance corrections; set one of them off)")
        if bad:
            raise ValueError("TriageSwiftGRPOTrainer: the TRIAGE loss cannot honour these settings: " + "; ".join(bad)
                             + " (docs/hooks.md#ms-swift)")
        check_normalization(cfg, "TriageSwiftGRPOTrainer", f"ms-swift divides the loss (loss_type={self.loss_type!r}) "
                            "by its own normaliser")

    # ------------------------------------------------------------------ loss
    def _loss_mask(self, grpo_batch) -> torch.Tensor:
        """The completion tokens ms-swift's loss sums over (overlong-truncated completions left out under
        ``overlong_filter``, as ms-swift does)."""
        mask = grpo_batch.completion_mask.bool()
        truncated = grpo_batch.truncated_mask
        if self.overlong_filter and truncated is not None and bool(truncated.any()):
            mask = mask & ~truncated.bool().unsqueeze(-1)
        return mask

    def _compute_loss_and_metrics(self, model, model_inputs, grpo_batch):
        if self.triage_hook is None:
            return super()._compute_loss_and_metrics(model, model_inputs, grpo_batch)
        (swift_loss, metrics_data), live = self._tm_run_captured(
            super()._compute_loss_and_metrics, model, model_inputs, grpo_batch)     # ms-swift's loss and metrics
        if not self.model.training:                                   # evaluation: ms-swift's loss, nothing recorded
            return swift_loss, metrics_data
        logps = live[0]
        hook = self.triage_hook
        batch = batch_from_swift(logps, grpo_batch, self._loss_mask(grpo_batch), hook.settings.on_invalid)
        rt = hook.runtime
        step = int(self.state.global_step)
        if rt.controller is None:                                     # monitoring only: ms-swift's loss
            rt.record(rt.step_for_call(step), batch.detach())
            return swift_loss, metrics_data
        old = grpo_batch.old_per_token_logps
        old = batch.learner_logp.detach() if old is None else batch.gather(old)
        res = hook.compute_loss(
            batch, old_logp=old, framework_step=step, clip_low=self.epsilon_low, clip_high=self.epsilon_high,
            dual_clip=self.args.delta, agg_mode=LOSS_TYPE_AGG[self.loss_type],
            denominator=self._triage_denominator(grpo_batch, logps), token_scale=self._triage_token_scale(
                grpo_batch, batch, old))
        self.triage_last = last_stats(res)          # detached numbers only: nothing of the micro-batch outlives it
        for k, v in res.output.stats.items():
            self._metrics["train"][f"triage/{k}"].append(float(v))
        return res.loss, metrics_data

    def _triage_denominator(self, grpo_batch, logps: torch.Tensor) -> torch.Tensor:
        """ms-swift's normaliser of one training micro-batch for ``self.loss_type`` (``_compute_loss_and_metrics``)."""
        mask = self._loss_mask(grpo_batch)
        rows = mask.size(0)
        lt = self.loss_type
        if lt == "grpo":
            den = torch.tensor(float(rows))
        elif lt == "bnpo":
            den = mask.sum().float().clamp(min=1.0)
        elif lt == "dr_grpo":
            den = torch.tensor(float(rows * self.max_completion_length))
        else:   # dapo: the accumulation window's completion tokens per process, ÷ ms-swift's own GA compensation
            den = torch.as_tensor(grpo_batch.num_items_in_batch).float() / self.accelerator.num_processes
            undo = getattr(self, "_undo_gradient_accumulation_scaling", None)      # ms-swift >= 4.6
            if undo is not None:
                den = den / float(undo(torch.tensor(1.0)))
        return den.to(logps.device)

    def _triage_token_scale(self, grpo_batch, batch: TokenBatch, old: torch.Tensor) -> Optional[torch.Tensor]:
        """``(N,)`` ms-swift's rollout importance-sampling weights (:func:`rollout_is_weights`) where ms-swift applies
        them, else None."""
        if (self.rollout_importance_sampling_mode is None or self.disable_rollout_importance_sampling
                or grpo_batch.rollout_per_token_logps is None):
            return None
        return rollout_is_weights(self.rollout_importance_sampling_mode, float(self.rollout_importance_sampling_threshold),
                                  old, batch.sampler_logp, batch)


def register(run_dir=None, triage: Optional[TriageConfig] = None, monitor: Optional[MonitorConfig] = None,
             manifest: Optional[dict] = None, on_invalid: str = "raise", *, alerts=True, loggers=(),
             framework_keys="curated", settings: Optional[HookSettings] = None) -> HookSettings:
    """Make ms-swift's ``--rlhf_type grpo`` build :class:`TriageSwiftGRPOTrainer` with these settings (call it from an
    ``--external_plugins`` file; every rank imports it, rank 0's attempt id is shared at construction).

    Args: as :class:`HookSettings` (``triage=None``: monitoring only, ms-swift's loss); ``settings``: a ready one.

    Returns:
        The :class:`HookSettings` registered.

    Raises:
        ValueError: a bad ``alerts`` / ``loggers`` / ``framework_keys`` (naming the option).
    """
    global _REGISTERED
    from swift.trainers import TrainerFactory

    if settings is None:
        alerts, loggers, framework_keys = hook_options("register", alerts, loggers, framework_keys)
        settings = HookSettings(run_dir=run_dir, monitor=monitor or MonitorConfig(), triage=triage,
                                manifest=dict(manifest or {}), on_invalid=on_invalid, alerts=alerts, loggers=loggers,
                                framework_keys=framework_keys)
    if settings.triage is not None:
        check_normalization(settings.triage, "register", "ms-swift divides the loss by its own normaliser")
    _REGISTERED = settings
    TrainerFactory.TRAINER_MAPPING["grpo"] = f"{__name__}.TriageSwiftGRPOTrainer"
    return settings


__all__ = ["TriageSwiftGRPOTrainer", "register", "rollout_is_weights", "batch_from_swift", "LOSS_TYPE_AGG",
           "ROLLOUT_IS_CORRECTIONS"]
