"""slime: ``triage-monitor import slime`` on dumps made by slime's two writers (format_version 2 and the v0.3.1
per-rank files, with tensor-parallel replicas and pipeline stages), and the custom loss against slime's own
policy loss.  slime cannot be installed here (not on PyPI): the writers and formulas come from
tests/slime_contract.py, transcribed from slime's source with commit and lines."""

from __future__ import annotations

import json
from argparse import Namespace

import cloudpickle
import pandas as pd
import pytest
import torch

import math
import sys

import recording_tracker
import slime_contract
from slime_contract import (get_sum_of_sample_mean, save_debug_train_data_v031, save_debug_train_data_v2,
                            slime_pg_loss)
from triage_monitor.alert_rules import Rule
from triage_monitor.cli import main
from triage_monitor.controller import TriageConfig
from triage_monitor.hooks import slime as slime_hook
from triage_monitor.hooks._runtime import HookSettings, close_all
from triage_monitor.hooks.slime import SlimeTriageLoss, check_slime_args
from triage_monitor.importers import slime_steps
from triage_monitor.monitor import MonitorConfig
from triage_monitor.trackers import CURATED_KEYS

pytestmark = pytest.mark.framework


# ------------------------------------------------------------------ data
def rollout(seed: int, n: int = 6):
    """One rollout's training data as slime's RolloutManager builds it (rollout.py _convert_samples_to_train_data):
    samples 2 and 3 are two training samples of one multi-turn rollout (shared rollout id, rollout_mask_sums)."""
    g = torch.Generator().manual_seed(seed)
    rollout_ids = [0, 1, 2, 2, 3, 4][:n]
    d = {k: [] for k in ("tokens", "response_lengths", "total_lengths", "loss_masks", "rollout_log_probs",
                         "log_probs", "advantages", "sample_indices", "rewards")}
    for i in range(n):
        P, L = int(torch.randint(3, 8, (), generator=g)), int(torch.randint(6, 30, (), generator=g))
        sampler = -torch.rand(L, generator=g) * 2 - 1e-3
        mask = torch.ones(L, dtype=torch.int32)
        if L > 12:
            mask[5:8] = 0                                                        # tool output
        adv = float(torch.randn((), generator=g))
        d["tokens"].append(torch.randint(0, 1000, (P + L,), generator=g))
        d["response_lengths"].append(L)
        d["total_lengths"].append(P + L)
        d["loss_masks"].append(mask)
        d["rollout_log_probs"].append(sampler)
        d["log_probs"].append((sampler + torch.randn(L, generator=g) * 0.2 - 0.05).clamp(max=-1e-4))
        d["advantages"].append(torch.full((L,), adv))
        d["sample_indices"].append(100 * seed + i)
        d["rewards"].append(adv)
    sums = {}
    for rid, m in zip(rollout_ids, d["loss_masks"]):
        sums[rid] = sums.get(rid, 0) + int(m.sum())
    d["rollout_mask_sums"] = torch.tensor([float(sums[r]) for r in rollout_ids])
    d["raw_reward"] = list(d["rewards"])
    return d


PARTITION = ([0, 2, 4], [1, 3, 5])          # the DP schedule: rollout positions of DP rank 0 and 1
PER_SAMPLE = ("tokens", "response_lengths", "total_lengths", "loss_masks", "rollout_log_probs", "log_probs",
              "advantages", "sample_indices", "rewards")


def dp_shard(full: dict, dp: int, *, head: bool, last_stage: bool = True) -> dict:
    """A DP rank's rollout_data when the dump is written (actor.py: after training).  v0.3.1 pops
    ``partition`` (utils/data.py process_rollout_data); HEAD keeps it and adds ``local_raw_reward``.  Earlier
    pipeline stages hold neither learner log-probs nor advantages (compute_advantages_and_returns returns)."""
    part = PARTITION[dp]
    rd = {k: [full[k][j] for j in part] for k in PER_SAMPLE}
    rd["rollout_mask_sums"] = full["rollout_mask_sums"][part]
    rd["raw_reward"] = full["raw_reward"]
    rd["micro_batch_indices"] = [[0, 1], [2]]
    rd["num_microbatches"] = [2]
    rd["global_batch_sizes"] = [6]
    if head:
        rd["partition"] = list(part)
        rd["local_raw_reward"] = [full["raw_reward"][j] for j in part]
    if not last_stage:
        del rd["log_probs"], rd["advantages"]
    return rd


