"""slime: ``triage-monitor import slime`` on dumps made by slime's two writers (format_version 2 and the v0.3.1
per-rank files, with tensor-parallel replicas and pipeline stages), and the custom loss against slime's own
policy loss.  slime cannot be installed here (not on PyPI): the writers and formulas come from
tests/slime_contract.py, transcribed from slime's source with commit and lines."""

from __future__ import annotations

import json
from argparse import Namespace
from typing import Optional

import cloudpickle
import numpy as np
import pandas as pd
import pytest
import torch

import math
import sys

import recording_tracker
from ranks import run_ranks
import slime_contract
from slime_contract import (get_sum_of_sample_mean, save_debug_train_data_v031, save_debug_train_data_v2,
                            slime_pg_loss)
from triage_monitor.alerting.alert_rules import Rule
from triage_monitor.cli import main
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks import slime as slime_hook
from triage_monitor.hooks.worker_runtime import HookSettings, close_all
from triage_monitor.hooks.slime import SlimeTriageLoss, check_slime_args
from triage_monitor.hooks.slime_dumps import slime_steps
from triage_monitor.metrics.stats import METRIC_NAMES
from triage_monitor.monitor import MonitorConfig
from triage_monitor.alerting.trackers import CURATED_KEYS

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


@pytest.mark.parametrize("kw", [{}, {"calculate_per_token_loss": True}], ids=["per-rollout-mean", "per-token-loss"])
def test_gate_weights_renormalise_per_sample_under_slimes_normaliser(kw):
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser through the hook's loss (slime's per-rollout
    mean, samples a and b one rollout: rollout_mask_sums 8, 8, 4; or the masked sum): three 4-token samples,
    A = −1, −1, +1, rollout log-probs above the learner's by −δ, old = live (ratio 1): a partly gated (δ = +0.2
    ungated, tier 0.3 on the rest), b all gated.  Gradient per token over the Gate-off one: w · 4 / W per sample."""
    delta = torch.tensor([[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]])
    rollout_lp = torch.full((3, 4), -2.0)
    args = slime_args(**kw)
    grads = {}
    for name, triage in (("off", None), ("on", TriageConfig(tis=False, repair=False, gate_width=4))):
        lp = [(rollout_lp[s] + delta[s]).requires_grad_() for s in range(3)]
        mb = {"rollout_log_probs": list(rollout_lp), "advantages": [torch.full((4,), a) for a in (-1.0, -1.0, 1.0)],
              "loss_masks": [torch.ones(4, dtype=torch.int32)] * 3, "log_probs": [x.detach() for x in lp],
              "rollout_mask_sums": torch.tensor([8, 8, 4])}
        SlimeTriageLoss(triage=triage).triage_loss(args, mb, lp).loss.backward()
        grads[name] = torch.stack([x.grad for x in lp])
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, .3 * s, .3 * s], [1.0] * 4, [1.0] * 4])
    assert (grads["off"] != 0).all()
    torch.testing.assert_close(grads["on"] / grads["off"], want, rtol=1e-5, atol=0)
    close_all()


def test_global_token_normalization_is_refused_at_the_first_call():
    """slime divides by rollout_mask_sums (or sums the per-token loss): the weights are renormalised per sample, so
    a TriageConfig asking for the global token mean is refused at the loss's first call, naming the setting."""
    lp = [torch.full((4,), -2.0, requires_grad=True)]
    mb = {"rollout_log_probs": [torch.full((4,), -1.5)], "advantages": [torch.full((4,), -1.0)],
          "loss_masks": [torch.ones(4, dtype=torch.int32)], "rollout_mask_sums": torch.tensor([4])}
    hook = SlimeTriageLoss(triage=TriageConfig(normalization="global_token"))
    for kw in ({}, {"calculate_per_token_loss": True}):
        with pytest.raises(ValueError, match=r"TriageConfig.normalization='global_token' .* cannot be honoured"):
            hook.triage_loss(slime_args(**kw), mb, lp)
    close_all()


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


