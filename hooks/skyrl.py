"""SkyRL hook: the TRIAGE loss (and the monitor) as a policy loss of SkyRL's ``PolicyLossRegistry``.

Checked against skyrl 0.3.0 and 0.4.0 (PyPI; the oldest and the newest release), ``skyrl/backends/skyrl_train``:

* **Call site** (``workers/worker.py`` ``PolicyWorkerBase._forward_backward_micro``, and the Megatron
  wrapper's ``loss_func``): ``policy_loss, loss_metrics = fn(action_log_probs, old_action_log_probs,
  advantages, config=cfg.trainer.algorithm, loss_mask=loss_mask, rollout_logprobs=rollout_logprobs)``, once per
  micro-batch, inside a Ray worker.  The worker multiplies the loss by the DP size, adds its own KL / entropy
  terms, logs every metric as ``loss_metrics/<name>`` (then ``policy/...``), and steps a ``torch.optim``
  optimizer once per mini-batch (``optim_step``).
* **Layout**: ``(B, T)`` response tensors are *right-aligned* (``dataset/preprocess.py``: sequences are
  left-padded, a response occupies the last ``len_i`` columns, the leading columns are padding with mask 0);
  positions therefore count from each row's first loss-mask column (:func:`batch_from_skyrl`).
  ``rollout_logprobs`` is present when the generator returns log-probs (``generator.sampling_params.logprobs``,
  default 1).
* **Scale**: the trainer has already divided the advantages by the reduction's normaliser
  (``ppo_utils.apply_loss_reduction_to_advantages_minibatch``: ``token_mean``, ``token_mean_legacy``,
  ``sequence_mean``, ``seq_mean_token_sum_norm``, ``prompt_mean``) and every SkyRL policy loss returns the
  **masked sum** ``Σ loss · loss_mask`` (``reduce_loss``); the micro-batch sums add up to the mini-batch loss.
  This hook does the same (``agg_mode="token_sum"``, normaliser 1): one rule exact under all five modes.
  Any other ``loss_reduction`` raises.
* **Registry and workers**: ``PolicyLossRegistry.register`` keeps the object; ``sync_registries()`` (run by
  ``initialize_ray``) cloudpickles it into a named Ray actor, and each worker's ``PolicyLossRegistry.get``
  unpickles its own copy.  :class:`SkyRLTriageLoss` therefore carries configuration only
  (:class:`~triage_monitor.hooks.worker_runtime.HookSettings`); each worker process builds its own monitor and
  controller (``hooks/worker_runtime.py``).
* **Step**: SkyRL's ``global_step``.  The loss call carries tensors only, but the batch the worker trains on
  carries SkyRL's metadata (``global_step``, written by the trainer; the mini-batch boundaries): the hook reads it
  from the worker's frame above the call (:func:`skyrl_call_site`, read-only).  Every loss call of one SkyRL step
  — all its micro-batches, mini-batches and epochs — is ONE monitored step, logged at the optimizer step that ends
  it (mini-batches × ``update_epochs_per_batch`` optimizer steps, from the metadata and the worker's config, else
  ``trainer=``), else when the next SkyRL step begins.  Without the metadata (or ``step_source="optimizer"``)
  the worker's optimizer steps are counted instead, as before.
* **What reaches SkyRL's tracker**: besides SkyRL's own loss metrics, each loss call returns the monitor's values
  of a completed step (:func:`~triage_monitor.hooks.option_strings.dp_framework_metrics`: ``framework_keys``, default
  the curated set, and ``triage/metrics_step``).  SkyRL averages loss metrics over the micro-batches of a
  mini-batch and over the DP ranks (``reduce_metrics`` / ``all_reduce_metrics``, one collective per key: every
  rank hands over the same keys), then over the mini-batches and epochs of its step.  So that this mean is one
  monitored step's value, every call of one SkyRL step reports the same step: the previous SkyRL step.  (Counting
  optimizer steps, the same holds when the hook knows how many optimizer steps a SkyRL step has, ``trainer=``:
  ``train_batch_size // policy_mini_batch_size × update_epochs_per_batch``; without it each mini-batch reports
  the step before it.)  Names ending in ``_loss`` are left out (SkyRL sums those).
* **SkyRL's own metrics**: the trainer's ``policy/rollout_train_logprobs_abs_diff_*`` and the worker's
  ``minibatch_rollout_logprobs_abs_diff_*`` are computed outside the loss and stay as they are; the loss's own
  metrics (``clip_ratio`` and, with ``off_policy_correction`` enabled, ``is_ratio_*``, ``tis_*``,
  ``*_mask_*``) are computed by SkyRL's own ``ppo_policy_loss`` on the same tensors and returned under the
  same names.  SkyRL's off-policy correction (TIS ratio, sequence / outlier / token masks) is applied as
  SkyRL applies it; ours are under ``triage/``.

See docs/hooks.md#skyrl for the lines a user copies.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from triage_monitor.batch import TokenBatch

from .micro_batches import leading_positions
from .option_strings import check_alerts, check_framework_keys, check_loggers, check_normalization, dp_framework_metrics
from .worker_runtime import HookSettings, LossHook, in_ray_worker

#: SkyRL's loss reductions (``train/utils/utils.py`` ``validate_cfg``; the same in 0.3.0 and 0.4.0); all are
#: advantage pre-scalings followed by the masked sum this hook computes.
SKYRL_LOSS_REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm",
                         "prompt_mean")
#: SkyRL's PPO policy losses this hook reproduces (``ppo_utils.ppo_policy_loss``): plain clip, or dual clip
#: with ``clip_ratio_c``.
SKYRL_BASE_LOSSES = ("regular", "dual_clip")


def batch_from_skyrl(log_probs, rollout_logprobs, advantages, loss_mask, on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from SkyRL's right-aligned ``(B, T)`` response tensors (learner vs generator log-probs).

    Args:
        log_probs: ``(B, T)`` float learner log-probs (nats), may carry grad.
        rollout_logprobs: ``(B, T)`` float generator log-probs (nats); SkyRL pads with 0.0.
        advantages: ``(B, T)`` float, as SkyRL hands them to the loss (already divided by the reduction's
            normaliser: only their sign and relative size within a response are meaningful to the monitor).
        loss_mask: ``(B, T)`` 0/1; response tokens occupy the last columns of each row (left padding).
        on_invalid: ``"raise"`` or ``"quarantine"`` (:meth:`TokenBatch.from_padded`).

    Positions count from each row's first loss-mask column (tool-output tokens inside a response keep
    counting); a response whose first tokens are masked out starts at its first masked-in token.

    Raises:
        ValueError: ``rollout_logprobs`` is None (the generator returns no log-probs), shapes disagree, or
            invalid values (``InvalidTokenError``) with ``on_invalid="raise"``.
    """
    if rollout_logprobs is None:
        raise ValueError("SkyRL passed rollout_logprobs=None: the generator returns no log-probs. Set "
                         "generator.sampling_params.logprobs=1 (SkyRL's default) so the mismatch can be measured")
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask > 0
    return TokenBatch.from_padded(log_probs, rollout_logprobs, advantages, mask,
                                  positions=leading_positions(mask), on_invalid=on_invalid)