def write_v031(tmp_path, rollouts, tp=2, pp=1):
    """Per-rank files of the v0.3.1 writer: every rank of DP 2 × TP ``tp`` × PP ``pp`` (Megatron rank order
    tp fastest, then dp, then pp)."""
    paths = []
    for rid, full in rollouts.items():
        for stage in range(pp):
            for dp in range(2):
                for t in range(tp):
                    rank = t + tp * (dp + 2 * stage)
                    paths.append(save_debug_train_data_v031(
                        str(tmp_path / "v031" / "{rollout_id}_{rank}.pt"), rank=rank, rollout_id=rid,
                        rollout_data=dp_shard(full, dp, head=False, last_stage=stage == pp - 1)))
    return paths


def write_v2(tmp_path, rollouts, tp=2):
    paths = []
    for rid, full in rollouts.items():
        shards = [{"rank": dp * tp, "data_parallel_rank": dp, "rollout_data": dp_shard(full, dp, head=True)}
                  for dp in range(2)]
        paths.append(save_debug_train_data_v2(str(tmp_path / "v2" / "{rollout_id}.pt"), writer_rank=0,
                                              rollout_id=rid, dp_shards=shards))
    return paths


def valid_tokens(full) -> int:
    return sum(int(m.sum()) for m in full["loss_masks"])


def imported(tmp_path, paths, name):
    out = tmp_path / name
    assert main(["import", "slime", *map(str, paths), "--out", str(out), "--calibration-steps", "1"]) == 0
    return (out, pd.read_parquet(out / "steps"), pd.read_parquet(out / "tokens"),
            json.loads((out / "run.json").read_text())["info"])


# --------------------------------------------------------------- import
def test_v031_tensor_parallel_replicas_are_imported_once(tmp_path):
    rollouts = {0: rollout(0), 1: rollout(1)}
    paths = write_v031(tmp_path, rollouts, tp=2)
    assert len(paths) == 8                                          # 2 rollouts × 4 ranks
    out, steps, tokens, info = imported(tmp_path, paths, "o")
    for rid, full in rollouts.items():
        assert steps.set_index("step").loc[rid, "n_tokens"] == valid_tokens(full)   # not twice that
        assert (tokens["step"] == rid).sum() == valid_tokens(full)
    assert info["replica_files_dropped"] == 4 and info["formats"] == ["per_rank_v0.3.1"]


def test_v031_pipeline_stages_without_log_probs_are_skipped(tmp_path):
    full = rollout(2)
    paths = write_v031(tmp_path, {3: full}, tp=1, pp=2)             # ranks 0,1: first stage, no log_probs
    _, steps, tokens, _ = imported(tmp_path, paths, "o")
    assert steps["n_tokens"].tolist() == [valid_tokens(full)]


def test_both_formats_give_the_same_tokens_and_metrics(tmp_path):
    rollouts = {0: rollout(0), 1: rollout(1), 2: rollout(2)}
    _, s1, t1, _ = imported(tmp_path, write_v031(tmp_path, rollouts), "a")
    _, s2, t2, info = imported(tmp_path, write_v2(tmp_path, rollouts), "b")
    assert info["formats"] == ["format_version_2"]
    cols = ["step", "learner_logp", "sampler_logp", "advantage"]
    # v0.3.1 files carry sample_indices, format 2 the rollout position: order both by step and value
    a = t1[cols].sort_values(cols).reset_index(drop=True)
    b = t2[cols].sort_values(cols).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    for c in ("n_tokens", "delta_mean", "k3_kl", "mass_amp_neg", "mass_amp_pos"):
        assert s1[c].tolist() == pytest.approx(s2[c].tolist(), rel=1e-6), c


