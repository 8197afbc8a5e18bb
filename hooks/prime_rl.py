"""prime-rl hook: the TRIAGE loss as prime-rl's custom RL loss (``[trainer.loss] type = "custom"``).

Checked against prime-rl's public repository at commit ``559b44772e471d1538537b8805cc77f3824a5e64``
(``src/prime_rl/trainer/rl/loss.py``, ``src/prime_rl/trainer/rl/train.py``); prime-rl does not install on a
CPU machine, so ``tests/test_hooks_prime_rl.py`` reproduces its call site (docs/hooks.md#prime-rl).

How prime-rl calls a custom loss: ``setup_rl_loss_fn`` imports ``[trainer.loss] import_path`` and calls it as
``fn(inputs, **kwargs)`` once **per sample** (``kwargs`` = ``[trainer.loss] kwargs``); ``inputs`` is a
``LossInputs`` with 1-D tensors over the packed sample (prompt + completion): ``trainer_logprobs`` (live,
grad-carrying, nats), ``inference_logprobs`` (vLLM), ``advantages`` (per token), ``loss_mask`` (bool),
``ref_logprobs`` and ``loss_weights`` (None unless distillation streams are used).  It must return a
``LossOutputs(loss, metrics)`` whose ``loss`` is the sample's **sum** over its loss tokens (``compute_loss``
adds the samples and divides by ``rl_scale``, the global loss-token count) and whose metric values are
**tensors** (0-dim, stacked over samples).

What this hook computes: prime-rl's default loss (DPPO-Binary-TV + squared-log-ratio KL, anchored on the
inference log-probs; :func:`triage_monitor.triage.corrections.dppo_kl_loss`) with the TRIAGE weights, aggregated as a
per-sample sum (``agg_mode="token_sum"``, the caller's ``rl_scale`` is the framework denominator, so the
weights are renormalised per response).  With Gate, TIS and Repair off it is prime-rl's ``default_loss_fn``.
TIS is the identity here: the anchor *is* the inference log-prob, the DPPO ratio already corrects the
mismatch.  Repair: each sample contributes ``repair_coef · Σφ · repair_width`` so that after prime-rl's
division by ``rl_scale`` the update's Repair is ``repair_coef · Σφ / (rl_scale / repair_width)``, i.e. the
update's segment count is taken as its loss tokens / ``repair_width`` (exact when every response fills whole
segments; prime-rl never shows a sample the update's token count).

Metrics: the default loss's own metrics under their names and with prime-rl's values
(``masked_mismatch_kl``, ``unmasked_mismatch_kl``, ``is_masked``, ``is_masked_low``, ``is_masked_high``,
``masked_advantage_positive``, ``masked_advantage_negative``); prime-rl's trainer computes ``mismatch_kl/*``
itself, outside the loss, so those stay as they are.  The controller's statistics go under ``triage/``.
Steps: one monitored step per optimizer step (prime-rl's AdamW / Muon step once per ``progress.step``).

What reaches prime-rl's own logger: on the monitor's rank 0 every sample's ``LossOutputs.metrics`` also carries
``settings.framework_keys`` of the last step this process logged (:meth:`WorkerRuntime.framework_metrics`: the
curated set by default, ``triage/<name>`` plus ``triage/metrics_step``) as 0-dim float32 tensors; the other ranks
carry none.  prime-rl stacks them per sample (``compute_loss``, ``src/prime_rl/trainer/rl/loss.py`` L345-349,
L396-401), appends them per micro-batch (``train.py`` L538-539) and ``Tensors.compute_stats``
(``trainer/utils.py`` L245-280, ``train.py`` L623) all-gathers every rank's values (a rank without the key adds
none) into ``<key>/mean``, ``/median``, ``/std``, ``/min``, ``/max``, which ``monitors.log`` hands to prime-rl's
monitors (W&B, file, Prime; ``train.py`` L675-676; all at ``559b4477``): every value is rank 0's, so ``/mean``,
``/median``, ``/min`` and ``/max`` are the monitor's value of step ``triage/metrics_step`` (the previous optimizer
step: the step being trained is logged when it closes) and ``/std`` is 0 (up to float32 rounding).  ``filter_rl_trainer_tensor_stats_for_wandb`` (``trainer/utils.py`` L289-321) keeps every
``triage/`` key, and prime-rl has no key under ``triage/``.  A controller statistic whose name is in
``framework_keys`` (``gate_downweighted_frac`` in the curated set) is the monitor's value, not the sample's.

The reward: prime-rl computes and logs it in the **orchestrator** process only (``orchestrator/orchestrator.py``
L747: ``monitors.log(metrics, step=step)`` in ``finalize_train_batch``, ``metrics`` holding
``train/agg/effective/<agent>/reward/mean``, L698-702 and ``orchestrator/metrics.py`` L244-253, L324-335), where
the loss hook never runs.  The orchestrator builds its monitors from its config only (``monitors.setup``,
``monitors/__init__.py`` L41-84, called at ``orchestrator.py`` L219-228), so no monitor can be configured there;
:func:`orchestrator_main` is the ``orchestrator`` entry point (``entrypoints/orchestrator.py`` L19-24) with a
:class:`RewardMonitor` appended to ``monitors.MONITORS`` once ``Orchestrator.setup`` has set prime-rl's up
(:func:`with_reward_monitor`).  Under the ``rl`` launcher it cannot run: ``rl`` starts the orchestrator by the
fixed command ``["orchestrator", "@", ...]`` (``entrypoints/rl.py`` L284); launch the components standalone
(prime-rl's ``docs/training.md`` L39) and start the orchestrator with ``python -m triage_monitor.hooks.prime_rl``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.triage.corrections import dppo_kl_loss
from triage_monitor.monitor import MonitorConfig
from triage_monitor.rundir.timings_writer import TimingsWriter, finite_or_none

from .frameworks import FRAMEWORKS
from .loss_hook_options import hook_options, own_stats, reports
from .option_strings import check_normalization
from .worker_runtime import HookSettings, LossHook

#: The prime-rl commit this hook's call-site contract was read from.
PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"

#: Metrics of prime-rl's ``default_loss_fn``, kept with prime-rl's values.
DEFAULT_LOSS_METRICS = ("masked_mismatch_kl", "unmasked_mismatch_kl", "is_masked", "is_masked_low", "is_masked_high",
                        "masked_advantage_positive", "masked_advantage_negative")

try:  # inside prime-rl, its own result type; elsewhere a structural twin (compute_loss reads .loss / .metrics)
    from prime_rl.trainer.rl.loss import LossOutputs
except Exception:  # noqa: BLE001 - prime-rl absent or not importable on this machine
    @dataclass
    class LossOutputs:
        """Structural twin of prime-rl's ``LossOutputs`` (``loss``: 0-dim tensor, ``metrics``: name → tensor)."""

        loss: torch.Tensor
        metrics: dict


