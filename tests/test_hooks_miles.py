"""Miles: the custom loss against Miles' own policy loss, what Miles' step reduction logs of ours (Megatron and FSDP
backends), the options refused, and ``triage-monitor import miles`` on dumps made by Miles' writer (tensor-parallel
replicas, pipeline stages, context-parallel slices).  Miles cannot be installed here (not on PyPI): its code comes
from tests/miles_contract.py, transcribed from commit 31f1ca96 with file and lines; scripts/check_miles_source.py
runs the same against Miles' own source."""

from __future__ import annotations

import json
import math
import sys
from argparse import Namespace

import numpy as np
import pandas as pd
import pytest
import torch

import miles_contract
import recording_tracker
from miles_contract import aggregate_train_losses, loss_function, policy_loss_function, save_debug_train_data_for_rank
from test_hooks_slime import GBS, PARTITION, amplifying_step, rollout, slime_micro_batch, valid_tokens
from triage_monitor.alerting.alert_rules import Rule
from triage_monitor.cli import main
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks.worker_runtime import close_all
from triage_monitor.hooks.miles import MILES_COMMIT, MilesTriageLoss, check_miles_args
from triage_monitor.alerting.trackers import CURATED_KEYS

pytestmark = pytest.mark.framework


def miles_args(**kw):
    base = dict(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, use_rollout_logprobs=False,
                calculate_per_token_loss=False, entropy_coef=0.0, observe_training_entropy=False, use_tis=False,
                tis_clip=2.0, tis_clip_low=0.0, custom_tis_function_path=None, get_mismatch_metrics=False,
                skip_actor_forward_only=False, qkv_format="thd", use_kl_loss=False, use_opsm=False,
                advantage_estimator="grpo", loss_type="custom_loss", custom_pg_loss_reducer_function_path=None,
                allgather_cp=False, multi_lora=False, global_batch_size=GBS, train_backend="megatron",
                rollout_temperature=1.0)
    base.update(kw)
    return Namespace(**base)


@pytest.fixture
def miles_modules():
    saved = miles_contract.install_miles_modules(miles_contract.single_process_state())
    yield
    miles_contract.restore_modules(saved)
    close_all()


def test_the_contract_cites_the_checked_commit():
    assert miles_contract.COMMIT == MILES_COMMIT


ICEPOP = "miles.backends.training_utils.loss_hub.corrections.icepop_function"


@pytest.mark.parametrize("kw", [{}, {"eps_clip_c": 1.05}, {"calculate_per_token_loss": True},
                                {"use_rollout_logprobs": True}, {"entropy_coef": 0.01},
                                {"observe_training_entropy": True}, {"use_tis": True, "tis_clip": 1.2},
                                {"get_mismatch_metrics": True, "tis_clip": 1.3, "tis_clip_low": 0.8},
                                {"use_tis": True, "custom_tis_function_path": ICEPOP, "tis_clip": 1.4,
                                 "tis_clip_low": 0.7},
                                {"skip_actor_forward_only": True}],
                         ids=["default", "dual-clip", "per-token", "rollout-anchor", "entropy", "observe-entropy",
                              "use-tis", "mismatch-metrics", "icepop", "skip-actor-forward"])
