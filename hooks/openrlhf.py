"""OpenRLHF hook: the TRIAGE loss (or monitoring only) inside OpenRLHF's Ray policy actor.

Checked against OpenRLHF 0.11.2 (``openrlhf/cli/train_ppo_ray.py``, ``trainer/ray/ppo_actor.py``,
``models/loss.py``, ``utils/loss_utils.py``, ``trainer/ppo_utils/experience.py``, ``samples_generator.py``).
Usage and the exact command lines: docs/hooks.md#openrlhf.

**Where the loss runs.**  ``openrlhf.cli.train_ppo_ray`` starts the Ray actor class ``PolicyModelActor``
(hard-coded there); its ``init_model_from_pretrained`` builds an ``ActorPPOTrainer`` whose ``actor_loss_fn``
(an ``openrlhf.models.loss.PolicyLoss``) is called once per micro-batch by ``ActorPPOTrainer.training_step``::

    actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(
        action_log_probs, old_action_log_probs, advantages, action_mask=..., rollout_log_probs=...,
        dp_size=..., batch_num_tokens=..., global_batch_size=...)

:func:`policy_actor_class` makes a ``PolicyModelActor`` subclass that, inside each Ray actor, replaces
``trainer.actor_loss_fn`` by an :class:`OpenRLHFTriageLoss` built there from the picklable
:class:`~triage_monitor.hooks.worker_runtime.HookSettings` (a class attribute, shipped with the class by Ray), and
:func:`run_cli` / ``python -m triage_monitor.hooks.openrlhf`` run OpenRLHF's own CLI (its argument parser and
``train``) with that subclass in place of ``PolicyModelActor``.  No OpenRLHF file is changed.

**Tensors** ``(B, A)``, A = T − 1: every row is one sample's prompt + response shifted by one
(``sequences[1:]``), **right**-padded to the batch's longest row (``zero_pad_sequences(..., "right")``).
Prompt, tool-output and padding columns have ``action_mask`` 0 and rollout log-prob 0.0; positions count from
each row's first action column (tool tokens inside the response keep counting).  ``rollout_log_probs`` exist
only with ``--algo.advantage.is_correction_level token|seq`` (the CLI then asks vLLM for
``processed_logprobs``); otherwise they are None and the hook refuses to start.

**Loss.**  :func:`~triage_monitor.triage.loss.triage_policy_loss` with OpenRLHF's own conventions, read from the
trainer's ``PolicyLoss``: clip ``[1 − clip_eps_low, 1 + clip_eps_high]``, ``dual_clip``, ``aggregate_loss``
(``--actor.loss_agg_mode token-mean`` → ``token_mean`` over ``batch_num_tokens``, ``seq-mean-token-mean`` →
``seq_mean_token_mean`` over ``global_batch_size``, both × ``dp_size``; plain masked means when those are None)
and OpenRLHF's train/rollout IS correction (:func:`is_correction_coef`) as a per-token loss factor.  With Gate,
TIS and Repair off the loss equals ``PolicyLoss`` on the same tensors.  OpenRLHF's own returned metrics
(``ppo_clip_ratio``, ``ppo_kl``, ``vllm_kl``, ``is_filter_ratio``) are computed by OpenRLHF's ``PolicyLoss``
itself on the same tensors and keep their meaning; the controller's statistics are added to the actor's
``fit`` status as ``triage/<name>`` (mean over the step's loss calls and the data-parallel ranks), and so are
the monitor's values of the fit's last optimizer step (``HookSettings.framework_keys``, default the curated
set, with ``triage/metrics_step``; rank 0's, handed to every actor), which OpenRLHF logs as ``train/triage/*``.

**Step.**  ``training_step``'s ``step`` argument is the micro-batch index within one PPO epoch and the actor's
``fit`` gets no global step, so the monitored step is the number of optimizer steps this actor has taken
(DeepSpeed steps the torch optimizer once per ``accumulated_gradient`` micro-batches; the hook runtime counts
those steps).  The step counters and the controller's calibration are stored in OpenRLHF's checkpoint
(``client_states["triage"]``) and restored on resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any, Optional, Sequence, TypedDict

import torch

from triage_monitor.batch import TokenBatch

from .micro_batches import leading_positions
from .option_strings import check_normalization
from .worker_runtime import HookSettings, LossHook

log = logging.getLogger("triage_monitor")

#: OpenRLHF releases this hook was run against (docs/hooks.md#openrlhf).
TESTED_VERSIONS = ("0.11.2",)

#: The OpenRLHF flags that make its IS correction a no-op (coefficient 1 on every token) while keeping the
#: rollout log-probs: needed when TRIAGE's own TIS is on.
IDENTITY_CORRECTION_FLAGS = ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip "
                             "--algo.advantage.is_correction_threshold 1 1")


def batch_from_openrlhf(log_probs, rollout_log_probs, advantages, action_mask, on_invalid: str = "raise",
                        sample_ids=None, group_ids=None) -> TokenBatch:
    """TokenBatch from OpenRLHF ``(B, A)`` tensors (learner ``log_probs``, vLLM ``rollout_log_probs``, nats).

    Positions count from each row's first ``action_mask`` column (module docstring).

    Raises:
        ValueError: ``rollout_log_probs`` is None (OpenRLHF keeps vLLM log-probs only with
            ``--algo.advantage.is_correction_level token|seq``); invalid tokens (``on_invalid="raise"``).
    """
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is None: OpenRLHF keeps the vLLM log-probs only with "
                         "--algo.advantage.is_correction_level token|seq (docs/hooks.md#openrlhf)")
    return TokenBatch.from_padded(log_probs, rollout_log_probs, advantages, action_mask,
                                  positions=leading_positions(action_mask), sample_ids=sample_ids,
                                  group_ids=group_ids, on_invalid=on_invalid)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1e-8)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1e-8)


def is_correction_coef(policy_loss, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       action_mask: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's train/rollout IS-correction coefficient per token, ``(B, A)`` float, detached.

    The factor ``PolicyLoss.forward`` (OpenRLHF 0.11.2) multiplies the per-token PPO loss with, from its
    ``is_correction_level`` (``token`` | ``seq``), ``is_correction_mode`` (``mask``: out-of-band units 0, the
    others keep their IS ratio ``exp(old − rollout)``; ``clip``: the token ratio clamped into the band),
    ``is_correction_gating`` (``ratio``, ``binary_kl``, ``tv``) and ``is_correction_threshold`` (low, high).
    The equality with ``PolicyLoss`` is tested on OpenRLHF's own function (tests/test_hooks_openrlhf.py).

    Raises:
        ValueError: ``is_correction_level`` is ``off`` (no coefficient: OpenRLHF then keeps no rollout log-probs).
    """
    level = policy_loss.is_correction_level
    if level == "off":
        raise ValueError("is_correction_coef: is_correction_level is 'off'")
    low, high = policy_loss.is_correction_threshold
    mask = action_mask
    with torch.no_grad():
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()
        if policy_loss.is_correction_gating == "ratio":
            stat = _masked_mean(is_log_ratio, mask, dim=-1).unsqueeze(-1) if level == "seq" else is_log_ratio
            stat = stat.exp()
        else:
            p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            if policy_loss.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
            if level == "seq":
                stat = _masked_mean(stat, mask, dim=-1).unsqueeze(-1)
        if policy_loss.is_correction_mode == "clip":
            coef = stat.clamp(min=low, max=high)
        else:
            coef = torch.where((stat >= low) & (stat <= high), token_is, 0.0)
        return coef.expand_as(old_log_probs)