def batch_from_prime_rl(trainer_logprobs, inference_logprobs, advantages, loss_mask, on_invalid: str = "raise",
                        sample_ids=None, group_ids=None) -> TokenBatch:
    """TokenBatch from prime-rl 1-D per-sample tensors (one sample, or lists of samples).

    A prime-rl sample spans prompt + completion (prompt: ``loss_mask`` False); each sample is cut at its first
    loss token so that position 0 is the first completion token; later masked tokens (tool output) keep
    counting.  ``trainer_logprobs`` keeps its gradient.

    Args:
        trainer_logprobs, inference_logprobs, advantages: ``(T_i,)`` float, nats (or lists of them).
        loss_mask: ``(T_i,)`` bool (or a list).
        on_invalid: ``"raise"`` | ``"quarantine"`` (:class:`~triage_monitor.batch.TokenBatch`).

    Raises:
        ValueError: from :meth:`TokenBatch.from_list` (lengths differ, non-finite values with ``"raise"``).
    """
    if hasattr(trainer_logprobs, "dim") and trainer_logprobs.dim() == 1:
        trainer_logprobs, inference_logprobs = [trainer_logprobs], [inference_logprobs]
        advantages, loss_mask = [advantages], [loss_mask]
    starts = [int(m.float().argmax()) if bool(m.any()) else 0 for m in loss_mask]
    cut = lambda ts: [t[s:] for t, s in zip(ts, starts)]  # noqa: E731
    return TokenBatch.from_list(cut(trainer_logprobs), cut(inference_logprobs), cut(advantages), cut(loss_mask),
                                sample_ids=sample_ids, group_ids=group_ids, on_invalid=on_invalid)


def _safe_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask].float().sum() / torch.clamp_min(mask.sum(), 1)


