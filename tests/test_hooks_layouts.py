"""Every framework adapter, fed the same tokens in its framework's own layout, yields the same batch,
the same metrics and the same controller weights.

Each layout is built the way that framework builds it (see hooks/<framework>.py docstrings):
padding values are framework sentinels (0.0 for rollout log-probs, -1e10 for learner padding) and
prompt / tool-output columns carry plausible-looking values that must be excluded by the mask.
If an adapter read any of them, from_padded would raise on the -1e10 sentinel or the metrics
(zero_logp / delta statistics) would differ from the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig, TriageController
from triage_monitor.metrics.stats import compute_step_metrics
from triage_monitor.hooks import nemo_rl, openrlhf, prime_rl, skyrl, slime

PAD_LEARNER = -1e10      # sentinel: must never be read
PAD_SAMPLER = 0.0        # rollout engines pad with 0.0 (reads as probability 1 if leaked)


def make_tokens(seed: int = 0):
    """Ground truth: S responses, each with response log-probs, a per-response advantage, a tool span."""
    g = torch.Generator().manual_seed(seed)
    lengths = [150, 70, 9, 131, 40]            # > 64 so segments (W = 64) matter
    prompts = [5, 3, 7, 2, 4]
    out = []
    for i, (L, P) in enumerate(zip(lengths, prompts)):
        sampler = -torch.rand(L, generator=g) * 2.0 - 1e-3
        delta = torch.randn(L, generator=g) * 0.3
        delta[::17] -= 7.0                                   # large negative gaps (tail tokens)
        learner = (sampler + delta).clamp(max=-1e-4)
        mask = torch.ones(L, dtype=torch.bool)
        if L > 40:
            mask[20:26] = False                              # tool output inside the response
        adv = float(torch.randn((), generator=g)) if i != 2 else -0.5
        out.append(dict(learner=learner, sampler=sampler, mask=mask, adv=adv, prompt=P,
                        prompt_learner=-torch.rand(P, generator=g), L=L))
    return out


def reference(tokens) -> TokenBatch:
    return TokenBatch.from_list([t["learner"] for t in tokens], [t["sampler"] for t in tokens],
                                torch.tensor([t["adv"] for t in tokens]), [t["mask"] for t in tokens])


def _right_padded(tokens):
    """(B, T) right-padded response tensors: verl, TRL."""
    B, T = len(tokens), max(t["L"] for t in tokens)
    learner = torch.full((B, T), PAD_LEARNER)
    sampler = torch.full((B, T), PAD_SAMPLER)
    mask = torch.zeros(B, T, dtype=torch.long)
    adv = torch.zeros(B, T)
    for i, t in enumerate(tokens):
        L = t["L"]
        learner[i, :L], sampler[i, :L], mask[i, :L], adv[i, :L] = t["learner"], t["sampler"], t["mask"].long(), t["adv"]
        sampler[i, :L][~t["mask"]] = 0.0                       # tool tokens: no engine log-prob
    return learner, sampler, mask, adv


def _prompt_plus_response(tokens, shift: int):
    """(B, S) prompt + response rows (OpenRLHF: shift 0 = already sequences[1:]; NeMo RL: shift 1)."""
    B = len(tokens)
    S = max(t["prompt"] + t["L"] for t in tokens) + shift + 3
    learner = torch.full((B, S), PAD_LEARNER)
    sampler = torch.full((B, S), PAD_SAMPLER)
    mask = torch.zeros(B, S, dtype=torch.long)
    adv = torch.zeros(B, S)
    for i, t in enumerate(tokens):
        a, L = t["prompt"] + shift, t["L"]
        learner[i, shift:a] = t["prompt_learner"]                    # prompt: real-looking, masked out
        sampler[i, shift:a] = 0.0
        learner[i, a:a + L], sampler[i, a:a + L] = t["learner"], t["sampler"]
        mask[i, a:a + L] = t["mask"].long()
        adv[i, a:a + L] = t["adv"]
    return learner, sampler, mask, adv


def via_verl(tokens):
    verl = pytest.importorskip("verl")
    from triage_monitor.hooks.verl import batch_from_dataproto

    learner, sampler, mask, adv = _right_padded(tokens)
    data = verl.DataProto.from_dict(tensors={"old_log_probs": learner, "rollout_log_probs": sampler,
                                             "advantages": adv, "response_mask": mask})
    return batch_from_dataproto(data)


def via_trl(tokens):
    pytest.importorskip("trl")
    from triage_monitor.hooks.trl import batch_from_trl

    learner, sampler, mask, _ = _right_padded(tokens)
    inputs = {"sampling_per_token_logps": sampler, "completion_mask": (learner > PAD_LEARNER).long(),
              "tool_mask": mask, "advantages": torch.tensor([t["adv"] for t in tokens])}
    return batch_from_trl(learner, inputs)


def via_skyrl(tokens):
    """SkyRL right-aligns each response in its (B, T) tensors (left padding)."""
    learner, sampler, mask, adv = (torch.flip(x, dims=[1]) for x in _right_padded(tokens))
    for i, t in enumerate(tokens):
        T, L = learner.shape[1], t["L"]
        for x in (learner, sampler, mask, adv):
            x[i, T - L:] = torch.flip(x[i, T - L:], dims=[0])
    return skyrl.batch_from_skyrl(learner, sampler, adv, mask)


def via_openrlhf(tokens):
    learner, sampler, mask, adv = _prompt_plus_response(tokens, shift=0)
    return openrlhf.batch_from_openrlhf(learner, sampler, adv, mask)


def via_nemo_rl(tokens):
    learner, sampler, mask, adv = _prompt_plus_response(tokens, shift=1)
    data = {"prev_logprobs": learner, "generation_logprobs": sampler, "advantages": adv, "token_mask": mask,
            "sample_mask": torch.ones(len(tokens))}
    return nemo_rl.batch_from_nemo_rl(data)


def via_prime_rl(tokens):
    def full(t, key, prompt_value):
        return torch.cat([prompt_value, t[key]])
    tl = [full(t, "learner", t["prompt_learner"]) for t in tokens]
    il = [full(t, "sampler", torch.zeros(t["prompt"])) for t in tokens]
    adv = [torch.full((t["prompt"] + t["L"],), t["adv"]) for t in tokens]
    lm = [torch.cat([torch.zeros(t["prompt"], dtype=torch.bool), t["mask"]]) for t in tokens]
    return prime_rl.batch_from_prime_rl(tl, il, adv, lm)


def via_slime(tokens):
    batch = {"log_probs": [t["learner"] for t in tokens],
             "rollout_log_probs": [torch.where(t["mask"], t["sampler"], torch.zeros(())) for t in tokens],
             "advantages": [torch.full((t["L"],), t["adv"]) for t in tokens],
             "loss_masks": [t["mask"].int() for t in tokens],
             "response_lengths": [t["L"] for t in tokens]}
    return slime.batch_from_slime(batch)


ADAPTERS = {"verl": via_verl, "trl": via_trl, "skyrl": via_skyrl, "openrlhf": via_openrlhf,
            "nemo_rl": via_nemo_rl, "prime_rl": via_prime_rl, "slime": via_slime}
FIELDS = ("learner_logp", "sampler_logp", "advantage", "sample_index", "position", "num_valid")


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_reproduces_tokens_metrics_and_weights(name):
    tokens = make_tokens()
    ref = reference(tokens)
    got = ADAPTERS[name](tokens)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f"{name}: {f} differs"
    # hand check of the layout contract: tool tokens 20..25 of response 0 are absent, positions keep counting
    pos0 = got.position[got.sample_index == 0]
    assert 20 not in pos0.tolist() and 26 in pos0.tolist() and int(pos0.max()) == tokens[0]["L"] - 1
    assert got.num_tokens == sum(int(t["mask"].sum()) for t in tokens)

    tau = -0.5
    m_ref, m_got = compute_step_metrics(ref, tau).values, compute_step_metrics(got, tau).values
    assert m_ref.keys() == m_got.keys()
    for k in m_ref:
        a, b = m_ref[k], m_got[k]
        assert (math.isnan(a) and math.isnan(b)) or a == b, f"{name}: metric {k} {a} != {b}"
    assert m_got["count_amp_neg"] > 0 and m_got["count_amp_pos"] > 0   # the data exercises the quadrants

    cfg = TriageConfig()
    out_ref, out_got = TriageController(cfg)(ref, step=0), TriageController(cfg)(got, step=0)
    assert torch.equal(out_ref.gate_weights, out_got.gate_weights)
    assert float(out_got.gate_weights.min()) < 1.0                      # the Gate actually fires
    assert torch.equal(out_ref.repair_loss, out_got.repair_loss)


def test_all_adapters_agree_with_each_other():
    """Agreement test (every adapter's batch through ``compute_step_metrics``); the independent check is
    test_adapter_reproduces_tokens_metrics_and_weights (hand-built reference batch and layout contract).

    The same tokens through every available layout give one set of metrics."""
    tokens = make_tokens(seed=3)
    results = {}
    for name, fn in ADAPTERS.items():
        try:
            results[name] = compute_step_metrics(fn(tokens), -0.3).values
        except pytest.skip.Exception:
            continue
    assert len(results) >= 5
    first = next(iter(results.values()))
    for name, m in results.items():
        for k, v in first.items():
            assert (math.isnan(v) and math.isnan(m[k])) or v == m[k], f"{name}: {k}"


def test_leaked_padding_would_be_caught():
    """Independent check that the sentinels are live: unmasking one padded column makes the adapter raise."""
    tokens = make_tokens()
    learner, sampler, mask, adv = _right_padded(tokens)
    mask[2, tokens[2]["L"]] = 1                                       # padding column of the short response
    with pytest.raises(ValueError, match="sentinel"):
        skyrl.batch_from_skyrl(learner, sampler, adv, mask)


def test_openrlhf_positions_start_at_first_action_column():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0, 0]])
    from triage_monitor.hooks.micro_batches import leading_positions
    assert leading_positions(mask).tolist() == [[-2, -1, 0, 1, 2, 3, 4], [-1, 0, 1, 2, 3, 4, 5]]


def test_missing_sampler_logprobs_named():
    x = torch.zeros(2, 3) - 0.1
    with pytest.raises(ValueError, match="rollout_log_probs is None"):
        openrlhf.batch_from_openrlhf(x, None, x, torch.ones(2, 3))
    with pytest.raises(KeyError, match="rollout_log_probs"):
        slime.batch_from_slime({"log_probs": [x[0]], "advantages": [x[0]]})
