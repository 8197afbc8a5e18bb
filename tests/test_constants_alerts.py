"""Alert thresholds and scores (docs/alerts.md#conditions) pinned by values worked out by hand: each comparison is
strict (a value exactly on the threshold does not hold), each score is divided by the documented reference
(|look-back| for rising/falling, |baseline| for excess/deficit), and the shipped rules carry the documented
thresholds (docs/alerts.md#default-rules-and-why)."""

import math

import pytest

from triage_monitor.alerts import AlertEngine, Rule, default_rules
from triage_monitor.alert_rules import NOISE_FLOOR_NATS


def fired(rule, values, steps=None):
    eng = AlertEngine([rule])
    for s, v in zip(range(len(values)) if steps is None else steps, values):
        eng.observe(s, {rule.metric: v})
    return [(a.step, a.value) for a in eng.fired]


def test_above_and_below_are_strict():
    assert fired(Rule("r", "window/x", "above", 1.5), [1.5, 1.75]) == [(1, 1.75)]
    assert fired(Rule("r", "window/x", "below", -1.0), [-1.0, -1.25]) == [(1, -1.25)]


def test_rising_relative_score_is_the_rise_over_the_lookback():
    """window 1, k 2: 1.0 → 1.25 → 1.5: rise 0.5, relative 0.5 / |1.0| = 0.5 (÷ |v(t)| would give 1/3, ÷ |v(t−w)|
    0.4); threshold 0.45 fires with value 0.5, threshold 0.5 (not strictly above) does not."""
    r = dict(window=1, k=2, relative=True)
    assert fired(Rule("r", "window/x", "rising", 0.45, **r), [1.0, 1.25, 1.5]) == [(2, 0.5)]
    assert fired(Rule("r", "window/x", "rising", 0.5, **r), [1.0, 1.25, 1.5]) == []
    # negative look-back: divided by its absolute value: −2 → −1.5 → −1: rise 1 / 2 = 0.5
    assert fired(Rule("r", "window/x", "rising", 0.45, **r), [-2.0, -1.5, -1.0]) == [(2, 0.5)]


def test_falling_absolute_and_relative_scores():
    """2.0 → 1.5 → 1.0: drop 1.0 (absolute), 1.0 / 2.0 = 0.5 (relative); strictly decreasing chain needed."""
    assert fired(Rule("r", "window/x", "falling", 0.75, window=1, k=2), [2.0, 1.5, 1.0]) == [(2, 1.0)]
    assert fired(Rule("r", "window/x", "falling", 1.0, window=1, k=2), [2.0, 1.5, 1.0]) == []
    assert fired(Rule("r", "window/x", "falling", 0.25, window=1, k=2, relative=True), [2.0, 1.5, 1.0]) == [(2, 0.5)]
    assert fired(Rule("r", "window/x", "falling", 0.1, window=1, k=2), [2.0, 2.0, 1.0]) == []      # not monotone
    # look-back spacing is the window: w = 2, k = 2 compares steps t, t−2, t−4
    assert fired(Rule("r", "window/x", "rising", 0.5, window=2, k=2), [0.0, 9.0, 0.5, -9.0, 1.0]) == [(4, 1.0)]


def test_excess_and_deficit_scores_against_the_baseline():
    """baseline 0.25 given: v = 0.3125 → excess 0.0625, relative 0.0625 / 0.25 = 0.25 (÷ v would be 0.2);
    deficit with baseline 2: v = 1.5 → 0.5, relative 0.25."""
    assert fired(Rule("r", "window/x", "excess", 0.0625, baseline=0.25), [0.3125, 0.375]) == [(1, 0.125)]
    assert fired(Rule("r", "window/x", "excess", 0.2, baseline=0.25, relative=True), [0.3125]) == [(0, 0.25)]
    assert fired(Rule("r", "window/x", "excess", 0.25, baseline=0.25, relative=True), [0.3125]) == []
    assert fired(Rule("r", "window/x", "deficit", 0.25, baseline=2.0, relative=True), [1.5]) == []
    assert fired(Rule("r", "window/x", "deficit", 0.24, baseline=2.0, relative=True), [1.5]) == [(0, 0.25)]
    assert fired(Rule("r", "window/x", "deficit", 0.4, baseline=2.0), [1.5]) == [(0, 0.5)]
    # calibrated: median of the first 3 steps (1, 5, 2 → 2), then v = 3 → 1.0 (mean 2.67 would give 0.33)
    assert fired(Rule("r", "window/x", "excess", 0.9, baseline_steps=3), [1.0, 5.0, 2.0, 3.0]) == [(3, 1.0)]


