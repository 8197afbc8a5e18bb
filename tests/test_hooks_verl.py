"""verl hook against the real installed verl package: a real DataProto through the monitoring adapter,
the TRIAGE loss registered in verl's own registry and called through verl's lookup, and the bypass-mode
route by which the rollout log-probs reach it (verl's own ``apply_bypass_mode``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
pd = pytest.importorskip("pandas")

from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.controller import TriageConfig, TriageController, weighted_policy_loss  # noqa: E402
from triage_monitor.corrections import ppo_clip_loss  # noqa: E402
from triage_monitor.hooks import verl as hook  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402


@pytest.fixture
def registry():
    """Restore verl's global registry after each test (register() writes into it)."""
    saved = dict(core_algos.POLICY_LOSS_REGISTRY)
    yield core_algos.POLICY_LOSS_REGISTRY
    core_algos.POLICY_LOSS_REGISTRY.clear()
    core_algos.POLICY_LOSS_REGISTRY.update(saved)


def make_actor_batch(seed=0, B=6, T=150):
    """Tensors laid out as verl's agent loop + old-log-prob pass leave them (right-padded, 0.0 rollout padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([150, 90, 7, 128, 64, 33])[:B]
    valid = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid.clone()
    mask[1, 30:40] = False                                   # tool-response tokens of a multi-turn rollout
    rollout = torch.where(valid, -torch.rand(B, T, generator=g) * 3 - 1e-3, torch.zeros(()))
    delta = torch.randn(B, T, generator=g) * 0.2
    delta[:, ::13] -= 8.0
    old = torch.where(valid, (rollout + delta).clamp(max=-1e-4), torch.zeros(()))
    scores = torch.randn(B, generator=g)
    adv = torch.where(valid, scores.unsqueeze(1), torch.zeros(()))
    uid = np.array(["p0", "p0", "p1", "p1", "p2", "p2"][:B], dtype=object)
    return old, rollout, adv, mask, uid


def actor_config():
    from verl.workers.config import FSDPActorConfig
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                           clip_ratio_low=0.2, clip_ratio_high=0.28)


def test_monitoring_from_real_dataproto(tmp_path):
    old, rollout, adv, mask, uid = make_actor_batch()
    data = verl.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "advantages": adv,
                                             "response_mask": mask.long()}, non_tensors={"uid": uid})
    with MismatchMonitor(tmp_path / "run", MonitorConfig(), manifest={"framework": "verl"}) as mon:
        metrics = hook.log_dataproto(mon, 7, data)
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    assert len(tokens) == int(mask.sum())                                 # padding and tool tokens excluded
    assert set(tokens["step"].astype(int)) == {7}
    r1 = tokens[tokens["sample_id"] == 1]
    assert not set(range(30, 40)) & set(r1["position"]) and 40 in set(r1["position"])
    assert torch.equal(torch.tensor(r1["sampler_logp"].to_numpy()), rollout[1][mask[1]])
    assert tokens.groupby("sample_id")["group_id"].first().tolist() == [0, 0, 1, 1, 2, 2]
    d = (old - rollout)[mask]
    assert abs(metrics["delta_mean"] - float(d.mean())) < 1e-6
    assert metrics["zero_logp_count"] == 0                               # 0.0 padding never read as data


def test_missing_rollout_log_probs_names_the_setting():
    old, rollout, adv, mask, _ = make_actor_batch()
    data = verl.DataProto.from_dict(tensors={"old_log_probs": old, "advantages": adv, "response_mask": mask.long()})
    with pytest.raises(KeyError, match="calculate_log_probs"):
        hook.batch_from_dataproto(data)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_registered_loss_equals_core_api(registry, agg):
    cfg = TriageConfig()
    fn = hook.register(TriageController(cfg))
    assert core_algos.get_policy_loss_fn("triage") is fn
    old, rollout, adv, mask, _ = make_actor_batch()
    live = old.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn("triage")(     # exactly how verl's ppo_loss calls it (bypass mode)
        old_log_prob=rollout, log_prob=live, advantages=adv, response_mask=mask, loss_agg_mode=agg,
        config=actor_config(), rollout_is_weights=None)
    batch = TokenBatch.from_padded(old.clone().requires_grad_(True), rollout, adv, mask)
    out = TriageController(cfg)(batch, step=0, old_logp=batch.sampler_logp)
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights)
    assert float(out.gate_weights.min()) < 1.0
    assert torch.equal(fn.last.output.repair_loss.detach(), out.repair_loss.detach())
    norm = {"token-mean": "global_token", "seq-mean-token-mean": "per_response"}[agg]
    ptl = ppo_clip_loss(batch.learner_logp, batch.sampler_logp, batch.advantage, 0.2, 0.28)
    expected = weighted_policy_loss(ptl, out.token_weights, batch, norm) + out.repair_loss
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert live.grad is not None and bool((live.grad[~mask] == 0).all()) and bool((live.grad[mask] != 0).any())
    assert set(metrics) >= {"triage/gate_weight_mean", "triage/repair_loss"}


def test_bypass_mode_route_through_verl(registry):
    """verl's own apply_bypass_mode copies rollout_log_probs into old_log_probs and forces loss_mode
    'bypass_mode'; with as_bypass_mode=True the lookup then returns the TRIAGE loss."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    fn = hook.register(as_bypass_mode=True)
    old, rollout, adv, mask, _ = make_actor_batch()
    data = verl.DataProto.from_dict(tensors={"rollout_log_probs": rollout, "advantages": adv,
                                             "response_mask": mask.long()})
    policy_loss_cfg = OmegaConf.create({"loss_mode": "triage"})
    apply_bypass_mode(data, OmegaConf.create({"bypass_mode": True, "loss_type": "ppo_clip"}), policy_loss_cfg)
    assert torch.equal(data.batch["old_log_probs"], rollout)
    assert core_algos.get_policy_loss_fn(policy_loss_cfg["loss_mode"]) is fn
    loss, _ = fn(data.batch["old_log_probs"], old, adv, mask, "token-mean", actor_config(), None)
    assert torch.isfinite(loss)


