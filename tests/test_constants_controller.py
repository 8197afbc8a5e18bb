"""The controller's constants (docs/metrics.md#controller) pinned by values worked out by hand.

Every test runs ``TriageController()`` / ``TriageConfig()`` with its **defaults** and compares it with numbers
typed in from docs/metrics.md: W_gate = 64, tiers −0.5 → 0.3 and −1.5 → 0.1 on the segment mean δ, δ_bad = −6,
tail weight 1 − 0.9·min(k/2, 1), scope q3; W_rep = 128, τ = −0.03, β = sqrt(0.0005), coefficient 0.015, scope
adv_positive (segments with mean A **> 0**); TIS clip [0, 2].  δ values are exact in float32 where a comparison
sits on the line (−0.5, −1.5, −6.0).  docs/testing.md lists which test pins which constant.
"""

import math

import numpy as np
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig, TriageController

SAMPLER = -8.0          # δ values below are multiples of 2⁻⁸ or exact binary fractions: learner − sampler is exact
BETA2 = 0.0005
TAU = -0.03
COEF = 0.015


def _batch(deltas, advs, requires_grad=False):
    samp = [torch.full((len(d),), SAMPLER) for d in deltas]
    learner = [(torch.tensor(d, dtype=torch.float32) + SAMPLER).requires_grad_(requires_grad) for d in deltas]
    return TokenBatch.from_list(learner, samp, torch.tensor(advs, dtype=torch.float32)), learner


def _gate(deltas, advs):
    batch, _ = _batch(deltas, advs)
    out = TriageController(TriageConfig(repair=False, tis=False))(batch, step=0)
    return torch.split(out.gate_weights, [len(d) for d in deltas])


def phi(q):
    """φ(q) = β²(sqrt(1 + q²/β²) − 1), β² = 0.0005, written out."""
    return BETA2 * (math.sqrt(1.0 + q * q / BETA2) - 1.0)


# ------------------------------------------------------------------------------------------------ gate
GATE_CASES = [
    # (δ of one A<0 response shorter than 64 tokens, expected weight per token)   reason
    ([-0.5] * 4, [1.0] * 4),                       # mean −0.5 is not < −0.5: tier 1
    ([-0.75] * 4, [0.3] * 4),                      # mean −0.75 < −0.5: 0.3
    ([-1.5] * 4, [0.3] * 4),                       # mean −1.5 is not < −1.5: still 0.3
    ([-1.75] * 4, [0.1] * 4),                      # mean −1.75 < −1.5: 0.1
    ([-1.0, -1.0, -1.0, 0.0], [0.3, 0.3, 0.3, 1.0]),   # q3: the δ = 0 token keeps 1
    ([-0.75, -0.75, -0.75, 0.75], [1.0] * 4),     # mean −0.375: tier 1 (and the δ > 0 token keeps 1 anyway)
    ([-6.0] + [1.0] * 7, [1.0] * 8),               # δ = −6 is not < δ_bad: k = 0, mean 0.125: 1
    ([-6.25] + [1.0] * 7, [0.55] + [1.0] * 7),     # k = 1: 1 − 0.9·½ = 0.55 on the δ < 0 token
    ([-7.0, -7.0] + [2.0] * 6, [0.1, 0.1] + [1.0] * 6),            # k = 2: 0.1 (mean −0.25: tier 1)
    ([-7.0, -7.0, -7.0] + [4.0] * 5, [0.1] * 3 + [1.0] * 5),       # k = 3: min(3/2, 1) = 1 → 0.1
    ([-6.5] + [-0.25] * 7, [0.3] * 8),             # mean −1.03125: tier 0.3 < tail 0.55 → 0.3
]


def test_gate_tiers_tail_weights_and_lines():
    cases = GATE_CASES
    got = _gate([d for d, _ in cases], [-1.0] * len(cases))
    for (d, want), g in zip(cases, got):
        assert g.tolist() == pytest.approx(want, rel=1e-6), d
    # min(tier, tail): mean (−7 + 2.25)/4 = −1.1875 → tier 0.3, k = 1 → tail 0.55: weight 0.3 on the δ < 0 token
    (g,) = _gate([[-7.0, 0.75, 0.75, 0.75]], [-1.0])
    assert g.tolist() == pytest.approx([0.3, 1.0, 1.0, 1.0], rel=1e-6)