class PrimeRLTriageLoss(LossHook):
    """prime-rl custom RL loss with TRIAGE; picklable configuration, per-process runtime.

    Args:
        run_dir: shared run directory of the monitor (None = no records).
        triage: :class:`TriageConfig` (or a dict of its fields); None = prime-rl's default loss, monitored only.
        monitor: :class:`MonitorConfig` (or dict).
        manifest: extra facts for ``run.json``.
        dppo_mask_low, dppo_mask_high, adv_tau, kl_tau: prime-rl's ``DefaultLossConfig`` fields (same defaults).
        on_invalid, step_source: :class:`~triage_monitor.hooks.worker_runtime.HookSettings`.
        alerts: the rules rank 0's monitor evaluates: True (default, the shipped rules), False, a rule file path or
            a list of rules / rule tables (:class:`~triage_monitor.hooks.worker_runtime.HookSettings`).
        loggers: trackers rank 0's monitor feeds, as configuration: ``"tensorboard"``, ``{kind = "mlflow", ...}``
            (a single one may be given without the list).
        framework_keys: the monitor's metrics handed to prime-rl's metrics: ``"curated"`` (default), ``"all"`` or
            a list of names (module docstring).
        key: identity across processes (default: random; :func:`triage_loss` derives it from its kwargs).

    Raises:
        ValueError: a negative DPPO threshold / temperature, a bad ``on_invalid`` / ``step_source``, a bad
            ``alerts`` / ``loggers`` / ``framework_keys`` (the message names the option), or
            ``TriageConfig.normalization="global_token"`` (prime-rl's ``rl_scale``: the weights are renormalised
            per response).
    """

    def __init__(self, run_dir: Optional[str] = None, triage=None, monitor=None, manifest: Optional[dict] = None,
                 dppo_mask_low: float = 0.2, dppo_mask_high: float = 0.2, adv_tau: float = 1.0, kl_tau: float = 1e-3,
                 on_invalid: str = "raise", step_source: str = "auto", alerts=True, loggers=(),
                 framework_keys="curated", key: Optional[str] = None):
        for name, v in (("dppo_mask_low", dppo_mask_low), ("dppo_mask_high", dppo_mask_high), ("adv_tau", adv_tau),
                        ("kl_tau", kl_tau)):
            if float(v) < 0:
                raise ValueError(f"PrimeRLTriageLoss: {name} must be >= 0 (prime-rl's DefaultLossConfig), got {v}")
        alerts, loggers, framework_keys = hook_options("PrimeRLTriageLoss", alerts, loggers, framework_keys)
        self.surrogate_kwargs = dict(mask_low=float(dppo_mask_low), mask_high=float(dppo_mask_high),
                                     adv_tau=float(adv_tau), kl_tau=float(kl_tau))
        # attempt=None: every torchrun rank builds this object itself; rank 0's attempt id is broadcast
        self.settings = HookSettings(run_dir=run_dir, monitor=monitor or MonitorConfig(), triage=triage,
                                     manifest={"framework": "prime-rl", "prime_rl_commit": PRIME_RL_COMMIT,
                                               **(manifest or {})},
                                     on_invalid=on_invalid, step_source=step_source, attempt=None,
                                     alerts=alerts, loggers=loggers, framework_keys=framework_keys,
                                     key=key or uuid.uuid4().hex)
        check_normalization(self.settings.triage, "PrimeRLTriageLoss", "prime-rl divides each sample's loss sum "
                            "by rl_scale, the global loss-token count")

    def __call__(self, inputs, **kwargs) -> LossOutputs:
        """One sample's loss (sum over its loss tokens) and metrics (0-dim tensors).

        Raises:
            ValueError: ``inputs.loss_weights`` holds weights other than 0/1 on the loss mask (prime-rl's
                distillation weight streams; not supported with TRIAGE), or extra ``kwargs`` (configure the
                object, or use :func:`triage_loss` as the import path).
        """
        if kwargs:
            raise ValueError(f"PrimeRLTriageLoss got [trainer.loss] kwargs {sorted(kwargs)}: point import_path at "
                             "triage_monitor.hooks.prime_rl.triage_loss to configure by kwargs")
        t_logp, i_logp, adv, mask = inputs.trainer_logprobs, inputs.inference_logprobs, inputs.advantages, \
            inputs.loss_mask.bool()
        w = getattr(inputs, "loss_weights", None)
        if w is not None and bool((w[mask] != 1).any()):
            bad = int(torch.nonzero(mask & (w != 1))[0])
            raise ValueError(f"PrimeRLTriageLoss: inputs.loss_weights[{bad}] = {float(w[bad])}; per-token rl weights "
                             "other than 0/1 are not supported with the TRIAGE loss")
        batch = batch_from_prime_rl(t_logp, i_logp, adv, mask, self.settings.on_invalid)
        triage = self.runtime.controller
        repair_den = (1.0 / triage.config.repair_width) if triage is not None else None
        res = self.compute_loss(batch, old_logp=batch.sampler_logp, agg_mode="token_sum", denominator=1.0,
                                repair_denominator=repair_den, surrogate="dppo_kl",
                                surrogate_kwargs=self.surrogate_kwargs)
        with torch.no_grad():
            metrics = self._default_loss_metrics(t_logp.detach(), i_logp, adv, mask)
        dev = res.loss.device
        if triage is not None:
            metrics.update({f"triage/{k}": torch.tensor(float(v), device=dev)
                            for k, v in own_stats(res.output.stats, self.settings).items()})
        rt = self.runtime
        if reports(rt):
            attach_timings_monitor(rt)
            # rank 0 only: Tensors.compute_stats pools every rank's values, so each is rank 0's (module docstring);
            # float32 like the empty tensor a rank without the key contributes to prime-rl's all-gather
            metrics.update({k: torch.tensor(v, dtype=torch.float32, device=dev)
                            for k, v in rt.framework_metrics().items()})
        return LossOutputs(loss=res.loss, metrics=metrics)

    def _default_loss_metrics(self, t_logp, i_logp, adv, mask) -> dict[str, torch.Tensor]:
        """prime-rl ``default_loss_fn``'s metrics for one sample (0-dim tensors, prime-rl's definitions)."""
        _, (masked, low, high) = dppo_kl_loss(t_logp, i_logp, adv, return_masks=True, **self.surrogate_kwargs)
        log_ratio = t_logp.float() - i_logp.float()
        mismatch_kl = torch.exp(log_ratio) - log_ratio - 1
        keep, drop = mask & ~masked, mask & masked
        return {"masked_mismatch_kl": _safe_mean(mismatch_kl, drop),
                "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep),
                "is_masked": _safe_mean(masked, mask), "is_masked_low": _safe_mean(low, mask),
                "is_masked_high": _safe_mean(high, mask),
                "masked_advantage_positive": _safe_mean(adv > 0, drop),
                "masked_advantage_negative": _safe_mean(adv < 0, drop)}


