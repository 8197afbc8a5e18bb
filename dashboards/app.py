"""triage-monitor post-mortem dashboard (Streamlit).

Start it with ``triage-monitor dashboard RUN_DIR [RUN_DIR ...]`` (or
``streamlit run app.py -- RUN_DIR ...``; the environment variable
``TRIAGE_MONITOR_RUNS``, os.pathsep-separated (an ``s3://`` URI's colon does not separate), is read when no argument is
given).  It answers "when did direction go wrong, where in the responses, and
would TRIAGE have caught it": overview, time series with a trailing-window
toggle, quadrant masses, localisation, the step time by phase with the
generation share and the projected full-cycle speedup (and two runs compared:
docs/metrics.md#step-time-and-the-full-cycle), one step's δ distribution and segment
heatmap, a response drill-down with Gate weights, the docs/metrics.md#stages stage table
and overlays of several runs.

Runs are read only through :mod:`triage_monitor.offline.analysis`.  Step-level data
comes first; token data is loaded lazily for the chosen step only, and every
load is cached (``st.cache_data``) under a signature of the run directory, so a
run still being written refreshes on rerun.  A path that is not a run, an
empty run or a run being written gives a message in the page, never a traceback.
"""

from __future__ import annotations

import html
import math
import re
import os
import sys
from pathlib import Path
from typing import Optional, TypedDict

import numpy as np
import pandas as pd
import streamlit as st

from triage_monitor.offline.analysis import Run, RunDirError, RunSignature, open_run, recompute, run_signature
from triage_monitor.config import MonitorConfig
from triage_monitor.metrics.names import label
from triage_monitor.offline import views
from triage_monitor.offline.verdict import VerdictDict
from triage_monitor.dashboards.launch import ROOT_ARG, LoadedRun, PostmortemView, StepDetail, check_location

TOKEN_COLUMNS = ["sample_id", "group_id", "position", "learner_logp", "sampler_logp", "advantage"]
#: Above this many tokens in the anchor windows the stage table waits for a click (it reads them all).
STAGE_AUTO_TOKENS = int(os.environ.get("TRIAGE_MONITOR_STAGE_AUTO_TOKENS", 5_000_000))


class BandFields(TypedDict):
    """The reference band in :func:`load_verdict`: :class:`~triage_monitor.offline.verdict.ReferenceBand`'s fields."""

    label: str
    lo: float
    hi: float
    windows: int
    noise: int
    note: str


class PageVerdict(VerdictDict):
    """:func:`load_verdict`: the run verdict's JSON dict and the reference band it was judged against (or None)."""

    band: Optional[BandFields]


# ----------------------------------------------------------------------------- data (cached)
def _signature(path: str) -> RunSignature:
    """Changes whenever the run gains step files or its manifest is rewritten (cache key;
    :func:`triage_monitor.offline.analysis.run_signature`)."""
    return run_signature(path)


@st.cache_resource(show_spinner=False, max_entries=8)
def run_of(path: str, sig: tuple) -> Run:
    """The run at ``path`` as listed at signature ``sig``, opened once and shared by every read of the page (a new
    signature — new step files, a rewritten manifest — opens it again); raises RunDirError for a non-run."""
    return open_run(path)


@st.cache_data(show_spinner=False, max_entries=32)
def load_run(path: str, sig: tuple) -> LoadedRun:
    """:class:`LoadedRun` (RunManifest, live step metrics, alerts, unreadable files) of a run; raises RunDirError
    for a non-run directory.  The live rows' steps are the page's snapshot of the run: every later read is limited
    to them, so a run being written is drawn from one listing (the overview, the charts and the stage table
    agree)."""
    run = run_of(path, sig)
    steps, alerts = run.steps(), run.alerts()
    return LoadedRun(run.manifest, steps, alerts, list(run.unreadable))


def snapshot_steps(path: str) -> tuple[int, ...]:
    """The steps of the page's one snapshot of ``path`` (the live rows :func:`load_run` read)."""
    return tuple(int(x) for x in runs[path][1]["step"])


@st.cache_data(show_spinner=False, max_entries=16)
def load_tokens(path: str, step: int, sig: tuple) -> pd.DataFrame:
    """Token rows of one step (the only token-level read of a page view)."""
    return run_of(path, sig).tokens(step, TOKEN_COLUMNS)