def test_gate_needs_negative_segment_advantage():
    """A = 0 (an all-equal GRPO group) and A > 0 responses keep weight 1 whatever their δ."""
    for g in _gate([[-2.0] * 4, [-7.0] * 4, [-2.0] * 4], [0.0, 0.0, 1.0]):
        assert g.tolist() == [1.0] * 4


def test_gate_segment_is_64_positions():
    """One A<0 response of 128 tokens: positions 0..63 δ = 0, 64..127 δ = −0.75.  W_gate = 64: the second segment
    gets 0.3, the first keeps 1 (and so does every token of it: δ = 0).  W = 65 or 63 would mix the two halves:
    position 64 (or 63) would land in the other segment and get the other weight."""
    d = [0.0] * 64 + [-0.75] * 64
    (g,) = _gate([d], [-1.0])
    assert g.tolist() == pytest.approx([1.0] * 64 + [0.3] * 64, rel=1e-6)


# ---------------------------------------------------------------------------------------------- repair
def _repair(deltas, advs, **cfg):
    batch, learner = _batch(deltas, advs, requires_grad=True)
    out = TriageController(TriageConfig(gate=False, tis=False, **cfg))(batch, step=0)
    grads = torch.autograd.grad(out.repair_loss, learner, allow_unused=True)
    return out, [torch.zeros(len(d)) if g is None else g for g, d in zip(grads, deltas)]


D1 = -0.125          # 2⁻³: exact


def _two_segment_response():
    """A > 0, 200 tokens: 100 at δ = −0.125 then 100 at 0.  W_rep = 128: segment 0 = 100·(−0.125)/128 =
    −0.09765625 → q = −0.03 + 0.09765625 = 0.06765625; segment 1 (72 tokens at 0) → q = max(−0.03, 0) = 0."""
    return [D1] * 100 + [0.0] * 100


def test_repair_value_tau_beta_coefficient_width():
    out, _ = _repair([_two_segment_response()], [1.0])
    q = TAU - 100 * D1 / 128
    want = COEF * (phi(q) + 0.0) / 2
    assert out.repair_loss.item() == pytest.approx(want, rel=1e-5)
    assert out.stats["repair_active_frac"] == 0.5
    # a segment with mean δ = −0.04 (τ − 0.01): q = 0.01 (it would be 0 for τ = −0.04 or lower)
    d = [-0.04] * 128
    out, _ = _repair([d], [1.0])
    assert out.repair_loss.item() == pytest.approx(COEF * phi(0.01), rel=1e-4)
    # φ is quadratic near 0 (q²/2) and linear (slope β) far out: φ(1) ≈ β·1 − β²
    out, _ = _repair([[-1.03] * 128], [1.0])
    assert out.repair_loss.item() == pytest.approx(COEF * phi(1.0), rel=1e-4)
    assert phi(1.0) == pytest.approx(math.sqrt(BETA2) - BETA2, rel=1e-3)


def test_repair_all_equal_group_is_out_of_scope():
    """An all-equal GRPO group (A = 0) and an A < 0 response add nothing: same loss, same denominator (1 segment
    counted, not 3), no gradient on their tokens.  Counting A = 0 as in scope would add φ(0.47) and 2 to the
    denominator: a loss about 7× larger here."""
    alone, _ = _repair([_two_segment_response()], [1.0])
    mixed, grads = _repair([_two_segment_response(), [-0.5] * 50, [-0.5] * 50], [1.0, 0.0, -1.0])
    assert mixed.repair_loss.item() == pytest.approx(alone.repair_loss.item(), rel=1e-6)
    assert mixed.stats["repair_active_frac"] == 0.5
    assert grads[1].abs().sum() == 0 and grads[2].abs().sum() == 0
    # the denominator counts in-scope segments only: 2 here (the response's two repair segments)
    q = TAU - 100 * D1 / 128
    assert mixed.repair_loss.item() == pytest.approx(COEF * phi(q) / 2, rel=1e-5)


