"""slime's dump writers and policy-loss formulas as contract code for tests/test_hooks_slime.py.

slime (THUDM/slime) is not on PyPI (the PyPI project ``slime`` is an unrelated package), so CI cannot import
it.  What the tests need of it is transcribed here, each piece cited by commit, file and lines; docs/hooks.md
#slime records the session run that checked these transcriptions against slime's own code.

* HEAD = 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21)
* v0.3.1 = tag v0.3.1, a6272da0d4f3d0a08520c99a2f3b4f6c887960dc
"""

from __future__ import annotations

from pathlib import Path

import torch

# ------------------------------------------------------------------ writers
# v0.3.1 slime/utils/train_dump_utils.py lines 9-22: every rank saves its own rollout_data.
def save_debug_train_data_v031(path_template: str, *, rank: int, rollout_id: int, rollout_data: dict) -> Path:
    path = Path(path_template.format(rollout_id=rollout_id, rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(rollout_id=rollout_id, rank=rank, rollout_data=rollout_data), path)
    return path


# HEAD slime/observability/train_data_utils.py lines 97-188 (_build_dump_payload) and 236-242 (the DP source
# rank of TP rank 0 / last PP stage / CP rank 0 writes one file with every DP shard).
_LAYOUT_FIELDS = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
_WHOLE_BATCH_FIELDS = ("raw_reward",)


def _is_per_sample(value, num_samples: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.size(0) == num_samples
    if isinstance(value, (list, tuple)):
        return len(value) == num_samples
    return False


def build_dump_payload_v2(dp_shards, *, rollout_id, writer_rank) -> dict:
    samples, layout, whole_batch = [], [], {}
    id_columns = {"sample_indices": "sample_index", "partition": "rollout_position"}
    for shard in dp_shards:
        rollout_data = shard["rollout_data"]
        dp_rank = shard["data_parallel_rank"]
        num_local = len(rollout_data["response_lengths"])
        shard_layout = {"rank": shard["rank"], "data_parallel_rank": dp_rank}
        for column in id_columns:
            value = rollout_data.get(column)
            shard_layout[column] = list(value) if value is not None else None
        per_sample_columns = {}
        for key, value in rollout_data.items():
            if key in id_columns:
                continue
            if key in _WHOLE_BATCH_FIELDS:
                whole_batch.setdefault(key, value)
            elif key in _LAYOUT_FIELDS or not _is_per_sample(value, num_local):
                shard_layout[key] = value
            else:
                per_sample_columns[key] = value
        for i in range(num_local):
            sample = {"data_parallel_rank": dp_rank}
            for column, scalar_key in id_columns.items():
                values = rollout_data.get(column)
                if values is not None:
                    sample[scalar_key] = values[i]
            for key, column in per_sample_columns.items():
                sample[key] = column[i]
            samples.append(sample)
        layout.append(shard_layout)
    order_key = next((k for k in ("rollout_position", "sample_index")
                      if samples and all(s.get(k) is not None for s in samples)), None)
    if order_key is not None:
        samples.sort(key=lambda s: s[order_key])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": writer_rank, "samples": samples,
            "dp_shards": layout, **whole_batch}


def save_debug_train_data_v2(path_template: str, *, writer_rank: int, rollout_id: int, dp_shards) -> Path:
    path = Path(path_template.format(rollout_id=rollout_id, rank=writer_rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build_dump_payload_v2(dp_shards, rollout_id=rollout_id, writer_rank=writer_rank), path)
    return path


# ------------------------------------------------------------------- loss
# HEAD slime/utils/ppo_utils.py lines 124-148 (compute_policy_loss).
def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is not None:
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1
    return pg_losses, clipfrac


# HEAD slime/backends/megatron_utils/cp_utils.py lines 47-124 (get_sum_of_sample_mean), context-parallel size 1.
def get_sum_of_sample_mean(response_lengths, loss_masks, sample_denoms=None, calculate_per_token_loss=False):
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]

    def sum_of_sample_mean(x):
        return sum((x_i * m).sum() / torch.clamp_min(d, 1)
                   for x_i, m, d in zip(x.split(response_lengths, dim=0), loss_masks, sample_denoms))

    def sum_of_token(x):
        return sum((x_i * m).sum() for x_i, m in zip(x.split(response_lengths, dim=0), loss_masks))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean


# HEAD slime/backends/megatron_utils/loss.py policy_loss_function (lines 934-1174), the default path
# (no TIS, no OPSM, no KL loss, advantage estimator grpo): the pg_loss from given live log-probs.
def slime_pg_loss(args, batch, log_probs, sum_of_sample_mean):
    old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    if not args.use_rollout_logprobs and not old:
        old = [lp.detach() for lp in log_probs]
    ppo_kl = torch.cat(old, dim=0) - torch.cat(log_probs, dim=0)
    pg_loss, pg_clipfrac = compute_policy_loss(ppo_kl, torch.cat(batch["advantages"], dim=0), args.eps_clip,
                                               args.eps_clip_high, eps_clip_c=args.eps_clip_c)
    return sum_of_sample_mean(pg_loss), sum_of_sample_mean(pg_clipfrac), sum_of_sample_mean(ppo_kl)


# ------------------------------------------------------- the custom-loss call site and the step's metric reduction
# HEAD slime/backends/megatron_utils/loss.py lines 83-95 (get_rollout_top_p_logprob_kwargs).
def get_rollout_top_p_logprob_kwargs(args, batch):
    if args.rollout_top_p == 1.0:
        return {}
    top_p_token_ids = batch.get("rollout_top_p_token_ids")
    top_p_token_offsets = batch.get("rollout_top_p_token_offsets")
    if top_p_token_ids is None or top_p_token_offsets is None:
        raise ValueError("rollout_top_p != 1.0 requires rollout_top_p_token_ids and rollout_top_p_token_offsets.")
    return {"top_p_token_ids": top_p_token_ids, "top_p_token_offsets": top_p_token_offsets}


# What HEAD loss.py lines 513-604 (get_log_probs_and_entropy) returns with tensor- and context-parallel size 1 and no
# top-p replay: the shifted targets of _build_shifted_tokens (lines 305-312), log-softmax / entropy over the full
# [T, V] logits (ppo_utils.calculate_log_probs_and_entropy, here without Megatron's vocab-parallel kernels) and the
# per-sample slices of _extract_per_sample (lines 499-508).  Not a transcription of the kernels:
# scripts/check_slime_source.py runs the hook with slime's own function.
def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None):
    assert non_loss_data and logits.dtype == torch.float32 and logits.dim() == 3 and logits.size(0) == 1
    assert top_p_token_ids is None
    logits = logits.squeeze(0)
    if getattr(args, "rollout_temperature", 1.0) != 1.0:
        logits = logits / args.rollout_temperature
    T = logits.size(0)
    full_tokens = torch.zeros(T, dtype=torch.long)
    offset = 0
    for tokens, total_length in zip(unconcat_tokens, total_lengths):
        full_tokens[offset:offset + total_length - 1] = tokens[1:total_length]
        offset += total_length
    logp = torch.log_softmax(logits, dim=-1)
    log_prob_full = logp.gather(-1, full_tokens.unsqueeze(-1)).squeeze(-1)
    entropy_full = -(logp.exp() * logp).sum(-1)
    log_probs, entropy = [], []
    offset = 0
    for total_length, response_length in zip(total_lengths, response_lengths):
        end = offset + total_length
        start = end - response_length
        log_probs.append(log_prob_full[start - 1:end - 1])
        entropy.append(entropy_full[start - 1:end - 1])
        offset += total_length
    res = {"log_probs": log_probs}
    if with_entropy:
        res["entropy"] = entropy
    return torch.empty((0,)), res


