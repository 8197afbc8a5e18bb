"""Plotly figures and summaries of a run, shared by the dashboard and the static report.

Each builder takes data already loaded through :mod:`triage_monitor.offline.analysis`
(the per-step metric frame of ``Run.steps()`` / ``recompute()``, one step's
token rows, alerts) and returns a ``plotly.graph_objects.Figure``; nothing here
reads files.  Trace names and ``meta`` fields are stable so tests can read the
plotted series back from a figure's JSON.

Ratios are plotted in % where docs/metrics.md reports them in % (small_gap_share,
quadrant shares, c_tok, r_amp, h_seg); log-probability gaps in nats.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Literal, Mapping, Optional, TypedDict, get_args

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..config import MetricConfig
from ..metrics.definitions import is_negative_response, is_tail, segment_number
from ..metrics import names as metric_names  # declarations only (the standard library): no metric code imported
from ..metrics.names import REGIONS  # noqa: F401  (the four regions of docs/metrics.md#terms, read here since 0.1)

if TYPE_CHECKING:
    from ..metrics.timings import CycleSummary


PALETTE = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563")
#: One colour convention for the report, the dashboard and the study: the inspected (failing) run in red, the
#: reference (a control that holds) in grey, any other run overlaid in the colours after them; each legend names
#: the roles ("(inspected)", "(reference)").  The study's arms use the same red (no correction) and grey (control).
INSPECTED_COLOR, REFERENCE_COLOR = "#dc2626", "#6b7280"
OTHER_COLORS = ("#2563eb", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777")
#: The destabilisation step's marker on every time series (docs/alerts.md#the-run-verdict).
MARKER_COLOR = "#111827"
REGION_COLORS = dict(zip(REGIONS, ("#dc2626", "#f97316", "#3b82f6", "#10b981")))
REGION_LABELS = metric_names.REGION_LABELS
#: Per-step extras written by the training loop: they have no pooled window
#: column, so the window view shows their trailing mean.
EXTRAS = ("reward", "accuracy", "gate_weight_mean", "repair_loss")

#: Time-series panels: key -> (title, [(column, label, scale)], y-axis title, reference line or None).
PANELS = {
    "direction": ("Direction: ρ_asym = mass(A⁻) / mass(A⁺)",
                  [(c, metric_names.label(c), 1.0) for c in ("rho_asym", "rho_asym_lennorm")],
                  "ratio", 1.0),
    "small_gap": (f"Small-gap share |δ| < {MetricConfig().small_gap_threshold:g}",
                  [("small_gap_share", metric_names.label("small_gap_share"), 100.0)],
                  "%", None),
    "delta_q05": ("q0.05 of δ", [("delta_q05", metric_names.label("delta_q05"), 1.0)], "nats", None),
    "k3_kl": ("k3 KL estimator", [("k3_kl", metric_names.label("k3_kl"), 1.0)], "nats", None),
    "reward": ("Reward and accuracy", [("reward", "reward", 1.0), ("accuracy", "accuracy", 1.0)], "", None),
    "controller": ("TRIAGE controller", [("gate_weight_mean", "Gate weight mean", 1.0),
                                         ("repair_loss", "repair loss", 1.0)], "", None),
}


def _template() -> go.layout.Template:
    """plotly's "plotly_white" template cut to its layout and the trace types these figures draw (scatter, bar,
    heatmap): the same look, and a copy per figure of a few kB instead of the full template (3x faster to build a
    figure; the report and the dashboard build a dozen)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        import plotly.io as pio

        full = pio.templates["plotly_white"]
        _TEMPLATE = go.layout.Template(layout=full.layout, data={k: full.data[k] for k in ("scatter", "bar", "heatmap")})
    return _TEMPLATE


_TEMPLATE: Optional[go.layout.Template] = None


def _layout(fig: go.Figure, title: str, height: int = 320, **kw) -> go.Figure:
    opts = dict(title=dict(text=title, x=0.01, y=0.97, yanchor="top", font=dict(size=14, color="#111827")),
                height=height, template=_template(), margin=dict(l=60, r=36, t=46, b=40),
                # the toolbar stands on the right edge, vertically, so it never covers the title (top left)
                modebar=dict(orientation="v", bgcolor="rgba(255,255,255,0.75)"),
                hovermode="x unified", font=dict(family="Inter, Segoe UI, Helvetica, Arial, sans-serif", size=12),
                legend=dict(orientation="h", yanchor="top", y=-0.24, x=0, xanchor="left", font=dict(size=11)))
    fig.update_layout(**{**opts, **kw})
    return fig


def series(df: pd.DataFrame, column: str, window: bool, window_steps: int = 25) -> Optional[pd.Series]:
    """The plotted values of ``column``: the pooled ``window/<column>`` when ``window``; for
    :data:`EXTRAS` (no pooled column) the trailing mean over ``window_steps`` steps; None when absent."""
    if window and f"window/{column}" in df.columns:
        return df[f"window/{column}"].astype(float)
    if column not in df.columns:
        return None
    s = df[column].astype(float)
    if window and column in EXTRAS:
        s = s.rolling(int(window_steps), min_periods=1).mean()
    return s