def test_repair_gradient_and_scopes():
    """dLoss/d learner_logp_t = −0.015 · φ'(q) / (n_S · 2) on segment 0's in-scope tokens, φ'(q) = q/sqrt(1+q²/β²),
    n_S = 128.  adv_positive: all 128 tokens of segment 0; q2: only its 100 δ < 0 tokens; segment 1 (q = 0): none."""
    q = TAU - 100 * D1 / 128
    g_tok = -COEF * (q / math.sqrt(1 + q * q / BETA2)) / (128 * 2)
    _, (g,) = _repair([_two_segment_response()], [1.0])
    assert g[:128].tolist() == pytest.approx([g_tok] * 128, rel=1e-4)
    assert g[128:].abs().sum() == 0
    _, (g,) = _repair([_two_segment_response()], [1.0], repair_scope="q2")
    assert g[:100].tolist() == pytest.approx([g_tok] * 100, rel=1e-4)
    assert g[100:].abs().sum() == 0
    # whole: the A = 0 response is in scope too (its 50 tokens at −0.5: one segment, q = 0.47), 3 segments
    out, grads = _repair([_two_segment_response(), [-0.5] * 50], [1.0, 0.0], repair_scope="whole")
    assert out.repair_loss.item() == pytest.approx(COEF * (phi(q) + phi(0.47)) / 3, rel=1e-5)
    assert grads[1].abs().sum() > 0


def test_repair_config_defaults():
    c = TriageConfig()
    assert (c.repair_width, c.repair_tau, c.repair_coef, c.repair_scope, c.repair_start_step) == (
        128, TAU, COEF, "adv_positive", 0)
    assert c.repair_beta ** 2 == pytest.approx(BETA2, rel=1e-12)
    assert (c.gate_width, c.neg_threshold, c.severe_threshold, c.neg_weight, c.severe_weight, c.delta_bad,
            c.tail_count, c.tail_floor, c.gate_scope) == (64, -0.5, -1.5, 0.3, 0.1, -6.0, 2, 0.1, "q3")
    assert c.tis_clip == (0.0, 2.0) and c.normalization == "per_response"


# ------------------------------------------------------------------------------------------------- tis
def _exact_log_ratio(target):
    """A float32 x with float32 exp(x) == target exactly (searched around log(target)), and its two neighbours
    whose exp lies strictly below / above target."""
    x = np.float32(math.log(target))
    for _ in range(64):
        e = torch.exp(torch.tensor(x)).item()
        if e == np.float32(target):
            break
        x = np.nextafter(x, np.float32(np.inf if e < target else -np.inf), dtype=np.float32)
    else:
        raise AssertionError(f"no float32 x with exp(x) == {target}")
    lo = hi = x
    while torch.exp(torch.tensor(lo)).item() >= np.float32(target):
        lo = np.nextafter(lo, np.float32(-np.inf), dtype=np.float32)
    while torch.exp(torch.tensor(hi)).item() <= np.float32(target):
        hi = np.nextafter(hi, np.float32(np.inf), dtype=np.float32)
    return float(lo), float(x), float(hi)


