"""agg_loss / triage_policy_loss: every aggregation mode against values worked out by hand."""

import math

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig, TriageController
from triage_monitor.triage.loss import AGG_MODES, agg_loss, renormalize_per_response, triage_policy_loss


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
    from triage_monitor.triage.corrections import dppo_kl_loss

    b = _batch()
    anchor = b.learner_logp.detach() - torch.tensor([0.3, -0.2, 0.1, 0.05])
    plain = TriageController(TriageConfig(gate=False, tis=False, repair=False))
    kw = dict(mask_low=0.2, mask_high=0.2, adv_tau=1.0, kl_tau=1e-3)
    res = triage_policy_loss(plain, b, 0, old_logp=anchor, agg_mode="token_sum", surrogate="dppo_kl",
                             surrogate_kwargs=kw)
    assert res.loss.item() == pytest.approx(dppo_kl_loss(b.learner_logp, anchor, b.advantage, **kw).sum().item())
    with pytest.raises(ValueError, match="surrogate"):
        triage_policy_loss(plain, b, 0, surrogate="grpo")


# ---------------------------------------------------------------- defaults, edge denominators, dtypes
def test_defaults_token_mean_and_per_response_denominator():
    """agg_loss's default mode is token_mean (Σ wℓ / Σ w = 6 / 2.5); policy_loss_denominator's default
    normalization is per_response: responses with ≥ 1 valid token — 2 here, one of them with a single token."""
    from triage_monitor.triage.loss import policy_loss_denominator
    b = _batch()
    assert agg_loss(LOSS, W, b).item() == pytest.approx(6.0 / 2.5)
    assert policy_loss_denominator(W, b).item() == 2.0
    assert policy_loss_denominator(W, b, "global_token").item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match=r"^token_weights has shape \(3,\), expected \(4,\)$"):
        policy_loss_denominator(W[:3], b)
    with pytest.raises(ValueError, match=r"^token_weights has shape \(3,\), expected \(4,\)$"):
        renormalize_per_response(W[:3], b)


def test_zero_and_small_denominators():
    """A denominator of 0 gives a loss of 0 with a finite (zero) gradient, whatever Σ wℓ; a denominator in (0, 1)
    divides like any other (6 / 0.5 = 12)."""
    loss = LOSS.clone().requires_grad_(True)
    out = agg_loss(loss, W, _batch(), "token_mean", denominator=0.0)
    out.backward()
    assert out.item() == 0.0 and loss.grad.tolist() == [0.0] * 4
    assert agg_loss(LOSS, W, _batch(), "token_mean", denominator=0.5).item() == pytest.approx(12.0)
    # Σ w = 0.5 as the default denominator: (0.5 · 4) / 0.5
    assert agg_loss(LOSS, torch.tensor([0.0, 0.0, 0.0, 0.5]), _batch(), "token_mean").item() == pytest.approx(4.0)


