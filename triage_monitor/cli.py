"""``triage-monitor`` command line: demo | study | analyze | report | dashboard | alerts | import.

Each sub-command's options live next to its implementation (an
``add_arguments(parser)`` / ``run_cli(args)`` pair); this module only wires
them into one argparse parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

# (command, module, help); the module provides add_arguments(parser) and run_cli(args)
# (for demo, study, analyze and alerts: this module's <command>_add_arguments / <command>_run_cli)
COMMANDS = (
    ("demo", "triage_monitor.cli", "run the built-in GRPO job (NVFP4 sampler vs learner) with monitoring"),
    ("study", "triage_monitor.cli", "run the built-in job's arms (none/tis/triage on a stale NVFP4 sampler, fp32-lag, the fp32 control) x seeds and compare"),
    ("analyze", "triage_monitor.cli", "recompute every metric of a run from its token Parquet files"),
    ("report", "triage_monitor.report", "write a self-contained HTML post-mortem of a run"),
    ("dashboard", "triage_monitor.dashboards.launch", "start the Streamlit post-mortem dashboard on 127.0.0.1"),
    ("alerts", "triage_monitor.cli", "replay the alert rules over a finished run or a metrics CSV"),
    ("import", "triage_monitor.importers", "turn a framework's dumped rollouts / a per-token table into a run directory"),
)

#: Columns `analyze` prints (all columns are saved).
SUMMARY_COLUMNS = {"step": "step", "n_tokens": "tokens", "small_gap_share": "small|δ|", "delta_q05": "q05 δ",
                   "k3_kl": "k3", "rho_asym": "ρ_asym", "rho_asym_lennorm": "ρ_len", "window/rho_asym": "ρ_win",
                   "c_tok": "C_tok", "r_amp": "r_amp", "h_seg": "H_seg", "tau_tail": "τ_tail"}


# ---------------------------------------------------------------------------- demo
def demo_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor demo``: ``--out`` plus every DemoConfig field."""
    from .demo import add_arguments as demo_options
    from .exits import add_existing_run_arguments

    parser.add_argument("--out", default="runs/demo", help="run directory to write (default: %(default)s)")
    add_existing_run_arguments(parser)
    demo_options(parser)


def demo_run_cli(args: argparse.Namespace) -> int:
    """Run the built-in GRPO job into ``args.out``."""
    from . import exits
    from .demo import config_from_args, run_demo

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        raise exits.CommandError(str(exc)) from None
    # records.OutputError (an unwritable --out: 3; another run there or a locked rank: 2) is mapped by run_command
    run_demo(cfg, args.out, resume=args.resume, force=args.force)
    return exits.OK


# ---------------------------------------------------------------------------- study
def study_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor study``: arms, seeds, jobs, --quick, --preset, --out and every DemoConfig field
    except those the arms set per run (seed, correction, sampler recipe)."""
    from .demo import add_arguments as demo_options
    from .demo.study import ARMS, DEFAULT_ARMS, PER_ARM_FIELDS, PRESETS, QUICK
    from .exits import add_existing_run_arguments

    parser.add_argument("--out", default="runs/study", help="output directory (default: %(default)s)")
    add_existing_run_arguments(parser)
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated arms out of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process each (default: 1)")
    parser.add_argument("--rejudge", action="store_true",
                        help="run nothing: judge the run directories already in OUT/runs again and rewrite the report")
    parser.add_argument("--quick", action="store_true",
                        help=f"the short version (`make demo`): arms {','.join(QUICK['arms'])}, seed "
                             f"{QUICK['seeds'][0]}, unless --arms / --seeds are given")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a prepared configuration: gpu = the NVFP4 regime without staleness at GPU scale "
                             "(docs/study.md#the-nvfp4-regime-on-a-gpu; options given explicitly win)")
    demo_options(parser, exclude=PER_ARM_FIELDS + ("log_every",), suppress=True)
    parser.allow_abbrev = False   # --seed must not be read as --seeds (seeds are set per arm)


def study_run_cli(args: argparse.Namespace) -> int:
    """Run the study into ``args.out``; exit 2 on a bad option (docs/cli.md#exit-statuses)."""
    from dataclasses import fields

    from .demo import DemoConfig
    from .demo.study import rejudge, run_study, study_config
    from .exits import CommandError

    try:
        given = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)}
        cfg, arms, seeds = study_config(args.preset, args.quick, **given)
        if args.arms:
            arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        if args.seeds:
            try:
                seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
            except ValueError:
                raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
        if args.rejudge:
            rejudge(cfg, args.out)
            return 0
        run_study(cfg, args.out, arms=arms, seeds=seeds, jobs=args.jobs, resume=args.resume, force=args.force)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return 0


