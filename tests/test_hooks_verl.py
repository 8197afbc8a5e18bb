"""verl 0.9.1 hook against the installed package: the TRIAGE loss through verl's registry and verl's own worker
loss entry ``ppo_loss`` (v1 nested layout), compared with verl's own policy losses on the same tensors; verl's
metrics kept; steps from the published ``global_steps``; the loss module imported in Ray workers the way
``external_lib`` does; monitoring from the v1 trainer's TransferQueue batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("CI") == "true":
    import verl  # noqa: F401 — a missing framework install fails under CI, never skips
verl = pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
pd = pytest.importorskip("pandas")

from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.triage.controller import TriageConfig, TriageController  # noqa: E402
from triage_monitor.hooks import verl as hook  # noqa: E402
from triage_monitor.hooks.worker_runtime import HookSettings  # noqa: E402
from triage_monitor.triage.loss import triage_policy_loss  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402
from triage_monitor.offline.analysis import open_run  # noqa: E402
from triage_monitor.metrics.timings import cycle_summary  # noqa: E402
from runfiles import shown  # noqa: E402

pytestmark = pytest.mark.framework

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OFF = dict(gate=False, tis=False, repair=False)


@pytest.fixture
def registry():
    """Restore verl's global registry after each test (register() writes into it)."""
    saved = dict(core_algos.POLICY_LOSS_REGISTRY)
    yield core_algos.POLICY_LOSS_REGISTRY
    core_algos.POLICY_LOSS_REGISTRY.clear()
    core_algos.POLICY_LOSS_REGISTRY.update(saved)


def make_actor_batch(seed=0, B=6, T=40):
    """Bypass-mode tensors as verl's ppo_loss hands them to a policy loss: ``old`` = rollout log-probs (0.0
    padding), ``live`` = the learner's; tool tokens masked; some A<0 tokens with ratio > clip_ratio_c = 3."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([40, 31, 7, 28, 19, 12])[:B]
    valid = torch.arange(T)[None] < lengths[:, None]
    mask = valid.clone()
    mask[1, 10:14] = False                                     # tool-response tokens of a multi-turn rollout
    rollout = torch.where(valid, -torch.rand(B, T, generator=g) * 3 - 0.05, torch.zeros(()))
    delta = torch.randn(B, T, generator=g) * 0.2
    delta[:, ::9] -= 4.0                                       # learner far below the sampler: Gate territory
    delta[:, 4::11] += 1.6                                     # ratio e^1.6 ≈ 5 > 3: dual clip territory
    live = torch.where(valid, (rollout + delta).clamp(max=-1e-4), torch.zeros(()))
    scores = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, -0.3])[:B]
    adv = torch.where(valid, scores[:, None].expand(B, T), torch.zeros(()))
    return live, rollout, adv, mask


def actor_config(**kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    args = dict(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                policy_loss=PolicyLossConfig(loss_mode="triage"))
    args.update(kw)
    return FSDPActorConfig(**args)


def global_info(cfg, mask, dp=2, share=2):
    """What verl's ppo_loss stores before calling the policy loss: this micro-batch is 1/share of the rank's
    mini-batch, dp ranks."""
    cfg.global_batch_info.update({"dp_size": dp, "batch_num_tokens": int(mask.sum()) * share * dp,
                                  "global_batch_size": mask.shape[0] * share * dp, "loss_scale_factor": None})
    return cfg


def call(fn, live, rollout, adv, mask, agg, cfg):
    """Exactly how verl's ppo_loss calls a registered policy loss (bypass mode: old_log_prob = rollout)."""
    return fn(old_log_prob=rollout, log_prob=live, advantages=adv, response_mask=mask, loss_agg_mode=agg,
              config=cfg, rollout_is_weights=None)