def _is_identity_correction(pl) -> bool:
    return (pl.is_correction_level == "token" and pl.is_correction_mode == "clip"
            and pl.is_correction_gating == "ratio" and tuple(pl.is_correction_threshold) == (1.0, 1.0))


class OpenRLHFTriageLoss(LossHook):
    """Replacement of ``ActorPPOTrainer.actor_loss_fn``: the TRIAGE loss with OpenRLHF's conventions.

    Built inside the policy actor from picklable :class:`HookSettings` and the trainer's own ``PolicyLoss``
    (whose settings it follows and which it calls for OpenRLHF's own metrics); carries no live object, so it
    survives a cloudpickle round trip.  ``settings.triage`` None = monitoring only (Gate, TIS, Repair off: the
    loss is OpenRLHF's).

    Args:
        settings: the hook's :class:`HookSettings`.
        policy_loss: the trainer's ``openrlhf.models.loss.PolicyLoss`` (``trainer.actor_loss_fn``).

    Raises:
        ValueError: ``policy_loss_type='gspo'`` (a sequence-level ratio; the controller weights tokens);
            ``is_correction_level='off'`` (no rollout log-probs); TRIAGE's TIS on together with an OpenRLHF IS
            correction that is not the identity (both would weight the same ratio);
            ``TriageConfig.normalization="global_token"`` (OpenRLHF's normaliser: the weights are renormalised per
            response).
        TypeError: ``policy_loss`` is not an OpenRLHF ``PolicyLoss``.
    """

    def __init__(self, settings: HookSettings, policy_loss):
        missing = [a for a in ("clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
                               "is_correction_level", "is_correction_mode", "is_correction_gating",
                               "is_correction_threshold") if not hasattr(policy_loss, a)]
        if missing:
            raise TypeError(f"OpenRLHFTriageLoss: policy_loss must be OpenRLHF's PolicyLoss (trainer.actor_loss_fn); "
                            f"{type(policy_loss).__name__} lacks {missing}")
        if policy_loss.policy_loss_type != "ppo":
            raise ValueError(f"OpenRLHFTriageLoss: --actor.policy_loss_type {policy_loss.policy_loss_type!r} is not "
                             "supported (GSPO's ratio is per sequence; the TRIAGE controller weights tokens): use ppo")
        if policy_loss.is_correction_level == "off":
            raise ValueError("OpenRLHFTriageLoss: --algo.advantage.is_correction_level is 'off', so OpenRLHF keeps no "
                             "rollout (vLLM) log-probs and nothing can be monitored. Set it to token or seq; with "
                             f"TRIAGE's TIS on, make OpenRLHF's correction a no-op: {IDENTITY_CORRECTION_FLAGS}")
        if settings.triage is not None and settings.triage.tis and not _is_identity_correction(policy_loss):
            raise ValueError(
                "OpenRLHFTriageLoss: TRIAGE's TIS and OpenRLHF's IS correction (is_correction_level="
                f"{policy_loss.is_correction_level}, mode={policy_loss.is_correction_mode}, threshold="
                f"{list(policy_loss.is_correction_threshold)}) would both weight the loss by the train/rollout ratio. "
                f"Either TriageConfig(tis=False) (OpenRLHF's correction stays), or make OpenRLHF's a no-op: "
                f"{IDENTITY_CORRECTION_FLAGS}")
        check_normalization(settings.triage, "OpenRLHFTriageLoss", "OpenRLHF divides the loss by the optimizer "
                            "step's token or sample count")
        self.settings = settings
        self.policy_loss = policy_loss
        self.agg_mode = "token_mean" if policy_loss.token_level_loss else "seq_mean_token_mean"

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
                 dp_size: int = 1, batch_num_tokens=None, global_batch_size=None):
        """``PolicyLoss.forward``'s signature and 5-tuple: ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``.

        Args: ``(B, A)`` learner ``log_probs`` (live), ``old_log_probs``, ``advantages``, ``action_mask``,
        ``rollout_log_probs`` (nats); ``dp_size``, ``batch_num_tokens``, ``global_batch_size`` from OpenRLHF's
        loss-batch info.  The last four values are OpenRLHF's own, from its ``PolicyLoss`` on the same tensors.

        Raises:
            ValueError: ``rollout_log_probs`` or ``action_mask`` is None; invalid tokens.
        """
        if action_mask is None:
            raise ValueError("OpenRLHFTriageLoss: action_mask is None (OpenRLHF's training_step always passes it)")
        pl = self.policy_loss
        batch = batch_from_openrlhf(log_probs, rollout_log_probs, advantages, action_mask,
                                    on_invalid=self.settings.on_invalid)
        with torch.no_grad():
            _, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = pl(
                log_probs.detach(), old_log_probs, advantages, action_mask=action_mask,
                rollout_log_probs=rollout_log_probs, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size)
        coef = is_correction_coef(pl, old_log_probs, rollout_log_probs, action_mask)
        denominator = batch_num_tokens if self.agg_mode == "token_mean" else global_batch_size
        res = self.compute_loss(batch, old_logp=batch.gather(old_log_probs), clip_low=pl.clip_eps_low,
                                clip_high=pl.clip_eps_high, dual_clip=pl.dual_clip, agg_mode=self.agg_mode,
                                denominator=denominator, loss_scale=float(dp_size) if denominator is not None else 1.0,
                                token_scale=batch.gather(coef))
        if self.runtime.controller is not None:
            self._stats().append({k: float(v) for k, v in res.output.stats.items()
                                  if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1)})
        return res.loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    def _stats(self) -> list[dict[str, float]]:
        if not hasattr(self, "_live_stats"):
            self._live_stats: list[dict[str, float]] = []
        return self._live_stats

    def pop_stats(self) -> dict[str, float]:
        """Mean of the controller's statistics over the loss calls since the last call (``{}`` when none)."""
        calls, self._live_stats = self._stats(), []
        keys = sorted({k for c in calls for k in c})
        return {k: sum(c[k] for c in calls if k in c) / sum(1 for c in calls if k in c) for k in keys}


