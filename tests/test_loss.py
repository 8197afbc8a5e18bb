"""agg_loss / triage_policy_loss: every aggregation mode against values worked out by hand."""

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageConfig, TriageController
from triage_monitor.loss import AGG_MODES, agg_loss, renormalize_per_response, triage_policy_loss


def _batch():
    # response 0: 3 valid tokens, response 1: 1 valid token (row 1 has 2 padded columns)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return TokenBatch.from_padded(lp, lp.clone(), torch.tensor([1.0, -1.0]), mask)


LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0])
W = torch.tensor([1.0, 0.0, 1.0, 0.5])


@pytest.mark.parametrize("mode,expected", [
    # Σ wℓ / Σ w = (1 + 0 + 3 + 2) / 2.5
    ("token_mean", 6.0 / 2.5),
    # ((1 + 3) / 2 + 2 / 0.5) / 2 responses
    ("seq_mean_token_mean", (2.0 + 4.0) / 2),
    # (4 + 2) / 2 responses
    ("seq_mean_token_sum", 3.0),
    ("token_sum", 6.0),
])
def test_agg_loss_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, W, _batch(), mode).item() == pytest.approx(expected)


def test_agg_loss_given_denominator_is_used_as_is():
    assert agg_loss(LOSS, W, _batch(), "token_mean", denominator=10.0).item() == pytest.approx(0.6)
    assert agg_loss(LOSS, W, _batch(), "token_sum", denominator=4.0).item() == pytest.approx(1.5)


def test_agg_loss_unweighted_equals_plain_conventions():
    ones = torch.ones(4)
    b = _batch()
    assert agg_loss(LOSS, ones, b, "token_mean").item() == pytest.approx(2.5)
    assert agg_loss(LOSS, ones, b, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert agg_loss(LOSS, ones, b, "seq_mean_token_sum").item() == pytest.approx((6.0 + 4.0) / 2)


def test_agg_loss_response_denominator_by_hand():
    # slime's per-rollout mean: response 0 divided by 4 (its rollout's mask total), response 1 by 2:
    # (1·1 + 0·2 + 1·3) / 4 + (0.5·4) / 2 = 1 + 1
    rd = torch.tensor([4.0, 2.0])
    assert agg_loss(LOSS, W, _batch(), "seq_mean_token_mean", denominator=1.0,
                    response_denominator=rd).item() == pytest.approx(2.0)
    # a divisor below 1 counts as 1 (slime clamps): 4 / 1 + 2 / 2
    assert agg_loss(LOSS, W, _batch(), "seq_mean_token_mean", denominator=1.0,
                    response_denominator=torch.tensor([0.0, 2.0])).item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="needs mode 'seq_mean_token_mean'"):
        agg_loss(LOSS, W, _batch(), "token_mean", response_denominator=rd)
    with pytest.raises(ValueError, match="one per response"):
        agg_loss(LOSS, W, _batch(), "seq_mean_token_mean", response_denominator=torch.ones(3))


def test_agg_loss_rejects_bad_mode_and_shape():
    with pytest.raises(ValueError, match="mode must be one of"):
        agg_loss(LOSS, W, _batch(), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="per_token_loss has shape"):
        agg_loss(LOSS[:3], W, _batch(), "token_mean")


def test_renormalize_per_response_keeps_each_response_total():
    w = renormalize_per_response(W, _batch())
    # response 0: weights 1, 0, 1 → ×3/2; response 1: 0.5 → ×1/0.5
    assert w.tolist() == pytest.approx([1.5, 0.0, 1.5, 1.0])
    assert renormalize_per_response(torch.zeros(4), _batch()).tolist() == [0.0] * 4


def test_micro_batch_split_gives_the_full_batch_loss():
    """With the framework's global token count as denominator, micro-batch losses add up to the full-batch
    loss whatever the split (the weights are renormalised per response)."""
    torch.manual_seed(0)
    B, T = 8, 6
    sampler = -torch.rand(B, T) * 3
    learner = (sampler + torch.randn(B, T)).clamp(max=-1e-3).requires_grad_(False)
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.2).int()
    mask[:, 0] = 1
    ctrl = lambda: TriageController(TriageConfig(gate_width=2, repair=False, tis=False))  # noqa: E731
    full = TokenBatch.from_padded(learner, sampler, adv, mask)
    n = int(mask.sum())
    old = (learner + 0.3 * torch.randn(B, T)).clamp(max=-1e-3)          # PPO anchor ≠ learner: ℓ varies per token
    kw = dict(agg_mode="token_mean", denominator=n)
    ref = triage_policy_loss(ctrl(), full, 0, old_logp=full.gather(old), **kw).loss
    c = ctrl()
    total = 0.0
    for s in (slice(0, 3), slice(3, 8)):
        p = TokenBatch.from_padded(learner[s], sampler[s], adv[s], mask[s])
        total = total + triage_policy_loss(c, p, 0, old_logp=p.gather(old[s]), **kw).loss
    assert total.item() == pytest.approx(ref.item(), rel=1e-6)
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    assert ref.item() != pytest.approx(triage_policy_loss(plain, full, 0, old_logp=full.gather(old), **kw).loss.item())


