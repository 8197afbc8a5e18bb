"""Baseline corrections (docs/metrics.md#baselines): values worked by hand from the stated formulas."""

import math

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.corrections import (
    dppo_kl_loss, geometric_mean_ratio, geometric_sequence_mask_weights, sequence_mask_weights, get_surrogate, icepop_weights, list_surrogates, mis_weights, ppo_clip_loss,
    reference_kl,
    register_surrogate, sequence_is_geometric_weights, sequence_is_product_weights, sequence_log_ratio_sum,
    tis_weights,
)


def test_ppo_clip_loss_hand_values_and_gradient():
    # ratio r = exp(logp - old): e^0.5 = 1.6487 (above 1.28) and e^-0.5 = 0.6065 (below 0.8)
    logp = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.1]) - 2.0
    old = torch.full((5,), -2.0)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    logp.requires_grad_(True)
    loss = ppo_clip_loss(logp, old, adv)
    e5, em5, e1 = math.exp(0.5), math.exp(-0.5), math.exp(0.1)
    # A>0: -min(r, 1.28); A<0: -min(-r, -clip(r)) = max(r, clip(r))
    expected = [-1.28, e5, -em5, 0.8, -2 * e1]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    loss.sum().backward()
    # clipped tokens (0 and 3) carry no gradient; unclipped: d(-r A)/dlogp = -r A
    assert logp.grad.tolist() == pytest.approx([0.0, e5, -em5, 0.0, -2 * e1], rel=1e-6)


def test_ppo_clip_symmetric_and_dual_clip():
    logp = torch.tensor([math.log(1.25), 2.0]) - 3.0
    old = torch.full((2,), -3.0)
    adv = torch.tensor([1.0, -1.0])
    sym = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert sym[0].item() == pytest.approx(-1.2, rel=1e-6)
    # r = e^2 = 7.389 with A = -1: plain loss 7.389, dual clip c = 3 caps it at 3
    assert sym[1].item() == pytest.approx(math.exp(2.0), rel=1e-6)
    dual = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert dual[1].item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old, adv, dual_clip=0.5)
    with pytest.raises(ValueError, match="same shape"):
        ppo_clip_loss(logp, old[:1], adv)


def test_tis_weights_clamp_and_defaults():
    old = torch.tensor([-1.0, -1.0, -1.0, -5.0])
    samp = torch.tensor([-1.0, -1.5, -0.2, -1.0])   # log ratios 0, 0.5, -0.8, -4
    w = tis_weights(old, samp)
    assert w.tolist() == pytest.approx([1.0, min(math.exp(0.5), 2.0), math.exp(-0.8), math.exp(-4.0)], rel=1e-6)
    w2 = tis_weights(old, torch.tensor([-1.0, -3.0, -0.2, -1.0]), low=0.5, high=1.5)  # log ratio 2 -> 7.39
    assert w2.tolist() == pytest.approx([1.0, 1.5, 0.5, 0.5], rel=1e-6)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="low < high"):
        tis_weights(old, samp, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="shape"):
        tis_weights(old, samp[:2])


def test_icepop_band():
    ratios = torch.tensor([0.45, 0.55, 1.0, 1.9, 2.1, 10.0])
    samp = torch.full((6,), -2.0)
    old = samp + ratios.log()
    w = icepop_weights(old, samp)
    assert w.tolist() == pytest.approx([0.0, 0.55, 1.0, 1.9, 0.0, 0.0], rel=1e-5)
    m = icepop_weights(old, samp, keep_ratio=False)
    assert m.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    wide = icepop_weights(old, samp, low=0.5, high=5.0, keep_ratio=False)
    assert wide.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def _two_sequences():
    # sequence 0: 3 tokens with log ratio 0.3 each; sequence 1: 5 tokens with log ratios
    # [0.0005, -0.0005, 0.0004, 0.0, 0.0001] (mean 0.0001)
    lr = [torch.full((3,), 0.3), torch.tensor([0.0005, -0.0005, 0.0004, 0.0, 0.0001])]
    samp = [torch.full((3,), -1.0), torch.full((5,), -1.0)]
    old = [s + r for s, r in zip(samp, lr)]
    batch = TokenBatch.from_list(old, samp, torch.tensor([1.0, -1.0]))
    return batch, batch.learner_logp.double(), batch.sampler_logp.double()