def install_slime_modules():
    """Make the slime functions the hook imports at its call resolve to the pieces above (as inside slime):
    ``slime.backends.megatron_utils.loss`` and ``slime.utils.ppo_utils``.  Returns what was there before."""
    import sys
    import types

    saved = {}
    mods = {}
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils", "slime.backends.megatron_utils.loss",
                 "slime.utils", "slime.utils.ppo_utils", "slime.observability", "slime.observability.logging_utils"):
        saved[name] = sys.modules.get(name)
        mods[name] = sys.modules[name] = types.ModuleType(name)
    mods["slime.observability"].logging_utils = mods["slime.observability.logging_utils"]
    mods["slime.observability.logging_utils"].log = log
    mods["slime.observability.logging_utils"].LOGGED = []
    loss = mods["slime.backends.megatron_utils.loss"]
    loss.get_log_probs_and_entropy = get_log_probs_and_entropy
    loss.get_rollout_top_p_logprob_kwargs = get_rollout_top_p_logprob_kwargs
    mods["slime.utils.ppo_utils"].compute_policy_loss = compute_policy_loss
    return saved


# 624b824a slime/observability/logging_utils.py L45-52 (log): W&B and TensorBoard when enabled (both off here:
# what was handed over is kept in LOGGED instead, to look at).
def log(args, metrics, step_key: str):
    import sys

    sys.modules["slime.observability.logging_utils"].LOGGED.append(dict(metrics))