def test_triage_off_equals_miles_policy_loss(kw, miles_modules):
    """With Gate, TIS and Repair off, ``MilesTriageLoss()`` called as Miles' ``loss_function`` calls it gives Miles'
    ``policy_loss_function``'s loss, logits gradient and every metric, on micro-batches whose sampler is 0.5 nats off
    the learner (so Miles' TIS / ICEPOP weights act where it applies them: reproduced by our corrections)."""
    args = miles_args(**kw)
    samples = amplifying_step(3)
    for idx in ([0, 2, 3], [1, 4, 5]):                      # samples 2 and 3: one rollout, shared denominator
        mb, logits = slime_micro_batch(samples, idx, torch.zeros(()))
        l1, l2 = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        ref_loss, ref_metrics = policy_loss_function(args, mb, l1, _ssm(args, mb))
        ours_loss, ours_metrics = MilesTriageLoss()(args, mb, l2, _ssm(args, mb))
        assert float(ours_loss) == pytest.approx(float(ref_loss), rel=1e-6, abs=1e-8)
        ref_loss.backward()
        ours_loss.backward()
        torch.testing.assert_close(l2.grad, l1.grad, rtol=1e-5, atol=1e-8)
        assert set(ref_metrics) <= set(ours_metrics)
        for k, v in ref_metrics.items():
            assert float(ours_metrics[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-7), k
        assert not [k for k in ours_metrics if k.startswith("triage/")]       # no monitor, no controller


def _ssm(args, mb):
    return miles_contract.get_sum_of_sample_mean(mb["total_lengths"], mb["response_lengths"], mb["loss_masks"],
                                                 args.calculate_per_token_loss, denominators=mb["rollout_mask_sums"])


def test_miles_tis_changes_the_loss_that_our_correction_reproduces(miles_modules):
    """The equality above is not vacuous: Miles' TIS weights change its loss on this data."""
    samples = amplifying_step(3)
    mb, logits = slime_micro_batch(samples, [0, 2, 3], torch.zeros(()))
    plain = policy_loss_function(miles_args(), mb, logits, _ssm(miles_args(), mb))[0]
    tis = policy_loss_function(miles_args(use_tis=True, tis_clip=1.2), mb, logits, _ssm(miles_args(), mb))[0]
    assert abs(float(plain) - float(tis)) > 1e-3


def miles_train(hook, args, steps: int, schedule=((0, 1, 2), (3, 4, 5)), after_step=None, before_step=None) -> list:
    """``steps`` Miles train steps of one data-parallel rank holding all 6 samples (5 rollouts): per micro-batch
    Miles' ``loss_function`` → backward; one optimizer step; ``aggregate_train_losses`` as the backend calls it
    (Megatron: ÷ the step's rollout count; FSDP and per-token loss: ÷ the summed first entries).  Returns the reduced
    logs."""
    param = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.0)
    megatron = args.train_backend == "megatron" and not args.calculate_per_token_loss
    logged = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        samples = amplifying_step(step)
        losses = []
        for idx in schedule:
            mb, logits = slime_micro_batch(samples, list(idx), param)
            loss, _, log = loss_function(args, mb, len(schedule), logits, hook, num_rollouts=GBS,
                                         apply_megatron_loss_scaling=args.train_backend == "megatron")
            loss.backward()
            losses.append(log)
        opt.step()
        opt.zero_grad()
        logged.append(aggregate_train_losses([losses], GBS if megatron else None))
        if after_step is not None:
            after_step(step)
    return logged


@pytest.mark.parametrize("backend,per_token", [("megatron", False), ("fsdp", False), ("megatron", True)],
                         ids=["megatron-per-rollout", "fsdp-per-rollout", "per-token"])
def test_miles_step_log_carries_the_monitors_values_of_the_step_before(backend, per_token, miles_modules, tmp_path):
    """Through Miles' ``loss_function`` and ``aggregate_train_losses``: every curated ``triage/*`` of step s equals the
    steps table's value of step s − 1, whichever divisor the backend uses (rollouts, samples or tokens); the rule
    fires once, the tracker gets every step; Miles' own keys are there."""
    recording_tracker.register()
    rule = Rule(name="rho_asym_above_2", metric="window/rho_asym", condition="above", threshold=2.0, hold=2)
    rec = tmp_path / "rec.jsonl"
    hook = MilesTriageLoss(str(tmp_path / "run"), triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                           alerts=[rule], loggers=[{"kind": "recorder", "path": str(rec)}])
    args = miles_args(train_backend=backend, calculate_per_token_loss=per_token)
    logged = miles_train(hook, args, 5)
    close_all()
    steps = recording_tracker.steps_table(tmp_path / "run")
    assert "triage/metrics_step" not in logged[0]
    for s in range(1, 5):
        assert logged[s]["triage/metrics_step"] == pytest.approx(s - 1, abs=1e-5)
        for k in CURATED_KEYS:
            v = steps.loc[s - 1, k]
            got = logged[s][f"triage/{k}"]
            assert (got == pytest.approx(v, rel=1e-5, abs=1e-6)) if math.isfinite(v) else math.isnan(got), (s, k)
        for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "ess_ratio", "train_rollout_logprob_abs_diff",
                  "train_rollout_kl", "triage/gate_weight_mean"):
            assert k in logged[s]
    alerts = recording_tracker.alerts_table(tmp_path / "run")
    assert alerts["rule"].tolist() == [rule.name]
    rows = recording_tracker.read(rec)
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == [0, 1, 2, 3, 4]
    info = json.loads((tmp_path / "run" / "run.json").read_text())["info"]
    assert info["framework"] == "miles"