def test_tis_clip_at_two_and_clip_fraction_strict():
    """TIS weight clamp(exp(old − sampler), 0, 2): ratios just below 2, exactly 2 and just above 2, and e⁻¹;
    only the one above 2 counts as clipped (tis_clip_frac = 1/4)."""
    lo, at, hi = _exact_log_ratio(2.0)
    samp = torch.zeros(5, dtype=torch.float32)          # old − sampler = old exactly
    old = torch.tensor([lo, at, hi, -1.0, -200.0], dtype=torch.float32)   # exp(−200) = 0 in float32: on lo = 0
    batch = TokenBatch.from_list([samp.clone()], [samp], torch.tensor([1.0]))
    ctrl = TriageController(TriageConfig(gate=False, repair=False))
    out = ctrl(batch, step=0, old_logp=old)
    raw = torch.exp(old - samp)
    assert out.tis_weights.tolist() == pytest.approx([raw[0].item(), 2.0, 2.0, math.exp(-1.0), 0.0], rel=1e-6)
    assert raw[0].item() < 2.0 and raw[1].item() == 2.0 and raw[2].item() > 2.0 and raw[4].item() == 0.0
    assert out.stats["tis_clip_frac"] == pytest.approx(0.2, rel=1e-6)
    # a configured clip is used for the weights and the fraction: [0, 3] clips e^1.5 = 4.48 to 3
    out = TriageController(TriageConfig(gate=False, repair=False, tis_clip=(0.0, 3.0)))(
        batch, step=0, old_logp=torch.tensor([1.5, 0.0, 0.0, 0.0, 0.0]))
    assert out.tis_weights.tolist() == pytest.approx([3.0, 1.0, 1.0, 1.0, 1.0])
    assert out.stats["tis_clip_frac"] == pytest.approx(0.2, rel=1e-6)
    with pytest.raises(ValueError, match=r"old_logp has shape \(3,\), expected \(5,\) = the batch's valid tokens "
                                         r"\(batch.gather\(old_logp\) reads a tensor of your layout at them\)"):
        ctrl(batch, step=0, old_logp=torch.zeros(3))


def test_repair_segment_count_for_accumulation_skips_all_equal_groups():
    """repair_segment_count (the gradient-accumulation denominator) counts the in-scope repair segments: the A > 0
    response's two, not the A = 0 or A < 0 responses' (2, not 4); passing it back gives the same loss."""
    deltas, advs = [_two_segment_response(), [-0.5] * 50, [-0.5] * 50], [1.0, 0.0, -1.0]
    batch, _ = _batch(deltas, advs)
    ctrl = TriageController(TriageConfig(gate=False, tis=False))
    assert ctrl.repair_segment_count(batch).item() == 2.0
    whole = TriageController(TriageConfig(gate=False, tis=False, repair_scope="whole"))
    assert whole.repair_segment_count(batch).item() == 4.0
    q = TAU - 100 * D1 / 128
    out = ctrl(batch, step=0, repair_denominator=ctrl.repair_segment_count(batch))
    assert out.repair_loss.item() == pytest.approx(COEF * phi(q) / 2, rel=1e-5)


def test_calibration_config_and_state_version_validation():
    """CalibrationConfig: window ≥ 1 (1 is accepted), 0 < severe < neg < 1 (equal quantiles are refused), 0 < bad < 1;
    a controller state of another version is refused with both versions in the message."""
    from triage_monitor.triage.controller import STATE_VERSION, CalibrationConfig

    assert CalibrationConfig(window=1).window == 1
    c = CalibrationConfig()
    assert (c.window, c.neg_quantile, c.severe_quantile, c.bad_quantile) == (25, 0.05, 0.01, 0.001)
    for kw in ({"window": 0}, {"severe_quantile": 0.05}, {"severe_quantile": 0.0}, {"neg_quantile": 1.0},
               {"bad_quantile": 0.0}, {"bad_quantile": 1.0}):
        with pytest.raises(ValueError, match="CalibrationConfig"):
            CalibrationConfig(**kw)
    ctrl = TriageController()
    state = ctrl.state_dict()
    state["version"] = STATE_VERSION + 7
    with pytest.raises(ValueError, match=rf"state version {STATE_VERSION + 7} is not {STATE_VERSION}"):
        ctrl.load_state_dict(state)