@st.cache_data(show_spinner=False, max_entries=8)
def load_recomputed(path: str, window: int, sig: tuple, snap: tuple) -> pd.DataFrame:
    """Metrics of the snapshot's steps ``snap`` recomputed from the token files with another trailing window."""
    run = run_of(path, sig)
    todo = sorted(set(run.step_numbers()) & set(snap))
    return recompute(run, window=window, steps=todo) if todo else pd.DataFrame()


@st.cache_data(show_spinner=False, max_entries=8)
def load_postmortem(path: str, window: int, sig: tuple, snap: tuple) -> PostmortemView:
    """:class:`PostmortemView` (frame, unreadable files): step and window metrics of the snapshot's steps with the
    run's one frozen tau_tail for every step (the cached per-step states; the live rows when the run has no token
    records)."""
    from triage_monitor.offline.analysis import postmortem_frame

    run = run_of(path, sig)
    frame = postmortem_frame(run, window, live=load_run(path, sig)[1], steps=snap)[0]
    return PostmortemView(frame, list(run.unreadable))


@st.cache_data(show_spinner=False, max_entries=8)
def load_stage_table(path: str, anchors, window: int, draws: int, sig: tuple, snap: tuple) -> pd.DataFrame:
    """The stage table of the snapshot's steps ``snap`` (:func:`triage_monitor.offline.stages.stage_table`)."""
    from triage_monitor.offline.stages import stage_table

    return stage_table(run_of(path, sig), list(anchors) if anchors else None, window=window, draws=draws, seed=0,
                       steps=snap, metrics=load_run(path, sig)[1])


@st.cache_data(show_spinner=False, max_entries=8)
def step_detail(path: str, step: int, tau: float, width: int, sig: tuple) -> StepDetail:
    """:class:`StepDetail` (δ array, tail layout, sample ids, gate weights, gate width, responses) of one step:
    ``responses`` is :meth:`~triage_monitor.offline.analysis.Run.responses` (each batch response's rank and recorded
    sample id: two ranks that reuse a sample id are two responses)."""
    from triage_monitor.offline.stages import tail_layout

    run = run_of(path, sig)
    batch = run.token_batch(step)
    delta = batch.delta.double().numpy()
    layout = tail_layout(batch, tau, width) if math.isfinite(tau) else None
    gw, cfg = views.gate_weights(batch, run.manifest)
    return StepDetail(delta, layout, batch.sample_id.numpy(), gw, cfg.gate_width, run.responses(step))


# ----------------------------------------------------------------------------- helpers
def _script_args() -> list[str]:
    """The arguments after ``--`` of ``streamlit run app.py`` (sys.argv), or [] when the page runs otherwise."""
    return list(sys.argv[1:]) if Path(sys.argv[0]).name == "app.py" else []


def _initial_runs() -> list[str]:
    """Run paths given after ``--`` to ``streamlit run app.py`` (sys.argv; the value of ``--reference`` is not one),
    else ``$TRIAGE_MONITOR_RUNS``."""
    argv, skip = _script_args(), False
    args: list[str] = []
    for a in argv:
        if skip:
            skip = False
        elif a == "--reference":
            skip = True
        elif not a.startswith("-"):
            args.append(a)
    if not args and os.environ.get("TRIAGE_MONITOR_RUNS"):
        args = _split_runs(os.environ["TRIAGE_MONITOR_RUNS"])
    return args


def _initial_reference() -> str:
    """The reference run given as ``--reference RUN`` (or ``--reference=RUN``) after ``--``, else
    ``$TRIAGE_MONITOR_REFERENCE``, else ""."""
    argv = _script_args()
    for i, a in enumerate(argv):
        if a == "--reference" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--reference="):
            return a.split("=", 1)[1]
    return os.environ.get("TRIAGE_MONITOR_REFERENCE", "")


