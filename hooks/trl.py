"""TRL hook: a ``GRPOTrainer`` subclass that monitors every step and (optionally) trains with TRIAGE.

Checked against TRL 1.13.0 (``trl/trainer/grpo_trainer.py``).  Callbacks never see tensors, so the
hook overrides the narrowest methods the trainer has:

* ``_generate_single_turn`` — only on the plain ``transformers.generate`` path (no vLLM, no
  continuous batching, text only).  TRL returns no log-probs there (``logprobs = None``); the
  override generates with the same padding, model unwrapping and generation config, plus
  ``output_logits=True``, and returns the **sampler path's own** log-probs:
  ``log_softmax(raw_logits / temperature)`` of each sampled token, computed during KV-cached
  decoding.  TRL then pads them (right, 0.0) into ``inputs["sampling_per_token_logps"]`` as it does
  for vLLM.  With vLLM, TRL's own ``sampling_per_token_logps`` are used unchanged.
* ``_get_per_token_logps_and_entropies`` — pass-through that keeps the last (teacher-forced,
  full-sequence) learner log-probs, so monitoring costs no extra forward pass.
* ``_compute_loss`` — with a controller: the TRIAGE loss (core API, see ``_common.triage_loss``)
  from the live learner log-probs ``(B, T)``, ``sampling_per_token_logps`` ``(B, T)``,
  ``completion_mask × tool_mask`` and ``advantages`` ``(B,)``; PPO anchor ``old_per_token_logps``
  (or the detached live log-probs when TRL skips it: one update per generation); clip
  ``[1 − epsilon_low, 1 + epsilon_high]``; divided by the gradient-accumulation steps as TRL's
  ``grpo`` loss is.  Without a controller: TRL's own loss, unchanged.

The monitor gets one ``log_step`` per optimizer step (micro-batches of a step are merged), with the
Gate weights as the ``gate_weight`` token column when a controller is attached.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from trl import GRPOTrainer

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageController

from ._common import StepAccumulator, gather_flat, triage_loss

#: What the sampler log-probs recorded on the transformers path are (SPEC.md §8: say which one was logged).
SAMPLER_LOGP_KIND = "transformers.generate KV-cache decoding: log_softmax(raw logits / temperature), no top-k/top-p"


def batch_from_trl(learner_logp, inputs: dict, on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from GRPOTrainer inputs: learner ``(B, T)`` vs ``inputs["sampling_per_token_logps"]`` ``(B, T)``.

    Mask = ``completion_mask`` × ``tool_mask`` (tool-result tokens excluded); ``advantages`` ``(B,)``;
    completions are right-padded (padding 0.0 in the sampler log-probs, never read).

    Raises:
        RuntimeError: the inputs carry no sampler log-probs.
    """
    sampler = inputs.get("sampling_per_token_logps")
    if sampler is None:
        raise RuntimeError("no sampler log-probs in the batch: use vLLM, or the plain transformers path with "
                           "record_sampler_logps=True (continuous batching returns none)")
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    return TokenBatch.from_padded(learner_logp, sampler, inputs["advantages"], mask, on_invalid=on_invalid)


class TriageGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with triage-monitor attached.

    Args (besides GRPOTrainer's):
        triage_monitor: a :class:`~triage_monitor.monitor.MismatchMonitor` (or None).
        triage_controller: a :class:`~triage_monitor.controller.TriageController`; None keeps TRL's loss.
        record_sampler_logps: record generation-time log-probs on the non-vLLM path (default True).
        triage_on_invalid: ``"raise"`` | ``"quarantine"`` for invalid tokens (SPEC.md §8).

    Raises:
        ValueError: a controller is given with settings the TRIAGE loss does not cover
            (``beta != 0``, Liger loss, sequence-level importance sampling).

    Attributes:
        triage_last: the last micro-batch's ``TriageLoss`` (tokens, weights, repair loss).
    """

    def __init__(self, *args, triage_monitor=None, triage_controller: Optional[TriageController] = None,
                 record_sampler_logps: bool = True, triage_on_invalid: str = "raise", **kwargs):
        super().__init__(*args, **kwargs)
        self.triage_monitor = triage_monitor
        self.triage_controller = triage_controller
        self.record_sampler_logps = record_sampler_logps
        self.triage_on_invalid = triage_on_invalid
        self.triage_last = None
        self._tm_last_logps = None
        self._tm_acc = StepAccumulator(triage_monitor) if triage_monitor is not None else None
        if triage_controller is not None:
            bad = {"beta": self.beta != 0.0, "use_liger_kernel": self.use_liger_kernel,
                   "importance_sampling_level": self.importance_sampling_level != "token"}
            if any(bad.values()):
                raise ValueError(f"TRIAGE loss does not cover these GRPOConfig settings: "
                                 f"{[k for k, v in bad.items() if v]} (use beta=0, no Liger, token-level IS)")
        if triage_monitor is not None and getattr(triage_monitor, "rank", 0) == 0:
            info = {"framework": "trl", "sampler_logp_kind": "vllm" if self.use_vllm else SAMPLER_LOGP_KIND}
            triage_monitor.manifest.setdefault("info", {}).update(info)

    # ------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        if (self.use_vllm or self.use_transformers_continuous_batching or not self.record_sampler_logps
                or images is not None or multimodal_fields):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        device = self.accelerator.device
        tok = self._tokenizer
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, padding_value=tok.pad_token_id, padding_side="left").to(device)
        attention = pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left").to(device)
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          generation_kwargs=self.generation_kwargs) as model,
              torch.no_grad(), self._dist.summon_full_params(self.model_wrapped, recurse=False)):
            config = copy.deepcopy(self.generation_config)
            config.output_logits, config.return_dict_in_generate = True, True
            out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        completion = out.sequences[:, input_ids.size(1):]
        logits = torch.stack(out.logits, dim=1).float() / self.temperature          # (B, L, V), raw logits
        logps = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        is_eos = completion == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], is_eos.size(1),
                                                                                    dtype=torch.long))
        keep = torch.arange(completion.size(1), device=device).unsqueeze(0) <= first.unsqueeze(1)
        ids = [c[m].tolist() for c, m in zip(completion.cpu(), keep.cpu())]
        lps = [lp[m].tolist() for lp, m in zip(logps.cpu(), keep.cpu())]
        return ids, lps

    # ------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        res = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._tm_last_logps = res[0]
        return res

    def _compute_loss(self, model, inputs):
        if self.triage_controller is None:
            loss = super()._compute_loss(model, inputs)
            if self.triage_monitor is not None and self.model.training:
                self._tm_collect(self._tm_batch(self._tm_last_logps.detach(), inputs), None, {})
            return loss
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention, completion_ids.size(1))
        batch = self._tm_batch(logps, inputs)
        old = inputs.get("old_per_token_logps")
        old = None if old is None else gather_flat(batch, old)
        res = triage_loss(self.triage_controller, batch, self.state.global_step, old_logp=old,
                          clip_low=self.epsilon_low, clip_high=self.epsilon_high)
        self.triage_last = res
        mode = "train" if self.model.training else "eval"
        for k, v in res.output.stats.items():
            self._metrics[mode][f"triage/{k}"].append(v)
        if mode == "train":
            if self.triage_monitor is not None:
                self._tm_collect(batch.detach(), res.output.gate_weights, res.output.stats)
            return res.loss / self.current_gradient_accumulation_steps
        return res.loss

    def _tm_batch(self, learner_logp, inputs) -> TokenBatch:
        return batch_from_trl(learner_logp, inputs, self.triage_on_invalid)

    # ------------------------------------------------------------ monitoring
    def _tm_collect(self, batch: TokenBatch, gate, stats: dict) -> None:
        """Buffer a micro-batch under TRL's optimizer step; the previous step is logged when the step changes."""
        # plain stat names in the monitor (as the other hooks and the demo log them; W&B adds "triage/")
        self._tm_acc.add(int(self.state.global_step), batch, None if gate is None else {"gate_weight": gate},
                         dict(stats))

    def _tm_flush(self) -> None:
        if self._tm_acc is not None:
            self._tm_acc.flush()

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._tm_flush()