def test_repair_terms_return_types_and_state_dict_config():
    """repair_terms returns (φ float32, in_scope bool, q float32) for every scope (docstring contract), and the
    controller's state_dict records its config under "config"."""
    from dataclasses import asdict

    from triage_monitor.triage.controller import repair_terms
    from triage_monitor.metrics.segments import segment_tokens

    batch, _ = _batch([_two_segment_response(), [-0.5] * 50], [1.0, 0.0])
    seg = segment_tokens(batch.sample_index, batch.position, 128)
    for scope, want in (("whole", [True, True, True]), ("adv_positive", [True, True, False]),
                        ("q2", [True, True, False])):
        phi_, in_scope, q = repair_terms(batch.learner_logp, batch.sampler_logp, batch.advantage, seg, TAU,
                                         BETA2 ** 0.5, scope)
        assert in_scope.dtype == torch.bool and in_scope.tolist() == want, scope
        assert phi_.dtype == torch.float32 and q.dtype == torch.float32
        assert q.tolist() == pytest.approx([TAU - 100 * D1 / 128, 0.0, 0.47], rel=1e-5)
    cfg = TriageConfig(repair_coef=0.02)
    assert TriageController(cfg).state_dict()["config"] == asdict(cfg)


def test_triage_config_validation_lines_and_messages():
    """Accepted on the line: severe_weight = neg_weight, neg_weight = 1, tail_floor = 0 and 1, repair_coef = 0.
    Refused on the line, each with the field and what it needs: severe_threshold = neg_threshold, tis_clip lo = hi."""
    for kw in ({"severe_weight": 0.3, "neg_weight": 0.3}, {"neg_weight": 1.0}, {"tail_floor": 0.0},
               {"tail_floor": 1.0}, {"repair_coef": 0.0}, {"tis_clip": [0, 5]}):
        TriageConfig(**kw)
    assert TriageConfig(tis_clip=[0, 5]).tis_clip == (0.0, 5.0)
    cases = [
        ({"gate_width": 2.5}, "gate_width = 2.5: must be a positive integer"),
        ({"tail_count": True}, "tail_count = True: must be a positive integer"),
        ({"repair_width": 0}, "repair_width = 0: must be a positive integer"),
        ({"delta_bad": math.inf}, "delta_bad = inf: must be finite (nats)"),
        ({"severe_threshold": -0.5}, "severe_threshold < neg_threshold"),
        ({"tail_floor": 1.5}, "tail_floor = 1.5: must be in [0, 1]"),
        ({"repair_beta": 0.0}, "repair_beta = 0.0: must be > 0"),
        ({"repair_coef": -1.0}, "repair_coef = -1.0: must be >= 0"),
        ({"repair_start_step": -1}, "repair_start_step = -1: must be an integer >= 0"),
        ({"gate_scope": "all"}, "gate_scope = 'all': must be one of ('q3', 'whole')"),
        ({"repair_scope": "all"}, "repair_scope = 'all': must be one of ('adv_positive', 'q2', 'whole')"),
        ({"normalization": "x"}, "normalization = 'x': must be one of ('per_response', 'global_token')"),
        ({"tis_clip": 2.0}, "tis_clip = 2.0: must be a pair (lo, hi) of floats"),
        ({"tis_clip": (1.0, 1.0)}, "tis_clip = (1.0, 1.0): needs 0 <= lo < hi"),
        ({"calibration": 3}, "calibration = 3: must be None, a CalibrationConfig or a dict of its fields"),
        ({"severe_weight": 0.5}, "severe_weight <= neg_weight <= 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError) as e:
            TriageConfig(**kw)
        assert msg in str(e.value), (kw, str(e.value))


def test_weight_and_threshold_order_refusals_read_in_full():
    """The two order refusals, typed out in full (both values named, what holds on a valid configuration)."""
    with pytest.raises(ValueError) as e:
        TriageConfig(severe_weight=0.5)
    assert str(e.value) == ("TriageConfig needs 0 < severe_weight <= neg_weight <= 1, got severe_weight=0.5, "
                            "neg_weight=0.3")
    with pytest.raises(ValueError) as e:
        TriageConfig(severe_threshold=-0.5)
    assert str(e.value) == ("TriageConfig needs severe_threshold < neg_threshold, got severe_threshold=-0.5, "
                            "neg_threshold=-0.5")