def _values(s: pd.Series, scale: float) -> list[Optional[float]]:
    return [None if not math.isfinite(v) else v * scale for v in s.to_numpy(dtype=float)]


def run_roles(labels, reference: Optional[str] = None) -> dict[str, tuple[str, str]]:
    """label -> ``(role, colour)`` of every run of a chart: the first label is the inspected run (red), ``reference``
    the reference (grey), the others ``"compared"`` in :data:`OTHER_COLORS` order."""
    out: dict[str, tuple[str, str]] = {}
    k = 0
    for i, label in enumerate(labels):
        if label == reference:
            out[label] = ("reference", REFERENCE_COLOR)
        elif i == 0:
            out[label] = ("inspected", INSPECTED_COLOR)
        else:
            out[label] = ("compared", OTHER_COLORS[k % len(OTHER_COLORS)])
            k += 1
    return out


def noise_steps(df: pd.DataFrame, window: bool = True) -> np.ndarray:
    """The steps of ``df`` at noise level by the rule of the alert guard and the trackers
    (:func:`triage_monitor.alerting.trackers.at_noise_level`: mean |δ| of the window, or of the step in the per-step view,
    below :data:`~triage_monitor.alerting.alert_rules.NOISE_FLOOR_NATS` nats); ``(n,)`` int64."""
    from ..alerting.trackers import noise_flags

    flags = noise_flags(df, window)
    return df["step"].to_numpy()[flags].astype(np.int64)