@st.cache_data(show_spinner=False, max_entries=16)
def load_verdict(path: str, sig: tuple, ref_path: str, ref_sig: tuple) -> PageVerdict:
    """The run verdict of ``path`` (:func:`triage_monitor.offline.verdict.verdict_of_steps` on its live steps, the shipped
    rules replayed), against the reference run ``ref_path`` when given; as its JSON dict with ``band`` (the reference
    band's fields, or None)."""
    from triage_monitor.offline.verdict import reference_of_run, verdict_of_steps

    band = reference_of_run(run_of(ref_path, ref_sig)) if ref_path else None
    out: VerdictDict = verdict_of_steps(load_run(path, sig)[1], reference=band).to_dict()
    fields: Optional[BandFields] = None if band is None else {
        "label": band.label, "lo": band.lo, "hi": band.hi, "windows": band.windows, "noise": band.noise,
        "note": band.note}
    return {**out, "band": fields}


def _split_runs(text: str) -> list[str]:
    """The run locations of an os.pathsep-separated list; an ``s3://...`` URI's colon does not separate."""
    out: list[str] = []
    for piece in text.split(os.pathsep):
        if out and piece.startswith("//") and out[-1].isalnum():      # "s3" + "//bucket/run": one URI
            out[-1] = f"{out[-1]}:{piece}"
        elif piece:
            out.append(piece)
    return out


def _labels(paths: list[str]) -> dict[str, str]:
    """path -> short unique label (directory name, with its parent when names repeat)."""
    names = [Path(p).name or p for p in paths]
    return {p: (f"{Path(p).parent.name}/{n}" if names.count(n) > 1 else n) for p, n in zip(paths, names)}


def _chart(fig, key: str) -> None:
    if fig is not None:
        st.plotly_chart(fig, width="stretch", theme=None, key=key,
                        config={"displaylogo": False, "displayModeBar": "hover"})


def _fmt_int(v) -> str:
    return "-" if v is None else f"{int(v):,}"


# ----------------------------------------------------------------------------- page
st.set_page_config(page_title="triage-monitor · post-mortem", page_icon="📉", layout="wide")
st.markdown("""<style>
div.block-container {padding-top: 2.2rem; padding-bottom: 2rem;}
div[data-testid="stMetricValue"] {font-size: 1.45rem;}
h2 {margin-top: 0.8rem;}
div.triage-verdict {border-radius: 6px; padding: 10px 14px; margin: 4px 0 10px; font-size: 0.92rem;
border: 1px solid #d1d5db; background: #f3f4f6; color: #111827;}
div.triage-verdict b {font-size: 0.98rem;}
div.triage-verdict div.rest {white-space: pre-wrap; margin-top: 6px; font-size: 0.85rem;}
div.triage-verdict.ok {background: #ecfdf5; border-color: #10b981; color: #065f46;}
div.triage-verdict.watch {background: #fffbeb; border-color: #f59e0b; color: #78350f;}
div.triage-verdict.warning {background: #fff7ed; border-color: #ea580c; color: #7c2d12;}
div.triage-verdict.critical {background: #fef2f2; border-color: #dc2626; color: #7f1d1d;}
</style>""", unsafe_allow_html=True)

with st.sidebar:
    st.header("Runs")
    runs_text = st.text_area("Run directories (one per line)", "\n".join(_initial_runs()), key="runs_text",
                             height=110)
paths = list(dict.fromkeys(line.strip() for line in runs_text.splitlines() if line.strip()))
# what a visitor may open: the runs the command line gave, and runs under its --allow-root roots (launch.check_location);
# without --allow-root (`streamlit run app.py -- RUN`, $TRIAGE_MONITOR_RUNS) the roots are the runs given
_GIVEN = [*_initial_runs(), *([_initial_reference()] if _initial_reference() else [])]
_ROOTS = [a[len(ROOT_ARG):] for a in _script_args() if a.startswith(ROOT_ARG)] or list(_GIVEN)
_refused = {p: why for p in paths if (why := check_location(p, _ROOTS, _GIVEN))}
for _why in _refused.values():
    st.error(_why)
paths = [p for p in paths if p not in _refused]

st.title("triage-monitor · post-mortem")
if not paths:
    st.info("No run directory given. Start with `triage-monitor dashboard RUN_DIR [RUN_DIR ...]` or type a path "
            "in the sidebar.")
    st.stop()

# one listing of each run per page render: the signature and the live rows read here are passed to every
# later read (charts, localisation, stage table), so a run still being written is shown as one snapshot
sigs = {p: _signature(p) for p in paths}
runs, bad = {}, []
for p in paths:
    try:
        runs[p] = load_run(p, sigs[p])
    except RunDirError as exc:
        bad.append(str(exc))
    except Exception as exc:  # an unreadable file of a run being written: say so, never a traceback
        bad.append(f"{p}: could not be read ({type(exc).__name__}: {exc})")