def test_sequence_is_product_vs_geometric():
    batch, old, samp = _two_sequences()
    prod = sequence_is_product_weights(old, samp, batch, high=10.0)
    geo = sequence_is_geometric_weights(old, samp, batch, high=10.0)
    # product: exp(sum) = exp(0.9) = 2.46; geometric: exp(mean) = exp(0.3) = 1.35
    assert prod[:3].tolist() == pytest.approx([math.exp(0.9)] * 3, rel=1e-5)
    assert geo[:3].tolist() == pytest.approx([math.exp(0.3)] * 3, rel=1e-5)
    assert prod[3:].tolist() == pytest.approx([math.exp(0.0005)] * 5, rel=1e-5)
    assert geo[3:].tolist() == pytest.approx([math.exp(0.0001)] * 5, rel=1e-5)
    # default truncation at 2 hits the product form only
    assert sequence_is_product_weights(old, samp, batch)[:3].tolist() == pytest.approx([2.0] * 3)
    assert sequence_is_geometric_weights(old, samp, batch)[:3].tolist() == pytest.approx([math.exp(0.3)] * 3,
                                                                                         rel=1e-5)
    # (sample_index, S) spelling gives the same
    alt = sequence_is_product_weights(old, samp, (batch.sample_index, batch.num_samples), high=10.0)
    assert torch.equal(alt, prod)


def test_mis_drops_sequence_outside_band():
    batch, old, samp = _two_sequences()
    g = geometric_mean_ratio(old, samp, batch)
    assert g.tolist() == pytest.approx([math.exp(0.3), math.exp(0.0001)], rel=1e-6)
    w = mis_weights(old, samp, batch)                 # band [1/1.001, 1.001]
    assert w.tolist() == [0.0] * 3 + [1.0] * 5
    w = mis_weights(old, samp, batch, high=1.5, low=0.5)
    assert w.tolist() == [1.0] * 8
    w = mis_weights(old, samp, batch, high=1.00005)   # exp(0.0001) = 1.0001 now outside
    assert w.tolist() == [0.0] * 8
    with pytest.raises(ValueError, match="sample_index"):
        mis_weights(old, samp, (batch.sample_index[:3], 2))


def test_mis_band_bounds_sampler_over_learner_like_verl():
    """Asymmetric band [0.7, 1.2] on π_sampler/π_old (verl's convention): sequence 0 has ratio e^−0.3 = 0.741 (kept);
    the inverse convention would see e^0.3 = 1.35 and drop it.  Checked against verl's own rejection mask."""
    batch, old, samp = _two_sequences()
    w = mis_weights(old, samp, batch, high=1.2, low=0.7)
    assert w.tolist() == [1.0] * 8
    assert mis_weights(old, samp, batch, high=1.2, low=0.75).tolist() == [0.0] * 3 + [1.0] * 5
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    lengths = torch.bincount(batch.sample_index).tolist()
    for low, high in ((0.7, 1.2), (0.75, 1.2), (0.5, 0.9)):
        rows = torch.zeros(2, max(lengths)), torch.zeros(2, max(lengths), dtype=torch.bool)
        for s, ratio in enumerate(torch.split(old - samp, lengths)):
            rows[0][s, :len(ratio)], rows[1][s, :len(ratio)] = ratio, True
        mask, _ = helper.compute_rollout_rejection_mask(rows[0], rows[1].float(), rollout_rs="seq_mean_k1",
                                                        rollout_rs_threshold=f"{low}_{high}")
        ours = mis_weights(old, samp, batch, high=high, low=low)
        assert ours.tolist() == mask[rows[1]].tolist(), (low, high)