def slime_train(hooks, args, steps: int, partitions, schedule, seed0: int = 0, after_step=None,
                before_step=None) -> list:
    """``steps`` slime train steps (model.py train_one_step): every DP rank (one hook each) runs its micro-batches
    through loss_function → backward; one optimizer step; then reduce_train_step_metrics over the ranks.  Returns
    the reduced log of each step (what slime logs as ``train/<key>``)."""
    param = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.0)
    logged = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
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
        if after_step is not None:
            after_step(step)
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


def test_the_actors_perf_timers_reach_the_rows_of_their_rollout(slime_modules, tmp_path):
    """slime's training actor logs its Timer readings of the rollout at the end of train (log_perf_data →
    logging_utils.log, transcribed at 624b824a), after the optimizer step wrote the rollout's row: the hook of the
    reporting rank puts them in the run's timings table at that step (one optimizer step per rollout here:
    steps 0-2), mapped as docs/hooks.md#phase-timings says (perf/step_time = train_wait + train); slime's own
    log call still gets the dict; they are the job's timings, so rank 1's rows of those steps show them too."""
    from triage_monitor.offline.analysis import open_run

    hooks = two_ranks(tmp_path, alerts=False, loggers=[])
    args = slime_args()

    def perf(rollout_id):
        slime_contract.log_perf_data(rollout_id, args, {"train_wait": 6.0 + rollout_id, "train": 4.0,
                                                        "data_preprocess": 0.25, "log_probs": 1.0,
                                                        "actor_train": 2.5, "update_weights": 0.5})

    slime_train(hooks, args, 3, PARTITION, [[0, 1], [2]], after_step=perf)
    close_all()
    run = open_run(tmp_path / "run")
    steps = run.steps().set_index("step")
    assert steps["time/step"].tolist() == [10.0, 11.0, 12.0]
    assert steps["time/logprob"].tolist() == [1.0] * 3 and steps["time/update"].tolist() == [2.5] * 3
    assert steps["time/weight_sync"].tolist() == [0.5] * 3 and steps["time/other"].tolist() == [0.25] * 3
    assert steps["time/generation"].isna().all()      # perf/rollout_time comes from the rollout manager's process
    assert run.steps(rank=1)["time/step"].tolist() == [10.0, 11.0, 12.0]
    assert set(run.timings()["framework"]) == {"slime"} and set(run.timings()["rank"]) == {0}
    logged = sys.modules["slime.observability.logging_utils"].LOGGED
    assert [d["rollout/step"] for d in logged] == [0, 1, 2] and logged[0]["perf/step_time"] == 10.0


def test_the_rollouts_raw_reward_is_the_reward_of_its_rows(slime_modules, tmp_path):
    """slime's training actor logs each rollout's rollout/raw_reward (the mean of every sample's reward, before
    GRPO's normalisation) in log_rollout_data, before it trains on the rollout (transcribed at 624b824a): the
    reporting rank's hook makes it the reward of the rollout's rows, rank 1's too (the job's reward).  The first
    rollout's is logged before slime imports the loss module (its first loss call): its row has none."""
    from triage_monitor.offline.analysis import open_run

    hooks = two_ranks(tmp_path, alerts=False, loggers=[])
    args = slime_args()
    raw = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.5], 2: [0.0, 0.0, 0.5, 0.5], 3: [1.0, 1.0, 1.0, 0.0]}

    def rollout(rollout_id):
        slime_contract.log_rollout_raw_reward(rollout_id, args, raw[rollout_id], dp_size=2)

    slime_train(hooks, args, 4, PARTITION, [[0, 1], [2]], before_step=rollout)
    close_all()
    run = open_run(tmp_path / "run")
    for rank in (0, 1):
        got = run.steps(rank=rank).set_index("step")["reward"]
        assert got.index.tolist() == [0, 1, 2, 3] and np.isnan(got[0])
        assert got[[1, 2, 3]].tolist() == [0.625, 0.25, 0.75]
    logged = sys.modules["slime.observability.logging_utils"].LOGGED
    assert [d["rollout/raw_reward"] for d in logged] == [0.25, 0.625, 0.25, 0.75]     # slime's own log, unchanged


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