def test_v2_tokens_by_hand(tmp_path):
    full = rollout(4)
    _, steps, tokens, _ = imported(tmp_path, write_v2(tmp_path, {7: full}), "o")
    assert steps["step"].tolist() == [7]
    # sample at rollout position 3, its first valid token: learner, sampler and advantage as slime holds them
    row = tokens[(tokens["sample_id"] == 3) & (tokens["position"] == 0)].iloc[0]
    assert row["learner_logp"] == pytest.approx(float(full["log_probs"][3][0]))
    assert row["sampler_logp"] == pytest.approx(float(full["rollout_log_probs"][3][0]))
    assert row["advantage"] == pytest.approx(float(full["advantages"][3][0]))
    # masked tool tokens (5..7) are absent, positions keep counting after them
    long = [i for i, m in enumerate(full["loss_masks"]) if len(m) > 12][0]
    pos = sorted(tokens[tokens["sample_id"] == long]["position"].tolist())
    assert 5 not in pos and 8 in pos


def test_errors_name_the_file(tmp_path, capsys):
    full = rollout(5)
    # context-parallel slices (v0.3.1 saves each CP rank's half of every response)
    rd = dp_shard(full, 0, head=False)
    rd["log_probs"] = [t[: len(t) // 2] for t in rd["log_probs"]]
    p = save_debug_train_data_v031(str(tmp_path / "cp_{rollout_id}_{rank}.pt"), rank=0, rollout_id=0, rollout_data=rd)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "context-parallel" in err
    # no learner log-probs on any replica
    rd = dp_shard(full, 0, head=False)
    del rd["log_probs"]
    p = save_debug_train_data_v031(str(tmp_path / "nolp_{rollout_id}_{rank}.pt"), rank=0, rollout_id=0,
                                   rollout_data=rd)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "'log_probs'" in err
    # an unknown format version, a format-2 sample without log_probs, a file that is not a dump
    p = tmp_path / "v3.pt"
    torch.save({"format_version": 3, "rollout_id": 0, "samples": []}, p)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o3")]) == 2
    assert f"{p}: unknown slime dump format_version 3" in capsys.readouterr().err
    p = tmp_path / "v2bad.pt"
    torch.save({"format_version": 2, "rollout_id": 0, "samples": [{"rollout_log_probs": torch.zeros(2)}]}, p)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o4")]) == 2
    assert f"{p}: samples[0] has no" in capsys.readouterr().err
    p = tmp_path / "garbage.pt"
    p.write_bytes(b"not a torch file")
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o5")]) == 2
    assert str(p) in capsys.readouterr().err
    assert main(["import", "slime", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "o6")]) == 2
    assert "missing.pt" in capsys.readouterr().err
    # an impossible value with --on-invalid raise: TokenBatch names the sample, the importer its file
    smp = {"log_probs": torch.tensor([-0.1, float("nan")]), "rollout_log_probs": torch.tensor([-0.1, -0.2]),
           "advantages": torch.tensor([1.0, 1.0])}
    p = tmp_path / "nan.pt"
    torch.save({"format_version": 2, "rollout_id": 4, "samples": [smp]}, p)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o7"), "--on-invalid", "raise"]) == 2
    err = capsys.readouterr().err
    assert f"triage-monitor import: error: {p}: samples[0]: rollout_id 4:" in err and "learner_logp" in err


def test_a_rollout_in_both_formats_is_refused(tmp_path):
    rollouts = {0: rollout(0)}
    paths = write_v031(tmp_path, rollouts) + write_v2(tmp_path, rollouts)
    with pytest.raises(ValueError, match="also in the format_version 2 file"):
        list(slime_steps(map(str, paths)))


# ------------------------------------------------------------------ loss
def slime_args(**kw):
    base = dict(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, use_rollout_logprobs=False,
                calculate_per_token_loss=False, entropy_coef=0.0, use_tis=False, use_kl_loss=False, use_opsm=False,
                advantage_estimator="grpo", custom_tis_function_path=None, get_mismatch_metrics=False,
                loss_type="custom_loss", context_parallel_size=1, allgather_cp=False, global_batch_size=5,
                rollout_top_p=1.0, rollout_temperature=1.0)
    base.update(kw)
    return Namespace(**base)


def micro_batch(full, idx):
    mb = {k: [full[k][j] for j in idx] for k in PER_SAMPLE}
    mb["rollout_mask_sums"] = full["rollout_mask_sums"][idx]
    return mb


def live_log_probs(mb, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(old + torch.randn(len(old), generator=g) * 0.3).clamp(max=-1e-4).requires_grad_(True)
            for old in mb["log_probs"]]


@pytest.mark.parametrize("kw", [{}, {"eps_clip_c": 1.05}, {"calculate_per_token_loss": True},
                                {"use_rollout_logprobs": True}])
def test_triage_off_equals_slime_policy_loss(kw):
    args = slime_args(**kw)
    mb = micro_batch(rollout(6), [0, 2, 3, 5])          # samples 2 and 3: one rollout, shared denominator
    lp_ours, lp_ref = live_log_probs(mb), live_log_probs(mb)
    hook = SlimeTriageLoss()
    res = hook.triage_loss(args, mb, lp_ours)
    ssm = get_sum_of_sample_mean(mb["response_lengths"], [m.float() for m in mb["loss_masks"]],
                                 mb["rollout_mask_sums"], args.calculate_per_token_loss)
    ref, _, _ = slime_pg_loss(args, mb, lp_ref, ssm)
    assert res.policy_loss.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)
    res.loss.backward()
    ref.backward()
    for a, b in zip(lp_ours, lp_ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8)
    close_all()