def test_the_surrogate_registry_is_what_the_loss_dispatches_on(monkeypatch):
    """Both per-token policy losses are registered under one signature; triage_policy_loss(surrogate=name) runs the
    registered function (a test entry registered here is used by it), an unknown name is refused naming the known."""
    from triage_monitor.triage import corrections
    from triage_monitor.batch import TokenBatch
    from triage_monitor.triage.controller import TriageConfig, TriageController
    from triage_monitor.triage.loss import triage_policy_loss

    monkeypatch.setattr(corrections, "_SURROGATES", dict(corrections._SURROGATES))   # the test's entry goes away
    assert list_surrogates() == ["ppo_clip", "dppo_kl"]
    assert get_surrogate("ppo_clip") is ppo_clip_loss and get_surrogate("dppo_kl") is dppo_kl_loss
    with pytest.raises(ValueError, match=r"unknown surrogate 'nope'; known: \['ppo_clip', 'dppo_kl'\]"):
        get_surrogate("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_surrogate("ppo_clip")(lambda *a, **k: None)

    @register_surrogate("_test_linear")
    def linear(learner_logp, old_logp, advantage, scale=1.0):
        return -scale * advantage * learner_logp

    b = TokenBatch.from_flat(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.5]), torch.tensor([1.0, -1.0]),
                             torch.zeros(2, dtype=torch.long), torch.arange(2))
    plain = TriageController(TriageConfig(gate=False, tis=False, repair=False))
    res = triage_policy_loss(plain, b, 0, agg_mode="token_sum", surrogate="_test_linear", surrogate_kwargs={"scale": 2.0})
    assert res.loss.item() == pytest.approx(-2 * (1 * -1.0 + -1 * -2.0))         # −2·(A·lp) summed: −2·(−1 + 2)


def test_dppo_kl_loss_by_hand():
    """prime-rl's default per-token loss on four tokens worked out by hand (probabilities chosen so that the
    trust-region test is on Δp = p − p_anchor: 0.3 > 0.2 masks A > 0, −0.3 < −0.2 masks A < 0 only)."""
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    anchor = torch.tensor([0.2, 0.25, 0.4, 0.4])
    adv = torch.tensor([1.0, 2.0, -1.0, 1.0])
    logp = p.log().requires_grad_()
    loss, (masked, low, high) = dppo_kl_loss(logp, anchor.log(), adv, return_masks=True)
    kl = lambda a, b: 1e-3 * math.log(a / b) ** 2  # noqa: E731
    expected = [kl(0.5, 0.2), -2 * 1.2 + kl(0.3, 0.25), kl(0.1, 0.4), -0.25 + kl(0.1, 0.4)]
    assert torch.allclose(loss, torch.tensor(expected), atol=1e-6)
    assert masked.tolist() == [True, False, True, False]
    assert low.tolist() == [False, False, True, False] and high.tolist() == [True, False, False, False]
    loss.sum().backward()                      # d/dlogp of −A·r = −A·r (kept tokens) plus 2·kl_tau·log r
    assert abs(float(logp.grad[1]) - (-2 * 1.2 + 2e-3 * math.log(1.2))) < 1e-6
    with pytest.raises(ValueError, match="kl_tau"):
        dppo_kl_loss(logp, anchor.log(), adv, kl_tau=-1.0)


def test_reference_kl_by_hand():
    """k1/k2/k3 at π = 0.5, π_ref = 0.25 (x = log 0.5); the score-function weight adds k·∇log π to the
    gradient (k3: 0.1931 + 0.5); the input clamp at 20 and output clamp at 10 bound a huge gap."""
    x = math.log(0.5)
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    for kind, value in (("k1", -x), ("k2", x * x / 2), ("k3", math.exp(x) - 1 - x)):
        assert abs(float(reference_kl(logp, ref, kind).detach()) - value) < 1e-6
    reference_kl(logp, ref, "k3").sum().backward()
    assert abs(float(logp.grad) - (math.exp(x) - 1 - x + 0.5)) < 1e-6
    logp.grad = None
    reference_kl(logp, ref, "k3", score_function=False).sum().backward()
    assert abs(float(logp.grad) - 0.5) < 1e-6
    assert float(reference_kl(torch.tensor([0.0]), torch.tensor([-30.0]))) == 10.0
    with pytest.raises(ValueError, match="kl_type"):
        reference_kl(logp, ref, "k4")


