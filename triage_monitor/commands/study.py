"""``triage-monitor study``: the built-in job's arms x seeds, judged and compared (docs/study.md)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor study``: arms, seeds, jobs, --quick, --preset, --out and every DemoConfig field
    except those the arms set per run (seed, correction, sampler recipe)."""
    from ..demo import add_arguments as demo_options
    from ..demo.study import ARMS, DEFAULT_ARMS, PER_ARM_FIELDS, PRESETS, QUICK
    from ..exits import add_existing_run_arguments

    parser.add_argument("--out", default="runs/study", help="output directory (default: %(default)s)")
    add_existing_run_arguments(parser)
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated arms out of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process each (default: 1)")
    parser.add_argument("--rejudge", action="store_true",
                        help="run nothing: judge the run directories already in OUT/runs again and rewrite the report")
    parser.add_argument("--population", action="store_true",
                        help="the alert-evaluation population instead of the study: fp32 and NVFP4 on-policy, NVFP4 2/4/8 "
                             "updates stale with none/TIS/TRIAGE, two learning rates, calibration and held-out seeds "
                             "(docs/alerts.md#evaluating-the-alerts; resumable: finished runs are kept)")
    parser.add_argument("--quick", action="store_true",
                        help=f"the short version (`make demo`): arms {','.join(QUICK['arms'])}, seed "
                             f"{QUICK['seeds'][0]}, unless --arms / --seeds are given")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a prepared configuration: gpu = the NVFP4 regime without staleness at GPU scale "
                             "(docs/study.md#the-nvfp4-regime-on-a-gpu; options given explicitly win)")
    demo_options(parser, exclude=PER_ARM_FIELDS + ("log_every",), suppress=True)
    parser.allow_abbrev = False   # --seed must not be read as --seeds (seeds are set per arm)


def run(args: argparse.Namespace) -> int:
    """Run the study into ``args.out``; exit 2 on a bad option (docs/cli.md#exit-statuses)."""
    from dataclasses import fields
    from typing import Sequence

    from ..demo import DemoConfig
    from ..demo.study import rejudge, run_study, study_config
    from ..exits import CommandError
    from ..rundir.layout import run_path

    args.out = str(run_path(args.out, "--out"))   # a local folder of runs: s3://... refused before anything is made
    try:
        given = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)}
        arms: Sequence[str]
        seeds: Sequence[int]
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
        if args.population:
            from ..demo.population import run_population

            run_population(cfg, args.out, jobs=args.jobs, seeds=seeds if args.seeds else None)
            return 0
        run_study(cfg, args.out, arms=arms, seeds=seeds, jobs=args.jobs, resume=args.resume, force=args.force)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return 0
