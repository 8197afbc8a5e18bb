"""``triage-monitor cycle``: where a run's step time goes, what a faster generator would buy, and two runs compared
(docs/cli.md#cycle, docs/metrics.md#step-time-and-the-full-cycle).  Reads the steps table only (no torch)."""

from __future__ import annotations

import argparse
import math


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor cycle``."""
    from ..metrics.timings import DEFAULT_K, frameworks

    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (with --compare: the baseline, e.g. BF16)")
    parser.add_argument("--k", type=float, default=DEFAULT_K,
                        help="generator speedup of the projection 1 / ((1 - g) + g / k) (default: %(default)s, the "
                             "published NVFP4 rollout)")
    parser.add_argument("--compare", metavar="OTHER_RUN",
                        help="a low-precision run of the same job: per-phase and whole-cycle speedup over RUN_DIR, "
                             "beside the projection and both runs' mismatch figures")
    parser.add_argument("--timings", metavar="FILE",
                        help="take RUN_DIR's step timings from this table (CSV, JSON Lines or Parquet: a step column "
                             "and the framework's timer columns, e.g. an export of its logged metrics) instead of the "
                             "steps table")
    parser.add_argument("--other-timings", metavar="FILE", help="the same for the --compare run")
    parser.add_argument("--framework", choices=sorted(frameworks()),
                        help="whose timer names the --timings tables use (default: any framework's unambiguous names)")
    parser.add_argument("--step-column", default="step", help="the step column of the --timings tables "
                                                               "(default: %(default)s)")
    parser.add_argument("--rows", type=int, default=10, help="per-step rows to print (the last ones); 0 prints all")


def _read_table(path: str):
    """A --timings table as a DataFrame (by the file name's ending: .csv, .jsonl / .json, .parquet)."""
    from pathlib import Path

    import pandas as pd

    from .. import exits

    p = Path(path)
    if not p.exists():
        raise exits.CommandError(f"--timings {p}: no such file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".csv":
            return pd.read_csv(p)
        if suffix in (".jsonl", ".json", ".ndjson"):
            return pd.read_json(p, lines=True)
        if suffix == ".parquet" or p.is_dir():
            return pd.read_parquet(p)
    except OSError as exc:
        raise exits.CommandError(f"--timings {p}: {exc.strerror or exc}", exits.OUTPUT_ERROR) from None
    except ValueError as exc:
        raise exits.CommandError(f"--timings {p}: unreadable ({exc})") from None
    raise exits.CommandError(f"--timings {p}: unknown table format {suffix or '(no extension)'!r}; use .csv, "
                             ".jsonl or .parquet")


def _steps_and_timings(path: str, timings_file, framework, step_column, command_option: str):
    """(Run, steps table, the table whose time/ columns are used, its source in words)."""
    from .. import exits
    from ..offline.analysis import RunDirError, open_run
    from ..metrics.timings import table_timings

    try:
        run = open_run(path)
    except RunDirError as exc:
        raise exits.CommandError(str(exc)) from None
    steps = run.steps()
    if steps.empty and timings_file is None:
        raise exits.CommandError(f"{run.path}: the run has no recorded steps yet, nothing to break down")
    if timings_file is None:
        return run, steps, steps, "the steps table"
    try:
        timed = table_timings(_read_table(timings_file), framework, step_column)
    except ValueError as exc:
        raise exits.CommandError(f"{command_option} {timings_file}: {exc}") from None
    return run, steps, timed, str(timings_file)


def _fmt(v, spec="{:.3g}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return spec.format(v)


def run(args: argparse.Namespace) -> int:
    """Print the run's per-step breakdown, its summary and, with ``--compare``, the two runs side by side.

    Exit status (docs/cli.md#exit-statuses): 0 printed; 2 not a run, a run without steps, no phase timing in the
    run (or the --timings table), a bad --k or an unreadable --timings table."""
    from rich.console import Console
    from rich.table import Table

    from .. import exits
    from ..metrics.timings import PHASES, SHORT, check_k, compare_cycles, cycle_frame, cycle_summary, device_of, figures

    try:
        k = check_k(args.k, "--k")
    except ValueError as exc:
        raise exits.CommandError(str(exc)) from None
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    run, steps, timed, source = _steps_and_timings(args.run_dir, args.timings, args.framework, args.step_column,
                                                   "--timings")
    frame = cycle_frame(timed, k)
    if frame.empty:
        raise exits.CommandError(
            f"{run.path}: no step has phase timings in {source} (time/<phase> columns): a hook records the "
            "framework's timers where it sees them, a loop of your own passes log_step(timings=...), or read the "
            "framework's logged timers with --timings FILE (docs/hooks.md#phase-timings)")
    info = run.manifest.info if isinstance(run.manifest.info, dict) else {}
    device = device_of(info) if args.timings is None else None
    summary = cycle_summary(frame, k)
    shown_phases = [p for p in PHASES if frame[p].notna().any()]
    ms = summary.mean.get("step", 0.0) < 10.0           # short steps in milliseconds
    unit, scale = ("ms", 1000.0) if ms else ("s", 1.0)
    title = (f"{run.path}: step time by phase, {unit} ({source}" + (f"; {figures(device)}" if device else "")
             + "; gen = generation, sync = weight sync, quant = quantisation / conversion)")
    table = Table(title=title)
    for col in ("step", *[SHORT[p] for p in shown_phases], "untimed", "step", "g", f"S(k={k:g})"):
        table.add_column(col, justify="right", no_wrap=True)
    rows = frame if args.rows == 0 else frame.tail(args.rows)
    for _, r in rows.iterrows():
        table.add_row(str(int(r["step"])), *[_fmt(r[p] * scale) for p in shown_phases], _fmt(r["untimed"] * scale),
                      _fmt(r["total"] * scale), _fmt(r["g"], "{:.3f}"), _fmt(r["projected"], "{:.2f}×"))
    console.print(table)
    for line in summary.lines(device):
        console.print(line, highlight=False)
    exits.report_unreadable("cycle", run)
    if args.compare is None:
        return exits.OK

    other, other_steps, other_timed, other_source = _steps_and_timings(
        args.compare, args.other_timings, args.framework, args.step_column, "--other-timings")
    if cycle_frame(other_timed, k).empty:
        raise exits.CommandError(f"{other.path}: no step has phase timings in {other_source} (time/<phase> "
                                 "columns): nothing to compare (docs/hooks.md#phase-timings)")
    cmp = compare_cycles(timed, other_timed, k)
    names = [run.path.name, other.path.name]
    if names[0] == names[1]:
        names = [str(run.path), str(other.path)]
    other_info = other.manifest.info if isinstance(other.manifest.info, dict) else {}
    devices = {d for d in (device_of(info), device_of(other_info)) if d is not None}
    t = Table(title=f"{names[1]} vs {names[0]}: mean seconds per step" +
              (f" ({', '.join(figures(d) for d in sorted(devices))})" if devices else ""))
    for col in ("phase", names[0], names[1], "measured speedup", "faster generator speeds it up"):
        t.add_column(col, justify="right" if col != "phase" else "left", no_wrap=True)
    for _, r in cmp.table.iterrows():
        t.add_row(r["label"], _fmt(r["base_s"], "{:.4g}"), _fmt(r["other_s"], "{:.4g}"), _fmt(r["speedup"], "{:.3g}×"),
                  "yes" if r["sped_up_by_generator"] else ("" if r["phase"] == "step" else "no"))
    console.print(t)
    for line in cmp.lines(names):
        console.print(line, highlight=False)
    m = Table(title="the mismatch each run pays (its steps table)")
    for col in ("figure", names[0], names[1]):
        m.add_column(col, justify="right" if col != "figure" else "left", no_wrap=True)
    for _, r in cmp.mismatch.iterrows():
        m.add_row(r["figure"], _fmt(r["base"], "{:.4g}"), _fmt(r["other"], "{:.4g}"))
    alerts = [r.alerts() for r in (run, other)]
    m.add_row("alerts raised", *[str(len(a)) if "rule" in a.columns else "0" for a in alerts])
    console.print(m)
    exits.report_unreadable("cycle", other)
    return exits.OK
