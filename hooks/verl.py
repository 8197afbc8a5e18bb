"""verl hook (verl 0.9.1, v1 trainer): TRIAGE as a registered policy loss in the workers, monitoring from the
v1 trainer's TransferQueue batches, verl's ``global_steps`` published to the workers.

Checked against the installed verl 0.9.1 (``trainer/ppo/core_algos.py``, ``workers/utils/losses.py``,
``workers/engine_workers.py``, ``trainer/ppo/v1/trainer_base.py``, ``trainer/main_ppo.py``,
``trainer/ppo/rollout_corr_helper.py``, ``workers/config/model.py``); docs/hooks.md#verl for the lines to copy.

* **Loss.**  verl's worker loss ``workers.utils.losses.ppo_loss`` calls ``get_policy_loss_fn(loss_mode)(
  old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=, config=, rollout_is_weights=)`` per
  micro-batch, all ``(B, T)`` right-padded, after it stored the update's normalisers in
  ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``).
  The rollout log-probs reach a policy loss only in **bypass mode** (``algorithm.rollout_correction.bypass_mode``:
  the trainer sets ``old_log_probs = rollout_log_probs``), so :class:`VerlTriageLoss` reads ``old_log_prob`` as
  the sampler log-prob and ``log_prob`` as the live learner log-prob.  PPO clip ``clip_ratio_low/high``, dual clip
  ``clip_ratio_c``, and verl's ``agg_loss`` normaliser for each ``loss_agg_mode`` (:func:`verl_aggregation`).
  verl's own metrics of that call are kept: ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``
  (verl's ``compute_policy_loss_vanilla`` on the detached tensors) and ``rollout_corr/*`` (verl's
  ``compute_rollout_correction_and_rejection_mask``, called exactly as verl's ``bypass_mode`` loss calls it).
  Beside them the monitor's values of the last step the worker logged (``HookSettings.framework_keys``, default
  the curated set, and ``triage/metrics_step``): verl averages them over micro-batches, data-parallel ranks and
  mini-batches (all equal within one verl step) and logs them as ``actor/triage/<name>``.
* **Reaching the workers.**  verl's registry is per process and nothing is pickled: the module
  :mod:`triage_monitor.hooks.verl_plugin`, named in ``actor_rollout_ref.model.external_lib`` (imported by
  ``HFModelConfig.__post_init__`` in every worker), registers the loss, built from environment variables
  (:func:`settings_from_env`) that Ray hands every worker.
* **Step.**  The ``triage_*`` trainers (:func:`register_trainers`) write verl's ``global_steps`` to
  ``<run_dir>/.verl/<ray job id>/global_steps`` before each step; the loss reads it, so every mini-batch, PPO
  epoch and micro-batch of one verl step is ONE monitored step.  Without that file (verl's own trainer) the
  steps are the worker's optimizer steps (one per mini-batch), said once in the log.
* **Monitoring without the TRIAGE loss** (decoupled mode, verl recomputes ``old_log_probs``): the ``triage_*``
  trainers read ``old_log_probs``, ``rollout_log_probs``, ``response_mask``, ``advantages`` and ``uid`` from the
  TransferQueue after ``_compute_advantage`` (:class:`TriageTrainerMixin`).
* **Phase timings.**  verl's own timers of the step (``timing_raw``, logged as ``timing_s/<name>``: ``gen``,
  ``old_log_prob``, ``ref``, ``reward``, ``adv``, ``update_actor``, ``update_weights``, ``step``, ...) reach the
  ``triage_*`` trainer's ``_compute_metrics``, which verl calls once the step timer has closed; the step's row gets
  them as ``time/<phase>`` (docs/hooks.md#phase-timings): in decoupled mode the trainer's own monitor logs the step
  there, in bypass mode the trainer publishes them in ``<run_dir>/.verl/<job>/timings/<step>.json`` before it
  publishes the next step, and the worker writing the step's row reads them (:func:`publish_timings`).
* **Reward.**  verl's ``critic/score/mean`` (:data:`REWARD_KEY`: ``compute_data_metrics``, which ``_compute_metrics``
  calls) is the step's ``reward`` column, by the same two paths as the timers: the trainer's monitor in decoupled
  mode, ``<run_dir>/.verl/<job>/rewards/<step>.json`` read by the workers in bypass mode.

No metric or controller logic here: conversion to :class:`TokenBatch` and calls into the core.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional, TypedDict

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.rundir.layout import RunLayout
from triage_monitor.rundir.storage import open_store
from triage_monitor.monitor import MonitorConfig
from triage_monitor.rundir.records import new_attempt_id

from .micro_batches import group_ids_from_keys
from .option_strings import check_normalization
from .worker_runtime import HookAdapter, HookSettings, LossHook

log = logging.getLogger("triage_monitor")

#: Environment variables read by :func:`settings_from_env` (in the trainer process and in every worker).
ENV_RUN_DIR = "TRIAGE_MONITOR_RUN_DIR"
ENV_TRIAGE = "TRIAGE_MONITOR_TRIAGE"
#: What verl divides the policy loss by (for the refusal of a normalisation the hook cannot honour).
VERL_NORMALISER = "verl's agg_loss divides by its own global normaliser (loss_agg_mode)"
ENV_MONITOR = "TRIAGE_MONITOR_CONFIG"
ENV_ON_INVALID = "TRIAGE_MONITOR_ON_INVALID"
ENV_ALERTS = "TRIAGE_MONITOR_ALERTS"
ENV_LOGGERS = "TRIAGE_MONITOR_LOGGERS"
ENV_FRAMEWORK_KEYS = "TRIAGE_MONITOR_FRAMEWORK_KEYS"
#: Policy-loss name registered by :mod:`triage_monitor.hooks.verl_plugin`.
LOSS_NAME = "triage"
#: The step's reward in verl's metrics: ``compute_data_metrics`` (``trainer/ppo/metric_utils.py``), called by the v1
#: trainer's ``_compute_metrics``: the mean over the step's non-aborted responses of each response's score, the sum
#: of its ``token_level_scores`` (= ``rm_scores``, the reward function's output before any KL penalty).
REWARD_KEY = "critic/score/mean"
#: verl's v1 trainer modes wrapped by :func:`register_trainers` (registered as ``triage_<mode>``).
TRAINER_MODES = ("sync", "colocate_async", "separate_async")

#: verl ``loss_agg_mode`` → :func:`triage_monitor.triage.loss.agg_loss` mode.
VERL_AGG = {"token-mean": "token_mean", "token-sum": "token_sum", "seq-mean-token-sum": "seq_mean_token_sum",
            "seq-mean-token-sum-norm": "seq_mean_token_sum", "seq-mean-token-mean": "seq_mean_token_mean"}


# ------------------------------------------------------------------ monitoring from a DataProto / TransferQueue
def batch_from_dataproto(data, learner_key: str = "old_log_probs", sampler_key: str = "rollout_log_probs",
                         on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from a verl ``DataProto`` (after old-log-prob recomputation, before the actor update).

    Args:
        data: ``verl.DataProto`` with ``batch[learner_key]``, ``batch[sampler_key]``, ``batch["advantages"]``,
            ``batch["response_mask"]``, all ``(B, T)`` right-padded; optional ``non_tensor_batch["uid"]``
            (group ids).
        learner_key, sampler_key: tensor names (nats).
        on_invalid: see :meth:`TokenBatch.from_padded`.

    Raises:
        KeyError: a required tensor is missing (the message says which verl setting produces it).
    """
    td = data.batch
    _require(td.keys(), learner_key, sampler_key)
    uid = data.non_tensor_batch.get("uid") if getattr(data, "non_tensor_batch", None) is not None else None
    return TokenBatch.from_padded(td[learner_key], td[sampler_key], td["advantages"], td["response_mask"],
                                  group_ids=None if uid is None else group_ids_from_keys(uid),
                                  on_invalid=on_invalid)


