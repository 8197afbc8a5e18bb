"""``triage-monitor demo``: run the built-in GRPO job (one run of the study's job) with monitoring."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor demo``: ``--out`` plus every DemoConfig field."""
    from ..demo import add_arguments as demo_options
    from ..exits import add_existing_run_arguments

    parser.add_argument("--out", default="runs/demo", help="run directory to write (default: %(default)s)")
    add_existing_run_arguments(parser)
    demo_options(parser)


def run(args: argparse.Namespace) -> int:
    """Run the built-in GRPO job into ``args.out``."""
    from .. import exits
    from ..demo import config_from_args, run_demo
    from ..rundir.layout import run_path

    args.out = str(run_path(args.out, "--out"))   # the demo writes a local run: s3://... refused before any work
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        raise exits.CommandError(str(exc)) from None
    # records.OutputError (an unwritable --out: 3; another run there or a locked rank: 2) is mapped by run_command
    run_demo(cfg, args.out, resume=args.resume, force=args.force)
    return exits.OK
