"""What the hooks of transformers-``Trainer``-based GRPO trainers share (TRL's ``GRPOTrainer`` and ms-swift's, which
subclasses TRL's): the hook object, the attempt id shared by the Accelerate ranks, capturing the live learner
log-probs of the loss forward, the curated metrics joining the trainer's ``log``, closing the monitor when
``train()`` returns and the hook's state in the trainer's checkpoints.  No framework is imported here; each
framework's module puts :class:`TrainerHookMixin` first among its trainer's bases (docs/hooks.md#trl,
docs/hooks.md#ms-swift).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, TypedDict

import torch

from triage_monitor.exits import log_lines_above_progress_bars

from .worker_runtime import HookSettings, LossHook

#: Name of the per-rank controller / monitor state file written into each checkpoint folder.
STATE_FILE = "triage_monitor_state_rank{rank}.pt"


class LastStats(TypedDict):
    """:func:`last_stats`: one loss call's plain-number statistics, in this key order."""

    loss: float
    policy_loss: float
    agg_mode: str
    n_tokens: int
    n_responses: int
    stats: dict[str, float]
    gate_weight_min: float
    token_weight_max: float


def last_stats(res) -> LastStats:
    """Plain-number statistics of one :class:`~triage_monitor.triage.loss.TriageLoss`: ``loss``, ``policy_loss``,
    ``agg_mode``, ``n_tokens``, ``n_responses``, the controller's ``stats`` and ``gate_weight_min`` /
    ``token_weight_max`` (NaN without tokens); nothing that references the micro-batch's tensors."""
    n = int(res.batch.num_tokens)
    nan = float("nan")
    return {"loss": float(res.loss.detach()), "policy_loss": float(res.policy_loss.detach()), "agg_mode": res.agg_mode,
            "n_tokens": n, "n_responses": int(res.batch.num_samples),
            "stats": {k: float(v) for k, v in res.output.stats.items()},
            "gate_weight_min": float(res.output.gate_weights.min()) if n else nan,
            "token_weight_max": float(res.token_weights.max()) if n else nan}


class TrainerLossHook(LossHook):
    """The picklable part of a trainer hook: :class:`HookSettings` only (the trainer holds the model, not this)."""

    def __init__(self, settings: HookSettings):
        self.settings = settings