def _require(keys, learner_key: str = "old_log_probs", sampler_key: str = "rollout_log_probs") -> None:
    keys = set(keys)
    for key, hint in ((learner_key, "decoupled mode recomputes it; in bypass mode it equals the rollout log-probs"),
                      (sampler_key, "set actor_rollout_ref.rollout.calculate_log_probs=True"),
                      ("advantages", "call after compute_advantage"), ("response_mask", "")):
        if key not in keys:
            raise KeyError(f"verl batch has no {key!r} ({hint}); it has {sorted(keys)}")


def log_dataproto(monitor, step: int, data, extra: Optional[dict] = None, **kw) -> dict[str, Any]:
    """``monitor.log_step(step, batch_from_dataproto(data, **kw), extra)``; returns the metrics."""
    return monitor.log_step(step, batch_from_dataproto(data, **kw), extra=extra)


def batch_from_transfer_queue(fields, tags: Optional[list] = None, on_invalid: str = "raise") -> TokenBatch:
    """TokenBatch from the fields the v1 trainer keeps in its TransferQueue (``tq.kv_batch_get`` output).

    Args:
        fields: TensorDict with ``old_log_probs`` (learner, nats), ``rollout_log_probs`` (sampler, nats),
            ``advantages``, ``response_mask`` — nested (jagged, one row per response) or ``(B, T)`` — and
            optionally the non-tensor ``uid`` (prompt id → group id).
        tags: the ``KVBatchMeta.tags``; rows tagged ``is_padding`` (verl's upsampling to a multiple of the
            data-parallel size) are left out.
        on_invalid: see :meth:`TokenBatch.from_padded`.

    Raises:
        KeyError: a required field is missing (the message names the verl setting).
    """
    _require(fields.keys())
    names = ["old_log_probs", "rollout_log_probs", "advantages", "response_mask"]
    t = {k: fields[k] for k in names}
    if any(v.is_nested for v in t.values()):
        t = {k: v.to_padded_tensor(0.0) if v.is_nested else v for k, v in t.items()}
    mask = t["response_mask"].bool()
    uid = None
    if "uid" in fields.keys():
        raw = fields["uid"]
        uid = list(raw.tolist() if hasattr(raw, "tolist") else raw)
    if tags is not None:
        keep = torch.tensor([not tag.get("is_padding", False) for tag in tags], dtype=torch.bool)
        if not bool(keep.all()):
            t = {k: v[keep.to(v.device)] for k, v in t.items()}
            mask = mask[keep.to(mask.device)]
            uid = None if uid is None else [u for u, k in zip(uid, keep.tolist()) if k]
    return TokenBatch.from_padded(t["old_log_probs"], t["rollout_log_probs"], t["advantages"], mask,
                                  group_ids=None if uid is None else group_ids_from_keys(uid), on_invalid=on_invalid)