def _spans(steps: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs of sorted integer ``steps`` as ``[(first, last), ...]``."""
    if steps.size == 0:
        return []
    cut = np.flatnonzero(np.diff(steps) != 1)
    starts = np.r_[steps[0], steps[cut + 1]]
    ends = np.r_[steps[cut], steps[-1]]
    return list(zip(starts.tolist(), ends.tolist()))


def add_noise_shading(fig: go.Figure, steps: np.ndarray, row=None, col=None) -> go.Figure:
    """Grey the x-ranges of ``steps`` (noise level: the ratio drawn there is rounding noise, docs/alerts.md#noise-guard)
    with a legend entry (``meta = {"guide": "noise", "steps": n}``).  Returns ``fig``."""
    spans = _spans(np.asarray(steps, dtype=np.int64))
    if not spans:
        return fig
    where = {} if row is None else {"row": row, "col": col}
    for a, b in spans:
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor="#9ca3af", opacity=0.18, line_width=0, layer="below",
                      **where)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="noise level (mean |δ| < 1e-4 nats): greyed",
                             line=dict(color="#9ca3af", width=8), opacity=0.4, hoverinfo="skip",
                             showlegend=row in (None, 1), meta={"guide": "noise", "steps": int(len(steps))}), **where)
    return fig


def add_destabilisation_marker(fig: go.Figure, step: Optional[int], row=None, col=None) -> go.Figure:
    """Mark the step at which the run destabilised (docs/alerts.md#the-run-verdict) with a vertical line and a legend
    entry (``meta = {"marker": "destabilised", "step": step}``); nothing when ``step`` is None.  Returns ``fig``."""
    if step is None:
        return fig
    where = {} if row is None else {"row": row, "col": col}
    fig.add_vline(x=int(step), line=dict(color=MARKER_COLOR, dash="dashdot", width=1.5), **where)
    on = {} if row is None else {"row": 1 if row == "all" else row, "col": col}
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"destabilised at step {int(step)}",
                             line=dict(color=MARKER_COLOR, dash="dashdot", width=1.5), hoverinfo="skip",
                             showlegend=row in (None, 1, "all"), meta={"marker": "destabilised", "step": int(step)}),
                  **on)
    return fig


def timeseries_figure(runs: Mapping[str, pd.DataFrame], panel: str, window: bool = False, window_steps: int = 25,
                      alerts: Optional[Mapping[str, pd.DataFrame]] = None, rules=None, *,
                      reference: Optional[str] = None, band=None, destabilised: Optional[int] = None
                      ) -> Optional[go.Figure]:
    """One time-series panel of :data:`PANELS` over steps, every run of ``runs`` (label -> metric frame)
    overlaid — the first is the inspected run (red), ``reference`` (a label of ``runs``) the reference (grey,
    :func:`run_roles`), each column of the panel a dash style; alerts of ``alerts`` (label -> alert rows) drawn as
    markers on the first series.  The direction panel also carries the healthy ρ_asym bands (``band``: a reference
    run's :class:`~triage_monitor.offline.verdict.ReferenceBand`, and the published one) and the alert thresholds of
    ``rules`` (None: the shipped defaults; :func:`add_rho_asym_guides`), and greys the inspected run's steps at
    noise level (:func:`add_noise_shading`).  ``destabilised``: the inspected run's destabilisation step, marked
    (:func:`add_destabilisation_marker`).

    Trace ``meta`` = ``{"run", "column", "window", "scale", "role"}`` (alerts: ``{"run", "alerts": True}``; guides:
    ``{"guide": "healthy" | "reference" | "noise" | <rule name>, "value": ...}``; the marker:
    ``{"marker": "destabilised", "step"}``).  Returns None when no run has any column of the panel.
    """
    title, cols, ytitle, ref = PANELS[panel]
    fig = go.Figure()
    multi = len(runs) > 1
    roles = run_roles(list(runs), reference)
    for ri, (label, df) in enumerate(runs.items()):
        first = None
        for ci, (col, name, scale) in enumerate(cols):
            s = series(df, col, window, window_steps)
            if s is None or (s.isna().all() and col in EXTRAS):
                continue                      # an all-NaN metric is still drawn (empty): its absence is news
            first = first if first is not None else (s, scale)
            role, color = roles[label]
            suffix = " (trailing mean)" if window and col in EXTRAS else ""
            fig.add_trace(go.Scatter(
                x=df["step"].tolist(), y=_values(s, scale), mode="lines", name=(f"{label} ({role}) · " if multi
                                                                                 else "") + name + suffix,
                line=dict(color=color, width=2 if role != "reference" else 1.6, dash="solid" if ci == 0 else "dot"),
                meta={"run": label, "column": col, "window": bool(window), "scale": scale, "role": role}))
        a = (alerts or {}).get(label)
        if first is not None and a is not None and len(a):
            metric = a["metric"].astype(str).str.replace("window/", "", regex=False) if "metric" in a else None
            own = metric.isin([c for c, _, _ in cols]) if metric is not None else pd.Series(True, index=a.index)
            if panel == "direction":       # the direction panel also carries alerts no other panel shows
                shown = {c for p, (_, cs, _, _) in PANELS.items() if p != "direction" for c, _, _ in cs}
                own = own | ~metric.isin(shown) if metric is not None else own
            a = a[own.to_numpy()]
            if len(a):
                s, scale = first
                y = s.set_axis(df["step"].to_numpy()).reindex(a["step"].to_numpy()).to_numpy() * scale
                text = [f"{r.get('level', '')} {r.get('rule', '')}: {r.get('title', '')}" for r in
                        a.to_dict("records")]
                fig.add_trace(go.Scatter(x=a["step"].tolist(), y=[None if not np.isfinite(v) else v for v in y],
                                         mode="markers", name=(f"{label} · " if multi else "") + "alerts",
                                         marker=dict(symbol="triangle-down", size=12, color="#b91c1c",
                                                     line=dict(width=1, color="white")),
                                         hovertext=text, hoverinfo="text+x", meta={"run": label, "alerts": True}))
    if not fig.data:
        return None
    if ref is not None:
        fig.add_hline(y=ref, line=dict(color="#6b7280", dash="dash", width=1), annotation_text=f"{ref:g}",
                      annotation_position="top left")
    if panel == "direction":
        add_rho_asym_guides(fig, rules, band=band)
        inspected = next(iter(runs))
        add_noise_shading(fig, noise_steps(runs[inspected], window))
    add_destabilisation_marker(fig, destabilised)
    # the legend stands below the plot: its rows (one per entry once names are long) make the figure taller, so
    # that the plot keeps its height
    named = [t.name or "" for t in fig.data if t.showlegend is not False]
    rows = len(named) if max(map(len, named), default=0) > 40 else math.ceil(len(named) / 2)
    _layout(fig, title + (f" · {window_steps}-step window" if window else " · per step"), height=300 + 21 * rows,
            margin=dict(l=60, r=36, t=46, b=40 + 21 * rows))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text=ytitle)
    return fig


def add_rho_asym_guides(fig: go.Figure, rules=None, row=None, col=None, band=None) -> go.Figure:
    """Draw on a ρ_asym chart the healthy bands and the alert thresholds on window ρ_asym.

    The published band spans :data:`~triage_monitor.alerting.references.RHO_ASYM_HEALTHY` (1.023 dense 4B to 1.337 MoE 30B,
    docs/metrics.md#rho_asym), labelled "published (4B dense / 30B MoE)"; ``band`` (a reference run's
    :class:`~triage_monitor.offline.verdict.ReferenceBand`, docs/alerts.md#a-reference-run) is drawn in grey, labelled
    with the reference's name (or, without a usable band, named in the legend with the reason); each ``above`` rule
    on ``window/rho_asym`` of ``rules`` (None: the shipped defaults, 1.45 WARN and 1.8 ERROR) is a dashed line.
    Each guide also gets a legend entry (a trace with ``meta["guide"]``), so the page says what the lines are.
    ``row`` / ``col`` address a subplot.  Returns ``fig``.
    """
    from ..alerting.references import RHO_ASYM_HEALTHY, rho_asym_thresholds

    lo, hi = RHO_ASYM_HEALTHY
    where = {} if row is None else {"row": row, "col": col}
    fig.add_hrect(y0=lo, y1=hi, fillcolor="#10b981", opacity=0.12, line_width=0, layer="below", **where)
    first = row in (None, 1)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines",
                             name=f"healthy ρ_asym {lo:g}–{hi:g}, published (4B dense / 30B MoE)",
                             line=dict(color="#10b981", width=8), opacity=0.35, hoverinfo="skip",
                             showlegend=first, meta={"guide": "healthy", "value": [lo, hi]}), **where)
    if band is not None:
        usable = band.usable
        if usable:
            fig.add_hrect(y0=band.lo, y1=band.hi, fillcolor=REFERENCE_COLOR, opacity=0.16, line_width=0,
                          layer="below", **where)
        name = (f"healthy ρ_asym {band.lo:.3g}–{band.hi:.3g}, reference {band.label}" if usable
                else f"reference {band.label}: {band.note}")
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=name,
                                 line=dict(color=REFERENCE_COLOR, width=8), opacity=0.4 if usable else 0.0,
                                 hoverinfo="skip", showlegend=first,
                                 meta={"guide": "reference", "label": band.label,
                                       "value": [band.lo, band.hi] if usable else None}), **where)
    for value, name, level in rho_asym_thresholds(rules):
        color = "#b91c1c" if level == "ERROR" else "#d97706"
        fig.add_hline(y=value, line=dict(color=color, dash="dash", width=1), **where)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"alert {name} > {value:g} ({level})",
                                 line=dict(color=color, dash="dash", width=1), hoverinfo="skip", showlegend=first,
                                 meta={"guide": name, "value": value}), **where)
    return fig


def quadrant_shares(df: pd.DataFrame, window: bool = False) -> pd.DataFrame:
    """Share (%) of the |A| mass of the four regions (docs/metrics.md#terms) per step: columns :data:`REGIONS`.

    The denominator is the sum of the four masses (tokens with A = 0 or δ = 0 carry none); NaN when it is 0.
    """
    m = pd.DataFrame({r: series(df, f"mass_{r}", window) for r in REGIONS})
    total = m.sum(axis=1)
    return m.div(total.where(total > 0), axis=0) * 100.0


def quadrant_figure(df: pd.DataFrame, window: bool = False, label: str = "",
                    destabilised: Optional[int] = None) -> go.Figure:
    """Stacked area of the four quadrant masses as shares (%) of the |A| mass per step; ``destabilised``: the step
    marked (:func:`add_destabilisation_marker`)."""
    sh = quadrant_shares(df, window)
    fig = go.Figure()
    for r in REGIONS:
        fig.add_trace(go.Scatter(x=df["step"].tolist(), y=_values(sh[r], 1.0), name=REGION_LABELS[r],
                                 mode="lines", stackgroup="mass", line=dict(width=0.5, color=REGION_COLORS[r]),
                                 meta={"run": label, "column": f"mass_{r}", "window": bool(window)}))
    add_destabilisation_marker(fig, destabilised)
    _layout(fig, "Quadrant masses (share of |A| mass)" + (f" · {label}" if label else ""), height=360)
    fig.update_yaxes(title_text="% of |A| mass", range=[0, 100])
    fig.update_xaxes(title_text="step")
    return fig


def localisation_figure(df: pd.DataFrame, window: bool = False, label: str = "",
                        reference: float = 5.0, destabilised: Optional[int] = None) -> go.Figure:
    """c_tok, r_amp and h_seg (%) per step, with the uniform-placement reference of c_tok (5 %); steps at noise level
    greyed (:func:`add_noise_shading`), ``destabilised`` marked (:func:`add_destabilisation_marker`)."""
    fig = go.Figure()
    for i, (col, name) in enumerate((c, metric_names.label(c)) for c in ("c_tok", "r_amp", "h_seg")):
        s = series(df, col, window)
        if s is None:
            continue
        fig.add_trace(go.Scatter(x=df["step"].tolist(), y=_values(s, 100.0), name=name, mode="lines",
                                 line=dict(color=PALETTE[i], width=2),
                                 meta={"run": label, "column": col, "window": bool(window), "scale": 100.0}))
    # the reference is named in the legend, not written on the chart where it crossed the r_amp line
    fig.add_hline(y=reference, line=dict(color="#6b7280", dash="dash", width=1))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"uniform C_tok reference ({reference:g} %)",
                             line=dict(color="#6b7280", dash="dash", width=1), hoverinfo="skip",
                             meta={"run": label, "reference": reference}))
    add_noise_shading(fig, noise_steps(df, window))
    add_destabilisation_marker(fig, destabilised)
    _layout(fig, "Localisation" + (f" · {label}" if label else ""), height=360)
    fig.update_yaxes(title_text="%", rangemode="tozero")
    fig.update_xaxes(title_text="step")
    return fig


def segment_heatmap_figure(layout, sample_id: np.ndarray, step: int, max_rows: int = 60) -> go.Figure:
    """Heatmap of segment tail fraction (responses × segment k) of one step's A<0 responses.

    Args:
        layout: :class:`~triage_monitor.offline.stages.TailLayout` of the step (with ``number``).
        sample_id: ``(S,)`` the batch's sample ids (``layout.response`` indexes it).
        max_rows: at most this many responses, those with the most tail tokens first.
    """
    fig = go.Figure()
    if layout.num_segments == 0:
        _layout(fig, f"Segment tail fraction · step {step}: no A<0 response", height=260)
        return fig
    resp, k = layout.response, layout.number
    uniq, row = np.unique(resp, return_inverse=True)
    tails = np.bincount(row, weights=layout.tail)
    keep = np.argsort(-tails, kind="stable")[:max_rows]
    rank = np.full(uniq.size, -1)
    rank[keep] = np.arange(keep.size)
    z = np.full((keep.size, int(k.max()) + 1), np.nan)
    sel = rank[row] >= 0
    z[rank[row][sel], k[sel]] = layout.tail[sel] / layout.valid[sel]
    ids = np.asarray(sample_id)[uniq[keep]]
    fig.add_trace(go.Heatmap(z=z * 100.0, x=list(range(z.shape[1])), y=[f"id {i}" for i in ids],
                             colorscale="Reds", zmin=0, zmax=100, colorbar=dict(title="tail %"),
                             hovertemplate="response %{y}<br>segment %{x}<br>tail fraction %{z:.1f}%<extra></extra>",
                             meta={"step": int(step), "sample_id": [int(i) for i in ids]}))
    more = f" (top {keep.size} of {uniq.size} by tail tokens)" if uniq.size > keep.size else ""
    _layout(fig, f"Segment tail fraction, A<0 responses · step {step}{more}", height=380, hovermode="closest")
    fig.update_xaxes(title_text="segment k (positions kW … (k+1)W−1)", dtick=1 if z.shape[1] <= 16 else None)
    fig.update_yaxes(autorange="reversed", showticklabels=keep.size <= 40)
    return fig


def delta_histogram_figure(delta: np.ndarray, tau_tail: float, small_gap: float = 0.05, step: Optional[int] = None,
                           bins: int = 120) -> go.Figure:
    """Histogram of one step's δ (nats) with log counts, the small-gap band ±``small_gap`` and τ_tail.

    Pre-binned with numpy (``bins`` equal-width bins over [min, max]) so a
    large step sends only the bin counts to the browser.
    """
    d = np.asarray(delta, dtype=np.float64)
    d = d[np.isfinite(d)]
    fig = go.Figure()
    if d.size:
        lo, hi = float(d.min()), float(d.max())
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        counts, edges = np.histogram(d, bins=bins, range=(lo, hi))
        fig.add_trace(go.Bar(x=((edges[:-1] + edges[1:]) / 2).tolist(), y=counts.tolist(),
                             width=float(edges[1] - edges[0]), marker_color="#2563eb", name="tokens",
                             meta={"edges": edges.tolist(), "n": int(d.size)}))
    # labels sit in the strip above the plot area (paper y = 1), clear of the bars
    fig.add_vrect(x0=-small_gap, x1=small_gap, fillcolor="#10b981", opacity=0.18, line_width=0)
    fig.add_annotation(x=small_gap, y=1.0, xref="x", yref="paper", yanchor="bottom", xanchor="left", showarrow=False,
                       text=f"small gap |δ| < {small_gap:g}", font=dict(color="#047857", size=11))
    if math.isfinite(tau_tail):
        fig.add_vline(x=tau_tail, line=dict(color="#dc2626", dash="dash", width=2))
        fig.add_annotation(x=tau_tail, y=1.0, xref="x", yref="paper", yanchor="bottom", xanchor="right",
                           showarrow=False, text=f"τ_tail = {tau_tail:.4g}", font=dict(color="#b91c1c", size=11))
    _layout(fig, "δ distribution (log count)" + (f" · step {step}" if step is not None else ""), height=380,
            bargap=0, showlegend=False, hovermode="closest", margin=dict(l=60, r=36, t=64, b=40))
    # one label per decade (1, 10, 100, 1k, …) instead of plotly's 2 / 5 minor labels on a log axis
    top = int(np.ceil(np.log10(max(float(counts.max()) if d.size else 1.0, 1.0)))) + 1
    decades = [10 ** k for k in range(top + 1)]
    fig.update_yaxes(type="log", title_text="tokens (log)", tickvals=decades,
                     ticktext=[f"{v:,.0f}" if v < 1000 else f"{v / 1000:,.0f}k" if v < 10 ** 6 else f"{v / 10 ** 6:,.0f}M"
                               for v in decades])
    fig.update_xaxes(title_text="δ (nats)")
    return fig


def response_figure(tokens: pd.DataFrame, gate_weight: Optional[np.ndarray], width: int, tau_tail: float,
                    sample_id: int) -> go.Figure:
    """Drill-down of one response: δ per token (bars coloured by δ), segment boundaries every
    ``width`` positions, tail tokens marked, advantage sign in the title, and the Gate weight per token.

    Args:
        tokens: the response's token rows (``position``, ``learner_logp``, ``sampler_logp``, ``advantage``).
        gate_weight: ``(n,)`` Gate weight per token (same order) or None.
    """
    t = tokens.sort_values("position")
    pos = t["position"].to_numpy()
    delta = (t["learner_logp"].astype(np.float64) - t["sampler_logp"].astype(np.float64)).to_numpy()
    token_adv = t["advantage"].to_numpy(np.float64)
    adv = float(token_adv.mean()) if len(t) else math.nan       # shown; the sign is the definition's
    negative = bool(is_negative_response(token_adv.clip(min=0).sum(), (-token_adv).clip(min=0).sum()))
    rows = 2 if gate_weight is not None else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.68, 0.32][:rows] if rows == 2 else None,
                        subplot_titles=["δ per token (nats)", "Gate weight"][:rows])
    lim = max(float(np.abs(delta).max()) if delta.size else 1.0, 1e-6)
    color = dict(color=delta.tolist(), colorscale="RdBu", cmin=-lim, cmax=lim,
                 colorbar=dict(title="δ", len=0.6, y=0.7))
    common = dict(x=pos.tolist(), y=delta.tolist(), name="δ", meta={"sample_id": int(sample_id), "column": "delta"},
                  hovertemplate="position %{x}<br>δ %{y:.4f}<extra></extra>")
    short = pos.size <= 200                   # bars read well up to ~200 tokens; beyond, coloured points
    fig.add_trace(go.Bar(marker=color, **common) if short else
                  go.Scatter(mode="markers", marker=dict(size=5, **color), **common), row=1, col=1)
    # the tail tokens the localisation metrics count: those of a response with A < 0, each token's A and δ in
    # float32 as recorded
    delta32 = t["learner_logp"].to_numpy(np.float32) - t["sampler_logp"].to_numpy(np.float32)
    tail = (is_tail(t["advantage"].to_numpy(np.float32), delta32, tau_tail) & negative if math.isfinite(tau_tail)
            else np.zeros(delta.size, bool))
    if tail.any() and short:
        fig.add_trace(go.Scatter(x=pos[tail].tolist(), y=delta[tail].tolist(), mode="markers", name="tail token",
                                 marker=dict(symbol="x", size=7, color="#111827"), meta={"column": "tail"}),
                      row=1, col=1)
    if math.isfinite(tau_tail):
        fig.add_hline(y=tau_tail, line=dict(color="#dc2626", dash="dash", width=1), row=1, col=1)
    if gate_weight is not None:
        fig.add_trace(go.Scatter(x=pos.tolist(), y=np.asarray(gate_weight, dtype=float).tolist(), mode="lines",
                                 line=dict(shape="hv", color="#7c3aed", width=2), name="Gate weight",
                                 meta={"sample_id": int(sample_id), "column": "gate_weight"}), row=2, col=1)
        fig.update_yaxes(range=[0, 1.05], row=2, col=1)
    bounds = (range((segment_number(int(pos.min()), width) + 1) * width, int(pos.max()) + 1, width) if pos.size
              else range(0))                          # the first position of each segment after the first
    if len(bounds):
        # the first boundary through add_vline (its shapes in each non-empty subplot), the others as copies of those
        # shapes set at once: the same layout, where an add_vline per boundary revalidated every shape so far
        # (quadratic: 1.3 s of a page for a 2k-token response)
        before = len(fig.layout.shapes)
        fig.add_vline(x=bounds[0] - 0.5, line=dict(color="#9ca3af", width=1, dash="dot"))
        shapes = [sh.to_plotly_json() for sh in fig.layout.shapes]
        one = shapes[before:]
        fig.layout.shapes = shapes + [{**sh, "x0": b - 0.5, "x1": b - 0.5} for b in bounds[1:] for sh in one]
    sign = "A < 0 (negative)" if negative else "A > 0 (positive)" if adv > 0 else "A = 0"
    _layout(fig, f"Response {sample_id} · {sign}, A = {adv:+.3f} · {len(t)} tokens · segments of {width}",
            height=420 if rows == 2 else 300, hovermode="closest", showlegend=False)
    fig.update_xaxes(title_text="position", row=rows, col=1)
    if pos.size and int(pos.max()) - int(pos.min()) <= 40:
        fig.update_xaxes(dtick=1)
    return fig


def gate_weights(batch, manifest):
    """Gate weight each token of ``batch`` would get (``(N,)`` float32 numpy, TokenBatch order).

    Uses :class:`~triage_monitor.triage.controller.TriageController` with the Gate
    settings found in the :class:`~triage_monitor.rundir.manifest.RunManifest` (``info.triage_config`` or
    ``info.demo_config``, fields of ``TriageConfig``), the docs/metrics.md#gate
    defaults otherwise; no calibration state (fixed thresholds).
    """
    from ..triage.controller import TriageConfig, TriageController

    info = manifest.info if isinstance(manifest.info, dict) else {}
    src = info.get("triage_config") or info.get("demo_config") or {}
    names = {f.name for f in fields(TriageConfig)} - {"calibration", "repair", "tis"}
    kw = {k: v for k, v in src.items() if k in names}
    try:
        cfg = TriageConfig(**kw, repair=False, tis=False)
    except (TypeError, ValueError):
        cfg = TriageConfig(repair=False, tis=False)
    return TriageController(cfg)(batch, step=0).gate_weights.numpy(), cfg


#: The manifest ``info`` entries :func:`run_overview` shows (as strings, where the run has them), in its order.
RunFact = Literal["model", "task", "framework", "sampler_recipe", "learner_recipe", "correction", "sampler_logp"]
RUN_FACTS: tuple[RunFact, ...] = get_args(RunFact)


class _RunHeadline(TypedDict):
    """The keys every :func:`run_overview` has."""

    run: str
    path: str
    status: str
    steps: int
    first_step: Optional[int]
    last_step: Optional[int]
    tokens: int
    alerts: int
    window: int
    segment_width: int
    tau_tail: Optional[float]
    created: str
    tool_version: str


class RunOverview(_RunHeadline, total=False):
    """:func:`run_overview`: the headline keys, then the :data:`RUN_FACTS` the manifest's ``info`` holds."""

    model: str
    task: str
    framework: str
    sampler_recipe: str
    learner_recipe: str
    correction: str
    sampler_logp: str


def run_overview(run, steps: pd.DataFrame, alerts: Optional[pd.DataFrame] = None) -> RunOverview:
    """Headline facts of a run: name, status, steps, tokens, alerts, and the manifest's model /
    recipe / correction / config entries (strings)."""
    m = run.manifest
    info = m.info if isinstance(m.info, dict) else {}
    n_steps = int(len(steps))
    tokens = int(np.nansum(steps["n_tokens"].to_numpy(dtype=float))) if "n_tokens" in steps.columns else 0
    out: RunOverview = {
        "run": run.path.name, "path": str(run.path), "status": str(m.status or "unknown"),
        "steps": n_steps, "first_step": int(steps["step"].min()) if n_steps else None,
        "last_step": int(steps["step"].max()) if n_steps else None, "tokens": tokens,
        "alerts": int(len(alerts)) if alerts is not None and "rule" in alerts.columns else 0,
        "window": run.config.window, "segment_width": run.config.metrics.segment_width,
        "tau_tail": run.tau_tail, "created": m.created, "tool_version": m.tool_version}
    for k in RUN_FACTS:
        if k in info:
            out[k] = str(info[k])
    return out


# ----------------------------------------------------------------------------------- step time, full cycle
#: Colours of the phases (docs/metrics.md#step-time-and-the-full-cycle): generation stands out, the phases a faster
#: generator does not touch in muted tones.
PHASE_COLORS = {"generation": "#dc2626", "logprob": "#2563eb", "reference": "#7c3aed", "reward": "#d97706",
                "update": "#059669", "weight_sync": "#0891b2", "quantize": "#db2777", "other": "#6b7280",
                "untimed": "#d1d5db"}


def cycle_figure(steps: pd.DataFrame, k: float = 2.3, label: str = "", device: Optional[str] = None,
                 destabilised: Optional[int] = None) -> Optional[go.Figure]:
    """Where each step's time went: stacked seconds per phase (and the untimed rest) per step on top; below, the
    generation share g per step and the projected full-cycle speedup at ``k`` (right axis)
    (docs/metrics.md#step-time-and-the-full-cycle).

    Args:
        steps: the run's steps table (``time/<phase>`` columns) or :func:`triage_monitor.metrics.timings.cycle_frame`'s output.
        k: generator speedup of the projection; label: the run's name; device: where it ran (the title says
            "CPU figures" for ``"cpu"``); destabilised: the step marked on both rows (:func:`add_destabilisation_marker`).

    Returns:
        The figure (trace ``meta``: ``{"phase": p}`` for the bars, ``{"column": "g"}``, ``{"column": "projected",
        "k": k}``), or None when no step is timed.
    """
    from ..metrics.timings import LABELS, PHASES, cycle_frame, figures

    f = steps if "total" in steps.columns else cycle_frame(steps, k)
    if f.empty:
        return None
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.09, row_heights=[0.64, 0.36],
                        specs=[[{}], [{"secondary_y": True}]],
                        subplot_titles=["seconds per step, by phase", f"generation share g and projected speedup at k = {k:g}"])
    x = f["step"].tolist()
    for p in (*PHASES, "untimed"):
        s = f[p].astype(float) if p in f.columns else None
        if s is None or not s.notna().any() or (p == "untimed" and not (s.abs() > 1e-12).any()):
            continue
        fig.add_trace(go.Bar(x=x, y=_values(s.clip(lower=0) if p == "untimed" else s, 1.0), name=LABELS[p],
                             marker_color=PHASE_COLORS[p], meta={"phase": p},
                             hovertemplate=f"{LABELS[p]}: %{{y:.4g}} s<extra>step %{{x}}</extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=_values(f["g"], 1.0), mode="lines+markers", name="g = generation / step",
                             line=dict(color=PHASE_COLORS["generation"], width=2), marker=dict(size=4),
                             meta={"column": "g"}), row=2, col=1, secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=_values(f["projected"], 1.0), mode="lines", name=f"projected speedup at k = {k:g}",
                             line=dict(color="#111827", width=2, dash="dot"), meta={"column": "projected", "k": k}),
                  row=2, col=1, secondary_y=True)
    add_destabilisation_marker(fig, destabilised, row="all", col=1)
    where = f" · {figures(device)}" if device else ""
    _layout(fig, "Step time and the full cycle" + (f" · {label}" if label else "") + where, height=520,
            barmode="stack", bargap=0.05, margin=dict(l=60, r=60, t=64, b=70 + 20 * math.ceil(len(fig.data) / 6)),
            legend=dict(orientation="h", yanchor="top", y=-0.1, x=0, xanchor="left", font=dict(size=11),
                        traceorder="normal"))
    fig.update_yaxes(title_text="s", row=1, col=1)
    fig.update_yaxes(title_text="g", range=[0, 1], row=2, col=1, secondary_y=False)
    top = float(np.nanmax(f["projected"].to_numpy(dtype=float))) if f["projected"].notna().any() else 1.0
    fig.update_yaxes(title_text="speedup ×", row=2, col=1, secondary_y=True, range=[0, max(top, 1.0) * 1.15],
                     tick0=0, dtick=0.5 if top <= 4 else None, showgrid=False)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_annotations(font_size=12)
    return fig


def cycle_bars_figure(summaries: Mapping[str, CycleSummary], title: str = "Mean step time by phase",
                      device: Optional[str] = None) -> Optional[go.Figure]:
    """One horizontal bar per run (label → :class:`~triage_monitor.metrics.timings.CycleSummary`): its mean seconds per step,
    stacked by phase (the untimed rest last), each bar's g and projection in its hover text.  Trace ``meta``:
    ``{"phase": p}``, ``x`` the runs' mean seconds in the order of ``summaries``.  None when no run is timed."""
    from ..metrics.timings import LABELS, PHASES, figures

    runs = {k: s for k, s in summaries.items() if getattr(s, "steps", 0)}
    if not runs:
        return None
    names = list(runs)
    fig = go.Figure()
    for p in (*PHASES, "untimed"):
        vals = [runs[n].mean.get(p) for n in names]
        if all(v is None or not math.isfinite(v) or (p == "untimed" and abs(v) < 1e-12) for v in vals):
            continue
        xs = [max(v, 0.0) if v is not None and math.isfinite(v) else 0.0 for v in vals]
        fig.add_trace(go.Bar(y=names, x=xs, orientation="h", name=LABELS[p], marker_color=PHASE_COLORS[p],
                             meta={"phase": p}, hovertemplate=f"{LABELS[p]}: %{{x:.4g}} s<extra>%{{y}}</extra>"))
    text = [f"g = {runs[n].g:.2f}, {runs[n].projected:.2f}× at k = {runs[n].k:g}" if math.isfinite(runs[n].g)
            else "generation not timed" for n in names]
    fig.add_trace(go.Scatter(y=names, x=[runs[n].mean.get("step", 0.0) for n in names], mode="text", text=text,
                             textposition="middle right", showlegend=False, hoverinfo="skip", meta={"text": "g"}))
    where = f" · {figures(device)}" if device else ""
    _layout(fig, title + where, height=170 + 46 * len(names), barmode="stack", hovermode="closest",
            margin=dict(l=120, r=40, t=46, b=70), legend=dict(orientation="h", yanchor="top", y=-0.3, x=0,
                                                             xanchor="left", font=dict(size=11), traceorder="normal"))
    longest = max(runs[n].mean.get("step", 0.0) for n in names)
    fig.update_xaxes(title_text="seconds per step (mean)", range=[0, longest * 1.45 if longest > 0 else 1])
    return fig