# ---------------------------------------------------------------------------- analyze
def analyze_add_arguments(parser: argparse.ArgumentParser) -> None:
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


def analyze_run_cli(args: argparse.Namespace) -> int:
    """Recompute the run's metrics, print a summary table, save the full one, compare with the live values.

    Exit status (docs/cli.md#exit-statuses): 0 every compared metric equals its live value (or differs only
    as the expected consequence of a resume, which is stated); 1 live and recomputed values differ;
    2 not a run, a run without token records, a bad option or an unreadable token file; 3 the table
    cannot be saved."""
    from rich.console import Console
    from rich.table import Table

    from . import exits
    from .analysis import RunDirError, open_run, recompute

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix.lower() not in (".csv", ".parquet"):
        raise exits.CommandError(f"--out {out}: unknown table format {out.suffix or '(no extension)'!r}; "
                                 "use a .csv or .parquet file name")
    try:
        run = open_run(args.run_dir)
    except RunDirError as exc:
        raise exits.CommandError(str(exc)) from None
    n_steps = len(run.step_numbers())
    if not n_steps:
        raise exits.CommandError(f"{run.path}: the run has no recorded steps with token records yet, nothing to "
                                 "analyze")
    from . import metrics  # noqa: F401  (imports torch now, so the throughput below times the recomputation only)
    exits.note("analyze", f"recomputing {n_steps} step(s) of {run.path} …")
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
    out = out or run.layout.analysis_dir / "metrics.csv"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        (df.to_parquet if out.suffix.lower() == ".parquet" else df.to_csv)(out, index=False)
    except OSError as exc:
        raise exits.CommandError(f"cannot save the table to {out}: {exc.strerror or exc}", exits.OUTPUT_ERROR) \
            from None

    shown = df if args.rows == 0 else df.tail(args.rows)
    table = Table(title=f"{run.path}  ({len(df)} steps, {n_tokens:,} tokens)")
    for c in SUMMARY_COLUMNS:
        table.add_column(SUMMARY_COLUMNS[c], justify="right", no_wrap=True)
    for _, r in shown.iterrows():
        table.add_row(*[_fmt(r[c]) for c in SUMMARY_COLUMNS])
    console.print(table)
    console.print(f"recomputed {n_tokens:,} tokens in {elapsed:.2f} s "
                  f"({n_tokens / max(elapsed, 1e-9):,.0f} tokens/s); full table: {out}")
    live = run.steps() if args.window is None and args.tau_tail is None else None
    exits.report_unreadable("analyze", run)
    verdict = _verdict(live if live is not None and not live.empty else df)
    try:
        return _compare_with_live(console, run, df, live)
    finally:
        console.print(verdict.line, style=_VERDICT_STYLE[verdict.level], highlight=False)


#: rich styles of the verdict levels
_VERDICT_STYLE = {"NO SIGNAL": "dim", "OK": "green", "WATCH": "yellow", "WARNING": "bold yellow",
                  "CRITICAL": "bold red"}


def _verdict(frame, rules=None):
    """The run's health verdict (:func:`triage_monitor.verdict.health_verdict`) after replaying ``rules``
    (default: the shipped ones) over ``frame``."""
    from .alerts import replay_engine
    from .verdict import health_verdict

    return health_verdict(frame, replay_engine(rules, frame))