def test_loss_is_float32_under_a_float64_default_dtype_and_a_float64_divisor():
    """The documented 0-dim float32 result holds when the user's default dtype is float64 and when slime's
    per-response divisors come as float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = _batch()
        out = agg_loss(LOSS, W, b, "seq_mean_token_mean")
        assert out.dtype == torch.float32 and out.item() == pytest.approx(3.0)
        assert renormalize_per_response(W, b).tolist() == pytest.approx([1.5, 0.0, 1.5, 1.0])
    finally:
        torch.set_default_dtype(old)
    out = agg_loss(LOSS, W, _batch(), "seq_mean_token_mean", denominator=1.0,
                   response_denominator=torch.tensor([4.0, 2.0], dtype=torch.float64))
    assert out.dtype == torch.float32 and out.item() == pytest.approx(2.0)


# ---------------------------------------------------------------- triage_policy_loss plumbing
def _tis_case():
    """_batch() (learner = sampler; A = 1, 1, 1 | −1) with rollout-time log-probs old = sampler + (0.5, 0, −0.5, 1):
    TIS weights clamp(e^(old − sampler), 0, 2) = (e^0.5, 1, e^−0.5, 2); PPO ratios e^(learner − old) =
    (e^−0.5, 1, e^0.5, e^−1)."""
    b = _batch()
    old = b.sampler_logp + torch.tensor([0.5, 0.0, -0.5, 1.0])
    return b, old, [math.exp(0.5), 1.0, math.exp(-0.5), 2.0]


def test_default_clip_range_is_08_to_128():
    """ℓ = −min(rA, clip(r, 0.8, 1.28)A): token 0 r = 0.607 A = 1 → −0.607; token 1 → −1; token 2 r = 1.649 → −1.28
    (clip-higher 0.28); token 3 r = 0.368 A = −1 → −min(−0.368, −0.8) = 0.8 (clip-low 0.2)."""
    b, old, _ = _tis_case()
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    res = triage_policy_loss(plain, b, 0, old_logp=old, agg_mode="token_sum")
    assert res.per_token_loss.tolist() == pytest.approx([-math.exp(-0.5), -1.0, -1.28, 0.8], rel=1e-6)
    assert res.policy_loss.item() == pytest.approx(-math.exp(-0.5) - 1.0 - 1.28 + 0.8, rel=1e-6)
    assert res.loss.item() == pytest.approx(res.policy_loss.item())


def test_dual_clip_caps_negative_advantage_tokens():
    """Token 3 (A = −1) with ratio e² = 7.39: PPO gives 7.39, dual clip c = 3 caps it at −c·A = 3."""
    b = _batch()
    old = b.learner_logp.detach() - torch.tensor([0.0, 0.0, 0.0, 2.0])
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    assert triage_policy_loss(plain, b, 0, old_logp=old).per_token_loss[3].item() == pytest.approx(math.exp(2.0))
    res = triage_policy_loss(plain, b, 0, old_logp=old, dual_clip=3.0)
    assert res.per_token_loss[3].item() == pytest.approx(3.0)


def test_tis_weights_come_from_old_logp_and_are_renormalised_only_with_a_fixed_denominator():
    """TIS weights use old_logp (not the live learner): (e^0.5, 1, e^−0.5, 2).  Without a denominator they are used
    as they are; with ``denominator`` or ``response_denominator`` each response is rescaled to keep its token count
    (response 0: × 3 / (e^0.5 + 1 + e^−0.5); response 1: 2 × 1/2 = 1)."""
    b, old, tis = _tis_case()
    ctrl = TriageController(TriageConfig(gate=False, repair=False, tis=True))
    res = triage_policy_loss(ctrl, b, 0, old_logp=old, agg_mode="token_mean")
    assert res.token_weights.tolist() == pytest.approx(tis, rel=1e-6)
    s0 = 3 / sum(tis[:3])
    renorm = [tis[0] * s0, tis[1] * s0, tis[2] * s0, 1.0]
    res = triage_policy_loss(ctrl, b, 0, old_logp=old, agg_mode="token_mean", denominator=4.0)
    assert res.token_weights.tolist() == pytest.approx(renorm, rel=1e-6)
    # ℓ = (−e^−0.5, −1, −1.28, 0.8) as in test_default_clip_range_is_08_to_128; Σ wℓ / 4
    ell = [-math.exp(-0.5), -1.0, -1.28, 0.8]
    assert res.loss.item() == pytest.approx(sum(w * x for w, x in zip(renorm, ell)) / 4, rel=1e-6)
    res = triage_policy_loss(ctrl, b, 0, old_logp=old, agg_mode="seq_mean_token_mean",
                             response_denominator=torch.tensor([4.0, 2.0]))
    assert res.token_weights.tolist() == pytest.approx(renorm, rel=1e-6)
    # Σ_s (Σ_t∈s wℓ / rd_s) / D: response 0 over 4, response 1 over 2, D = 2 responses (no denominator given)
    expect = (sum(w * x for w, x in zip(renorm[:3], ell[:3])) / 4 + renorm[3] * ell[3] / 2) / 2
    assert res.loss.item() == pytest.approx(expect, rel=1e-6)


def test_agg_mode_error_names_the_function_and_the_modes():
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))
    with pytest.raises(ValueError, match=r"^triage_policy_loss: agg_mode must be one of \('token_mean'.*got 'x'$"):
        triage_policy_loss(plain, _batch(), 0, agg_mode="x")


def test_repair_loss_is_added_and_uses_the_given_segment_count():
    """loss = policy part + Repair; the Repair part divides by ``repair_denominator`` as given (twice the count,
    half the Repair loss).  A > 0 tokens 1 nat below the sampler are in Repair's scope."""
    lp = torch.tensor([[-3.0, -3.0, -3.0], [-1.5, 0.0, 0.0]])
    b = TokenBatch.from_padded(lp.clone().requires_grad_(True), lp + 1.0, torch.tensor([1.0, -1.0]),
                               torch.tensor([[1, 1, 1], [1, 0, 0]]))
    ctrl = TriageController(TriageConfig(gate=False, tis=False, repair=True))
    r1 = triage_policy_loss(ctrl, b, 0, repair_denominator=5.0)
    r2 = triage_policy_loss(ctrl, b, 0, repair_denominator=10.0)
    rep1, rep2 = r1.output.repair_loss.item(), r2.output.repair_loss.item()
    assert rep1 > 0 and rep2 == pytest.approx(rep1 / 2, rel=1e-6)
    assert r1.loss.item() == pytest.approx(r1.policy_loss.item() + rep1, rel=1e-6)