for msg in bad:
    st.error(msg)
if not runs:
    st.warning("None of the given paths is a triage-monitor run directory (a run directory holds run.json, "
               "steps/ and tokens/, written by MismatchMonitor or `triage-monitor demo`).")
    st.stop()

labels = _labels(list(runs))
with st.sidebar:
    primary = st.selectbox("Run to inspect", list(runs), format_func=labels.get, key="primary")
    overlay = st.multiselect("Overlay in time series", list(runs), default=list(runs), format_func=labels.get,
                             key="overlay")
    reference_path = st.text_input("Reference run (its ρ_asym range is the healthy band)", _initial_reference(),
                                   key="reference", help="An on-policy or BF16 control of the same job "
                                                         "(docs/alerts.md#a-reference-run); empty: the published "
                                                         "band only.").strip()
    if reference_path and check_location(reference_path, _ROOTS, _GIVEN):
        st.error(check_location(reference_path, _ROOTS, _GIVEN))
        reference_path = ""
    st.header("View")
    view = st.radio("Values", ["per step", "trailing window"], index=1, horizontal=True, key="view")
    manifest, steps, alerts, _ = runs[primary]
    run_config = MonitorConfig.from_dict(manifest.monitor_config, strict=False)   # a newer release's keys: ignored
    run_window = run_config.window
    window_steps = int(st.number_input("Trailing window (steps)", 1, 100000, run_window, key="window_steps",
                                       help="The run's window uses the live pooled values; another window is "
                                            "recomputed from the token files (slower on large runs)."))
    cycle_k = float(st.number_input("Generator speedup k (full-cycle projection)", min_value=1.0, max_value=100.0,
                                    value=2.3, step=0.1, key="cycle_k",
                                    help="The projection 1 / ((1 − g) + g / k): a generator k times faster, every "
                                         "other phase unchanged; 2.3 is the published NVFP4 rollout speedup."))

sig = sigs[primary]
snap = snapshot_steps(primary)
ov = views.run_overview(run_of(primary, sig), steps, alerts)
status = ov["status"]
reference = None                  # (path, label, live steps) of the reference run
if reference_path:
    try:
        ref_sig = _signature(reference_path)
        _, ref_steps, _, _ = load_run(reference_path, ref_sig)
        ref_label = labels.get(reference_path) or Path(reference_path).name or reference_path
        if ref_label in [labels[p_] for p_ in runs if p_ != reference_path]:
            ref_label = f"{ref_label} (reference)"
        reference = (reference_path, ref_label, ref_steps, ref_sig)
    except RunDirError as exc:
        st.error(f"Reference run: {exc}")
    except Exception as exc:  # an unreadable reference: say so, never a traceback
        st.error(f"Reference run {reference_path}: could not be read ({type(exc).__name__}: {exc})")
verdict = None
if not steps.empty:
    verdict = load_verdict(primary, sig, reference[0] if reference else "", reference[3] if reference else ())
    level = verdict["level"].lower().replace(" ", "-")
    rest = "\n".join(line.strip() for line in verdict["lines"][1:])
    # the verdict's text is ours (rule names, numbers), escaped all the same
    st.markdown(f'<div class="triage-verdict {level}" id="triage-verdict" data-level="{verdict["level"]}">'
                f'<b>{html.escape(verdict["lines"][0])}</b><div class="rest">{html.escape(rest)}</div></div>',
                unsafe_allow_html=True)
# run.json strings are the run writer's input, not the page's: plain text, never Markdown (a crafted manifest
# would otherwise show links and load remote images)
st.text(f"{ov['path']} · triage-monitor {ov.get('tool_version') or '?'} · created {ov.get('created') or '?'}")
if status == "running":
    st.info(f"This run is still being written (status `running`): showing the {ov['steps']} step(s) recorded so "
            "far. Rerun the page (R) to refresh.")
from triage_monitor.offline.analysis import record_gaps  # noqa: E402

for _gap in record_gaps(run_of(primary, sig), steps):       # what the records lack, beyond a run still being written
    if not _gap.startswith("run.json says the run is 'running'"):
        st.warning("Incomplete records: " + re.sub(r"([\\`*_{}\[\]()#+\-.!<>|~$:])", r"\\\1", _gap))  # plain text
