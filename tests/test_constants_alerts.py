"""Alert thresholds and scores (docs/alerts.md#conditions) pinned by values worked out by hand: each comparison is
strict (a value exactly on the threshold does not hold), each score is divided by the documented reference
(|look-back| for rising/falling, |baseline| for excess/deficit), and the shipped rules carry the documented
thresholds (docs/alerts.md#default-rules-and-why).  Bad rule fields and rule files are refused with messages typed
out here in full (rule, field, value; the file's path)."""

import locale
import math
import re
import sys

import pytest

from triage_monitor.alerting.alerts import AlertEngine, Rule, default_rules
from triage_monitor.alerting.alert_rules import NOISE_FLOOR_NATS, load_rules


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


# ----------------------------------------------------------------------- rule fields and rule files
def _raises_exactly(exc, text):
    """pytest.raises matching the whole message ``text`` (the message a user reads, typed out here)."""
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def test_bad_rule_fields_are_refused_with_the_rule_field_and_value():
    """Each refusal names the rule, the field and its value, and says what the field needs; a name or metric of
    the wrong type is refused as well as an empty one, and a threshold that is not a number is a ValueError
    (not float()'s own error)."""
    with _raises_exactly(ValueError, "alert rule: name=123 must be a non-empty string"):
        Rule(123, "window/x", "above", 1.0)
    with _raises_exactly(ValueError, "alert rule: name='' must be a non-empty string"):
        Rule("", "window/x", "above", 1.0)
    with _raises_exactly(ValueError, "alert rule 'r': metric=5 must be a non-empty string"):
        Rule("r", 5, "above", 1.0)
    with _raises_exactly(ValueError, "alert rule 'r': metric='' must be a non-empty string"):
        Rule("r", "", "above", 1.0)
    with _raises_exactly(ValueError, "alert rule 'r': condition='sideways' must be one of "
                                     "('above', 'below', 'rising', 'falling', 'excess', 'deficit', 'drawdown')"):
        Rule("r", "window/x", "sideways", 1.0)
    with _raises_exactly(ValueError, "alert rule 'r': level='PANIC' must be one of ('INFO', 'WARN', 'ERROR')"):
        Rule("r", "window/x", "above", 1.0, level="PANIC")
    with _raises_exactly(ValueError, "alert rule 'r': agg='median' must be one of "
                                     "('mean', 'sum', 'min', 'max', 'last')"):
        Rule("r", "window/x", "above", 1.0, agg="median")
    with _raises_exactly(ValueError, "alert rule 'r': threshold='high' must be a finite number"):
        Rule("r", "window/x", "above", "high")
    with _raises_exactly(ValueError, "alert rule 'r': threshold=None must be a finite number"):
        Rule("r", "window/x", "above", None)
    with _raises_exactly(ValueError, "alert rule 'r': threshold=inf must be a finite number"):
        Rule("r", "window/x", "above", math.inf)


def test_rule_tables_name_where_they_come_from():
    """Rule.from_dict says ``rule:`` when not told where the table comes from, names the type of a table that is
    not a mapping, and lists the missing required fields."""
    with _raises_exactly(ValueError, "rule: expected a table of rule fields, got list"):
        Rule.from_dict(["r", "window/x", "above", 1.0])
    with _raises_exactly(ValueError, "rule: missing required field(s) ['threshold']"):
        Rule.from_dict({"name": "r", "metric": "window/x", "condition": "above"})
    with _raises_exactly(ValueError, "rules[3]: missing required field(s) ['metric', 'condition']"):
        Rule.from_dict({"name": "r", "threshold": 1.0}, where="rules[3]")


ONE_RULE_YAML = "rules:\n  - {name: a, metric: window/x, condition: above, threshold: 1.5, note: ρ_asym ≥ 1.45}\n"


@pytest.mark.parametrize("name", ["r.yml", "r.YML", "r.yaml"])
def test_yml_and_yaml_files_are_read_as_yaml(tmp_path, name):
    """``.yml`` is YAML like ``.yaml``, in any letter case (the text is not valid TOML)."""
    p = tmp_path / name
    p.write_text(ONE_RULE_YAML, encoding="utf-8")
    assert load_rules(p) == [Rule("a", "window/x", "above", 1.5, note="ρ_asym ≥ 1.45")]


