"""``triage-monitor dashboard RUN_DIR [RUN_DIR ...]``: check the runs, then start the Streamlit post-mortem app
(:mod:`triage_monitor.dashboards.launch`) in the foreground."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys

from ..offline.analysis import RunDirError, open_run
from ..dashboards.launch import DEFAULT_HOST, DEFAULT_PORT, build_command, is_loopback, validate_runs
from ..exits import INPUT_ERROR, INTERRUPTED, error


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``triage-monitor dashboard``; returns ``parser``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several are overlaid)")
    parser.add_argument("--reference", metavar="RUN",
                        help="a reference run of the same job (an on-policy or BF16 control): its window ρ_asym range "
                             "is drawn as the healthy band, its series in grey (docs/alerts.md#a-reference-run)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default: %(default)s; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    parser.add_argument("--allow-root", action="append", default=[], metavar="DIR",
                        help="a folder (or s3:// prefix) whose runs the page may open when typed in its sidebar "
                             "(repeatable; default: only the runs given)")
    parser.add_argument("--open-browser", action="store_true", help="let Streamlit open a browser tab")
    parser.add_argument("--print-command", action="store_true", help="print the streamlit command and exit")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the run paths, then run Streamlit in the foreground; returns its exit status
    (docs/cli.md#exit-statuses: 2 for a path that is not a run, a bad port or a missing dashboard extra,
    130 after Ctrl-C)."""
    try:
        runs = validate_runs(args.run_dirs)
        reference = validate_runs([args.reference])[0] if getattr(args, "reference", None) else None
        cmd = build_command(runs, args.host, args.port, headless=not getattr(args, "open_browser", False),
                            reference=reference, roots=list(getattr(args, "allow_root", []) or []) or None)
    except (RunDirError, ValueError) as exc:
        error("dashboard", exc)
        return INPUT_ERROR
    try:
        import streamlit  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        error("dashboard", f"the dashboard needs the dashboard extra ({exc.name} is missing): "
                           "pip install 'triage-monitor[dashboard]'")
        return INPUT_ERROR
    if getattr(args, "print_command", False):
        print(shlex.join(cmd))           # paste-able: paths with spaces are quoted
        return 0
    for p in runs:
        bad = list(getattr(open_run(p), "unreadable", []) or [])
        if bad:
            print(f"triage-monitor dashboard: {p}: {len(bad)} unreadable file(s), skipped and listed in the page: "
                  + ", ".join(str(f) for f, _ in bad[:3]) + (" …" if len(bad) > 3 else ""), file=sys.stderr)
    if not is_loopback(args.host):
        print(f"triage-monitor dashboard: warning: bound to {args.host}, the page is reachable from the network "
              "without authentication: anyone who reaches it reads the runs under "
              f"{', '.join(getattr(args, 'allow_root', []) or runs)} (docs/reliability.md#security)", file=sys.stderr)
    print(f"triage-monitor dashboard: http://{args.host}:{args.port}  ({len(runs)} run(s); Ctrl+C to stop)",
          file=sys.stderr)
    proc = subprocess.Popen(cmd)
    # a SIGTERM to the launcher (kill, timeout, a supervisor) stops the server too instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:    # Ctrl+C: stop the server (it may already be stopping: same process group)
        proc.terminate()
        proc.wait()
        print("triage-monitor dashboard: interrupted (Ctrl-C); server stopped", file=sys.stderr)
        return INTERRUPTED
