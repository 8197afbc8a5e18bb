"""Miles hook: the TRIAGE loss as Miles' ``--custom-loss-function-path`` (docs/hooks.md#miles).

Miles (radixark/miles; read at commit ``31f1ca96``, 2026-08-21) is derived from slime and keeps slime's call: with
``--loss-type custom_loss --custom-loss-function-path mymod.triage_loss`` its ``loss_function``
(``miles/backends/training_utils/loss.py`` L126-228) calls ``triage_loss(args, batch, logits, sum_of_sample_mean)
-> (loss, log)`` per micro-batch, on the Megatron backend and on the FSDP one alike, with slime's batch (lists of
per-sample response tensors: ``rollout_log_probs``, ``log_probs``, ``advantages``, ``loss_masks``,
``rollout_mask_sums``).  So :class:`MilesTriageLoss` is :class:`~triage_monitor.hooks.slime.SlimeTriageLoss` with
what Miles does differently (all at ``31f1ca96``):

* **Where its functions live**: ``loss_hub/logit_processors.get_log_probs_and_entropy`` (returns a dict; takes
  ``max_seq_lens`` for ``--qkv-format bshd`` and ``entropy_requires_grad``; no top-p replay),
  ``loss_hub/math_utils`` (``compute_policy_loss`` with the log-ratio clamped to ±20 as ours,
  ``compute_ess_ratio_contribution``, ``compute_approx_kl``), ``loss_hub/corrections`` (``vanilla_tis_function``,
  ``icepop_function``).
* **Parallel state**: Miles' own ``get_parallel_state()`` (``training_utils/parallel.py``: ``tp``, ``cp``,
  ``intra_dp_cp``, ``indep_dp`` groups, the same for both backends) instead of Megatron's ``mpu``.  Tensor-parallel
  rank 0 records; the monitor syncs over ``intra_dp_cp`` (the group ``aggregate_train_losses`` reduces over).
* **The loss**: slime's default policy loss, plus, under ``--use-tis`` or ``--get-mismatch-metrics``, Miles'
  truncated importance-sampling weights on the per-token loss (``losses.py`` L243-282): the hook reproduces them
  with our corrections — ``vanilla_tis_function`` = :func:`~triage_monitor.triage.corrections.tis_weights`, ``icepop_function``
  (``--custom-tis-function-path miles.backends.training_utils.loss_hub.corrections.icepop_function``) =
  :func:`~triage_monitor.triage.corrections.icepop_weights` — on ``[--tis-clip-low, --tis-clip]``, so with Gate, TIS and
  Repair off the loss is Miles' ``policy_loss_function``'s in these cases too.
* **Its metrics** (``losses.py`` L362-400): ``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``, ``ppo_kl``,
  ``ess_ratio``, ``train_rollout_logprob_abs_diff`` (old − rollout, the old being the rollout's own log-probs under
  ``--use-rollout-logprobs``), ``train_rollout_kl`` and ``ois`` / ``tis`` / ``tis_clipfrac`` / ``tis_abs``, computed
  with Miles' functions as ``policy_loss_function`` computes them.
* **Its step reduction** (``log_utils.aggregate_train_losses`` L439-488): the micro-batches' sums all-reduced over
  ``intra_dp_cp``, divided by the step's rollout count (Megatron, ``model.py`` L651-655), by the summed first entry
  of ``values`` — the micro-batches' sample counts (FSDP, ``fsdp_utils/actor.py`` L554) —, or by the summed token
  counts (``--calculate-per-token-loss``).  The hook hands each of ``framework_keys`` on every micro-batch as value ×
  the micro-batch's part of that divisor (its rollouts' share ``sum_of_sample_mean(1)``, its sample count, its token
  count), so the log shows the monitor's value of the step before; ``triage/alerts_active`` (the reporting rank's
  only) is left out when there is more than one data-parallel rank.

Refused on the first call (``ValueError`` naming the option): a custom TIS function other than Miles' ``icepop``,
a custom pg-loss reducer, OPSM, ``--use-kl-loss``, ``--advantage-estimator gspo``, context parallelism (or
``--allgather-cp``), multi-LoRA, independent data-parallel replicas (``indep_dp``), and TRIAGE's TIS together with
Miles' (``TriageConfig(tis=True)`` with ``--use-tis`` / ``--get-mismatch-metrics``).

Miles is not on PyPI: CI tests this module against Miles' call site, formulas, step reduction and dump writer
transcribed in tests/miles_contract.py (commit cited there); scripts/check_miles_source.py runs it against a checkout.
"""

from __future__ import annotations

from typing import Optional

import torch

from triage_monitor.triage.corrections import icepop_weights, tis_weights
from triage_monitor.monitor import ALERT_STATE
from triage_monitor.alerting.trackers import PREFIX, framework_values

