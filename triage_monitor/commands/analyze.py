"""``triage-monitor analyze``: recompute every metric of a run from its token records, check them against the live
values, end with the run's verdict."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Union

if TYPE_CHECKING:
    import pandas as pd


#: Columns `analyze` prints (all columns are saved), headed by their declared short names
#: (:func:`triage_monitor.metrics.names.short`).
SUMMARY_COLUMNS = ("step", "n_tokens", "small_gap_share", "delta_q05", "k3_kl", "rho_asym", "rho_asym_lennorm",
                   "window/rho_asym", "c_tok", "r_amp", "h_seg", "tau_tail")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor analyze``."""
    parser.add_argument("run_dir", help="run directory written by MismatchMonitor")
    parser.add_argument("--window", type=int, default=None, help="trailing window in steps (default: the run's)")
    parser.add_argument("--tau-tail", type=float, default=None, help="explicit tau_tail in nats (default: the run's)")
    parser.add_argument("--out", default=None,
                        help="where to save the full table (.csv or .parquet; default RUN_DIR/analysis/metrics.csv)")
    parser.add_argument("--rows", type=int, default=20, help="rows to print (the last ones); 0 prints all")
    parser.add_argument("--tau-mode", choices=("frozen", "live"), default="frozen",
                        help="frozen (default): one tau_tail for every step, the post-mortem; live: replay the "
                             "provisional tau_tail the live monitor used on its reference steps")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes (default: 1, this one)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="map the steps here (local) or on a Ray cluster (needs triage-monitor[ray])")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address for --engine ray (default: RAY_ADDRESS, else a new local cluster)")