def test_trl_sequence_mask_keeps_the_product_ratio_inside_the_band():
    """TRL's default vLLM correction: sequence 0 has Π r = e^0.9 = 2.46, sequence 1 e^0.0005; both within the
    default (None, 3.0] and kept with their product ratio; a cap of 2 masks sequence 0 to 0."""
    batch, old, samp = _two_sequences()
    w = sequence_mask_weights(old, samp, batch)
    assert w.tolist() == pytest.approx([math.exp(0.9)] * 3 + [math.exp(0.0005)] * 5, rel=1e-5)
    w = sequence_mask_weights(old, samp, batch, high=2.0)
    assert w.tolist() == pytest.approx([0.0] * 3 + [math.exp(0.0005)] * 5, rel=1e-5)
    w = sequence_mask_weights(old, samp, batch, high=None, low=1.001)           # only the lower bound
    assert w.tolist() == pytest.approx([math.exp(0.9)] * 3 + [0.0] * 5, rel=1e-5)
    with pytest.raises(ValueError, match="low=3.0 must be <= high=2.0"):
        sequence_mask_weights(old, samp, batch, high=2.0, low=3.0)


def test_geometric_sequence_mask_keeps_each_tokens_own_ratio_inside_the_band():
    """ms-swift's ``sequence_mask``: sequence 0 has geometric mean e^0.3 = 1.35, sequence 1 e^0.0001; at C = 2 both
    are kept, each token with its own ratio (sequence 1: e^0.0005, e^−0.0005, ...); at C = 1.3 sequence 0 is
    masked to 0; a token log-ratio beyond ±20 is clamped before exp (e^20, as ms-swift's SAFETY_BOUND)."""
    batch, old, samp = _two_sequences()
    own = [0.3] * 3 + [0.0005, -0.0005, 0.0004, 0.0, 0.0001]
    w = geometric_sequence_mask_weights(old, samp, batch)
    assert w.tolist() == pytest.approx([math.exp(x) for x in own], rel=1e-5)
    w = geometric_sequence_mask_weights(old, samp, batch, high=1.3)
    assert w.tolist() == pytest.approx([0.0] * 3 + [math.exp(x) for x in own[3:]], rel=1e-5)
    one = TokenBatch.from_list([torch.tensor([-0.5, -1.0])], [torch.tensor([-30.0, -1.0])], torch.tensor([1.0]))
    w = geometric_sequence_mask_weights(one.learner_logp, one.sampler_logp, one, high=1e9)
    assert w.tolist() == pytest.approx([math.exp(20.0), 1.0], rel=1e-5)
    with pytest.raises(ValueError, match="geometric_sequence_mask_weights"):
        geometric_sequence_mask_weights(old, samp, batch, high=0.0)


def test_sequence_sums_and_counts_cover_every_sequence_even_empty_ones():
    """Three sequences, the last one without a valid token: sums [0.5 − 1, 2, 0] and counts [2, 1, 0] (int64,
    one per sequence); with no token at all, S = 2 zeros of each.  The geometric mean ratio of an empty sequence
    is 1 (log-mean 0)."""
    lr = torch.tensor([0.5, -1.0, 2.0])
    total, count = sequence_log_ratio_sum(lr, (torch.tensor([0, 0, 1]), 3))
    assert total.tolist() == [-0.5, 2.0, 0.0]
    assert count.dtype == torch.int64 and count.tolist() == [2, 1, 0]
    total, count = sequence_log_ratio_sum(torch.zeros(0), (torch.zeros(0, dtype=torch.long), 2))
    assert total.tolist() == [0.0, 0.0]
    assert count.dtype == torch.int64 and count.tolist() == [0, 0]
    g = geometric_mean_ratio(lr, torch.zeros(3), (torch.tensor([0, 0, 1]), 3))
    assert g.tolist() == pytest.approx([math.exp(-0.25), math.exp(2.0), 1.0], rel=1e-6)


