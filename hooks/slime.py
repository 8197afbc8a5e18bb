"""slime hook: the TRIAGE loss as slime's ``--custom-loss-function-path``, and a monitoring adapter.

slime (THUDM/slime; read at commit 624b824a, and its v0.3.1 tag) trains with Megatron ranks.  A micro-batch
reaches the loss as lists of 1-D per-sample tensors over the **response** tokens: ``rollout_log_probs``
(SGLang, nats), ``log_probs`` (the learner's recomputation before the update; absent when slime skips that
pass), ``advantages`` (per token), ``loss_masks`` (0 for tool/observation tokens), with ``response_lengths``,
``total_lengths`` and ``rollout_mask_sums`` (each sample's rollout's loss-mask total).

**Loss.**  With ``--loss-type custom_loss --custom-loss-function-path mymod.triage_loss``, slime's
``loss_function`` calls ``triage_loss(args, batch, logits, sum_of_sample_mean) -> (loss, log)`` where
``triage_loss = SlimeTriageLoss(...)`` is built at import of ``mymod`` in every Megatron rank.
:class:`SlimeTriageLoss` computes the live log-probs with slime's own ``get_log_probs_and_entropy`` (tensor
parallel vocab, rollout temperature, top-p replay), then the loss through
:func:`~triage_monitor.triage.loss.triage_policy_loss` with slime's aggregation: per sample Σ_t m ℓ / rollout_mask_sum
(``seq_mean_token_mean`` with ``response_denominator``), or a masked sum under
``--calculate-per-token-loss`` (``token_sum``); PPO clip ``eps_clip`` / ``eps_clip_high``, dual clip
``eps_clip_c``; minus ``entropy_coef`` × slime's entropy term.  slime then rescales it for Megatron as it does
its own loss.  With Gate, TIS and Repair off this is slime's ``policy_loss_function`` loss.  slime's own
metrics keep their names and values (computed with slime's functions: ``pg_loss``, ``pg_clipfrac``,
``ppo_kl``, ``entropy_loss``, ``train_rollout_logprob_abs_diff``, and ``ois``/``tis``/``tis_clipfrac``/
``tis_abs`` under ``--get-mismatch-metrics``); the controller's go under ``triage/``.  Options the hook cannot
honour raise :class:`ValueError` on the first call (the arguments reach the loss only then): context
parallelism, ``--use-tis`` (TRIAGE's TIS replaces it), a custom TIS or pg-loss reducer, OPSM, GSPO, CISPO,
``--use-kl-loss``.

**Step and ranks.**  The loss receives no step; the monitored step counts Megatron optimizer steps (the
global ``torch.optim`` step post-hook of :mod:`triage_monitor.hooks.worker_runtime`).  Every rank that runs the loss
runs the controller; only tensor-parallel rank 0 records tokens (the other TP ranks see the same tokens), and only
the last pipeline stage runs the loss.  The recording ranks are therefore one data-parallel group — Megatron's
``mpu.get_data_parallel_group(with_context_parallel=True)`` of TP rank 0 on the last stage, the group slime
reduces its step metrics over (``model.py`` L693-700 at ``624b824a``) — and the hook hands that group to its
runtime (:meth:`~triage_monitor.hooks.worker_runtime.WorkerRuntime.set_group`): the monitor all-reduces over it only
(the other ranks never call it), its attempt id is the group's rank 0's, and the files are numbered by the
data-parallel rank, so the data-parallel rank 0 — the rank slime logs from (``model.py`` L874-877) — reports
(alerts once per job, the trackers), writes ``run.json`` and is the rank readers default to.  Any tensor- and
pipeline-parallel size works (before, the monitor all-reduced over the world group, which the ranks that record
nothing never joined: a DP 2 × TP 2 job hung at the first optimizer step).

**What reaches slime's own log** (``train/<key>`` to W&B / TensorBoard, ``model.py`` L880-898).  slime sums each
key of the micro-batches' log dicts on a rank, all-reduces the sums over the data-parallel group and divides by
``step_global_batch_size`` (the step's rollout count, ``args.global_batch_size``: ``dp_schedule.py`` L150,
``rollout.py`` L777, ``model.py`` L839), or by the all-reduced token count under ``--calculate-per-token-loss``
(``observability/train_metric_utils.py`` L45-59, ``loss.py`` L1317, L1363-1382; all at ``624b824a``); every
micro-batch of every rank must therefore carry the same keys.  The log gets ``settings.framework_keys`` of the
last step the process logged (the curated set by default, ``triage/<name>`` and ``triage/metrics_step``) on every
micro-batch, with the value placed so that the reduction returns the monitor's: per-rollout mean (slime's
default) — the reporting rank's (data-parallel rank 0's) first micro-batch after the step closed carries value ×
``args.global_batch_size``, every other entry 0, so the log shows its steps-table value of step
``triage/metrics_step`` exactly (the step before the one being trained; NaN stays NaN); per-token loss — each rank
carries its own value × the micro-batch's token count (slime's ``num_tokens``), exact for the step and window
metrics, which the monitor all-reduces over the data-parallel group, and a token-weighted mean over the
data-parallel ranks for their own values (the controller's statistics, the integrity counters);
``triage/alerts_active``, the reporting rank's only, is left out then when there is more than one data-parallel
rank.  The data-parallel groups of the other tensor-parallel ranks carry no monitor key on any rank (their
reduction needs the same keys within the group only).  The controller's per-call statistics (``triage/gate_weight_mean``, ...; a name
claimed by ``framework_keys`` is the monitor's value instead) are weighted by the micro-batch's share of the
divisor (``sum_of_sample_mean`` of ones: its rollouts' share; or its tokens), so the log shows their
rollout- (token-) weighted mean over the step.

**Offline.**  ``triage-monitor import slime`` reads ``--save-debug-train-data`` dumps
(:func:`triage_monitor.hooks.slime_dumps.slime_steps`).  slime is not on PyPI (the PyPI project ``slime`` is another
package), so CI tests this module against slime's call site and formulas transcribed from commit 624b824a
(tests/test_hooks_slime.py); docs/hooks.md#slime says what was run against slime's own code.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.monitor import ALERT_STATE, MonitorConfig
from triage_monitor.alerting.trackers import PREFIX, framework_values

from .frameworks import FRAMEWORKS
from .loss_hook_options import first_hand_over, hook_options, own_stats, reports
from .worker_runtime import HookSettings, LossHook

#: slime arguments the TRIAGE loss cannot honour: (attribute, value that is fine, why).
_UNSUPPORTED = (
    ("use_tis", False, "TRIAGE's TIS replaces slime's; set TriageConfig(tis=True) instead of --use-tis"),
    ("custom_tis_function_path", None, "a custom TIS function is slime's own loss path"),
    ("custom_pg_loss_reducer_function_path", None, "the reduction is slime's per-rollout mean or masked sum"),
    ("use_opsm", False, "OPSM masking is not part of the TRIAGE loss"),
    ("use_kl_loss", False, "the KL-to-reference loss term is not part of the TRIAGE loss"),
    ("allgather_cp", False, "context parallelism gives each rank a slice of every response"),
)


def check_slime_args(args) -> None:
    """Raise when a slime option cannot be honoured by :class:`SlimeTriageLoss`.

    Raises:
        ValueError: names the option, its value and why (context parallel size > 1, ``--use-tis``, a custom TIS
            or pg-loss reducer, OPSM, ``--use-kl-loss``, advantage estimator ``gspo`` / ``cispo``, a loss type
            other than ``custom_loss``, no positive ``global_batch_size`` without ``--calculate-per-token-loss``).
    """
    for name, ok, why in _UNSUPPORTED:
        value = getattr(args, name, ok)
        if value != ok and not (ok is False and not value):
            raise ValueError(f"triage-monitor slime loss: --{name.replace('_', '-')}={value!r} is not supported: {why}")
    est = getattr(args, "advantage_estimator", "grpo")
    if est in ("gspo", "cispo"):
        raise ValueError(f"triage-monitor slime loss: --advantage-estimator {est} is not supported (sequence-level "
                         "ratio / CISPO loss); use grpo, ppo, reinforce_plus_plus(_baseline)")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp != 1:
        raise ValueError(f"triage-monitor slime loss: --context-parallel-size {cp} is not supported: each rank holds "
                         "a slice of every response, the Gate and Repair need whole responses")
    gbs = getattr(args, "global_batch_size", None)
    if not getattr(args, "calculate_per_token_loss", False) and not (isinstance(gbs, int) and gbs > 0):
        raise ValueError(f"triage-monitor slime loss: --global-batch-size is {gbs!r}; slime sets it (the rollouts per "
                         "step, its metric divisor) before training")
    loss_type = getattr(args, "loss_type", "custom_loss")
    if loss_type != "custom_loss":
        raise ValueError(f"triage-monitor slime loss: --loss-type {loss_type!r}; slime calls a custom loss function "
                         "only with --loss-type custom_loss")


def batch_from_slime(batch: dict, learner_key: str = "log_probs", sampler_key: str = "rollout_log_probs",
                     on_invalid: str = "raise", sample_ids=None, group_ids=None,
                     learner: Optional[Sequence[torch.Tensor]] = None) -> TokenBatch:
    """TokenBatch from a slime batch dict of per-sample lists (``loss_masks`` optional → all valid).

    Args:
        batch: slime micro-batch / rollout data: lists of S 1-D tensors ``(L_i,)`` over the response tokens.
        learner_key, sampler_key: keys of the learner and sampler log-probs (nats).
        learner: live learner log-probs (S tensors ``(L_i,)``) used instead of ``batch[learner_key]``.

    Raises:
        KeyError: a required list is missing (names the key and what slime needs to produce it).
        ValueError: per-sample lengths disagree (TokenBatch).
    """
    need = (sampler_key, "advantages") + ((learner_key,) if learner is None else ())
    for key in need:
        if key not in batch:
            raise KeyError(f"slime batch has no {key!r} (rollout_log_probs needs log-probs returned by the "
                           f"rollout engine); keys: {sorted(batch)}")
    masks = batch.get("loss_masks")
    lp = list(batch[learner_key]) if learner is None else list(learner)
    return TokenBatch.from_list(lp, [t.float() for t in batch[sampler_key]], list(batch["advantages"]),
                                None if masks is None else list(masks), sample_ids=sample_ids,
                                group_ids=group_ids, on_invalid=on_invalid)


def log_slime_batch(monitor, step: int, batch: dict, extra=None, **kw) -> dict[str, Any]:
    """``monitor.log_step(step, batch_from_slime(batch, **kw), extra)``; returns the metrics."""
    return monitor.log_step(step, batch_from_slime(batch, **kw), extra=extra)


class SlimeTriageLoss(LossHook):
    """slime ``--custom-loss-function-path`` target: ``(args, batch, logits, sum_of_sample_mean) -> (loss, log)``.

    Holds only :class:`HookSettings` (picklable); each Megatron rank builds its own controller and monitor
    on first use (module docstring of :mod:`triage_monitor.hooks.worker_runtime`).

    Args:
        run_dir: shared run directory (every rank writes its files there); None = no monitoring.
        triage: :class:`TriageConfig`; None = slime's own PPO loss, monitored.
        monitor: :class:`MonitorConfig`.
        manifest: facts for ``run.json``.
        on_invalid: ``"raise"`` or ``"quarantine"``.
        alerts: the rules rank 0's monitor evaluates: True (default, the shipped rules), False, a rule file path or
            a list of rules.
        loggers: trackers rank 0's monitor feeds, as configuration (``"tensorboard"``, ``{"kind": "mlflow", ...}``;
            one may be given without a list).
        framework_keys: the monitor's metrics put in slime's log: ``"curated"`` (default), ``"all"`` or a list of
            names (module docstring).
        settings: a ready :class:`HookSettings` instead of the arguments above.

    Raises:
        ValueError: a bad ``alerts`` / ``loggers`` / ``framework_keys`` (naming the option), or one of them given
            beside ``settings``.
    """

    #: the framework named in ``run.json`` (a subclass for a fork of slime names its own)
    FRAMEWORK = "slime"

    def __init__(self, run_dir=None, triage: Optional[TriageConfig] = None, monitor: Optional[MonitorConfig] = None,
                 manifest: Optional[dict] = None, on_invalid: str = "raise", *, alerts=True, loggers=(),
                 framework_keys="curated", settings: Optional[HookSettings] = None):
        where = type(self).__name__
        if settings is not None:
            given = [n for n, v, d in (("alerts", alerts, True), ("loggers", loggers, ()),
                                       ("framework_keys", framework_keys, "curated")) if v is not d and v != d]
            if given:
                raise ValueError(f"{where}: {', '.join(given)} given beside settings; set them in the HookSettings")
            self.settings = settings
            return
        alerts, loggers, framework_keys = hook_options(where, alerts, loggers, framework_keys)
        # attempt=None: every Megatron rank builds this object at import; rank 0's attempt id is broadcast
        self.settings = HookSettings(
            run_dir=run_dir, monitor=monitor or MonitorConfig(), triage=triage,
            manifest={"framework": self.FRAMEWORK, **(manifest or {})}, on_invalid=on_invalid,
            step_source="optimizer", attempt=None, alerts=alerts, loggers=loggers, framework_keys=framework_keys)

    # ------------------------------------------------------------ the loss
    def triage_loss(self, args, batch: dict, log_probs: Sequence[torch.Tensor], record: bool = True,
                    token_scale: Optional[torch.Tensor] = None):
        """The policy part of one micro-batch from live per-sample log-probs (no slime import).

        Args:
            args: slime's arguments (``eps_clip``, ``eps_clip_high``, ``eps_clip_c``, ``use_rollout_logprobs``,
                ``calculate_per_token_loss``).
            batch: slime micro-batch: ``rollout_log_probs``, ``advantages``, ``loss_masks``, optional
                ``log_probs`` (old, nats) and ``rollout_mask_sums`` (S,).
            log_probs: S live learner log-prob tensors ``(L_i,)`` (grad-carrying), nats.
            record: buffer the tokens for this process's monitor (False on tensor-parallel ranks other than 0,
                which see the same tokens).
            token_scale: ``(N,)`` per-token factors the framework's own loss multiplies its per-token loss by, in
                the batch's flat order (:func:`~triage_monitor.triage.loss.triage_policy_loss`); None: none.

        Returns:
            :class:`~triage_monitor.triage.loss.TriageLoss`; ``.policy_loss`` is slime's ``pg_loss`` when TRIAGE is off.
        """
        tb = batch_from_slime(batch, learner=log_probs, on_invalid=self.settings.on_invalid)
        old = old_log_probs(args, batch, log_probs)
        if getattr(args, "calculate_per_token_loss", False):
            agg: dict[str, Any] = dict(agg_mode="token_sum", denominator=1.0)
        else:
            masks = batch.get("loss_masks")
            sums = batch.get("rollout_mask_sums")
            if sums is None:     # slime's reducer without per-rollout totals: each sample's own mask total
                sums = [torch.as_tensor(m).sum() if masks is not None else len(lp) for m, lp in
                        zip(masks if masks is not None else log_probs, log_probs)]
            rd = torch.as_tensor([float(x) for x in sums], dtype=torch.float32)
            agg = dict(agg_mode="seq_mean_token_mean", denominator=1.0, response_denominator=rd)
        kw: dict[str, Any] = dict(old_logp=tb.gather([o.to(tb.learner_logp.dtype) for o in old]).detach(),
                  clip_low=float(args.eps_clip), clip_high=float(args.eps_clip_high),
                  dual_clip=getattr(args, "eps_clip_c", None), token_scale=token_scale, **agg)
        if record:
            return self.compute_loss(tb, **kw)
        from triage_monitor.triage.loss import triage_policy_loss

        rt = self.runtime        # the controller and the step count advance as on rank 0; nothing is written
        step = rt.step_for_call(None)
        with rt._lock:           # counted as a call, so that the optimizer step closes this rank's step too
            rt.calls += 1
            rt._calls_since_step += 1
        ctrl = rt.plain_controller if rt.controller is None else rt.controller
        return triage_policy_loss(ctrl, tb, step, **kw)

    def __call__(self, args, batch: dict, logits: torch.Tensor, sum_of_sample_mean):
        """slime's custom loss call (``slime/backends/megatron_utils/loss.py`` ``loss_function``).

        Args:
            args: slime's arguments.
            batch: the micro-batch (``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ...).
            logits: ``[1, T, V/tp]`` float32 Megatron logits.
            sum_of_sample_mean: slime's reducer for this micro-batch (used for slime's own metrics).

        Returns:
            ``(loss, log)``: 0-dim loss, and a dict of 0-dim tensors (slime's metric names, ``triage/*``).

        Raises:
            ValueError: an unsupported option (:func:`check_slime_args`).
            KeyError: the batch has no ``rollout_log_probs`` (the rollout engine must return log-probs).
        """
        check_slime_args(args)
        record = _tensor_parallel_rank() == 0
        if record and self.settings.run_dir is not None:
            # only TP rank 0 of the last pipeline stage records: the monitor's collectives run over its data-parallel
            # group (the recording ranks), which the other ranks never have to join
            self.runtime.set_group(_data_parallel_group())
        from slime.backends.megatron_utils.loss import (get_log_probs_and_entropy,
                                                        get_rollout_top_p_logprob_kwargs)
        from slime.utils.ppo_utils import compute_policy_loss

        if "rollout_log_probs" not in batch:
            raise KeyError("slime batch has no 'rollout_log_probs': the rollout engine must return log-probs "
                           "(slime keeps them when SGLang returns logprobs)")
        _, out = get_log_probs_and_entropy(
            logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=True,
            **get_rollout_top_p_logprob_kwargs(args, batch))
        log_probs, entropy = out["log_probs"], out["entropy"]
        res = self.triage_loss(args, batch, log_probs, record=record)

        # slime's own metrics, with slime's functions and reducer (policy_loss_function, commit 624b824a)
        old = torch.cat(old_log_probs(args, batch, log_probs), dim=0)
        lp = torch.cat(log_probs, dim=0)
        advantages = torch.cat(batch["advantages"], dim=0)
        with torch.no_grad():
            ppo_kl = old - lp.detach()
            dual = getattr(args, "eps_clip_c", None)       # v0.3.1 has no dual clip (no --eps-clip-c)
            _, pg_clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high,
                                                 **({} if dual is None else {"eps_clip_c": dual}))
        entropy_loss = sum_of_sample_mean(torch.cat(entropy, dim=0))
        loss = res.loss - args.entropy_coef * entropy_loss
        if lp.numel() == 0:
            loss = loss + 0 * logits.sum()
        rollout = torch.cat([t.to(lp.dtype) for t in batch["rollout_log_probs"]], dim=0)
        compare = lp.detach() if args.use_rollout_logprobs else old
        log = {"loss": loss.clone().detach(), "pg_loss": res.policy_loss.clone().detach(),
               "entropy_loss": entropy_loss.clone().detach(), "pg_clipfrac": sum_of_sample_mean(pg_clipfrac),
               "ppo_kl": sum_of_sample_mean(ppo_kl)}
        if batch["rollout_log_probs"]:
            log["train_rollout_logprob_abs_diff"] = sum_of_sample_mean((compare - rollout).abs()).detach()
        if getattr(args, "get_mismatch_metrics", False):
            from slime.backends.megatron_utils.loss import vanilla_tis_function

            train_lp = batch.get("log_probs") or [t.detach() for t in log_probs]
            _, _, tis_metrics = vanilla_tis_function(
                args, pg_loss=torch.zeros_like(lp), train_log_probs=train_lp,
                rollout_log_probs=batch["rollout_log_probs"], loss_masks=batch["loss_masks"])
            log["ois"] = sum_of_sample_mean((-ppo_kl).exp()).detach()
            log.update({k: sum_of_sample_mean(v) for k, v in tis_metrics.items()})
        if self.settings.triage is not None:
            log.update(triage_log(res, _divisor_share(args, batch, sum_of_sample_mean, logits.device), logits.device,
                                  self.settings))
        log.update(_framework_log(self.runtime, args, batch, logits.device))
        if record and reports(self.runtime):
            attach_perf_timings(self.runtime)
        return loss, log


#: Where slime's actor logs its metrics (``log(args, metrics, step_key)``), at 624b824a.
SLIME_LOG_MODULE = "slime.observability.logging_utils"
#: The rollout's reward in the training actor's log: ``log_rollout_data`` (``observability/train_metric_utils.py``
#: L142-221 at 624b824a; Miles: ``backends/training_utils/log_utils.py`` L165-261 at 31f1ca96), which the actor calls
#: before it trains on the rollout (slime actor.py L508-524; Miles megatron actor.py L566-571), reduces
#: ``rollout_data["raw_reward"]`` (each sample's reward before GRPO's normalisation: slime ``ray/rollout.py``
#: L612-663) to its mean and logs it as ``rollout/raw_reward`` through ``gather_log_data`` → ``log`` on the
#: data-parallel source rank (L117-138; Miles L81-128).
REWARD_KEY = "rollout/raw_reward"


def attach_perf_timings(runtime, module_name: str = SLIME_LOG_MODULE) -> bool:
    """Make slime's metric logging (``slime.observability.logging_utils.log``, 624b824a L45-52, which the training
    actor's ``train_metric_utils.log_perf_data`` calls at the end of ``train`` with the rollout's Timer readings as
    ``perf/<name>_time``: ``actor_train_time``, ``log_probs_time``, ``update_weights_time``, ``step_time``, ...;
    actor.py L564-568, train_metric_utils.py L358-403) hand those readings to ``runtime`` first: they belong to
    the last step this process logged (the rollout's last optimizer step, whose row is written), so they go to the
    run's timings table (docs/hooks.md#phase-timings); and the rollout's reward that ``log_rollout_data`` logs
    before the rollout's training (:data:`REWARD_KEY`) becomes the reward of the rows logged after it (the
    rollout's optimizer steps; ``WorkerRuntime.set_reward``, docs/hooks.md#rewards).  The wrapper is put in place at
    the reporting rank's first loss call, after the first rollout's reward was logged: that rollout's rows carry
    none.  slime's own ``log`` is then called unchanged; the wrapper never raises.  Done once per process (the newest reporting runtime is the one fed); False when slime's module
    is not loaded.  ``module_name``: the module holding that ``log`` (Miles: ``miles.utils.tracking_utils.tracking``,
    whose ``log_perf_data_raw`` logs the same names)."""
    module = sys.modules.get(module_name)
    own = getattr(module, "log", None)
    if own is None:
        return False
    if getattr(own, "triage_runtime", None) is not None:
        own.triage_runtime = runtime
        return True

    def log(args, metrics, step_key, *rest, **kw):
        try:
            logged = dict(metrics)
            timers = {k: v for k, v in logged.items() if k in FRAMEWORKS["slime"].timers}
            rt = log.triage_runtime
            if timers and rt.last_metrics is not None:
                rt.add_timings(int(rt.last_metrics["step"]), timers, "slime")
            if REWARD_KEY in logged:           # the rollout's reward, logged before its optimizer steps
                rt.set_reward(logged[REWARD_KEY])
        except Exception:  # noqa: BLE001 — monitoring never stops the training job
            pass
        return own(args, metrics, step_key, *rest, **kw)

    log.triage_runtime = runtime
    module.log = log
    return True


def _data_parallel_size() -> int:
    """Megatron's data-parallel world size (1 when Megatron's parallel state is not initialised)."""
    try:
        from megatron.core import mpu

        return int(mpu.get_data_parallel_world_size(with_context_parallel=True))
    except Exception:
        return 1


def _data_parallel_group():
    """Megatron's data-parallel group (with context parallelism, as slime reduces its step metrics over it); None
    when Megatron's parallel state is not initialised (the monitor then uses the default group)."""
    try:
        from megatron.core import mpu

        if not mpu.model_parallel_is_initialized():
            return None
        return mpu.get_data_parallel_group(with_context_parallel=True)
    except Exception:
        return None