def test_dppo_kl_surrogate_options_are_passed_through():
    """Non-default DPPO options (kl_tau 0.5, adv_tau 2) reach dppo_kl_loss."""
    from triage_monitor.triage.corrections import dppo_kl_loss

    b = _batch()
    anchor = b.learner_logp.detach() - torch.tensor([0.3, -0.2, 0.1, 0.05])
    plain = TriageController(TriageConfig(gate=False, tis=False, repair=False))
    kw = dict(mask_low=0.1, mask_high=0.05, adv_tau=2.0, kl_tau=0.5)
    res = triage_policy_loss(plain, b, 0, old_logp=anchor, agg_mode="token_sum", surrogate="dppo_kl",
                             surrogate_kwargs=kw)
    ours = dppo_kl_loss(b.learner_logp, anchor, b.advantage, **kw).sum().item()
    assert res.loss.item() == pytest.approx(ours)
    assert ours != pytest.approx(dppo_kl_loss(b.learner_logp, anchor, b.advantage).sum().item())


# ---------------------------------------------------------------- two ranks (real gloo collectives, two threads)
def _two_ranks(fn):
    """Run ``fn(rank, group)`` on two ranks of a real gloo process group (one thread per rank, an in-memory
    store); returns ``[result of rank 0, result of rank 1]``."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    out, errors = [None, None], []

    def run(rank):
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("loss", store), rank, 2, timedelta(seconds=60))
            out[rank] = fn(rank, pg)
        except Exception as e:          # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


# rank 0: _batch() with LOSS, W (Σ wℓ = 6, Σ w = 2.5, per-response means 2 and 4);
# rank 1: _batch() with ℓ = 2 everywhere and w = 1 (Σ wℓ = 8, Σ w = 4, per-response means 2 and 2)
RANK_LOSS = (LOSS, torch.full((4,), 2.0))
RANK_W = (W, torch.ones(4))


@pytest.mark.parametrize("mode,kw,expected", [
    ("token_mean", {}, 14 / 6.5),
    ("token_mean", {"denominator": 10.0}, 14 / 10),          # a given denominator is not summed over the ranks
    ("token_sum", {}, 14.0),
    ("seq_mean_token_mean", {}, (2 + 4 + 2 + 2) / 4),
    ("seq_mean_token_sum", {}, (4 + 2 + 6 + 2) / 4),
])
def test_agg_loss_over_two_ranks_is_the_global_loss(mode, kw, expected):
    def fn(rank, pg):
        loss = RANK_LOSS[rank].clone().requires_grad_(True)
        out = agg_loss(loss, RANK_W[rank], _batch(), mode, group=pg, **kw)
        out.backward()
        return out.item(), loss.grad
    (v0, g0), (v1, _) = _two_ranks(fn)
    assert v0 == pytest.approx(expected) and v1 == pytest.approx(expected)
    if mode == "token_mean" and not kw:
        assert g0.tolist() == pytest.approx((W / 6.5).tolist())     # the gradient flows through local tokens only


def test_policy_loss_denominator_and_weighted_loss_over_two_ranks():
    from triage_monitor.triage.loss import policy_loss_denominator, weighted_policy_loss

    def fn(rank, pg):
        b = _batch()
        return (policy_loss_denominator(RANK_W[rank], b, "per_response", group=pg).item(),
                policy_loss_denominator(RANK_W[rank], b, "global_token", group=pg).item(),
                weighted_policy_loss(RANK_LOSS[rank], RANK_W[rank], b, "global_token", group=pg).item(),
                weighted_policy_loss(RANK_LOSS[rank], RANK_W[rank], b, "per_response", group=pg).item())
    for got in _two_ranks(fn):
        assert got == pytest.approx((4.0, 6.5, 14 / 6.5, 2.5))


def test_triage_policy_loss_over_two_ranks_is_the_global_token_mean():
    """Plain PPO, learner = old → ℓ = −A: rank 0 A = (1, 1, 1, −1) → Σℓ = −2; rank 1 A = (2, 2, 2, 3) → Σℓ = −9;
    global token mean −11 / 8 (each rank alone: −0.5 and −2.25)."""
    plain = TriageController(TriageConfig(gate=False, repair=False, tis=False))

    def fn(rank, pg):
        b = _batch() if rank == 0 else TokenBatch.from_padded(
            torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]]), torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]]),
            torch.tensor([2.0, 3.0]), torch.tensor([[1, 1, 1], [1, 0, 0]]))
        return triage_policy_loss(plain, b, 0, agg_mode="token_mean", group=pg).loss.item()
    assert _two_ranks(fn) == pytest.approx([-11 / 8, -11 / 8])


# ------------------------------------------------------------ the per-response redistribution (docs/hooks.md)
GATE_ONLY = dict(tis=False, repair=False, gate_width=4)
#: the docs' worked example (docs/hooks.md#triage-weights-under-a-frameworks-normaliser): δ of three 4-token
#: responses with A = −1, −1, +1 (learner = sampler + δ; the PPO anchor is the learner: ratio 1, nothing clipped)
EXAMPLE_DELTA = [[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]]
EXAMPLE_ADV = [-1.0, -1.0, 1.0]


def _token_grads(cfg: TriageConfig, delta, adv, **kw):
    """(d loss / d learner_logp per valid token, the result) of triage_policy_loss: sampler −2, learner −2 + δ."""
    delta = torch.tensor(delta)
    sampler = torch.full_like(delta, -2.0)
    learner = (sampler + delta).requires_grad_()
    b = TokenBatch.from_padded(learner, sampler, torch.tensor(adv), torch.ones_like(delta, dtype=torch.bool))
    res = triage_policy_loss(TriageController(cfg), b, 0, old_logp=b.learner_logp.detach(), **kw)
    res.loss.backward()
    return learner.grad.reshape(-1), res


def test_renormalisation_worked_example_of_the_docs():
    """Under a framework's denominator the Gate weights are renormalised per response, w · n / Σw: the partly gated
    response a gets ×4/1.9 on its ungated token and 0.3 · 4/1.9 on the gated ones; the all-gated response b trains
    exactly as with the Gate off; the A > 0 response c is not eligible.  Gradient per token / Gate off's."""
    kw = dict(agg_mode="token_mean", denominator=12.0)
    on, res = _token_grads(TriageConfig(**GATE_ONLY), EXAMPLE_DELTA, EXAMPLE_ADV, **kw)
    off, _ = _token_grads(TriageConfig(gate=False, tis=False, repair=False), EXAMPLE_DELTA, EXAMPLE_ADV, **kw)
    assert res.output.gate_weights.tolist() == pytest.approx([1, .3, .3, .3, .3, .3, .3, .3, 1, 1, 1, 1])
    s = 4 / 1.9
    want = [s, .3 * s, .3 * s, .3 * s] + [1.0] * 8
    assert res.token_weights.tolist() == pytest.approx(want, rel=1e-6)
    assert (on / off).tolist() == pytest.approx(want, rel=1e-6)
    assert [round(x, 3) for x in want[:2]] == [2.105, 0.632]            # the table's figures
    # the value does not move at all here: ℓ = −A·ratio is constant within each response and each keeps n
    assert res.loss.item() == pytest.approx(-(-4 - 4 + 4) / 12)