from .loss_hook_options import reports
from .slime import SlimeTriageLoss, attach_perf_timings, old_log_probs, triage_log

#: The commit the hook and its contract tests were checked against.
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

#: Miles' ICEPOP correction, the one custom TIS function the hook reproduces.
ICEPOP_PATH = "miles.backends.training_utils.loss_hub.corrections.icepop_function"
#: Where Miles' actor logs its metrics, the rollout's ``perf/<name>_time`` among them (``log_perf_data_raw``,
#: ``miles/utils/train_metric_utils.py`` L14-62 at 31f1ca96; slime's names, slime's phase mapping).
MILES_LOG_MODULE = "miles.utils.tracking_utils.tracking"

#: Miles arguments the TRIAGE loss cannot honour: (attribute, value that is fine, why).
_UNSUPPORTED = (
    ("custom_pg_loss_reducer_function_path", None, "the reduction is Miles' per-rollout mean or masked sum"),
    ("use_opsm", False, "OPSM masking is not part of the TRIAGE loss"),
    ("use_kl_loss", False, "the KL-to-reference loss term is not part of the TRIAGE loss"),
    ("allgather_cp", False, "context parallelism gives each rank a slice of every response"),
    ("multi_lora", False, "multi-LoRA normalises per adapter at the optimizer step"),
)


def miles_is_correction(args) -> Optional[str]:
    """The importance-sampling correction Miles' own loss applies: None, ``"tis"`` (``vanilla_tis_function``, under
    ``--use-tis`` or ``--get-mismatch-metrics`` without a custom function) or ``"icepop"`` (``icepop_function``).

    Raises:
        ValueError: a ``--custom-tis-function-path`` other than Miles' ``icepop_function``.
    """
    if not (getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)):
        return None
    path = getattr(args, "custom_tis_function_path", None)
    if path is None:
        return "tis"
    if path == ICEPOP_PATH:
        return "icepop"
    from miles.backends.training_utils.loss_hub.corrections import icepop_function
    from miles.utils.misc import load_function

    if load_function(path) is icepop_function:
        return "icepop"
    raise ValueError(f"triage-monitor Miles loss: --custom-tis-function-path={path!r} is not supported (only Miles' "
                     f"{ICEPOP_PATH}, or none: vanilla TIS)")


def check_miles_args(args, parallel_state=None, triage=None) -> None:
    """Raise when a Miles option cannot be honoured by :class:`MilesTriageLoss` (module docstring).

    Args:
        args: Miles' arguments; ``parallel_state``: Miles' ``ParallelState`` (None: not checked);
        triage: the hook's :class:`~triage_monitor.triage.controller.TriageConfig` (None: monitoring only).

    Raises:
        ValueError: naming the option, its value and why.
    """
    for name, ok, why in _UNSUPPORTED:
        value = getattr(args, name, ok)
        if value != ok and not (ok is False and not value):
            raise ValueError(f"triage-monitor Miles loss: --{name.replace('_', '-')}={value!r} is not supported: {why}")
    est = getattr(args, "advantage_estimator", "grpo")
    if est == "gspo":
        raise ValueError("triage-monitor Miles loss: --advantage-estimator gspo is not supported (a sequence-level "
                         "ratio); use grpo, ppo, reinforce_plus_plus(_baseline)")
    loss_type = getattr(args, "loss_type", "custom_loss")
    if loss_type != "custom_loss":
        raise ValueError(f"triage-monitor Miles loss: --loss-type {loss_type!r}; Miles calls a custom loss function "
                         "only with --loss-type custom_loss")
    correction = miles_is_correction(args)
    if correction is not None and triage is not None and getattr(triage, "tis", False):
        raise ValueError(f"triage-monitor Miles loss: Miles' {correction} correction (--use-tis / --get-mismatch-"
                         "metrics) together with TriageConfig(tis=True): two importance corrections; set one off")
    if parallel_state is not None:
        cp = int(parallel_state.cp.size)
        if cp != 1:
            raise ValueError(f"triage-monitor Miles loss: context parallel size {cp} is not supported: each rank holds "
                             "a slice of every response, the Gate and Repair need whole responses")
        indep = int(parallel_state.indep_dp.size)
        if indep != 1:
            raise ValueError(f"triage-monitor Miles loss: {indep} independent data-parallel replicas (indep_dp) are "
                             "not supported: the monitor syncs over one data-parallel group")


def _flat_valid(values, masks) -> torch.Tensor:
    """Per-sample tensors → the valid tokens in :class:`~triage_monitor.batch.TokenBatch`'s flat order."""
    return torch.cat([v[torch.as_tensor(m, device=v.device).bool()] for v, m in zip(values, masks)])