def test_the_actors_perf_timers_reach_the_rows_of_their_rollout(miles_modules, tmp_path):
    """Miles' actor logs its Timer readings of the rollout at the end of train (log_perf_data_raw → tracking.log,
    transcribed at 31f1ca96), after the optimizer step wrote the rollout's row: the hook puts them in the run's
    timings table at that step, with slime's names and mapping; Miles' own log call still gets the dict."""
    import miles_contract

    from triage_monitor.offline.analysis import open_run

    hook = MilesTriageLoss(str(tmp_path / "run"), triage=None, alerts=False)
    args = miles_args()
    miles_train(hook, args, 3, after_step=lambda rollout_id: miles_contract.log_perf_data_raw(
        rollout_id, args, True, {"train_wait": 6.0 + rollout_id, "train": 4.0, "log_probs": 1.0,
                                 "actor_train": 2.5, "update_weights": 0.5}))
    close_all()
    steps = open_run(tmp_path / "run").steps()
    assert steps["time/step"].tolist() == [10.0, 11.0, 12.0] and (steps["time/update"] == 2.5).all()
    assert (steps["time/logprob"] == 1.0).all() and (steps["time/weight_sync"] == 0.5).all()
    logged = sys.modules["miles.utils.tracking_utils.tracking"].LOGGED
    assert [d["rollout/step"] for d in logged] == [0, 1, 2]


def test_the_rollouts_raw_reward_is_the_reward_of_its_rows(miles_modules, tmp_path):
    """Miles' actor logs each rollout's rollout/raw_reward (log_rollout_data → gather_log_data → tracking.log,
    transcribed at 31f1ca96) before it trains on the rollout: the hook makes it the reward of the rollout's rows,
    from the second rollout on (the first is logged before Miles loads the loss module)."""
    import miles_contract

    from triage_monitor.offline.analysis import open_run

    hook = MilesTriageLoss(str(tmp_path / "run"), triage=None, alerts=False)
    args = miles_args()
    per_rank = {0: [[1.0, 0.0], [0.0]], 1: [[1.0, 1.0], [0.0, 0.0]], 2: [[0.5], [0.5, 0.5, 1.5]]}
    miles_train(hook, args, 3, before_step=lambda rollout_id: miles_contract.log_rollout_raw_reward(
        rollout_id, args, per_rank[rollout_id]))
    close_all()
    got = open_run(tmp_path / "run").steps().set_index("step")["reward"]
    assert got.index.tolist() == [0, 1, 2] and np.isnan(got[0]) and got[[1, 2]].tolist() == [0.5, 0.75]
    logged = sys.modules["miles.utils.tracking_utils.tracking"].LOGGED
    assert [d["rollout/raw_reward"] for d in logged] == pytest.approx([1 / 3, 0.5, 0.75])


@pytest.mark.parametrize("kw,match", [
    ({"use_kl_loss": True}, "use-kl-loss"), ({"use_opsm": True}, "use-opsm"), ({"advantage_estimator": "gspo"}, "gspo"),
    ({"custom_pg_loss_reducer_function_path": "m.f"}, "custom-pg-loss-reducer"),
    ({"use_tis": True, "custom_tis_function_path": "m.f"}, "custom-tis-function-path"),
    ({"loss_type": "policy_loss"}, "custom_loss"), ({"allgather_cp": True}, "allgather-cp"),
    ({"multi_lora": True}, "multi-lora"),
])
def test_unsupported_options_raise(kw, match, miles_modules):
    with pytest.raises(ValueError, match=match):
        check_miles_args(miles_args(**kw))
    check_miles_args(miles_args())                                    # the defaults are fine
    check_miles_args(miles_args(use_tis=True, custom_tis_function_path=ICEPOP))
    with pytest.raises(ValueError, match="two importance corrections"):
        check_miles_args(miles_args(use_tis=True), triage=TriageConfig())
    two = miles_contract.GroupInfo(0, 2, None)
    one = miles_contract.GroupInfo(0, 1, None)
    with pytest.raises(ValueError, match="context parallel size 2"):
        check_miles_args(miles_args(), miles_contract.ParallelState(intra_dp_cp=one, cp=two, tp=one, indep_dp=one))
    with pytest.raises(ValueError, match="indep_dp"):
        check_miles_args(miles_args(), miles_contract.ParallelState(intra_dp_cp=one, cp=one, tp=one, indep_dp=two))


# ------------------------------------------------------------------ import
def miles_shard(full: dict, dp: int, *, last_stage: bool = True) -> dict:
    """A DP rank's rollout_data when Miles dumps it (after training): per-sample lists, full-length tokens and
    masks.  Earlier pipeline stages hold no learner log-probs nor advantages."""
    part = PARTITION[dp]
    keys = ("tokens", "response_lengths", "total_lengths", "loss_masks", "rollout_log_probs", "log_probs",
            "advantages", "sample_indices", "rewards")
    rd = {k: [full[k][j] for j in part] for k in keys}
    rd["rollout_mask_sums"] = full["rollout_mask_sums"][part]
    if not last_stage:
        del rd["log_probs"], rd["advantages"]
    return rd