def _tensor_parallel_rank() -> int:
    """Megatron's tensor-parallel rank (0 when Megatron's parallel state is not initialised)."""
    try:
        from megatron.core import mpu

        return int(mpu.get_tensor_model_parallel_rank())
    except Exception:
        return 0


def old_log_probs(args, batch: dict, log_probs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The PPO anchor of slime's loss (and Miles', which shares it: :mod:`triage_monitor.hooks.miles`).

    Args:
        args: slime's (Miles') parsed arguments; ``use_rollout_logprobs`` is read.
        batch: the micro-batch dict: ``rollout_log_probs`` (the sampler's, nats) and, when slime ran its
            recompute pass, ``log_probs`` (the learner's before the update), lists of 1-D per-sample tensors.
        log_probs: the live log-probs, one 1-D tensor per sample.

    Returns:
        One 1-D tensor per sample: the sampler-side ``rollout_log_probs`` as float32 under
        ``--use-rollout-logprobs``, else the recomputed ``log_probs`` detached, else (no recompute pass) the live
        log-probs detached.
    """
    if getattr(args, "use_rollout_logprobs", False):
        return [t.float() for t in batch["rollout_log_probs"]]
    old = batch.get("log_probs")
    return [t.detach() for t in (old if old else log_probs)]


def _divisor_share(args, batch: dict, sum_of_sample_mean, device) -> float:
    """This micro-batch's part of slime's step divisor: its token count as slime's ``loss_function`` counts it
    (``num_tokens``, under ``--calculate-per-token-loss``), else ``sum_of_sample_mean`` of ones — Σ mask / rollout
    mask total over its samples, its share of the step's rollouts (``args.global_batch_size``; the samples of one
    rollout add up to 1)."""
    if getattr(args, "calculate_per_token_loss", False):
        return float(sum(max(int(torch.as_tensor(m).sum()), 1) for m in batch["loss_masks"]))
    n = int(sum(int(x) for x in batch["response_lengths"]))
    return float(sum_of_sample_mean(torch.ones(n, device=device)))


def triage_log(res, weight: float, device, settings: HookSettings) -> dict[str, torch.Tensor]:
    """The controller's statistics as ``triage/<name>`` (those ``framework_keys`` does not claim), each × ``weight``,
    this micro-batch's share of the step divisor: slime's step reduction (sum over micro-batches and ranks ÷ the
    step's rollout count, or ÷ its token count under ``--calculate-per-token-loss``) then yields their rollout-
    (token-) weighted mean."""
    out: dict[str, torch.Tensor] = {}
    for name, value in own_stats(res.output.stats, settings).items():
        v = 0.0 if value != value else float(value)      # NaN (no tokens) adds nothing
        out[f"triage/{name}"] = torch.tensor(v * weight, device=device)
    return out


def _framework_log(rt, args, batch: dict, device) -> dict[str, torch.Tensor]:
    """``framework_keys`` of the last step this process logged, as log entries that slime's reduction turns back
    into the monitor's values (module docstring).  The keys depend only on this process's last metrics, which every
    rank of the data-parallel group has alike; a process that records nothing (tensor-parallel rank > 0) has none,
    like the rest of its group."""
    last = rt.last_metrics
    if not last:
        return {}
    # NaN kept: the keys must not depend on a rank's own values; ratios at noise level (a global guard) left out
    values = framework_values(last, rt.settings.framework_keys)
    values["metrics_step"] = float(last["step"])
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    rank0 = reports(rt)
    if per_token:
        if ALERT_STATE in values and _data_parallel_size() > 1:
            del values[ALERT_STATE]                                      # rank 0's only: no per-token mean of it
        tokens = float(sum(max(int(torch.as_tensor(m).sum()), 1) for m in batch["loss_masks"]))
        scale = {k: tokens if (rank0 or k != ALERT_STATE) else 0.0 for k in values}
    else:
        first = rank0 and first_hand_over(rt)
        gbs = float(getattr(args, "global_batch_size"))
        scale = dict.fromkeys(values, gbs if first else 0.0)
    return {PREFIX + k: torch.tensor(v * scale[k] if scale[k] else 0.0, device=device) for k, v in values.items()}


__all__ = ["SlimeTriageLoss", "batch_from_slime", "check_slime_args", "log_slime_batch", "attach_perf_timings",
           "REWARD_KEY"]