def install(trainer, settings: HookSettings) -> OpenRLHFTriageLoss:
    """Replace ``trainer.actor_loss_fn`` (an ``ActorPPOTrainer``'s ``PolicyLoss``) by the TRIAGE loss; returns it.

    Raises:
        ValueError / TypeError: as :class:`OpenRLHFTriageLoss` (unsupported OpenRLHF options).
    """
    current = trainer.actor_loss_fn
    if isinstance(current, OpenRLHFTriageLoss):
        return current
    loss = OpenRLHFTriageLoss(settings, current)
    trainer.actor_loss_fn = loss
    return loss


class TriagePolicyActorMixin:
    """What :func:`policy_actor_class` adds to OpenRLHF's ``PolicyModelActor`` (usable with your own subclass).

    ``triage_settings`` (class attribute): the :class:`HookSettings`.  ``init_model_from_pretrained`` installs
    :class:`OpenRLHFTriageLoss` on ``self.trainer`` (and restores its state from OpenRLHF's checkpoint);
    ``fit`` adds to the status OpenRLHF logs the controller's ``triage/<stat>`` (mean over the fit's loss calls
    and the DP ranks) and the monitor's values of the fit's last step (:meth:`triage_framework_metrics`; a name
    in both takes the monitor's); ``save_checkpoint`` stores the hook's state in ``client_states["triage"]``;
    ``save_model`` (called once, at the end of ``train``) closes the monitor.
    """

    triage_settings: Optional[HookSettings] = None

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        super().init_model_from_pretrained(strategy, *args, **kwargs)
        self._install_triage()

    def _install_triage(self) -> None:
        """Install the loss hook on ``self.trainer``; restore its state from ``self.checkpoint_states``."""
        if self.triage_settings is None:
            raise ValueError("TriagePolicyActorMixin: triage_settings is None (build the class with "
                             "policy_actor_class(settings))")
        self.triage_loss = install(self.trainer, self.triage_settings)
        state = (getattr(self, "checkpoint_states", None) or {}).get("triage")
        if state is not None:
            self.triage_loss.load_state_dict(state)

    def fit(self, kl_ctl: float = 0):
        import torch.distributed as dist

        status = super().fit(kl_ctl)
        dist_on = dist.is_available() and dist.is_initialized()
        stats = self.triage_loss.pop_stats()
        if stats:
            if dist_on:
                stats = self.strategy.all_reduce(stats)          # OpenRLHF's own mean over the DP ranks
            status.update({f"triage/{k}": float(v) for k, v in stats.items()})
        status.update(self.triage_framework_metrics(dist_on))
        return status

    def triage_framework_metrics(self, dist_on: bool) -> dict[str, float]:
        """The monitor's values of the fit's last optimizer step (the current step: the fit has just closed it),
        the ``framework_keys`` selection as ``triage/<name>`` with ``triage/metrics_step``, taken from rank 0 —
        whose monitor judged the all-reduced metrics and holds the alert state — and handed to every rank, so the
        status OpenRLHF merges from its actors carries rank 0's values whichever actor's status it keeps."""
        out = self.triage_loss.runtime.framework_metrics()
        if dist_on:
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                box = [out]
                dist.broadcast_object_list(box, src=0)
                out = box[0]
        return out

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        client_states = dict(client_states or {})
        client_states["triage"] = self.triage_loss.state_dict()
        return super().save_checkpoint(tag, client_states, metric_value=metric_value, metric_key=metric_key)

    def save_model(self):
        out = super().save_model()
        self.triage_loss.close()
        return out