unreadable_slot = st.empty()      # filled once the page's reads have counted the files they could not read


def _show_unreadable(extra=()) -> None:
    """Count and name the unreadable files every read of this page skipped (``Run.unreadable``)."""
    found = {}
    for p_, (_, _, _, bad_) in runs.items():
        found.setdefault(p_, []).extend(bad_)
    found.setdefault(primary, []).extend(f for f in extra if f not in found.get(primary, []))
    found = {p_: b_ for p_, b_ in found.items() if b_}
    if found:
        n = sum(len(b_) for b_ in found.values())
        with unreadable_slot.container():
            st.error(f"{n} unreadable file(s) skipped: everything on this page is computed without them.")
            for p_, b_ in found.items():
                st.markdown(f"**{labels.get(p_, p_)}**\n" + "\n".join(f"- `{f}`: {why}" for f, why in b_[:30])
                            + (f"\n- … {len(b_) - 30} more" if len(b_) > 30 else ""))


if steps.empty:
    _show_unreadable()
    st.warning(f"Run `{labels[primary]}` has no recorded steps yet, so there is nothing to plot. "
               + ("It is still running: rerun the page later." if status == "running" else
                  "Its steps/ folder is empty."))
    st.stop()

# ------------------------------------------------------------------ overview
st.header("Overview")
c = st.columns(6)
c[0].metric("Steps", f"{ov['steps']:,}", help=f"steps {ov['first_step']} … {ov['last_step']}")
c[1].metric("Tokens", _fmt_int(ov["tokens"]))
c[2].metric("Alerts", f"{ov['alerts']}")
c[3].metric("Correction", ov.get("correction", "-"))
c[4].metric("Window", f"{run_window} steps")
tau = ov.get("tau_tail")
c[5].metric(label("tau_tail"), "-" if tau is None or not math.isfinite(float(tau)) else f"{float(tau):.4g}")
facts = {k: ov[k] for k in ("model", "task", "sampler_recipe", "learner_recipe", "correction", "framework",
                            "sampler_logp") if k in ov}
if facts:
    st.text(" · ".join(f"{k.replace('_', ' ')}: {v}" for k, v in facts.items()))
with st.expander("Manifest (run.json)"):
    st.json(manifest.to_dict(), expanded=1)
if ov["alerts"]:
    with st.expander(f"Alerts raised ({ov['alerts']})", expanded=True):
        cols = [c_ for c_ in ("step", "level", "rule", "metric", "value", "threshold", "title") if c_ in alerts]
        st.dataframe(alerts[cols], hide_index=True, width="stretch")

# ------------------------------------------------------------------ time series
window = view == "trailing window"


def metrics_of(path: str) -> pd.DataFrame:
    man, live, _, _ = runs[path]
    if window and window_steps != MonitorConfig.from_dict(man.monitor_config, strict=False).window:
        with st.spinner(f"recomputing {labels[path]} with a {window_steps}-step window…"):
            rec = load_recomputed(path, window_steps, sigs[path], snapshot_steps(path))
        if rec.empty:
            st.warning(f"{labels[path]}: no token records to recompute a {window_steps}-step window from; "
                       "showing the live window values.")
            return live
        extra = [c_ for c_ in live.columns if c_ not in rec.columns]
        return rec.merge(live[["step", *extra]], on="step", how="left")
    return live


shown_runs = [primary] + [p for p in (overlay or []) if p != primary]     # the inspected run first: it is red
ref_label = None
if reference is not None and reference[0] in runs:
    ref_label = labels[reference[0]]
    shown_runs = [p for p in shown_runs if p != reference[0]] + [reference[0]]
frames = {labels[p]: metrics_of(p) for p in shown_runs}
alert_frames = {labels[p]: runs[p][2] for p in shown_runs}
if reference is not None and ref_label is None:
    ref_label = reference[1]
    frames[ref_label], alert_frames[ref_label] = reference[2], None
band = None
if verdict is not None and verdict.get("band"):
    from triage_monitor.offline.verdict import ReferenceBand

    band = ReferenceBand(**verdict["band"])