# ------------------------------------------- tensor- and pipeline-parallel jobs: real gloo processes (Megatron's groups)
PARALLEL_STEPS = 6


PARALLEL_HOOK = """
from triage_monitor.controller import TriageConfig
from triage_monitor.hooks.slime import SlimeTriageLoss
from triage_monitor.monitor import MonitorConfig
from triage_monitor.alert_rules import Rule
triage_loss = SlimeTriageLoss({run!r}, triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                              monitor=MonitorConfig(window=4, calibration_steps=2),
                              alerts=[Rule(name={rule.name!r}, metric={rule.metric!r}, condition={rule.condition!r},
                                           threshold={rule.threshold!r}, hold={rule.hold!r})],
                              loggers=[{{"kind": "recorder", "path": {rec!r}}}])
"""


def _parallel_worker(tp: int, pp: int, rank: int, world: int, out: str) -> None:
    """One Megatron rank of a DP × TP × PP job: Megatron's process groups, the hook module slime loads with
    ``--custom-loss-function-path triage_slime_parallel.triage_loss`` (built at import, as in every rank),
    PARALLEL_STEPS train steps of slime's loop: the loss on the last pipeline stage only (each TP rank with its
    vocabulary shard of the logits), the optimizer step on every rank, slime's step reduction over the
    data-parallel group on the last stage (model.py L679, L693-700 at 624b824a).

    CI: tests/slime_contract.py's stand-ins for ``megatron.core.mpu`` and slime's functions (every TP rank gets the
    whole logits there: the stand-in log-probs are TP 1's).  With ``TRIAGE_SLIME_SOURCE`` set (a slime checkout and
    megatron-core on the path, as scripts/check_slime_source.py runs it): the real
    ``megatron.core.parallel_state.initialize_model_parallel`` and slime's own ``loss_function``,
    ``get_log_probs_and_entropy`` (vocabulary-parallel over the TP group) and ``reduce_train_step_metrics``."""
    import datetime
    import importlib
    import os
    from pathlib import Path

    import torch.distributed as dist

    from triage_monitor.rundir import manifest as manifest_mod

    out_dir = Path(out)
    real = bool(os.environ.get("TRIAGE_SLIME_SOURCE"))
    timeout = datetime.timedelta(seconds=60)     # a collective a rank never joins fails the test, it does not hang it
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'rdv'}", rank=rank, world_size=world,
                            timeout=timeout)
    if real:
        from megatron.core import parallel_state as ps
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     distributed_timeout_minutes=1)
        from slime.backends.megatron_utils.loss import loss_function
        try:
            from slime.observability.train_metric_utils import reduce_train_step_metrics
        except ImportError:                       # v0.3.1: the same function in cp_utils
            from slime.backends.megatron_utils.cp_utils import reduce_train_step_metrics
    else:
        ps = slime_contract.install_megatron_parallel_state(tp, pp, timeout)
        slime_contract.install_slime_modules()
    recording_tracker.register()
    lines = recording_tracker.AlertLines()
    write = manifest_mod.RunManifest.write

    def counted_write(self, run_dir):             # which processes write run.json
        with open(out_dir / "manifest-writes.txt", "a") as f:
            f.write(f"{rank}\n")
        return write(self, run_dir)

    manifest_mod.RunManifest.write = counted_write
    sys.path.insert(0, str(out_dir))
    hook = importlib.import_module("triage_slime_parallel").triage_loss          # what slime's load_function does
    args = Namespace(**{**vars(slime_args()), "custom_loss_function_path": "triage_slime_parallel.triage_loss",
                        "recompute_loss_function": False, "log_probs_chunk_size": -1})
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp_rank, last = ps.get_tensor_model_parallel_rank(), ps.is_pipeline_last_stage(ignore_virtual=True)
    param = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.0)
    schedule, logged = [[0, 1], [2]], []
    for step in range(PARALLEL_STEPS):
        samples = amplifying_step(step)
        losses_reduced = []
        if last:                                   # Megatron calls the loss on the last pipeline stage only
            for mb_idx in schedule:
                mb, logits = slime_micro_batch(samples, [PARTITION[dp_rank][j] for j in mb_idx], param)
                if real:                           # this TP rank's vocabulary shard
                    logits = logits.chunk(tp, dim=-1)[tp_rank]
                    loss, _, log = loss_function(args, mb, len(schedule), args.global_batch_size, logits)
                else:
                    loss, _, log = slime_contract.loss_function(args, mb, len(schedule), args.global_batch_size,
                                                                logits, hook, dp_size=dp)
                loss.backward()
                losses_reduced.append(log)
        opt.step()                                 # every rank steps
        opt.zero_grad()
        if last:
            group = ps.get_data_parallel_group(with_context_parallel=True)
            kw = dict(calculate_per_token_loss=False, step_global_batch_size=args.global_batch_size)
            logged.append(reduce_train_step_metrics(losses_reduced, cp_size=1, dp_with_cp_group=group, **kw) if real
                          else slime_contract.reduce_train_step_metrics_in_rank(losses_reduced, dp_with_cp_group=group,
                                                                                **kw))
    mon = hook.runtime._monitor
    res = {"pid": os.getpid(), "rank": rank, "dp_rank": dp_rank, "tp_rank": tp_rank, "last": last,
           "logged": logged, "monitor": mon is not None, "reports": bool(mon and mon.reports)}
    close_all()
    lines.remove()
    res["alert_lines"] = lines.lines
    dist.barrier()                                 # nobody tears its pairs down while another still uses them
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res))


