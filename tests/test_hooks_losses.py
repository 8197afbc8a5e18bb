"""The loss objects for OpenRLHF, SkyRL, NeMo RL and prime-rl: same per-token weights and repair loss
as the core API on the same tokens, the framework's return shape, and (OpenRLHF, where the package
installs but cannot be imported without CUDA's flash-attn) the exact ``PolicyLoss.forward`` signature
read from the installed source."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageConfig, TriageController, weighted_policy_loss
from triage_monitor.corrections import ppo_clip_loss
from triage_monitor.hooks import openrlhf, skyrl


def tokens(seed=0, B=4, T=140):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([140, 70, 12, 100])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    sampler = -torch.rand(B, T, generator=g) * 2 - 1e-3
    delta = torch.randn(B, T, generator=g) * 0.3
    delta[:, ::11] -= 7.0
    learner = (sampler + delta).clamp(max=-1e-4)
    old = (learner + torch.randn(B, T, generator=g) * 0.01).clamp(max=-1e-4)
    adv = torch.tensor([-1.0, 0.7, -0.4, 1.2]).unsqueeze(1).expand(B, T).contiguous()
    return learner, old, sampler, adv, mask


def core(learner, old, sampler, adv, mask, norm, clip=(0.2, 0.28)):
    batch = TokenBatch.from_padded(learner, sampler, adv, mask)
    oldf = old[mask]
    out = TriageController(TriageConfig())(batch, step=0, old_logp=oldf)
    ptl = ppo_clip_loss(batch.learner_logp, oldf, batch.advantage, *clip)
    return out, weighted_policy_loss(ptl, out.token_weights, batch, norm) + out.repair_loss


def test_openrlhf_policy_loss_matches_core_api():
    learner, old, sampler, adv, mask = tokens()
    P = 3                                                      # OpenRLHF rows start with prompt columns
    pad = lambda x, v: torch.cat([torch.full((x.shape[0], P), v, dtype=x.dtype), x], 1)  # noqa: E731
    fn = openrlhf.TriagePolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, clip_ratio, ppo_kl, vllm_kl, filt = fn(pad(learner, -0.5), pad(old, -0.5), pad(adv, 0.0),
                                                 action_mask=pad(mask, False), rollout_log_probs=pad(sampler, 0.0))
    out, expected = core(learner, old, sampler, adv, mask, "global_token")
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights) and float(out.gate_weights.min()) < 1
    assert torch.equal(fn.last.output.tis_weights, out.tis_weights)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert abs(float(vllm_kl) - float((sampler - old)[mask].mean())) < 1e-6
    half, *_ = fn(pad(learner, -0.5), pad(old, -0.5), pad(adv, 0.0), action_mask=pad(mask, False),
                  rollout_log_probs=pad(sampler, 0.0), dp_size=1, batch_num_tokens=2 * int(mask.sum()))
    assert torch.allclose(half, loss * 0.5)


def _openrlhf_source():
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("openrlhf is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "models" / "loss.py"


def test_openrlhf_forward_signature_matches_installed_package():
    tree = ast.parse(_openrlhf_source().read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PolicyLoss")
    fwd = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    theirs = [a.arg for a in fwd.args.args]
    ours = list(inspect.signature(openrlhf.TriagePolicyLoss.forward).parameters)
    assert ours == theirs


def test_skyrl_loss_matches_core_api():
    learner, old, sampler, adv, mask = tokens(1)
    fn = skyrl.SkyRLTriageLoss()
    cfg = SimpleNamespace(eps_clip_low=0.2, eps_clip_high=0.28, loss_reduction="sequence_mean")
    loss, metrics = fn(learner, old, adv, cfg, loss_mask=mask.float(), rollout_logprobs=sampler)
    out, expected = core(learner, old, sampler, adv, mask, "per_response")
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights)
    assert torch.allclose(loss, expected, atol=1e-6) and "triage/repair_loss" in metrics


def _calls(name, learner, old, sampler, adv, mask):
    """(hook, [one call per micro-batch]) in each framework's own layout; micro-batches are rows 0-1 and 2-3
    (OpenRLHF, SkyRL); prime-rl and NeMo RL: tests/test_hooks_prime_rl.py, tests/test_hooks_nemo_rl.py."""
    if name == "openrlhf":
        fn = openrlhf.TriagePolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)
        return fn, [lambda r=r: fn(learner[r], old[r], adv[r], action_mask=mask[r], rollout_log_probs=sampler[r])
                    for r in (slice(0, 2), slice(2, 4))]
    fn, cfg = skyrl.SkyRLTriageLoss(), SimpleNamespace(eps_clip_low=0.2, eps_clip_high=0.28)
    return fn, [lambda r=r: fn(learner[r], old[r], adv[r], cfg, loss_mask=mask[r], rollout_logprobs=sampler[r])
                for r in (slice(0, 2), slice(2, 4))]


@pytest.mark.parametrize("name", ["openrlhf", "skyrl"])
def test_loss_calls_of_one_step_are_one_monitored_step(name, tmp_path):
    """With ``fn.step`` set, the loss calls of a step give ONE monitored step: the union of the tokens, sample
    ids distinct across calls, and the metrics of one log_step on all rows; the next step value writes it."""
    pd = pytest.importorskip("pandas")
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    learner, old, sampler, adv, mask = tokens(3)
    fn, calls = _calls(name, learner, old, sampler, adv, mask)
    with MismatchMonitor(tmp_path / "run", MonitorConfig()) as mon:
        fn.monitor, fn.step = mon, 7
        for call in calls:
            call()
        assert mon.steps_logged == 0
        fn.step = 8
        calls[0]()
        assert mon.steps_logged == 1
        fn.close()
        assert mon.steps_logged == 2
    with MismatchMonitor(tmp_path / "ref", MonitorConfig()) as ref_mon:
        ref = ref_mon.log_step(7, TokenBatch.from_padded(learner, sampler, adv, mask))
    t7 = pd.read_parquet(tmp_path / "run" / "tokens").pipe(lambda t: t[t["step"].astype(int) == 7])
    t7 = t7.sort_values(["sample_id", "position"])
    assert sorted(set(t7["sample_id"])) == [0, 1, 2, 3] and len(t7) == int(mask.sum())
    assert torch.equal(torch.tensor(t7["sampler_logp"].to_numpy()), sampler[mask])
    steps = pd.read_parquet(tmp_path / "run" / "steps")
    s7 = steps[steps["step"].astype(int) == 7].iloc[0]
    from triage_monitor.metrics import METRIC_NAMES
    for k in (*METRIC_NAMES, *(f"window/{m}" for m in METRIC_NAMES), "empty_response_count"):
        got, want = float(s7[k]), ref[k]
        assert (got != got and want != want) or got == pytest.approx(want, rel=1e-6), k