def test_triage_policy_loss_reads_the_config_normalization():
    b = _batch()
    for norm, mode in (("per_response", "seq_mean_token_mean"), ("global_token", "token_mean")):
        res = triage_policy_loss(TriageController(TriageConfig(normalization=norm)), b, 0)
        assert res.agg_mode == mode
    assert set(AGG_MODES) >= {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"}


def test_token_scale_multiplies_the_loss_outside_the_normaliser():
    """A framework's own per-token factor (mask, importance ratio) scales ℓ but never the denominator.
    learner = old → ratio 1 → ℓ = −A: response 0 (A = 1) ℓ = −1 ×3, response 1 (A = −1) ℓ = +1."""
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    scale = torch.tensor([1.0, 0.0, 1.0, 0.5])
    b = _batch()
    # per response: (−1 + 0 − 1) / 3 and 0.5 / 1, mean of the two responses
    res = triage_policy_loss(plain, b, 0, agg_mode="seq_mean_token_mean", token_scale=scale)
    assert res.loss.item() == pytest.approx((-2 / 3 + 0.5) / 2)
    assert res.per_token_loss.tolist() == pytest.approx([-1.0, 0.0, -1.0, 0.5])
    # token mean over the 4 tokens, denominator unchanged by the zero factor
    res = triage_policy_loss(plain, b, 0, agg_mode="token_mean", token_scale=scale)
    assert res.loss.item() == pytest.approx(-1.5 / 4)
    with pytest.raises(ValueError, match="token_scale has shape"):
        triage_policy_loss(plain, b, 0, token_scale=scale[:3])


def test_token_scale_multiplies_after_renormalisation():
    """A trainer's own per-token correction (SkyRL's TIS ratio × masks) scales the weights after the per-response
    renormalisation and is not renormalised itself."""
    b = _batch()
    old = torch.tensor([-1.5, -2.0, -2.5, -0.5])                  # ratios e^0.5, 1, e^-0.5, 1; A = 1, 1, 1, -1
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    scale = torch.tensor([2.0, 0.0, 1.0, 0.5])
    res = triage_policy_loss(plain, b, 0, old_logp=old, clip_low=10.0, clip_high=10.0, agg_mode="token_sum",
                             denominator=1.0, token_scale=scale)
    # unclipped ℓ = −r·A: −e^0.5, −1, −e^−0.5, +1; Σ scale·ℓ = −2e^0.5 + 0 − e^−0.5 + 0.5
    expected = -2 * torch.exp(torch.tensor(0.5)) - torch.exp(torch.tensor(-0.5)) + 0.5
    assert res.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    e = torch.exp(torch.tensor(0.5)).item()
    assert res.per_token_loss.tolist() == pytest.approx([-2 * e, 0.0, -1 / e, 0.5], rel=1e-6)
    with pytest.raises(ValueError, match="token_scale has shape"):
        triage_policy_loss(plain, b, 0, token_scale=scale[:3])


def test_token_scale_scales_the_per_token_loss_and_is_not_renormalised():
    """A framework's own per-token factor (OpenRLHF's IS-correction coefficient) multiplies ℓ; a zeroed token
    still counts in the denominator.  Worked by hand: ratio 1 (old = learner), A = (1, 1, 1 | −1) → ℓ = −A."""
    b = _batch()
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    scale = torch.tensor([2.0, 0.0, 1.0, 0.5])
    # token mean over 4 tokens: (−2 − 0 − 1 + 0.5) / 4
    res = triage_policy_loss(plain, b, 0, agg_mode="token_mean", token_scale=scale)
    assert res.loss.item() == pytest.approx(-2.5 / 4)
    # the same with the framework's denominator 10: (−2.5) / 10
    res = triage_policy_loss(plain, b, 0, agg_mode="token_mean", denominator=10.0, token_scale=scale)
    assert res.loss.item() == pytest.approx(-0.25)
    # sequence mean: ((−2 − 0 − 1) / 3 + 0.5 / 1) / 2
    res = triage_policy_loss(plain, b, 0, agg_mode="seq_mean_token_mean", token_scale=scale)
    assert res.loss.item() == pytest.approx((-1.0 + 0.5) / 2)
    with pytest.raises(ValueError, match="token_scale has shape"):
        triage_policy_loss(plain, b, 0, token_scale=scale[:3])


def test_dppo_kl_surrogate_token_sum():
    """surrogate="dppo_kl" with the controller off and token_sum: the plain sum of dppo_kl_loss (prime-rl's
    per-sample loss), anchored on old_logp; an unknown surrogate is refused."""
    from triage_monitor.corrections import dppo_kl_loss

    b = _batch()
    anchor = b.learner_logp.detach() - torch.tensor([0.3, -0.2, 0.1, 0.05])
    plain = TriageController(TriageConfig(gate=False, tis=False, repair=False))
    kw = dict(mask_low=0.2, mask_high=0.2, adv_tau=1.0, kl_tau=1e-3)
    res = triage_policy_loss(plain, b, 0, old_logp=anchor, agg_mode="token_sum", surrogate="dppo_kl",
                             surrogate_kwargs=kw)
    assert res.loss.item() == pytest.approx(dppo_kl_loss(b.learner_logp, anchor, b.advantage, **kw).sum().item())
    with pytest.raises(ValueError, match="surrogate"):
        triage_policy_loss(plain, b, 0, surrogate="grpo")