def optimizer_steps_per_step(trainer) -> int:
    """Optimizer steps of the policy in one SkyRL training step, from SkyRL's ``cfg.trainer``:
    ``train_batch_size // policy_mini_batch_size`` mini-batches (SkyRL's ``compute_prompt_mini_batch_boundaries``
    makes exactly that many) × ``update_epochs_per_batch``.

    Raises:
        ValueError: a size that is not a positive integer, or a mini-batch larger than the batch.
    """
    sizes = {k: getattr(trainer, k, None) for k in ("train_batch_size", "policy_mini_batch_size",
                                                    "update_epochs_per_batch")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"register(trainer=...): SkyRL trainer config needs positive integer {sorted(bad)}, got {bad}")
    n = sizes["train_batch_size"] // sizes["policy_mini_batch_size"]
    if n < 1:
        raise ValueError(f"register(trainer=...): trainer.policy_mini_batch_size={sizes['policy_mini_batch_size']} "
                         f"exceeds trainer.train_batch_size={sizes['train_batch_size']}")
    return n * sizes["update_epochs_per_batch"]


#: per process and hook (``settings.key``): (block of SkyRL steps, the framework metrics frozen for it); SkyRL may
#: unpickle a fresh copy of the loss for a call, so this lives beside the runtime, not in the object
_REPORTS: dict = {}
_REPORTS_LOCK = threading.Lock()

