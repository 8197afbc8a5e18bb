"""TRL hook: a ``GRPOTrainer`` subclass that monitors every optimizer step and (optionally) trains with TRIAGE.

Checked against TRL 1.16.0 and 1.13.0 (``trl/trainer/grpo_trainer.py``; the ``_compute_loss`` of both releases is
the same code).  TRL runs the loss in the trainer process (one per Accelerate rank, no Ray), but the hook follows
the same contract as the others (docs/hooks.md#trl): it holds plain :class:`~triage_monitor.hooks.worker_runtime.HookSettings`;
monitor, controller and step accumulation live in this process's runtime; the step is TRL's own
``state.global_step``.  Callbacks never see tensors, so the hook overrides the narrowest methods the trainer has:

* ``_generate_single_turn`` (plain ``transformers.generate`` path only): TRL's own generation runs unchanged; a
  forward hook on the generating model records, at each KV-cached decoding step, ``log_softmax(raw logits /
  temperature)`` of the token sampled next — the **sampler path's own** log-probs, which TRL does not return on
  this path (``logprobs = None``).  TRL pads them (right, 0.0) into ``inputs["sampling_per_token_logps"]`` as it
  does for vLLM.  With vLLM or a ``rollout_func``, TRL's own ``sampling_per_token_logps`` are used unchanged.
* ``_get_per_token_logps_and_entropies``: keeps the live learner log-probs and entropies of the loss forward.
* ``_compute_loss``: TRL's own ``_compute_loss`` always runs first — its metrics (``clip_ratio/*``, ``entropy``,
  ...) are TRL's own, computed by TRL's code on the same tensors.  Without a controller its loss is returned.  With
  one, the loss returned is :func:`~triage_monitor.triage.loss.triage_policy_loss` on the same live learner log-probs,
  with TRL's aggregation for its ``loss_type`` (:data:`LOSS_TYPE_AGG`) and TRL's own per-token factors (entropy
  mask, off-policy mask, vLLM importance-sampling ratio) computed by TRL's own methods; TRL's graph is dropped.
  Our statistics go to TRL's logs under ``triage/``.
* **Phase timings** (docs/hooks.md#phase-timings): TRL's own timers of a step are its ``step_time`` (the optimizer
  step's ``training_step`` calls, in ``_metrics["train"]``; the optimizer step itself is outside it) and its
  ``profiling_context`` spans, which TRL sends to W&B / MLflow / Trackio only.  The hook takes ``step_time`` as the
  step's ``time/step`` and times the spans TRL profiles in the methods it overrides: ``_generate_single_turn``
  (TRL's ``transformers.generate`` / ``vLLM.generate`` / ``transformers.generate_batch`` spans, with TRL's
  ``sync_weights`` inside on vLLM → generation), ``_calculate_rewards`` (reward), ``_get_per_token_logps_and_entropies``
  outside the loss (the old log-probs → logprob; with the reference model → reference), and ``training_step`` less
  ``_prepare_inputs`` (the loss forward and backward → update); with a ``rollout_func`` (which TRL calls from
  ``_generate`` without a span of its own) the hook times ``_generate`` as generation.  Evaluation is not timed.
* **Reward** (docs/hooks.md#rewards): TRL's own ``reward`` metric — the mean over the generation batch of the
  weighted sum of the reward functions, appended to ``_metrics["train"]["reward"]`` in
  ``_generate_and_score_completions`` — of the batch each training micro-batch comes from is the step's
  ``reward`` column (:meth:`TrainerHookMixin._tm_record_reward <triage_monitor.hooks.trainer_mixin.TrainerHookMixin._tm_record_reward>`).
* ``log``: TRL logs after the optimizer has stepped, so the monitored step that update closed is complete: it is
  logged now, and the hook's curated metrics (``hook.framework_metrics()``: ``triage/window/rho_asym``, ...,
  ``triage/alerts_active``, ``triage/metrics_step``) join TRL's log, which TRL's ``report_to`` callbacks forward
  (W&B, TensorBoard, MLflow, ...).  Alerts and our own trackers (``HookSettings(alerts=..., loggers=...)``) are
  the monitor's, on rank 0 (the accelerator's main process).

Options the TRIAGE loss cannot honour raise a ``ValueError`` at construction (:meth:`TriageGRPOTrainer._check_triage`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.exits import quiet_imports

from .trainer_mixin import TrainerHookMixin, TrainerLossHook, last_stats
from .option_strings import check_normalization
from .worker_runtime import HookSettings

with quiet_imports():          # TRL loads transformers, which loads torchao: its failed CUDA-extension loads on a CPU
    from trl import GRPOTrainer

#: What the sampler log-probs recorded on the transformers path are (say which one was logged).
SAMPLER_LOGP_KIND = "transformers.generate KV-cache decoding: log_softmax(raw logits / temperature), no top-k/top-p"

#: TRL ``loss_type`` → :func:`~triage_monitor.triage.loss.agg_loss` mode; the denominators are TRL's own
#: (:meth:`TriageGRPOTrainer._triage_denominator`).  Other loss types (``sapo``, ``cispo``, ``vespo``) are not a
#: PPO-clip surrogate and raise at construction.
__all__ = ["HookSettings", "TriageGRPOTrainer", "TRLLossHook", "batch_from_trl", "last_stats", "LOSS_TYPE_AGG"]

LOSS_TYPE_AGG = {
    "grpo": "seq_mean_token_mean",   # Σ_s (Σ_t ℓ / n_s) / B, ÷ gradient-accumulation steps
    "bnpo": "token_mean",            # Σ ℓ / (tokens of the micro-batch), ÷ GA
    "dr_grpo": "token_sum",          # Σ ℓ / (B · max_completion_length), ÷ GA
    "dapo": "token_mean",            # Σ ℓ / (num_items_in_batch / processes · GA / steps_per_generation)
    "luspo": "seq_mean_token_sum",   # Σ_s Σ_t ℓ / B, ÷ GA
}

def batch_from_trl(learner_logp, inputs: dict, on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from GRPOTrainer inputs: learner ``(B, T)`` vs ``inputs["sampling_per_token_logps"]`` ``(B, T)``.

    Mask = ``completion_mask`` × ``tool_mask`` (tool-result tokens excluded); ``advantages`` ``(B,)`` or ``(B, T)``;
    completions are right-padded, so the position is the column (tool tokens keep counting).  Tokens vLLM could not
    score carry NaN sampler log-probs: invalid tokens (``on_invalid``).

    Raises:
        RuntimeError: the inputs carry no sampler log-probs.
        triage_monitor.batch.InvalidTokenError: invalid values with ``on_invalid="raise"``.
    """
    sampler = inputs.get("sampling_per_token_logps")
    if sampler is None:
        raise RuntimeError("no sampler log-probs in the batch (inputs['sampling_per_token_logps']): use vLLM, a "
                           "rollout_func returning 'logprobs', or the plain transformers path with "
                           "record_sampler_logps=True (docs/hooks.md#trl)")
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    return TokenBatch.from_padded(learner_logp, sampler, inputs["advantages"], mask, on_invalid=on_invalid)