class TriageTimingsMixin:
    """What the hook adds to OpenRLHF's driver-side trainer (``PPOTrainer``, or the ``TrainingActor`` of the async
    trainer): ``save_logs_and_checkpoints(global_step, logs_dict)`` — called once per OpenRLHF step with the status
    that holds the step's ``timing/*`` (``generation``, ``make_experience``, ``ppo_train``, ``broadcast``,
    ``step_total``; ``trainer/ppo_trainer.py`` ``train_step`` / ``fit``) and the step's reward
    (``rollout/reward_mean``, :data:`REWARD_KEY`) — first hands those timers and the reward to a
    :class:`~triage_monitor.rundir.timings_writer.TimingsWriter` of the run, at the monitored step the status names
    (``triage/metrics_step``: the last optimizer step of the step's fit, whose row the actors wrote before the
    driver's timers closed), then calls OpenRLHF's own.  Never raises into the trainer."""

    triage_settings: Optional[HookSettings] = None

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None):
        record_status_timings(self, global_step, logs_dict)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


#: The step's reward in an OpenRLHF status: ``rollout/reward_mean``, the mean of every experience's
#: ``info["reward"]`` (one per sample, the reward model's or reward function's score), computed by
#: ``BasePPOTrainer._compute_rollout_stats`` in ``train_step`` before the PPO update (``trainer/ppo_trainer.py``).
REWARD_KEY = "rollout/reward_mean"