class TrainerHookMixin:
    """Put first among the bases of a transformers-``Trainer`` GRPO trainer (it needs ``accelerator``, ``state``,
    ``model``, ``log``, ``train``, ``_save_checkpoint``, ``_load_optimizer_and_scheduler`` and the
    ``_get_per_token_logps_and_entropies`` method TRL and ms-swift name alike).

    Attributes:
        triage_hook: the :class:`TrainerLossHook` (None without settings); its ``runtime`` holds monitor and
            controller.
        triage_last: detached statistics of the last training micro-batch's loss (controller on; None before the
            first): plain numbers only (:func:`last_stats`).
    """

    triage_hook: Optional[TrainerLossHook] = None
    triage_last: Optional[LastStats] = None
    _tm_live = None
    _tm_capture = False
    _tm_logged_step = None

    def _tm_attach(self, triage: Optional[HookSettings], manifest: dict) -> Optional[HookSettings]:
        """Attach ``triage`` (a copy with its own manifest; rank 0's attempt id on every Accelerate rank) and add
        ``manifest``'s facts to it where it has none; returns the copy (None: no hook)."""
        self.triage_last = None
        self._tm_live, self._tm_capture, self._tm_logged_step = None, False, None
        if triage is None:
            self.triage_hook = None
            return None
        triage = dataclasses.replace(triage, manifest=dict(triage.manifest))
        if self.accelerator.num_processes > 1:       # every rank built its own settings: share rank 0's attempt id
            from accelerate.utils import broadcast_object_list

            triage.attempt = broadcast_object_list([triage.attempt], from_process=0)[0]
        for k, v in manifest.items():
            triage.manifest.setdefault(k, v)
        self.triage_hook = TrainerLossHook(triage)
        return triage

    # ------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        t0 = time.perf_counter()
        res = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._tm_capture:
            self._tm_live = res
        else:                          # scoring the rollouts: the old log-probs, or the reference model's
            model = args[0] if args else kwargs.get("model")
            ref = getattr(self, "ref_model", None)
            self._tm_time("reference" if ref is not None and model is ref else "logprob", time.perf_counter() - t0)
        return res

    # ------------------------------------------------------------ timings
    # What the trainer profiles as spans sent to trackers only (TRL's and ms-swift's profiling_context), and its
    # own step_time, added to the phase timings of the step being trained (docs/hooks.md#phase-timings).
    _tm_prep = 0.0                     # seconds in _prepare_inputs during the training_step running now
    _tm_in_step = False                # inside a training_step (generation and scoring included; evaluation not)

    def _tm_time(self, name: str, seconds: float) -> None:
        """Add a timer reading (a TRL span name, TRL's ``step_time`` or one of our phases) to the phase timings
        of the step being trained (inside ``training_step`` only: the model may be in eval mode while it
        generates)."""
        if self.triage_hook is None or not self._tm_in_step:
            return
        self.triage_hook.runtime.add_timings(self.state.global_step, {name: max(seconds, 0.0)}, "trl")

    def _tm_timed(self, name: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its time added under ``name`` (:meth:`_tm_time`)."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._tm_time(name, time.perf_counter() - t0)

    def _prepare_inputs(self, *args, **kwargs):
        rewards = self._metrics["train"].get("reward", []) if self._tm_in_step else None
        before = len(rewards) if rewards is not None else 0
        t0 = time.perf_counter()
        try:
            out = super()._prepare_inputs(*args, **kwargs)
        finally:
            self._tm_prep += time.perf_counter() - t0
        self._tm_record_reward(before)
        return out

    # ------------------------------------------------------------- reward
    _tm_reward = None                  # (generation number, reward) of the newest generation batch
    _tm_generations = 0

    def _tm_record_reward(self, before: int) -> None:
        """The reward of the generation batch the micro-batch just prepared comes from, for the step being trained.

        The trainer scores each generation batch in ``_prepare_inputs`` (``_generate_and_score_completions``) and
        appends the batch's mean reward, over every process's completions, to ``_metrics["train"]["reward"]`` (TRL:
        ``grpo_trainer.py``, the weighted sum of the reward functions; ms-swift: ``_compute_advantages``); a batch
        buffered for several micro-batches or steps keeps its reward.  Each micro-batch of the step adds its batch's
        reward under the batch's number, so a step trained on two batches gets their mean (the runtime averages
        over keys).  Inside ``training_step`` only; never raises."""
        if self.triage_hook is None or not self._tm_in_step:
            return
        try:
            rewards = self._metrics["train"].get("reward", [])
            if len(rewards) > before:                  # a new generation batch was scored in this call
                self._tm_generations += 1
                self._tm_reward = (self._tm_generations, float(rewards[-1]))
            if self._tm_reward is not None:
                gen, value = self._tm_reward
                self.triage_hook.runtime.add_reward(self.state.global_step, value, key=gen)
        except Exception as exc:  # noqa: BLE001 — monitoring never stops training
            self.triage_hook.runtime._warn_once("trainer-reward", "triage-monitor: the step's reward not recorded "
                                                "(%s: %s)", type(exc).__name__, exc)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.triage_hook is None:
            return super().training_step(model, inputs, num_items_in_batch)
        times = self._metrics["train"].get("step_time", [])
        before = len(times)
        self._tm_prep = 0.0
        self._tm_in_step = True
        try:
            t0 = time.perf_counter()
            out = super().training_step(model, inputs, num_items_in_batch)
            # the loss forward and backward: the training_step outside _prepare_inputs (generation and scoring)
            self._tm_time("update", time.perf_counter() - t0 - self._tm_prep)
            times = self._metrics["train"].get("step_time", [])
            if len(times) > before:      # TRL closed its step_time of this optimizer step (every GA micro-steps)
                self._tm_time("step_time", float(times[-1]))
        finally:
            self._tm_in_step = False
        return out

    def _tm_run_captured(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (the framework's own loss) with the live log-probs of its forward captured:
        returns ``(result, live)``; the live tensors are never kept on the trainer."""
        self._tm_capture, self._tm_live = True, None
        try:
            out = fn(*args, **kwargs)
        finally:
            self._tm_capture = False
        live, self._tm_live = self._tm_live, None
        return out, live

    # ------------------------------------------------------------ logging
    def log(self, logs: dict, *args, **kwargs) -> None:
        """The trainer's ``log``, with the triage metrics of the step just completed added to ``logs``.

        The trainer logs after the optimizer step, so the monitored step that update closed is complete: it is
        logged now (one ``log_step``; every rank does so, as every rank runs ``log``), and
        ``hook.framework_metrics()`` joins ``logs``: ``HookSettings.framework_keys`` of that step as
        ``triage/<name>`` floats (NaN left out) and ``triage/metrics_step``.  Each monitored step joins one training
        log, the first after it; evaluation logs get none.  Monitoring never raises here.
        """
        if self.triage_hook is not None and self.model.training:
            logs.update(self._triage_log_metrics())
        return super().log(logs, *args, **kwargs)

    def _triage_log_metrics(self) -> dict[str, float]:
        rt = self.triage_hook.runtime
        try:
            rt.flush()
            out = rt.framework_metrics()
        except Exception as exc:          # monitoring never stops training
            rt._warn_once("trainer-log", "triage-monitor: logging the step for the trainer's log failed (%s: %s); "
                          "training continues", type(exc).__name__, exc)
            return {}
        step = out.get("triage/metrics_step")
        if step is None or step == self._tm_logged_step:
            return {}
        self._tm_logged_step = step
        return out

    # ------------------------------------------------------------ lifecycle
    def train(self, *args, **kwargs):
        if self.triage_hook is None:
            return super().train(*args, **kwargs)
        try:
            # the trainer draws a tqdm bar: an alert's log line goes above it, not into it
            with log_lines_above_progress_bars():
                return super().train(*args, **kwargs)
        finally:
            self.triage_hook.close()           # logs the last step, closes this process's monitor

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.triage_hook is not None:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            if os.path.isdir(folder):
                torch.save(self.triage_hook.state_dict(),
                           os.path.join(folder, STATE_FILE.format(rank=self.accelerator.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.triage_hook is not None and checkpoint is not None:
            path = os.path.join(checkpoint, STATE_FILE.format(rank=self.accelerator.process_index))
            if os.path.exists(path):
                self.triage_hook.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


__all__ = ["STATE_FILE", "TrainerHookMixin", "TrainerLossHook", "last_stats", "LastStats"]