@pytest.mark.parametrize("n, factor", [(64, 64 / 7.3), (1000, 1000 / 100.9)])
def test_scale_up_of_the_one_ungated_token_stays_below_one_over_the_smallest_gate_weight(n, factor):
    """One ungated token (δ > 0) among n − 1 severe ones (δ = −2, weight 0.1) in a response with A < 0: its gradient
    is n / (1 + 0.1 (n − 1)) × Gate off's — 8.8 for a 64-token segment, 9.9 for 1,000 tokens, below 1 / 0.1."""
    delta = [[0.1] + [-2.0] * (n - 1)]
    kw = dict(agg_mode="token_sum", denominator=1.0)
    on, res = _token_grads(TriageConfig(tis=False, repair=False), delta, [-1.0], **kw)
    off, _ = _token_grads(TriageConfig(gate=False, tis=False, repair=False), delta, [-1.0], **kw)
    assert res.output.gate_weights[1:].max().item() == pytest.approx(0.1)
    assert (on[0] / off[0]).item() == pytest.approx(factor, rel=1e-5)
    assert factor < 1 / min(TriageConfig().severe_weight, TriageConfig().tail_floor) == pytest.approx(10)


def test_global_token_is_refused_where_it_would_be_replaced():
    """normalization='global_token' with a framework denominator (the weights would be renormalised per response)
    or another aggregation mode raises naming the setting; alone it is the global token mean."""
    b = _batch()
    ctrl = TriageController(TriageConfig(normalization="global_token"))
    for kw in (dict(agg_mode="token_mean", denominator=4.0), dict(agg_mode="token_sum", denominator=1.0),
               dict(agg_mode="seq_mean_token_mean"),
               dict(agg_mode="seq_mean_token_mean", response_denominator=torch.tensor([3.0, 1.0]))):
        with pytest.raises(ValueError, match="normalization='global_token'.*cannot be honoured"):
            triage_policy_loss(ctrl, b, 0, **kw)
    assert ctrl.calls == 0                                   # refused before the controller ran
    assert triage_policy_loss(ctrl, b, 0).agg_mode == "token_mean"
    assert triage_policy_loss(ctrl, b, 0, agg_mode="token_mean").agg_mode == "token_mean"


