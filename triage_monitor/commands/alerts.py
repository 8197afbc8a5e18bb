"""``triage-monitor alerts``: replay the alert rules over a run or a metrics CSV; name the rules that could not
evaluate yet; end with the verdict."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``triage-monitor alerts``; returns ``parser``."""
    parser.add_argument("run_dir", nargs="*", metavar="RUN_DIR",
                        help="run directory (its steps/ table is replayed); with --evaluate, any number of run "
                             "directories and metrics CSV files")
    parser.add_argument("--rules", help="rules file (.toml, .yaml); default: the shipped default rules")
    parser.add_argument("--from-csv", dest="from_csv", metavar="CSV",
                        help="replay a metrics history CSV (e.g. a W&B history export) instead of RUN_DIR")
    parser.add_argument("--reference", metavar="RUN",
                        help="a reference run of the same job (an on-policy or BF16 control): the verdict places the "
                             "run's window ρ_asym against its range (docs/alerts.md#a-reference-run)")
    parser.add_argument("--step-column", dest="step_column", default="step",
                        help="step column of the CSV (default: step; 'triage/step' is accepted as 'step')")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    ev = parser.add_argument_group("evaluating the rules on runs with known outcomes (docs/alerts.md#evaluating-the-alerts)")
    ev.add_argument("--evaluate", action="store_true",
                    help="score every rule, tier and rule group against each run's outcome, beside baseline rules: "
                         "precision, recall, lead, warnings on runs that held")
    ev.add_argument("--labels", metavar="FILE",
                    help="outcomes from a CSV/JSON label file (run, failed_at, optional group) instead of the reward")
    ev.add_argument("--horizon", type=int, default=None,
                    help="H, steps: a warning counts when the run destabilises within H steps after it "
                         "(default: 20%% of the median run length)")
    ev.add_argument("--outcome-fraction", type=float, default=None,
                    help="destabilised below this fraction of the trailing reward's running peak (default 0.5)")
    ev.add_argument("--outcome-smooth", type=int, default=None, help="trailing reward mean, steps (default 10)")
    ev.add_argument("--outcome-stay", type=int, default=None,
                    help="consecutive steps below the fraction (default 10)")
    ev.add_argument("--baselines", metavar="FILE",
                    help="baseline rules file (default: the built-in reward drawdown, gradient-norm spike, |δ| level)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Replay the rules over ``args.run_dir`` (its live per-step metrics, ``open_run(run_dir).steps()``)
    or ``args.from_csv`` and print when each would have fired.  Returns the exit code
    (docs/cli.md#exit-statuses: 0 no alert, 1 at least one alert, 2 bad input or an empty run / CSV,
    3 an input the OS refused to read; the message on stderr)."""
    import json
    from dataclasses import fields

    import pandas as pd

    from ..alerting.alerts import Alert, default_rules, load_rules, normalize_columns, replay_engine

    from .. import exits

    if args.evaluate:
        return _evaluate(args)
    for name in ("labels", "horizon", "outcome_fraction", "outcome_smooth", "outcome_stay", "baselines"):
        if getattr(args, name) is not None:
            exits.error("alerts", f"--{name.replace('_', '-')} is an option of --evaluate")
            return exits.INPUT_ERROR
    if len(args.run_dir) > 1:
        exits.error("alerts", f"one RUN_DIR at a time without --evaluate (got {len(args.run_dir)})")
        return exits.INPUT_ERROR
    args.run_dir = args.run_dir[0] if args.run_dir else None
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
            from ..offline.analysis import open_run  # lazy: analysis imports torch
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
    from ..offline.verdict import reference_of_run, run_verdict

    reference = None
    if args.reference:
        from ..offline.analysis import RunDirError, open_run
        try:
            reference = reference_of_run(open_run(args.reference))
        except (RunDirError, OSError, ValueError) as e:
            exits.error("alerts", f"--reference: {e}")
            return exits.INPUT_ERROR
    verdict = run_verdict(frame if step_col == "step" else frame.rename(columns={step_col: "step"}), engine,
                          reference=reference)
    out = sys.stdout if args.format == "table" else sys.stderr   # csv / json stay machine-readable
    waiting = [(n, why) for n, why in verdict.status.not_evaluable if why.startswith("not evaluable")]
    if waiting:
        print(f"{len(waiting)} rule(s) could not evaluate yet over these {len(frame)} step(s):", file=out)
        for n, why in waiting:
            print(f"  {n}: {why}", file=out)
    print(verdict.text, file=out)
    gaps = []
    if run is not None:                    # what the records lack (analysis.record_gaps): said, never exit 0
        from ..offline.analysis import record_gaps

        gaps = record_gaps(run, frame)
        for line in gaps:
            print(f"incomplete records: {line}", file=sys.stderr)
    return exits.FINDING if rows or gaps else exits.OK


def _evaluate(args: argparse.Namespace) -> int:
    """``alerts --evaluate RUN ...``: the evaluation table (docs/alerts.md#evaluating-the-alerts); exit 0, 2 on bad
    input, 3 on an unreadable input."""
    import json

    from .. import exits
    from ..alerting.alerts import baseline_rules, default_rules, load_rules
    from ..offline.evaluation import evaluate, load_run, read_labels
    from ..alerting.outcome import OutcomeDefinition

    paths = list(args.run_dir) + ([args.from_csv] if args.from_csv else [])
    try:
        if not paths:
            raise ValueError("--evaluate needs at least one run directory or metrics CSV")
        given = {k: v for k, v in (("fraction", args.outcome_fraction), ("smooth", args.outcome_smooth),
                                   ("stay", args.outcome_stay)) if v is not None}
        definition = OutcomeDefinition(**given)
        if args.horizon is not None and args.horizon < 0:
            raise ValueError(f"--horizon must be >= 0 steps, got {args.horizon}")
        rules = load_rules(args.rules) if args.rules else default_rules()
        baselines = load_rules(args.baselines) if args.baselines else baseline_rules()
        labels = read_labels(args.labels) if args.labels else None
        runs = []
        for i, p in enumerate(paths, start=1):
            runs.append(load_run(p, labels, definition, step_column=args.step_column))
            if args.format == "table" and len(paths) > 20 and i % 20 == 0:
                print(f"read {i}/{len(paths)} runs", file=sys.stderr)
        table = evaluate(runs, rules, baselines, args.horizon)
    except PermissionError as e:
        exits.error("alerts", e)
        return exits.OUTPUT_ERROR
    except (OSError, ValueError, ImportError) as e:
        exits.error("alerts", e)
        return exits.INPUT_ERROR
    horizon = table.attrs["horizon"]
    unknown = [r.name for r in runs if not r.outcome_known]
    outcomes = [{"run": r.name, "group": r.group, "steps": r.n_steps, "destabilised_at": r.destabilised_at,
                 "outcome_known": r.outcome_known} for r in runs]
    if args.format == "json":
        print(json.dumps({"horizon": horizon, "definition": definition.describe(), "runs": outcomes,
                          "detectors": table.to_dict("records")}, indent=1, default=float))
    elif args.format == "csv":
        table.to_csv(sys.stdout, index=False)
    else:
        _print_evaluation(table, runs, horizon, definition.describe())
    if unknown:
        print(f"note: {len(unknown)} run(s) without a recorded reward or label were not scored: "
              f"{', '.join(unknown[:10])}{' …' if len(unknown) > 10 else ''}", file=sys.stderr)
    return exits.OK


def _print_evaluation(table, runs, horizon: int, definition: str) -> None:
    import math

    from rich.console import Console
    from rich.table import Table

    known = [r for r in runs if r.outcome_known]
    failed = [r for r in known if r.destabilised_at is not None]
    groups = sorted({r.group for r in known})
    con = Console(width=200)
    con.print(f"{len(runs)} run(s): {len(failed)} destabilised, {len(known) - len(failed)} held"
              f"{f', {len(runs) - len(known)} without an outcome' if len(runs) > len(known) else ''}; {definition}; "
              f"a warning counts when the run destabilises within H = {horizon} steps after it.", highlight=False)

    def f(x, pct=False):
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else (f"{x:.0%}" if pct else f"{x:g}")

    t = Table(title="alert rules against the runs' outcomes (precision, recall: destabilises within H steps)")
    for c in ("kind", "detector", "tier", "warned", "precision", "recall", "lead median (min–max)", "late",
              *[f"held {g} warned" for g in groups]):
        t.add_column(c, overflow="fold")
    for _, r in table.iterrows():
        lead = "—" if math.isnan(r["lead_median"]) else f"{r['lead_median']:g} ({r['lead_min']:g}–{r['lead_max']:g})"
        t.add_row(r["kind"], r["name"], r["tier"], f"{r['warned']}/{r['runs']}", f(r["precision"], True),
                  f"{f(r['recall'], True)} ({r['timely']}/{r['failed']})", lead, str(r["late"]),
                  *[f"{r[f'held_warned_{g}']}/{r[f'held_{g}']}" for g in groups])
    con.print(t)


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``triage-monitor alerts RUN_DIR [--rules FILE] [--from-csv CSV --step-column step]`` without the
    top-level options; returns the exit code (see :func:`alerts_run_cli`)."""
    p = add_arguments(argparse.ArgumentParser(
        prog="triage-monitor alerts", description="Replay alert rules over a finished run or a metrics CSV."))
    return run(p.parse_args(argv))