def _compare_with_live(console, run, df, live) -> int:
    """The recomputation check: the recomputed table ``df`` against the live steps; returns the exit code."""
    from . import exits
    from .analysis import compare_live

    if live is None or live.empty:
        return exits.OK
    cmp = compare_live(run, df, live=live)
    prov = int(cmp["provisional"].max()) if len(cmp) else 0
    if prov:
        console.print(f"{int(cmp.loc[cmp['metric'] == 'tau_tail', 'provisional'].sum())} live step(s) used a "
                      "provisional tau_tail (tau_tail_frozen = 0) while it was calibrating; the recomputation "
                      "uses the frozen value for every step, so their localisation metrics (and the windows "
                      "holding them) are not compared (--tau-mode live replays the provisional values)")
    bad = cmp[~cmp["equal"]]
    if bad.empty:
        console.print(f"[green]recomputation check: all {len(cmp)} metrics equal the live values (recomputed "
                      f"from tokens/: the records are complete)[/green]")
        return exits.OK
    explained, reasons = resume_explanations(run, live, df)
    skipped = _provisional_skips(live, df, int(df.attrs.get("window") or run.config.window))
    unexplained = [m for m in bad["metric"]
                   if _differing_steps(live, df, m) - explained.get(m, set()) - skipped.get(m, set())]
    console.print(f"[yellow]{len(bad)} metrics differ from the live values:[/yellow]")
    console.print(bad.to_string(index=False))
    for line in reasons:
        console.print(line)
    if not unexplained:
        console.print(f"[green]every difference is the expected consequence of the run's {len(run.manifest.attempts)} "
                      "attempts (above); the other metrics equal the live values[/green]")
        return exits.OK
    exits.note("analyze", f"{len(unexplained)} metric(s) differ from the live values beyond what a resume "
                          f"explains: {', '.join(unexplained[:8])}{' …' if len(unexplained) > 8 else ''}")
    return exits.FINDING


def _differing_steps(live, rec, metric: str, rtol: float = 1e-9) -> set:
    """Steps where ``live`` and ``rec`` values of ``metric`` differ (NaN on both sides is equal)."""
    import numpy as np

    m = live[["step", metric]].merge(rec[["step", metric]], on="step", suffixes=("_live", "_rec"))
    a, b = m[f"{metric}_live"].to_numpy(float), m[f"{metric}_rec"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        same = (np.isnan(a) & np.isnan(b)) | (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b)))
    return set(m["step"].to_numpy()[~same].tolist())


def _provisional_skips(live, rec, window: int) -> dict:
    """{metric: steps} that :func:`~triage_monitor.analysis.compare_live` leaves out: the τ-dependent metrics
    of live steps with a provisional τ_tail, and of the windows holding one (frozen τ mode only)."""
    from .analysis import TAU_DEPENDENT

    if rec.attrs.get("tau_mode", "frozen") != "frozen" or "tau_tail_frozen" not in live.columns:
        return {}
    prov = set(live.loc[live["tau_tail_frozen"].astype(float) == 0, "step"].astype(int))
    steps = set(live["step"].astype(int))
    win = {s for s in steps if any(s - window < p <= s for p in prov)}
    return {**{m: prov for m in TAU_DEPENDENT}, **{f"window/{m}": win for m in TAU_DEPENDENT}}