_HOOKS: dict = {}
_HOOKS_LOCK = threading.Lock()


class _MonitorInterface:
    """The interface of prime-rl's ``Monitor`` base (``monitors/base.py`` L16-57 at ``559b4477``): ``init``,
    ``log`` (a metrics dict goes to :meth:`log_metrics`), ``log_metrics``, ``log_episodes`` and ``finalize``, each a
    coroutine; nothing by default.  The two monitors below override what they read."""

    async def init(self, **kwargs) -> None:
        return None

    async def log(self, data, step=None, kind="train", subset="effective") -> None:
        if isinstance(data, dict):
            await self.log_metrics(data, step)

    async def log_metrics(self, metrics: dict, step=None) -> None:
        return None

    async def log_episodes(self, episodes, step=None, kind="train", subset="effective") -> None:
        return None

    async def finalize(self) -> None:
        return None


class TimingsMonitor(_MonitorInterface):
    """A monitor in prime-rl's fan-out (``prime_rl.monitors.MONITORS``, the list ``monitors.log`` hands every
    metrics dict to: ``src/prime_rl/monitors/__init__.py`` L38, L101-113 at ``559b4477``), with the interface of
    its ``Monitor`` base (``monitors/base.py`` L16-57: ``log(data, step, kind, subset)``, ``log_metrics``,
    ``log_episodes``, ``finalize``).

    The trainer logs its step's timers once the step is over (``train.py`` L679-688: ``time/step``,
    ``time/wait_for_batch``, ``time/load_data``, ``time/broadcast_weights``, ``time/save_ckpt``,
    ``time/forward_backward``, with ``step``: ``progress.step``), after this process's monitor wrote the step's
    row at its optimizer step; this monitor hands them to the hook's runtime for that monitored step (the last
    step the process logged), which puts them in the run's timings table (docs/hooks.md#phase-timings).  Every
    other dict and the episodes are ignored; it never raises."""

    def __init__(self, runtime):
        self.runtime = runtime

    async def log_metrics(self, metrics: dict, step=None) -> None:
        try:
            timers = {k: v for k, v in metrics.items() if k in FRAMEWORKS["prime_rl"].timers}
            last = self.runtime.last_metrics
            if timers and last is not None:
                self.runtime.add_timings(int(last["step"]), timers, "prime_rl")
        except Exception:  # noqa: BLE001 — add_timings says a bad reading itself; never raised into prime-rl
            pass