# ------------------------------------------------------------------------------------------- settings
def _ray_job_id() -> Optional[str]:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 — no Ray, or not inside a Ray process: no job id
        return None
    return None


def _job_dir(run_dir: str, job: Optional[str]) -> str:
    """The job's shared folder, relative to the run directory (``.verl/<job>``)."""
    return RunLayout.framework_dir("verl", job or f"pid-{os.getpid()}")


def shared_attempt(run_dir: str, job: Optional[str]) -> int:
    """The attempt id shared by every process of one verl job (the trainer and all its Ray workers).

    The first process of Ray job ``job`` to ask draws a new id and publishes it in ``<run_dir>/.verl/<job>/attempt``
    (locally with an atomic link, so that of processes asking at once one wins); the others read it.  On an object
    store, which has no exclusive create, the id is written only when none is there: the trainer asks first, when
    the hook's settings are built, before it starts the workers that read it.  A resumed job is a new Ray job,
    hence a new attempt.
    """
    store = open_store(run_dir)
    rel = f"{_job_dir(run_dir, job)}/attempt"
    if not store.is_local:
        try:
            return int(store.read_bytes(rel).decode())
        except FileNotFoundError:
            store.write_bytes(rel, str(new_attempt_id()).encode())
            return int(store.read_bytes(rel).decode())
    path = store.local(rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"attempt.{os.getpid()}.tmp")
    tmp.write_text(str(new_attempt_id()))
    try:
        os.link(tmp, path)              # atomic: fails when another process published first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return int(path.read_text())


def _json_env(env, name: str) -> Optional[dict]:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        val = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}={raw!r} is not JSON ({exc}); expected an object of field: value") from None
    if not isinstance(val, dict):
        raise ValueError(f"{name}={raw!r}: expected a JSON object of field: value")
    return val


def settings_from_env(environ=None) -> HookSettings:
    """The hook settings of a verl job, from environment variables (the same in the trainer and every worker).

    ``TRIAGE_MONITOR_RUN_DIR``: the shared run directory (unset: no monitoring).
    ``TRIAGE_MONITOR_TRIAGE``: a JSON object of :class:`TriageConfig` fields (unset or ``{}``: the published
    configuration); ``off``: Gate, TIS and Repair off — the loss is verl's own PPO loss, the hook only monitors.
    ``TRIAGE_MONITOR_CONFIG``: a JSON object of :class:`MonitorConfig` fields.
    ``TRIAGE_MONITOR_ON_INVALID``: ``raise`` (default) or ``quarantine``.
    ``TRIAGE_MONITOR_ALERTS``: ``default`` (unset: the shipped rules), ``off``, or a rule file (TOML / YAML) —
    read now, so a missing or bad file fails at start-up.
    ``TRIAGE_MONITOR_LOGGERS``: a JSON list of tracker specs (``'["tensorboard", {"kind": "mlflow", ...}]'``) or
    comma-separated kind names; rank 0's monitor builds them.
    ``TRIAGE_MONITOR_FRAMEWORK_KEYS``: what goes into verl's metrics: ``curated`` (default), ``all``, or metric
    names (JSON list or comma-separated).

    Raises:
        ValueError: a variable that does not parse, naming it and its value (or a bad config field); a
            ``normalization`` the hook cannot honour in ``TRIAGE_MONITOR_TRIAGE`` (``"global_token"``).
    """
    from .option_strings import parse_alerts, parse_framework_keys, parse_loggers

    env = os.environ if environ is None else environ
    on_invalid = (env.get(ENV_ON_INVALID) or "raise").strip()
    if on_invalid not in ("raise", "quarantine"):
        raise ValueError(f"{ENV_ON_INVALID}={on_invalid!r}: use 'raise' or 'quarantine'")
    alerts = parse_alerts(env.get(ENV_ALERTS), ENV_ALERTS)
    loggers = parse_loggers(env.get(ENV_LOGGERS), ENV_LOGGERS)
    keys = parse_framework_keys(env.get(ENV_FRAMEWORK_KEYS), ENV_FRAMEWORK_KEYS)
    run_dir = (env.get(ENV_RUN_DIR) or "").strip() or None
    raw = (env.get(ENV_TRIAGE) or "").strip()
    triage = None if raw.lower() == "off" else TriageConfig(**(_json_env(env, ENV_TRIAGE) or {}))
    check_normalization(triage, ENV_TRIAGE, VERL_NORMALISER)
    mon = _json_env(env, ENV_MONITOR)
    job = _ray_job_id()
    try:
        import verl
        version = verl.__version__
    except ImportError:
        version = None
    return HookSettings(run_dir=run_dir, monitor=MonitorConfig.from_dict(mon) if mon else MonitorConfig(),
                        triage=triage, manifest={"framework": "verl", "verl_version": version},
                        on_invalid=on_invalid,
                        attempt=_attempt(run_dir, job), key=f"verl-{job or os.getpid()}",
                        alerts=alerts, loggers=loggers, framework_keys=keys)