def run(args: argparse.Namespace) -> int:
    """Recompute the run's metrics, print a summary table, save the full one, compare with the live values.

    Exit status (docs/cli.md#exit-statuses): 0 every compared metric equals its live value (or differs only
    as the expected consequence of a resume, which is stated); 1 live and recomputed values differ;
    2 not a run, a run without token records, a bad option or an unreadable token file; 3 the table
    cannot be saved."""
    from rich.console import Console
    from rich.table import Table

    from .. import exits
    from ..metrics.names import short
    from ..offline.analysis import RunDirError, open_run, recompute

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    from ..rundir.layout import run_path

    out = run_path(args.out, "--out") if args.out else None      # s3://...: refused, never a local folder 's3:'
    if out is not None and out.suffix.lower() not in (".csv", ".parquet"):
        raise exits.CommandError(f"--out {out}: unknown table format {out.suffix or '(no extension)'!r}; "
                                 "use a .csv or .parquet file name")
    try:
        run = open_run(args.run_dir)
    except RunDirError as exc:           # a store that refused or timed out (RunReadError, an OSError): exit 3
        raise exits.CommandError(str(exc), exits.OUTPUT_ERROR if isinstance(exc, OSError) else exits.INPUT_ERROR) \
            from None
    n_steps = len(run.step_numbers())
    if not n_steps:
        raise exits.CommandError(f"{run.path}: the run has no recorded steps with token records yet, nothing to "
                                 "analyze")
    from ..metrics import stats  # noqa: F401  (imports numba now, so the throughput below times the recomputation only)
    exits.note("analyze", f"recomputing {n_steps} step(s) of {run.path} …")
    if args.engine == "local" and args.workers > 1:
        from ..offline.analysis import WORKER_MIN_BYTES, WORKER_MIN_CORES, planned_workers, usable_cores

        used = planned_workers([run.token_source(s) for s in run.step_numbers()], args.workers)
        if used < args.workers and usable_cores() < WORKER_MIN_CORES:
            exits.note("analyze", f"--workers {args.workers}: 1 used — with {usable_cores()} core(s) this process "
                                  "already keeps two busy (decode and update overlapped); worker processes pay from "
                                  f"{WORKER_MIN_CORES} cores")
        elif used < args.workers:
            exits.note("analyze", f"--workers {args.workers}: {used} used — a worker process pays off its start-up "
                                  f"only with {WORKER_MIN_BYTES >> 30} GiB of token records to map"
                                  + (" (this process maps them)" if used == 1 else ""))
    t0 = time.perf_counter()
    try:
        df = recompute(run, window=args.window, tau_tail=args.tau_tail, progress=True, tau_mode=args.tau_mode,
                       cache=True, workers=args.workers, engine=args.engine, address=args.address)
    except (ValueError, ImportError, KeyError) as exc:     # an unreadable token file (ArrowInvalid is a ValueError)
        raise exits.CommandError(str(exc)) from None
    elapsed = time.perf_counter() - t0
    if df.empty:
        raise exits.CommandError(f"{run.path}: the run has no recorded steps with token records yet, nothing to "
                                 "analyze")
    n_tokens = int(df["n_tokens"].sum())
    exits.note("analyze", f"recomputed {n_tokens:,} tokens of {len(df)} step(s) in {elapsed:.2f} s")
    dest = out          # the local file written: --out, else the run's analysis/metrics.csv (None: an object store)
    table_at: Union[Path, str]      # what the lines below name: that file, the store's name of it, or "not saved"
    try:
        if dest is None and not run.layout.is_local:      # an object store's run: the table goes next to its states
            rel = f"{run.layout.analysis_dir}/metrics.csv"
            run.store.write_bytes(rel, df.to_csv(index=False).encode())
            table_at = run.store.display(rel)
        else:
            from ..rundir.storage import open_store

            dest = dest or run.layout.root / run.layout.analysis_dir / "metrics.csv"
            # whole or not at all: a hidden temporary file renamed over dest (a full disk leaves neither)
            with open_store(str(dest.parent)).writing(dest.name, ".tmp") as f:
                if dest.suffix.lower() == ".parquet":
                    df.to_parquet(f, index=False)
                else:
                    f.write(df.to_csv(index=False).encode())
            table_at = dest
    except OSError as exc:
        if args.out:
            raise exits.CommandError(f"cannot save the table to {dest}: {exc.strerror or exc}", exits.OUTPUT_ERROR) \
                from None
        # the default place, inside the run (a read-only mount, another user's run): the analysis goes on
        exits.note("analyze", f"the table could not be saved to {dest} ({exc.strerror or exc}); the comparison and "
                              "the verdict follow; give --out FILE to save the table elsewhere")
        table_at = "not saved (see above)"

    shown = df if args.rows == 0 else df.tail(args.rows)
    table = Table(title=f"{run.path}  ({len(df)} steps, {n_tokens:,} tokens)")
    for c in SUMMARY_COLUMNS:
        table.add_column(c if c == "step" else short(c), justify="right", no_wrap=True)
    for _, r in shown.iterrows():
        table.add_row(*[_fmt(r[c]) for c in SUMMARY_COLUMNS])
    console.print(table)
    console.print(f"recomputed {n_tokens:,} tokens in {elapsed:.2f} s "
                  f"({n_tokens / max(elapsed, 1e-9):,.0f} tokens/s); full table: {table_at}")
    run.refresh()                   # the steps recorded meanwhile too: they are named, then left out below
    live = run.steps() if args.window is None and args.tau_tail is None else None
    if live is not None and not live.empty:
        # a run being written: steps recorded after the recomputation started are left out of the comparison and
        # the verdict, so that the page printed is one snapshot (the table, the check and the verdict agree)
        later = live["step"] > df["step"].max()
        if bool(later.any()):
            exits.note("analyze", f"{int(later.sum())} step(s) recorded while this ran (after step "
                                  f"{int(df['step'].max())}) are not included; run it again to see them")
            live = live[~later]
    exits.report_unreadable("analyze", run)
    verdict = _verdict(live if live is not None and not live.empty else df)
    saved = _save_verdict(run, verdict, table_at)
    try:
        return _compare_with_live(console, run, df, live)
    finally:
        console.print(verdict.lines[0], style=_VERDICT_STYLE[verdict.level], highlight=False, markup=False,
                      soft_wrap=True)
        for line in verdict.lines[1:]:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        if saved:
            console.print(f"verdict saved: {saved}", highlight=False, markup=False, soft_wrap=True)


#: rich styles of the verdict levels
_VERDICT_STYLE = {"NO SIGNAL": "dim", "OK": "green", "WATCH": "yellow", "WARNING": "bold yellow",
                  "CRITICAL": "bold red"}


def _verdict(frame, rules=None):
    """The run's verdict (:func:`triage_monitor.offline.verdict.run_verdict`, docs/alerts.md#the-run-verdict) after
    replaying ``rules`` (default: the shipped ones) over ``frame``."""
    from ..offline.verdict import verdict_of_steps

    return verdict_of_steps(frame, rules)


def _save_verdict(run, verdict, table_out: Union[Path, str]) -> str:
    """Store the verdict as JSON beside the table (``analysis/verdict.json`` for the default table, else
    ``<table>.verdict.json``); returns where, or "" (with a note) when it cannot be written.  ``table_out``: the
    table's local file, or a text (an object store's name of it, or "not saved"), which means the default place."""
    import json

    from .. import exits

    data = json.dumps(verdict.to_dict(), indent=1, ensure_ascii=False).encode()
    try:
        if not isinstance(table_out, Path) or table_out == run.layout.root / run.layout.analysis_dir / "metrics.csv":
            rel = f"{run.layout.analysis_dir}/verdict.json"
            run.store.makedirs(run.layout.analysis_dir)
            run.store.write_bytes(rel, data)
            return run.store.display(rel)
        dest = table_out.with_name(table_out.stem + ".verdict.json")
        dest.write_bytes(data)
        return str(dest)
    except OSError as exc:
        exits.note("analyze", f"the verdict could not be saved ({exc.strerror or exc})")
        return ""


