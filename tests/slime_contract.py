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