def test_hold_and_cooldown_counts():
    """hold 3: fires on the third consecutive step; cooldown 4 after a firing at step 2: the next episode
    (steps 4, 5, 6) completes inside it and fires at step 6 = 2 + 4."""
    r = Rule("r", "window/x", "above", 0.0, hold=3, cooldown=4)
    assert [s for s, _ in fired(r, [1, 1, 1, -1, 1, 1, 1, 1])] == [2, 6]


DEFAULTS = {
    # name: (metric, condition, threshold, window, k, relative, hold, cooldown, level), docs/alerts.md#default-rules-and-why
    "rho_asym_rising": ("window/rho_asym", "rising", 0.15, 25, 2, True, 5, 100, "WARN"),
    "rho_asym_high": ("window/rho_asym", "above", 1.45, 25, None, False, 5, 100, "WARN"),
    "c_tok_excess": ("window/c_tok", "excess", 0.03, 25, None, False, 10, 100, "WARN"),
    "small_gap_share_falling": ("window/small_gap_share", "falling", 0.05, 25, 2, False, 5, 100, "WARN"),
    "delta_q05_low": ("window/delta_q05", "below", -1.0, 25, None, False, 3, 100, "ERROR"),
    "k3_kl_rising": ("window/k3_kl", "rising", 1.0, 25, 2, True, 5, 100, "WARN"),
    "nonfinite_logp": ("nonfinite_count", "above", 0.0, 1, None, False, 1, 25, "ERROR"),
    "gate_downweighting_rising": ("gate_downweighted_frac", "rising", 0.02, 25, 2, False, 10, None, "WARN"),
}


def test_shipped_rules_carry_the_documented_thresholds():
    rules = {r.name: r for r in default_rules()}
    for name, (metric, cond, thr, window, k, rel, hold, cooldown, level) in DEFAULTS.items():
        r = rules[name]
        assert (r.metric, r.condition, r.threshold, r.window, r.relative, r.hold, r.level) == (
            metric, cond, thr, window, rel, hold, level), name
        if k is not None:
            assert r.k == k, name
        if cooldown is not None:
            assert r.cooldown == cooldown, name
    assert rules["c_tok_excess"].baseline_steps == 50
    assert NOISE_FLOOR_NATS == 1e-4
    for name in ("rho_asym_rising", "rho_asym_high", "c_tok_excess", "k3_kl_rising"):
        assert (rules[name].guard_metric, rules[name].guard_min) == ("window/delta_abs_mean", 1e-4), name


def test_rho_asym_high_fires_above_145_after_hold_5():
    """The shipped rule on a window/rho_asym series (guard satisfied): 1.45 exactly never fires; 1.46 from step 10 on
    fires at step 14 (5 consecutive steps)."""
    rule = {r.name: r for r in default_rules()}["rho_asym_high"]
    eng = AlertEngine([rule])
    for s in range(20):
        eng.observe(s, {"window/rho_asym": 1.45 if s < 10 else 1.46, "window/delta_abs_mean": 0.01})
    assert [a.step for a in eng.fired] == [14]
    eng = AlertEngine([rule])
    for s in range(20):                               # below the noise floor: never evaluated
        eng.observe(s, {"window/rho_asym": 3.0, "window/delta_abs_mean": 0.5e-4})
    assert eng.fired == [] and not math.isnan(NOISE_FLOOR_NATS)