def test_rollout_denominator_matters():
    """The per-rollout denominator is slime's: dividing samples 2 and 3 by their own mask totals would differ."""
    args = slime_args()
    mb = micro_batch(rollout(6), [2, 3])
    lp = live_log_probs(mb)
    ours = SlimeTriageLoss().triage_loss(args, mb, lp).policy_loss.item()
    own = get_sum_of_sample_mean(mb["response_lengths"], [m.float() for m in mb["loss_masks"]])
    per_sample, _, _ = slime_pg_loss(args, mb, lp, own)
    shared = get_sum_of_sample_mean(mb["response_lengths"], [m.float() for m in mb["loss_masks"]],
                                    mb["rollout_mask_sums"])
    ref, _, _ = slime_pg_loss(args, mb, lp, shared)
    assert ours == pytest.approx(ref.item(), rel=1e-6) and ours != pytest.approx(per_sample.item(), rel=1e-3)
    close_all()


def test_triage_on_changes_the_loss_and_counts_optimizer_steps(tmp_path):
    args = slime_args()
    full = rollout(7)
    hook = cloudpickle.loads(cloudpickle.dumps(
        SlimeTriageLoss(tmp_path / "run", triage=TriageConfig(), monitor=None, manifest={"model": "toy"})))
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.1)
    for step in range(3):                                             # 3 optimizer steps × 2 micro-batches
        for idx in ([0, 1, 2], [3, 4, 5]):
            mb = micro_batch(full, idx)
            lp = [(t + param).clamp(max=-1e-4) for t in live_log_probs(mb, seed=step)]
            res = hook.triage_loss(args, mb, lp)
            assert torch.isfinite(res.loss)
            res.loss.backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    steps = pd.read_parquet(tmp_path / "run" / "steps")
    assert sorted(steps["step"].tolist()) == [0, 1, 2]
    assert set(steps["n_tokens"]) == {valid_tokens(full)}            # every token of the step once
    info = json.loads((tmp_path / "run" / "run.json").read_text())["info"]
    assert info["framework"] == "slime" and info["model"] == "toy"