def _anchor_batch():
    """One response, two tokens whose learner and sampler log-probs differ: learner (log 0.3, log 0.2), sampler
    (log 0.2, log 0.4), per-token advantages (1, 3)."""
    learner = torch.log(torch.tensor([0.3, 0.2])).requires_grad_(True)
    sampler = torch.log(torch.tensor([0.2, 0.4]))
    b = TokenBatch.from_flat(learner, sampler, torch.tensor([1.0, 3.0]), torch.zeros(2, dtype=torch.long),
                             torch.arange(2))
    return b, learner


def test_default_anchor_is_the_learner_not_the_sampler():
    """Without ``old_logp`` the PPO / TIS anchor is the learner's own log-prob (one update per rollout), here with
    sampler != learner.  By hand: PPO ratio exp(l − l) = 1 on both tokens (unclipped), ℓ = −A = (−1, −3); TIS
    weights exp(l − s) = (0.3/0.2, 0.2/0.4) = (1.5, 0.5), inside [0, 2]; per-response mean
    Σ w ℓ / Σ w = (1.5·(−1) + 0.5·(−3)) / 2 = −1.5; gradient w.r.t. the learner log-probs w_t·(−A_t)·1 / Σ w =
    (−0.75, −0.75).  The sampler as anchor would give TIS weights 1, ratios (1.5, 0.5) and
    (−min(1.5, 1.28) − min(1.5, 2.4)) / 2 = −1.39 (checked too: the test can tell the two apart)."""
    cfg = TriageConfig(gate=False, repair=False)            # TIS on, clip [0, 2]
    b, learner = _anchor_batch()
    res = triage_policy_loss(TriageController(cfg), b, 0)
    assert res.output.token_weights.tolist() == pytest.approx([1.5, 0.5], rel=1e-6)
    assert res.loss.item() == pytest.approx(-1.5, rel=1e-6)
    res.loss.backward()
    assert learner.grad.tolist() == pytest.approx([-0.75, -0.75], rel=1e-6)
    explicit = triage_policy_loss(TriageController(cfg), b, 0, old_logp=b.learner_logp.detach())
    assert explicit.loss.item() == res.loss.item()
    wrong = triage_policy_loss(TriageController(cfg), b, 0, old_logp=b.sampler_logp)
    assert wrong.output.token_weights.tolist() == [1.0, 1.0]
    assert wrong.loss.item() == pytest.approx(-1.39, rel=1e-6)