def _attempt(run_dir: Optional[str], job: Optional[str]) -> int:
    if run_dir is None:
        return new_attempt_id()
    try:
        return shared_attempt(run_dir, job)
    except OSError as exc:     # monitoring I/O never stops the job: this process gets an attempt of its own
        log.warning("triage-monitor: cannot share the attempt id in %s (%s); this process uses its own", run_dir, exc)
        return new_attempt_id()


# ---------------------------------------------------------------------------------------- the step
def publish_step(run_dir: str, step: int, job: Optional[str] = None) -> None:
    """Write verl's ``global_steps`` for this job's workers (``<run_dir>/.verl/<job>/global_steps``, replaced whole)."""
    try:
        _write_text(run_dir, f"{_job_dir(run_dir, job if job is not None else _ray_job_id())}/global_steps",
                    str(int(step)))
    except OSError as exc:     # monitoring I/O never stops the job; the workers then count optimizer steps
        log.warning("triage-monitor: cannot publish global_steps=%s in %s (%s)", step, run_dir, exc)


def _write_text(run_dir: str, rel: str, text: str) -> None:
    open_store(run_dir).write_bytes(rel, text.encode())


def _read_text(run_dir: str, rel: str) -> str:
    return open_store(run_dir).read_bytes(rel).decode()


def read_step(run_dir: Optional[str], job: Optional[str] = None) -> Optional[int]:
    """verl's ``global_steps`` as last published by the trainer of this job; None when none was published."""
    if run_dir is None:
        return None
    try:
        return int(_read_text(run_dir, f"{_job_dir(run_dir, job if job is not None else _ray_job_id())}/global_steps"))
    except (OSError, ValueError):
        return None


def publish_timings(run_dir: str, step: int, timing_raw: dict, job: Optional[str] = None,
                    reward: Optional[float] = None) -> None:
    """Publish verl's timers of ``step`` (``timing_raw``: verl's names, seconds) for the job's workers, mapped onto
    the phases (``<run_dir>/.verl/<job>/timings/<step>.json``, written atomically; :func:`read_timings`), and the
    step's reward (verl's ``critic/score/mean``, :data:`REWARD_KEY`; ``rewards/<step>.json``,
    :func:`read_reward`) when it is a finite number.  Called by the ``triage_*`` trainers in bypass mode, before
    they publish the next step.  Never raises."""
    from triage_monitor.metrics.timings import phase_times
    from triage_monitor.rundir.timings_writer import finite_or_none

    jd = _job_dir(run_dir, job if job is not None else _ray_job_id())
    try:
        times = phase_times(timing_raw, "verl")
        _write_text(run_dir, f"{jd}/timings/{int(step)}.json", json.dumps(times))
        value = finite_or_none(reward)
        if value is not None:
            _write_text(run_dir, f"{jd}/rewards/{int(step)}.json", json.dumps(value))
    except (OSError, ValueError) as exc:     # monitoring I/O never stops the job
        log.warning("triage-monitor: cannot publish the phase timings of step %s in %s (%s)", step, run_dir, exc)


def read_reward(run_dir: str, step: int, job: Optional[str] = None) -> Optional[float]:
    """The reward the trainer published for ``step`` (:func:`publish_timings`); None when none was."""
    try:
        return float(json.loads(_read_text(run_dir, f"{_job_dir(run_dir, job if job is not None else _ray_job_id())}/"
                                                    f"rewards/{int(step)}.json")))
    except (OSError, ValueError, TypeError):
        return None


def read_timings(run_dir: str, step: int, job: Optional[str] = None) -> Optional[dict]:
    """``{phase: seconds}`` the trainer published for ``step`` (:func:`publish_timings`); None when none was."""
    try:
        return json.loads(_read_text(run_dir, f"{_job_dir(run_dir, job if job is not None else _ray_job_id())}/"
                                               f"timings/{int(step)}.json"))
    except (OSError, ValueError):
        return None


#: Seconds between two looks of a worker at the published step (its flush thread).
STEP_POLL_S = 0.5
DONE = "done"
_WATCHED: set = set()
_WATCH_LOCK = threading.Lock()