#: Frames above the loss call searched for the SkyRL batch being trained (:func:`skyrl_call_site`).
CALL_SITE_DEPTH = 32
#: Local names under which SkyRL's workers hold that batch: ``_forward_backward_micro(self, experience, ...)``
#: (FSDP), ``forward_backward(self, data, ...)`` (both backends).
CALL_SITE_NAMES = ("experience", "data")


class CallSite(NamedTuple):
    """:func:`skyrl_call_site`: SkyRL's ``global_step`` and the optimizer steps of that step (None: not found)."""

    step: Optional[int]
    optimizer_steps: Optional[int]


def skyrl_call_site(frame=None, depth: int = CALL_SITE_DEPTH) -> CallSite:
    """:class:`CallSite` ``(global_step, optimizer steps of that SkyRL step)`` of the SkyRL batch the calling worker
    is training on; ``(None, None)`` when none is found.

    SkyRL's trainer writes ``data.metadata["global_step"]`` (``RayPPOTrainer.train_critic_and_policy``) and
    ``["policy_mini_batch_boundaries"]`` (``convert_to_training_input``) on the step's batch; ``TensorBatch``'s
    slices and chunks keep the metadata on their way to the workers, and ``batch_to_experience`` hands it on as
    ``Experience.metadata`` — but the policy loss is called with tensors only.  So the hook reads it, without
    changing anything of SkyRL's, from the frames above the loss call: the first local ``experience`` or ``data``
    whose ``metadata`` holds an integer ``global_step``.  The optimizer steps of the step are its mini-batches
    (``len(policy_mini_batch_boundaries)``) × the worker's ``cfg.update_epochs_per_batch`` (the frame's
    ``self``), or None when either is missing.
    """
    f = sys._getframe(1) if frame is None else frame
    for _ in range(depth):
        if f is None:
            break
        loc = f.f_locals
        for name in CALL_SITE_NAMES:
            meta = getattr(loc.get(name), "metadata", None)
            step = meta.get("global_step") if isinstance(meta, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                continue
            bounds = meta.get("policy_mini_batch_boundaries")
            epochs = getattr(getattr(loc.get("self"), "cfg", None), "update_epochs_per_batch", None)
            n = (len(bounds) * epochs if isinstance(bounds, (list, tuple)) and bounds and isinstance(epochs, int)
                 and not isinstance(epochs, bool) and epochs > 0 else None)
            return CallSite(int(step), n)
        f = f.f_back
    return CallSite(None, None)


class _StepClock:
    """Per process and hook: the SkyRL step the worker is training and the optimizer steps it has taken in it.

    Every loss call of one SkyRL step is one monitored step (the runtime merges them); it is logged at the
    optimizer step that ends the SkyRL step when their number is known (the batch's mini-batches × epochs, or
    ``trainer=``), else when the next SkyRL step's first call arrives, or when the hook closes.  Inside a Ray
    worker that last optimizer step also waits until the step is on disk: Ray ends its workers without ``atexit``.
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self.current: Optional[int] = None        # SkyRL step of the latest loss call
        self.open = False                         # calls of ``current`` not logged yet
        self.expected: Optional[int] = None       # optimizer steps of ``current`` (None: unknown)
        self.done = 0                             # optimizer steps taken in ``current``
        self.total = 0                            # optimizer steps counted, all steps
        self.optimizer = None                     # weakref of the first optimizer stepping after a loss call

    def call(self, step: int, expected: Optional[int]) -> None:
        if step != self.current:
            self.current, self.done, self.expected = step, 0, expected
        elif not self.open:
            self.runtime._warn_once(
                "skyrl-late-call", "triage-monitor: a loss call of SkyRL step %d after the optimizer step that "
                "ended it (%d expected): its tokens are logged again under step %d, replacing the first record",
                step, self.expected, step)
        self.open = True

    def on_optimizer_step(self, optimizer) -> None:
        if not self.open:
            return
        if self.optimizer is None:
            self.optimizer = weakref.ref(optimizer)
        elif self.optimizer() is not optimizer:
            return
        self.done += 1
        self.total += 1
        if self.expected is not None and self.done >= self.expected:
            self.open = False
            rt = self.runtime
            rt.flush()
            if rt.settings.run_dir is not None and in_ray_worker():
                rt.monitor.flush(timeout=300)


_CLOCKS: dict = {}
_CLOCKS_LOCK = threading.Lock()
_CLOCK_HOOK = None


def _clock_for(runtime) -> _StepClock:
    global _CLOCK_HOOK
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(runtime.settings.key)
        if clock is None or clock.runtime is not runtime:
            clock = _CLOCKS[runtime.settings.key] = _StepClock(runtime)
        if _CLOCK_HOOK is None:
            _CLOCK_HOOK = register_optimizer_step_post_hook(_on_optimizer_step)
        return clock


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for clock in list(_CLOCKS.values()):
        try:
            with clock.runtime._lock:
                clock.on_optimizer_step(optimizer)
        except Exception as exc:     # monitoring never breaks the optimizer step
            clock.runtime._warn_once("skyrl-optimizer-hook", "triage-monitor: logging the SkyRL step failed (%s: %s); "
                                     "training continues", type(exc).__name__, exc)


def _dp_size() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        from skyrl.backends.skyrl_train.distributed.ulysses.utils import get_ulysses_sequence_parallel_world_size

        sp = max(1, int(get_ulysses_sequence_parallel_world_size()))
    except Exception:  # noqa: BLE001 — no SkyRL SP state: no sequence parallelism
        sp = 1
    return max(1, dist.get_world_size() // sp)


def _off_policy_enabled(config) -> bool:
    opc = getattr(config, "off_policy_correction", None)
    if opc is None:
        return False
    from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import off_policy_correction_enabled

    return off_policy_correction_enabled(opc)


def check_algorithm_config(config, settings: HookSettings, base: str) -> None:
    """Raise on a SkyRL ``AlgorithmConfig`` this loss cannot honour (called at construction and on every call).

    Raises:
        ValueError: ``loss_reduction`` not one of :data:`SKYRL_LOSS_REDUCTIONS`; SkyRL's TIS
            (``off_policy_correction.tis_ratio_type``) together with TRIAGE's TIS (double correction);
            ``clip_ratio_c`` ≤ 1 with ``base="dual_clip"``.
    """
    red = getattr(config, "loss_reduction", None)
    if red not in SKYRL_LOSS_REDUCTIONS:
        raise ValueError(f"SkyRL trainer.algorithm.loss_reduction={red!r} is not supported by the TRIAGE loss: "
                         f"it supports {SKYRL_LOSS_REDUCTIONS} (skyrl 0.3.0-0.4.0)")
    opc = getattr(config, "off_policy_correction", None)
    if (settings.triage is not None and settings.triage.tis and opc is not None
            and getattr(opc, "tis_ratio_type", None) is not None):
        raise ValueError("SkyRL off_policy_correction.tis_ratio_type="
                         f"{opc.tis_ratio_type!r} and TRIAGE's TIS would both reweight by the rollout ratio: set "
                         "trainer.algorithm.off_policy_correction.tis_ratio_type=null or TriageConfig(tis=False)")
    if base == "dual_clip" and not float(getattr(config, "clip_ratio_c", 3.0)) > 1.0:
        raise ValueError(f"SkyRL trainer.algorithm.clip_ratio_c={config.clip_ratio_c} must be > 1 for dual clip")


class SkyRLTriageLoss(LossHook):
    """A SkyRL policy loss computing the TRIAGE loss (or, with ``settings.triage=None``, SkyRL's own PPO loss)
    and recording every micro-batch for the monitor of the worker process that runs it.

    Called by SkyRL as ``fn(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs)`` with
    ``(B, T)`` right-aligned tensors (module docstring); returns ``(loss, metrics)``: ``loss`` 0-dim float32,
    the masked sum of the weighted PPO-clip loss (+ the Repair term), ``metrics`` SkyRL's own loss metrics
    (computed by SkyRL's ``ppo_policy_loss``) plus ours under ``triage/`` (floats).

    Args:
        settings: :class:`HookSettings` (run directory, monitor and TRIAGE configuration, alerts, trackers,
            framework keys); default: no monitor, monitoring-only controller (TRIAGE off).
        base: SkyRL PPO loss reproduced: ``"regular"`` or ``"dual_clip"`` (uses ``clip_ratio_c``).
        algorithm: SkyRL's ``cfg.trainer.algorithm``, to check it here rather than at the first worker call.
        trainer: SkyRL's ``cfg.trainer``: its batch sizes give the optimizer steps of one SkyRL step
            (:func:`optimizer_steps_per_step`) where the batch's metadata does not (module docstring: when the
            step is logged; with optimizer steps counted, that every loss call of one SkyRL step reports the same
            monitored step); None: from the metadata only.

    Raises:
        ValueError: ``base`` unknown, ``algorithm`` / ``trainer`` not supported (:func:`check_algorithm_config`),
            or ``TriageConfig.normalization="global_token"`` (SkyRL's masked sum: the weights are renormalised per
            response).
    """

    def __init__(self, settings: Optional[HookSettings] = None, *, base: str = "regular", algorithm=None,
                 trainer=None):
        if base not in SKYRL_BASE_LOSSES:
            raise ValueError(f"SkyRLTriageLoss: base must be one of {SKYRL_BASE_LOSSES} (SkyRL's PPO losses), "
                             f"got {base!r}")
        self.settings = settings if settings is not None else HookSettings()
        check_normalization(self.settings.triage, "SkyRLTriageLoss", "SkyRL sums the loss (its loss_reduction "
                            "divides the advantages)")
        self.base = base
        self.trainer_steps = optimizer_steps_per_step(trainer) if trainer is not None else None
        self.steps_per_report = self.trainer_steps or 1
        if algorithm is not None:
            check_algorithm_config(algorithm, self.settings, base)

    def skyrl_metrics(self, log_probs, old_log_probs, advantages, config, loss_mask,
                      rollout_logprobs) -> dict[str, Any]:
        """SkyRL's own loss metrics for these tensors, computed by SkyRL's ``ppo_policy_loss`` (no grad)."""
        from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_policy_loss

        cfg = copy.copy(config)
        cfg.policy_loss_type = self.base
        with torch.no_grad():
            _, metrics = ppo_policy_loss(log_probs.detach(), old_log_probs, advantages, cfg, loss_mask=loss_mask,
                                         rollout_logprobs=rollout_logprobs)
        return dict(metrics)

    def __call__(self, log_probs, old_log_probs, advantages, config=None, loss_mask=None, rollout_logprobs=None):
        if config is None:
            raise ValueError("SkyRLTriageLoss needs SkyRL's AlgorithmConfig as `config` (SkyRL passes it)")
        check_algorithm_config(config, self.settings, self.base)
        if loss_mask is None:
            loss_mask = torch.ones_like(log_probs)
        batch = batch_from_skyrl(log_probs, rollout_logprobs, advantages, loss_mask, self.settings.on_invalid)
        scale = None
        if _off_policy_enabled(config):       # SkyRL's own TIS ratio × sequence / outlier / token masks
            from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import apply_off_policy_correction

            with torch.no_grad():
                factor, mask_after, _ = apply_off_policy_correction(
                    torch.ones_like(old_log_probs, dtype=torch.float32), old_log_probs, rollout_logprobs,
                    loss_mask, config.off_policy_correction)
            scale = batch.gather(factor * mask_after)
        step = self._skyrl_step(sys._getframe(1))
        res = self.compute_loss(batch, old_logp=batch.gather(old_log_probs), framework_step=step,
                                agg_mode="token_sum", denominator=1.0,
                                clip_low=float(config.eps_clip_low), clip_high=float(config.eps_clip_high),
                                dual_clip=float(config.clip_ratio_c) if self.base == "dual_clip" else None,
                                token_scale=scale)
        metrics = self.skyrl_metrics(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs)
        if self.settings.triage is not None:
            metrics.update({f"triage/{k}": float(v) for k, v in res.output.stats.items()})
        # the monitor's values of a completed step (a name also among the controller's statistics,
        # gate_downweighted_frac, takes the monitored step's value, with triage/metrics_step)
        metrics.update(self.framework_report())
        return res.loss, metrics

    def _skyrl_step(self, frame) -> Optional[int]:
        """SkyRL's ``global_step`` of this call (:func:`skyrl_call_site`), registered with this process's step clock;
        None with ``step_source="optimizer"`` or when the call site holds none (said once: optimizer steps count)."""
        if self.settings.step_source == "optimizer":
            return None
        step, expected = skyrl_call_site(frame)
        rt = self.runtime
        if step is None:
            rt._warn_once("skyrl-no-step", "triage-monitor: no SkyRL global_step found above the loss call (the batch's "
                          "metadata); the monitored steps count the worker's optimizer steps instead")
            return None
        if expected is None and self.trainer_steps is not None:
            expected = self.trainer_steps
        with rt._lock:
            _clock_for(rt).call(step, expected)
        return step

    def framework_report(self) -> dict[str, float]:
        """What this call hands to SkyRL's loss metrics from the monitor: the metrics of the last step this worker
        logged before the current SkyRL step began (with optimizer steps counted: before the current block of
        ``steps_per_report`` optimizer steps, one SkyRL step when ``trainer=`` was given), the same keys on every
        rank (:func:`dp_framework_metrics`), names ending in ``_loss`` left out; ``{}`` before the first step or
        without a run directory."""
        rt = self.runtime
        if self.settings.run_dir is None:
            return {}
        clock = _CLOCKS.get(self.settings.key)
        if clock is not None and clock.runtime is rt and clock.current is not None:
            block = ("skyrl", clock.current)     # SkyRL's step: the previous one has been logged by now
        else:
            block = ("optimizer", (rt.step_offset + rt.optimizer_steps) // self.steps_per_report)
        with _REPORTS_LOCK:
            held = _REPORTS.get(self.settings.key)
            if held is None or held[0] != block or held[2] is not rt:
                mon = rt.monitor
                out = dp_framework_metrics(rt.last_metrics, self.settings.framework_keys, mon.rank, _dp_size(),
                                           self.settings.alerts is not False)
                out = {k: v for k, v in out.items() if not (k.endswith("_loss") or k == "triage/loss")}
                held = _REPORTS[self.settings.key] = (block, out, rt)
        return dict(held[1])


def register(settings: Optional[HookSettings] = None, *, name: str = "triage", base: str = "regular",
             algorithm=None, trainer=None, **settings_kw) -> SkyRLTriageLoss:
    """Register a :class:`SkyRLTriageLoss` in SkyRL's ``PolicyLossRegistry`` under ``name`` and return it.

    Call it on the driver before SkyRL's ``validate_cfg`` / ``initialize_ray`` (which syncs the registry into
    the Ray actor the workers read), and select it with ``trainer.algorithm.policy_loss_type=<name>``.

    Args:
        settings: :class:`HookSettings`; or give its fields as keywords (``run_dir=``, ``triage=``,
            ``alerts=`` (True: the shipped rules; False; a rule file, read now; a list of rules), ``loggers=``
            (tracker specs, built by rank 0's monitor), ``framework_keys=`` (``"curated"``, ``"all"`` or names), ...).
        name: registry name.
        base, algorithm, trainer: as :class:`SkyRLTriageLoss` (``trainer=cfg.trainer``, ``algorithm=cfg.trainer.
            algorithm``).

    Raises:
        ImportError: SkyRL is not installed.  ValueError: ``name`` already registered, a bad ``alerts`` /
        ``loggers`` / ``framework_keys`` (naming the argument and the value), or as :class:`SkyRLTriageLoss`.
    """
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    if settings is None:
        settings_kw.setdefault("manifest", {"framework": "skyrl"})
        for arg, check in (("alerts", check_alerts), ("loggers", check_loggers),
                           ("framework_keys", check_framework_keys)):
            if arg in settings_kw:
                settings_kw[arg] = check(settings_kw[arg], f"register({arg}=...)")
        settings = HookSettings(**settings_kw)
    elif settings_kw:
        raise ValueError("register: give either settings or its fields as keywords, not both")
    else:
        check_alerts(settings.alerts, "HookSettings.alerts")          # a rule file: read now, on the driver
    fn = SkyRLTriageLoss(settings, base=base, algorithm=algorithm, trainer=trainer)
    PolicyLossRegistry.register(name, fn)
    return fn


# ------------------------------------------------------------------------------------------- phase timings
#: The step's reward in SkyRL's log payload: ``reward/avg_raw_reward``, set by ``RayPPOTrainer.
#: postprocess_generator_output`` (``train/trainer.py``) from ``generators/utils.py``
#: ``get_metrics_from_generator_output``: the mean over the step's trajectories of each one's reward (summed over
#: its tokens when the rewards are per token), before any KL penalty or advantage.
REWARD_KEY = "reward/avg_raw_reward"


def timings_callback(run_dir):
    """A SkyRL training callback (``skyrl.train.utils.callbacks.TrainingCallback``) recording each step's phase
    timings and reward (:data:`REWARD_KEY`) in the run directory ``run_dir``.

    The trainer (``train/trainer.py`` ``RayPPOTrainer.train``, in the process of SkyRL's entry point) fires
    ``on_log`` with the payload it is about to hand to its tracker — the step's ``timing/<name>`` (its
    ``all_timings``: ``generate``, ``fwd_logprobs_values_reward``, ``train_critic_and_policy``, ``sync_weights``,
    ``step``, ...) among its metrics — once the step timer closed, after the workers wrote the step's rows (the
    monitored step is SkyRL's ``global_step``, ``callback_input.global_step``).  The callback hands the payload
    to a :class:`~triage_monitor.rundir.timings_writer.TimingsWriter` of ``run_dir`` at that step, with the payload's
    ``reward/avg_raw_reward`` as the step's reward (other keys are skipped, the payload is not changed); it never
    raises into the trainer.  Add it with
    ``trainer.add_callback(...)`` or ``RayPPOTrainer(..., callbacks=[...])``, or use :func:`experiment_class`.

    Raises:
        ImportError: SkyRL is not installed."""
    from skyrl.train.utils.callbacks import TrainingCallback

    from triage_monitor.rundir.timings_writer import TimingsWriter

    class TriageTimingsCallback(TrainingCallback):
        def __init__(self):
            self.writer = TimingsWriter(run_dir, framework="skyrl")

        def on_log(self, trainer, callback_input, control) -> None:
            logs, step = callback_input.logs, callback_input.global_step
            if logs:                    # record never raises; a step that is no integer is said once there
                self.writer.record(logs, step=step, framework_step=step, reward=logs.get(REWARD_KEY))

        def on_train_end(self, trainer, callback_input, control) -> None:
            self.writer.close()

    return TriageTimingsCallback()


class TimingsExpMixin:
    """For SkyRL's experiment class (``skyrl.train.entrypoints.main_base.BasePPOExp`` or your subclass):
    ``get_trainer`` adds :func:`timings_callback` of ``triage_run_dir`` (the run directory of :func:`register`) to
    the trainer it builds."""

    triage_run_dir: Optional[str] = None

    def get_trainer(self, *args, **kwargs):
        trainer = super().get_trainer(*args, **kwargs)
        if self.triage_run_dir:
            trainer.add_callback(timings_callback(self.triage_run_dir))
        return trainer


def experiment_class(run_dir, base=None):
    """``base`` (default SkyRL's ``BasePPOExp``) with :class:`TimingsExpMixin` recording into ``run_dir``."""
    if base is None:
        from skyrl.train.entrypoints.main_base import BasePPOExp as base
    return type(f"Timed{base.__name__}", (TimingsExpMixin, base), {"triage_run_dir": str(run_dir),
                                                                   "__module__": __name__})


def run_experiment(cfg, run_dir, base=None) -> None:
    """What SkyRL's ``skyrl_entrypoint`` does (``BasePPOExp(cfg).run()``), with the experiment class of
    :func:`experiment_class`: the trainer's phase timings reach the run's steps table."""
    experiment_class(run_dir, base)(cfg).run()


def entrypoint(num_cpus: float = 1):
    """SkyRL's ``skyrl_entrypoint`` with the phase timings recorded: a Ray remote function taking
    ``(cfg, run_dir, base=None)`` (:func:`run_experiment`); ``ray.get(entrypoint().remote(cfg, run_dir))``."""
    import ray

    return ray.remote(num_cpus=num_cpus)(run_experiment)


__all__ = ["SKYRL_LOSS_REDUCTIONS", "SKYRL_BASE_LOSSES", "batch_from_skyrl", "check_algorithm_config",
           "optimizer_steps_per_step", "skyrl_call_site", "CallSite", "SkyRLTriageLoss", "register", "timings_callback", "REWARD_KEY",
           "TimingsExpMixin", "experiment_class", "run_experiment", "entrypoint"]