def test_the_controllers_own_default_anchor_is_the_learner():
    """``TriageController(cfg)(batch, step)`` without ``old_logp`` (Gate and TIS users who write their own loss):
    the TIS weights are exp(learner − sampler) = (1.5, 0.5) on the batch above, not the 1.0 that a sampler anchor
    would give (TIS silently off)."""
    b, _ = _anchor_batch()
    out = TriageController(TriageConfig(gate=False, repair=False))(b, step=0)
    assert out.token_weights.tolist() == pytest.approx([1.5, 0.5], rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_old_logp_is_refused_naming_the_token(bad):
    """A NaN / ±inf anchor would make the loss NaN (PPO ratio and TIS weight) with nothing pointing at old_logp: it
    is refused, naming old_logp, the token's sample_id and position, and the value; shapes keep their own error."""
    b = TokenBatch.from_flat(torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.1, -0.2, -0.3]), torch.ones(3),
                             torch.tensor([3, 7, 7]), torch.tensor([0, 1, 2]))
    old = b.learner_logp.detach().clone()
    old[2] = bad                                           # sample_id 7, position 2
    ctrl = TriageController(TriageConfig())
    with pytest.raises(ValueError) as err:
        triage_policy_loss(ctrl, b, 0, old_logp=old)
    assert str(err.value).startswith(f"triage_policy_loss: old_logp[sample=7, position=2] = {bad!r} is not finite "
                                     "(1 such token(s) in this batch)")
    assert ctrl.calls == 0                                  # refused before the controller ran
    with pytest.raises(ValueError, match=r"old_logp has shape \(2,\)"):
        triage_policy_loss(ctrl, b, 0, old_logp=old[:2])
    assert math.isfinite(triage_policy_loss(ctrl, b, 0, old_logp=b.learner_logp.detach()).loss.item())


def test_the_compiled_cpu_passes_give_the_torch_operations_loss_and_gradient_bit_for_bit(monkeypatch):
    """The TRIAGE loss with the controller's compiled CPU passes (segments and their sums, the Gate's broadcast) and
    with the torch operations alone (what an accelerator runs, ``segments.COMPILED_ON_CPU = False``): loss, policy
    loss, per-token loss, weights, Gate weights, Repair, statistics and the gradient of the padded learner
    log-probs are bit-identical, for both Gate scopes, the three Repair scopes, widths that divide and that do not,
    a calibrating controller (thresholds set at its third step), per-sample and per-token advantages and several
    aggregation modes."""
    from triage_monitor.metrics import segments
    from triage_monitor.triage.controller import CalibrationConfig

    def bits(t):
        t = t.detach().reshape(-1)
        return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32).tolist()

    configs = [TriageConfig(), TriageConfig(gate_scope="whole", repair_scope="q2", repair_width=192),
               TriageConfig(repair_width=100, repair_scope="whole"), TriageConfig(gate=False, tis=False),
               TriageConfig(gate_width=32, repair_width=64, delta_bad=-0.5),
               TriageConfig(calibration=CalibrationConfig(window=2, neg_quantile=0.2, severe_quantile=0.05,
                                                          bad_quantile=0.01))]

    def run() -> list:
        out = []
        for i, cfg in enumerate(configs):
            g = torch.Generator().manual_seed(i)
            ctrl = TriageController(cfg)
            for step in range(4):
                B, T = 9, 300
                mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)
                sampler = -torch.rand(B, T, generator=g) * 3
                learner = (sampler + torch.randn(B, T, generator=g) * 1.5).clamp(max=0)
                learner[:, ::7] = sampler[:, ::7]                   # δ = 0 exactly: not negative (Gate scope q3)
                learner.requires_grad_(True)
                adv = torch.randn(B, generator=g) if step % 2 else torch.randn(B, T, generator=g)
                batch = TokenBatch.from_padded(learner, sampler, adv, mask)
                old = batch.gather((learner + torch.randn(B, T, generator=g) * 0.2).clamp(max=0))
                res = triage_policy_loss(ctrl, batch, step, old_logp=old, dual_clip=3.0,
                                         agg_mode=AGG_MODES[step % len(AGG_MODES)])
                res.loss.backward()
                out.append([bits(t) for t in (res.loss, res.policy_loss, res.per_token_loss, res.token_weights,
                                              res.output.gate_weights, res.output.tis_weights,
                                              res.output.repair_loss, learner.grad)]
                           + [sorted(res.output.stats.items()), ctrl.effective_thresholds()])
        return out

    compiled = run()
    monkeypatch.setattr(segments, "COMPILED_ON_CPU", False)
    assert run() == compiled