def watch_published_steps(runtime, run_dir: str, job: Optional[str] = None) -> None:
    """Start (once per process and hook) the worker thread that writes a step as soon as the trainer publishes the
    next one, and on ``done`` (:func:`finish_workers`) writes the last step, closes this process's monitor (its
    writer drained) and acknowledges in ``<run_dir>/.verl/<job>/flushed/<pid>``.  Ray ends worker processes without running ``atexit``, so the
    last step would otherwise be lost."""
    job = job if job is not None else _ray_job_id()
    with _WATCH_LOCK:
        if runtime.settings.key in _WATCHED:
            return
        _WATCHED.add(runtime.settings.key)
    jd = _job_dir(run_dir, job)
    # the step's phase timings and reward, published by the trainer once verl's step timer closed (publish_timings)
    runtime.timings_source = lambda step: read_timings(run_dir, step, job)
    runtime.reward_source = lambda step: read_reward(run_dir, step, job)
    try:
        _write_text(run_dir, f"{jd}/workers/{os.getpid()}", "")
    except OSError as exc:     # monitoring I/O never stops the job
        runtime._warn_once("verl-watch", "triage-monitor: cannot register this worker in %s (%s); its last step "
                           "may be lost", jd, exc)

    def loop():
        while not runtime.closed:
            time.sleep(STEP_POLL_S)
            try:
                txt = _read_text(run_dir, f"{jd}/global_steps").strip()
            except OSError:
                continue
            try:
                if txt == DONE:
                    runtime.close()         # writes the last step, drains the writer, finishes run.json
                    _write_text(run_dir, f"{jd}/flushed/{os.getpid()}", "")
                    return
                # look and flush under the runtime's lock: a loss call of the new step may be buffering at the
                # same moment (it flushes the old step itself); flushing after it would cut the new step in two
                with runtime._lock:
                    acc = runtime._acc
                    if (acc is not None and acc.step is not None and txt.lstrip("-").isdigit()
                            and int(txt) != acc.step):
                        runtime.flush()
            except Exception as exc:  # noqa: BLE001 — monitoring never breaks the training job
                runtime._warn_once("verl-watch", "triage-monitor: writing a step failed (%s: %s); training continues",
                                   type(exc).__name__, exc)

    threading.Thread(target=loop, daemon=True, name="triage-monitor-verl-steps").start()


def finish_workers(run_dir: str, job: Optional[str] = None, timeout: float = 60.0) -> bool:
    """Publish ``done`` to the job's workers and wait until every worker that monitored has written its last step.

    Returns True when all acknowledged within ``timeout`` seconds; otherwise warns (naming the missing worker
    pids) and returns False.  Called by the ``triage_*`` trainers at the end of ``fit``.
    """
    jd = _job_dir(run_dir, job if job is not None else _ray_job_id())
    store = open_store(run_dir)
    try:
        _write_text(run_dir, f"{jd}/global_steps", DONE)
    except OSError as exc:
        log.warning("triage-monitor: cannot tell the verl workers to write their last step (%s)", exc)
        return False
    deadline = time.monotonic() + timeout
    while True:
        workers = {e.name for e in store.listdir(f"{jd}/workers")}
        done = {e.name for e in store.listdir(f"{jd}/flushed")}
        if workers <= done:
            return True
        if time.monotonic() > deadline:
            log.warning("triage-monitor: verl workers %s did not write their last step within %.0f s",
                        sorted(workers - done), timeout)
            return False
        time.sleep(STEP_POLL_S / 2)


# ------------------------------------------------------------------------------------ aggregation
def _info(config, name: str):
    info = getattr(config, "global_batch_info", None) or {}
    return info.get(name)


def _cfg(config, name: str, default=None):
    v = config.get(name, None) if hasattr(config, "get") else getattr(config, name, None)
    return default if v is None else v


class VerlAggregation(TypedDict):
    """:func:`verl_aggregation`: verl's normaliser as keywords of :func:`~triage_monitor.triage.loss.triage_policy_loss`."""

    agg_mode: str
    denominator: float
    loss_scale: float


def verl_aggregation(loss_agg_mode: str, response_mask: torch.Tensor, config) -> VerlAggregation:
    """verl's ``agg_loss`` normaliser as :func:`~triage_monitor.triage.loss.triage_policy_loss` arguments.

    ``loss = Σ ℓ·mask / D · dp_size`` with ``D``: ``token-mean`` ``batch_num_tokens``; ``token-sum`` 1;
    ``seq-mean-token-sum`` / ``seq-mean-token-mean`` ``global_batch_size``; ``seq-mean-token-sum-norm``
    ``global_batch_size · loss_scale_factor`` (default: the micro-batch's padded width ``T``).  Where verl's
    ``config.global_batch_info`` lacks a count (a loss called outside ``ppo_loss``), the micro-batch's own count
    is used, as verl does (and, as verl, that needs ``dp_size`` 1).

    Args:
        loss_agg_mode: verl's ``actor.loss_agg_mode``.
        response_mask: ``(B, T)`` mask of the micro-batch.
        config: verl's ``ActorConfig`` (``global_batch_info``, ``loss_scale_factor``).

    Returns:
        :class:`VerlAggregation` ``{"agg_mode", "denominator", "loss_scale"}``.

    Raises:
        ValueError: unknown ``loss_agg_mode``, or ``dp_size > 1`` without the global count (verl's own error).
    """
    if loss_agg_mode not in VERL_AGG:
        raise ValueError(f"verl loss_agg_mode {loss_agg_mode!r} is not one of {sorted(VERL_AGG)}")
    mask = response_mask.bool()
    dp = int(_info(config, "dp_size") or 1)

    def global_count(name, local):
        v = _info(config, name)
        if v is None:
            if dp > 1:
                raise ValueError(f"(global) {name} is required when dp_size > 1 (verl's agg_loss)")
            return float(local)
        return float(v)

    if loss_agg_mode == "token-mean":
        den = global_count("batch_num_tokens", mask.sum())
    elif loss_agg_mode == "token-sum":
        den = 1.0
    else:
        den = global_count("global_batch_size", (mask.sum(-1) > 0).sum())
        if loss_agg_mode == "seq-mean-token-sum-norm":
            lsf = _info(config, "loss_scale_factor")
            lsf = _cfg(config, "loss_scale_factor") if lsf is None else lsf
            den *= float(mask.shape[-1] if lsf is None else lsf)
    return {"agg_mode": VERL_AGG[loss_agg_mode], "denominator": den, "loss_scale": float(dp)}