def record_status_timings(trainer, global_step: int, logs_dict) -> Optional[int]:
    """Record the ``timing/*`` and the reward (:data:`REWARD_KEY`) of an OpenRLHF status in the run's timings table
    (``trainer.triage_settings.run_dir``) at the status's ``triage/metrics_step`` (else the run's newest step);
    returns the monitored step written, or None.  The writer is kept on ``trainer``.  Never raises."""
    try:
        settings = trainer.triage_settings
        if settings is None or settings.run_dir is None or not logs_dict:
            return None
        writer = getattr(trainer, "_triage_timings", None)
        if writer is None:
            from triage_monitor.rundir.timings_writer import TimingsWriter

            writer = trainer._triage_timings = TimingsWriter(settings.run_dir, framework="openrlhf")
        step = logs_dict.get("triage/metrics_step")
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else None
        return writer.record(logs_dict, step=step, framework_step=int(global_step),
                             reward=logs_dict.get(REWARD_KEY))
    except Exception as exc:  # noqa: BLE001 — monitoring never stops the training job
        log.warning("triage-monitor: OpenRLHF step %s's phase timings not recorded (%s: %s)", global_step,
                    type(exc).__name__, exc)
        return None


def _timed(base, settings: HookSettings, name: str):
    """``base`` (a plain class, not the Ray-decorated one) with :class:`TriageTimingsMixin` and ``settings``."""
    return type(name, (TriageTimingsMixin, base), {"triage_settings": settings, "__module__": __name__,
                                                   "__doc__": f"OpenRLHF's {base.__name__} recording its phase "
                                                              "timings (docs/hooks.md#phase-timings)."})