#: The TRL adapter's picklable part (the trainer holds the model, not this).
TRLLossHook = TrainerLossHook


class _SamplerLogps:
    """Records, during one ``generate`` call, the log-prob of each sampled token under the sampler's raw logits.

    A forward hook on the generating model: at each decoding step the previous step's ``log_softmax(logits[:, -1] /
    temperature)`` row is read at the token the step feeds in (``input_ids[:, -1]``, the token just sampled), and
    the new row is kept; the last token is read after ``generate`` from the returned ids.  Memory: one ``(B, V)`` row.
    """

    def __init__(self, module: torch.nn.Module, temperature: float):
        self.module, self.temperature = module, float(temperature)
        self.pending: Optional[torch.Tensor] = None
        self.cols: list = []
        self.tokens: list = []

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _hook(self, module, args, kwargs, output):
        if kwargs.get("fused_lm_head") or getattr(output, "logits", None) is None:
            return                       # a scoring forward (TRL 1.16 fused head), not a decoding step
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.pending is not None and ids is not None:
            tok = ids[:, -1].to(self.pending.device)
            self.cols.append(self.pending.gather(1, tok.unsqueeze(1)).squeeze(1))
            self.tokens.append(tok)
        self.pending = (output.logits[:, -1, :].detach().float() / self.temperature).log_softmax(-1)

    def logps(self, completion_ids: list) -> Optional[list]:
        """Per-completion log-prob lists aligned with TRL's (EOS-trimmed) ``completion_ids``; None if they do not
        align with the decoding steps seen (then TRL's ``None`` is kept and the batch says so)."""
        if self.pending is None or len(completion_ids) != self.pending.size(0):
            return None
        lp = torch.stack(self.cols, 1).cpu() if self.cols else torch.zeros(self.pending.size(0), 0)
        tk = torch.stack(self.tokens, 1).cpu() if self.tokens else torch.zeros(self.pending.size(0), 0, dtype=torch.long)
        out = []
        for i, ids in enumerate(completion_ids):
            n = len(ids)
            if n == 0:
                out.append([])
                continue
            if n - 1 > lp.size(1) or tk[i, :n - 1].tolist() != list(ids[:n - 1]):
                return None
            row = lp[i, :n - 1].tolist()
            row.append(self.pending[i, int(ids[n - 1])].item() if n - 1 == lp.size(1) else lp[i, n - 1].item())
            out.append(row)
        return out


