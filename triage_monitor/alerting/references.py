"""The published reference values of docs/metrics.md, in one place, for everything that shows or judges a run.

Per 25-update window of the published NVFP4 runs (dense 4B and MoE 30B-A3B), stages healthy / drift /
pre-terminal / terminal (docs/metrics.md#rho_asym, #small_gap_share, #c_tok).  The charts (report, dashboard,
study) draw :data:`RHO_ASYM_HEALTHY` as a band and the shipped alert thresholds (read from the rules, not
copied here) as lines; the health verdict (:mod:`triage_monitor.offline.verdict`) compares a run with them.

Imports only :mod:`typing`: torch-free and cheap.
"""

from __future__ import annotations

from typing import NamedTuple

#: Stages of a published run's post-mortem, in order.
STAGES = ("healthy", "drift", "pre-terminal", "terminal")

#: ρ_asym (raw |A| weighting) per 25-update window: model -> stage -> value (docs/metrics.md#rho_asym).
RHO_ASYM = {"dense 4B": {"healthy": 1.023, "drift": 1.504, "pre-terminal": 2.319, "terminal": 1.936},
            "MoE 30B": {"healthy": 1.337, "drift": 1.488, "pre-terminal": 1.851, "terminal": 3.391}}

#: The healthy band of window ρ_asym: from the dense 4B to the MoE 30B healthy value.
RHO_ASYM_HEALTHY = (RHO_ASYM["dense 4B"]["healthy"], RHO_ASYM["MoE 30B"]["healthy"])

#: small_gap_share stayed at or above these fractions up to the pre-terminal window (docs/metrics.md#small_gap_share).
SMALL_GAP_SHARE_FLOOR = {"dense 4B": 0.830, "MoE 30B": 0.919}

#: C_tok (fraction) healthy and pre-terminal (docs/metrics.md#c_tok); uniform placement gives 0.05.
C_TOK = {"dense 4B": {"healthy": 0.2156, "pre-terminal": 0.2568},
         "MoE 30B": {"healthy": 0.2010, "pre-terminal": 0.2501}}


class RhoThreshold(NamedTuple):
    """One ``above`` threshold of an alert rule on window ρ_asym (:func:`rho_asym_thresholds`)."""

    threshold: float
    rule: str
    level: str


def rho_asym_thresholds(rules=None) -> list[RhoThreshold]:
    """The ``above`` thresholds of the alert rules on window ρ_asym, lowest first.

    Args:
        rules: :class:`~triage_monitor.alerting.alert_rules.Rule` objects (anything with ``metric``, ``condition``,
            ``threshold``, ``name``, ``level``); None reads the shipped defaults.

    Returns:
        ``[RhoThreshold(threshold, rule name, level), ...]`` (tuples) of the rules with ``metric == "window/rho_asym"`` and
        ``condition == "above"`` (shipped: 1.45 WARN, 1.8 ERROR).
    """
    if rules is None:
        from .alert_rules import default_rules

        rules = default_rules()
    out = [RhoThreshold(float(r.threshold), r.name, r.level) for r in rules
           if r.metric == "window/rho_asym" and r.condition == "above"]
    return sorted(out)


__all__ = ["STAGES", "RHO_ASYM", "RHO_ASYM_HEALTHY", "SMALL_GAP_SHARE_FLOOR", "C_TOK", "RhoThreshold", "rho_asym_thresholds"]