class RolloutCorrSettings(TypedDict):
    """:func:`_rollout_corr_settings`: verl's rollout-correction options (keywords of its correction helper)."""

    rollout_is: Any
    rollout_is_threshold: Any
    rollout_is_batch_normalize: Any


def _rollout_corr_settings(config) -> RolloutCorrSettings:
    pl = _cfg(config, "policy_loss")
    rc = _cfg(pl, "rollout_correction") if pl is not None else None
    get = (lambda k, d=None: _cfg(rc, k, d)) if rc is not None else (lambda k, d=None: d)
    if get("rollout_rs") is not None:
        raise ValueError(f"actor.policy_loss.rollout_correction.rollout_rs={get('rollout_rs')!r}: the TRIAGE loss does "
                         "not reject tokens (its Gate down-weights them); set it to null")
    if get("loss_type", "ppo_clip") != "ppo_clip":
        raise ValueError(f"actor.policy_loss.rollout_correction.loss_type={get('loss_type')!r}: the TRIAGE loss is "
                         "PPO-clip; set loss_type=ppo_clip")
    return {"rollout_is": get("rollout_is"), "rollout_is_threshold": get("rollout_is_threshold", 2.0),
            "rollout_is_batch_normalize": get("rollout_is_batch_normalize", False)}


# ------------------------------------------------------------------------------------------- the loss
class VerlTriageLoss(LossHook):
    """verl ``PolicyLossFn`` computing the TRIAGE loss (bypass mode, module docstring); carries settings only.

    Call signature and return value are verl's: ``(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``, tensors ``(B, T)``; ``old_log_prob`` is the
    sampler log-prob (bypass mode), ``log_prob`` the live learner log-prob, both nats.  With ``settings.triage``
    None (``TRIAGE_MONITOR_TRIAGE=off``) the value equals verl's ``compute_policy_loss_vanilla``.

    Args:
        settings: :class:`HookSettings` (default: :func:`settings_from_env`).

    Raises (on call):
        ValueError: ``rollout_is_weights`` given (decoupled mode: the sampler log-probs are not here), an
            unknown ``loss_agg_mode``, rejection sampling or REINFORCE configured in
            ``policy_loss.rollout_correction``, ``clip_ratio_c <= 1``.
    """

    def __init__(self, settings: Optional[HookSettings] = None):
        self.settings = settings if settings is not None else settings_from_env()
        check_normalization(self.settings.triage, "VerlTriageLoss", VERL_NORMALISER)

    def __call__(self, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                 config: Any = None, rollout_is_weights=None):
        if config is None:
            raise ValueError("verl passes the actor config to a policy loss; got config=None")
        if rollout_is_weights is not None:
            raise ValueError("the TRIAGE loss got rollout_is_weights: verl is in decoupled mode, where the loss never "
                             "sees the rollout log-probs; set algorithm.rollout_correction.bypass_mode=True")
        rc = _rollout_corr_settings(config)
        agg = verl_aggregation(loss_agg_mode, response_mask, config)
        clip = float(_cfg(config, "clip_ratio", 0.2))
        dual = float(_cfg(config, "clip_ratio_c", 3.0))
        if dual <= 1.0:
            raise ValueError(f"actor.clip_ratio_c={dual}: verl's dual clip needs a value > 1")
        mask = response_mask.bool()
        batch = TokenBatch.from_padded(log_prob, old_log_prob, advantages, mask, on_invalid=self.settings.on_invalid)
        ctrl = self.controller
        gbs = _info(config, "global_batch_size")
        rep_den = None
        if ctrl is not None and ctrl.config.repair and gbs is not None:
            # verl gives no global Repair segment count: this micro-batch's count scaled by its share of the
            # mini-batch's responses (docs/hooks.md#verl)
            rep_den = ctrl.repair_segment_count(batch) * float(gbs) / (mask.shape[0] * agg["loss_scale"])
        res = self.compute_loss(batch, old_logp=batch.sampler_logp, framework_step=self._framework_step(),
                                clip_low=float(_cfg(config, "clip_ratio_low", clip)),
                                clip_high=float(_cfg(config, "clip_ratio_high", clip)), dual_clip=dual,
                                repair_denominator=rep_den, **agg)
        metrics = verl_metrics(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rc)
        if ctrl is not None:
            metrics.update({f"triage/{k}": float(v) for k, v in res.output.stats.items()})
        # the monitor's values of the last step this worker logged (the previous verl step: this call's step is
        # logged when it closes), all belonging to triage/metrics_step; a name also in the controller's statistics
        # (gate_downweighted_frac) takes the monitored step's value
        metrics.update(self.framework_metrics())
        # detached statistics only: the result's per-token tensors (and the live log-probs' graph) are not kept
        # across the optimizer step
        self._live_last = {"loss": float(res.loss.detach()), "policy_loss": float(res.policy_loss.detach()),
                           "n_tokens": int(res.batch.num_tokens), "stats": dict(res.output.stats),
                           "gate_weight_min": float(res.output.gate_weights.min()) if res.batch.num_tokens else
                           float("nan")}
        return res.loss, metrics

    @property
    def last(self) -> Optional[dict]:
        """Detached statistics of this object's last call in this process (``loss``, ``policy_loss``,
        ``n_tokens``, the controller's ``stats``, ``gate_weight_min``); None before the first call."""
        return getattr(self, "_live_last", None)

    def __getstate__(self):
        return {"settings": self.settings}

    def _framework_step(self) -> Optional[int]:
        if self.settings.run_dir is None:
            return None
        step = read_step(self.settings.run_dir)
        if step is not None:
            watch_published_steps(self.runtime, self.settings.run_dir)
        if step is None:
            self.runtime._warn_once(
                "verl-step", "triage-monitor: verl's global_steps is not published in %s (the trainer is not a "
                "triage_* trainer): monitored steps count this worker's optimizer steps, one per mini-batch. Fix: "
                "trainer.v1.trainer_mode=triage_sync (docs/hooks.md#verl)", self.settings.run_dir)
        return step