destabilised = verdict["outcome"]["step"] if verdict is not None else None
st.header("Time series")
roles = views.run_roles(list(frames), ref_label)
legend = " · ".join(f"{label}: {role} ({'red' if c == views.INSPECTED_COLOR else 'grey' if c == views.REFERENCE_COLOR else 'colour in the legend'})"
                    for label, (role, c) in roles.items())
st.caption(("Pooled trailing-window values (raw sums of the window, docs/metrics.md#steps-and-windows)" if window else "Per-step values")
           + f" · {legend}" + " · alerts as ▼ markers"
           + (f" · dash-dot line: destabilised at step {destabilised}" if destabilised is not None else "")
           + " · grey shading: steps at noise level · the study draws its failing arm in the same red, its control "
             "in the same grey")
# each figure is sent as soon as it is built (the first chart reaches the browser before the others are
# computed); panels without data are skipped and the two-column grid stays compact
cols, slot = None, 0
for p in views.PANELS:
    f = views.timeseries_figure(frames, p, window, window_steps, alert_frames, reference=ref_label, band=band,
                                destabilised=destabilised)
    if f is None:
        continue
    if slot == 0:
        cols = st.columns(2)
    with cols[slot]:
        _chart(f, f"ts_{p}")
    slot = 1 - slot

primary_frame = frames.get(labels[primary], metrics_of(primary))
cols = st.columns(2)
with cols[0]:
    _chart(views.quadrant_figure(primary_frame, window, labels[primary], destabilised=destabilised), "quadrants")
with cols[1]:
    # localisation depends on tau_tail: drawn with the run's frozen value for every step, the first ones included
    with st.spinner("localisation metrics with the frozen tau_tail…"):
        loc_frame, loc_unreadable = load_postmortem(primary, window_steps, sig, snap)
    _chart(views.localisation_figure(loc_frame, window, labels[primary], destabilised=destabilised), "localisation")
_show_unreadable(loc_unreadable)

# ------------------------------------------------------------------ step time and the full cycle
st.header("Step time and the full cycle")
from triage_monitor.metrics.timings import compare_cycles, cycle_frame, cycle_summary, device_of, figures  # noqa: E402

cycle = cycle_frame(steps, cycle_k)
if cycle.empty:
    st.info("No step of this run has phase timings (time/<phase> columns): a framework hook records them where it "
            "sees the framework's timers, a loop of your own passes log_step(timings=...) (docs/hooks.md#phase-timings).")
