"""``triage-monitor report RUN_DIR -o report.html``: write the self-contained HTML post-mortem
(:mod:`triage_monitor.offline.report`).  Its options are declared without importing the report's plotting stack, so
``report --help`` works, and a missing ``dashboard`` extra (plotly) is one line naming it, exit 2."""

from __future__ import annotations

import argparse
import sys
import time

from .. import exits

#: What the report's charts need, and how to get it.
EXTRA_HINT = "pip install 'triage-monitor[dashboard]'"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``triage-monitor report``; returns ``parser``."""
    parser.epilog = f"needs plotly, from the 'dashboard' extra: {EXTRA_HINT}"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter        # the epilog's command stays on one line
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directory (more are overlaid in the time series)")
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: %(default)s)")
    parser.add_argument("--reference", metavar="RUN",
                        help="a reference run of the same job (an on-policy or BF16 control): its window ρ_asym range "
                             "is drawn as the healthy band, its series in grey (docs/alerts.md#a-reference-run)")
    parser.add_argument("--anchors", type=int, nargs="+", metavar="STEP",
                        help="stage anchor steps (default: 25/50/75/100 %% of the run)")
    parser.add_argument("--window", type=int, help="trailing window in steps (default: the run's)")
    parser.add_argument("--draws", type=int, default=499, help="C_tok shuffle-null draws (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle-null seed (default: %(default)s)")
    parser.add_argument("--k", type=float, default=2.3,
                        help="generator speedup of the full-cycle projection 1 / ((1 - g) + g / k) (default: "
                             "%(default)s); with two runs the second is compared with the first (the baseline)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the report.  Exit status (docs/cli.md#exit-statuses): 0 written; 1 written, and the records are
    incomplete or differ from the live values (named on stderr); 2 a bad run directory, an
    empty run, a bad option or plotly missing (the line names the ``dashboard`` extra); 3 the output path cannot
    be written (one line on stderr)."""
    from ..offline.analysis import RunDirError, open_run

    try:
        from ..offline.report import build_report
    except ImportError as exc:        # plotly (the dashboard extra) missing; any other import error is a bug
        missing = (exc.name or "").split(".")[0]
        if missing != "plotly":
            raise
        exits.error("report", f"the HTML report needs plotly, which is not installed: {EXTRA_HINT}")
        return exits.INPUT_ERROR

    from ..rundir.layout import run_path

    out = run_path(args.output, "--output")    # s3://...: refused before any work, never a local folder 's3:'
    t0 = time.perf_counter()
    exits.note("report", f"reading {', '.join(map(str, args.run_dirs))} …")
    try:
        runs = [open_run(p) for p in args.run_dirs]
        reference = open_run(args.reference) if getattr(args, "reference", None) else None
        text = build_report(runs, anchors=args.anchors, window=args.window, draws=args.draws,
                            seed=args.seed, progress=True, k=args.k, reference=reference)
    except (RunDirError, ValueError, KeyError) as exc:
        exits.error("report", exc)
        return exits.INPUT_ERROR
    try:
        from ..rundir.storage import open_store

        open_store(str(out.parent)).write_bytes(out.name, text.encode("utf-8"))  # whole or nothing, no temp left
    except OSError as exc:
        exits.error("report", f"cannot write {out}: {exc.strerror or exc}")
        return exits.OUTPUT_ERROR
    for r in runs:
        exits.report_unreadable("report", r)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, self-contained: opens offline) "
          f"in {time.perf_counter() - t0:.1f} s")
    from ..offline.analysis import record_gaps

    gaps = [f"{r.path}: {line}" for r in runs for line in record_gaps(r)]   # said, and never exit 0 on such a run
    for line in gaps:
        print(f"triage-monitor report: incomplete records: {line}", file=sys.stderr)
    damaged = [f"{r.path}: {line}" for r in runs for line in _differences_from_live(r)]
    for line in damaged:
        print(f"triage-monitor report: records that differ from the live run: {line}", file=sys.stderr)
    return exits.FINDING if gaps or damaged else exits.OK


def _differences_from_live(run) -> list[str]:
    """``analyze``'s recomputation check on ``run`` (its per-step states, cached by the report): one line when
    metrics recomputed from the token records differ from the live values beyond what a resume explains (a token
    block damaged or replaced after the run, whose pages still decode), else none."""
    from ..offline.analysis import recompute
    from .analyze import compare_with_live_values

    live = run.steps()
    if live is None or live.empty:
        return []
    df = recompute(run, cache=True)
    live = live[live["step"] <= df["step"].max()]            # steps recorded while the report was built: not yet
    result = compare_with_live_values(run, df, live)
    if result is None or not result.unexplained:
        return []
    names = result.unexplained
    return [f"{len(names)} metric(s) recomputed from the token records differ from the live values beyond what a "
            f"resume explains ({', '.join(names[:4])}{' …' if len(names) > 4 else ''}): a token block no longer "
            f"holds what the monitor saw; `triage-monitor analyze {run.path}` shows the differences"]
