"""The loss objects for SkyRL, NeMo RL and prime-rl: same per-token weights and repair loss as the core API on
the same tokens, and the framework's return shape.  (OpenRLHF: tests/test_hooks_openrlhf.py, against the real
package.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageConfig, TriageController, weighted_policy_loss
from triage_monitor.corrections import ppo_clip_loss
from triage_monitor.hooks import nemo_rl, prime_rl, skyrl


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


def test_skyrl_loss_matches_core_api():
    learner, old, sampler, adv, mask = tokens(1)
    fn = skyrl.SkyRLTriageLoss()
    cfg = SimpleNamespace(eps_clip_low=0.2, eps_clip_high=0.28, loss_reduction="sequence_mean")
    loss, metrics = fn(learner, old, adv, cfg, loss_mask=mask.float(), rollout_logprobs=sampler)
    out, expected = core(learner, old, sampler, adv, mask, "per_response")
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights)
    assert torch.allclose(loss, expected, atol=1e-6) and "triage/repair_loss" in metrics


def test_nemo_rl_loss_matches_core_api():
    torch.manual_seed(0)
    B, S, V, P = 3, 40, 11, 4
    ids = torch.randint(0, V, (B, S))
    logits = torch.randn(B, S, V, requires_grad=True)
    live = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    tm = torch.zeros(B, S)
    tm[:, P:] = 1
    tm[1, 20:24] = 0                                           # environment tokens
    sampler = torch.zeros(B, S)
    sampler[:, 1:] = torch.where(tm[:, 1:] > 0, (live.detach() - 0.4 * torch.rand(B, S - 1)), torch.zeros(()))
    prev = torch.zeros(B, S)
    prev[:, 1:] = live.detach()
    adv = torch.tensor([-1.0, 0.5, -0.2]).unsqueeze(1).expand(B, S)
    data = {"input_ids": ids, "prev_logprobs": prev, "generation_logprobs": sampler, "advantages": adv,
            "token_mask": tm, "sample_mask": torch.ones(B)}
    fn = nemo_rl.NemoRLTriageLoss()
    loss, _ = fn(logits, data, global_valid_seqs=B, global_valid_toks=None)
    m = tm[:, 1:].bool()
    batch = TokenBatch.from_padded(live, sampler[:, 1:], adv[:, 1:], m,
                                   positions=torch.arange(S - 1).expand(B, -1) - (P - 1))
    assert int(batch.position.min()) == 0
    out = TriageController()(batch, step=0, old_logp=prev[:, 1:][m])
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights)
    ptl = ppo_clip_loss(batch.learner_logp, prev[:, 1:][m], batch.advantage, 0.2, 0.28)
    assert torch.allclose(loss, weighted_policy_loss(ptl, out.token_weights, batch, "global_token") + out.repair_loss,
                          atol=1e-6)
    loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_prime_rl_per_sample_loss():
    learner, old, sampler, adv, mask = tokens(2)
    fn = prime_rl.PrimeRLTriageLoss()
    i = 0
    P = 5
    inputs = SimpleNamespace(trainer_logprobs=torch.cat([torch.full((P,), -0.3), learner[i]]),
                             inference_logprobs=torch.cat([torch.zeros(P), sampler[i]]),
                             teacher_logprobs=None, advantages=torch.cat([torch.zeros(P), adv[i]]),
                             loss_mask=torch.cat([torch.zeros(P, dtype=torch.bool), mask[i]]))
    res = fn(inputs)
    loss = res[0] if isinstance(res, tuple) else res.loss
    batch = TokenBatch.from_list([learner[i]], [sampler[i]], [adv[i]], [mask[i]])
    out = TriageController()(batch, step=0)
    assert torch.equal(fn.last.output.gate_weights, out.gate_weights) and float(out.gate_weights.min()) < 1
    ptl = ppo_clip_loss(batch.learner_logp, batch.learner_logp.detach(), batch.advantage, 0.2, 0.28)
    assert torch.allclose(loss, weighted_policy_loss(ptl, out.token_weights, batch, "per_response") + out.repair_loss)


def _calls(name, learner, old, sampler, adv, mask):
    """(hook, [one call per micro-batch]) in each framework's own layout; micro-batches are rows 0-1 and 2-3
    (SkyRL), or one sample per call (prime-rl)."""
    if name == "skyrl":
        fn, cfg = skyrl.SkyRLTriageLoss(), SimpleNamespace(eps_clip_low=0.2, eps_clip_high=0.28)
        return fn, [lambda r=r: fn(learner[r], old[r], adv[r], cfg, loss_mask=mask[r], rollout_logprobs=sampler[r])
                    for r in (slice(0, 2), slice(2, 4))]
    fn = prime_rl.PrimeRLTriageLoss()
    return fn, [lambda i=i: fn(SimpleNamespace(trainer_logprobs=learner[i], inference_logprobs=sampler[i],
                                               advantages=adv[i], loss_mask=mask[i])) for i in range(4)]


@pytest.mark.parametrize("name", ["skyrl", "prime_rl"])
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
