"""``triage-monitor report RUN_DIR -o report.html``: write the self-contained HTML post-mortem
(:mod:`triage_monitor.report`).  Its options are declared without importing the report's plotting stack, so
``report --help`` works, and a missing ``dashboard`` extra is one line naming it, exit 2."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .. import exits


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``triage-monitor report``; returns ``parser``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directory (more are overlaid in the time series)")
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: %(default)s)")
    parser.add_argument("--anchors", type=int, nargs="+", metavar="STEP",
                        help="stage anchor steps (default: 25/50/75/100 %% of the run)")
    parser.add_argument("--window", type=int, help="trailing window in steps (default: the run's)")
    parser.add_argument("--draws", type=int, default=499, help="C_tok shuffle-null draws (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle-null seed (default: %(default)s)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the report.  Exit status (docs/cli.md#exit-statuses): 0 written; 2 a bad run directory, an
    empty run or a bad option; 3 the output path cannot be written (one line on stderr)."""
    from ..analysis import RunDirError, open_run
    from ..report import build_report

    t0 = time.perf_counter()
    exits.note("report", f"reading {', '.join(map(str, args.run_dirs))} …")
    try:
        runs = [open_run(p) for p in args.run_dirs]
        text = build_report(runs, anchors=args.anchors, window=args.window, draws=args.draws,
                            seed=args.seed, progress=True)
    except (RunDirError, ValueError, KeyError) as exc:
        exits.error("report", exc)
        return exits.INPUT_ERROR
    out = Path(args.output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        exits.error("report", f"cannot write {out}: {exc.strerror or exc}")
        return exits.OUTPUT_ERROR
    for r in runs:
        exits.report_unreadable("report", r)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, self-contained: opens offline) "
          f"in {time.perf_counter() - t0:.1f} s")
    return exits.OK
