"""Miles' dump writer, policy loss, custom-loss call site and step reduction as contract code for
tests/test_hooks_miles.py.

Miles (radixark/miles) is not on PyPI, so CI cannot import it.  What the tests need of it is transcribed here, each
piece cited by file and lines at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21); the pieces that are
the same as slime's are taken from tests/slime_contract.py and say so.  scripts/check_miles_source.py runs the same
checks against Miles' own code (a checkout of that commit); docs/hooks.md#miles records the run.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

import slime_contract

COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"


# ------------------------------------------------------------------ the dump writer
# miles/utils/train_dump_utils.py L24-44 (save_debug_train_data_for_rank): every rank saves its own rollout_data,
# with its context-parallel rank and size and the qkv format.
def save_debug_train_data_for_rank(path_template: str, *, rollout_id, rollout_data, rank, cp_rank=0, cp_size=1,
                                   qkv_format="thd") -> Path:
    path = Path(path_template.format(rollout_id=rollout_id, rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(rollout_id=rollout_id, rank=rank, rollout_data=rollout_data, cp_rank=cp_rank, cp_size=cp_size,
                    qkv_format=qkv_format), path)
    return path


# miles/backends/training_utils/cp_utils.py L19-67 (get_logits_and_tokens_offset_with_cp) and L411-437
# (slice_log_prob_with_cp): a context-parallel rank's slice of a per-response tensor (zigzag, two chunks).
def get_logits_and_tokens_offset_with_cp(total_length, response_length, qkv_format="thd", max_seq_len=None, *,
                                         cp_rank, cp_size):
    assert cp_size > 1
    prompt_length = total_length - response_length
    if qkv_format == "thd":
        chunk_size = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    else:
        assert max_seq_len is not None
        chunk_size = (max_seq_len + 2 * cp_size - 1) // (2 * cp_size)
    chunk_0 = (cp_rank * chunk_size, (cp_rank + 1) * chunk_size)
    chunk_1 = ((2 * cp_size - cp_rank - 1) * chunk_size, (2 * cp_size - cp_rank) * chunk_size)
    logits_0 = (max(chunk_0[0], prompt_length - 1), min(chunk_0[1], total_length - 1))
    logits_1 = (max(chunk_1[0], prompt_length - 1), min(chunk_1[1], total_length - 1))
    if logits_0[0] < logits_0[1]:
        token_0 = (logits_0[0] + 1, logits_0[1] + 1)
    else:
        logits_0, token_0 = (0, 0), (0, 0)
    if logits_1[0] < logits_1[1]:
        token_1 = (logits_1[0] + 1, logits_1[1] + 1)
    else:
        logits_1, token_1 = (0, 0), (0, 0)
    return chunk_size, (chunk_0, chunk_1), (logits_0, logits_1), (token_0, token_1)


def slice_log_prob_with_cp(log_prob, total_length, response_length, qkv_format="thd", max_token_len=None, *,
                           cp_rank, cp_size):
    assert len(log_prob) == response_length
    if cp_size == 1:
        return log_prob
    prompt_length = total_length - response_length
    _, _, logits_offset, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length, qkv_format,
                                                                  max_token_len, cp_rank=cp_rank, cp_size=cp_size)
    chunk_1 = log_prob[logits_offset[0][0] - (prompt_length - 1): logits_offset[0][1] - (prompt_length - 1)]
    chunk_2 = log_prob[logits_offset[1][0] - (prompt_length - 1): logits_offset[1][1] - (prompt_length - 1)]
    return chunk_1 + chunk_2 if isinstance(log_prob, list) else torch.cat([chunk_1, chunk_2], dim=0)


# ------------------------------------------------------------------ the policy loss
# miles/backends/training_utils/loss_hub/math_utils.py L19-33 (_safe_clamp_log_ratio, _safe_exp_neg_ppo_kl) and
# L254-277 (compute_policy_loss): slime's formula with the log-ratio nan_to_num'd and clamped to ±20 before exp.
def _safe_clamp_log_ratio(log_ratio):
    log_ratio = torch.nan_to_num(log_ratio.float(), nan=0.0, posinf=20.0, neginf=-20.0)
    return torch.clamp(log_ratio, min=-20.0, max=20.0)


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    ratio = _safe_clamp_log_ratio(-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is not None:
        assert eps_clip_c > 1.0
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1
    return pg_losses, clipfrac


# math_utils.py L35-88 (compute_ess_ratio_contribution), context-parallel size 1.
def compute_ess_ratio_contribution(ppo_kl, loss_masks, total_lengths, response_lengths, qkv_format, max_seq_lens,
                                   calculate_per_token_loss):
    lengths = [m.size(0) for m in loss_masks]
    weights = _safe_clamp_log_ratio(-ppo_kl.detach()).exp().split(lengths, dim=0)
    total = torch.zeros((), dtype=torch.float32)
    for w, m in zip(weights, loss_masks):
        mw = w * m.to(w.dtype)
        n = torch.clamp_min(m.float().sum(), 1)
        s1, s2 = mw.sum(), (mw * mw).sum()
        ess = (s1 * s1) / (n * torch.clamp_min(s2, 1e-8))
        total = total + (ess * n if calculate_per_token_loss else ess)
    return total


# math_utils.py L139-180 (compute_approx_kl).
def compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio ** 2 / 2.0
    else:
        log_ratio = -log_ratio
        if kl_loss_type == "low_var_kl":
            log_ratio = _safe_clamp_log_ratio(log_ratio)
        kl = log_ratio.exp() - 1 - log_ratio
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


# miles/backends/training_utils/loss_hub/corrections.py L7-32 (vanilla_tis_function) and L35-62 (icepop_function).
def vanilla_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    tis = torch.exp(old_log_probs - rollout_log_probs)
    tis_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    tis_weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    tis_clipfrac = (tis_weights != tis).float()
    metrics = {"tis": tis.clone().detach(), "tis_clipfrac": tis_clipfrac.clone().detach(),
               "tis_abs": tis_abs.clone().detach()}
    return pg_loss * tis_weights, loss_masks, metrics


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    ice_ratio = torch.exp(old_log_probs - rollout_log_probs)
    ice_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    ice_weight = torch.where((ice_ratio >= args.tis_clip_low) & (ice_ratio <= args.tis_clip), ice_ratio,
                             torch.zeros_like(ice_ratio))
    ice_clipfrac = (ice_weight != ice_ratio).float()
    metrics = {"tis": ice_ratio.clone().detach(), "tis_clipfrac": ice_clipfrac.clone().detach(),
               "tis_abs": ice_abs.clone().detach()}
    return pg_loss * ice_weight, loss_masks, metrics


# miles/backends/training_utils/cp_utils.py L98-133 (get_sum_of_sample_mean), context-parallel size 1: slime's
# (tests/slime_contract.py) with the denominators given as a keyword.
def get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False,
                           qkv_format="thd", max_seq_lens=None, *, denominators=None):
    return slime_contract.get_sum_of_sample_mean(response_lengths, loss_masks, denominators, calculate_per_token_loss)


# miles/backends/training_utils/loss_hub/logit_processors.py L131-210 (get_log_probs_and_entropy): Miles returns
# the dict (slime a pair); tensor- and context-parallel size 1, ``thd``.  The log-probs are tests/slime_contract.py's.
def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              entropy_requires_grad=True, non_loss_data=True, max_seq_lens=None):
    assert args.qkv_format == "thd" and max_seq_lens is None
    _, res = slime_contract.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths,
        response_lengths=response_lengths, with_entropy=with_entropy)
    if with_entropy and not entropy_requires_grad:
        res["entropy"] = [e.detach() for e in res["entropy"]]
    return res


# miles/backends/training_utils/loss_hub/losses.py L62-400 (policy_loss_function): the default policy loss, with
# TIS (vanilla or icepop) under --use-tis / --get-mismatch-metrics; no OPSM, KL loss, GSPO or custom reducer.
def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    advantages = torch.cat([a.detach() for a in batch["advantages"]], dim=0)
    rollout_old = [lp.detach() for lp in batch["rollout_log_probs"]] if batch.get("rollout_log_probs") is not None \
        else None
    calculate_entropy = args.entropy_coef != 0 or args.observe_training_entropy
    out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                    total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
                                    with_entropy=calculate_entropy, entropy_requires_grad=args.entropy_coef != 0,
                                    max_seq_lens=batch.get("max_seq_lens"))
    log_probs = out["log_probs"]
    if args.skip_actor_forward_only:
        scored = [lp.detach() for lp in log_probs]
    else:
        scored = [lp.detach() for lp in batch["log_probs"]] if batch.get("log_probs") is not None else None
    old = rollout_old if args.use_rollout_logprobs else scored
    old_log_probs, log_probs = torch.cat(old, dim=0), torch.cat(log_probs, dim=0)
    ppo_kl = old_log_probs - log_probs
    active = torch.cat(batch["loss_masks"], dim=0).bool()
    ppo_kl = torch.where(active, torch.nan_to_num(ppo_kl, nan=0.0, posinf=0.0, neginf=0.0), ppo_kl.new_zeros(()))
    advantages = torch.where(active, torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0),
                             advantages.new_zeros(()))
    pg_loss, pg_clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high,
                                               getattr(args, "eps_clip_c", None))
    if args.get_mismatch_metrics or args.use_tis:
        metric_reducer = sum_of_sample_mean
        tis_func = icepop_function if args.custom_tis_function_path else vanilla_tis_function
        ois = (-ppo_kl).exp()
        pg_loss, modified_masks, tis_metrics = tis_func(args, pg_loss=pg_loss, train_log_probs=scored,
                                                        rollout_log_probs=rollout_old, loss_masks=batch["loss_masks"])
        sum_of_sample_mean = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], modified_masks,
                                                    args.calculate_per_token_loss,
                                                    denominators=batch.get("rollout_mask_sums"))
    ess = compute_ess_ratio_contribution(ppo_kl, batch["loss_masks"], batch["total_lengths"],
                                         batch["response_lengths"], args.qkv_format, None,
                                         args.calculate_per_token_loss)
    pg_loss = sum_of_sample_mean(pg_loss)
    pg_clipfrac = sum_of_sample_mean(pg_clipfrac)
    ppo_kl = sum_of_sample_mean(ppo_kl)
    entropy_loss = pg_loss.new_zeros(())
    loss = pg_loss
    if calculate_entropy:
        entropy_loss = sum_of_sample_mean(torch.cat(out["entropy"], dim=0))
        if args.entropy_coef != 0:
            loss = pg_loss - args.entropy_coef * entropy_loss
        else:
            entropy_loss = entropy_loss.detach()
    if log_probs.numel() == 0:
        loss += 0 * logits.sum()
    rollout = torch.cat(rollout_old, dim=0)
    abs_diff = (old_log_probs - rollout).abs()
    abs_diff = torch.where(active, torch.nan_to_num(abs_diff, nan=0.0, posinf=0.0, neginf=0.0), abs_diff.new_zeros(()))
    kl = compute_approx_kl(rollout, old_log_probs, kl_loss_type="low_var_kl")
    kl = torch.where(active, torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0), kl.new_zeros(()))
    reported = {"loss": loss.clone().detach(), "pg_loss": pg_loss.clone().detach(),
                "entropy_loss": entropy_loss.clone().detach(), "pg_clipfrac": pg_clipfrac.clone().detach(),
                "ppo_kl": ppo_kl.clone().detach(), "ess_ratio": ess.squeeze(),
                "train_rollout_logprob_abs_diff": sum_of_sample_mean(abs_diff).clone().detach(),
                "train_rollout_kl": sum_of_sample_mean(kl).clone().detach()}
    if args.get_mismatch_metrics or args.use_tis:
        reported["ois"] = metric_reducer(ois).clone().detach()
        for k, v in tis_metrics.items():
            reported[k] = metric_reducer(v)
    return loss, reported


# ------------------------------------------------------- the custom-loss call site and the step's metric reduction
# miles/backends/training_utils/loss.py L126-228 (loss_function), context-parallel size 1, no recompute: num_tokens,
# num_samples, the reducer with rollout_mask_sums, func(args, batch, logits, sum_of_sample_mean), the rescale (Megatron:
# × num_microbatches / num_rollouts × dp; FSDP: / global_batch_size × dp) and values[0] = num_samples or num_tokens.
def loss_function(args, batch, num_microbatches, logits, func, *, apply_megatron_loss_scaling=True, num_rollouts=None,
                  dp_size=1):
    num_tokens = sum([torch.clamp_min(m.sum(), 1) for m in batch["loss_masks"]])
    num_samples = len(batch["response_lengths"])
    ssm = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                 args.calculate_per_token_loss, denominators=batch.get("rollout_mask_sums"))
    loss, log = func(args, batch, logits, ssm)
    global_batch_size = num_rollouts if num_rollouts is not None else args.global_batch_size
    if not args.calculate_per_token_loss:
        if apply_megatron_loss_scaling:
            loss = loss * num_microbatches / global_batch_size * dp_size
        else:
            loss = loss / global_batch_size * dp_size
    return (loss, torch.tensor(num_tokens if args.calculate_per_token_loss else 1),
            {"keys": list(log.keys()),
             "values": torch.tensor([num_samples if not args.calculate_per_token_loss else num_tokens]
                                    + list(log.values()))})


# miles/backends/training_utils/log_utils.py L439-488 (aggregate_train_losses): the micro-batches' sums, summed over the
# data-parallel ranks (the all-reduce), ÷ num_rollouts (Megatron per-rollout mean, model.py L651-655) or ÷ the summed
# values[0] (num_rollouts None: FSDP, fsdp_utils/actor.py L554, and --calculate-per-token-loss), cp_size 1.
def aggregate_train_losses(ranks, num_rollouts=None):
    keys, per_rank = ranks[0][0]["keys"], []
    for losses_reduced in ranks:
        assert losses_reduced[0]["keys"] == keys                  # the all-reduce needs the same layout everywhere
        values = None
        for d in losses_reduced:
            values = d["values"].clone() if values is None else values + d["values"]
        per_rank.append(values)
    values = sum(per_rank).tolist()
    divisor = num_rollouts if num_rollouts is not None else values[0]
    return {k: v / divisor for k, v in zip(keys, values[1:])}


# ------------------------------------------------------- Miles' modules, as the hook imports them (stand-ins)
@dataclass(frozen=True)
class GroupInfo:
    """miles/utils/ft_utils/process_group_utils.py L20-27: what the hook reads of a group (rank, size, group)."""
    rank: int
    size: int
    group: object = None


@dataclass
class ParallelState:
    """miles/backends/training_utils/parallel.py L35-58: the groups the hook reads."""
    intra_dp_cp: GroupInfo
    cp: GroupInfo
    tp: GroupInfo
    indep_dp: GroupInfo
    is_pp_last_stage: bool = True


def single_process_state() -> ParallelState:
    one = GroupInfo(0, 1, None)
    return ParallelState(intra_dp_cp=one, cp=one, tp=one, indep_dp=one)


def install_miles_modules(state: ParallelState) -> dict:
    """Make the Miles modules the hook imports at its call resolve to the pieces above (as inside Miles):
    ``miles.backends.training_utils.{parallel, loss_hub.{logit_processors, math_utils, corrections}}`` and
    ``miles.utils.misc.load_function``.  Returns what was there before."""
    names = ["miles", "miles.backends", "miles.backends.training_utils", "miles.backends.training_utils.parallel",
             "miles.backends.training_utils.loss_hub", "miles.backends.training_utils.loss_hub.logit_processors",
             "miles.backends.training_utils.loss_hub.math_utils", "miles.backends.training_utils.loss_hub.corrections",
             "miles.utils", "miles.utils.misc", "miles.utils.tracking_utils", "miles.utils.tracking_utils.tracking"]
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    sys.modules.update(mods)
    mods["miles.backends.training_utils.parallel"].get_parallel_state = lambda: state
    mods["miles.backends.training_utils.loss_hub.logit_processors"].get_log_probs_and_entropy = get_log_probs_and_entropy
    mu = mods["miles.backends.training_utils.loss_hub.math_utils"]
    mu.compute_policy_loss, mu.compute_ess_ratio_contribution = compute_policy_loss, compute_ess_ratio_contribution
    mu.compute_approx_kl = compute_approx_kl
    co = mods["miles.backends.training_utils.loss_hub.corrections"]
    co.vanilla_tis_function, co.icepop_function = vanilla_tis_function, icepop_function
    tracking = mods["miles.utils.tracking_utils.tracking"]
    tracking.log, tracking.LOGGED = tracking_log, []
    mods["miles.utils.tracking_utils"].tracking = tracking
    mods["miles.utils.misc"].load_function = lambda path: {
        "miles.backends.training_utils.loss_hub.corrections.icepop_function": icepop_function}.get(path)
    return saved


# 31f1ca96 miles/utils/tracking_utils/tracking.py L46-50 (log): the tracking manager's backends (W&B, TensorBoard)
# and the event logger; here what was handed over is kept in LOGGED, to look at.
def tracking_log(args, metrics, step_key: str):
    sys.modules["miles.utils.tracking_utils.tracking"].LOGGED.append(dict(metrics))


# 31f1ca96 miles/utils/train_metric_utils.py L14-62 (log_perf_data_raw), as backends/training_utils/log_utils.py
# L408-420 calls it at the end of the actor's train (is_primary_rank: TP 0, last stage, DP 0); ``timer_log_dict``:
# Miles' Timer().log_dict() of the rollout; the FLOPs figures left out (compute_total_fwd_flops None).
def log_perf_data_raw(rollout_id, args, is_primary_rank: bool, timer_log_dict: dict, extra_metrics=None) -> None:
    from miles.utils.tracking_utils import tracking

    if not is_primary_rank:
        return
    log_dict = slime_contract.perf_log_dict(timer_log_dict, extra_metrics)     # the same lines as slime's
    log_dict["rollout/step"] = rollout_id
    tracking.log(args, log_dict, step_key="rollout/step")


# 31f1ca96 miles/backends/training_utils/log_utils.py L165-261 (log_rollout_data), the branch of a plain list of
# numbers (``raw_reward``, each rank's samples): (sum(flat), len(flat)) per rank, reduced on the DP-CP rank 0 as
# Σsum / Σcount (reduce_gathered_log_dict, L34-78) and logged by gather_log_data (L81-128) through tracking.log as
# ``rollout/<key>`` at ``rollout/step``; the Megatron actor calls it before it trains on the rollout
# (backends/megatron_utils/actor.py L566-571).
def log_rollout_raw_reward(rollout_id, args, per_rank_raw_reward: list) -> None:
    from miles.utils.tracking_utils import tracking

    gathered = [(sum(flat), len(flat)) for flat in per_rank_raw_reward]
    reduced = {"raw_reward": sum(x for x, _ in gathered) / sum(n for _, n in gathered)}
    log_dict = {f"rollout/{k}": v for k, v in reduced.items()}
    log_dict["rollout/step"] = rollout_id
    tracking.log(args, log_dict, step_key="rollout/step")


def restore_modules(saved: dict) -> None:
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
