"""``triage-monitor report RUN_DIR -o report.html``: one self-contained HTML post-mortem.

The file holds the overview (manifest facts, steps, tokens, alerts), the key
time series (ρ_asym raw and length-normalised, small-gap share, δ q0.05, k3 KL,
reward), the quadrant-mass chart, the localisation chart, the step time by phase with the
generation share and the projected full-cycle speedup (docs/metrics.md#step-time-and-the-full-cycle;
with two runs, the second compared with the first as the baseline) and the docs/metrics.md#stages
stage table with the C_tok shuffle null.  plotly.js is embedded inline, so the
file opens without any network access and can be attached to a ticket.
Several run directories are overlaid in the time series; the first one is
the subject of the other sections.
"""

from __future__ import annotations

import concurrent.futures as cf
import html
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, NamedTuple, Optional, Sequence

import pandas as pd

from ..metrics import names as metric_names
from .analysis import Run, RunDirError, open_run, postmortem_frame
from .verdict import reference_of_run, verdict_of_steps
from .stages import degenerate_notice, format_stage_table, stage_table
from ..metrics.timings import DEFAULT_K
from .. import exits
from . import views

if TYPE_CHECKING:
    import plotly.graph_objects as go

REPORT_PANELS = ("direction", "small_gap", "delta_q05", "k3_kl", "reward", "controller")

_CSS = """
body {font-family: Inter, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; color: #111827; background: #f9fafb;}
main {max-width: 1480px; margin: 0 auto; padding: 28px 32px 60px;}
h1 {font-size: 28px; margin: 0 0 4px;} h2 {font-size: 20px; margin: 34px 0 10px; border-bottom: 1px solid #e5e7eb;
padding-bottom: 6px;}
.sub {color: #6b7280; font-size: 13px; margin-bottom: 18px;}
.cards {display: grid; grid-template-columns: repeat(6, 1fr); gap: 12px;}
.card {background: white; border: 1px solid #e5e7eb; border-radius: 8px; padding: 10px 14px;}
.card .k {color: #6b7280; font-size: 12px;} .card .v {font-size: 20px; font-weight: 600; margin-top: 2px;}
.grid {display: grid; grid-template-columns: 1fr 1fr; gap: 14px;}
.chart {background: white; border: 1px solid #e5e7eb; border-radius: 8px; padding: 4px;}
table {border-collapse: collapse; font-size: 12.5px; background: white; width: 100%;}
th, td {border: 1px solid #e5e7eb; padding: 5px 8px; text-align: right; white-space: nowrap;}
th {background: #f3f4f6; font-weight: 600;} td:first-child, th:first-child {text-align: left;}
table.stage-table {font-size: 12px;} table.stage-table th {white-space: normal; min-width: 44px;}
table.stage-table th, table.stage-table td {padding: 4px 6px;}
.notice {background: #fffbeb; border: 1px solid #f59e0b; border-radius: 6px; padding: 8px 12px; margin: 10px 0;
font-size: 13px; color: #78350f;}
table.facts td {text-align: left; white-space: normal;} table.facts td:first-child {width: 180px; color: #374151;}
.note {color: #4b5563; font-size: 12.5px; margin-top: 6px;}
.scroll {overflow-x: auto;}
.verdict {border-radius: 6px; padding: 10px 14px; margin: 8px 0 4px; font-size: 14px; font-weight: 600;
border: 1px solid #d1d5db; background: #f3f4f6;}
.verdict-ok {background: #ecfdf5; border-color: #10b981; color: #065f46;}
.verdict-watch {background: #fffbeb; border-color: #f59e0b; color: #78350f;}
.verdict-warning {background: #fff7ed; border-color: #ea580c; color: #7c2d12;}
.verdict-critical {background: #fef2f2; border-color: #dc2626; color: #7f1d1d;}
.verdict .rest {font-weight: 400; font-size: 13px; margin-top: 6px; white-space: pre-wrap;}
.legend-note {color: #374151; font-size: 12.5px; margin: 6px 0;}
.swatch {display: inline-block; width: 22px; height: 4px; vertical-align: middle; margin: 0 4px 0 10px;}
"""


def verdict_html(verdict) -> str:
    """The run verdict (:class:`~triage_monitor.offline.verdict.RunVerdict`) as the report's top banner: its first line in
    bold, the other lines below, the JSON beside it (``<script id="triage-verdict" type="application/json">``)."""
    import json

    data = json.dumps(verdict.to_dict(), ensure_ascii=False).replace("</", "<\\/")
    rest = "\n".join(line.strip() for line in verdict.lines[1:])
    level = verdict.level.lower().replace(" ", "-")
    return (f'<div class="verdict verdict-{level}" id="verdict">'
            f'{html.escape(verdict.lines[0])}<div class="rest">{html.escape(rest)}</div></div>'
            f'<script type="application/json" id="triage-verdict">{data}</script>')


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.2f}" if pct else f"{v:.4g}"
    return html.escape(str(v))