def test_rule_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """A UTF-8 rule file with a non-ASCII note reads the same under an ASCII locale (LC_CTYPE=C: Python's
    default text encoding is then ASCII, which cannot decode "ρ")."""
    p = tmp_path / "r.yaml"
    p.write_text(ONE_RULE_YAML, encoding="utf-8")
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        rules = load_rules(p)
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert [r.note for r in rules] == ["ρ_asym ≥ 1.45"]


def test_unreadable_rule_files_name_the_file_and_the_problem(tmp_path, monkeypatch):
    """Not YAML, not TOML, no top-level list ``rules`` (a YAML list, a TOML table ``[rules]``): each error starts
    with the file's path."""
    p = tmp_path / "bad.yaml"
    p.write_text("rules: [unclosed\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}: not valid YAML: ")):
        load_rules(p)
    p = tmp_path / "bad.toml"
    p.write_text("[[rules]\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}: not valid TOML: ")):
        load_rules(p)
    for name, text in (("list.yaml", "- {name: a}\n"), ("table.toml", "[rules]\nname = 'a'\n"),
                       ("none.toml", "title = 'no rules'\n")):
        p = tmp_path / name
        p.write_text(text)
        with _raises_exactly(ValueError, f"{p}: expected a top-level list 'rules' ([[rules]] tables in TOML)"):
            load_rules(p)
    # without PyYAML: an ImportError that names the file and the package to install
    monkeypatch.setitem(sys.modules, "yaml", None)        # `import yaml` now raises ImportError
    p = tmp_path / "r.yaml"
    p.write_text(ONE_RULE_YAML, encoding="utf-8")
    with _raises_exactly(ImportError, f"{p}: reading YAML rules needs PyYAML (pip install pyyaml)"):
        load_rules(p)


def test_integer_wait_guard_and_full_window_fields_are_checked_with_their_bounds():
    """Counts are integers (not bools, not floats) >= 1 (cooldown >= 0), baseline_steps = 1 and wait_s = 0 are
    allowed; each refusal names the rule, the field and its value."""
    assert Rule("r", "window/x", "excess", 0.1, baseline_steps=1).baseline_steps == 1
    assert Rule("r", "window/x", "above", 0.1, wait_s=0).wait_s == 0
    assert Rule("r", "window/x", "above", 0.1, wait_s=0.5, cooldown=0).wait_s == 0.5
    for kw, text in ((dict(baseline_steps=0), "baseline_steps=0 must be an integer >= 1"),
                     (dict(hold=True), "hold=True must be an integer >= 1"),
                     (dict(window=2.5), "window=2.5 must be an integer >= 1"),
                     (dict(cooldown=-1), "cooldown=-1 must be an integer >= 0"),
                     (dict(baseline=math.nan), "baseline=nan must be a finite number or omitted"),
                     (dict(wait_s=-1.0), "wait_s=-1.0 must be >= 0"),
                     (dict(guard_metric=3), "guard_metric=3 must be a metric name or empty"),
                     (dict(guard_min=None), "guard_min=None must be a finite number"),
                     (dict(guard_min=math.inf), "guard_min=inf must be a finite number"),
                     (dict(full_window="yes"), "full_window='yes' must be true or false")):
        with _raises_exactly(ValueError, f"alert rule 'r': {text}"):
            Rule("r", "window/x", "above", 0.1, **kw)


def test_yaml_exponent_numbers_become_floats(tmp_path):
    """PyYAML reads ``1e-3`` (no decimal point) as the string '1e-3'; the rule stores the numbers 0.001 and 0.0001,
    and the rule works: the guard 2e-4 >= 1e-4 lets a value 0.002 > 0.001 fire."""
    p = tmp_path / "r.yaml"
    p.write_text("rules:\n  - {name: a, metric: window/x, condition: above, threshold: 1e-3,\n"
                 "     guard_metric: window/g, guard_min: 1e-4}\n")
    (rule,) = load_rules(p)
    assert (rule.threshold, rule.guard_min) == (0.001, 0.0001)
    assert type(rule.threshold) is float and type(rule.guard_min) is float
    eng = AlertEngine([rule])
    eng.observe(0, {"window/x": 0.002, "window/g": 2e-4})
    assert [a.step for a in eng.fired] == [0]