class TriageGRPOTrainer(TrainerHookMixin, GRPOTrainer):
    """``GRPOTrainer`` with triage-monitor attached (docs/hooks.md#trl).

    Args (besides GRPOTrainer's):
        triage: :class:`~triage_monitor.hooks.worker_runtime.HookSettings`: ``run_dir`` (None = no records),
            ``monitor``, ``triage`` (a :class:`~triage_monitor.triage.controller.TriageConfig`; None keeps TRL's loss),
            ``manifest``, ``on_invalid``, ``step_source``, ``alerts`` (default: the shipped rules, on rank 0),
            ``loggers`` (trackers fed by rank 0), ``framework_keys`` (what joins TRL's log, :meth:`log`).
            None: a plain GRPOTrainer.
        record_sampler_logps: record generation-time log-probs on the plain ``transformers.generate`` path
            (default True; vLLM and ``rollout_func`` give their own).

    Raises:
        ValueError: at construction, a TRL option the TRIAGE loss path cannot honour together with a controller
            (:meth:`_check_triage`), or monitoring/TRIAGE with a generation path that yields no sampler log-probs.

    Attributes:
        triage_hook: the :class:`TRLLossHook` (None without ``triage``); its ``runtime`` holds monitor and controller.
        triage_last: detached statistics of the last training micro-batch's loss (controller on; None before the
            first): plain numbers only (:func:`last_stats`), no tensor of the micro-batch is kept.
    """

    def __init__(self, *args, triage: Optional[HookSettings] = None, record_sampler_logps: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_sampler_logps = record_sampler_logps
        import trl

        triage = self._tm_attach(triage, {"framework": "trl", "framework_version": trl.__version__})
        if triage is None:
            return
        self._check_monitoring()
        if triage.triage is not None:
            self._check_triage()
        triage.manifest.setdefault("sampler_logp_kind", self._sampler_logp_kind())
        if triage.triage is not None:
            triage.manifest.setdefault("trl_loss_type", self.loss_type)

    # ------------------------------------------------------------ checks
    def _sampler_logp_kind(self) -> str:
        if self.rollout_func is not None:
            return "rollout_func logprobs"
        if self.use_vllm:
            return "vllm processed_logprobs of the sampled token"
        return SAMPLER_LOGP_KIND

    def _check_monitoring(self) -> None:
        """Refuse set-ups where the hook would see no sampler or no learner log-probs.

        Raises:
            ValueError: TRL 1.13's Liger loss (``_compute_loss`` never runs), continuous batching or
                ``record_sampler_logps=False`` without vLLM / ``rollout_func`` (no sampler log-probs).
        """
        if hasattr(GRPOTrainer, "compute_liger_loss") and self.args.use_liger_kernel:
            raise ValueError("triage-monitor: use_liger_kernel=True on TRL < 1.16 computes the loss inside Liger's "
                             "fused kernel, so no learner log-probs reach the hook; use_liger_kernel=False, or TRL "
                             ">= 1.16 (only Liger's layer kernels there) (docs/hooks.md#trl)")
        if self.rollout_func is not None or self.use_vllm:
            return
        if self.use_transformers_continuous_batching:
            raise ValueError("triage-monitor: use_transformers_continuous_batching=True returns no sampler "
                             "log-probs, so there is no mismatch to monitor; use the plain transformers path "
                             "(record_sampler_logps=True), vLLM or a rollout_func (docs/hooks.md#trl)")
        if not self.record_sampler_logps:
            raise ValueError("triage-monitor: record_sampler_logps=False on the transformers.generate path leaves no "
                             "sampler log-probs; set it True, or use vLLM or a rollout_func (docs/hooks.md#trl)")

    def _check_triage(self) -> None:
        """Refuse, at construction, every TRL option the TRIAGE loss path cannot honour.

        Honoured: ``loss_type`` in :data:`LOSS_TYPE_AGG`, ``epsilon`` / ``epsilon_high``, ``delta`` (≥ 1 + epsilon_high:
        the dual clip), ``top_entropy_quantile``, ``off_policy_mask_threshold``, vLLM importance-sampling correction
        (with TRIAGE's TIS off), ``mask_truncated_completions``, tools, TRL 1.16's Liger layer kernels (TRL 1.13's
        Liger loss is refused by :meth:`_check_monitoring`).

        Raises:
            ValueError: naming the setting, its value and the fix; ``TriageConfig.normalization="global_token"``
                (TRL's normaliser renormalises the weights per response: docs/hooks.md#triage-weights-under-a-frameworks-normaliser).
        """
        args, cfg = self.args, self.triage_hook.settings.triage
        bad = []
        if self.loss_type not in LOSS_TYPE_AGG:
            bad.append(f"loss_type={self.loss_type!r} (not a PPO-clip surrogate; use one of {sorted(LOSS_TYPE_AGG)})")
        if self.beta != 0.0:
            bad.append(f"beta={self.beta} (KL term; use beta=0.0)")
        if getattr(self, "_entropy_bonus_enabled", False):
            bad.append(f"entropy_coef={self.entropy_coef} / use_adaptive_entropy={self.use_adaptive_entropy} "
                       "(entropy bonus; use entropy_coef=0.0, use_adaptive_entropy=False)")
        if self.importance_sampling_level != "token":
            bad.append(f"importance_sampling_level={self.importance_sampling_level!r} (use 'token')")
        if getattr(self, "aux_loss_enabled", False):
            bad.append(f"router_aux_loss_coef={args.router_aux_loss_coef} (MoE aux loss; use 0.0)")
        if args.delta is not None and args.delta < 1.0 + self.epsilon_high:
            bad.append(f"delta={args.delta} (< 1 + epsilon_high = {1 + self.epsilon_high}: not a dual clip)")
        if getattr(self, "_is_vlm", False):
            bad.append("a vision-language processing_class (multimodal inputs are not tested with the TRIAGE "
                       "loss; monitoring alone works)")
        if self.use_vllm and self.vllm_importance_sampling_correction and cfg.tis:
            bad.append("vllm_importance_sampling_correction=True with TriageConfig(tis=True) (two importance "
                       "corrections; set one of them off)")
        if bad:
            raise ValueError("TriageGRPOTrainer: the TRIAGE loss cannot honour these GRPOConfig settings: "
                             + "; ".join(bad) + " (docs/hooks.md#trl)")
        check_normalization(cfg, "TriageGRPOTrainer", f"TRL divides the loss (loss_type={self.loss_type!r}) by its "
                            "own normaliser")

    # ------------------------------------------------------------ generation
    def _generate(self, prompts, *args, **kwargs):
        # With a rollout_func TRL calls it from _generate (not _generate_single_turn) and profiles no span of its
        # own around it: the hook times that call as generation (with vLLM it holds TRL's sync_weights span, as
        # _generate_single_turn does).  Without one, _generate_single_turn below is timed instead.
        if self.triage_hook is None or self.rollout_func is None:
            return super()._generate(prompts, *args, **kwargs)
        return self._tm_timed("generation", super()._generate, prompts, *args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        # TRL 1.13: (prompt_ids, images, multimodal_fields, has_tool_images=False);
        # TRL 1.16: (prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)
        span = ("vLLM.generate" if self.use_vllm else "transformers.generate_batch"
                if self.use_transformers_continuous_batching else "transformers.generate")
        t0 = time.perf_counter()
        try:
            return self._tm_generate(prompt_ids, images, multimodal_fields, *args, **kwargs)
        finally:
            self._tm_time(span, time.perf_counter() - t0)

    def _tm_generate(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        if (self.triage_hook is None or self.use_vllm or self.use_transformers_continuous_batching
                or not self.record_sampler_logps):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        module = self.accelerator.unwrap_model(self.model_wrapped)
        if hasattr(module, "get_base_model"):             # PEFT: generate runs the base model's forward
            module = module.get_base_model()
        with _SamplerLogps(module, self.temperature) as rec:
            ids, logps = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        if logps is None:
            logps = rec.logps(ids)
            if logps is None:
                self.triage_hook.runtime._warn_once(
                    "trl-sampler", "triage-monitor: the decoding steps seen did not match TRL's completions; no "
                    "sampler log-probs for this batch")
        return ids, logps

    # ------------------------------------------------------------ timings
    def _calculate_rewards(self, *args, **kwargs):
        return self._tm_timed("_calculate_rewards", super()._calculate_rewards, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        if self.triage_hook is None:
            return super()._compute_loss(model, inputs)
        trl_loss, live = self._tm_run_captured(super()._compute_loss, model, inputs)   # TRL's own loss and metrics
        if not self.model.training:                                # evaluation: TRL's loss, nothing recorded
            return trl_loss
        logps, entropies, _ = live
        hook = self.triage_hook
        batch = batch_from_trl(logps, inputs, hook.settings.on_invalid)
        rt = hook.runtime
        if rt.controller is None:                                  # monitoring only: TRL's loss
            rt.record(rt.step_for_call(self.state.global_step), batch.detach())
            return trl_loss
        old = inputs.get("old_per_token_logps")
        res = hook.compute_loss(
            batch, old_logp=None if old is None else batch.gather(old), framework_step=self.state.global_step,
            clip_low=self.epsilon_low, clip_high=self.epsilon_high, dual_clip=self.args.delta,
            agg_mode=LOSS_TYPE_AGG[self.loss_type], denominator=self._triage_denominator(inputs),
            token_scale=self._triage_token_scale(inputs, logps, entropies, batch))
        # detached statistics only: the result's per-token tensors (the live log-probs and their graph, the
        # batch, the weights) must not outlive this micro-batch's backward, across the optimizer step
        self.triage_last = last_stats(res)
        for k, v in res.output.stats.items():
            self._metrics["train"][f"triage/{k}"].append(float(v))
        return res.loss

    def _loss_mask(self, inputs):
        mask = inputs["completion_mask"]
        return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]

    def _triage_denominator(self, inputs) -> torch.Tensor:
        """TRL's normaliser of one training micro-batch for ``self.loss_type`` (``_compute_loss``, train mode)."""
        ga = self.current_gradient_accumulation_steps
        rows = inputs["completion_ids"].size(0)
        lt = self.loss_type
        if lt in ("grpo", "luspo"):
            den = torch.tensor(float(rows * ga))
        elif lt == "bnpo":
            den = self._loss_mask(inputs).sum().float().clamp(min=1.0) * ga
        elif lt == "dr_grpo":
            den = torch.tensor(float(rows * self.max_completion_length * ga))
        else:   # dapo
            den = (inputs["num_items_in_batch"].float().clamp(min=1.0) / self.accelerator.num_processes
                   * ga / self.args.steps_per_generation)
        return den.to(inputs["completion_ids"].device)

    def _triage_token_scale(self, inputs, logps, entropies, batch: TokenBatch) -> Optional[torch.Tensor]:
        """``(N,)`` product of TRL's own per-token factors (computed by TRL's methods), or None when none is on."""
        mask = self._loss_mask(inputs)
        scale = torch.ones_like(logps, dtype=torch.float32)
        on = False
        if self.top_entropy_quantile < 1.0:
            scale = scale * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).float()
            on = True
        if self.off_policy_mask_threshold is not None:
            adv = inputs["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            sampling = inputs.get("sampling_per_token_logps", old)
            scale = scale * self.get_off_policy_mask(advantages=adv, per_token_logps=logps,
                                                     sampling_per_token_logps=sampling, mask=mask,
                                                     off_policy_threshold=self.off_policy_mask_threshold).float()
            on = True
        if self.use_vllm and self.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            scale = scale * inputs["importance_sampling_ratio"].float()
            on = True
        return batch.gather(scale.expand_as(logps)) if on else None

    # ------------------------------------------------------------ logging
    def log(self, logs: dict, *args, **kwargs) -> None:
        """TRL's ``log``, with the triage metrics of the step just completed added to ``logs`` (docs/hooks.md#trl;
        :meth:`TrainerHookMixin.log <triage_monitor.hooks.trainer_mixin.TrainerHookMixin.log>`).  For a name the
        controller's statistics also carry (``triage/gate_downweighted_frac``) TRL's own mean over the logging
        interval is kept (TRL merges its ``_metrics`` last)."""
        return super().log(logs, *args, **kwargs)
