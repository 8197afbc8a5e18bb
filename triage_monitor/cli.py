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
    ("study", "triage_monitor.cli", "run the built-in job's arms (none/tis/triage/fp32 control) x seeds and compare"),
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

    from .records import add_existing_run_arguments

    parser.add_argument("--out", default="runs/demo", help="run directory to write (default: %(default)s)")
    add_existing_run_arguments(parser)
    demo_options(parser)


def demo_run_cli(args: argparse.Namespace) -> int:
    """Run the built-in GRPO job into ``args.out``."""
    from .demo import config_from_args, run_demo
    from .records import OutputError

    try:
        cfg = config_from_args(args)
        run_demo(cfg, args.out, resume=args.resume, force=args.force)
    except (ValueError, OutputError) as exc:
        print(f"triage-monitor demo: {exc}", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------------------- study
def study_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor study``: arms, seeds, jobs, --quick, --out and every DemoConfig field
    (defaulting to the study's job, :data:`triage_monitor.demo.study.STUDY_BASE`)."""
    from .demo import add_arguments as demo_options
    from .demo.study import ARMS, QUICK, STUDY_BASE

    parser.add_argument("--out", default="runs/study", help="output directory (default: %(default)s)")
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated arms out of {','.join(ARMS)} (default: all)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process each (default: 1)")
    parser.add_argument("--rejudge", action="store_true",
                        help="run nothing: judge the run directories already in OUT/runs again and rewrite the report")
    parser.add_argument("--quick", action="store_true",
                        help=f"the short version (`make demo`): arms {','.join(QUICK['arms'])}, seed "
                             f"{QUICK['seeds'][0]}, {QUICK['steps']} steps, unless given explicitly")
    demo_options(parser)
    parser.set_defaults(**{**STUDY_BASE, "steps": None})


def study_run_cli(args: argparse.Namespace) -> int:
    """Run the study into ``args.out``; exit 2 on a bad option."""
    from .demo import config_from_args
    from .demo.study import ARMS, QUICK, STUDY_BASE, rejudge, run_study

    try:
        quick = args.quick
        arms = (args.arms or ",".join(QUICK["arms"] if quick else ARMS)).split(",")
        arms = [a.strip() for a in arms if a.strip()]
        try:
            seeds = [int(s) for s in (args.seeds or ",".join(map(str, QUICK["seeds"] if quick else (0, 1, 2)))
                                      ).split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
        if args.steps is None:
            args.steps = QUICK["steps"] if quick else STUDY_BASE["steps"]
        cfg = config_from_args(args)
        if args.rejudge:
            rejudge(cfg, args.out)
            return 0
        run_study(cfg, args.out, arms=arms, seeds=seeds, jobs=args.jobs)
    except ValueError as exc:
        print(f"triage-monitor study: {exc}", file=sys.stderr)
        return 2
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
    """Recompute the run's metrics, print a summary table, save the full one, compare with the live values."""
    from rich.console import Console
    from rich.table import Table

    from .analysis import RunDirError, compare_live, open_run, recompute

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    try:
        run = open_run(args.run_dir)
    except RunDirError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    n_tokens = 0
    from . import metrics  # noqa: F401  (imports torch now, so the throughput below times the recomputation only)
    t0 = time.perf_counter()
    try:
        df = recompute(run, window=args.window, tau_tail=args.tau_tail, progress=True, tau_mode=args.tau_mode, cache=True,
                       workers=args.workers, engine=args.engine, address=args.address)
    except (OSError, ValueError, ImportError) as exc:     # an unreadable token file (ArrowInvalid is a ValueError)
        console.print(f"[red]error:[/red] {exc}")
        return 2
    elapsed = time.perf_counter() - t0
    if df.empty:
        console.print(f"[yellow]{run.path}: no token records yet[/yellow]")
        return 1
    n_tokens = int(df["n_tokens"].sum())
    out = Path(args.out) if args.out else run.path / "analysis" / "metrics.csv"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        (df.to_parquet if out.suffix == ".parquet" else df.to_csv)(out, index=False)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot save the table to {out}: {exc}")
        return 2

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
    if live is not None and not live.empty:
        cmp = compare_live(run, df, live=live)
        bad = cmp[~cmp["equal"]]
        prov = int(cmp["provisional"].max()) if len(cmp) else 0
        if prov:
            console.print(f"{int(cmp.loc[cmp['metric'] == 'tau_tail', 'provisional'].sum())} live step(s) used a "
                          "provisional tau_tail (tau_tail_frozen = 0) while it was calibrating; the recomputation "
                          "uses the frozen value for every step, so their localisation metrics (and the windows "
                          "holding them) are not compared (--tau-mode live replays the provisional values)")
        if bad.empty:
            console.print(f"[green]all {len(cmp)} metrics equal the live values[/green]")
        else:
            console.print(f"[yellow]{len(bad)} metrics differ from the live values:[/yellow]")
            console.print(bad.to_string(index=False))
            attempts = len(run.manifest.attempts)
            if attempts > 1:
                console.print(f"this run has {attempts} attempts (a resumed job or a re-run into the same directory): "
                              "after a resume the live monitor restored tau_tail from run.json and restarted its "
                              "trailing window, while the recomputation uses the full recorded history, so "
                              "window and localisation values can differ from that point on")
    return 0


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
    (0; 2 on bad input, with the message on stderr)."""
    import json
    from dataclasses import fields

    import pandas as pd

    from .alerts import Alert, default_rules, load_rules, normalize_columns, replay_engine

    try:
        rules = load_rules(args.rules) if args.rules else default_rules()
        if args.from_csv:
            frame = normalize_columns(pd.read_csv(args.from_csv))
            step_col = args.step_column[len("triage/"):] if args.step_column.startswith("triage/") \
                and args.step_column not in frame.columns else args.step_column
        elif args.run_dir:
            from .analysis import open_run  # lazy: analysis imports torch
            frame, step_col = open_run(args.run_dir).steps(), "step"
        else:
            raise ValueError("give RUN_DIR or --from-csv CSV")
        engine = replay_engine(rules, frame, step_column=step_col)
        alerts = engine.fired
    except (OSError, ValueError, ImportError) as e:
        print(f"triage-monitor alerts: error: {e}", file=sys.stderr)
        return 2
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
    return 0


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
    parser = argparse.ArgumentParser(prog="triage-monitor", description=__doc__.splitlines()[0])
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {c[0] for c in COMMANDS}
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in names else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "_missing", None):
        print(f"triage-monitor: {args._missing}", file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
