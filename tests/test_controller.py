"""TRIAGE controller (docs/metrics.md#controller): Gate, Repair, TIS, normalisation, calibration, state.

Expected values are worked by hand (comments) or by plain Python loops over
responses and segments written here, independent of the vectorised code.
"""

import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import (
    CalibrationConfig, TriageConfig, TriageController, pseudo_huber,
)
from triage_monitor.triage.loss import policy_loss_denominator, weighted_policy_loss

GATE_ONLY = dict(repair=False, tis=False)
BETA = math.sqrt(5e-4)


def make_batch(delta, adv, mask=None, sampler=-3.0, requires_grad=False):
    """Padded (B, T) batch with sampler_logp = ``sampler`` and learner_logp = sampler + delta."""
    delta = torch.as_tensor(delta, dtype=torch.float32)
    samp = torch.full_like(delta, sampler)
    learner = (samp + delta).clone().requires_grad_(requires_grad)
    mask = torch.ones_like(delta, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return TokenBatch.from_padded(learner, samp, torch.as_tensor(adv, dtype=torch.float32), mask), learner


# -------------------------------------------------------------- reference
def ref_gate(delta, adv, mask, cfg):
    """Plain-loop Gate (docs/metrics.md#gate) over a padded (B, T) layout; returns a (B, T) list of weights."""
    out = []
    for b in range(len(delta)):
        row = [1.0] * len(delta[b])
        segs = {}
        for t in range(len(delta[b])):
            if mask[b][t]:
                segs.setdefault(t // cfg.gate_width, []).append(t)
        for ts in segs.values():
            seg_adv = sum(adv[b][t] for t in ts) / len(ts)
            seg_delta = sum(delta[b][t] for t in ts) / len(ts)
            k = sum(1 for t in ts if delta[b][t] < cfg.delta_bad)
            if seg_adv >= 0:
                continue
            tier = (cfg.severe_weight if seg_delta < cfg.severe_threshold
                    else cfg.neg_weight if seg_delta < cfg.neg_threshold else 1.0)
            tail = 1.0 - (1.0 - cfg.tail_floor) * min(k / cfg.tail_count, 1.0)
            w = min(tier, tail)
            for t in ts:
                if cfg.gate_scope == "whole" or delta[b][t] < 0:
                    row[t] = w
        out.append(row)
    return out


# ------------------------------------------------------------------- Gate
# W = 4.  Masked positions carry delta = +50 so that they would change every mean if read.
X = 50.0
HAND_DELTA = [
    # A = -1: seg0 mean -0.1 (tier 1, k 0); seg1 mean -0.55 (tier 0.3); seg2 mean +0.5, k = 1 (tail 0.55)
    [-0.2, -0.2, 0.1, -0.1, -0.8, -0.8, -0.8, 0.2, -7.0, 3.0, 3.0, 3.0, X, X],
    # A = -1: seg0 mean -1, k = 2 (min(0.3, 0.1)); seg1 mean -1.75 (severe 0.1);
    #         seg2 positions 8, 9 masked, mean of [-0.6, -0.6] = -0.6 (0.3); seg3 short, mean -1.6 (0.1)
    [-7.0, -7.0, 3.0, 3.0, -2.0, -2.0, -2.0, -1.0, X, X, -0.6, -0.6, -1.6, -1.6],
    # A = +1: never eligible
    [-7.0] * 14,
]
HAND_MASK = [[1] * 12 + [0, 0], [1] * 8 + [0, 0] + [1] * 4, [1] * 14]
HAND_ADV = [-1.0, -1.0, 1.0]
HAND_Q3 = [
    [1, 1, 1, 1, .3, .3, .3, 1, .55, 1, 1, 1, 1, 1],
    [.1, .1, 1, 1, .1, .1, .1, .1, 1, 1, .3, .3, .1, .1],
    [1] * 14,
]
HAND_WHOLE = [
    [1, 1, 1, 1, .3, .3, .3, .3, .55, .55, .55, .55, 1, 1],
    [.1, .1, .1, .1, .1, .1, .1, .1, 1, 1, .3, .3, .1, .1],
    [1] * 14,
]


@pytest.mark.parametrize("scope,expected", [("q3", HAND_Q3), ("whole", HAND_WHOLE)])
def test_gate_hand_worked_tiers_tails_masks_short_segment(scope, expected):
    batch, _ = make_batch(HAND_DELTA, HAND_ADV, HAND_MASK)
    out = TriageController(TriageConfig(gate_width=4, gate_scope=scope, **GATE_ONLY))(batch, step=0)
    got = batch.scatter(out.gate_weights, fill=1.0)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float32), atol=1e-6), got
    assert out.gate_weights.dtype == torch.float32 and not out.gate_weights.requires_grad
    assert torch.equal(out.token_weights, out.gate_weights)          # TIS off
    valid = batch.scatter(torch.ones(batch.num_tokens), fill=0.0).bool()
    exp_valid = torch.tensor(expected)[valid]
    assert out.stats["gate_weight_mean"] == pytest.approx(exp_valid.mean().item(), rel=1e-6)
    assert out.stats["gate_downweighted_frac"] == pytest.approx((exp_valid < 1).float().mean().item())