# ------------------------------------------------------------------ loss = verl's own, TRIAGE off
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("with_global", [False, True])
def test_triage_off_equals_verls_own_default_policy_loss(registry, agg, with_global):
    """TRIAGE with Gate/Repair/TIS off = verl's compute_policy_loss_vanilla (loss_mode 'vanilla', the v1 default),
    dual clip included, value and gradient, on the same tensors, in every loss_agg_mode, with and without verl's
    global-batch / dp scaling."""
    hook.register(HookSettings(triage=TriageConfig(**OFF)))
    live, rollout, adv, mask = make_actor_batch()
    cfg_ours, cfg_verl = actor_config(), actor_config(policy_loss={"loss_mode": "vanilla"})
    if with_global:
        global_info(cfg_ours, mask), global_info(cfg_verl, mask)
    a, b = live.clone().requires_grad_(True), live.clone().requires_grad_(True)
    ours, m_ours = call(core_algos.get_policy_loss_fn("triage"), a, rollout, adv, mask, agg, cfg_ours)
    ref, m_ref = call(core_algos.get_policy_loss_fn("vanilla"), b, rollout, adv, mask, agg, cfg_verl)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-7), (float(ours), float(ref))
    ours.backward(), ref.backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-8)
    for k, v in m_ref.items():                                       # verl's own metrics kept, same values
        assert m_ours[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert m_ref["actor/pg_clipfrac_lower"] > 0                      # dual clip is active on these tensors


def test_dual_clip_is_honoured(registry):
    """Without clip_ratio_c the loss differs from verl's (the A<0, ratio>3 tokens); with it they agree."""
    live, rollout, adv, mask = make_actor_batch()
    cfg = actor_config()
    fn = hook.register(HookSettings(triage=None))
    ours, _ = call(fn, live, rollout, adv, mask, "token-mean", cfg)
    ref, _ = core_algos.compute_policy_loss_vanilla(rollout, live, adv, mask, "token-mean", cfg)
    batch = TokenBatch.from_padded(live, rollout, adv, mask)
    no_dual = triage_policy_loss(TriageController(TriageConfig(**OFF)), batch, 0, old_logp=batch.sampler_logp,
                                 clip_low=0.2, clip_high=0.28, agg_mode="token_mean").loss
    assert torch.allclose(ours, ref, atol=1e-7)
    assert float(no_dual) > 1.5 * float(ref) > 0                     # the dual clip caps those tokens' loss


def test_triage_off_equals_verls_bypass_mode_loss_and_rollout_corr(registry):
    """Against verl's own bypass-mode loss (ppo_clip): same loss, and the same rollout_corr/* metrics, computed
    by verl's rollout_corr_helper on the same tensors (token IS weights for metrics, as verl's ppo_clip)."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True)
    live, rollout, adv, mask = make_actor_batch(seed=3)
    cfg_ours = global_info(actor_config(policy_loss=PolicyLossConfig(loss_mode="triage", rollout_correction=rc)), mask)
    cfg_verl = global_info(actor_config(policy_loss=PolicyLossConfig(loss_mode="bypass_mode",
                                                                     rollout_correction=rc)), mask)
    fn = hook.register(HookSettings(triage=None))
    ours, m_ours = call(fn, live, rollout, adv, mask, "seq-mean-token-mean", cfg_ours)
    ref, m_ref = call(core_algos.get_policy_loss_fn("bypass_mode"), live, rollout, adv, mask,
                      "seq-mean-token-mean", cfg_verl)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-7)
    corr = [k for k in m_ref if k.startswith("rollout_corr/")]
    assert len(corr) > 10 and "rollout_corr/rollout_is_mean" in corr and "rollout_corr/kl" in corr
    assert {k: m_ours[k] for k in m_ref} == pytest.approx(m_ref, rel=1e-6, abs=1e-9, nan_ok=True)


# ------------------------------------------------------------------ TRIAGE on: verl's normaliser, micro-batches
@pytest.mark.parametrize("agg", AGG_MODES)
def test_triage_on_uses_verls_normaliser_and_adds_up_over_micro_batches(registry, agg):
    """Gate + TIS on (Repair off for an exact sum): the loss is the core's triage_policy_loss with verl's
    normaliser as denominator and dp_size as loss_scale; two micro-batches of one mini-batch add up to the loss
    of the whole mini-batch (same global counts), as verl's gradient accumulation needs."""
    cfg_t = TriageConfig(repair=False, gate_width=8)
    fn = hook.register(HookSettings(triage=cfg_t))
    live, rollout, adv, mask = make_actor_batch(seed=1)
    cfg = global_info(actor_config(), mask, dp=2, share=1)
    whole, metrics = call(fn, live, rollout, adv, mask, agg, cfg)
    assert fn.last["gate_weight_min"] < 1.0 and "triage/gate_weight_mean" in metrics
    # only detached statistics outlive the call (no per-token tensor, no autograd graph)
    assert not any(torch.is_tensor(v) for v in (*fn.last.values(), *fn.last["stats"].values()))
    batch = TokenBatch.from_padded(live, rollout, adv, mask)
    spec = hook.verl_aggregation(agg, mask, cfg)
    expected = triage_policy_loss(TriageController(cfg_t), batch, 0, old_logp=batch.sampler_logp, clip_low=0.2,
                                  clip_high=0.28, dual_clip=3.0, **spec).loss
    assert torch.allclose(whole, expected, rtol=1e-6, atol=1e-7)
    parts = [call(fn, live[r], rollout[r], adv[r], mask[r], agg, cfg)[0] for r in (slice(0, 2), slice(2, 6))]
    if agg == "seq-mean-token-sum-norm":          # verl's horizon is each micro-batch's padded width: same T here
        assert mask[0:2].shape[-1] == mask.shape[-1]
    assert torch.allclose(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-7)


def test_verl_normalisers_by_hand():
    """D for each mode on a 2×4 mask with 3 + 0 valid tokens (a fully masked row), global counts absent, dp 1."""
    from types import SimpleNamespace
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    cfg = SimpleNamespace(global_batch_info={}, loss_scale_factor=None)
    assert hook.verl_aggregation("token-mean", mask, cfg)["denominator"] == 3.0
    assert hook.verl_aggregation("token-sum", mask, cfg)["denominator"] == 1.0
    assert hook.verl_aggregation("seq-mean-token-sum", mask, cfg)["denominator"] == 1.0
    assert hook.verl_aggregation("seq-mean-token-sum-norm", mask, cfg)["denominator"] == 4.0   # 1 seq × T=4
    cfg.global_batch_info = {"dp_size": 4, "batch_num_tokens": 40, "global_batch_size": 16, "loss_scale_factor": 7}
    assert hook.verl_aggregation("token-mean", mask, cfg) == {"agg_mode": "token_mean", "denominator": 40.0,
                                                              "loss_scale": 4.0}
    assert hook.verl_aggregation("seq-mean-token-sum-norm", mask, cfg)["denominator"] == 16.0 * 7
    cfg.global_batch_info = {"dp_size": 2}
    with pytest.raises(ValueError, match="batch_num_tokens is required when dp_size > 1"):
        hook.verl_aggregation("token-mean", mask, cfg)
    with pytest.raises(ValueError, match="'weird'"):
        hook.verl_aggregation("weird", mask, cfg)


# ------------------------------------------------------------------ verl's real worker call site (v1 layout)
def v1_micro_batch(seed=5, amplify=0.0):
    """A v1 micro-batch as the FSDP engine hands it to ppo_loss: nested (jagged) prompts / responses / response
    fields from the TransferQueue, and the remove-padding model output (one log-prob per prompt+response token,
    of the *next* token) as a nested tensor.  ``amplify`` > 0: a sampler biased in the amplifying direction by
    that many nats (above the learner on the A < 0 responses, below it on the A > 0 one), ±0.05 nats noise."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [4, 2, 3], [30, 13, 21]
    B, T = 3, max(resp_lens)
    adv_row = [-1.0, 0.5, -0.3]
    live = [(-torch.rand(n, generator=g) * 2 - 1e-3 - amplify) for n in resp_lens]
    if amplify:
        rollout = [(x - amplify * (1.0 if a > 0 else -1.0) + 0.05 * torch.randn(len(x), generator=g)).clamp(max=-1e-4)
                   for x, a in zip(live, adv_row)]
    else:
        rollout = [(x + 0.5 * torch.randn(len(x), generator=g)).clamp(max=-1e-4) for x in live]
    for x, r in zip(live, rollout):
        x[3], r[3] = -0.9, -2.5                                    # ratio e^1.6 ≈ 5 > 3: a dual-clip token
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    flat = torch.cat([torch.cat([-torch.rand(p - 1, generator=g), lv, torch.zeros(1)])
                      for p, lv in zip(prompt_lens, live)])
    data = TensorDict({
        "prompts": nested([torch.ones(p, dtype=torch.long) for p in prompt_lens]),
        "responses": nested([torch.ones(n, dtype=torch.long) for n in resp_lens]),
        "response_mask": nested([torch.ones(n, dtype=torch.long) for n in resp_lens]),
        "old_log_probs": nested(rollout),
        "advantages": nested([torch.full((n,), a) for n, a in zip(resp_lens, adv_row)]),
    }, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(resp_lens), global_batch_size=B, max_response_len=T)
    padded = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, T - len(x))) for x in xs])  # noqa: E731
    mask = padded([torch.ones(n) for n in resp_lens]).bool()
    adv = padded([torch.full((n,), a) for n, a in zip(resp_lens, adv_row)])
    return data, flat, padded(live), padded(rollout), adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_through_verls_ppo_loss_v1_layout(registry, agg, tmp_path):
    """verl's worker loss entry (workers.utils.losses.ppo_loss) looks the loss up by policy_loss.loss_mode, slices
    the nested model output back to (B, T) and passes the global counts: TRIAGE off gives verl's own ppo_loss
    with loss_mode=vanilla; TRIAGE on gives the core loss on the same (B, T) tensors (the recorded tokens)."""
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    hook.register(HookSettings(triage=None), name="triage_off")
    fn_on = hook.register(HookSettings(run_dir=str(tmp_path / "run"), triage=TriageConfig(gate_width=8),
                                       monitor=MonitorConfig(calibration_steps=1)))
    losses = {}
    for mode in ("triage_off", "vanilla", "triage"):
        data, flat, live, rollout, adv, mask = v1_micro_batch()
        out = flat.clone().requires_grad_(True)
        cfg = actor_config(loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=mode))
        loss, metrics = ppo_loss(cfg, {"log_probs": out}, data)
        loss.backward()
        losses[mode] = (loss.detach(), out.grad, {k: v.aggregate() if hasattr(v, "aggregate") else v
                                              for k, v in metrics.items()})
    assert torch.allclose(losses["triage_off"][0], losses["vanilla"][0], rtol=1e-6, atol=1e-7)
    assert torch.allclose(losses["triage_off"][1], losses["vanilla"][1], rtol=1e-5, atol=1e-8)
    assert losses["triage_off"][2]["actor/pg_clipfrac_lower"] == losses["vanilla"][2]["actor/pg_clipfrac_lower"] > 0
    fn_on.close()
    tokens = pd.read_parquet(tmp_path / "run" / "tokens").sort_values(["sample_id", "position"])
    assert torch.equal(torch.tensor(tokens["learner_logp"].to_numpy()), live[mask])
    assert torch.equal(torch.tensor(tokens["sampler_logp"].to_numpy()), rollout[mask])
    batch = TokenBatch.from_padded(live, rollout, adv, mask)
    spec = hook.verl_aggregation(agg, mask, actor_config())
    expected = triage_policy_loss(TriageController(TriageConfig(gate_width=8)), batch, 0, old_logp=batch.sampler_logp,
                                  clip_low=0.2, clip_high=0.28, dual_clip=3.0, **spec).loss
    assert torch.allclose(losses["triage"][0], expected, rtol=1e-6, atol=1e-7)
    assert "rollout_corr/kl" in losses["triage"][2] and "triage/repair_loss" in losses["triage"][2]


# ------------------------------------------------------------------ unsupported options raise
def test_unsupported_options_raise_clearly(registry):
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    fn = hook.register(HookSettings(triage=TriageConfig()))
    live, rollout, adv, mask = make_actor_batch()
    with pytest.raises(ValueError, match="bypass_mode=True"):
        fn(rollout, live, adv, mask, "token-mean", actor_config(), torch.ones_like(live))
    rs = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    with pytest.raises(ValueError, match="rollout_rs='token_k1'"):
        call(fn, live, rollout, adv, mask, "token-mean", actor_config(policy_loss=PolicyLossConfig(
            loss_mode="triage", rollout_correction=rs)))
    rf = RolloutCorrectionConfig(loss_type="reinforce")
    with pytest.raises(ValueError, match="loss_type='reinforce'"):
        call(fn, live, rollout, adv, mask, "token-mean", actor_config(policy_loss=PolicyLossConfig(
            loss_mode="triage", rollout_correction=rf)))
    with pytest.raises(ValueError, match="not one of"):
        call(fn, live, rollout, adv, mask, "mean", actor_config())


def test_settings_from_env(tmp_path):
    s = hook.settings_from_env({"TRIAGE_MONITOR_RUN_DIR": str(tmp_path / "run"),
                                "TRIAGE_MONITOR_TRIAGE": '{"gate_width": 32, "repair": false}',
                                "TRIAGE_MONITOR_CONFIG": '{"window": 7}', "TRIAGE_MONITOR_ON_INVALID": "quarantine"})
    assert s.run_dir == str(tmp_path / "run") and s.triage.gate_width == 32 and not s.triage.repair
    assert s.monitor.window == 7 and s.on_invalid == "quarantine" and s.manifest["verl_version"] == "0.9.1"
    assert hook.settings_from_env({"TRIAGE_MONITOR_TRIAGE": "off"}).triage is None
    assert hook.settings_from_env({}).triage == TriageConfig() and hook.settings_from_env({}).run_dir is None
    with pytest.raises(ValueError, match="TRIAGE_MONITOR_TRIAGE='gate_width=3' is not JSON"):
        hook.settings_from_env({"TRIAGE_MONITOR_TRIAGE": "gate_width=3"})
    with pytest.raises(ValueError, match="gate_width"):
        hook.settings_from_env({"TRIAGE_MONITOR_TRIAGE": '{"gate_width": 0}'})


def test_global_token_normalization_is_refused_where_the_settings_are_read():
    """verl divides by its agg_loss normaliser, so the weights are renormalised per response: TRIAGE_MONITOR_TRIAGE
    asking for the global token mean fails when the settings are read (the plugin's import in a worker, the
    trainer's construction), naming the variable and the setting; so does a loss built with such settings."""
    with pytest.raises(ValueError, match=r"TRIAGE_MONITOR_TRIAGE: TriageConfig.normalization='global_token' cannot "
                                         r"be honoured: verl's agg_loss divides"):
        hook.settings_from_env({"TRIAGE_MONITOR_TRIAGE": '{"normalization": "global_token"}'})
    assert hook.settings_from_env({"TRIAGE_MONITOR_TRIAGE": '{"normalization": "per_response"}'}).triage is not None
    with pytest.raises(ValueError, match=r"VerlTriageLoss: TriageConfig.normalization='global_token'"):
        hook.VerlTriageLoss(HookSettings(triage=TriageConfig(normalization="global_token")))


def test_gate_weights_renormalise_per_response_under_verls_normaliser():
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser as verl's ppo_loss calls the loss (bypass mode:
    the PPO anchor is the rollout log-prob, token-mean over verl's global token count).  Response a (A = −1):
    δ = +0.2 (ungated) and −0.1, −1.0, −1.5 (tier 0.3); b (A = −1) all gated; c (A = +1).  Gradient per token over
    the Gate-off one: 4/1.9 on a's ungated token, 0.3 · 4/1.9 on its gated −0.1 token, 1 on b and c; the gated
    tokens with δ < log 0.8 are clipped by PPO (ratio e^δ < 1 − clip_ratio_low): no gradient with or without Gate."""
    delta = torch.tensor([[0.2, -0.1, -1.0, -1.5], [-0.1, -0.15, -1.0, -1.2], [0.1, -0.1, 0.05, 0.0]])
    rollout = torch.full_like(delta, -2.0)
    adv = torch.tensor([-1.0, -1.0, 1.0])[:, None].expand_as(delta).contiguous()
    mask = torch.ones_like(delta, dtype=torch.bool)
    grads = {}
    for name, triage in (("off", TriageConfig(**OFF)), ("on", TriageConfig(tis=False, repair=False, gate_width=4))):
        live = (rollout + delta).requires_grad_()
        loss, _ = call(hook.VerlTriageLoss(HookSettings(triage=triage)), live, rollout, adv, mask, "token-mean",
                       global_info(actor_config(), mask, dp=1, share=1))
        loss.backward()
        grads[name] = live.grad
    clipped = torch.zeros_like(mask)
    clipped[0, 2:] = clipped[1, 2:] = True
    assert (grads["off"][clipped] == 0).all() and (grads["on"][clipped] == 0).all()
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, 0, 0], [1.0, 1.0, 0, 0], [1.0] * 4])
    assert torch.allclose((grads["on"] / grads["off"])[~clipped], want[~clipped], rtol=1e-5)


def test_settings_from_env_alerts_loggers_framework_keys(tmp_path):
    """TRIAGE_MONITOR_ALERTS / _LOGGERS / _FRAMEWORK_KEYS become HookSettings' alerts / loggers / framework_keys;
    a bad value fails when the settings are read (the plugin's import in a worker, the trainer's construction),
    naming the variable and the value."""
    from triage_monitor.alerting.trackers import TrackerSpec

    rules = tmp_path / "rules.toml"
    rules.write_text(RULES_TOML)
    s = hook.settings_from_env({})
    assert s.alerts is True and s.loggers == [] and s.framework_keys == "curated"
    s = hook.settings_from_env({"TRIAGE_MONITOR_ALERTS": str(rules), "TRIAGE_MONITOR_FRAMEWORK_KEYS": "all",
                                "TRIAGE_MONITOR_LOGGERS": '["tensorboard", {"kind": "mlflow", "keys": "all", '
                                                          '"tracking_uri": "file:/tmp/mlruns"}]'})
    assert s.alerts == str(rules) and s.framework_keys == "all"
    assert s.loggers == [TrackerSpec("tensorboard"), TrackerSpec("mlflow", "all", {"tracking_uri": "file:/tmp/mlruns"})]
    assert hook.settings_from_env({"TRIAGE_MONITOR_ALERTS": "off"}).alerts is False
    assert hook.settings_from_env({"TRIAGE_MONITOR_ALERTS": "default"}).alerts is True
    assert hook.settings_from_env({"TRIAGE_MONITOR_LOGGERS": "tensorboard,wandb"}).loggers == [
        TrackerSpec("tensorboard"), TrackerSpec("wandb")]
    assert hook.settings_from_env({"TRIAGE_MONITOR_FRAMEWORK_KEYS": "window/rho_asym, k3_kl"}).framework_keys == (
        "window/rho_asym", "k3_kl")
    assert hook.settings_from_env({"TRIAGE_MONITOR_FRAMEWORK_KEYS": '["c_tok"]'}).framework_keys == ("c_tok",)
    bad_rules = tmp_path / "bad.toml"
    bad_rules.write_text('[[rules]]\nname = "x"\nmetric = "rho_asym"\ncondition = "upward"\nthreshold = 1\n')
    for env, match in [({"TRIAGE_MONITOR_ALERTS": str(tmp_path / "missing.toml")},
                        r"TRIAGE_MONITOR_ALERTS='.*missing.toml': .*not a file.*'default', 'off'"),
                       ({"TRIAGE_MONITOR_ALERTS": str(bad_rules)}, r"TRIAGE_MONITOR_ALERTS='.*bad.toml'.*condition"),
                       ({"TRIAGE_MONITOR_LOGGERS": "[tensorboard"}, r"TRIAGE_MONITOR_LOGGERS='\[tensorboard' is not JSON"),
                       ({"TRIAGE_MONITOR_LOGGERS": "neptune"}, r"TRIAGE_MONITOR_LOGGERS='neptune': .*'neptune'"),
                       ({"TRIAGE_MONITOR_LOGGERS": '[{"keys": "all"}]'}, r"TRIAGE_MONITOR_LOGGERS=.*'kind'"),
                       ({"TRIAGE_MONITOR_FRAMEWORK_KEYS": ","}, r"TRIAGE_MONITOR_FRAMEWORK_KEYS=',': .*metric names"),
                       ({"TRIAGE_MONITOR_FRAMEWORK_KEYS": "[1]"}, r"TRIAGE_MONITOR_FRAMEWORK_KEYS='\[1\]': .*metric names"),
                       ({"TRIAGE_MONITOR_ON_INVALID": "drop"}, r"TRIAGE_MONITOR_ON_INVALID='drop'")]:
        with pytest.raises(ValueError, match=match):
            hook.settings_from_env(env)


def test_loss_object_pickles_as_configuration(tmp_path, registry):
    """What a worker holds pickles to its settings only; a copy finds the same per-process runtime."""
    import cloudpickle

    fn = hook.register(HookSettings(run_dir=str(tmp_path / "run"), triage=TriageConfig()))
    live, rollout, adv, mask = make_actor_batch()
    call(fn, live.requires_grad_(True), rollout, adv, mask, "token-mean", actor_config())
    data = cloudpickle.dumps(fn)
    assert b"MismatchMonitor" not in data and b"TriageController" not in data and len(data) < 4000
    copy = cloudpickle.loads(data)
    assert copy.runtime is fn.runtime and copy.controller.calls == 1
    fn.close()


# ------------------------------------------------------------------ steps from verl's global_steps
def test_published_global_steps_make_the_monitored_steps(tmp_path, registry):
    """The trainer publishes global_steps; every micro-batch / mini-batch of one global step is ONE monitored step
    (optimizer steps in between do not split it); the tokens are the union of the calls', once each."""
    run = tmp_path / "run"
    fn = hook.register(HookSettings(run_dir=str(run), triage=TriageConfig(gate_width=8),
                                    monitor=MonitorConfig(calibration_steps=1)))
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    live, rollout, adv, mask = make_actor_batch()
    for step in (7, 8):
        hook.publish_step(str(run), step)
        for mini in (slice(0, 3), slice(3, 6)):                      # two optimizer steps per global step
            for micro in (slice(mini.start, mini.start + 1), slice(mini.start + 1, mini.stop)):
                loss, _ = call(fn, (live[micro] + w).clamp(max=-1e-4), rollout[micro], adv[micro], mask[micro],
                               "token-mean", global_info(actor_config(), mask[micro], dp=1, share=3))
                loss.backward()
            opt.step()
            opt.zero_grad()
    fn.close()
    steps = pd.read_parquet(run / "steps")
    assert sorted(steps["step"].astype(int)) == [7, 8]
    tokens = pd.read_parquet(run / "tokens")
    assert (tokens.groupby(tokens["step"].astype(int)).size() == int(mask.sum())).all()
    assert "gate_weight" in tokens.columns


def test_without_published_step_counts_optimizer_steps_and_says_so(tmp_path, registry, caplog):
    run = tmp_path / "run"
    fn = hook.register(HookSettings(run_dir=str(run), triage=None))
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    live, rollout, adv, mask = make_actor_batch()
    with caplog.at_level("WARNING", logger="triage_monitor"):
        for _ in range(2):
            call(fn, (live + w).clamp(max=-1e-4), rollout, adv, mask, "token-mean", actor_config())[0].backward()
            opt.step()
    fn.close()
    assert caplog.text.count("global_steps is not published") == 1 and "triage_sync" in caplog.text
    assert sorted(pd.read_parquet(run / "steps")["step"].astype(int)) == [0, 1]


# ------------------------------------------------------------------ Ray workers, the way external_lib reaches them
WORKER_STEPS, MINI, MICRO = 3, 2, 2
#: a sampler this many nats off the learner in the amplifying direction (v1_micro_batch)
AMPLIFY = 0.5
#: the rules of the Ray test (TRIAGE_MONITOR_ALERTS): the window's ρ_asym above 1.5 held 1, 2 and 3 steps, so a
#: sampler biased in the amplifying direction raises exactly one alert at each of the 3 steps, for the job
RULES_TOML = "\n".join(f"""[[rules]]
name = "rho_asym_held_{h}"
metric = "window/rho_asym"
condition = "above"
threshold = 1.5
window = 2
hold = {h}
cooldown = 100
level = "WARN"
""" for h in (1, 2, 3))


def ray_worker_train(worker: int, steps_done, port=None) -> dict:
    """One verl worker: verl's own import_external_libs loads the plugin (as HFModelConfig does for
    actor_rollout_ref.model.external_lib), then 2 mini-batches (optimizer steps) × 2 micro-batches per global step
    through verl's real ppo_loss.  With ``port`` the 2 workers first form a gloo process group, as verl's FSDP
    workers always have one (the monitors then all-reduce), and the metrics ppo_loss returns go through verl's
    own reduction: micro-batches collected as its ``postprocess_batch_func`` does (``append_to_dict``), gathered
    over the data-parallel group by its ``allgather_dict_into_dict`` (``_postprocess_output``), reduced per
    mini-batch with ``Metric.aggregate_dp`` on the output rank (``update_actor``); the driver finishes what the
    trainer does (``rename_dict(..., "actor/")``, ``reduce_metrics``)."""
    import torch.distributed as dist
    from verl.utils.import_utils import import_external_libs
    from verl.utils.metric import Metric
    from verl.utils.py_functional import append_to_dict
    from verl.utils.torch_functional import allgather_dict_into_dict
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    if port is not None and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=worker, world_size=2)
    import_external_libs("triage_monitor.hooks.verl_plugin")
    from triage_monitor.hooks import verl_plugin

    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.01)
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode="triage"))
    n_tokens = 0
    step = steps_done
    outputs = []
    for mini in range(MINI):
        micro_metrics: dict = {}
        for micro in range(MICRO):
            data, flat, *_ = v1_micro_batch(seed=1000 * worker + 100 * step + 10 * mini + micro,
                                            amplify=AMPLIFY if port is not None else 0.0)
            loss, metrics = ppo_loss(cfg, {"log_probs": (flat + w).clamp(max=-1e-4)}, data)
            loss.backward()
            append_to_dict(micro_metrics, metrics)              # postprocess_batch_func (engine/utils.py)
            n_tokens += int(sum(data["response_mask"].offsets().diff()))
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():                               # _postprocess_output (engine_workers.py)
            micro_metrics = allgather_dict_into_dict(data=micro_metrics, group=None)
        outputs.append(micro_metrics)
    logged = {}                                                 # update_actor (engine_workers.py), output rank
    for output in outputs:
        for key, val in output.items():
            if isinstance(val, list):
                output[key] = Metric.aggregate_dp(val) if isinstance(val[0], Metric) else [x for v in val for x in v]
        append_to_dict(logged, output)
    rt = verl_plugin.LOSS.runtime
    mon = rt.monitor
    return {"pid": os.getpid(), "tokens": n_tokens, "rank": mon.rank, "attempt": rt.settings.attempt,
            "trainers": verl_plugin.TRAINERS, "logged": logged,
            "loggers": [(type(lg).__name__, lg.keys) for lg in mon.loggers],
            "rules": None if mon.alerts is None else [r.name for r in mon.alerts.rules]}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One real local Ray cluster (2 CPUs) for the worker and trainer tests, the TRIAGE_MONITOR_* variables of the
    workers' run in the job's runtime_env (as ``ray_kwargs.ray_init.runtime_env.env_vars`` sets them in verl)."""
    ray = pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("ray")
    run = root / "workers-run"
    rules = root / "rules.toml"
    rules.write_text(RULES_TOML)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
           "TRIAGE_MONITOR_RUN_DIR": str(run), "TRIAGE_MONITOR_TRIAGE": '{"gate_width": 8}',
           "TRIAGE_MONITOR_CONFIG": '{"window": 2, "calibration_steps": 1, "per_rank_steps": true}',
           "VERL_USE_EXTERNAL_PLUGINS": "none",
           "TRIAGE_MONITOR_ALERTS": str(rules),
           "TRIAGE_MONITOR_LOGGERS": '[{"kind": "wandb", "start": false, "keys": "all"}]'}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": env})
    try:
        yield run
    finally:
        ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verl_logged_metrics(per_worker: list) -> dict:
    """What verl's trainer logs of the actor update (trainer_base.py ``_update_actor``): the output rank's
    (data-parallel rank 0) metrics, prefixed ``actor/`` and reduced over the mini-batches by ``reduce_metrics``."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    out = next(r for r in per_worker if r["rank"] == 0)["logged"]
    return reduce_metrics(rename_dict(dict(out), "actor/"))