def test_other_tensor_parallel_ranks_write_nothing_and_stay_in_step(tmp_path):
    """TP rank 0 records; another TP rank (same tokens) gets the same TRIAGE losses and writes no files."""
    args = slime_args()
    full = rollout(8)
    rank0 = SlimeTriageLoss(tmp_path / "r0", triage=TriageConfig())
    rank1 = SlimeTriageLoss(tmp_path / "r1", triage=TriageConfig())
    for hook, record in ((rank0, True), (rank1, False)):
        param = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([param], lr=0.1)
        losses = []
        for step in range(3):
            mb = micro_batch(full, [0, 1, 2, 3, 4, 5])
            lp = [(t + param).clamp(max=-1e-4) for t in live_log_probs(mb, seed=step)]
            res = hook.triage_loss(args, mb, lp, record=record)
            res.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(res.loss.item())
        assert hook.runtime.optimizer_steps == 3
        hook.close()
        if record:
            ref = losses
        else:
            assert losses == pytest.approx(ref, rel=1e-6)
    assert (tmp_path / "r0" / "steps").exists() and not (tmp_path / "r1").exists()


@pytest.mark.parametrize("kw,match", [
    ({"use_tis": True}, "use-tis"), ({"use_kl_loss": True}, "use-kl-loss"), ({"use_opsm": True}, "use-opsm"),
    ({"advantage_estimator": "gspo"}, "gspo"), ({"context_parallel_size": 2}, "context-parallel-size 2"),
    ({"custom_tis_function_path": "m.f"}, "custom-tis-function-path"), ({"loss_type": "policy_loss"}, "custom_loss"),
    ({"global_batch_size": None}, "global-batch-size is None"),
])
def test_unsupported_options_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        check_slime_args(slime_args(**kw))
    check_slime_args(slime_args())                                    # the defaults are fine


# ------------------------------------- slime's custom-loss call site and step reduction (tests/slime_contract.py)
V = 40
ROLLOUT_IDS = [0, 1, 2, 2, 3, 4]                 # samples 2 and 3: two training samples of one rollout
GBS = len(set(ROLLOUT_IDS))                      # args.global_batch_size: the step's rollouts