def _compare_with_live(console, run, df, live) -> int:
    """The recomputation check: the recomputed table ``df`` against the live steps, then what the records lack
    (:func:`~triage_monitor.offline.analysis.record_gaps`: never "complete", never exit 0 on such a run); returns the exit
    code."""
    from .. import exits
    from ..offline.analysis import record_gaps

    code = _compare_values(console, run, df, live)
    gaps = record_gaps(run, live)
    if not gaps:
        return code
    for line in gaps:
        console.print(f"incomplete records: {line}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    exits.note("analyze", f"the run's records are incomplete ({len(gaps)} finding(s) above): what was recomputed "
                          "covers the records that exist")
    return max(code, exits.FINDING)


class LiveComparison(NamedTuple):
    """The recomputed table against the live steps (:func:`compare_with_live_values`)."""

    table: "pd.DataFrame"            #: one row a metric: metric, equal, provisional, …
    differing: "pd.DataFrame"        #: the rows of ``table`` whose metric differs somewhere
    reasons: List[str]               #: what the run's attempts explain (one line each)
    unexplained: List[str]           #: metrics that differ beyond what a resume or a provisional τ_tail explains


def compare_with_live_values(run, df, live) -> Optional[LiveComparison]:
    """The recomputation check of ``analyze`` and ``report``: the recomputed table ``df`` (:func:`~triage_monitor.
    analysis.recompute`) against the live ``steps`` table ``live``; None when there is nothing live to compare.
    A metric that differs and is not explained by the run's resumes or its provisional τ_tail steps is in
    ``unexplained``: the token records no longer hold what the live monitor saw (a damaged or replaced block)."""
    from ..offline.analysis import compare_live, differing_steps, provisional_skips, resume_explanations

    if live is None or live.empty:
        return None
    cmp = compare_live(run, df, live=live)
    bad = cmp[~cmp["equal"]]
    if bad.empty:
        return LiveComparison(cmp, bad, [], [])
    explained, reasons = resume_explanations(run, live, df)
    skipped = provisional_skips(live, df, int(df.attrs.get("window") or run.config.window))
    unexplained = [m for m in bad["metric"]
                   if differing_steps(live, df, m) - explained.get(m, set()) - skipped.get(m, set())]
    return LiveComparison(cmp, bad, reasons, unexplained)


def _compare_values(console, run, df, live) -> int:
    """The recomputed table ``df`` against the live steps, printed; returns the exit code."""
    from .. import exits
    from ..offline.analysis import record_gaps

    result = compare_with_live_values(run, df, live)
    if result is None:
        return exits.OK
    cmp = result.table
    prov = int(cmp["provisional"].max()) if len(cmp) else 0
    if prov:
        console.print(f"{int(cmp.loc[cmp['metric'] == 'tau_tail', 'provisional'].sum())} live step(s) used a "
                      "provisional tau_tail (tau_tail_frozen = 0) while it was calibrating; the recomputation "
                      "uses the frozen value for every step, so their localisation metrics (and the windows "
                      "holding them) are not compared (--tau-mode live replays the provisional values)")
    if result.differing.empty:
        whole = "" if record_gaps(run, live) else ": the records are complete"
        console.print(f"[green]recomputation check: all {len(cmp)} metrics equal the live values (recomputed "
                      f"from tokens/{whole})[/green]")
        return exits.OK
    console.print(f"[yellow]{len(result.differing)} metrics differ from the live values:[/yellow]")
    console.print(result.differing.to_string(index=False))
    for line in result.reasons:
        console.print(line)
    if not result.unexplained:
        console.print(f"[green]every difference is the expected consequence of the run's {len(run.manifest.attempts)} "
                      "attempts (above); the other metrics equal the live values[/green]")
        return exits.OK
    unexplained = result.unexplained
    exits.note("analyze", f"{len(unexplained)} metric(s) differ from the live values beyond what a resume "
                          f"explains: {', '.join(unexplained[:8])}{' …' if len(unexplained) > 8 else ''}")
    return exits.FINDING


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.0f}" if abs(v) >= 1000 or v == int(v) else f"{v:.3g}"
    return str(v)