def test_ray_workers_load_the_loss_via_external_lib_and_log_global_steps(ray_cluster):
    """2 Ray worker processes (a gloo process group between them, as verl's FSDP workers) load the loss as
    external_lib does; 3 global steps published by the driver (as the triage_* trainer's step() does), then
    finish_workers (as its fit() does; Ray ends workers without atexit) → exactly 3 monitored steps numbered 1..3,
    every token once, rank files from both workers, one run.json, one attempt.  The TRIAGE_MONITOR_ALERTS /
    _LOGGERS variables reach the workers' monitors (rules and tracker on rank 0 only); with a sampler biased in the
    amplifying direction the rules raise one alert per step for the job, from rank 0; the curated keys are in
    what verl's own reduction of ppo_loss's metrics logs, each equal to the monitor's value of the step before
    (read back from the steps table); the timers the driver publishes after each step (bypass mode) are the phase
    timings of that step's rows."""
    import json

    import ray
    from triage_monitor.alerting.trackers import CURATED_KEYS

    run = ray_cluster

    @ray.remote(num_cpus=1)
    class Worker:
        def train(self, worker, step, port):
            import test_hooks_verl as t
            return t.ray_worker_train(worker, step, port)

    workers = [Worker.remote() for _ in range(2)]
    port = _free_port()
    results = []
    for step in range(1, WORKER_STEPS + 1):
        hook.publish_step(str(run), step)
        results.append(ray.get([w.train.remote(i, step, port) for i, w in enumerate(workers)]))
        # the step is over: the triage_* trainer's _compute_metrics publishes verl's timers of the step (bypass mode)
        hook.publish_timings(str(run), step, {"gen": 1.0 * step, "update_actor": 0.5, "step": 2.0 * step + 1.0,
                                              "testing": 9.0}, reward=0.25 * step)
    assert hook.finish_workers(str(run), timeout=60)                  # the trainer's fit() ends with this
    last = results[-1]
    assert {r["rank"] for r in last} == {0, 1} and len({r["pid"] for r in last}) == 2
    assert len({r["attempt"] for r in last}) == 1
    assert last[0]["trainers"] == ["triage_sync", "triage_colocate_async", "triage_separate_async"]
    steps = pd.read_parquet(run / "steps")
    assert sorted(set(steps["step"].astype(int))) == [1, 2, 3]
    tokens = pd.read_parquet(run / "tokens")
    for s, per_worker in enumerate(results, start=1):
        for r in per_worker:
            got = tokens[(tokens["step"].astype(int) == s) & (tokens["rank"].astype(int) == r["rank"])]
            assert len(got) == r["tokens"]                           # every token once
            assert float((got["learner_logp"] - got["sampler_logp"]).abs().mean()) > 0.4   # sampler != learner
    manifest = json.loads((run / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "verl"
    assert manifest["attempts"][0]["attempt"] == last[0]["attempt"] and manifest["status"] == "finished"

    # the options of the environment reached the monitors: rules and the tracker on rank 0 only
    by_rank = {r["rank"]: r for r in last}
    assert by_rank[0]["rules"] == ["rho_asym_held_1", "rho_asym_held_2", "rho_asym_held_3"]
    assert by_rank[0]["loggers"] == [("WandbLogger", "all")]
    assert by_rank[1]["rules"] is None and by_rank[1]["loggers"] == []
    # one alert per step for the job, raised by rank 0 on the all-reduced metrics; rank 1 raised none
    alerts = pd.read_parquet(run / "alerts")
    assert sorted(zip(alerts["step"].astype(int), alerts["rule"])) == [
        (1, "rho_asym_held_1"), (2, "rho_asym_held_2"), (3, "rho_asym_held_3")]
    assert set(alerts["rank"].astype(int)) == {0}
    rows = {(int(r["step"]), int(r["rank"])): r for _, r in steps.iterrows()}
    assert [rows[(s, 0)]["alerts_active"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    # each step's row carries the timers the trainer published after it (the last one read at finish_workers)
    for s in (1, 2, 3):
        for rank in (0, 1):
            r = rows[(s, rank)]
            assert (r["time/generation"], r["time/update"], r["time/step"]) == (1.0 * s, 0.5, 2.0 * s + 1.0)
            assert r["reward"] == 0.25 * s                          # and the step's reward (critic/score/mean)
            assert np.isnan(r["time/logprob"]) and np.isnan(r["time/other"])
    assert all(np.isnan(rows[(s, 1)]["alerts_active"]) for s in (1, 2, 3))

    # what verl logs: the curated keys of the step before (the loss runs before its own step is logged)
    first = verl_logged_metrics(results[0])
    assert "actor/triage/metrics_step" not in first and not any(k.startswith("actor/triage/window") for k in first)
    for s in (2, 3):
        logged = verl_logged_metrics(results[s - 1])
        assert logged["actor/triage/metrics_step"] == s - 1
        r0, r1 = rows[(s - 1, 0)], rows[(s - 1, 1)]
        want = {k for k in CURATED_KEYS if np.isfinite(r0[k])}
        assert {"window/rho_asym", "rho_asym", "window/k3_kl", "delta_abs_mean", "alerts_active",
                "gate_downweighted_frac"} <= want
        assert {k[len("actor/triage/"):] for k in logged if k.startswith("actor/triage/")} >= want
        for k in want:
            got = logged[f"actor/triage/{k}"]
            if k == "gate_downweighted_frac":           # each rank's own Gate: verl's mean over the dp ranks
                assert got == pytest.approx((r0[k] + r1[k]) / 2, rel=1e-6, abs=1e-9), k
            elif k == "alerts_active":                  # rank 0's count (the other ranks hand over none)
                assert got == r0[k] and np.isnan(r1[k])
            else:                                       # all-reduced by the monitors: the same on both ranks
                assert r1[k] == pytest.approx(r0[k], rel=1e-9, abs=1e-12), k
                assert got == pytest.approx(r0[k], rel=1e-6, abs=1e-9), k
        assert logged["actor/triage/window/rho_asym"] > 1.5
        assert "actor/pg_clipfrac" in logged and "actor/pg_loss" in logged     # verl's own keys, untouched


def task_runner_compute_advantage() -> dict:
    """In a Ray actor, as verl's TaskRunnerV1: ``import verl`` loads the plugin from VERL_USE_EXTERNAL_MODULES,
    verl's ppo_trainer config selects trainer.v1.trainer_mode=triage_sync, TransferQueue as the TaskRunner starts
    it; samples put as verl's agent loop puts them, old_log_probs as _compute_old_log_prob writes them; then
    verl's own _compute_advantage (GRPO)."""
    from hydra import compose, initialize_config_dir
    from tensordict import TensorDict
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.rollout.calculate_log_probs=True", "trainer.v1.trainer_mode=triage_sync",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
            "trainer.logger=[console]", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"])
    tq.init(cfg.transfer_queue)
    try:
        trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
        g = torch.Generator().manual_seed(0)
        lens, keys, fields, tags = [9, 5, 12, 7], [], [], []
        for i, n in enumerate(lens):                                 # as AgentLoopWorkerTQ puts its outputs
            rm = torch.zeros(n)
            rm[-1] = SCORES[i]                                       # the reward function's score, at the last token
            keys.append(f"p{i // 2}_{i % 2}_0")
            fields.append({"prompts": torch.ones(3, dtype=torch.int64), "responses": torch.ones(n, dtype=torch.int64),
                           "response_mask": torch.ones(n, dtype=torch.int64), "rm_scores": rm, "uid": f"p{i // 2}",
                           "rollout_log_probs": -torch.rand(n, generator=g) - 0.01, "num_turns": 2})
            tags.append({"status": "success", "prompt_len": 3, "response_len": n, "seq_len": 3 + n,
                         "global_steps": 1, "min_global_steps": 0, "max_global_steps": 0})
        tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
        old = [(f["rollout_log_probs"] + 0.1 * torch.randn(len(f["rollout_log_probs"]), generator=g)).clamp(max=-1e-4)
               for f in fields]
        tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(
            {"old_log_probs": torch.nested.as_nested_tensor(old, layout=torch.jagged)}, batch_size=[4]))
        trainer.global_steps = 3
        metrics = {}
        meta = KVBatchMeta(partition_id="train", keys=keys, tags=tags)
        trainer._compute_advantage(meta, metrics)
        adv = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
        # the step is over: verl's fit calls _compute_metrics with the step's timing_raw (here hand-chosen seconds,
        # as marked_timer leaves them); verl's own code turns them into its timing_s/* metrics, the triage_* trainer
        # logs the monitored step with them.  (verl's init_workers builds the resource-pool manager its throughput
        # metrics read; here verl's own _init_resource_pool_mgr, without creating the GPU pools.)
        trainer._init_resource_pool_mgr()
        trainer._compute_metrics(meta, metrics, dict(VERL_TIMING_RAW), global_steps=3, epoch=0)
        trainer.triage_monitor.close()
        # bypass mode (the loss monitors in the workers): the same _compute_metrics publishes the step's reward for
        # the workers, beside its timers
        trainer.triage_monitor, trainer.triage_bypass = None, True
        bypass = {}
        trainer._compute_metrics(meta, bypass, dict(VERL_TIMING_RAW), global_steps=4, epoch=0)
        published = hook.read_reward(trainer.triage_settings.run_dir, 4)
    finally:
        tq.close()
    return {"cls": type(trainer).__name__, "mode": trainer.trainer_mode, "metrics": sorted(metrics),
            "score_mean": float(metrics["critic/score/mean"]), "published_reward": published,
            "bypass_score_mean": float(bypass["critic/score/mean"]),
            "timing_s": {k: float(v) for k, v in metrics.items() if k.startswith("timing_s/")},
            "triage": {k: float(v) for k, v in metrics.items() if k.startswith("triage/")}, "lens": lens,
            "old": torch.cat(old), "rollout": torch.cat([f["rollout_log_probs"] for f in fields]),
            "adv": [a.clone() for a in adv.unbind()]}


#: The four responses' scores (verl's rm_scores at the last token; two GRPO groups of two): mean 0.45.
SCORES = [0.2, 1.0, 0.0, 0.6]
#: A verl step's timers (verl's names, seconds), chosen by hand: generation 6.0 s of a 10.5 s step.
VERL_TIMING_RAW = {"gen": 6.0, "reward": 0.25, "old_log_prob": 1.0, "adv": 0.25, "update_actor": 2.25,
                   "update_weights": 0.5, "step": 10.5, "testing": 3.0}


def test_triage_trainer_monitors_the_transfer_queue_batch(ray_cluster, tmp_path):
    """verl's real v1 trainer class, registered as triage_sync by the plugin that VERL_USE_EXTERNAL_MODULES loads
    on ``import verl`` in a Ray actor (where verl's TaskRunnerV1 looks the trainer up), over a real TransferQueue:
    the step's tokens are monitored under global_steps with verl's own GRPO advantages and uid groups, and
    verl's rollout_corr/* metrics are untouched; verl's own _compute_metrics, with the step's timing_raw (generation
    6.0 s of a 10.5 s step), puts verl's timing_s/* names into the steps table as time/<phase>: g = 0.571, 1.48× at
    k = 2.3."""
    import ray

    run = tmp_path / "run"
    env = {"VERL_USE_EXTERNAL_MODULES": "triage_monitor.hooks.verl_plugin", "TRIAGE_MONITOR_RUN_DIR": str(run),
           "TRIAGE_MONITOR_CONFIG": '{"calibration_steps": 1}'}

    @ray.remote(num_cpus=1)
    def task_runner():
        import test_hooks_verl as t
        return t.task_runner_compute_advantage()

    got = ray.get(task_runner.options(runtime_env={"env_vars": env}).remote())
    assert got["cls"] == "TriagePPOTrainerSync" and got["mode"] == "sync"     # verl still branches on "sync"
    assert "rollout_corr/kl" in got["metrics"]                       # verl's own metrics, computed by verl
    steps = open_run(run).steps()
    assert steps["step"].tolist() == [3] and steps["n_tokens"].tolist() == [float(sum(got["lens"]))]
    row = steps.iloc[0]
    # verl's own timing_s/* metrics (computed by verl's compute_timing_metrics) land as the step's phase timings
    ts = got["timing_s"]
    assert ts["timing_s/gen"] == 6.0 and ts["timing_s/step"] == 10.5
    assert row["time/generation"] == ts["timing_s/gen"]
    assert row["time/logprob"] == ts["timing_s/old_log_prob"]
    assert row["time/reward"] == ts["timing_s/reward"] + ts["timing_s/adv"] == 0.5
    assert row["time/update"] == ts["timing_s/update_actor"]
    assert row["time/weight_sync"] == ts["timing_s/update_weights"]
    assert row["time/step"] == ts["timing_s/step"]
    assert np.isnan(row["time/reference"]) and np.isnan(row["time/quantize"])   # not timed in this step
    # validation (timing_s/testing) lies outside verl's step timer: it is no phase
    assert np.isnan(row["time/other"])
    summary = cycle_summary(steps)
    assert summary.g == pytest.approx(6.0 / 10.5) and summary.projected == pytest.approx(1.4771, abs=1e-4)
    assert got["triage"]["triage/metrics_step"] == 3.0      # the step's curated keys joined verl's metrics
    # verl's own critic/score/mean (the mean of each response's summed rm_scores, computed by verl's
    # compute_data_metrics) is the step's reward: 0.45, not a per-token mean (1.8 / 33)
    assert got["score_mean"] == pytest.approx(sum(SCORES) / 4) and row["reward"] == got["score_mean"]
    # bypass mode: the trainer publishes it for the workers writing the rows
    assert got["published_reward"] == got["bypass_score_mean"] == got["score_mean"]
    tokens = pd.read_parquet(run / "tokens").sort_values(["sample_id", "position"])
    assert set(tokens["step"].astype(int)) == {3}
    assert torch.equal(torch.tensor(tokens["learner_logp"].to_numpy()), got["old"])
    assert torch.equal(torch.tensor(tokens["sampler_logp"].to_numpy()), got["rollout"])
    assert np.allclose(tokens["advantage"].to_numpy(), torch.cat(got["adv"]).numpy())
    assert tokens.groupby("sample_id")["group_id"].first().tolist() == [0, 0, 1, 1]
    assert abs(float(got["adv"][0][0]) + float(got["adv"][1][0])) < 1e-5   # GRPO: ± within a group


@pytest.mark.parametrize("keys", ["curated", ["n_tokens", "delta_mean"]])
def test_trainer_step_publishes_global_steps_and_logs_metrics(tmp_path, keys):
    """TriageTrainerMixin around a trainer's step: global_steps published before step(), the monitored step logged
    in _compute_metrics (verl calls it once the step timer closed) with the step's timers as phase timings, the
    framework_keys selection of its metrics (the curated set by default) in verl's metrics dict as
    triage/<name> with triage/metrics_step = this step (no lag), equal to the steps table; nothing else of ours."""
    from triage_monitor.hooks.verl import TriageTrainerMixin, VerlBatchMonitor
    from triage_monitor.alerting.trackers import CURATED_KEYS

    run = str(tmp_path / "run")
    live, rollout, adv, mask = make_actor_batch()
    seen = {}

    class OwnStep:                                  # stands for verl's PPOTrainer.step (our test double)
        def step(self, metrics, timing_raw):
            seen["published"] = hook.read_step(run)
            if self.global_steps == 12:
                self.triage_monitor.runtime.record(self.global_steps,
                                                   TokenBatch.from_padded(live, rollout, adv, mask))
            metrics["actor/pg_loss"] = 0.5                        # verl's own keys stay
            return "batch-meta"

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):   # verl's: after the step
            seen["compute_metrics"] = global_steps

    class T(TriageTrainerMixin, OwnStep):
        pass

    t = T.__new__(T)
    t.triage_settings = hook.settings_from_env({"TRIAGE_MONITOR_RUN_DIR": run, "TRIAGE_MONITOR_FRAMEWORK_KEYS":
                                                keys if isinstance(keys, str) else ",".join(keys)})
    t.triage_monitor = VerlBatchMonitor(t.triage_settings)
    t.triage_bypass = False

    def verl_step(out):                             # verl's fit: step(), then _compute_metrics once the step is over
        meta = t.step(out, {})
        t._compute_metrics(meta, out, {"gen": 1.0, "step": 2.0}, t.global_steps, 0)
        return meta

    t.global_steps = 12
    metrics = {}
    assert verl_step(metrics) == "batch-meta"
    assert seen["compute_metrics"] == 12
    t.global_steps = 13                             # a step that monitored nothing adds nothing (no stale values)
    later = {}
    verl_step(later)
    t.triage_monitor.close()
    assert seen["published"] == 13 and later == {"actor/pg_loss": 0.5}
    row = pd.read_parquet(tmp_path / "run" / "steps").iloc[0]
    assert int(row["step"]) == 12
    assert row["time/generation"] == 1.0 and row["time/step"] == 2.0
    names = CURATED_KEYS if keys == "curated" else keys
    vals = shown(row)                                # the ratios at noise level left out, as on every tracker
    want = {f"triage/{k}": vals[k] for k in names if k in vals and np.isfinite(vals[k])}
    want["triage/metrics_step"] = 12.0
    if keys == "curated":                            # the noise flag beside them (docs/alerts.md#noise-guard)
        want["triage/noise"] = 1.0 if row["window/delta_abs_mean"] < 1e-4 else 0.0
    assert {k: v for k, v in metrics.items() if k.startswith("triage/")} == pytest.approx(want)
    assert metrics["actor/pg_loss"] == 0.5
    if keys == "curated":
        assert {"triage/window/rho_asym", "triage/rho_asym", "triage/alerts_active"} <= set(metrics)
    else:
        assert metrics["triage/n_tokens"] == int(mask.sum())


# ------------------------------------------------------------------ monitoring from the v1 trainer's batches
def test_monitoring_from_transfer_queue_fields(tmp_path):
    """Fields as tq.kv_batch_get returns them (nested response fields, non-tensor uid), padding rows tagged:
    the padding row is left out, group ids from uid, tool tokens out, positions = column index."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    live, rollout, adv, mask = make_actor_batch()
    lengths = [40, 31, 7, 28, 19, 12]
    nested = lambda x: torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lengths)],  # noqa: E731
                                                     layout=torch.jagged)
    fields = TensorDict({"old_log_probs": nested(live), "rollout_log_probs": nested(rollout),
                         "advantages": nested(adv), "response_mask": nested(mask.long())}, batch_size=[6])
    fields["uid"] = NonTensorStack(*["p0", "p0", "p1", "p1", "p2", "pad"])
    tags = [{}, {}, {}, {}, {}, {"is_padding": True}]
    batch = hook.batch_from_transfer_queue(fields, tags)
    keep = mask[:5]
    assert batch.num_tokens == int(keep.sum()) and batch.num_samples == 5
    assert torch.equal(batch.learner_logp, live[:5][keep]) and torch.equal(batch.sampler_logp, rollout[:5][keep])
    assert batch.group_id.tolist() == [0, 0, 1, 1, 2]
    assert 10 not in batch.position[batch.sample_index == 1].tolist()
    with MismatchMonitor(tmp_path / "run", MonitorConfig()) as mon:
        metrics = mon.log_step(1, batch)
    assert abs(metrics["delta_mean"] - float((live - rollout)[:5][keep].mean())) < 1e-6


def test_missing_rollout_log_probs_names_the_setting():
    live, rollout, adv, mask = make_actor_batch()
    data = verl.DataProto.from_dict(tensors={"old_log_probs": live, "advantages": adv, "response_mask": mask.long()})
    with pytest.raises(KeyError, match="calculate_log_probs"):
        hook.batch_from_dataproto(data)


def test_check_config_refuses_what_cannot_work():
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "triage"}},
                                                  "rollout": {"calculate_log_probs": True}},
                            "algorithm": {"rollout_correction": {"bypass_mode": False}}})
    with pytest.raises(ValueError, match="bypass_mode=True"):
        hook.check_config(cfg)
    cfg.algorithm.rollout_correction.bypass_mode = True
    hook.check_config(cfg)
    cfg.actor_rollout_ref.rollout.calculate_log_probs = False
    with pytest.raises(ValueError, match="calculate_log_probs=True"):
        hook.check_config(cfg)


def test_step_channel_io_failures_never_stop_the_job(tmp_path, caplog):
    """A run directory that cannot be written (here: a regular file): settings, publishing and finishing warn and
    go on; reading gives no step (the workers then count optimizer steps)."""
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    with caplog.at_level("WARNING", logger="triage_monitor"):
        s = hook.settings_from_env({"TRIAGE_MONITOR_RUN_DIR": str(blocked)})
        hook.publish_step(str(blocked), 3)
        assert hook.finish_workers(str(blocked), timeout=1) is False
    assert s.attempt > 0 and hook.read_step(str(blocked)) is None
    assert caplog.text.count("triage-monitor: cannot") == 3