def test_global_batch_info_scaling(registry):
    """verl's agg_loss divides by the global token count × dp: the micro-batch share is n_local / N · dp."""
    fn = hook.register()
    old, rollout, adv, mask, _ = make_actor_batch()
    cfg = actor_config()
    local, _ = fn(rollout, old, adv, mask, "token-mean", cfg, None)
    cfg.global_batch_info.update({"dp_size": 2, "batch_num_tokens": int(mask.sum()) * 4})
    scaled, _ = fn(rollout, old, adv, mask, "token-mean", cfg, None)
    assert torch.allclose(scaled, local * 0.5)


def test_unsupported_agg_mode_is_named(registry):
    fn = hook.register()
    old, rollout, adv, mask, _ = make_actor_batch()
    with pytest.raises(ValueError, match="token-sum"):
        fn(rollout, old, adv, mask, "token-sum", actor_config(), None)


def test_called_by_verls_own_ppo_loss(registry):
    """verl's worker loss entry (workers.utils.losses.ppo_loss) looks the TRIAGE loss up by
    config.policy_loss.loss_mode and feeds it the unpadded model output sliced back to (B, T)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    fn = hook.register()
    g = torch.Generator().manual_seed(5)
    B, P, T = 3, 4, 70
    resp_lens, prompt_lens = torch.tensor([70, 33, 51]), torch.tensor([4, 2, 3])
    att = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):                        # left-padded prompts, right-padded responses (verl's layout)
        att[i, P - prompt_lens[i]:P] = 1
        att[i, P:P + resp_lens[i]] = 1
    resp_mask = (torch.arange(T)[None] < resp_lens[:, None]).long()
    live_resp = (-torch.rand(B, T, generator=g) - 1e-3) * resp_mask
    # remove-padding model output: one value per real token, log-prob of the *next* token
    flat = torch.cat([torch.cat([-torch.rand(int(prompt_lens[i]) - 1, generator=g), live_resp[i, :resp_lens[i]],
                                 torch.zeros(1)]) for i in range(B)]).requires_grad_(True)
    rollout = ((live_resp + 0.4 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)) * resp_mask
    adv = torch.tensor([[-1.0], [0.5], [-0.3]]).expand(B, T).contiguous()
    data = TensorDict({"prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
                       "attention_mask": att, "response_mask": resp_mask, "old_log_probs": rollout,
                       "advantages": adv}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                          clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=PolicyLossConfig(loss_mode="triage"))
    loss, _ = ppo_loss(cfg, {"log_probs": flat}, data)
    assert fn.calls == 1
    mask = resp_mask.bool()
    assert torch.equal(fn.last.batch.learner_logp.detach(), live_resp[mask])
    batch = TokenBatch.from_padded(live_resp, rollout, adv, mask)
    out = TriageController()(batch, step=0, old_logp=batch.sampler_logp)
    expected = weighted_policy_loss(ppo_clip_loss(batch.learner_logp, batch.sampler_logp, batch.advantage, 0.2, 0.28),
                                    out.token_weights, batch, "global_token") + out.repair_loss
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert float(flat.grad.abs().sum()) > 0


def _same_metrics(got: dict, ref: dict):
    for k, v in ref.items():
        assert k in got, k
        assert (math.isnan(v) and math.isnan(got[k])) or got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_micro_batches_of_a_step_are_one_monitored_step(registry, tmp_path, caplog):
    """Two loss calls (micro-batches) with fn.step = 3 → ONE step on disk: the union of the tokens (sample ids
    kept distinct), Gate weights in call order, and the metrics of one log_step on the concatenated rows —
    an empty response and a quarantined token included; a new step value flushes it, close() writes the last."""
    old, rollout, adv, mask, _ = make_actor_batch()
    mask[4] = False                                              # a response with no valid token (micro-batch 2)
    old[1, 5] = 0.5                                              # an impossible learner log-prob: quarantined
    mon = MismatchMonitor(tmp_path / "run", MonitorConfig(calibration_steps=2))
    fn = hook.register(monitor=mon, on_invalid="quarantine")
    fn.step = 3
    rows = (slice(0, 3), slice(3, 6))
    gates, stats = [], []
    for r in rows:                                               # how verl's ppo_loss calls it per micro-batch
        core_algos.get_policy_loss_fn("triage")(old_log_prob=rollout[r], log_prob=old[r].clone().requires_grad_(True),
                                                advantages=adv[r], response_mask=mask[r], loss_agg_mode="token-mean",
                                                config=actor_config(), rollout_is_weights=None)
        gates.append(fn.last.output.gate_weights.detach())
        stats.append(fn.last.output.stats["repair_loss"])
    assert fn.calls == 2 and mon.steps_logged == 0              # nothing logged until the step is over
    fn.step = 4
    fn(rollout[:2], old[:2], adv[:2], mask[:2], "token-mean", actor_config(), None)
    assert mon.steps_logged == 1                                 # the new step value flushed step 3
    with caplog.at_level("WARNING", logger="triage_monitor"):
        merged = dict(fn.close() or {})
        assert mon.steps_logged == 2
        assert fn.close() is None                                # nothing left to write
        mon.close()
    assert "logged twice" not in caplog.text
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    t3 = tokens[tokens["step"].astype(int) == 3].sort_values(["sample_id", "position"])
    keep = mask.clone()
    keep[1, 5] = False
    assert len(t3) == int(keep.sum()) and sorted(set(t3["sample_id"])) == [0, 1, 2, 3, 5]
    assert torch.equal(torch.tensor(t3["sampler_logp"].to_numpy()), rollout[keep])
    assert torch.equal(torch.tensor(t3["gate_weight"].to_numpy()), torch.cat(gates))
    assert len(tokens[tokens["step"].astype(int) == 4]) == int(mask[:2].sum()) - 1
    steps = pd.read_parquet(tmp_path / "run" / "steps")
    assert sorted(steps["step"].astype(int)) == [3, 4]
    # reference: one log_step on all six rows at once, in a fresh run
    with MismatchMonitor(tmp_path / "ref", MonitorConfig(calibration_steps=2)) as ref_mon:
        ref = ref_mon.log_step(3, TokenBatch.from_padded(old, rollout, adv, mask, on_invalid="quarantine"))
        ref_mon.log_step(4, TokenBatch.from_padded(old[:2], rollout[:2], adv[:2], mask[:2], on_invalid="quarantine"))
    s3 = steps[steps["step"].astype(int) == 3].iloc[0]
    assert ref["empty_response_count"] == 1 and ref["quarantined_count"] == 1 and ref["positive_logp_count"] == 1
    compared = {k: v for k, v in ref.items() if k in s3 and k not in ("step", "writer_dropped_rows")}
    assert len(compared) > 40 and "window/rho_asym" in compared
    _same_metrics({k: float(s3[k]) for k in compared}, compared)
    assert merged["step"] == 4 and "gate_weight_mean" in merged
    assert stats[0] != stats[1] and float(s3["repair_loss"]) == pytest.approx(sum(stats) / 2)  # mean over calls
    q = pd.read_parquet(tmp_path / "run" / "quarantine")
    q3 = q[q["step"].astype(int) == 3]
    assert q3[["sample_id", "position"]].values.tolist() == [[1, 5]]


def test_step_unset_counts_calls_and_warns_once(registry, tmp_path, caplog):
    """Without fn.step every loss call is its own step (controller and monitor), and a warning says so once."""
    old, rollout, adv, mask, _ = make_actor_batch()
    with MismatchMonitor(tmp_path / "run", MonitorConfig()) as mon:
        fn = hook.register(monitor=mon)
        with caplog.at_level("WARNING", logger="triage_monitor"):
            for i, r in enumerate((slice(0, 3), slice(3, 6), slice(0, 2))):
                fn(rollout[r], old[r], adv[r], mask[r], "token-mean", actor_config(), None)
                assert mon.steps_logged == i + 1                 # nothing to merge: logged at once
        assert fn.close() is None
    assert caplog.text.count(".step is not set") == 1
    assert fn.controller.last_step == 2
    steps = pd.read_parquet(tmp_path / "run" / "steps")
    assert sorted(steps["step"].astype(int)) == [0, 1, 2]