def _stage_html(table: pd.DataFrame) -> str:
    shown = format_stage_table(table)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.columns)
    rows = []
    for r in shown.itertuples(index=False):
        cells = [f"<td>{_fmt(v, '%' in c or 'pts' in c)}</td>" for c, v in zip(shown.columns, r)]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table class="stage-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


class CycleSection(NamedTuple):
    """The report's step-time section: its HTML and its figures (in page order)."""

    section: str
    figures: list[go.Figure]


def _cycle_html(runs: Sequence[Run], names: Sequence[str], subject_steps: pd.DataFrame, k: float,
                destabilised: Optional[int] = None) -> CycleSection:
    """(section HTML, figures) of the step time and the full cycle: the subject run's breakdown; with a second run,
    the comparison (the first run the baseline).  Empty when the subject has no phase timing."""
    from ..metrics.timings import compare_cycles, cycle_frame, cycle_summary, device_of, figures

    frame = cycle_frame(subject_steps, k)
    if frame.empty:
        return CycleSection("<h2>Step time and the full cycle</h2><div class=\"note\">No step of this run has phase "
                            "timings (<code>time/&lt;phase&gt;</code> columns): a hook records them where it sees the "
                            "framework's timers, a loop of your own passes <code>log_step(timings=...)</code> "
                            "(docs/hooks.md#phase-timings).</div>", [])
    info = runs[0].manifest.info if isinstance(runs[0].manifest.info, dict) else {}
    device = device_of(info)
    summary = cycle_summary(frame, k)
    lines = "".join(f"<li>{html.escape(x)}</li>" for x in summary.lines(device))
    figs = [views.cycle_figure(frame, k, names[0], device, destabilised)]
    cpu = (f'<div class="notice">{html.escape(figures(device))}: measured on this machine\'s {html.escape(device)}; '
           "on an accelerator the phases' shares differ (and NVFP4 emulated on a CPU is slower than full precision, "
           "where native NVFP4 kernels are faster).</div>" if device and device.startswith("cpu") else "")
    out = (f"<h2>Step time and the full cycle</h2>{cpu}<ul>{lines}</ul><div class=\"note\">Generation share g = "
           f"generation / step; projected full-cycle speedup 1 / ((1 − g) + g / k) for a generator k = {k:g}× "
           "faster, every other phase unchanged (docs/metrics.md#step-time-and-the-full-cycle).</div>")
    other = runs[1] if len(runs) > 1 else None
    if other is not None:
        osteps = other.steps()
        if not cycle_frame(osteps, k).empty:
            cmp = compare_cycles(subject_steps, osteps, k)
            pair = [names[0], names[1]]
            rows = "".join(
                f"<tr><td>{html.escape(r['label'])}</td><td>{_fmt(r['base_s'])}</td><td>{_fmt(r['other_s'])}</td>"
                f"<td>{_fmt(r['speedup'])}{'×' if r['speedup'] == r['speedup'] else ''}</td>"
                f"<td>{'yes' if r['sped_up_by_generator'] else ('' if r['phase'] == 'step' else 'no')}</td></tr>"
                for _, r in cmp.table.iterrows())
            alerts = [len(a) if "rule" in a.columns else 0 for a in (runs[0].alerts(), other.alerts())]
            mrows = "".join(f"<tr><td>{html.escape(r['figure'])}</td><td>{_fmt(r['base'])}</td><td>{_fmt(r['other'])}"
                            "</td></tr>" for _, r in cmp.mismatch.iterrows())
            mrows += f"<tr><td>alerts raised</td><td>{alerts[0]}</td><td>{alerts[1]}</td></tr>"
            head = "".join(f"<th>{html.escape(c)}</th>" for c in ("phase", f"{pair[0]} (s)", f"{pair[1]} (s)",
                                                                 "measured speedup", "a faster generator speeds it up"))
            said = "".join(f"<li>{html.escape(x)}</li>" for x in cmp.lines(pair))
            out += (f"<h3>{html.escape(pair[1])} compared with {html.escape(pair[0])} (the baseline)</h3>"
                    f"<ul>{said}</ul><div class=\"grid\"><div><table class=\"cycle-compare\"><thead><tr>{head}</tr>"
                    f"</thead><tbody>{rows}</tbody></table></div><div><table class=\"cycle-mismatch\"><thead><tr>"
                    f"<th>mismatch</th><th>{html.escape(pair[0])}</th><th>{html.escape(pair[1])}</th></tr></thead>"
                    f"<tbody>{mrows}</tbody></table></div></div>")
            figs.append(views.cycle_bars_figure({pair[0]: cmp.base, pair[1]: cmp.other},
                                                "Mean step time by phase, the two runs", device))
    return CycleSection(out, [f for f in figs if f is not None])