def run_parallel_job(tmp_path, tp: int, pp: int, world: int = 4, env: Optional[dict] = None) -> list:
    """The processes of one job (this file as the worker script); a rank that does not finish in time fails the
    test (all are killed) instead of hanging it.  Returns each rank's result, by rank."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "triage_slime_parallel.py").write_text(PARALLEL_HOOK.format(
        run=str(tmp_path / "run"), rec=str(tmp_path / "rec.jsonl"), rule=RULE))
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", **(env or {})}
    run_ranks(__file__, lambda r: ["parallel", tp, pp, r, world, tmp_path], world, env, f"DP x TP {tp} x PP {pp}")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def check_parallel_job(tmp_path, tp: int, pp: int, results: list, rtol: float = 1e-9, atol: float = 0.0) -> float:
    """The checks of a DP 2 job with tensor- / pipeline-parallel size ``tp`` / ``pp`` (see the test); the monitor's
    metrics on both data-parallel ranks agree with one process's on both shards to ``rtol`` / ``atol`` (the single
    process here uses tests/slime_contract.py's log-probs).  Returns the largest absolute difference seen."""
    dp = len(results) // (tp * pp)
    last_stage = [r for r in results if r["last"]]
    recording = [r for r in last_stage if r["tp_rank"] == 0]
    reporter = slime_contract.megatron_rank_groups(tp, dp, pp, "dp")[(pp - 1) * tp][0]    # DP rank 0, TP 0, last
    assert [r["rank"] for r in results if r["monitor"]] == [r["rank"] for r in recording]   # nobody else built one
    assert [r["rank"] for r in results if r["reports"]] == [reporter] and reporter == recording[0]["rank"]
    run = tmp_path / "run"
    steps = pd.read_parquet(run / "steps")
    tokens = pd.read_parquet(run / "tokens")
    assert set(tokens["rank"]) == set(range(dp))                                   # files by data-parallel rank
    assert set(steps["rank"]) == {0}                # the step's one row: DP rank 0's (the metrics are all-reduced)
    assert sorted(p.name for p in run.glob(".writer-rank-*.lock")) == [f".writer-rank-{d}.lock" for d in range(dp)]
    assert tokens["attempt"].nunique() == 1 and set(steps["attempt"]) == set(tokens["attempt"])
    for step in range(PARALLEL_STEPS):                                              # every token once
        samples = amplifying_step(step)
        assert (tokens["step"] == step).sum() == sum(int(smp["loss_masks"].sum()) for smp in samples)
        for d in range(dp):
            want = sum(int(samples[j]["loss_masks"].sum()) for j in PARTITION[d])
            assert ((tokens["step"] == step) & (tokens["rank"] == d)).sum() == want
    # the metrics are those of one process on both data-parallel shards
    single = SlimeTriageLoss(str(tmp_path / "single"), triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                             monitor=MonitorConfig(window=4, calibration_steps=2), alerts=False)
    slime_train([single], slime_args(), PARALLEL_STEPS, [list(range(6))], [[0, 1, 2], [3, 4, 5]])
    close_all()
    ref = recording_tracker.steps_table(tmp_path / "single")
    names = [*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)]
    worst = 0.0
    for d in sorted(set(steps["rank"])):
        got = recording_tracker.steps_table(run, rank=d)
        for name in names:
            a, b = got[name].to_numpy(), ref[name].to_numpy()
            assert np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True), (d, name, a, b)
            both = np.isfinite(a) & np.isfinite(b)
            worst = max(worst, float(np.max(np.abs(a[both] - b[both]), initial=0.0)))
    # one alert for the job, from the reporting rank (rank 0 of the data-parallel group); the tracker its alone
    alerts = recording_tracker.alerts_table(run)
    assert alerts["rule"].tolist() == [RULE.name] and alerts["rank"].tolist() == [0]
    assert {r["rank"]: len(r["alert_lines"]) for r in results} == {r["rank"]: int(r["rank"] == reporter)
                                                                    for r in results}
    pid = results[reporter]["pid"]
    rows = recording_tracker.read(tmp_path / "rec.jsonl")
    assert {r["pid"] for r in rows} == {pid} and [r["rule"] for r in rows if r["kind"] == "alert"] == [RULE.name]
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == list(range(PARALLEL_STEPS))
    # run.json: written by the reporting process only
    assert set((tmp_path / "manifest-writes.txt").read_text().split()) == {str(reporter)}
    manifest = json.loads((run / "run.json").read_text())
    assert [(a["pid"], a["world_size"]) for a in manifest["attempts"]] == [(pid, dp)]
    assert manifest["info"]["hook_pid"] == pid and manifest["status"] == "finished"
    # slime's step log (the logging rank: DP 0, TP 0, last stage) gets the reporting rank's values of the step before
    own = recording_tracker.steps_table(run, rank=0)
    logged = results[reporter]["logged"]
    for s in range(1, PARALLEL_STEPS):
        assert logged[s]["triage/metrics_step"] == pytest.approx(s - 1, abs=1e-5)
        for k in CURATED_KEYS:
            v = own.loc[s - 1, k]
            assert logged[s][f"triage/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-7) if math.isfinite(v) else \
                math.isnan(logged[s][f"triage/{k}"]), (s, k)
    assert logged[int(alerts["step"][0]) + 1]["triage/alerts_active"] == pytest.approx(1.0)
    for r in last_stage:                         # the other TP ranks' data-parallel group: the controller's only
        keys = {k for log in r["logged"] for k in log}
        assert ("triage/metrics_step" in keys) == (r["tp_rank"] == 0) and "triage/gate_weight_mean" in keys
    return worst


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_jobs_monitor_over_the_data_parallel_group(tp, pp, slime_modules, tmp_path):
    """4 gloo processes, DP 2 × TP 2 or DP 2 × PP 2, with Megatron's groups (tests/slime_contract.py): only TP rank 0
    of the last stage records, so the monitor syncs over its data-parallel group.  The job runs through (a rank
    that waits on a collective the others never join fails after 60 s; before, DP 2 × TP 2 hung at the first
    optimizer step), every token is written once (files by data-parallel rank), the metrics equal one process's on
    both shards, the rule fires once for the job from rank 0 of the data-parallel group (global rank 2 under PP:
    global rank 0 is on the first stage and never records), whose process alone feeds the tracker and writes
    run.json, and slime's step log on its logging rank carries that rank's values."""
    check_parallel_job(tmp_path, tp, pp, run_parallel_job(tmp_path, tp, pp))


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


if __name__ == "__main__" and sys.argv[1:2] == ["parallel"]:
    _parallel_worker(*map(int, sys.argv[2:6]), sys.argv[6])