def test_gate_boundaries_are_strict():
    # seg mean exactly -0.5 / -1.5 is not below the threshold; delta exactly -6 is not a tail token
    delta = [[-0.5, -0.5, -1.5, -1.5, -6.0, 3.0, -1.0, 0.0, -3.0]]
    batch, _ = make_batch(delta, [-1.0], sampler=-8.0)
    out = TriageController(TriageConfig(gate_width=2, **GATE_ONLY))(batch, step=0)
    # seg0 mean -0.5 -> 1; seg1 mean -1.5 -> 0.3 (not severe); seg2 mean -1.5 -> 0.3, k = 0, and
    # its delta = +3 token is outside the q3 scope; seg3 mean (-1 + 0)/2 = -0.5 -> 1;
    # seg4 (short) mean -3 -> 0.1
    assert out.gate_weights.tolist() == pytest.approx([1, 1, .3, .3, .3, 1, 1, 1, .1])
    # q3 applies only to delta < 0 strictly: a delta = 0 token of a down-weighted segment keeps 1
    batch, _ = make_batch([[-2.0, 0.0]], [-1.0])
    out = TriageController(TriageConfig(gate_width=2, **GATE_ONLY))(batch, step=0)
    assert out.gate_weights.tolist() == pytest.approx([0.3, 1.0])


def test_gate_eligibility_uses_segment_mean_advantage():
    # per-token advantages: seg0 mean (−1 −1 +3 +0)/4 = +0.25 -> untouched; seg1 mean −1 -> severe 0.1;
    # seg2 mean (−1 +1 −2 +2)/4 = 0 exactly -> not eligible (seg_adv < 0 is strict)
    delta = [[-2.0] * 12]
    adv = [[-1.0, -1.0, 3.0, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -2.0, 2.0]]
    batch, _ = make_batch(delta, adv)
    out = TriageController(TriageConfig(gate_width=4, **GATE_ONLY))(batch, step=0)
    assert out.gate_weights.tolist() == pytest.approx([1] * 4 + [0.1] * 4 + [1] * 4)


@pytest.mark.parametrize("scope,width,tail_count,tail_floor", [("q3", 7, 2, 0.1), ("whole", 5, 3, 0.25),
                                                                ("q3", 64, 1, 0.0)])
def test_gate_matches_loop_reference_random(scope, width, tail_count, tail_floor):
    g = torch.Generator().manual_seed(width)
    B, T = 12, 150
    delta = (torch.randn(B, T, generator=g) * 1.5 - 0.6).clamp(max=2.9)
    delta[torch.rand(B, T, generator=g) < 0.05] = -8.0
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.85
    mask[3] = False                                            # a response with no valid token
    mask[4, 40:] = False
    cfg = TriageConfig(gate_width=width, gate_scope=scope, tail_count=tail_count, tail_floor=tail_floor,
                       neg_threshold=-0.4, severe_threshold=-1.0, neg_weight=0.5, severe_weight=0.2, **GATE_ONLY)
    batch, _ = make_batch(delta, adv, mask)
    got = batch.scatter(TriageController(cfg)(batch, step=0).gate_weights, fill=1.0)
    adv_bt = adv[:, None].expand(B, T).tolist()
    expected = ref_gate(delta.tolist(), adv_bt, mask.tolist(), cfg)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float32), atol=1e-6)
    assert (got < 1).any()                                     # the case exercises down-weighting


def test_gate_off_and_empty_batch():
    batch, _ = make_batch(HAND_DELTA, HAND_ADV, HAND_MASK)
    out = TriageController(TriageConfig(gate=False, **GATE_ONLY))(batch, step=0)
    assert torch.equal(out.gate_weights, torch.ones(batch.num_tokens))
    assert out.stats["gate_downweighted_frac"] == 0.0
    empty, _ = make_batch([[0.0, 0.0]], [1.0], [[0, 0]])
    out = TriageController(TriageConfig())(empty, step=0)
    assert out.gate_weights.shape == (0,) and out.repair_loss.item() == 0.0
    assert math.isnan(out.stats["gate_weight_mean"])


