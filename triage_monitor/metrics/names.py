"""The metrics of docs/metrics.md, declared once: name, how tables, charts and terminals label it, its unit, whether it
reads as a percentage and whether it depends on τ_tail.

Everything that lists metrics derives from :data:`METRICS`: the order of :data:`METRIC_NAMES` (the steps table's
columns, ``MismatchStats.compute``), the τ-dependent metrics (:data:`TAU_DEPENDENT`: what a change of τ_tail
recomputes and marks provisional), and every display name (:func:`label`, :func:`short`: the stage table, the
report, the dashboard, the study's comparison, ``analyze``'s and the demo's terminal tables).  The standard library
only: the dashboard's first charts import it.
"""

from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    """One metric's declaration.

    Attributes:
        name: its key (the steps table's column; ``window/<name>`` its trailing-window value).
        label: how tables, charts and the report name it (``"C_tok"``, ``"k3 KL"``).
        short: the header of a narrow terminal column (``"small|δ|"``).
        unit: ``"nats"`` for log-probability quantities, else ``""`` (a ratio, a share, a count).
        percent: a share in [0, 1] shown as % in tables.
        needs_tau: computed from the amplifying-tail tokens (A < 0 and δ < τ_tail): NaN before τ_tail is
            calibrated, recomputed when τ_tail changes.
    """

    name: str
    label: str
    short: str
    unit: str = ""
    percent: bool = False
    needs_tau: bool = False


#: The four regions of docs/metrics.md#terms, in the order of the ``mass_*`` / ``count_*`` metrics and state fields.
REGIONS = ("amp_neg", "amp_pos", "con_neg", "con_pos")
#: Quantiles of δ reported per step / window (docs/metrics.md#delta_quantiles), name → q.
DELTA_QUANTILES = {"delta_q01": 0.01, "delta_q05": 0.05, "delta_q50": 0.50}
_REGION_LABEL = {"amp_neg": "A⁻", "amp_pos": "A⁺", "con_neg": "C⁻", "con_pos": "C⁺"}
#: What each region holds, for legends (docs/metrics.md#terms).
REGION_LABELS = {"amp_neg": "A⁻ amplifying (A<0, δ<0)", "amp_pos": "A⁺ amplifying (A>0, δ>0)",
                 "con_neg": "contracting (A<0, δ>0)", "con_pos": "contracting (A>0, δ<0)"}

#: Every metric :meth:`~triage_monitor.metrics.stats.MismatchStats.compute` returns, in display order.
METRICS: tuple[Metric, ...] = (
    Metric("n_tokens", "tokens", "tokens"),
    Metric("n_samples", "responses", "resp"),
    Metric("small_gap_share", "small-gap share", "small", percent=True),
    Metric("delta_mean", "mean δ", "δ", "nats"),
    Metric("delta_abs_mean", "mean |δ|", "|δ|", "nats"),
    *(Metric(k, f"δ q{q:g}", f"q{k[-2:]} δ", "nats") for k, q in DELTA_QUANTILES.items()),
    Metric("delta_min", "min δ", "min δ", "nats"),
    Metric("k3_kl", "k3 KL", "k3", "nats"),
    Metric("log_ppl_diff", "log-ppl difference", "Δlog ppl", "nats"),
    Metric("chi2_token", "χ² per token", "χ²"),
    *(Metric(f"mass_{r}", f"mass {_REGION_LABEL[r]}", f"m{_REGION_LABEL[r]}") for r in REGIONS),
    *(Metric(f"count_{r}", f"tokens {_REGION_LABEL[r]}", f"n{_REGION_LABEL[r]}") for r in REGIONS),
    Metric("rho_asym", "ρ_asym", "ρ_asym"),
    Metric("rho_asym_lennorm", "ρ_asym (length-normalised)", "ρ_len"),
    Metric("amp_share", "amp share", "amp", percent=True),
    Metric("r_amp", "r_amp", "r_amp", percent=True, needs_tau=True),
    Metric("h_seg", "H_seg", "H_seg", percent=True, needs_tau=True),
    Metric("c_tok", "C_tok", "C_tok", percent=True, needs_tau=True),
    Metric("p_adj", "P_adj", "P_adj", needs_tau=True),
    Metric("dilution", "dilution", "dil", percent=True, needs_tau=True),
    Metric("tau_tail", "τ_tail", "τ_tail", "nats", needs_tau=True),
)
BY_NAME = {m.name: m for m in METRICS}
#: The metric names, in display order.
METRIC_NAMES = tuple(m.name for m in METRICS)
#: The metrics that depend on τ_tail (:attr:`Metric.needs_tau`).
TAU_DEPENDENT = tuple(m.name for m in METRICS if m.needs_tau)
#: The metrics computed from the amplifying-tail tokens (τ_tail itself excluded): NaN until τ_tail is calibrated.
LOCALISATION = tuple(n for n in TAU_DEPENDENT if n != "tau_tail")
WINDOW = "window/"


def _metric(column: str) -> Metric:
    try:
        return BY_NAME[column.removeprefix(WINDOW)]
    except KeyError:
        raise KeyError(f"{column!r} is not a metric of docs/metrics.md (one of {', '.join(METRIC_NAMES)}, or "
                       f"window/<name>)") from None


def label(column: str, unit: bool = False) -> str:
    """The display name of a metric column: its :attr:`Metric.label`, ``"window <label>"`` for ``window/<name>``,
    with ``" (<unit>)"`` appended when ``unit`` and the metric has one.

    Raises:
        KeyError: ``column`` is not a metric (naming it)."""
    m = _metric(column)
    text = f"window {m.label}" if column.startswith(WINDOW) else m.label
    return f"{text} ({m.unit})" if unit and m.unit else text


def short(column: str) -> str:
    """The narrow terminal header of a metric column: :attr:`Metric.short`, with ``" (w)"`` for ``window/<name>``.

    Raises:
        KeyError: ``column`` is not a metric (naming it)."""
    m = _metric(column)
    return f"{m.short} (w)" if column.startswith(WINDOW) else m.short