else:
    info = manifest.info if isinstance(manifest.info, dict) else {}
    device = device_of(info)
    summ = cycle_summary(cycle, cycle_k)
    c = st.columns(4)
    c[0].metric("Generation share g", "-" if math.isnan(summ.g) else f"{summ.g:.3f}",
                help="Σ generation / Σ step over the timed steps")
    c[1].metric(f"Projected speedup at k = {cycle_k:g}", "-" if math.isnan(summ.projected) else f"{summ.projected:.2f}×",
                help="1 / ((1 − g) + g / k)")
    c[2].metric("Mean step", f"{summ.mean.get('step', math.nan):.3g} s", help=f"{summ.steps} timed step(s)")
    c[3].metric("Not sped up", "-" if math.isnan(summ.g) else f"{100 * (1 - summ.g):.0f} % of the step",
                help="every phase but generation, and the untimed rest")
    if device:      # info.device is run.json's: plain text, never Markdown (as the manifest line above)
        st.text(f"{figures(device)}: measured on the run's {device}" + (
            "; on an accelerator the phases' shares differ (NVFP4 emulated on a CPU is slower than full precision)."
            if device.startswith("cpu") else "."))
    st.markdown("\n".join(f"- {line}" for line in summ.lines()[1:]))
    _chart(views.cycle_figure(cycle, cycle_k, labels[primary], device, destabilised), "cycle")
    others = [p_ for p_ in runs if p_ != primary]
    if others:
        other = st.selectbox(f"Compare {labels[primary]} (the run inspected: the baseline) with another run of the "
                             "same job; a speedup is the baseline's time ÷ the other's", others,
                             format_func=labels.get, key="cycle_other")
        other_steps = runs[other][1]
        if cycle_frame(other_steps, cycle_k).empty:
            st.info(f"{labels[other]} has no phase timings: nothing to compare.")
        else:
            cmp = compare_cycles(steps, other_steps, cycle_k)
            pair = [labels[primary], labels[other]]
            st.markdown("\n".join(f"- {line}" for line in cmp.lines(pair)))
            cc = st.columns([3, 2])
            with cc[0]:
                shown = cmp.table.assign(faster_generator=[
                    "" if ph == "step" else "yes" if up else "no"
                    for ph, up in zip(cmp.table["phase"], cmp.table["sped_up_by_generator"])])
                shown = shown.rename(columns={"label": "phase ", "base_s": f"{pair[0]} (s)", "other_s": f"{pair[1]} (s)",
                                              "speedup": "measured speedup (×)",
                                              "faster_generator": "faster generator"})
                st.dataframe(shown[["phase ", f"{pair[0]} (s)", f"{pair[1]} (s)", "measured speedup (×)",
                                    "faster generator"]], hide_index=True, width="stretch", key="cycle_compare",
                             column_config={"faster generator": st.column_config.TextColumn(
                                 help="does a faster generator speed this phase up?")})
            with cc[1]:
                mm = cmp.mismatch.rename(columns={"figure": "mismatch", "base": pair[0], "other": pair[1]})
                n_alerts = [len(runs[p_][2]) if "rule" in runs[p_][2].columns else 0 for p_ in (primary, other)]
                mm = pd.concat([mm, pd.DataFrame([{"mismatch": "alerts raised", pair[0]: float(n_alerts[0]),
                                                   pair[1]: float(n_alerts[1])}])], ignore_index=True)
                st.dataframe(mm, hide_index=True, width="stretch", key="cycle_mismatch",
                             column_config={c_: st.column_config.NumberColumn(format="%.4g")
                                            for c_ in (pair[0], pair[1])})
            _chart(views.cycle_bars_figure({pair[0]: cmp.base, pair[1]: cmp.other},
                                           "Mean step time by phase, the two runs", device), "cycle_bars")

# ------------------------------------------------------------------ one step (token data, lazy)
st.header("One step")
step_list = [int(s) for s in steps["step"]]
focus = verdict["focus_step"] if verdict is not None else None
focus = focus if focus in step_list else step_list[-1]
focus_why = verdict["focus_why"] if verdict is not None and focus == verdict["focus_step"] else "the last step"
sel = st.columns([2, 3])
with sel[0]:
    step = int(st.select_slider("Step for the δ histogram, heatmap and drill-down", step_list, value=focus,
                                key="step"))
with sel[1]:
    st.markdown(f'<div id="triage-step-note">Opened at step {focus}: {html.escape(focus_why)} (the most informative '
                f"step: the first collapse-tier alert, else the window ρ_asym peak). Showing step {step}.</div>",
                unsafe_allow_html=True)
row = steps.set_index("step").loc[step]
# the run's one frozen tau_tail (the live row holds a provisional value on the first steps)
frozen_tau = loc_frame.set_index("step")["tau_tail"] if "tau_tail" in loc_frame.columns else pd.Series(dtype=float)
step_tau = float(frozen_tau[step]) if step in frozen_tau.index else float(row.get("tau_tail", math.nan))
width = run_config.metrics.segment_width
small_gap = run_config.metrics.small_gap_threshold
try:
    with st.spinner(f"loading the tokens of step {step}…"):
        delta, layout, sample_ids, gw, gate_width, who = step_detail(primary, step, step_tau, width, sig)
        toks = load_tokens(primary, step, sig)
        # toks and the batch are both sorted by (sample_id, rank, position): the same flat order; each row's
        # response is the batch's sample id (a rank's reused id stays its own response)
        toks = toks.assign(response=np.repeat(who["batch_id"].to_numpy(), who["n_tokens"].to_numpy()))
except (KeyError, OSError, ValueError) as exc:
    st.warning(f"Token records of step {step} are not readable ({exc}); step-level charts above are complete.")
    toks = None
