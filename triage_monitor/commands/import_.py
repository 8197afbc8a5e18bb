"""``triage-monitor import``: turn a framework's dumped rollouts or a per-token table into a run directory
(:mod:`triage_monitor.offline.importers`).  The frameworks' sources and their readers are declared beside the hooks
(``hooks/frameworks.py``'s ``DUMP_READERS``): one sub-command each, the reader imported when it runs."""

from __future__ import annotations

import argparse
import glob
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Mapping, Tuple

from ..config import TABLE_OPTIONAL_FIELDS as OPTIONAL, TABLE_REQUIRED_FIELDS as REQUIRED
from ..exits import add_existing_run_arguments

if TYPE_CHECKING:
    from ..batch import TokenBatch
    from ..hooks.frameworks import DumpReader
    from ..offline.importers import StepReader


def dump_readers() -> Mapping[str, "DumpReader"]:
    """``{source: DumpReader}`` of the frameworks whose dumps ``import`` reads (``hooks/frameworks.py``, the hooks'
    torch-free declarations); empty where the hooks are not installed — as
    :func:`~triage_monitor.metrics.timings.frameworks` finds them (the GPU kit runs the package tree without them:
    ``import table`` only)."""
    from ..metrics.timings import frameworks

    if not frameworks():
        return {}
    from ..hooks.frameworks import DUMP_READERS

    return DUMP_READERS


def step_reader(target: str) -> "StepReader":
    """The reader a :class:`~triage_monitor.hooks.frameworks.DumpReader` names, ``"module:function"`` (imported now).

    Raises:
        ImportError: its module cannot be imported; AttributeError: it has no such function.
    """
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor import``: ``<source> FILES...`` of each :func:`dump_readers` source (``slime``,
    ``miles``) or ``table PATH --map field=column``."""
    sub = parser.add_subparsers(dest="source", required=True)
    parsers = []
    for source, reader in dump_readers().items():
        d = sub.add_parser(source, help=reader.help)
        d.add_argument("paths", nargs="+", help=reader.paths_help)
        parsers.append(d)
    t = sub.add_parser("table", help="Parquet/JSONL of per-token (or per-response list) log-probs")
    t.add_argument("path", help="Parquet file or directory, or JSONL file")
    t.add_argument("--format", default="auto", choices=("auto", "parquet", "jsonl"),
                   help="how to read PATH: parquet (a file or a directory of files), jsonl (JSON Lines), or "
                        "auto: jsonl for .jsonl/.json/.jsonl.gz, parquet otherwise (default: %(default)s)")
    t.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                   help=f"column of each field; fields: {', '.join(REQUIRED + OPTIONAL)} (default: same name)")
    for p in (*parsers, t):
        p.add_argument("--out", required=True, help="run directory to write")
        add_existing_run_arguments(p)
        p.add_argument("--on-invalid", default="quarantine", choices=("quarantine", "raise"),
                       help="invalid tokens (NaN, positive, sentinel log-probs): count and exclude, or stop")
        p.add_argument("--window", type=int, default=25, help="trailing window in steps (default: %(default)s)")
        p.add_argument("--calibration-steps", type=int, default=25,
                       help="steps of the tau_tail reference window (default: %(default)s)")
        p.add_argument("--segment-width", type=int, default=64,
                       help="localisation segment width W in tokens (default: %(default)s)")
        p.add_argument("--tau-tail", type=float, default=None,
                       help="explicit tau_tail in nats (default: calibrated on the first --calibration-steps steps)")


def run(args: argparse.Namespace) -> int:
    """Run ``triage-monitor import``; prints what was written.  Exit status (docs/cli.md#exit-statuses): 0
    written; 2 bad input (no such file, a format it does not read, a malformed dump or table, nothing to
    import); 3 the OS refused a read or the run directory cannot be written."""
    from .. import exits
    from ..config import MetricConfig, MonitorConfig
    from ..offline.importers import parse_mapping, read_table, table_steps, write_run
    from ..rundir.records import OutputError, UnwritableOutputError, probe_writable

    try:
        cfg = MonitorConfig(window=args.window, calibration_steps=args.calibration_steps, tau_tail=args.tau_tail,
                            metrics=MetricConfig(segment_width=args.segment_width))
    except (ValueError, TypeError) as exc:
        exits.error("import", exc)
        return exits.INPUT_ERROR
    from ..rundir.storage import is_remote

    created = not is_remote(args.out) and not Path(args.out).exists()
    try:
        probe_writable(args.out)                 # an unwritable --out fails before the input is read
        readers = dump_readers()
        if args.source in readers:
            files = sorted({f for p in args.paths for f in (glob.glob(p) or [p])})
            missing = [f for f in files if not Path(f).exists()]
            if missing:
                raise ValueError(f"no such file: {missing[0]}")
            exits.note("import", f"reading {len(files)} {args.source} dump file(s) …")
            info: dict = {}
            source = readers[args.source]
            reader = step_reader(source.target)
            steps = list(reader(files, args.on_invalid, info=info))   # read first: run.json records how
            manifest = {"framework": args.source, "imported_from": files[:50], "import_source": source.dump, **info}
        else:
            mapping = parse_mapping(args.map)
            exits.note("import", f"reading {args.path} …")
            table = read_table(args.path, args.format)
            steps = list(table_steps(table, mapping, args.on_invalid))
            manifest = {"framework": "table", "imported_from": str(args.path), "column_map": mapping}
        if not steps:
            raise ValueError(f"{getattr(args, 'path', None) or ', '.join(args.paths)}: no step to import (no rows)")
        n = write_run(_with_progress(steps), args.out, manifest, cfg, resume=args.resume, force=args.force)
    except (PermissionError, UnwritableOutputError) as exc:
        _remove_if_left_empty(args.out, created)
        exits.error("import", exc)
        return exits.OUTPUT_ERROR
    except (ValueError, KeyError, OutputError) as exc:     # OutputError here: another run in --out, a locked rank
        _remove_if_left_empty(args.out, created)
        exits.error("import", exc)
        return exits.INPUT_ERROR
    print(f"imported {n} step(s) into {args.out}")
    return exits.OK if n else exits.INPUT_ERROR


def _remove_if_left_empty(out, created: bool) -> None:
    """A refused import writes nothing: the ``--out`` directory its start check made is removed again when it is
    still empty (a directory that was there before, or holds anything, is left as it is)."""
    try:
        if created and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()
    except OSError:
        pass


def _with_progress(steps: List[Tuple[int, TokenBatch]]) -> Iterator[Tuple[int, TokenBatch]]:
    """``steps`` with a progress bar on stderr (rich; nothing when stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("writing steps"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("write", total=len(steps))
        for item in steps:
            yield item
            bar.advance(task)