# 624b824a slime/observability/train_metric_utils.py L358-403 (log_perf_data), called by the training actor at the
# end of train (backends/megatron_utils/actor.py L564-568), on TP rank 0 of the last pipeline stage and DP rank 0;
# ``timer_log_dict``: slime's Timer().log_dict() of the rollout (its seconds per timer name); the FLOPs figures
# (which need the model's config) left out; compute_rollout_step: the rollout id (one step per rollout).
def log_perf_data(rollout_id, args, timer_log_dict: dict, extra_metrics=None) -> None:
    from slime.observability import logging_utils

    log_dict = perf_log_dict(timer_log_dict, extra_metrics)
    log_dict["rollout/step"] = rollout_id
    logging_utils.log(args, log_dict, step_key="rollout/step")


# 624b824a slime/observability/train_metric_utils.py L142-221 (log_rollout_data), the branch of a plain list of
# numbers (``raw_reward``: every sample's reward, shipped whole to each data-parallel rank, utils/data.py L320-327):
# (sum, count) per rank, reduced on the DP source rank as Σsum / Σcount (gather_and_reduce_log_dict, L86-114) and
# logged by gather_log_data (L117-138) as ``rollout/<key>`` at ``rollout/step``; called by the training actor
# before it trains on the rollout (backends/megatron_utils/actor.py L508-524).  Miles' log_rollout_data
# (backends/training_utils/log_utils.py L165-261 at 31f1ca96) reduces and logs the same way.
def log_rollout_raw_reward(rollout_id, args, raw_reward: list, dp_size: int = 1) -> None:
    from slime.observability import logging_utils

    per_rank = [(sum(raw_reward), len(raw_reward))] * dp_size
    reduced = {"raw_reward": sum(x for x, _ in per_rank) / sum(n for _, n in per_rank)}
    log_dict = {f"rollout/{k}": v for k, v in reduced.items()}
    log_dict["rollout/step"] = rollout_id
    logging_utils.log(args, log_dict, step_key="rollout/step")


def perf_log_dict(timer_log_dict: dict, extra_metrics=None) -> dict:
    """The perf dict of a rollout's Timer readings, as slime's log_perf_data (L376-378, L395-399) and Miles'
    log_perf_data_raw (miles/utils/train_metric_utils.py L28-30, L52-56 at 31f1ca96) build it, FLOPs left out."""
    log_dict = {f"perf/{key}_time": val for key, val in timer_log_dict.items()}
    if extra_metrics:
        log_dict.update(extra_metrics)
    if "perf/train_wait_time" in log_dict and "perf/train_time" in log_dict:
        total_time = log_dict["perf/train_wait_time"] + log_dict["perf/train_time"]
        if total_time > 0:
            log_dict["perf/step_time"] = total_time
            log_dict["perf/wait_time_ratio"] = log_dict["perf/train_wait_time"] / total_time
    return log_dict


