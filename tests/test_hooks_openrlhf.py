"""OpenRLHF 0.11.2 hook, driven through OpenRLHF's own code: ``PolicyLoss``, ``ActorPPOTrainer`` (its ``__init__``,
``ppo_train`` and ``training_step``), ``PolicyModelActor.fit``, ``NaiveReplayBuffer`` and ``Experience`` batching,
``iter_grad_accum_global_norm``, ``DeepspeedStrategy``.  Only CUDA-only pieces are stood in for
(tests/openrlhf_cpu.py: the flash_attn and vllm modules, the DeepSpeed engine's optimizer step, ``torch.cuda``
device calls).

OpenRLHF pins transformers 5.15.0 and needs deepspeed / peft / torchdata, so the tests that import it run in the
side environment ``.venv-fw/openrlhf-0.11.2`` (scripts/install_frameworks.sh): in the main venv this module holds
the tests that need no OpenRLHF and one test that runs the module again in the side environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks import openrlhf as hook
from triage_monitor.hooks.worker_runtime import HookSettings, close_all
from triage_monitor.monitor import MonitorConfig

sys.path.insert(0, str(Path(__file__).parent))
import openrlhf_cpu as cpu  # noqa: E402
from runfiles import shown  # noqa: E402

pytestmark = pytest.mark.framework

SIDE_ENV = "openrlhf-0.11.2"
IN_SIDE_ENV = os.environ.get("TRIAGE_TEST_OPENRLHF") == "1"


def test_cli_arguments_split(tmp_path):
    cfg = tmp_path / "t.json"
    cfg.write_text('{"tis": false, "gate_width": 32}')
    s, rest = hook.parse_triage_args(["--actor.model_name_or_path", "m", "--triage.run_dir", str(tmp_path / "r"),
                                      "--triage.config", str(cfg), "--algo.advantage.is_correction_level", "token"])
    assert rest == ["--actor.model_name_or_path", "m", "--algo.advantage.is_correction_level", "token"]
    assert s.run_dir == str(tmp_path / "r") and s.triage.gate_width == 32 and not s.triage.tis
    s, _ = hook.parse_triage_args(["--triage.run_dir", "x", "--triage.monitor_only"])
    assert s.triage is None and s.manifest["framework"] == "openrlhf"
    assert s.alerts is True and s.loggers == [] and s.framework_keys == "curated"


def test_cli_alerts_loggers_framework_keys(tmp_path, capsys):
    """--triage.alerts / --triage.loggers / --triage.framework_keys become HookSettings' options (shipped with the
    actor class into every actor); a bad value stops the launch with argparse's error naming the flag."""
    from triage_monitor.alerting.trackers import TrackerSpec

    rules = tmp_path / "rules.toml"
    rules.write_text(rules_toml([1]))
    s, rest = hook.parse_triage_args(["--triage.run_dir", "r", "--triage.alerts", str(rules), "--triage.loggers",
                                      '["tensorboard", {"kind": "wandb", "start": false}]',
                                      "--triage.framework_keys", "window/rho_asym,k3_kl", "--actor.x", "1"])
    assert rest == ["--actor.x", "1"] and s.alerts == str(rules) and s.framework_keys == ("window/rho_asym", "k3_kl")
    assert s.loggers == [TrackerSpec("tensorboard"), TrackerSpec("wandb", options={"start": False})]
    s, _ = hook.parse_triage_args(["--triage.run_dir", "r", "--triage.alerts", "off", "--triage.loggers", "mlflow",
                                   "--triage.framework_keys", "all"])
    assert s.alerts is False and s.loggers == [TrackerSpec("mlflow")] and s.framework_keys == "all"
    assert cloudpickle.loads(cloudpickle.dumps(s)) == s                   # configuration only
    for flag, value, match in [("--triage.alerts", str(tmp_path / "none.toml"), "--triage.alerts='.*none.toml'"),
                               ("--triage.loggers", "[wandb", "--triage.loggers='\\[wandb' is not JSON"),
                               ("--triage.loggers", "comet", "--triage.loggers='comet': tracker kind 'comet'"),
                               ("--triage.framework_keys", "[2]", "--triage.framework_keys='\\[2\\]'")]:
        with pytest.raises(SystemExit) as e:
            hook.parse_triage_args(["--triage.run_dir", "r", flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert re.search(match, err), err


def test_cli_refuses_a_global_token_normalization(tmp_path, capsys):
    """OpenRLHF divides by the optimizer step's token or sample count: the weights are renormalised per response,
    so a --triage.config asking for the global token mean stops the launch (argparse's exit 2), naming it."""
    cfg = tmp_path / "triage.json"
    cfg.write_text('{"normalization": "global_token"}')
    with pytest.raises(SystemExit) as e:
        hook.parse_triage_args(["--triage.run_dir", "r", "--triage.config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--triage.config {cfg}: TriageConfig.normalization='global_token' cannot be honoured" in err, err
    cfg.write_text('{"normalization": "per_response"}')
    assert hook.parse_triage_args(["--triage.run_dir", "r", "--triage.config", str(cfg)])[0].triage is not None


def rules_toml(holds, metric="window/amp_share", threshold=0.9, window=25) -> str:
    """Rules on ``metric`` above ``threshold`` held 1, 2, ... steps: on a sampler that keeps the condition true,
    rule ``held_h`` fires once, at the h-th step (one alert per step for the job)."""
    return "\n".join(f"""[[rules]]
name = "held_{h}"
metric = "{metric}"
condition = "above"
threshold = {threshold}
window = {window}
hold = {h}
cooldown = 100
""" for h in holds)


if not IN_SIDE_ENV:
    def test_openrlhf_suite_in_its_side_environment(side_env):
        """The OpenRLHF tests below, run by the side environment's python (their output shown on failure)."""
        py = side_env(SIDE_ENV)
        r = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env={**os.environ, "TRIAGE_TEST_OPENRLHF": "1"}, capture_output=True, text=True,
                           timeout=900, cwd=Path(__file__).parents[1])
        tail = (r.stdout + r.stderr)[-6000:]
        assert r.returncode == 0, tail
        assert " passed" in r.stdout and " failed" not in r.stdout and " skipped" not in r.stdout, tail


OFF = TriageConfig(gate=False, tis=False, repair=False)


@pytest.fixture(scope="module")
def orl():
    """OpenRLHF's modules, imported with the CUDA-only flash_attn / vllm stood in for (removed afterwards), and a
    one-process gloo group (OpenRLHF calls torch.distributed.barrier / all_reduce unconditionally)."""
    import torch.distributed as dist

    torch.set_num_threads(1)          # a 32-wide model: more threads only contend on a shared 2-core machine
    added = cpu.install_stubs()
    try:
        from openrlhf.models import Actor
        from openrlhf.models.loss import PolicyLoss
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.trainer.ray import ppo_actor
        from openrlhf.utils.deepspeed import DeepspeedStrategy
        from openrlhf.utils.loss_utils import iter_grad_accum_global_norm
    finally:
        cpu.remove_stubs(added)
    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dict(Actor=Actor, PolicyLoss=PolicyLoss, ppo_actor=ppo_actor, DeepspeedStrategy=DeepspeedStrategy,
               iter_grad_accum_global_norm=iter_grad_accum_global_norm, Experience=Experience)
    if own_group:
        dist.destroy_process_group()


def policy_loss(orl, **kw):
    """OpenRLHF's PolicyLoss built exactly as ActorPPOTrainer.__init__ builds it from its args."""
    a = cpu.openrlhf_args(**kw)
    return orl["PolicyLoss"](
        clip_eps_low=a.actor.eps_clip_low_high[0], clip_eps_high=a.actor.eps_clip_low_high[1],
        dual_clip=a.actor.dual_clip, token_level_loss=a.actor.loss_agg_mode == "token-mean",
        policy_loss_type=a.actor.policy_loss_type, is_correction_level=a.algo.advantage.is_correction_level,
        is_correction_mode=a.algo.advantage.is_correction_mode,
        is_correction_gating=a.algo.advantage.is_correction_gating,
        is_correction_threshold=a.algo.advantage.is_correction_threshold)


def tensors(seed=0, B=6, A=40):
    """(B, A) rows in OpenRLHF's layout: prompt columns, a response with a tool span, right padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, A, dtype=torch.bool)
    for b in range(B):
        P, R = int(torch.randint(2, 9, (), generator=g)), int(torch.randint(4, 30, (), generator=g))
        mask[b, P:P + R] = True
        if R > 10:
            mask[b, P + 4:P + 7] = False
    old = (-torch.rand(B, A, generator=g) * 2 - 1e-3)
    learner = (old + 0.15 * torch.randn(B, A, generator=g)).clamp(max=-1e-4)
    rollout = ((old + 0.5 * torch.randn(B, A, generator=g)).clamp(max=-1e-4)) * mask
    rollout[0, mask[0].nonzero()[3]] = old[0, mask[0].nonzero()[3]] - 4.0        # one far-off token (filtered)
    adv = torch.randn(B, 1, generator=g).expand(B, A) * mask
    return learner, old, rollout, adv, mask


def settings(tmp_path=None, triage=OFF, **kw):
    return HookSettings(run_dir=None if tmp_path is None else str(tmp_path / "run"), triage=triage,
                        monitor=MonitorConfig(calibration_steps=1), **kw)


CASES = [
    dict(),                                                                            # token mean, token mask (ICEPOP)
    dict(loss_agg_mode="seq-mean-token-mean"),
    dict(dual_clip=3.0),
    dict(is_mode="clip", is_threshold=(0.8, 1.25)),                                    # TIS
    dict(is_level="seq", is_threshold=(0.9, 1.1)),                                     # seq-mask-tis
    dict(is_level="seq", is_gating="binary_kl", is_threshold=(0.0, 0.05)),            # trust region
    dict(is_gating="tv", is_threshold=(0.0, 0.2), loss_agg_mode="seq-mean-token-mean"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
@pytest.mark.parametrize("norm", ["global", "local"])
def test_triage_off_equals_openrlhf_policy_loss(orl, case, norm):
    """Gate, TIS and Repair off: value, gradient and the four metrics equal OpenRLHF's own PolicyLoss."""
    learner, old, rollout, adv, mask = tensors()
    pl = policy_loss(orl, **case)
    kw = dict(dp_size=2, batch_num_tokens=3.0 * mask.sum().float(), global_batch_size=torch.tensor(9.0)) \
        if norm == "global" else {}
    x1, x2 = learner.clone().requires_grad_(), learner.clone().requires_grad_()
    theirs = pl(x1, old, adv, action_mask=mask, rollout_log_probs=rollout, **kw)
    ours = hook.OpenRLHFTriageLoss(settings(), pl)(x2, old, adv, action_mask=mask, rollout_log_probs=rollout, **kw)
    assert float(theirs[4]) > 0                                   # the correction does filter something here
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(ours[1:], theirs[1:]):
        assert torch.equal(a, b)                                  # OpenRLHF's metrics, OpenRLHF's values
    theirs[0].backward()
    ours[0].backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-8)


def test_is_correction_coef_is_openrlhf_factor(orl):
    """With ratio 1 and advantage −1 the per-token PPO loss is 1, so PolicyLoss's token mean over one token per
    row is the coefficient itself: every token of every row, checked one at a time."""
    learner, old, rollout, adv, mask = tensors(1, B=3, A=20)
    for case in CASES:
        pl = policy_loss(orl, **case)
        if pl.is_correction_level == "seq":
            continue                                              # seq statistics need the whole row
        coef = hook.is_correction_coef(pl, old, rollout, mask)
        for b, t in mask.nonzero().tolist()[::5]:
            one = torch.zeros_like(mask)
            one[b, t] = True
            val = pl(old, old, -torch.ones_like(old), action_mask=one, rollout_log_probs=rollout)[0]
            assert float(val) == pytest.approx(float(coef[b, t]), rel=1e-6, abs=1e-7), case


def test_unsupported_options_raise_at_construction(orl):
    with pytest.raises(ValueError, match="is_correction_level is 'off'.*token or seq"):
        hook.OpenRLHFTriageLoss(settings(), policy_loss(orl, is_level="off"))
    gspo = policy_loss(orl)
    gspo.policy_loss_type = "gspo"
    with pytest.raises(ValueError, match="gspo"):
        hook.OpenRLHFTriageLoss(settings(), gspo)
    with pytest.raises(ValueError, match="would both weight.*is_correction_threshold 1 1"):
        hook.OpenRLHFTriageLoss(settings(triage=TriageConfig()), policy_loss(orl))
    with pytest.raises(TypeError, match="PolicyLoss"):
        hook.OpenRLHFTriageLoss(settings(), torch.nn.Identity())
    # TRIAGE's TIS with OpenRLHF's correction made the identity: accepted, and its coefficient is 1
    ident = policy_loss(orl, is_mode="clip", is_threshold=(1.0, 1.0))
    hook.OpenRLHFTriageLoss(settings(triage=TriageConfig()), ident)
    learner, old, rollout, adv, mask = tensors()
    assert torch.equal(hook.is_correction_coef(ident, old, rollout, mask), torch.ones_like(old))
    with pytest.raises(ValueError, match="rollout_log_probs is None.*is_correction_level token"):
        hook.OpenRLHFTriageLoss(settings(), policy_loss(orl))(learner, old, adv, action_mask=mask,
                                                              rollout_log_probs=None)


def test_global_token_normalization_is_refused_at_construction(orl):
    with pytest.raises(ValueError, match=r"OpenRLHFTriageLoss: TriageConfig.normalization='global_token' cannot be "
                                         r"honoured: OpenRLHF divides the loss"):
        hook.OpenRLHFTriageLoss(settings(triage=TriageConfig(tis=False, normalization="global_token")),
                                policy_loss(orl))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gate_weights_renormalise_per_response_under_openrlhfs_normaliser(orl, agg):
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser through OpenRLHF's PolicyLoss call (its global
    normalisers, OpenRLHF's IS correction the identity): three rows of a prompt column and 4 action tokens,
    A = −1, −1, +1, rollout log-probs above the learner's by −δ, old = learner (ratio 1): row a partly gated
    (δ = +0.2 ungated, tier 0.3 on the rest), b all gated.  Gradient per token over the Gate-off one: w · 4 / W."""
    delta = torch.tensor([[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]])
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[:, 0] = False
    base = torch.full((3, 5), -2.0)
    adv = torch.tensor([-1.0, -1.0, 1.0])[:, None].expand(3, 5) * mask
    pl = policy_loss(orl, is_mode="clip", is_threshold=(1.0, 1.0), loss_agg_mode=agg)
    grads = {}
    for name, triage in (("off", OFF), ("on", TriageConfig(tis=False, repair=False, gate_width=4))):
        learner = base.clone().requires_grad_()
        rollout = torch.cat([torch.zeros(3, 1), base[:, 1:] - delta], 1)
        loss = hook.OpenRLHFTriageLoss(settings(triage=triage), pl)(
            learner, learner.detach(), adv, action_mask=mask, rollout_log_probs=rollout, dp_size=1,
            batch_num_tokens=torch.tensor(12.0), global_batch_size=torch.tensor(3.0))[0]
        loss.backward()
        grads[name] = learner.grad[:, 1:]
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, .3 * s, .3 * s], [1.0] * 4, [1.0] * 4])
    assert (grads["off"] != 0).all()
    torch.testing.assert_close(grads["on"] / grads["off"], want, rtol=1e-5, atol=0)


def test_loss_object_pickles_with_configuration_only(orl, tmp_path):
    pl = policy_loss(orl)
    fn = hook.OpenRLHFTriageLoss(settings(tmp_path, triage=TriageConfig(tis=False)), pl)
    learner, old, rollout, adv, mask = tensors()
    fn(learner.requires_grad_(), old, adv, action_mask=mask, rollout_log_probs=rollout)
    copy = cloudpickle.loads(cloudpickle.dumps(fn))
    assert copy.settings == fn.settings and not hasattr(copy, "_live_stats")
    assert copy.runtime is fn.runtime                            # same process, same key: one runtime
    fn.close()


# --------------------------------------------------------------------------------------------------------------
# The real training path: PolicyModelActor.fit -> ActorPPOTrainer.ppo_train -> training_step -> actor_loss_fn


def make_actor(orl, tmp_path, *, hook_settings=None, checkpoint_states=None, **kw):
    """A policy actor object (the class policy_actor_class builds, or OpenRLHF's own) set up on the CPU
    (tests/openrlhf_cpu.py: set_up_policy_actor)."""
    if hook_settings is None:
        cls = orl["ppo_actor"].PolicyModelActor.__ray_actor_class__
    else:
        cls = hook.policy_actor_class(hook_settings, num_gpus=0).__ray_actor_class__
    model_dir = tmp_path / "tiny"
    if not model_dir.exists():
        cpu.tiny_model_dir(model_dir)
    return cpu.set_up_policy_actor(cls.__new__(cls), model_dir, checkpoint_states=checkpoint_states, **kw)


def fit(orl, obj, exps, seed=0):
    return cpu.fit(obj, exps, seed)


@pytest.fixture(scope="module")
def runs(orl, tmp_path_factory):
    """Three fits of 24 samples (3 optimizer steps of 4 micro-batches of 2 each) by OpenRLHF's own actor and by
    the hook's actor class with TRIAGE off and on (Gate + Repair; OpenRLHF's token-mask IS correction kept)."""
    tmp = tmp_path_factory.mktemp("openrlhf")
    out = {}
    for name, triage in (("own", None), ("off", OFF), ("on", TriageConfig(tis=False, gate_width=4, repair_width=4))):
        s = None if name == "own" else settings(tmp / name, triage=triage, rank=0)
        obj = make_actor(orl, tmp, hook_settings=s)
        exps = cpu.experiences(obj.actor, n=24, seed=1)
        statuses = [fit(orl, obj, exps, seed=k) for k in range(3)]
        if s is not None:
            obj.triage_loss.close()
        out[name] = dict(obj=obj, statuses=statuses, exps=exps, run=None if s is None else tmp / name / "run")
    close_all()
    return out


def test_real_training_triage_off_equals_openrlhf_run(runs):
    """Same data, same shuffle: with Gate/TIS/Repair off the hooked actor trains exactly like OpenRLHF's own."""
    own, off = runs["own"], runs["off"]
    for a, b in zip(own["statuses"], off["statuses"]):
        for k in ("policy_loss", "ppo_clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
        assert b["triage/gate_downweighted_frac"] == 0.0                    # controller configured, all off
    for p, q in zip(own["obj"].actor.model.parameters(), off["obj"].actor.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5)
    assert own["obj"].actor.model.global_steps == off["obj"].actor.model.global_steps == 9


def test_real_training_keeps_openrlhf_metrics_and_adds_triage(runs):
    own, on = runs["own"], runs["on"]
    first = on["statuses"][0]
    # vllm_kl and is_filter_ratio depend on the old and rollout log-probs only: identical to OpenRLHF's run
    for a, b in zip(own["statuses"], on["statuses"]):
        assert b["vllm_kl"] == pytest.approx(a["vllm_kl"], rel=1e-6)
        assert b["is_filter_ratio"] == pytest.approx(a["is_filter_ratio"], rel=1e-6)
    assert "triage/gate_downweighted_frac" in first and 0 < first["triage/gate_downweighted_frac"] < 1
    assert first["is_filter_ratio"] != pytest.approx(first["triage/gate_downweighted_frac"])
    assert first["policy_loss"] != pytest.approx(own["statuses"][0]["policy_loss"])   # the Gate changed the loss


@pytest.mark.parametrize("name", ["off", "on"])
def test_real_training_status_carries_the_monitors_values_of_the_fits_last_step(runs, name):
    """The status PolicyModelActor.fit returns (what OpenRLHF logs as train/<key>) holds the curated keys of the
    fit's last optimizer step — the current step, no lag — with the values of the monitor's steps table (read back
    from the Parquet), and triage/metrics_step naming it; sampler != learner there."""
    from triage_monitor.alerting.trackers import CURATED_KEYS

    r = runs[name]
    steps = pd.read_parquet(r["run"] / "steps").set_index("step")
    for k, status in enumerate(r["statuses"]):
        last = 3 * k + 2                                       # 3 optimizer steps per fit: 0-2, 3-5, 6-8
        assert status["triage/metrics_step"] == last
        row = steps.loc[last]
        assert row["delta_abs_mean"] > 0.05                    # the sampler differs from the learner
        vals = shown(row)                       # the ratios at noise level left out, as on every tracker
        want = {f"triage/{c}": vals[c] for c in CURATED_KEYS if c in vals and np.isfinite(vals[c])}
        want["triage/noise"] = 1.0 if row["window/delta_abs_mean"] < 1e-4 else 0.0     # the flag beside them
        assert {"triage/window/rho_asym", "triage/window/small_gap_share", "triage/window/k3_kl",
                "triage/delta_abs_mean", "triage/gate_downweighted_frac", "triage/alerts_active"} <= set(want)
        assert {c: status[c] for c in want} == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert not any(c.startswith("triage/") and c not in want and c != "triage/metrics_step"
                       and c[len("triage/"):] not in ("gate_weight_mean", "tis_clip_frac", "repair_loss",
                                                      "repair_active_frac") for c in status)


@pytest.mark.parametrize("name", ["off", "on"])
def test_real_training_one_monitored_step_per_optimizer_step(runs, name):
    """3 fits × 3 optimizer steps (DeepSpeed-style accumulation of 4 micro-batches) = 9 monitored steps, every
    action token of every fit once per step's micro-batches, positions from the first action column."""
    r = runs[name]
    tok = pd.read_parquet(r["run"] / "tokens")
    assert sorted(tok["step"].astype(int).unique()) == list(range(9))
    n_tokens = sum(int(e.action_mask.sum()) for e in r["exps"])
    assert len(tok) == 3 * n_tokens
    per_fit = tok.assign(fit=tok["step"].astype(int) // 3).groupby("fit").size()
    assert per_fit.tolist() == [n_tokens] * 3
    lengths = sorted(int(e.action_mask[0].nonzero()[-1] - e.action_mask[0].nonzero()[0] + 1) for e in r["exps"])
    first = tok[tok["step"].astype(int) < 3].groupby(["step", "sample_id"])["position"].agg(["min", "max"])
    assert (first["min"] == 0).all() and sorted((first["max"] + 1).tolist()) == lengths
    if name == "on":
        assert "gate_weight" in tok.columns


def test_checkpoint_state_round_trip(orl, tmp_path):
    """PolicyModelActor.save_checkpoint gets the hook's state in OpenRLHF's client_states; an actor resumed from
    those states continues the step count and the controller's calibration."""
    s = settings(tmp_path / "a", triage=TriageConfig(tis=False, gate_width=4, repair_width=4), rank=0)
    obj = make_actor(orl, tmp_path, hook_settings=s)
    fit(orl, obj, cpu.experiences(obj.actor, n=24, seed=1))
    saved = {}
    obj.disable_ds_ckpt, obj.save_hf_ckpt = False, False
    # DeepSpeed's checkpoint writer (DeepSpeedEngine.save_checkpoint) needs the real engine: record its input
    obj.strategy.save_ckpt = lambda model, path, tag, max_num, max_mem, client_states, **kw: saved.update(
        client_states)
    with cpu.cpu_cuda("cpu"):
        obj.save_checkpoint("global_step1", {"global_step": 1})
    assert saved["global_step"] == 1 and saved["triage"]["optimizer_steps"] == 3
    assert saved["triage"]["controller"] is not None
    obj.triage_loss.close()
    s2 = settings(tmp_path / "b", triage=s.triage, rank=0)
    fresh = make_actor(orl, tmp_path, hook_settings=s2, checkpoint_states={"triage": saved["triage"]})
    assert fresh.triage_loss.runtime.step_for_call() == 3
    mine, theirs = fresh.triage_loss.state_dict()["controller"], saved["triage"]["controller"]
    assert mine["calls"] == theirs["calls"] > 0 and mine["reference"]["steps"] == theirs["reference"]["steps"]
    fresh.triage_loss.close()


def test_ray_actor_group_of_two_policy_actors(orl, tmp_path):
    """A real local Ray cluster: OpenRLHF's RayActorGroup starts 2 policy actors of the hook's class (settings from
    the --triage.* flags, shipped with the class), which form their gloo data-parallel group from the addresses
    OpenRLHF's BaseDistributedActor set; each runs 2 fits of its own 16 samples (2 optimizer steps each) → 4
    monitored steps with rank files from both actors, every token once, one run.json; triage/* all-reduced like
    OpenRLHF's own.  The --triage.alerts / --triage.loggers options reach the monitors (rank 0's only); with a
    sampler biased in the amplifying direction the rules raise one alert per step for the job, from rank 0; both
    actors' statuses carry rank 0's monitor values of their fit's last step (the steps table's)."""
    import json

    import ray
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from triage_monitor.alerting.trackers import CURATED_KEYS

    model_dir = cpu.tiny_model_dir(tmp_path / "tiny")
    (tmp_path / "triage.json").write_text('{"tis": false, "gate_width": 4, "repair_width": 4}')
    (tmp_path / "rules.toml").write_text(rules_toml([1, 2, 3, 4]))
    (tmp_path / "manifest.json").write_text('{"framework": "openrlhf"}')
    s, rest = hook.parse_triage_args([
        "--triage.run_dir", str(tmp_path / "run"), "--triage.config", str(tmp_path / "triage.json"),
        "--triage.manifest", str(tmp_path / "manifest.json"), "--triage.alerts", str(tmp_path / "rules.toml"),
        "--triage.loggers", '[{"kind": "wandb", "start": false}]'])
    assert rest == []
    s.monitor = MonitorConfig(calibration_steps=1, per_rank_steps=True)    # every rank's row: rank 1's compared below
    tests_dir = str(Path(__file__).parent)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,       # GPUs: a label only
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
                                       "TOKENIZERS_PARALLELISM": "false"},
                          "worker_process_setup_hook": "openrlhf_cpu.install_stubs"})
    try:
        group = RayActorGroup(1, 2, hook.policy_actor_class(s), pg=None, num_gpus_per_actor=1)
        results = ray.get(group.async_run_method("__ray_call__", cpu.ray_actor_run, str(model_dir), amplify=0.5),
                          timeout=600)
    finally:
        ray.shutdown()
    pids = {pid for pid, _, _ in results}
    assert len(pids) == 2 and os.getpid() not in pids
    (_, st0, info0), (_, st1, info1) = results
    for a, b in zip(st0, st1):
        assert a["triage/gate_downweighted_frac"] == pytest.approx(b["triage/gate_downweighted_frac"])
        assert a["vllm_kl"] == pytest.approx(b["vllm_kl"]) and "is_filter_ratio" in a
    run = tmp_path / "run"
    # the options reached the monitors: rules and tracker on rank 0 only
    assert (info0["rank"], info1["rank"]) == (0, 1)
    assert info0["rules"] == ["held_1", "held_2", "held_3", "held_4"] and info0["loggers"] == [("WandbLogger",
                                                                                               "curated")]
    assert info1["rules"] is None and info1["loggers"] == []
    # one alert per step for the job (rank 0, on the all-reduced metrics); rank 1 raised none
    alerts = pd.read_parquet(run / "alerts")
    assert sorted(zip(alerts["step"].astype(int), alerts["rule"])) == [(0, "held_1"), (1, "held_2"), (2, "held_3"),
                                                                      (3, "held_4")]
    assert set(alerts["rank"].astype(int)) == {0}
    # each fit's status (both actors alike: what OpenRLHF logs whichever status it keeps) = rank 0's monitor values
    steps = pd.read_parquet(run / "steps")
    rows = {(int(r["step"]), int(r["rank"])): r for _, r in steps.iterrows()}
    for k, (a, b) in enumerate(zip(st0, st1)):
        last = 2 * k + 1
        row = rows[(last, 0)]
        want = {f"triage/{c}": float(row[c]) for c in CURATED_KEYS if np.isfinite(row[c])}
        want["triage/metrics_step"] = float(last)
        assert want["triage/alerts_active"] == last + 1 and np.isnan(rows[(last, 1)]["alerts_active"])
        assert row["delta_abs_mean"] > 0.3                                  # sampler != learner
        for status in (a, b):
            assert {c: status[c] for c in want} == pytest.approx(want, rel=1e-9, abs=1e-12)
        for c in CURATED_KEYS:                      # the all-reduced ones are the same on both ranks' rows
            if c not in ("alerts_active", "gate_downweighted_frac") and np.isfinite(row[c]):
                assert rows[(last, 1)][c] == pytest.approx(row[c], rel=1e-9, abs=1e-12), c
    from runfiles import step_keys
    keys = step_keys(run, "tokens")
    steps = sorted({s for s, _, _ in keys})
    assert steps == [0, 1, 2, 3]
    for st in steps:
        assert sorted(r for s, r, _ in keys if s == st) == [0, 1]
    tok = pd.read_parquet(run / "tokens")
    per_rank = tok.groupby(tok["rank"].astype(int)).size().to_dict()
    # each rank: 2 fits × the action tokens of its 16 samples (made in the actor with seed 100·rank)
    with torch.no_grad():
        actor = orl["Actor"](str(model_dir), attn_implementation="eager", param_dtype="bf16")
        actor.model.float()
        expect = {r: 2 * sum(int(e.action_mask.sum()) for e in cpu.experiences(actor, n=16, seed=100 * r))
                  for r in (0, 1)}
    assert per_rank == expect
    manifest = json.loads((run / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "openrlhf"


def test_run_cli_runs_openrlhf_cli_with_the_hook_class(orl, monkeypatch, capsys):
    """run_cli executes OpenRLHF's own train_ppo_ray module (here up to its parser's --help), whose
    PolicyModelActor is then the hook's class, and PPOTrainer (which train() imports) the hook's timed trainer;
    OpenRLHF's module attributes are restored afterwards."""
    import argparse

    seen = {}

    def spy(self, *a, **k):
        seen["actor"] = sys.modules["__main__"].__dict__.get("PolicyModelActor")   # the running CLI's global
        seen["trainer"] = sys.modules["openrlhf.trainer.ppo_trainer"].PPOTrainer
        seen["prog"] = sys.argv[0]
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", spy)
    original = orl["ppo_actor"].PolicyModelActor
    added = cpu.install_stubs()               # the trainer modules import vllm (not installable on a CPU)
    try:
        from openrlhf.trainer import ppo_trainer
        original_trainer = ppo_trainer.PPOTrainer
        with pytest.raises(SystemExit) as e:
            hook.main(["--triage.run_dir", "unused", "--help"])
    finally:
        cpu.remove_stubs(added)
    assert e.value.code == 0 and seen["prog"].endswith("train_ppo_ray.py")
    assert issubclass(seen["actor"].__ray_actor_class__, hook.TriagePolicyActorMixin)
    assert seen["actor"].__ray_actor_class__.triage_settings.run_dir == "unused"
    assert issubclass(seen["trainer"].__ray_actor_class__, hook.TriageTimingsMixin)
    assert orl["ppo_actor"].PolicyModelActor is original and ppo_trainer.PPOTrainer is original_trainer


def test_policy_actor_class_is_a_ray_policy_model_actor(orl):
    import ray

    s = settings()
    cls = hook.policy_actor_class(s)
    plain = cls.__ray_actor_class__
    assert isinstance(cls, ray.actor.ActorClass)
    assert issubclass(plain, orl["ppo_actor"].PolicyModelActor.__ray_actor_class__)
    assert plain.__mro__[1] is hook.TriagePolicyActorMixin
    back = cloudpickle.loads(cloudpickle.dumps(plain))                   # how Ray ships the class to the actors
    assert back.triage_settings == s



def _driver_classes(run_dir):
    """The hook's driver-side trainer classes, with OpenRLHF's trainer modules imported as the orl fixture does."""
    added = cpu.install_stubs()
    try:
        from openrlhf.trainer import ppo_trainer, ppo_trainer_async
        classes = hook.trainer_classes(settings(run_dir, rank=0))
    finally:
        cpu.remove_stubs(added)
    return classes, ppo_trainer, ppo_trainer_async


def test_the_drivers_timers_land_on_each_fits_last_step(runs, tmp_path):
    """OpenRLHF's own BasePPOTrainer.save_logs_and_checkpoints, reached through the hook's PPOTrainer subclass,
    with each real fit's status plus the timers train_step / fit add (trainer/ppo_trainer.py L255-258, L543-545):
    the run's steps table gets them at the fit's last optimizer step (2, 5, 8; triage/metrics_step), the other
    steps stay untimed; so does the step's reward (rollout/reward_mean); OpenRLHF's logger still gets the status,
    timers included."""
    import math
    import types

    from openrlhf.trainer.ppo_utils.experience import Experience

    from triage_monitor.offline.analysis import open_run

    r = runs["off"]
    classes, ppo_trainer, _ = _driver_classes(r["run"].parent)
    cls = classes["PPOTrainer"].__ray_actor_class__
    assert issubclass(cls, hook.TriageTimingsMixin) and issubclass(cls, ppo_trainer.BasePPOTrainer)
    logged = []
    trainer = object.__new__(cls)
    trainer.args = types.SimpleNamespace(logger=types.SimpleNamespace(logging_steps=1),
                                         ckpt=types.SimpleNamespace(save_steps=float("inf")))
    trainer.wandb_logger = types.SimpleNamespace(log_train=lambda step, logs: logged.append((step, dict(logs))))
    trainer.tensorboard_logger = None
    rewards = [[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, 1.0], [2.0, 1.0, 1.0, 0.0]]
    for k, status in enumerate(r["statuses"]):
        status = dict(status)
        status.update({"timing/make_experience": 1.0 + k, "timing/ppo_train": 2.0, "timing/broadcast": 0.5})
        # train_step merges OpenRLHF's rollout stats (L261): its own _compute_rollout_stats over the step's
        # experiences, each sample's reward in info["reward"] as samples_generator.py L284 puts it
        exps = [Experience(info={"reward": torch.tensor([x])}, response_length=torch.tensor([5.0]),
                           truncated=torch.tensor([False])) for x in rewards[k]]
        status.update(ppo_trainer.BasePPOTrainer._compute_rollout_stats(trainer, exps))
        status["timing/generation"] = 6.0
        status["timing/step_total"] = sum(v for key, v in status.items() if key.startswith("timing/"))
        trainer.save_logs_and_checkpoints(k + 1, status, {})
    trainer._triage_timings.close()
    steps = open_run(r["run"]).steps().set_index("step")
    timed = steps[steps["time/generation"].notna()]
    assert timed.index.tolist() == [2, 5, 8]
    # OpenRLHF's rollout/reward_mean of each step is the reward of that step's row (the mean of its samples'
    # rewards: 0.4375, 0.5, 1.0); the other rows have none
    assert timed["reward"].tolist() == [sum(x) / 4 for x in rewards] == [0.4375, 0.5, 1.0]
    assert steps.drop(index=[2, 5, 8])["reward"].isna().all()
    assert timed["time/logprob"].tolist() == [1.0, 2.0, 3.0] and timed["time/update"].tolist() == [2.0] * 3
    assert timed["time/step"].tolist() == [9.5, 10.5, 11.5] and timed["time/weight_sync"].tolist() == [0.5] * 3
    assert all(math.isnan(v) for v in steps.drop(index=[2, 5, 8])["time/step"])
    late = open_run(r["run"]).timings()
    assert late["framework"].tolist() == ["openrlhf"] * 3 and late["framework_step"].tolist() == [1, 2, 3]
    assert [s for s, _ in logged] == [1, 2, 3] and logged[0][1]["timing/generation"] == 6.0


def test_the_async_trainer_makes_its_training_actor_record_timings(tmp_path):
    """The async trainer's __init__ puts the hook's TrainingActor in ppo_trainer_async's module (where OpenRLHF's
    PPOTrainerAsync.__init__ looks it up, in its own process) before OpenRLHF's __init__ runs."""
    classes, _, ppo_trainer_async = _driver_classes(tmp_path)
    original = ppo_trainer_async.TrainingActor
    base = classes["PPOTrainerAsync"].__ray_actor_class__
    try:
        with pytest.raises(AttributeError):               # OpenRLHF's own __init__ starts: strategy.args...
            base.__init__(object.__new__(base), "model", None, None, None, None, None, None)
        actor = ppo_trainer_async.TrainingActor.__ray_actor_class__
        assert issubclass(actor, hook.TriageTimingsMixin)
        assert issubclass(actor, original.__ray_actor_class__)
    finally:
        ppo_trainer_async.TrainingActor = original


# In the main venv only the tests above the side-environment runner are collected; the OpenRLHF tests run in
# the side environment through test_openrlhf_suite_in_its_side_environment (no silent skip either way).
MAIN_VENV_TESTS = ("test_cli_arguments_split", "test_cli_alerts_loggers_framework_keys",
                   "test_openrlhf_suite_in_its_side_environment")
if not IN_SIDE_ENV:
    for _name in [n for n in list(globals()) if n.startswith("test_") and n not in MAIN_VENV_TESTS]:
        del globals()[_name]