@pytest.fixture
def slime_modules():
    saved = slime_contract.install_slime_modules()
    yield
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def amplifying_step(seed: int) -> list:
    """One step's 6 training samples (5 rollouts) with their logits, the sampler biased in the amplifying direction:
    advantage +0.5 on samples 2 and 5, −1.5 on the others (× U(1, 1.2); each DP shard of PARTITION holds both
    signs); the rollout log-probs 0.5 nats (± 0.1) above the live ones (from the logits) on A<0 samples and 0.5
    below on A>0 ones: δ ≈ ∓0.5 on every loss token, window ρ_asym well above the rules' thresholds."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        P, L = int(torch.randint(3, 7, (), generator=g)), int(torch.randint(10, 24, (), generator=g))
        tokens = torch.randint(0, V, (P + L,), generator=g)
        logits = torch.randn(P + L, V, generator=g) * 1.5
        _, o = slime_contract.get_log_probs_and_entropy(logits[None], args=slime_args(), unconcat_tokens=[tokens],
                                                        total_lengths=[P + L], response_lengths=[L])
        live = o["log_probs"][0]
        mask = torch.ones(L, dtype=torch.int32)
        mask[4:6] = 0                                                     # tool output
        adv = (-1.5 if i % 3 != 2 else 0.5) * (1 + 0.2 * float(torch.rand((), generator=g)))
        bias = 0.5 if adv < 0 else -0.5
        out.append({"tokens": tokens, "logits": logits, "total_lengths": P + L, "response_lengths": L,
                    "loss_masks": mask, "advantages": torch.full((L,), adv),
                    "rollout_log_probs": (live + bias + 0.1 * torch.randn(L, generator=g)).clamp(max=-1e-3),
                    "log_probs": live + 0.05 * torch.randn(L, generator=g)})
    sums = {}
    for rid, smp in zip(ROLLOUT_IDS, out):
        sums[rid] = sums.get(rid, 0) + int(smp["loss_masks"].sum())
    for rid, smp in zip(ROLLOUT_IDS, out):
        smp["rollout_mask_sum"] = float(sums[rid])
    return out


def slime_micro_batch(samples: list, idx: list, offset: torch.Tensor):
    """slime's micro-batch dict for samples ``idx`` and its packed ``[1, T, V]`` logits (``offset`` added: the
    parameter the optimizer steps)."""
    pick = [samples[j] for j in idx]
    mb = {"unconcat_tokens": [p["tokens"] for p in pick], "total_lengths": [p["total_lengths"] for p in pick],
          "response_lengths": [p["response_lengths"] for p in pick], "loss_masks": [p["loss_masks"] for p in pick],
          "advantages": [p["advantages"] for p in pick], "rollout_log_probs": [p["rollout_log_probs"] for p in pick],
          "log_probs": [p["log_probs"] for p in pick],
          "rollout_mask_sums": torch.tensor([p["rollout_mask_sum"] for p in pick])}
    logits = torch.cat([p["logits"] for p in pick])[None] + offset
    return mb, logits


def slime_train(hooks, args, steps: int, partitions, schedule, seed0: int = 0) -> list:
    """``steps`` slime train steps (model.py train_one_step): every DP rank (one hook each) runs its micro-batches
    through loss_function → backward; one optimizer step; then reduce_train_step_metrics over the ranks.  Returns
    the reduced log of each step (what slime logs as ``train/<key>``)."""
    param = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.0)
    logged = []
    for step in range(steps):
        samples = amplifying_step(seed0 + step)
        ranks = []
        for hook, part in zip(hooks, partitions):
            losses_reduced = []
            for mb_idx in schedule:
                mb, logits = slime_micro_batch(samples, [part[j] for j in mb_idx], param)
                loss, _, log = slime_contract.loss_function(args, mb, len(schedule), args.global_batch_size, logits,
                                                            hook, dp_size=len(hooks))
                loss.backward()
                losses_reduced.append(log)
            ranks.append(losses_reduced)
        opt.step()                                                   # model.py L679: the monitors log the step
        opt.zero_grad()
        logged.append(slime_contract.reduce_train_step_metrics(
            ranks, calculate_per_token_loss=args.calculate_per_token_loss,
            step_global_batch_size=args.global_batch_size))
    return logged


RULE = Rule(name="test_rho_asym_above_2", metric="window/rho_asym", condition="above", threshold=2.0, hold=2)


def two_ranks(tmp_path, triage=TriageConfig(gate_width=4, calibration=dict(window=1)), **options):
    """The hooks of two data-parallel ranks (slime builds one per Megatron rank at import; here both in one
    process, with their rank and the job's attempt fixed in the settings)."""
    recording_tracker.register()
    opts = dict(alerts=[RULE], loggers=[{"kind": "recorder", "path": str(tmp_path / "rec.jsonl")}])
    opts.update(options)
    return [SlimeTriageLoss(settings=HookSettings(
        run_dir=str(tmp_path / "run"), triage=triage, monitor=MonitorConfig(window=4, calibration_steps=2),
        manifest={"framework": "slime"}, step_source="optimizer", rank=r, attempt=7, **opts)) for r in (0, 1)]


def test_curated_metrics_reach_slimes_step_log_per_rollout_mean(slime_modules, tmp_path):
    """Two DP ranks, slime's default per-rollout mean, an amplifying sampler, 6 steps: the log slime reduces (every
    micro-batch of both ranks with the same keys, summed, all-reduced, ÷ global_batch_size) holds the curated keys
    with rank 0's steps-table value of the previous step — although the two ranks' monitors differ here (no
    process group: each judged its own tokens); the rule given as ``alerts`` fires once, on rank 0, is logged
    once and reaches the ``loggers`` tracker, which only rank 0 built."""
    hooks = two_ranks(tmp_path)
    lines = recording_tracker.AlertLines()
    logged = slime_train(hooks, slime_args(), 6, PARTITION, [[0, 1], [2]])
    close_all()
    lines.remove()
    steps = recording_tracker.steps_table(tmp_path / "run", rank=0)
    other = recording_tracker.steps_table(tmp_path / "run", rank=1)
    assert (steps["window/rho_asym"] != other["window/rho_asym"]).all()      # what is logged can only be rank 0's
    checked = set()
    own = {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff"}
    for s, log in enumerate(logged):
        assert own <= set(log) and all(k.startswith("triage/") for k in set(log) - own)   # no name of slime's
        if s == 0:
            assert "triage/metrics_step" not in log and "triage/gate_downweighted_frac" not in log
            continue
        assert log["triage/metrics_step"] == pytest.approx(s - 1, abs=1e-5)
        for k in CURATED_KEYS:
            v = steps.loc[s - 1, k]
            if math.isfinite(v):
                assert log[f"triage/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-7), (s, k)
                checked.add(k)
            else:
                assert math.isnan(log[f"triage/{k}"]), (s, k)                # NaN stays NaN, the key stays
    assert checked == set(CURATED_KEYS)
    assert 0 < log["triage/gate_weight_mean"] <= 1                          # the controller's, rollout-weighted
    alerts = recording_tracker.alerts_table(tmp_path / "run")
    assert alerts["rule"].tolist() == ["test_rho_asym_above_2"] and alerts["rank"].tolist() == [0]
    assert len(lines.lines) == 1
    assert logged[int(alerts["step"][0]) + 1]["triage/alerts_active"] == pytest.approx(1.0)
    rows = recording_tracker.read(tmp_path / "rec.jsonl")
    assert [r["rule"] for r in rows if r["kind"] == "alert"] == ["test_rho_asym_above_2"]
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == list(range(6))     # rank 0's steps only


def test_controller_statistics_are_weighted_by_rollouts_not_samples(slime_modules, tmp_path):
    """Gate off: every call's gate_weight_mean is 1, so the reduced log must show exactly 1 — with 6 samples of 5
    rollouts a weight per sample (the old scaling) gave 6/5."""
    hooks = two_ranks(tmp_path, triage=TriageConfig(gate=False, tis=False, repair=False), alerts=False, loggers=[])
    logged = slime_train(hooks, slime_args(), 2, PARTITION, [[0, 1], [2]])
    close_all()
    assert [log["triage/gate_weight_mean"] for log in logged] == pytest.approx([1.0, 1.0], rel=1e-6)
    assert "triage/alerts_active" in logged[1] and math.isnan(logged[1]["triage/alerts_active"])   # alerts=False


def test_per_token_loss(slime_modules, tmp_path, monkeypatch):
    """--calculate-per-token-loss divides by the all-reduced token count: on one DP rank the log holds the steps
    table's values; on two, each rank's own value weighted by its tokens (the monitor all-reduces the step and
    window metrics in a real job, so they agree), and triage/alerts_active, rank 0's only, is left out."""
    args = slime_args(calculate_per_token_loss=True)
    one = SlimeTriageLoss(str(tmp_path / "one"), triage=TriageConfig(), monitor=MonitorConfig(window=4,
                                                                                              calibration_steps=2))
    logged = slime_train([one], args, 3, [list(range(6))], [[0, 1, 2], [3, 4, 5]])
    close_all()
    steps = recording_tracker.steps_table(tmp_path / "one")
    for s in (1, 2):
        for k in CURATED_KEYS:
            assert logged[s][f"triage/{k}"] == pytest.approx(steps.loc[s - 1, k], rel=1e-6, abs=1e-7), (s, k)
    monkeypatch.setattr(slime_hook, "_data_parallel_size", lambda: 2)
    hooks = two_ranks(tmp_path / "two")
    logged = slime_train(hooks, args, 2, PARTITION, [[0, 1], [2]])
    close_all()
    r0, r1 = (recording_tracker.steps_table(tmp_path / "two" / "run", rank=r) for r in (0, 1))
    samples = amplifying_step(1)
    tokens = [sum(max(int(samples[j]["loss_masks"].sum()), 1) for j in part) for part in PARTITION]
    for k in ("window/rho_asym", "delta_abs_mean", "gate_downweighted_frac"):
        want = (r0.loc[0, k] * tokens[0] + r1.loc[0, k] * tokens[1]) / sum(tokens)
        assert logged[1][f"triage/{k}"] == pytest.approx(want, rel=1e-6), k
    assert "triage/alerts_active" not in logged[1]


def test_options_on_the_constructor(tmp_path):
    recording_tracker.register()
    hook = SlimeTriageLoss(tmp_path / "run", alerts=str(tmp_path / "rules.toml"),
                           loggers={"kind": "recorder", "path": "x"}, framework_keys=["window/rho_asym"])
    s = hook.settings
    assert (s.alerts, s.loggers[0].kind, s.framework_keys, s.step_source) == \
        (str(tmp_path / "rules.toml"), "recorder", ("window/rho_asym",), "optimizer")
    with pytest.raises(ValueError, match=r"SlimeTriageLoss: alerts=3"):
        SlimeTriageLoss(alerts=3)
    with pytest.raises(ValueError, match=r"SlimeTriageLoss: loggers: tracker kind 'nope'"):
        SlimeTriageLoss(loggers="nope")
    with pytest.raises(ValueError, match=r"SlimeTriageLoss: framework_keys='x'"):
        SlimeTriageLoss(framework_keys="x")
    with pytest.raises(ValueError, match=r"SlimeTriageLoss: alerts, loggers given beside settings"):
        SlimeTriageLoss(settings=HookSettings(), alerts=False, loggers=["wandb"])
    assert cloudpickle.loads(cloudpickle.dumps(hook)).settings.loggers == s.loggers


def test_monitoring_with_model_parallelism_is_refused(slime_modules, tmp_path, monkeypatch):
    """Tensor- or pipeline-parallel size > 1: the ranks that record nothing would never join the monitor's
    collectives (a DP 2 × TP 2 gloo run hung), so monitoring refuses at the first call; the controller alone runs."""
    args = slime_args()
    mb, logits = slime_micro_batch(amplifying_step(0), [0, 1], torch.zeros(()))
    ssm = get_sum_of_sample_mean(mb["response_lengths"], mb["loss_masks"], mb["rollout_mask_sums"])
    for sizes in ((2, 1), (1, 2)):
        monkeypatch.setattr(slime_hook, "_model_parallel_sizes", lambda: sizes)
        with pytest.raises(ValueError, match=rf"tensor-parallel size {sizes[0]} / pipeline-parallel size {sizes[1]}"):
            SlimeTriageLoss(tmp_path / "run", triage=TriageConfig())(args, mb, logits, ssm)
        loss, log = SlimeTriageLoss(triage=TriageConfig())(args, mb, logits, ssm)
        assert torch.isfinite(loss) and "triage/gate_weight_mean" in log
    assert not (tmp_path / "run").exists()
    close_all()


def test_the_docs_lines_configure_the_hook():
    """The ``mymod.py`` lines of docs/hooks.md#slime, run as written: the module-level hook slime's
    ``--custom-loss-function-path mymod.triage_loss`` loads, with the controller and the three options."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    section = text.split("\n## slime\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n# mymod.py\n", 1)[1].split("```", 1)[0]
    ns = {}
    exec(code, ns)
    s = ns["triage_loss"].settings
    assert (s.run_dir, s.alerts, s.framework_keys, s.step_source) == ("/shared/runs/exp1", True, "curated",
                                                                      "optimizer")
    assert s.triage is not None and [t.kind for t in s.loggers] == ["tensorboard", "mlflow"]
