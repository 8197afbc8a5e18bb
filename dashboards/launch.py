"""``triage-monitor dashboard RUN_DIR [RUN_DIR ...]``: start the Streamlit post-mortem app.

This launcher and the app it starts, ``app.py``, are the package
``triage_monitor.dashboards`` (the repository's ``dashboards/`` folder); the
app is found through the installed package, so the command works the same
after an editable or a regular ``pip install .[dashboard]``.  Run paths are
checked first (:func:`triage_monitor.analysis.open_run`), so a typo is
reported at once instead of inside the page.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

from triage_monitor.analysis import RunDirError, open_run
from triage_monitor.exits import INPUT_ERROR, INTERRUPTED, error

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501


def app_path() -> Path:
    """Path of the Streamlit script ``app.py`` inside the installed ``triage_monitor.dashboards`` package."""
    return Path(str(resources.files("triage_monitor.dashboards") / "app.py"))


def validate_runs(run_dirs: Sequence[str]) -> list:
    """Absolute paths of ``run_dirs``; raises RunDirError naming the first path that is not a run directory."""
    if not run_dirs:
        raise RunDirError("give at least one run directory")
    out = []
    for p in run_dirs:
        open_run(p)
        out.append(str(Path(p).resolve()))
    return out


def build_command(run_dirs: Sequence[str], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  headless: bool = True, python: Optional[str] = None) -> list:
    """The ``python -m streamlit run <app.py> ... -- RUN_DIR ...`` argument list (nothing is started).

    ``headless`` keeps Streamlit from opening a browser; usage statistics are off.
    """
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    return [python or sys.executable, "-m", "streamlit", "run", str(app_path()),
            "--server.address", str(host), "--server.port", str(int(port)),
            "--server.headless", "true" if headless else "false",
            "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--server.fileWatcherType", "none",
            "--", *run_dirs]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``triage-monitor dashboard``; returns ``parser``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several are overlaid)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default: %(default)s; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    parser.add_argument("--open-browser", action="store_true", help="let Streamlit open a browser tab")
    parser.add_argument("--print-command", action="store_true", help="print the streamlit command and exit")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Validate the run paths, then run Streamlit in the foreground; returns its exit status
    (docs/cli.md#exit-statuses: 2 for a path that is not a run, a bad port or a missing dashboard extra,
    130 after Ctrl-C)."""
    try:
        runs = validate_runs(args.run_dirs)
        cmd = build_command(runs, args.host, args.port, headless=not getattr(args, "open_browser", False))
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