# HEAD loss.py lines 1283-1382 (loss_function), the custom_loss branch, context parallel size 1 (the hook refuses
# more), no recompute: num_tokens, the reducer, func(args, batch, logits, sum_of_sample_mean), the Megatron rescale
# and the logging dict whose values[0] is num_tokens (per-token loss) or 0.
def loss_function(args, batch, num_microbatches, step_global_batch_size, logits, func, dp_size=1):
    num_tokens = sum([torch.clamp_min(loss_mask.sum(), 1) for loss_mask in batch["loss_masks"]])
    sum_of_sample_mean = get_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                                batch["rollout_mask_sums"], args.calculate_per_token_loss)
    loss, log = func(args, batch, logits, sum_of_sample_mean)
    if not args.calculate_per_token_loss:
        loss = loss * num_microbatches / step_global_batch_size * dp_size
    return (loss, (num_tokens if args.calculate_per_token_loss else torch.tensor(1)),
            {"keys": list(log.keys()),
             "values": torch.tensor([num_tokens if args.calculate_per_token_loss else 0] + list(log.values()))})


# HEAD slime/observability/train_metric_utils.py lines 45-59 (reduce_train_step_metrics), cp_size 1; the DP
# all-reduce is the sum over the ranks' summed values (``ranks``: per rank, its micro-batches' logging dicts).
def reduce_train_step_metrics(ranks, *, calculate_per_token_loss, step_global_batch_size):
    per_rank = []
    for losses_reduced in ranks:
        keys = losses_reduced[0]["keys"]
        values = None
        for item in losses_reduced:
            values = item["values"] if values is None else values + item["values"]
        assert len(keys) + 1 == values.numel()
        per_rank.append((keys, values))
    assert all(k == per_rank[0][0] for k, _ in per_rank)              # all_reduce needs the same layout everywhere
    keys, values = per_rank[0][0], sum(v for _, v in per_rank)      # dist.all_reduce(values, dp_with_cp_group)
    values = values.tolist()
    num_samples_or_tokens = values[0] if calculate_per_token_loss else step_global_batch_size
    return {key: value / num_samples_or_tokens for key, value in zip(keys, values[1:])}