def verl_metrics(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_corr: RolloutCorrSettings) -> dict[str, Any]:
    """verl's own metrics of a PPO loss call in bypass mode, computed by verl's functions on detached tensors.

    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` from ``compute_policy_loss_vanilla``
    and ``rollout_corr/*`` from ``compute_rollout_correction_and_rejection_mask(old_log_prob=log_prob,
    rollout_log_prob=old_log_prob, ...)`` — what verl's ``bypass_mode`` loss logs (none when the micro-batch
    has no valid token, where verl's helper would raise).
    """
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    with torch.no_grad():
        lp = log_prob.detach()
        _, metrics = compute_policy_loss_vanilla(old_log_prob=old_log_prob, log_prob=lp, advantages=advantages,
                                                 response_mask=response_mask, loss_agg_mode=loss_agg_mode,
                                                 config=config, rollout_is_weights=None)
        if bool(response_mask.any()):
            _, _, rc_metrics = compute_rollout_correction_and_rejection_mask(
                old_log_prob=lp, rollout_log_prob=old_log_prob, response_mask=response_mask, **rollout_corr)
            metrics.update(rc_metrics)
    return metrics


def register(settings: Optional[HookSettings] = None, name: str = LOSS_NAME,
             as_bypass_mode: bool = False) -> VerlTriageLoss:
    """Register the TRIAGE loss in verl's policy-loss registry of this process and return it.

    Args:
        settings: default :func:`settings_from_env`.
        name: registry name; select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>``.
        as_bypass_mode: also register it as ``"bypass_mode"`` (verl's legacy ``RayPPOTrainer`` forces that loss
            mode in bypass mode; the v1 trainer keeps the configured one).

    Raises:
        ImportError: verl is not installed.
    """
    from verl.trainer.ppo.core_algos import register_policy_loss

    fn = VerlTriageLoss(settings)
    register_policy_loss(name)(fn)
    if as_bypass_mode:
        register_policy_loss("bypass_mode")(fn)
    return fn


# ------------------------------------------------------------------------------------------ the trainer
class VerlBatchMonitor(HookAdapter):
    """Monitoring of the v1 trainer's batches in the trainer process (decoupled mode): settings only."""

    def __init__(self, settings: HookSettings):
        self.settings = settings

    def record(self, step: int, fields, tags=None) -> None:
        """Buffer one batch (``tq.kv_batch_get`` fields, :func:`batch_from_transfer_queue`) under ``step``."""
        self.runtime.record(step, batch_from_transfer_queue(fields, tags, self.settings.on_invalid))


def _bypass(config) -> bool:
    rc = config.algorithm.get("rollout_correction", None)
    return bool(rc and rc.get("bypass_mode", False))