def resume_explanations(run, live, rec) -> tuple:
    """Which live/recomputed differences a resumed (multi-attempt) run explains, and why.

    Two effects of a later attempt (a resumed job, or a re-run into the same directory) on what the live
    monitor computed, that the recomputation from the visible token files cannot reproduce:

    * **τ_tail from replaced steps**: the later attempt read back the τ_tail that run.json recorded, which
      an earlier attempt calibrated on its own first steps; when the later attempt rewrote those steps,
      the recomputation calibrates on the new ones.  The τ-dependent metrics
      (:data:`~triage_monitor.analysis.TAU_DEPENDENT`) of every step whose live τ_tail differs from the
      recomputed one are explained.
    * **restarted window**: each process start begins an empty trailing window, so a live window that
      ends after a resume holds only that attempt's steps; the recomputation pools the visible steps of
      every attempt.  The ``window/`` metrics of windows whose visible steps come from more than one
      attempt are explained.

    Returns:
        ``({metric: set of steps}, [sentence, ...])``; empty for a run with one attempt.
    """
    from .analysis import TAU_DEPENDENT

    if "attempt" not in live.columns or live["attempt"].nunique() < 2 and len(run.manifest.attempts) < 2:
        return {}, []
    att = dict(zip(live["step"].astype(int), live["attempt"]))
    steps = sorted(att)
    window = int(rec.attrs.get("window") or run.config.window)
    explained: dict = {}
    reasons = []
    cal = run.manifest.calibration if isinstance(run.manifest.calibration, dict) else {}
    tau_steps = set()
    if "tau_tail" in live.columns and "tau_tail" in rec.columns:
        tau_steps = _differing_steps(live, rec, "tau_tail")
        if "tau_tail_frozen" in live.columns:      # provisional steps are left out by compare_live already
            frozen = set(live.loc[live["tau_tail_frozen"].astype(float) == 1, "step"].astype(int))
            tau_steps &= frozen
    if tau_steps:
        n_cal = int(run.config.calibration_steps)
        replaced = [s for s in steps[:n_cal] if cal.get("attempt") is not None and att[s] != cal.get("attempt")]
        live_tau = float(live.loc[live["step"] == min(tau_steps), "tau_tail"].iloc[0])
        rec_tau = float(rec.loc[rec["step"] == min(tau_steps), "tau_tail"].iloc[0])
        why = (f"run.json's tau_tail was calibrated by attempt {cal.get('attempt')} on steps that attempt "
               f"{att[replaced[0]]} later rewrote ({replaced[0]}..{replaced[-1]})" if replaced else
               "the live monitor restored tau_tail from run.json at a resume")
        reasons.append(f"resume: {why}; the live steps used tau_tail = {live_tau:.6g}, the recomputation calibrates "
                       f"{rec_tau:.6g} from the visible steps, so the tau-dependent metrics "
                       f"({', '.join(TAU_DEPENDENT)}) of {len(tau_steps)} step(s) differ as expected")
        for m in TAU_DEPENDENT:
            explained.setdefault(m, set()).update(tau_steps)
            explained.setdefault(f"window/{m}", set()).update(tau_steps)
    mixed = {s for s in steps if len({att[t] for t in steps if s - window < t <= s}) > 1}
    if mixed:
        reasons.append(f"resume: the live trailing window restarts at each attempt, while the recomputation pools "
                       f"the visible steps of every attempt: the window/ metrics of {len(mixed)} step(s) "
                       f"({min(mixed)}..{max(mixed)}) whose window spans two attempts differ as expected")
        for m in rec.columns:
            if m.startswith("window/"):
                explained.setdefault(m, set()).update(mixed)
    # a window holding a step whose τ-dependent values differ differs as well
    if tau_steps:
        near = {s for s in steps if any(s - window < t <= s for t in tau_steps)}
        for m in TAU_DEPENDENT:
            explained.setdefault(f"window/{m}", set()).update(near)
    return explained, reasons


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.0f}" if abs(v) >= 1000 or v == int(v) else f"{v:.3g}"
    return str(v)


