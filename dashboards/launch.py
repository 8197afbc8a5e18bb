"""``triage-monitor dashboard RUN_DIR [RUN_DIR ...]``: start the Streamlit post-mortem app.

This launcher and the app it starts, ``app.py``, are the package
``triage_monitor.dashboards`` (the repository's ``dashboards/`` folder); the
app is found through the installed package, so the command works the same
after an editable or a regular ``pip install .[dashboard]``.  Run paths are
checked first (:func:`triage_monitor.analysis.open_run`), so a typo is
reported at once instead of inside the page.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

from triage_monitor.analysis import RunDirError, open_run

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501


def app_path() -> Path:
    """Path of the Streamlit script ``app.py`` inside the installed ``triage_monitor.dashboards`` package."""
    return Path(str(resources.files("triage_monitor.dashboards") / "app.py"))


def validate_runs(run_dirs: Sequence[str]) -> list:
    """Absolute paths of ``run_dirs`` (an ``s3://`` URI as given); raises RunDirError naming the first location
    that is not a run directory."""
    if not run_dirs:
        raise RunDirError("give at least one run directory")
    out = []
    for p in run_dirs:
        run = open_run(p)
        out.append(str(run.path.resolve()) if run.layout.is_local else run.layout.location)
    return out


def build_command(run_dirs: Sequence[str], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  headless: bool = True, python: Optional[str] = None, reference: Optional[str] = None) -> list:
    """The ``python -m streamlit run <app.py> ... -- RUN_DIR ... [--reference RUN]`` argument list (nothing is
    started).

    ``headless`` keeps Streamlit from opening a browser; usage statistics are off; ``reference``: a reference run
    whose window ρ_asym range the page draws as the healthy band (docs/alerts.md#a-reference-run).
    """
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    return [python or sys.executable, "-m", "streamlit", "run", str(app_path()),
            "--server.address", str(host), "--server.port", str(int(port)),
            "--server.headless", "true" if headless else "false",
            "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--server.fileWatcherType", "none",
            "--", *run_dirs, *(["--reference", str(reference)] if reference else [])]