class TriageTrainerMixin:
    """Mixed into verl's v1 trainers by :func:`register_trainers` (``trainer.v1.trainer_mode=triage_<mode>``).

    * Before each step, publishes ``global_steps`` to the workers (:func:`publish_step`); at the end of ``fit``
      has them write their last step (:func:`finish_workers`).
    * Decoupled mode: after ``_compute_advantage`` reads the step's learner (``old_log_probs``) and sampler
      (``rollout_log_probs``) log-probs, advantages, mask and ``uid`` from the TransferQueue; in ``_compute_metrics``
      (verl calls it once the step timer has closed) logs them as ONE monitored step per ``global_steps`` (also with
      ``parameter_sync_step > 1``) with verl's timers of the step (``timing_raw``) as its phase timings; the step's
      metrics selected by ``TRIAGE_MONITOR_FRAMEWORK_KEYS`` (default the curated set) are added to verl's logged
      metrics as ``triage/<name>``, with ``triage/metrics_step``.  In bypass mode the batch holds no learner
      log-probs: the TRIAGE loss monitors inside the workers, and ``_compute_metrics`` publishes the step's timers
      for them (:func:`publish_timings`).
    * At construction: raises ``ValueError`` for ``policy_loss.loss_mode=triage`` without bypass mode or without
      ``rollout.calculate_log_probs``; warns when nothing would be monitored.
    """

    base_mode = "sync"

    def __init__(self, config):
        from omegaconf import open_dict

        with open_dict(config):
            config.trainer.v1.trainer_mode = self.base_mode   # verl branches on the mode name ("sync" ...)
        check_config(config)
        self.triage_settings = settings_from_env()
        self.triage_bypass = _bypass(config)
        self.triage_monitor = (VerlBatchMonitor(self.triage_settings)
                               if self.triage_settings.run_dir is not None and not self.triage_bypass else None)
        super().__init__(config)

    def step(self, metrics: dict, timing_raw: dict):
        if self.triage_settings.run_dir is not None:
            publish_step(self.triage_settings.run_dir, self.global_steps)
        return super().step(metrics, timing_raw)

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        out = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        self.triage_log_step(global_steps, metrics, timing_raw)
        return out

    def triage_log_step(self, step: int, metrics: dict, timing_raw: dict) -> None:
        """The step is over (verl's step timer closed, its timers in ``timing_raw``): decoupled mode logs the
        monitored step with them as phase timings and adds its ``framework_keys`` to verl's ``metrics``; bypass
        mode publishes them for the workers (:func:`publish_timings`).  Never raises."""
        reward = metrics.get(REWARD_KEY) if hasattr(metrics, "get") else None
        try:
            if self.triage_monitor is not None:
                self.triage_monitor.runtime.add_timings(step, dict(timing_raw or {}), "verl")
                self.triage_monitor.runtime.add_reward(step, reward)
                # this step's own values (no lag: the trainer logs the step it has just closed), the framework_keys
                # selection as triage/<name> and triage/metrics_step; verl logs them under its global_steps
                if self.triage_monitor.flush() is not None:
                    metrics.update(self.triage_monitor.framework_metrics())
            elif self.triage_settings.run_dir is not None and self.triage_bypass:
                publish_timings(self.triage_settings.run_dir, step, dict(timing_raw or {}), reward=reward)
        except Exception as exc:  # noqa: BLE001 — monitoring never stops the training job
            log.warning("triage-monitor: logging step %s failed (%s: %s); training continues", step,
                        type(exc).__name__, exc)

    def fit(self, *args, **kwargs):
        try:
            return super().fit(*args, **kwargs)
        finally:
            if self.triage_monitor is not None:
                self.triage_monitor.close()
            if self.triage_settings.run_dir is not None:
                finish_workers(self.triage_settings.run_dir)

    def _compute_advantage(self, batch, metrics: dict):
        if self.triage_monitor is None:
            return super()._compute_advantage(batch, metrics)
        import transfer_queue as tq

        fields = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                 select_fields=["old_log_probs", "rollout_log_probs", "response_mask", "uid"])
        out = super()._compute_advantage(batch, metrics)
        fields["advantages"] = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                               select_fields=["advantages"])["advantages"]
        self.triage_monitor.record(self.global_steps, fields, batch.tags)
        return out


def check_config(config) -> None:
    """Settings the TRIAGE loss / monitoring cannot work with: a clear error now rather than wrong records later.

    Raises:
        ValueError: ``actor.policy_loss.loss_mode=triage`` without ``algorithm.rollout_correction.bypass_mode=True``
            or without ``actor_rollout_ref.rollout.calculate_log_probs=True``.
    """
    arr = config.actor_rollout_ref
    loss_mode = arr.actor.policy_loss.get("loss_mode", "vanilla")
    if not arr.rollout.get("calculate_log_probs", False):
        raise ValueError("triage-monitor needs the sampler log-probs: set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True")
    if loss_mode == LOSS_NAME and not _bypass(config):
        raise ValueError("actor_rollout_ref.actor.policy_loss.loss_mode=triage needs "
                         "algorithm.rollout_correction.bypass_mode=True (only then does the loss see the sampler "
                         "log-probs)")
    if _bypass(config) and loss_mode != LOSS_NAME:
        log.warning("triage-monitor: bypass mode with loss_mode=%s: verl recomputes no learner log-probs, so nothing "
                    "is monitored; use loss_mode=triage (TRIAGE_MONITOR_TRIAGE=off for verl's own PPO loss)", loss_mode)


def register_trainers() -> list[str]:
    """Register ``triage_sync``, ``triage_colocate_async``, ``triage_separate_async`` with verl's
    ``register_trainer``: verl's own v1 trainers with :class:`TriageTrainerMixin`.  Returns the names.

    Raises:
        ImportError: verl's v1 trainer does not import (it needs ``transfer_queue``).
    """
    from verl.trainer.ppo.v1 import trainer_base as tb

    names: list[str] = []
    for mode in TRAINER_MODES:
        name = f"triage_{mode}"
        if name not in tb.TRAINER_REGISTRY:
            base = tb.get_trainer_cls(mode)
            cls = type(f"Triage{base.__name__}", (TriageTrainerMixin, base),
                       {"base_mode": mode, "__module__": __name__, "__doc__": TriageTrainerMixin.__doc__})
            tb.register_trainer(name)(cls)
        names.append(name)
    return names


__all__ = ["batch_from_dataproto", "log_dataproto", "batch_from_transfer_queue", "settings_from_env",
           "shared_attempt", "publish_step", "read_step", "publish_timings", "read_timings", "read_reward", "REWARD_KEY", "watch_published_steps", "finish_workers", "verl_aggregation", "VerlAggregation", "verl_metrics", "VerlTriageLoss",
           "register", "VerlBatchMonitor", "TriageTrainerMixin", "check_config", "register_trainers"]