def test_geometric_mean_ratio_bounds_the_log_mean_at_20_both_ways():
    """Log-means +30 and −30 (two tokens each) give exp(20) ≈ 4.85e8 and exp(−20) ≈ 2.06e−9; 19.5 is inside the
    bound and gives exp(19.5)."""
    old = torch.tensor([30.0, 30.0, -30.0, -30.0, 19.5])
    g = geometric_mean_ratio(old, torch.zeros(5), (torch.tensor([0, 0, 1, 1, 2]), 3))
    assert g.tolist() == pytest.approx([math.exp(20.0), math.exp(-20.0), math.exp(19.5)], rel=1e-6)


def test_tis_weights_from_a_given_ratio_are_those_it_computes():
    """A ratio handed in (the controller has exp(old − sampler) already) gives the same weights bit for bit as the
    ones tis_weights computes itself, gaps beyond ±88 nats (exp overflow / underflow) included; a ratio of another
    shape is refused naming the three shapes."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(1000, generator=g) * 5
    sampler = -torch.rand(1000, generator=g) * 5
    old[:3] = torch.tensor([-0.0, -200.0, -1e-9])
    sampler[:3] = torch.tensor([-150.0, -0.5, -1e-9])
    raw = torch.exp(old.float() - sampler.float())
    for lo, hi in ((0.0, 2.0), (0.5, 1.5)):
        assert torch.equal(tis_weights(old, sampler, lo, hi, ratio=raw).view(torch.int32),
                           tis_weights(old, sampler, lo, hi).view(torch.int32))
    with pytest.raises(ValueError, match=r"ratio \(999,\), old_logp \(1000,\) and sampler_logp \(1000,\)"):
        tis_weights(old, sampler, ratio=raw[1:])


def test_ppo_clip_loss_equals_the_minimum_form_with_ties_and_dual_clip_ties():
    """The dual clip is computed as one minimum against a +inf cap where A >= 0 (one backward instead of a where
    and a minimum); values and gradients equal the textbook form -min(r·A, clip(r)·A), dual clip min(loss, -c·A)
    for A < 0, torch.minimum's tie rule included:
    r inside the clip range (a tie of the two branches, every such token), r on a clip boundary, A = 0, and a
    token whose loss equals the dual-clip cap exactly (half of its gradient through the cap's minimum)."""
    def textbook(logp, old, adv, lo, hi, c):
        ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
        loss = -torch.min(ratio * adv, ratio.clamp(1.0 - lo, 1.0 + hi) * adv)
        return loss if c is None else torch.where(adv < 0, torch.min(loss, -c * adv), loss)

    g = torch.Generator().manual_seed(0)
    n = 4000
    old = -torch.rand(n, generator=g) * 3
    logp = old + torch.randn(n, generator=g) * 0.4
    logp[:500] = old[:500]                                    # r = 1: both branches tie
    logp[500:600] = old[500:600] + math.log(1.28)             # at the upper boundary
    adv = torch.randn(n, generator=g)
    adv[600:700] = 0.0
    r_tie = float(torch.exp(torch.tensor(2.0)))               # the dual-clip cap equals this token's loss exactly
    logp[700], old[700], adv[700] = 2.0 - 3.0, -3.0, -1.0
    up = torch.randn(n, generator=g)
    for c in (None, 3.0, r_tie):
        got, want = [], []
        for f, out in ((ppo_clip_loss, got), (textbook, want)):
            lp = logp.clone().requires_grad_(True)
            loss = f(lp, old, adv, 0.2, 0.28, c)
            (loss * up).sum().backward()
            out += [loss.detach(), lp.grad]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), c     # == (±0 alike)
    assert float(want[0][700]) == r_tie                       # the tie is real: the cap's minimum split its gradient
    assert float(want[1][700]) == pytest.approx(0.5 * r_tie * float(up[700]), rel=1e-6)