def build_report(run_dirs: Sequence, *, anchors: Optional[Sequence[int]] = None, window: Optional[int] = None,
                 draws: int = 499, seed: int = 0, progress: bool = False, k: float = DEFAULT_K,
                 reference=None) -> str:
    """The report's HTML text (see module docstring).

    Args:
        run_dirs: one or more run directories (paths or opened :class:`~triage_monitor.offline.analysis.Run`); the first
            is the subject, all are overlaid in the time series.
        anchors: stage anchor steps (None: 25/50/75/100 %); window: trailing window in steps (None: the run's).
        draws, seed: C_tok shuffle-null draws and seed (docs/metrics.md#localisation).
        k: generator speedup of the full-cycle projection (docs/metrics.md#step-time-and-the-full-cycle; default 2.3).
        progress: print what is being computed on stderr (one line per phase, a bar for the per-step states).
        reference: a reference run (path or :class:`~triage_monitor.offline.analysis.Run`; docs/alerts.md#a-reference-run):
            its window ρ_asym range is the healthy band of the ρ_asym chart and of the verdict, and its series are
            overlaid in grey.

    Raises:
        RunDirError: a path is not a run directory; ValueError: the first run has no recorded step,
            or an anchor step was not recorded.
    """
    runs = [p if isinstance(p, Run) else open_run(p) for p in run_dirs]
    if not runs:
        raise RunDirError("give at least one run directory")
    run = runs[0]
    steps = run.steps()
    if steps.empty:
        raise ValueError(f"{run.path}: the run has no recorded steps yet, nothing to report")
    alerts = run.alerts()
    ov = views.run_overview(run, steps, alerts)
    ref_run = None if reference is None else reference if isinstance(reference, Run) else open_run(reference)
    band = None if ref_run is None else reference_of_run(ref_run)
    verdict = verdict_of_steps(steps, reference=band)
    destabilised = verdict.outcome["step"]
    win = int(window or run.config.window)
    frames, alert_frames = {}, {}
    names = [r.path.name for r in runs]
    subject_states = None
    say = (lambda msg: exits.note("report", msg)) if progress else (lambda msg: None)
    for r, name in zip(runs, names):
        label = f"{r.path.parent.name}/{name}" if names.count(name) > 1 else name
        if progress and r.step_numbers():     # fills the states cache postmortem_frame reads, with a bar
            from .analysis import recompute_states

            say(f"{r.path}: per-step metric states of {len(r.step_numbers())} step(s) …")
            recompute_states(r, cache=True, progress=True)
        # one frozen tau_tail for every step (the first ones included), from the cached per-step states
        frame, states = postmortem_frame(r, win)
        if subject_states is None and r is run:
            subject_states = states
        frames[label], alert_frames[label] = frame, r.alerts()
    subject = next(iter(frames))
    ref_label = None
    if ref_run is not None:                  # its live rows: the reference is drawn, not analysed
        ref_label = f"{ref_run.path.name} (reference)" if ref_run.path.name in frames else ref_run.path.name
        frames[ref_label], alert_frames[ref_label] = ref_run.steps(), ref_run.alerts().iloc[0:0]
    say(f"stage table and C_tok shuffle null ({draws} draws) …")
    # the stage table's null draws (compiled, outside the GIL) run on their threads while the figures are built
    with cf.ThreadPoolExecutor(1) as pool:
        staged = pool.submit(stage_table, run, anchors, window=win, draws=draws, seed=seed, metrics=frames[subject],
                             states=subject_states)
        panels = [views.timeseries_figure(frames, p, True, win, alert_frames, reference=ref_label, band=band,
                                          destabilised=destabilised) for p in REPORT_PANELS]
        figs = [f for f in panels if f is not None]
        figs += [views.quadrant_figure(frames[subject], True, subject, destabilised=destabilised),
                 views.localisation_figure(frames[subject], True, subject, destabilised=destabilised)]
        cycle_html, cycle_figs = _cycle_html(runs, list(frames), steps, k, destabilised)
        divs = [f.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False, default_width="100%",
                          config={"displaylogo": False, "responsive": True}) for i, f in enumerate(figs + cycle_figs)]
        table = staged.result()
    cycle_divs = "".join(f'<div class="chart">{d}</div>' for d in divs[len(figs):])
    divs = divs[:len(figs)]

    tau = ov["tau_tail"]
    cards = [("Steps", f"{ov['steps']:,}"), ("Tokens", f"{ov['tokens']:,}"), ("Alerts", str(ov["alerts"])),
             ("Correction", ov.get("correction", "-")), ("Window", f"{win} steps"),
             (metric_names.label("tau_tail"), _fmt(float(tau)) if tau is not None else "-")]
    card_html = "".join(f'<div class="card"><div class="k">{k}</div><div class="v">{html.escape(v)}</div></div>'
                        for k, v in cards)
    fact_keys = ("path", "status", "model", "task", "framework", "sampler_recipe", "learner_recipe", "correction",
                 "sampler_logp", "segment_width", "created", "tool_version")
    by_name: Mapping[str, object] = ov        # the facts table reads the overview's keys by name
    facts = "".join(f"<tr><td>{k.replace('_', ' ')}</td><td>{_fmt(by_name[k])}</td></tr>" for k in fact_keys
                    if by_name.get(k) is not None)
    alert_html = ""
    if ov["alerts"]:
        cols = [c for c in ("step", "level", "rule", "metric", "value", "threshold", "title") if c in alerts]
        alert_html = "<h2>Alerts</h2>" + alerts[cols].to_html(index=False, classes="alerts", border=0,
                                                             float_format=lambda x: f"{x:.4g}")
    charts = "".join(f'<div class="chart">{d}</div>' for d in divs)
    notice = degenerate_notice(table, run.config.metrics.segment_width)
    notice_html = f'<div class="notice degenerate">{html.escape(notice)}</div>' if notice else ""
    unreadable_html = ""
    for r in runs:
        bad = list(getattr(r, "unreadable", []) or [])
        if bad:
            items = "".join(f"<li><code>{html.escape(str(p))}</code>: {html.escape(str(why))}</li>" for p, why in bad[:50])
            more = f"<li>… {len(bad) - 50} more</li>" if len(bad) > 50 else ""
            unreadable_html += (f'<div class="notice unreadable"><b>{len(bad)} unreadable file(s)</b> in '
                                f'<code>{html.escape(str(r.path))}</code> were skipped; everything below is computed '
                                f'without them:<ul>{items}{more}</ul></div>')
    legend = _legend_html(subject, ref_label, destabilised)
    overlay = f" · overlay of {len(frames)} runs: {', '.join(map(html.escape, frames))}" if len(frames) > 1 else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>triage-monitor post-mortem · {html.escape(ov['run'])}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body><main>