# ------------------------------------------------ Megatron's parallel state, as slime's ranks see it (stand-in)
# megatron-core is not in the project's environment.  What the hook reads of it (``from megatron.core import mpu``)
# is stood in for by torch.distributed.new_group groups with Megatron's rank lists, from NVIDIA/Megatron-LM tag
# core_v0.16.1 (55ac7082517c3878ae653c07c09c534b8aed49f6), megatron/core/parallel_state.py:
# L251-357 generate_masked_orthogonal_rank_groups (below, verbatim but for the docstring), L447-522 RankGenerator
# (the order "tp-cp-ep-dp-pp", L562, with cp = ep = 1: rank = tp_rank + tp·dp_rank + tp·dp·pp_rank), and the groups
# initialize_model_parallel creates, in its order: L851-877 the data-parallel groups with context parallelism
# (``get_data_parallel_group(with_context_parallel=True)``, what slime reduces its step metrics over), L951-965 the
# data-parallel groups, L1019-1027 the tensor-parallel groups, L1095-1115 the pipeline groups; the getters
# L1372-1380, L1408-1430, L1606-1642, L1748-1777.  scripts/check_slime_source.py runs the same job on the real
# megatron.core.parallel_state.
def generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask):
    def prefix_product(a, init=1):
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def inner_product(a, b):
        return sum([x * y for x, y in zip(a, b)])

    def decompose(index, shape, stride=None):
        if stride is None:
            stride = prefix_product(shape)
        idx = [(index // d) % s for s, d in zip(shape, stride)]
        assert sum([x * y for x, y in zip(idx, stride[:-1])]) == index
        return idx

    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = prefix_product(masked_shape)[-1]
    num_of_group = world_size // group_size
    ranks = []
    for group_index in range(num_of_group):
        decomposed_group_idx = decompose(group_index, unmasked_shape)
        rank = []
        for rank_in_group in range(group_size):
            decomposed_rank_idx = decompose(rank_in_group, masked_shape)
            rank.append(inner_product(decomposed_rank_idx, masked_stride)
                        + inner_product(decomposed_group_idx, unmasked_stride))
        ranks.append(rank)
    return ranks


ORDER = "tp-cp-ep-dp-pp"


def megatron_rank_groups(tp: int, dp: int, pp: int, token: str) -> list:
    """RankGenerator(tp, ep=1, dp, pp, cp=1, order=ORDER).get_ranks(token)."""
    sizes = {"tp": tp, "cp": 1, "ep": 1, "dp": dp, "pp": pp}
    order = ORDER.split("-")
    wanted = token.split("-")
    return generate_masked_orthogonal_rank_groups(tp * dp * pp, [sizes[t] for t in order],
                                                  [t in wanted for t in order])


def install_megatron_parallel_state(tp: int, pp: int, timeout=None):
    """In a process of an initialised torch.distributed world of tp·dp·pp ranks: create the groups as Megatron's
    initialize_model_parallel does (every rank creates every group, in its order) and make ``megatron.core.mpu``
    (and ``megatron.core.parallel_state``) a module answering the getters the hook and slime call with them.
    Returns that module."""
    import sys
    import types

    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % (tp * pp) == 0
    dp = world // (tp * pp)
    mine = {}
    for token, key in (("dp-cp", "dp_cp"), ("dp", "dp"), ("tp", "tp"), ("pp", "pp")):
        for ranks in megatron_rank_groups(tp, dp, pp, token):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[key] = (group, ranks)
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True
    ps.get_data_parallel_group = lambda with_context_parallel=False: mine["dp_cp" if with_context_parallel else "dp"][0]
    ps.get_data_parallel_world_size = lambda with_context_parallel=False: len(mine["dp"][1])
    ps.get_data_parallel_rank = lambda with_context_parallel=False: mine["dp"][1].index(rank)
    ps.get_tensor_model_parallel_world_size = lambda: tp
    ps.get_tensor_model_parallel_rank = lambda: mine["tp"][1].index(rank)
    ps.get_pipeline_model_parallel_world_size = lambda: pp
    ps.get_pipeline_model_parallel_rank = lambda: mine["pp"][1].index(rank)
    ps.is_pipeline_last_stage = lambda ignore_virtual=True: ps.get_pipeline_model_parallel_rank() == pp - 1
    ps.get_context_parallel_world_size = lambda: 1
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    core.parallel_state = core.mpu = ps
    megatron.core = core
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.parallel_state": ps})
    return ps


# HEAD slime/observability/train_metric_utils.py lines 45-59 (reduce_train_step_metrics) as it runs in a rank, with
# the real all-reduce over the data-parallel group (context-parallel size 1).
def reduce_train_step_metrics_in_rank(losses_reduced, *, calculate_per_token_loss, step_global_batch_size,
                                      dp_with_cp_group):
    import torch.distributed as dist

    keys = losses_reduced[0]["keys"]
    values = None
    for item in losses_reduced:
        values = item["values"] if values is None else values + item["values"]
    assert len(keys) + 1 == values.numel()
    dist.all_reduce(values, group=dp_with_cp_group)
    values = values.tolist()
    num_samples_or_tokens = values[0] if calculate_per_token_loss else step_global_batch_size
    return {key: value / num_samples_or_tokens for key, value in zip(keys, values[1:])}