# ------------------------------------------------------------------- TIS
def test_tis_weights_and_clip_fraction():
    batch, _ = make_batch([[0.0, 0.0, 0.0, 0.0]], [1.0])
    old = batch.sampler_logp + torch.tensor([0.0, 1.0, -1.0, -30.0])   # ratios 1, e, 1/e, ~0
    cfg = TriageConfig(gate=False, repair=False, tis_clip=(0.5, 2.0))
    out = TriageController(cfg)(batch, step=0, old_logp=old)
    assert out.tis_weights.tolist() == pytest.approx([1.0, 2.0, 0.5, 0.5], rel=1e-6)
    assert out.stats["tis_clip_frac"] == pytest.approx(0.75)
    # default old_logp = learner_logp (delta = 0 here): all ones, nothing clipped
    out = TriageController(cfg)(batch, step=0)
    assert out.tis_weights.tolist() == [1.0] * 4 and out.stats["tis_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="old_logp has shape"):
        TriageController(cfg)(batch, step=0, old_logp=old[:2])


def test_token_weights_are_gate_times_tis():
    batch, _ = make_batch(HAND_DELTA, HAND_ADV, HAND_MASK)
    old = batch.sampler_logp + 0.3 * torch.sin(torch.arange(batch.num_tokens, dtype=torch.float32))
    out = TriageController(TriageConfig(gate_width=4, repair=False))(batch, step=0, old_logp=old)
    assert torch.allclose(out.token_weights, out.gate_weights * torch.exp(old - batch.sampler_logp).clamp(0, 2))


# ---------------------------------------------------------------- Repair
def phi(q, beta=BETA):
    return beta * beta * (math.sqrt(1.0 + (q / beta) ** 2) - 1.0)


def test_repair_penalty_value_hand_worked():
    # one segment, d_S = -0.1: q = -0.03 + 0.1 = 0.07; (q/beta)^2 = 0.0049 / 0.0005 = 9.8
    batch, _ = make_batch([[-0.1] * 4], [1.0], requires_grad=True)
    out = TriageController(TriageConfig(gate=False, tis=False))(batch, step=0)
    expected = 0.015 * 5e-4 * (math.sqrt(10.8) - 1.0)
    assert out.repair_loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.stats["repair_loss"] == pytest.approx(expected, rel=1e-5)
    assert out.stats["repair_active_frac"] == 1.0
    assert out.repair_loss.requires_grad and out.repair_loss.dim() == 0


def test_repair_gradient_bounded_by_beta():
    # 5 segments of width 8 (all A > 0), shortfalls from tiny to huge
    d_s = [-0.02, -0.05, -0.3, -3.0, -20.0]
    delta = [[d] * 8 for d in d_s] + [[0.5] * 3]     # last response: d_S above tau, q = 0
    delta = [row + [0.0] * (8 - len(row)) for row in delta]
    mask = [[1] * 8] * 5 + [[1] * 3 + [0] * 5]
    batch, learner = make_batch(delta, [1.0] * 6, mask, sampler=-25.0, requires_grad=True)
    cfg = TriageConfig(gate=False, tis=False, repair_width=8)
    out = TriageController(cfg)(batch, step=0)
    out.repair_loss.backward()
    n_seg = 6
    # d loss / d d_S = -coef * phi'(q) / n_seg, phi'(q) = q / sqrt(1 + (q/beta)^2) < beta;
    # d d_S / d learner_t = 1 / count_S, so per segment d loss / d d_S = grad_t * count_S.
    seg_grad = learner.grad[:, 0] * torch.tensor([8.0] * 5 + [3.0])
    bound = 0.015 * BETA / n_seg
    for i, d in enumerate(d_s + [0.5]):
        q = max(-0.03 - d, 0.0)
        assert seg_grad[i].item() == pytest.approx(-0.015 * q / math.sqrt(1 + (q / BETA) ** 2) / n_seg, rel=1e-4,
                                                   abs=1e-12)
        assert abs(seg_grad[i].item()) <= bound * (1 + 1e-6)
    assert abs(seg_grad[4].item()) > 0.99 * bound                # huge shortfall: slope saturates at beta
    assert seg_grad[5].item() == 0.0
    expected = 0.015 * sum(phi(max(-0.03 - d, 0.0)) for d in d_s) / n_seg
    assert out.repair_loss.item() == pytest.approx(expected, rel=1e-4)
    # active: q > 0 for d_S in {-0.05, -0.3, -3, -20}; -0.02 and +0.5 sit above tau = -0.03
    assert out.stats["repair_active_frac"] == pytest.approx(4 / 6)


def _scope_batch():
    # response 0 (A = +1): one segment, delta [-0.4, -0.4, +0.2, +0.2] -> d_S = -0.1
    # response 1 (A = -1): one segment, delta [-0.5] * 4 -> d_S = -0.5
    return make_batch([[-0.4, -0.4, 0.2, 0.2], [-0.5] * 4], [1.0, -1.0], requires_grad=True)


@pytest.mark.parametrize("scope", ["adv_positive", "q2", "whole"])
def test_repair_scopes(scope):
    batch, learner = _scope_batch()
    out = TriageController(TriageConfig(gate=False, tis=False, repair_width=4, repair_scope=scope))(batch, step=0)
    out.repair_loss.backward()
    g = learner.grad
    p0, p1 = phi(0.07), phi(0.47)               # q = tau - d_S; the value of d_S never depends on the scope
    if scope == "whole":
        assert out.repair_loss.item() == pytest.approx(0.015 * (p0 + p1) / 2, rel=1e-5)
        assert (g != 0).all()
    else:
        # valid repair segments = the A > 0 one only
        assert out.repair_loss.item() == pytest.approx(0.015 * p0, rel=1e-5)
        assert (g[1] == 0).all()                 # A < 0 segment: no gradient
        if scope == "adv_positive":
            assert (g[0] != 0).all()
        else:                                    # q2: only the delta < 0 tokens of the segment
            assert (g[0, :2] != 0).all() and (g[0, 2:] == 0).all()
    q = 0.07
    per_token = -0.015 * q / math.sqrt(1 + (q / BETA) ** 2) / (2 if scope == "whole" else 1) / 4
    assert g[0, 0].item() == pytest.approx(per_token, rel=1e-4)


def test_repair_coefficient_start_step_and_switch():
    batch, _ = _scope_batch()
    base = TriageConfig(gate=False, tis=False, repair_width=4)
    l1 = TriageController(base)(batch, step=0).repair_loss.item()
    l2 = TriageController(TriageConfig(gate=False, tis=False, repair_width=4, repair_coef=0.03))(
        batch, step=0).repair_loss.item()
    assert l1 > 0 and l2 == pytest.approx(2 * l1, rel=1e-6)
    late = TriageController(TriageConfig(gate=False, tis=False, repair_width=4, repair_start_step=10))
    out = late(batch, step=9)
    assert out.repair_loss.item() == 0.0 and out.stats["repair_active_frac"] == 0.0
    out.repair_loss.backward()                   # still part of the graph
    assert late(batch, step=10).repair_loss.item() == pytest.approx(l1, rel=1e-6)
    off = TriageController(TriageConfig(gate=False, tis=False, repair=False))(batch, step=0)
    assert off.repair_loss.item() == 0.0


@pytest.mark.parametrize("scope", ["adv_positive", "whole"])
def test_repair_micro_batches_sum_to_full_batch(scope):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 50
    delta = torch.randn(B, T, generator=g) * 0.3 - 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.0])
    mask = torch.rand(B, T, generator=g) < 0.9
    _, learner = make_batch(delta, adv, mask, requires_grad=True)
    samp = torch.full((B, T), -3.0)
    ctrl = TriageController(TriageConfig(gate=False, tis=False, repair_width=16, repair_scope=scope))
    full = TokenBatch.from_padded(learner, samp, adv, mask)
    ref = ctrl(full, step=0).repair_loss
    (g_ref,) = torch.autograd.grad(ref, learner)
    den = ctrl.repair_segment_count(full)
    # independent count: segments (response, position // 16) with >= 1 valid token and, unless
    # "whole", mean advantage > 0 (here advantage is per response)
    n_seg = sum(len({t // 16 for t in range(T) if mask[b, t]}) for b in range(B) if scope == "whole" or adv[b] > 0)
    assert den.item() == n_seg
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        mb = TokenBatch.from_padded(learner[rows], samp[rows], adv[rows], mask[rows])
        total = total + ctrl(mb, step=0, repair_denominator=den).repair_loss
    (g_tot,) = torch.autograd.grad(total, learner)
    assert ref.item() > 0 and total.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(g_tot, g_ref, atol=1e-10)


# ---------------------------------------------------------- normalisation
def _random_padded(seed, B=6, T=40):
    g = torch.Generator().manual_seed(seed)
    learner = -torch.rand(B, T, generator=g) * 3
    samp = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[2] = False                              # no valid token: not a response of the mean
    loss = torch.randn(B, T, generator=g)
    w = torch.rand(B, T, generator=g)
    w[4] = 0.0                                   # weight sum 0: contributes 0, still counted
    return learner, samp, adv, mask, loss, w


def test_per_response_is_mean_of_weighted_means():
    learner, samp, adv, mask, loss, w = _random_padded(1)
    batch = TokenBatch.from_padded(learner, samp, adv, mask)
    flat_l, flat_w = loss[mask], w[mask]
    got = weighted_policy_loss(flat_l, flat_w, batch, "per_response")
    means = []
    for b in range(6):
        m = mask[b]
        if m.sum() == 0:
            continue
        den = (w[b][m]).sum().item()
        means.append((w[b][m] * loss[b][m]).sum().item() / den if den > 0 else 0.0)
    assert len(means) == 5
    assert got.item() == pytest.approx(sum(means) / len(means), rel=1e-5)
    glob = weighted_policy_loss(flat_l, flat_w, batch, "global_token")
    assert glob.item() == pytest.approx((flat_w * flat_l).sum().item() / flat_w.sum().item(), rel=1e-5)
    zero = weighted_policy_loss(flat_l, torch.zeros_like(flat_w), batch, "global_token")
    assert zero.item() == 0.0


@pytest.mark.parametrize("normalization", ["global_token", "per_response"])
@pytest.mark.parametrize("splits", [[6], [3, 3], [1, 2, 3], [1] * 6])
def test_micro_batches_sum_to_full_batch(normalization, splits):
    learner, samp, adv, mask, loss, w = _random_padded(2)
    learner = learner.clone().requires_grad_(True)
    full = TokenBatch.from_padded(learner, samp, adv, mask)
    per_tok = loss * learner                      # differentiable per-token loss
    ref = weighted_policy_loss(per_tok[mask], w[mask], full, normalization)
    (g_ref,) = torch.autograd.grad(ref, learner, retain_graph=True)
    den = policy_loss_denominator(w[mask], full, normalization)
    total, start = 0.0, 0
    parts = []
    for n in splits:
        rows = slice(start, start + n)
        start += n
        mb = TokenBatch.from_padded(learner[rows], samp[rows], adv[rows], mask[rows])
        parts.append(policy_loss_denominator(w[rows][mask[rows]], mb, normalization))
        total = total + weighted_policy_loss(per_tok[rows][mask[rows]], w[rows][mask[rows]], mb, normalization,
                                             global_denominator=den)
    (g_tot,) = torch.autograd.grad(total, learner)
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(g_tot, g_ref, atol=1e-7)
    assert sum(p.item() for p in parts) == pytest.approx(den.item(), rel=1e-6)


def test_normalization_errors():
    learner, samp, adv, mask, loss, w = _random_padded(3)
    batch = TokenBatch.from_padded(learner, samp, adv, mask)
    with pytest.raises(ValueError, match="normalization"):
        weighted_policy_loss(loss[mask], w[mask], batch, "per_token")
    with pytest.raises(ValueError, match="token_weights has shape"):
        weighted_policy_loss(loss[mask], w[mask][:3], batch)


# ------------------------------------------------------------ distributed
def _dist_worker(rank, world, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        learner, samp, adv, mask, loss, w = _random_padded(5)
        rows = [slice(0, 2), slice(2, 6)][rank]   # uneven split
        lr = learner[rows].clone().requires_grad_(True)
        b = TokenBatch.from_padded(lr, samp[rows], adv[rows], mask[rows])
        ctrl = TriageController(TriageConfig(gate=False, tis=False, repair_width=8, repair_scope="whole"),
                                group=dist.group.WORLD)
        out = ctrl(b, step=0)
        lp = loss[rows].clone().requires_grad_(True)
        pg = weighted_policy_loss(lp[mask[rows]], w[rows][mask[rows]], b, "global_token", group=dist.group.WORLD)
        (grad,) = torch.autograd.grad(out.repair_loss, lr)
        (pg_grad,) = torch.autograd.grad(pg, lp)
        torch.save({"repair": out.repair_loss.item(), "pg": pg.item(), "grad": grad, "pg_grad": pg_grad,
                    "active": out.stats["repair_active_frac"]}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_distributed_reduction_matches_single_process(plain_main):
    learner, samp, adv, mask, loss, w = _random_padded(5)
    lr = learner.clone().requires_grad_(True)
    full = TokenBatch.from_padded(lr, samp, adv, mask)
    out = TriageController(TriageConfig(gate=False, tis=False, repair_width=8, repair_scope="whole"))(full, step=0)
    (g_full,) = torch.autograd.grad(out.repair_loss, lr)
    lp = loss.clone().requires_grad_(True)
    pg = weighted_policy_loss(lp[mask], w[mask], full, "global_token")
    (pg_grad,) = torch.autograd.grad(pg, lp)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dist_worker, args=(2, os.path.join(d, "init"), os.path.join(d, "res")), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f"res.{r}")) for r in range(2)]
    for r in res:                                 # every rank reports the global value
        assert r["repair"] == pytest.approx(out.repair_loss.item(), rel=1e-5)
        assert r["pg"] == pytest.approx(pg.item(), rel=1e-5)
        assert r["active"] == pytest.approx(out.stats["repair_active_frac"], rel=1e-6)
    # each rank's gradient is the global loss's gradient w.r.t. its own tokens
    assert torch.allclose(torch.cat([res[0]["grad"], res[1]["grad"]]), g_full, atol=1e-9)
    assert torch.allclose(torch.cat([res[0]["pg_grad"], res[1]["pg_grad"]]), pg_grad, atol=1e-7)
    assert g_full.abs().max() > 1e-7 and pg_grad.abs().max() > 1e-3
    assert out.repair_loss.item() > 0


# ------------------------------------------------- calibration and state
def _step_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    B, T = 8, 96
    delta = (torch.randn(B, T, generator=g) * 0.8 - 0.3).clamp(max=2.5)
    delta[torch.rand(B, T, generator=g) < 0.03] -= 7.0
    mask = torch.rand(B, T, generator=g) < 0.9
    batch, _ = make_batch(delta, torch.randn(B, generator=g), mask, sampler=-5.0)
    return batch


def test_calibration_quantiles_from_reference_window():
    cal = CalibrationConfig(window=2, neg_quantile=0.2, severe_quantile=0.05, bad_quantile=0.01)
    ctrl = TriageController(TriageConfig(gate_width=16, repair=False, tis=False, calibration=cal))
    seg_means, toks = [], []
    for step in (0, 1):
        b = _step_batch(step)
        ctrl(b, step=step)
        assert ctrl.thresholds is None            # fixed thresholds during the window
        # independent segment means: loop over (sample, position // 16)
        d = b.delta.tolist()
        groups = {}
        for i in range(b.num_tokens):
            groups.setdefault((int(b.sample_index[i]), int(b.position[i]) // 16), []).append(d[i])
        seg_means += [sum(v) / len(v) for _, v in sorted(groups.items())]
        toks += d
    ctrl(b, step=1)                               # a second micro-batch of step 1 still belongs to the window
    seg_means += seg_means[-len(groups):]
    toks += d
    ctrl(_step_batch(2), step=2)
    th = ctrl.thresholds
    # read from the reference window's quantile sketch: exact up to the sketch's stated bound
    from triage_monitor.metrics.sketch import quantile_error_bound
    sm, tk = np.sort(np.asarray(seg_means, dtype=np.float64)), np.sort(np.asarray(toks, dtype=np.float64))
    for got, vals, q in ((th["neg_threshold"], sm, 0.2), (th["severe_threshold"], sm, 0.05),
                         (th["delta_bad"], tk, 0.01)):
        assert abs(got - float(np.quantile(vals, q))) <= quantile_error_bound(vals, q) + 1e-7, (q, got)
    assert ctrl.effective_thresholds() == th


def test_state_dict_round_trip_continues_identically(tmp_path):
    cfg = TriageConfig(gate_width=16, repair_width=32, calibration={"window": 3, "neg_quantile": 0.1,
                                                                    "severe_quantile": 0.02})
    a = TriageController(cfg)
    for step in range(2):
        a(_step_batch(step), step=step)
    torch.save(a.state_dict(), tmp_path / "mid_window.pt")        # inside the reference window
    b = TriageController(cfg)
    b.load_state_dict(torch.load(tmp_path / "mid_window.pt"))
    fresh = TriageController(cfg)
    c = None
    for step in range(2, 8):
        if step == 5:                                              # after calibration
            torch.save(a.state_dict(), tmp_path / "calibrated.pt")
            c = TriageController(cfg)
            c.load_state_dict(torch.load(tmp_path / "calibrated.pt"))
        oa = a(_step_batch(step), step=step)
        for other in (b, c):
            if other is None:
                continue
            ob = other(_step_batch(step), step=step)
            assert torch.equal(oa.gate_weights, ob.gate_weights) and torch.equal(oa.token_weights, ob.token_weights)
            assert oa.repair_loss.item() == ob.repair_loss.item() and oa.stats == ob.stats
        fresh(_step_batch(step), step=step)
    assert a.thresholds is not None and a.thresholds == b.thresholds == c.thresholds
    assert a.calls == b.calls == c.calls == 8 and c.last_step == 7
    # a controller that missed the first steps calibrates on other data: the state mattered
    assert fresh.thresholds != a.thresholds
    with pytest.raises(ValueError, match="state version"):
        b.load_state_dict({"version": 99})


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("kw,match", [
    (dict(severe_weight=0.5, neg_weight=0.3), "severe_weight <= neg_weight"),
    (dict(severe_weight=0.0), "0 < severe_weight"),
    (dict(neg_weight=1.5), "neg_weight <= 1"),
    (dict(gate_width=0), "gate_width"),
    (dict(repair_width=-4), "repair_width"),
    (dict(tail_count=0), "tail_count"),
    (dict(severe_threshold=-0.5, neg_threshold=-1.5), "severe_threshold < neg_threshold"),
    (dict(gate_scope="q4"), "gate_scope"),
    (dict(repair_scope="neg"), "repair_scope"),
    (dict(normalization="token"), "normalization"),
    (dict(tis_clip=(2.0, 1.0)), "tis_clip"),
    (dict(repair_beta=0.0), "repair_beta"),
    (dict(repair_coef=-1.0), "repair_coef"),
    (dict(tail_floor=1.5), "tail_floor"),
    (dict(repair_start_step=-1), "repair_start_step"),
    (dict(delta_bad=float("nan")), "delta_bad"),
    (dict(calibration={"severe_quantile": 0.2, "neg_quantile": 0.1}), "severe_quantile < neg_quantile"),
    (dict(calibration="yes"), "calibration"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TriageConfig(**kw)


def test_default_config_is_published_one():
    c = TriageConfig()
    assert (c.gate_width, c.neg_threshold, c.severe_threshold, c.neg_weight, c.severe_weight, c.delta_bad) == (
        64, -0.5, -1.5, 0.3, 0.1, -6.0)
    assert (c.repair_width, c.repair_tau, c.repair_coef, c.tis_clip) == (128, -0.03, 0.015, (0.0, 2.0))
    assert c.repair_beta == pytest.approx(0.02236, abs=1e-5)
    assert pseudo_huber(torch.tensor(0.0), c.repair_beta).item() == 0.0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_stay_on_device_and_dtype_follows_caller(device, dtype):
    # delta = 0 or -0.25 exactly (representable in bf16): gate weights and repair identical across dtypes
    delta = torch.tensor([[-0.25, 0.0] * 40, [-2.0, -1.0] * 40])
    learner = (delta - 2.0).to(device=device, dtype=dtype).requires_grad_(True)
    samp = torch.full_like(learner, -2.0).detach()
    b = TokenBatch.from_padded(learner, samp, torch.tensor([1.0, -1.0], device=device),
                               torch.ones(2, 80, dtype=torch.bool, device=device))
    out = TriageController(TriageConfig(gate_width=8, repair_width=16))(b, step=0)
    for t in (out.gate_weights, out.tis_weights, out.token_weights, out.repair_loss):
        assert t.device.type == device
    assert out.gate_weights.dtype == torch.float32
    pg = weighted_policy_loss(torch.ones(b.num_tokens, device=device), out.token_weights, b)
    (pg + out.repair_loss).backward()
    assert learner.grad.dtype == dtype and learner.grad[0].abs().sum() > 0   # repair pulls response 0 up
    # response 1: mean delta -1.5 per segment -> 0.3 (not < -1.5) on its delta < 0 tokens
    assert out.gate_weights[80:].cpu().tolist() == pytest.approx([0.3] * 80)
    # response 0: d_S = -0.125 -> q = 0.095 in each of its 5 segments
    q = 0.095
    assert out.repair_loss.item() == pytest.approx(0.015 * phi(q), rel=1e-4)


def test_calibration_config_errors_name_the_rule():
    with pytest.raises(ValueError, match=r"CalibrationConfig needs 0 < severe_quantile < neg_quantile < 1, got "
                                         r"severe_quantile=0.3, neg_quantile=0.2"):
        CalibrationConfig(neg_quantile=0.2, severe_quantile=0.3)


def test_a_loaded_controller_resumes_at_the_saved_step():
    a = TriageController(TriageConfig(repair_width=8))
    for step in range(3):
        a(_step_batch(step), step=step)
    b = TriageController(TriageConfig(repair_width=8))
    b.load_state_dict(a.state_dict())
    assert b.last_step == 2 and b.calls == 3


def _segment_count_rank(rank, world, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ctrl = TriageController(TriageConfig(repair_width=4, repair_scope="whole"), group=dist.group.WORLD)
        b = _list_batch_of_lengths([5, 4] if rank == 0 else [9])
        torch.save(ctrl.repair_segment_count(b), f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def _list_batch_of_lengths(lengths):
    """Responses of the given lengths, δ = 0, A = −1."""
    lp = [torch.full((n,), -1.0) for n in lengths]
    return TokenBatch.from_list(lp, [x.clone() for x in lp], torch.full((len(lengths),), -1.0))


def test_repair_segment_count_is_summed_over_the_group(tmp_path, plain_main):
    """W = 4: responses of 5 and 4 tokens on rank 0 (2 + 1 segments), 9 tokens on rank 1 (3): every rank's
    repair denominator is 6.  In one process with a one-rank group: rank 0's own 3."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        ctrl = TriageController(TriageConfig(repair_width=4, repair_scope="whole"), group=dist.group.WORLD)
        assert ctrl.repair_segment_count(_list_batch_of_lengths([5, 4])).item() == 3
    finally:
        dist.destroy_process_group()
    mp.spawn(_segment_count_rank, args=(2, str(tmp_path / "rdv"), str(tmp_path / "count")), nprocs=2, join=True)
    assert [torch.load(tmp_path / f"count.{r}").item() for r in range(2)] == [6, 6]


# ------------------------------------------- dtypes and a one-rank group
def _repair_case(requires_grad=False):
    """Two responses of 4 tokens, A = +1 (both in the adv_positive scope), one repair segment each (W_rep = 128).

    Response 0: δ = −0.25 on every token → d_S = −0.25, q = τ − d_S = −0.03 + 0.25 = 0.22, φ(0.22) > 0 (active);
    response 1: δ = 0 → q = max(−0.03, 0) = 0, φ = 0 (in scope, not active).  Σφ over 2 in-scope segments:
    repair = 0.015 · φ(0.22) / 2, active fraction 1 / 2.  Gradient of repair w.r.t. a response-0 learner log-prob:
    0.015 / 2 · φ'(q) · (−1/4), φ'(q) = q / sqrt(1 + q²/β²); response 1: 0 (q clamped at 0)."""
    learner = [torch.full((4,), v).requires_grad_(requires_grad) for v in (-8.25, -8.0)]
    batch = TokenBatch.from_list(learner, [torch.full((4,), -8.0)] * 2, torch.tensor([1.0, 1.0]))
    q = 0.22
    phi_q = BETA ** 2 * (math.sqrt(1.0 + q * q / BETA ** 2) - 1.0)
    grad0 = 0.015 / 2 * (q / math.sqrt(1.0 + q * q / BETA ** 2)) * -0.25
    return batch, learner, 0.015 * phi_q / 2, grad0


def test_outputs_are_float32_under_a_float64_default_dtype_and_a_float64_denominator():
    """The documented float32 weights and 0-dim float32 repair loss hold when the user's default dtype is float64
    (Gate and TIS off: the weights are the controller's own ones) and when the repair denominator comes as a float64
    tensor (e.g. a count summed in numpy): 0.015 · φ(0.22) / 4 with a denominator of 4 (see _repair_case)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        batch, _, repair, _ = _repair_case()
        out = TriageController(TriageConfig(gate=False, tis=False))(batch, step=0)
    finally:
        torch.set_default_dtype(old)
    for t in (out.gate_weights, out.tis_weights, out.token_weights, out.repair_loss):
        assert t.dtype == torch.float32
    assert out.gate_weights.tolist() == [1.0] * 8 and out.token_weights.tolist() == [1.0] * 8
    assert out.repair_loss.item() == pytest.approx(repair, rel=1e-5)
    batch, _, repair, _ = _repair_case()
    out = TriageController(TriageConfig(gate=False, tis=False))(
        batch, step=0, repair_denominator=torch.tensor(4.0, dtype=torch.float64))
    assert out.repair_loss.dtype == torch.float32
    assert out.repair_loss.item() == pytest.approx(repair / 2, rel=1e-5)
    assert out.stats["repair_active_frac"] == 0.25                   # 1 active segment / 4


def test_a_one_rank_group_gives_the_single_process_loss_gradient_and_stats(tmp_path):
    """With torch.distributed initialised on one rank and ``group=WORLD`` (a one-GPU job that passes its group),
    the all-reduced sums are this rank's own: the repair loss, its gradient and the active fraction are the
    hand-worked single-process values of _repair_case."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        batch, learner, repair, grad0 = _repair_case(requires_grad=True)
        out = TriageController(TriageConfig(gate=False, tis=False), group=dist.group.WORLD)(batch, step=0)
        g0, g1 = torch.autograd.grad(out.repair_loss, learner)
    finally:
        dist.destroy_process_group()
    assert out.repair_loss.item() == pytest.approx(repair, rel=1e-5)
    assert out.stats["repair_loss"] == pytest.approx(repair, rel=1e-5)
    assert out.stats["repair_active_frac"] == 0.5
    assert g0.tolist() == pytest.approx([grad0] * 4, rel=1e-4) and g1.tolist() == [0.0] * 4


def test_a_fresh_controller_reports_no_call_and_its_state_resets_a_used_one():
    """Before any call: calls 0, last_step None (no step seen), no calibrated thresholds, in the state dict too;
    loading that state into a controller that has run 3 steps resets it to the same."""
    fresh = TriageController(TriageConfig(repair_width=8))
    assert (fresh.calls, fresh.last_step, fresh.thresholds) == (0, None, None)
    state = fresh.state_dict()
    assert (state["calls"], state["last_step"], state["thresholds"]) == (0, None, None)
    used = TriageController(TriageConfig(repair_width=8))
    for step in range(3):
        used(_step_batch(step), step=step)
    used.load_state_dict(state)
    assert (used.calls, used.last_step, used.thresholds) == (0, None, None)