class MilesTriageLoss(SlimeTriageLoss):
    """Miles ``--custom-loss-function-path`` target: ``(args, batch, logits, sum_of_sample_mean) -> (loss, log)``.

    The arguments are :class:`~triage_monitor.hooks.slime.SlimeTriageLoss`'s (``run_dir``, ``triage``, ``monitor``,
    ``manifest``, ``on_invalid``, ``alerts``, ``loggers``, ``framework_keys``, ``settings``); ``run.json`` names
    ``framework: miles``.
    """

    FRAMEWORK = "miles"

    def __call__(self, args, batch: dict, logits: torch.Tensor, sum_of_sample_mean):
        """Miles' custom loss call (``miles/backends/training_utils/loss.py`` ``loss_function``).

        Args:
            args: Miles' arguments.
            batch: the micro-batch (``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``,
                ``advantages``, ``rollout_log_probs``, ``log_probs``, ``rollout_mask_sums``, ``max_seq_lens``).
            logits: ``[1, T, V/tp]`` (``thd``) or ``[B, max_seq_len, V/tp]`` (``bshd``) logits.
            sum_of_sample_mean: Miles' reducer for this micro-batch.

        Returns:
            ``(loss, log)``: 0-dim loss, and a dict of 0-dim tensors (Miles' metric names, ``triage/*``).

        Raises:
            ValueError: an unsupported option (:func:`check_miles_args`).
            KeyError: the batch has no ``rollout_log_probs`` (the rollout engine must return log-probs).
        """
        from miles.backends.training_utils.loss_hub.corrections import icepop_function, vanilla_tis_function
        from miles.backends.training_utils.loss_hub.logit_processors import get_log_probs_and_entropy
        from miles.backends.training_utils.loss_hub.math_utils import (compute_approx_kl,
                                                                        compute_ess_ratio_contribution,
                                                                        compute_policy_loss)
        from miles.backends.training_utils.parallel import get_parallel_state

        ps = get_parallel_state()
        check_miles_args(args, ps, self.settings.triage)
        record = int(ps.tp.rank) == 0
        if record and self.settings.run_dir is not None:
            # only TP rank 0 records: the monitor's collectives run over the data-parallel group Miles reduces its
            # step metrics over, which the other ranks never have to join
            self.runtime.set_group(ps.intra_dp_cp.group)
        if batch.get("rollout_log_probs") is None:
            raise KeyError("Miles batch has no 'rollout_log_probs': the rollout engine must return log-probs")
        if getattr(args, "skip_actor_forward_only", False):
            batch = {**batch, "log_probs": None}       # Miles' anchor is then the live log-probs, detached (L124-133)
        with_entropy = args.entropy_coef != 0 or getattr(args, "observe_training_entropy", False)
        out = get_log_probs_and_entropy(
            logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=with_entropy,
            entropy_requires_grad=args.entropy_coef != 0, max_seq_lens=batch.get("max_seq_lens"))
        log_probs = out["log_probs"]
        masks = batch["loss_masks"]
        rollout_list = [t.detach() for t in batch["rollout_log_probs"]]
        # Miles' TIS compares the trainer's scored log-probs (the recomputed ones, or the live ones detached under
        # --skip-actor-forward-only) with the rollout's, whatever the PPO anchor is (losses.py L124-133, L256-268)
        scored = ([t.detach() for t in log_probs] if getattr(args, "skip_actor_forward_only", False)
                  else [t.detach() for t in batch["log_probs"]] if batch.get("log_probs") is not None else None)
        correction = miles_is_correction(args)
        token_scale = None
        if correction is not None:
            if scored is None:
                raise KeyError("Miles batch has no 'log_probs': Miles' TIS needs the trainer's recomputed log-probs "
                               "(or --skip-actor-forward-only)")
            old_v, roll_v = _flat_valid(scored, masks).float(), _flat_valid(rollout_list, masks).float()
            lo, hi = float(args.tis_clip_low), float(args.tis_clip)
            token_scale = (tis_weights(old_v, roll_v, lo, hi) if correction == "tis"
                           else icepop_weights(old_v, roll_v, lo, hi))
        res = self.triage_loss(args, batch, log_probs, record=record, token_scale=token_scale)

        # Miles' own metrics, with Miles' functions, as policy_loss_function computes them (losses.py L186-400)
        old = torch.cat(old_log_probs(args, batch, log_probs), dim=0)
        lp = torch.cat(log_probs, dim=0)
        active = torch.cat([torch.as_tensor(m) for m in masks], dim=0).to(lp.device).bool()
        zero = lp.new_zeros(())
        with torch.no_grad():
            ppo_kl = torch.where(active, torch.nan_to_num(old - lp.detach(), nan=0.0, posinf=0.0, neginf=0.0), zero)
            adv = torch.cat(batch["advantages"], dim=0).detach()
            adv = torch.where(active, torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0), adv.new_zeros(()))
            _, pg_clipfrac = compute_policy_loss(ppo_kl, adv, args.eps_clip, args.eps_clip_high,
                                                 getattr(args, "eps_clip_c", None))
            ess = compute_ess_ratio_contribution(
                ppo_kl=ppo_kl, loss_masks=masks, total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"], qkv_format=args.qkv_format,
                max_seq_lens=batch.get("max_seq_lens"), calculate_per_token_loss=args.calculate_per_token_loss)
        loss = res.loss
        entropy_loss = res.policy_loss.new_zeros(())
        if with_entropy:
            entropy_loss = sum_of_sample_mean(torch.cat(out["entropy"], dim=0))
            if args.entropy_coef != 0:
                loss = loss - args.entropy_coef * entropy_loss
            else:
                entropy_loss = entropy_loss.detach()
        if lp.numel() == 0:
            loss = loss + 0 * logits.sum()
        log = {"loss": loss.clone().detach(), "pg_loss": res.policy_loss.clone().detach(),
               "entropy_loss": entropy_loss.clone().detach(), "pg_clipfrac": sum_of_sample_mean(pg_clipfrac).detach(),
               "ppo_kl": sum_of_sample_mean(ppo_kl).detach(), "ess_ratio": ess.squeeze()}
        rollout = torch.cat(rollout_list, dim=0).to(old.dtype)
        with torch.no_grad():
            abs_diff = (old - rollout).abs()
            abs_diff = torch.where(active, torch.nan_to_num(abs_diff, nan=0.0, posinf=0.0, neginf=0.0), zero)
            kl = compute_approx_kl(rollout, old, kl_loss_type="low_var_kl")
            kl = torch.where(active, torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0), kl.new_zeros(()))
        log["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(abs_diff).detach()
        log["train_rollout_kl"] = sum_of_sample_mean(kl).detach()
        if correction is not None:
            tis_fn = vanilla_tis_function if correction == "tis" else icepop_function
            _, _, tis_metrics = tis_fn(args, pg_loss=torch.zeros_like(lp), train_log_probs=scored,
                                       rollout_log_probs=rollout_list, loss_masks=masks)
            log["ois"] = sum_of_sample_mean((-ppo_kl).exp()).detach()
            log.update({k: sum_of_sample_mean(v).detach() for k, v in tis_metrics.items()})
        if batch.get("opd_reverse_kl") is not None:
            log["opd_reverse_kl"] = sum_of_sample_mean(torch.cat(batch["opd_reverse_kl"], dim=0)).detach()
        share = step_share(args, batch, sum_of_sample_mean, logits.device)
        if self.settings.triage is not None:
            log.update(triage_log(res, share, logits.device, self.settings))
        if record:
            log.update(framework_log(self.runtime, share, int(ps.intra_dp_cp.size), logits.device))
            if reports(self.runtime):
                attach_perf_timings(self.runtime, MILES_LOG_MODULE)
        return loss, log


def step_share(args, batch: dict, sum_of_sample_mean, device) -> float:
    """This micro-batch's part of the divisor Miles' ``aggregate_train_losses`` divides the step's sums by: its token
    count (``--calculate-per-token-loss``), its sample count (the FSDP backend: the first entry of ``values``), or its
    rollouts' share ``sum_of_sample_mean(1)`` (the Megatron backend divides by the step's rollout count; the samples of
    one rollout add up to 1, so the shares add up to the rollouts that have a loss token)."""
    if getattr(args, "calculate_per_token_loss", False):
        return float(sum(max(int(torch.as_tensor(m).sum()), 1) for m in batch["loss_masks"]))
    if getattr(args, "train_backend", "megatron") == "fsdp":
        return float(len(batch["response_lengths"]))
    n = int(sum(int(x) for x in batch["response_lengths"]))
    return float(sum_of_sample_mean(torch.ones(n, device=device)))


def framework_log(rt, share: float, dp_size: int, device) -> dict[str, torch.Tensor]:
    """``framework_keys`` of the last step this process logged, each × ``share`` (:func:`step_share`), so that Miles'
    step reduction returns the monitor's value (module docstring); ``triage/alerts_active`` only with one
    data-parallel rank (it is the reporting rank's alone).  Nothing before the first logged step."""
    last = rt.last_metrics
    if not last:
        return {}
    # NaN kept: the keys must not depend on a rank's own values; ratios at noise level (a global guard) left out
    values = framework_values(last, rt.settings.framework_keys)
    values["metrics_step"] = float(last["step"])
    if dp_size > 1:
        values.pop(ALERT_STATE, None)
    return {PREFIX + k: torch.tensor(v * share, device=device) for k, v in values.items()}


__all__ = ["MilesTriageLoss", "check_miles_args", "miles_is_correction", "step_share", "framework_log",
           "MILES_COMMIT"]