if toks is not None:
    cols = st.columns(2)
    with cols[0]:
        _chart(views.delta_histogram_figure(delta, step_tau, small_gap, step), "delta_hist")
    with cols[1]:
        if layout is None:
            st.info("τ_tail is not calibrated at this step, so there are no tail tokens to localise.")
        else:
            _chart(views.segment_heatmap_figure(layout, sample_ids, step), "heatmap")

    st.subheader("Response drill-down")
    adv = toks.groupby("response", sort=True)["advantage"].mean()
    renumbered = not (who["batch_id"] == who["sample_id"]).all()
    named = {int(b): (f"rank {int(r)} · id {int(i)}" if renumbered else f"id {int(i)}")
             for b, r, i in zip(who["batch_id"], who["rank"], who["sample_id"])}
    # tail tokens per response from the step's tail layout (stages.tail_layout: the segments of triage_monitor.segments)
    tails = pd.Series(0, index=adv.index, dtype=np.int64)
    if layout is not None and layout.num_segments:
        per_id = pd.Series(layout.tail).groupby(sample_ids[layout.response]).sum()
        tails = tails.add(per_id, fill_value=0).astype(np.int64)
    order = sorted(adv.index, key=lambda i: (-int(tails[i]), float(adv[i]), int(i)))
    pick = st.selectbox("Response (most amplifying-tail tokens first)", order, key="response",
                        format_func=lambda i: f"{named[int(i)]} · A {adv[i]:+.3f} · {int(tails[i])} tail tokens")
    sel = (toks["response"] == pick).to_numpy()
    gw_sel = gw[sel] if gw is not None and gw.shape[0] == sel.shape[0] else None
    # segments drawn with the monitor's W, as in the heatmap above (the Gate's own width is named below)
    _chart(views.response_figure(toks[sel], gw_sel, width, step_tau, int(pick)), "response_chart")
    st.caption(f"Segment boundaries every {width} positions (the monitor's segment width W, as in the heatmap); "
               f"Gate weight = the weight TriageController would give each token at this step with the run's "
               f"Gate settings (Gate width {gate_width}, fixed thresholds, docs/metrics.md#gate).")

# ------------------------------------------------------------------ stages
st.header("Stages (docs/metrics.md#stages)")
from triage_monitor.offline.stages import (anchor_steps, anchor_windows, degenerate_notice,  # noqa: E402
                                           format_stage_table)

with st.sidebar:
    st.header("Stages")
    anchors_text = st.text_input("Anchor steps (comma-separated; empty = 25/50/75/100 %)", "", key="anchors")
    draws = int(st.number_input("Shuffle-null draws", 9, 9999, 499, step=10, key="draws"))
try:
    anchors = tuple(int(a) for a in anchors_text.replace(",", " ").split()) if anchors_text.strip() else None
    ends = list(anchors) if anchors else anchor_steps(step_list)
    in_windows = steps["step"].isin({s_ for win in anchor_windows(step_list, ends, window_steps) for s_ in win})
    n_read = float(steps.loc[in_windows, "n_tokens"].sum()) if "n_tokens" in steps else 0.0
    if n_read > STAGE_AUTO_TOKENS and not st.toggle(
            f"Compute the stage table (reads ~{n_read / 1e6:.1f}M tokens of the anchor windows)", key="stage_go"):
        st.info("On a run this large the stage table is computed on request: it reads the token rows of "
                "every anchor window and draws the C_tok shuffle null. Everything above is already complete.")
        st.stop()
    with st.spinner("computing the stage table and the C_tok shuffle null…"):
        table = load_stage_table(primary, anchors, window_steps, draws, sig, snap)
    notice = degenerate_notice(table, width)
    if notice:
        st.warning(notice)
    shown = format_stage_table(table)
    # compact columns: the whole table fits a 1,500 px window next to the sidebar
    st.dataframe(shown, hide_index=True, width="stretch",
                 column_config={c_: st.column_config.NumberColumn(format="%.2f" if "%" in c_ or "pts" in c_
                                                                               else "%.3f", width="small")
                                for c_ in shown.columns
                                if c_ not in ("stage", "step", "window", "tokens", "null 95% interval (%)")})
    st.caption(f"Trailing {window_steps}-step windows ending at each anchor. C_tok null: tail labels shuffled "
               f"within each A<0 response ({draws} draws, seed 0); excess = C_tok − null median, in points. "
               "Dilution: A<0 responses with a tail-heavy segment whose mean |δ| < 0.05.")
except (ValueError, KeyError, OSError) as exc:
    st.warning(f"Stage table: {exc}" + (" (the run has no token records for it)" if isinstance(exc, KeyError)
                                        else ""))