class TrainerClasses(TypedDict):
    """:func:`trainer_classes`: the Ray actor classes :func:`run_cli` puts in place of OpenRLHF's two trainers."""

    PPOTrainer: Any
    PPOTrainerAsync: Any


def trainer_classes(settings: HookSettings) -> TrainerClasses:
    """Ray actor classes for the two places :func:`run_cli` puts them: ``{"PPOTrainer": ..., "PPOTrainerAsync":
    ...}`` — OpenRLHF's synchronous trainer with :class:`TriageTimingsMixin`, and its asynchronous trainer, whose
    ``__init__`` (in its own process) makes its ``TrainingActor`` the same (that class is looked up there)."""
    import ray
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async

    def plain(cls):
        return getattr(cls, "__ray_actor_class__", cls)

    sync = _timed(plain(ppo_trainer.PPOTrainer), settings, "TriagePPOTrainer")
    training_actor = plain(ppo_trainer_async.TrainingActor)
    async_base = plain(ppo_trainer_async.PPOTrainerAsync)

    def __init__(self, *args, **kwargs):
        from openrlhf.trainer import ppo_trainer_async as module

        module.TrainingActor = ray.remote(_timed(training_actor, settings, "TriageTrainingActor"))
        async_base.__init__(self, *args, **kwargs)

    asynchronous = type("TriagePPOTrainerAsync", (async_base,), {"__init__": __init__, "__module__": __name__})
    return TrainerClasses(PPOTrainer=ray.remote(sync), PPOTrainerAsync=ray.remote(asynchronous))


def policy_actor_class(settings: HookSettings, num_gpus: float = 1):
    """A Ray actor class: OpenRLHF's ``PolicyModelActor`` with :class:`TriagePolicyActorMixin` and ``settings``.

    Pass it wherever OpenRLHF takes the policy actor class (``RayActorGroup(..., ray_actor_type, ...)``), or use
    :func:`run_cli`.  The class (with its settings) is pickled into the actors by Ray.

    Raises:
        ImportError: OpenRLHF (and the GPU stack its ``ppo_actor`` module imports) is not installed.
    """
    import ray
    from openrlhf.trainer.ray import ppo_actor

    base = ppo_actor.PolicyModelActor
    base = getattr(base, "__ray_actor_class__", base)        # the plain class behind @ray.remote
    cls = type("TriagePolicyModelActor", (TriagePolicyActorMixin, base),
               {"triage_settings": settings, "__module__": __name__,
                "__doc__": "OpenRLHF's PolicyModelActor with the triage-monitor loss hook (docs/hooks.md#openrlhf)."})
    return ray.remote(num_gpus=num_gpus)(cls)


def run_cli(settings: HookSettings, argv: Optional[Sequence[str]] = None) -> None:
    """Run OpenRLHF's ``openrlhf.cli.train_ppo_ray`` (its own parser, checks and ``train``) with the policy actor
    class of :func:`policy_actor_class` in place of ``PolicyModelActor`` and the trainers of
    :func:`trainer_classes` in place of ``PPOTrainer`` / ``PPOTrainerAsync``; ``argv``: OpenRLHF's arguments.

    The substitutions are the module attributes ``openrlhf.trainer.ray.ppo_actor.PolicyModelActor``,
    ``openrlhf.trainer.ppo_trainer.PPOTrainer`` and ``openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync`` for the
    duration of the call (the CLI imports the classes from there when it runs); they are restored afterwards.
    """
    import runpy

    from openrlhf.trainer import ppo_trainer, ppo_trainer_async
    from openrlhf.trainer.ray import ppo_actor

    originals = [(ppo_actor, "PolicyModelActor", ppo_actor.PolicyModelActor),
                 (ppo_trainer, "PPOTrainer", ppo_trainer.PPOTrainer),
                 (ppo_trainer_async, "PPOTrainerAsync", ppo_trainer_async.PPOTrainerAsync)]
    saved_argv = sys.argv
    ppo_actor.PolicyModelActor = policy_actor_class(settings)
    trainers = trainer_classes(settings)
    ppo_trainer.PPOTrainer, ppo_trainer_async.PPOTrainerAsync = trainers["PPOTrainer"], trainers["PPOTrainerAsync"]
    sys.argv = ["openrlhf.cli.train_ppo_ray", *(sys.argv[1:] if argv is None else argv)]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    finally:
        for module, name, cls in originals:
            setattr(module, name, cls)
        sys.argv = saved_argv