def cp_slice(rd: dict, cp_rank: int, cp_size: int) -> dict:
    """What a context-parallel rank of that shard holds (miles data.py L94-114: rollout log-probs sliced; the
    learner log-probs and advantages are computed on the rank's slice)."""
    out = dict(rd)
    for key in ("log_probs", "rollout_log_probs", "advantages"):
        if key in rd:
            out[key] = [miles_contract.slice_log_prob_with_cp(v, t, r, cp_rank=cp_rank, cp_size=cp_size)
                        for v, t, r in zip(rd[key], rd["total_lengths"], rd["response_lengths"])]
    return out


def write_dumps(tmp_path, rollouts, name, *, tp=1, cp=1, pp=1):
    """Every rank's file of DP 2 × TP ``tp`` × CP ``cp`` × PP ``pp`` (Miles' rank order: tp fastest, then cp, dp,
    pp)."""
    paths = []
    for rid, full in rollouts.items():
        for stage in range(pp):
            for dp in range(2):
                for c in range(cp):
                    for t in range(tp):
                        rank = t + tp * (c + cp * (dp + 2 * stage))
                        rd = cp_slice(miles_shard(full, dp, last_stage=stage == pp - 1), c, cp) if cp > 1 else \
                            miles_shard(full, dp, last_stage=stage == pp - 1)
                        paths.append(save_debug_train_data_for_rank(
                            str(tmp_path / name / "{rollout_id}_{rank}.pt"), rollout_id=rid, rollout_data=rd,
                            rank=rank, cp_rank=c, cp_size=cp))
    return paths


def imported(tmp_path, paths, name):
    out = tmp_path / name
    assert main(["import", "miles", *map(str, paths), "--out", str(out), "--calibration-steps", "1"]) == 0
    return pd.read_parquet(out / "steps"), pd.read_parquet(out / "tokens"), json.loads((out / "run.json").read_text())


def test_import_miles_dumps_every_token_once_with_context_parallel_slices_put_back(tmp_path):
    rollouts = {0: rollout(20), 1: rollout(21)}
    plain = write_dumps(tmp_path, rollouts, "plain")
    replicas = write_dumps(tmp_path, rollouts, "tp_pp", tp=2, pp=2)
    sliced = write_dumps(tmp_path, rollouts, "cp", cp=2, tp=2)
    cols = ["step", "sample_id", "position", "learner_logp", "sampler_logp", "advantage"]
    ref_steps, ref, man = imported(tmp_path, plain, "a")
    for rid, full in rollouts.items():
        assert (ref["step"] == rid).sum() == valid_tokens(full)
    # a sample's first valid token, by hand
    row = ref[(ref["step"] == 1) & (ref["sample_id"] == 2101) & (ref["position"] == 0)].iloc[0]
    assert row["learner_logp"] == pytest.approx(float(rollouts[1]["log_probs"][1][0]))
    assert row["sampler_logp"] == pytest.approx(float(rollouts[1]["rollout_log_probs"][1][0]))
    assert man["info"]["framework"] == "miles" and man["info"]["replica_files_dropped"] == 0
    for paths, name, dropped in ((replicas, "b", 2 * 2 * 3), (sliced, "c", 2 * 4)):
        steps, tokens, man = imported(tmp_path, paths, name)
        pd.testing.assert_frame_equal(tokens[cols].sort_values(cols).reset_index(drop=True),
                                      ref[cols].sort_values(cols).reset_index(drop=True))
        assert man["info"]["replica_files_dropped"] == dropped
        assert np.allclose(steps["k3_kl"], ref_steps["k3_kl"])
    assert json.loads((tmp_path / "c" / "run.json").read_text())["info"]["cp_sizes"] == [2]


def test_import_miles_refuses_a_missing_context_parallel_rank_naming_the_file(tmp_path, capsys):
    paths = write_dumps(tmp_path, {0: rollout(22)}, "cp", cp=2)
    keep = [p for p in paths if not p.name.endswith("_1.pt")]          # rank 1: DP 0's CP rank 1
    assert main(["import", "miles", *map(str, keep), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "context-parallel ranks [0] of 2" in err and ".pt" in err
    assert not (tmp_path / "o").exists()


def test_the_docs_lines_configure_the_hook():
    """The ``mymod.py`` lines of docs/hooks.md#miles, run as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    section = text.split("\n## Miles\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n# mymod.py\n", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(code, ns)
    s = ns["triage_loss"].settings
    assert isinstance(ns["triage_loss"], MilesTriageLoss)
    assert (s.run_dir, s.alerts, s.framework_keys, s.step_source) == ("/shared/runs/exp1", True, "curated",
                                                                      "optimizer")
    assert s.triage is not None and [t.kind for t in s.loggers] == ["tensorboard", "mlflow"]
    assert s.manifest["framework"] == "miles"