<h1>triage-monitor post-mortem · {html.escape(ov['run'])}</h1>
<div class="sub">generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from <code>{html.escape(ov['path'])}</code>
{overlay}</div>
{unreadable_html}
{verdict_html(verdict)}
<h2>Overview</h2><div class="cards">{card_html}</div>
<table class="facts" style="margin-top:14px">{facts}</table>
{alert_html}
<h2>Time series, quadrants and localisation</h2>
<div class="note">Pooled trailing {win}-step windows (raw sums of the window, docs/metrics.md#steps-and-windows); reward and controller
columns are trailing means of the per-step values; alerts as ▼ markers. On the ρ_asym chart the green band is the
published healthy range (1.023 dense 4B – 1.337 MoE 30B), the grey band a reference run's range when one is given,
grey shading the steps at noise level, and the dashed lines the shipped alert thresholds.</div>
{legend}
<div class="grid">{charts}</div>
{cycle_html}
{cycle_divs}
<h2>Stages (docs/metrics.md#stages)</h2>
{notice_html}
{_stage_html(table)}
<div class="note">Trailing {win}-step windows ending at each anchor. C_tok null: tail labels shuffled uniformly
within each A&lt;0 response ({draws} draws, seed {seed}); 95 % = central interval; excess = C_tok − null median
(points). Dilution: share of A&lt;0 responses with a tail-heavy segment whose mean |δ| &lt; 0.05.</div>
</main></body></html>
"""


def _legend_html(subject: str, ref_label: Optional[str], destabilised: Optional[int]) -> str:
    """The colour convention of the charts (views.run_roles), stated once above them."""
    def swatch(color):
        return f'<span class="swatch" style="background:{color}"></span>'
    parts = [f"{swatch(views.INSPECTED_COLOR)}the run inspected ({html.escape(subject)})"]
    if ref_label is not None:
        parts.append(f"{swatch(views.REFERENCE_COLOR)}the reference ({html.escape(ref_label)})")
    if destabilised is not None:
        parts.append(f"{swatch(views.MARKER_COLOR)}dash-dot line: destabilised at step {destabilised}")
    return ('<div class="legend-note">Colours: ' + "".join(parts) + " — the study draws its failing arm in the same "
            "red and its control in the same grey.</div>")


def write_report(run_dirs: Sequence, output, **kw) -> Path:
    """Write :func:`build_report` to ``output`` (atomically, through a temporary file); returns the path."""
    out = Path(output)
    text = build_report(run_dirs, **kw)
    from ..rundir.storage import open_store

    open_store(str(out.parent)).write_bytes(out.name, text.encode("utf-8"))   # whole or nothing, no temp left
    return out