def parse_triage_args(argv: Sequence[str]):
    """Split ``argv`` into this hook's ``--triage.*`` options and OpenRLHF's arguments: ``(HookSettings, rest)``.

    ``--triage.run_dir DIR`` (required), ``--triage.config FILE`` (JSON object of ``TriageConfig`` fields;
    default: the published TRIAGE configuration), ``--triage.monitor_only`` (no controller: OpenRLHF's loss),
    ``--triage.manifest FILE`` (JSON facts stored in ``run.json``), ``--triage.alerts`` (``default``: the shipped
    rules; ``off``; or a rule file, read now), ``--triage.loggers`` (a JSON list of tracker specs or
    comma-separated kinds, built by rank 0's monitor), ``--triage.framework_keys`` (what goes into OpenRLHF's
    status: ``curated`` (default), ``all`` or metric names, comma-separated or a JSON list).

    Raises:
        SystemExit: (argparse) a missing ``--triage.run_dir`` or a bad value, the message naming the flag.
    """
    from .option_strings import parse_alerts, parse_framework_keys, parse_loggers

    p = argparse.ArgumentParser(prog="python -m triage_monitor.hooks.openrlhf", add_help=False)
    p.add_argument("--triage.run_dir", dest="run_dir", required=True)
    p.add_argument("--triage.config", dest="config", default=None)
    p.add_argument("--triage.monitor_only", dest="monitor_only", action="store_true")
    p.add_argument("--triage.manifest", dest="manifest", default=None)
    p.add_argument("--triage.alerts", dest="alerts", default="default")
    p.add_argument("--triage.loggers", dest="loggers", default="")
    p.add_argument("--triage.framework_keys", dest="framework_keys", default="curated")
    ns, rest = p.parse_known_args(list(argv))
    if ns.monitor_only and ns.config:
        p.error("--triage.monitor_only and --triage.config exclude each other")
    try:
        alerts = parse_alerts(ns.alerts, "--triage.alerts")
        loggers = parse_loggers(ns.loggers, "--triage.loggers")
        keys = parse_framework_keys(ns.framework_keys, "--triage.framework_keys")
    except ValueError as exc:
        p.error(str(exc))
    from triage_monitor.triage.controller import TriageConfig

    triage = None if ns.monitor_only else TriageConfig(**(json.loads(open(ns.config).read()) if ns.config else {}))
    try:
        check_normalization(triage, f"--triage.config {ns.config}", "OpenRLHF divides the loss by the optimizer "
                            "step's token or sample count")
    except ValueError as exc:
        p.error(str(exc))
    manifest = {"framework": "openrlhf"}
    if ns.manifest:
        manifest.update(json.loads(open(ns.manifest).read()))
    return HookSettings(run_dir=ns.run_dir, triage=triage, manifest=manifest, alerts=alerts, loggers=loggers,
                        framework_keys=keys), rest


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m triage_monitor.hooks.openrlhf --triage.run_dir DIR [--triage.*] <train_ppo_ray arguments>``."""
    settings, rest = parse_triage_args(sys.argv[1:] if argv is None else argv)
    run_cli(settings, rest)


if __name__ == "__main__":
    from triage_monitor.hooks.openrlhf import main as _main   # the importable module, so Ray pickles by reference

    _main()


__all__ = ["batch_from_openrlhf", "is_correction_coef", "OpenRLHFTriageLoss", "install", "TriagePolicyActorMixin",
           "TriageTimingsMixin", "record_status_timings", "trainer_classes", "TrainerClasses", "policy_actor_class", "run_cli", "parse_triage_args", "main", "TESTED_VERSIONS",
           "IDENTITY_CORRECTION_FLAGS"]