def attach_timings_monitor(runtime) -> Optional[TimingsMonitor]:
    """Put a :class:`TimingsMonitor` of ``runtime`` into prime-rl's ``prime_rl.monitors.MONITORS`` (once per
    runtime; the trainer has set its monitors up before the first loss call); None when prime-rl's monitors
    module is not loaded in this process."""
    module = sys.modules.get("prime_rl.monitors")
    registered = getattr(module, "MONITORS", None)
    if not isinstance(registered, list):
        return None
    for m in registered:
        if isinstance(m, TimingsMonitor) and m.runtime is runtime:
            return m
    m = TimingsMonitor(runtime)
    registered.append(m)
    return m


#: The step's reward in the orchestrator's metrics: ``train/agg/effective/<agent>/reward/mean``, the mean reward of
#: the agent's traces in the shipped (effective) cohort (``orchestrator/metrics.py`` L177-192, L244-253, L324-335;
#: ``orchestrator.py`` L698-702); with one agent the step line's ``Reward`` (``orchestrator.py`` L880).
REWARD_KEY = re.compile(r"^train/agg/effective/([^/]+)/reward/mean$")

#: The environment variable naming the run directory for :func:`orchestrator_main`.
RUN_DIR_ENV = "TRIAGE_MONITOR_RUN_DIR"


def orchestrator_reward(metrics) -> Optional[float]:
    """The step's reward in a metrics dict of prime-rl's orchestrator (:data:`REWARD_KEY`): the one agent's mean;
    None when the dict has no such key (an eval dict, the trainer's), more than one agent (their trace counts are
    not logged, so no mean over them is recoverable) or a value that is not a finite number."""
    if not isinstance(metrics, dict):
        return None
    found = [v for k, v in metrics.items() if isinstance(k, str) and REWARD_KEY.match(k)]
    return finite_or_none(found[0]) if len(found) == 1 else None


class RewardMonitor(_MonitorInterface):
    """A monitor in the orchestrator's ``prime_rl.monitors.MONITORS`` (interface of ``monitors/base.py`` L16-57) that
    records the step's reward (:func:`orchestrator_reward`) in the run's timings table with a
    :class:`~triage_monitor.rundir.timings_writer.TimingsWriter`; ``open_run(p).steps()`` fills the steps row's ``reward``.

    Steps: the orchestrator's ``progress.step`` (1-indexed, ``orchestrator/types.py`` L27-30; ``progress.step`` + 1
    on resume, ``orchestrator.py`` L321) names the batch it ships (``finalize_train_batch`` L625, the sender starting
    at ``progress.step``, L329); the trainer trains batch s at its own ``progress.step`` s (``trainer/ckpt.py``
    L29-31, its receiver starting there: ``trainer/rl/train.py`` L242-247), one optimizer step per batch, and the
    loss hook's monitored steps count those optimizer steps from 0 in each attempt.  So orchestrator step s is
    monitored step ``s - first_step``, ``first_step`` being the orchestrator's first step of this launch (1, or the
    resumed step).  The orchestrator logs a step when it ships the batch, before the trainer trains it; the timings
    row waits in the table until the step's row is read.  Only the reward is recorded (the orchestrator's
    ``time/step`` is not the trainer's); every other dict and the episodes are ignored; it never raises.

    Args:
        run_dir: the run directory of the loss hook (its ``run_dir``).
        first_step: the orchestrator's ``progress.step`` when its loop starts (1 for a fresh run).
    """

    def __init__(self, run_dir, first_step: int = 1):
        self.writer = TimingsWriter(run_dir, framework="prime_rl")
        self.first_step = int(first_step)

    async def log_metrics(self, metrics: dict, step=None) -> None:
        try:
            reward = orchestrator_reward(metrics)
            if reward is None or step is None or int(step) < self.first_step:
                return
            self.writer.record({}, step=int(step) - self.first_step, framework_step=int(step), reward=reward)
        except Exception:  # noqa: BLE001 — record says a bad reading itself; never raised into prime-rl
            pass

    async def finalize(self) -> None:
        self.writer.close()