# ---------------------------------------------------------------------------- alerts
def alerts_add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``triage-monitor alerts``; returns ``parser``."""
    parser.add_argument("run_dir", nargs="?", help="run directory (its steps/ table is replayed)")
    parser.add_argument("--rules", help="rules file (.toml, .yaml); default: the shipped default rules")
    parser.add_argument("--from-csv", dest="from_csv", metavar="CSV",
                        help="replay a metrics history CSV (e.g. a W&B history export) instead of RUN_DIR")
    parser.add_argument("--step-column", dest="step_column", default="step",
                        help="step column of the CSV (default: step; 'triage/step' is accepted as 'step')")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    return parser


def alerts_run_cli(args: argparse.Namespace) -> int:
    """Replay the rules over ``args.run_dir`` (its live per-step metrics, ``open_run(run_dir).steps()``)
    or ``args.from_csv`` and print when each would have fired.  Returns the exit code
    (docs/cli.md#exit-statuses: 0 no alert, 1 at least one alert, 2 bad input or an empty run / CSV,
    3 an input the OS refused to read; the message on stderr)."""
    import json
    from dataclasses import fields

    import pandas as pd

    from .alerts import Alert, default_rules, load_rules, normalize_columns, replay_engine

    from . import exits

    if args.run_dir and args.from_csv:
        exits.error("alerts", f"give RUN_DIR or --from-csv CSV, not both (got {args.run_dir} and {args.from_csv})")
        return exits.INPUT_ERROR
    run = None
    try:
        rules = load_rules(args.rules) if args.rules else default_rules()
        if args.from_csv:
            frame = normalize_columns(pd.read_csv(args.from_csv))
            step_col = args.step_column[len("triage/"):] if args.step_column.startswith("triage/") \
                and args.step_column not in frame.columns else args.step_column
            if frame.empty:
                raise ValueError(f"{args.from_csv}: the CSV has no rows, nothing to replay")
        elif args.run_dir:
            from .analysis import open_run  # lazy: analysis imports torch
            run = open_run(args.run_dir)
            frame, step_col = run.steps(), "step"
            if frame.empty:
                raise ValueError(f"{run.path}: the run has no recorded steps yet, nothing to replay")
        else:
            raise ValueError("give RUN_DIR or --from-csv CSV")
        engine = replay_engine(rules, frame, step_column=step_col)
        alerts = engine.fired
    except PermissionError as e:
        exits.error("alerts", e)
        return exits.OUTPUT_ERROR
    except (OSError, ValueError, ImportError) as e:
        exits.error("alerts", e)
        return exits.INPUT_ERROR
    if run is not None:
        exits.report_unreadable("alerts", run)
    absent = sorted({r.metric for r in rules} - set(frame.columns))
    rows = [a.to_row() for a in alerts]
    if args.format == "json":
        print(json.dumps(rows, indent=1, default=float))
    elif args.format == "csv":
        pd.DataFrame(rows, columns=[f.name for f in fields(Alert) if f.name != "wait_s"]).to_csv(
            sys.stdout, index=False)
    else:
        _print_alert_table(rows, len(frame), len(rules))
    noise = {name: steps for name, steps in engine.noise_steps.items() if steps}
    if noise:
        guards = {(r.guard_metric, r.guard_min) for r in rules if r.name in noise}
        how = "; ".join(f"{m} < {t:.4g}" for m, t in sorted(guards))
        print(f"note: noise level ({how}: the learner and sampler agree to rounding, direction ratios are "
              f"noise) held back " + ", ".join(f"{n} on {len(s)} step(s)" for n, s in noise.items()), file=sys.stderr)
    if absent:
        print(f"note: metric(s) absent from the history, their rules never evaluated: {absent}", file=sys.stderr)
    from .verdict import health_verdict

    verdict = health_verdict(frame, engine)
    out = sys.stdout if args.format == "table" else sys.stderr   # csv / json stay machine-readable
    waiting = [(n, why) for n, why in verdict.not_evaluable if why.startswith("not evaluable")]
    if waiting:
        print(f"{len(waiting)} rule(s) could not evaluate yet over these {len(frame)} step(s):", file=out)
        for n, why in waiting:
            print(f"  {n}: {why}", file=out)
    print(verdict.line, file=out)
    return exits.FINDING if rows else exits.OK


def _print_alert_table(rows: list, n_steps: int, n_rules: int) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{len(rows)} alert(s) from {n_rules} rule(s) over {n_steps} step(s)")
    for c in ("step", "level", "rule", "metric", "value", "threshold", "text"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(str(r["step"]), r["level"], r["rule"], r["metric"], f"{r['value']:.4g}", f"{r['threshold']:.4g}",
                  r["text"])
    Console(width=160).print(t)


def alerts_cli(argv: Optional[Sequence[str]] = None) -> int:
    """``triage-monitor alerts RUN_DIR [--rules FILE] [--from-csv CSV --step-column step]`` without the
    top-level options; returns the exit code (see :func:`alerts_run_cli`)."""
    p = alerts_add_arguments(argparse.ArgumentParser(
        prog="triage-monitor alerts", description="Replay alert rules over a finished run or a metrics CSV."))
    return alerts_run_cli(p.parse_args(argv))


# ---------------------------------------------------------------------------- main
def _version() -> str:
    from . import __version__

    return __version__


def build_parser(command=None) -> argparse.ArgumentParser:
    """The argparse parser; only ``command``'s module is imported (keeps ``--help`` fast)."""
    from .exits import EPILOG

    parser = argparse.ArgumentParser(prog="triage-monitor", description=__doc__.splitlines()[0].replace("``", ""),
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, help_ in COMMANDS:
        p = sub.add_parser(name, help=help_, description=help_)
        if name != command:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # a component whose optional dependency is missing
            p.set_defaults(_missing=f"'{name}' is unavailable: {exc}")
            continue
        prefix = f"{name}_" if module == "triage_monitor.cli" else ""
        getattr(mod, f"{prefix}add_arguments")(p)
        p.set_defaults(_run=getattr(mod, f"{prefix}run_cli"))
    return parser


#: Seconds a Ctrl-C'd command may take to unwind before the process is ended with status 130 anyway.
FORCE_EXIT_AFTER_S = 10.0


def _install_sigint_watchdog(command: str):
    """Ctrl-C raises KeyboardInterrupt as usual and also arms a timer that ends the process (status 130, the
    one "interrupted" line) if unwinding has not finished after :data:`FORCE_EXIT_AFTER_S`: an interrupt that
    lands inside a lazy import can leave CPython's import lock held, and the clean-up would then wait forever.
    Returns the event the normal path sets once it has printed the line (its ``restore()`` puts the previous
    handler back).  Only in the main thread."""
    import os
    import signal
    import threading

    from . import exits

    reported = threading.Event()
    reported.restore = lambda: None
    if threading.current_thread() is not threading.main_thread():
        return reported

    def force_exit() -> None:
        if not reported.is_set():
            exits.note(command, "interrupted (Ctrl-C); stopped")
        sys.stderr.flush()
        os._exit(exits.INTERRUPTED)

    def on_sigint(signum, frame):
        if not getattr(on_sigint, "armed", False):
            on_sigint.armed = True
            timer = threading.Timer(FORCE_EXIT_AFTER_S, force_exit)
            timer.daemon = True
            timer.start()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    reported.restore = lambda: signal.signal(signal.SIGINT, previous)
    return reported


def run_command(command: str, fn, args) -> int:
    """Run one command's ``run_cli(args)`` under the exit-status convention of :mod:`triage_monitor.exits`:
    :class:`~triage_monitor.exits.CommandError` → its code, an OS error → 3, Ctrl-C → 130, each as one
    line on stderr (``triage-monitor <command>: ...``), never a traceback."""
    from . import exits, records

    reported = _install_sigint_watchdog(command)
    try:
        return int(fn(args) or 0)
    except exits.CommandError as exc:
        exits.error(command, exc)
        return exc.code
    except KeyboardInterrupt:
        reported.set()
        exits.note(command, "interrupted (Ctrl-C); stopped")
        return exits.INTERRUPTED
    except OSError as exc:          # a read or write the OS refused (the message names the path)
        exits.error(command, exc)
        return exits.OUTPUT_ERROR
    except records.OutputError as exc:
        # the run writer's start checks: an unwritable output is an I/O error (3); a directory holding another
        # run, or a rank another live process writes, is a usage error (2)
        exits.error(command, exc)
        return exits.OUTPUT_ERROR if isinstance(exc, records.UnwritableOutputError) else exits.INPUT_ERROR
    finally:
        reported.restore()        # an armed timer keeps running: a hang after this still ends at 130


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {c[0] for c in COMMANDS}
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command if command in names else None)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("triage-monitor: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "_missing", None):
        from .exits import error

        error(args.command, args._missing)
        return 2
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