def attach_reward_monitor(run_dir, first_step: int = 1) -> Optional[RewardMonitor]:
    """Append a :class:`RewardMonitor` to ``prime_rl.monitors.MONITORS`` of this process (after prime-rl's
    ``monitors.setup``, which refuses a non-empty list: ``monitors/__init__.py`` L58); None when prime-rl's monitors
    module is not loaded."""
    module = sys.modules.get("prime_rl.monitors")
    registered = getattr(module, "MONITORS", None)
    if not isinstance(registered, list):
        return None
    m = RewardMonitor(run_dir, first_step)
    registered.append(m)
    return m


def with_reward_monitor(orchestrator_cls, run_dir):
    """A subclass of prime-rl's ``Orchestrator`` whose ``setup`` (``orchestrator.py`` L195-456: monitors set up at
    L219-228, ``progress.step`` resumed at L321) is followed by :func:`attach_reward_monitor` at the orchestrator's
    first step; ``start`` (L458-461) calls ``setup`` first."""

    class TriageOrchestrator(orchestrator_cls):
        async def setup(self) -> None:
            await super().setup()
            attach_reward_monitor(run_dir, first_step=self.progress.step)

    return TriageOrchestrator


def orchestrator_main() -> None:
    """prime-rl's ``orchestrator`` entry point (``entrypoints/orchestrator.py`` L19-24, ``run_orchestrator``
    ``orchestrator.py`` L1048-1053) with the reward recorded in the run directory named by ``$TRIAGE_MONITOR_RUN_DIR``
    (the loss hook's ``run_dir``): ``TRIAGE_MONITOR_RUN_DIR=<run_dir> python -m triage_monitor.hooks.prime_rl @
    orch.toml`` in place of ``orchestrator @ orch.toml``.

    Raises:
        SystemExit: ``$TRIAGE_MONITOR_RUN_DIR`` is not set.
    """
    run_dir = os.environ.get(RUN_DIR_ENV, "").strip()
    if not run_dir:
        raise SystemExit(f"triage-monitor: set {RUN_DIR_ENV} to the run directory of the prime-rl loss hook")
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.utils.config import cli
    from prime_rl.utils.process import set_proc_title

    set_proc_title("Orchestrator")
    config = cli(OrchestratorConfig)
    from prime_rl.orchestrator.orchestrator import Orchestrator
    from prime_rl.utils.utils import clean_exit

    orchestrator_cls = with_reward_monitor(Orchestrator, run_dir)

    @clean_exit
    async def run_orchestrator(config) -> None:
        await orchestrator_cls(config).start()

    asyncio.run(run_orchestrator(config))


def triage_loss(inputs, **kwargs) -> LossOutputs:
    """The import-path target ``triage_monitor.hooks.prime_rl.triage_loss``, configured by ``[trainer.loss] kwargs``.

    ``kwargs`` are :class:`PrimeRLTriageLoss`'s arguments (``run_dir``, ``triage`` as a table of
    :class:`TriageConfig` fields, ``monitor``, ``dppo_mask_low`` ..., ``alerts``, ``loggers``, ``framework_keys``).
    One hook per distinct kwargs per process, keyed by their canonical JSON (the same key on every rank).

    Raises:
        TypeError: an unknown keyword.  ValueError: from :class:`PrimeRLTriageLoss`.
    """
    blob = json.dumps(kwargs, sort_keys=True, default=str)
    with _HOOKS_LOCK:
        hook = _HOOKS.get(blob)
        if hook is None:
            cfg = dict(kwargs)
            if isinstance(cfg.get("triage"), dict):
                cfg["triage"] = TriageConfig(**cfg["triage"])
            hook = _HOOKS[blob] = PrimeRLTriageLoss(**cfg, key=hashlib.sha1(blob.encode()).hexdigest())
    return hook(inputs)


__all__ = ["PRIME_RL_COMMIT", "DEFAULT_LOSS_METRICS", "LossOutputs", "batch_from_prime_rl", "PrimeRLTriageLoss",
           "TimingsMonitor", "attach_timings_monitor", "triage_loss", "REWARD_KEY", "RUN_DIR_ENV",
           "orchestrator_reward", "RewardMonitor", "attach_reward_monitor", "with_reward_monitor", "orchestrator_main"]
triage_loss_fn = triage_loss   # the import path named by earlier docs


if __name__ == "__main__":
    orchestrator_main()
