"""``triage-monitor dashboard RUN_DIR [RUN_DIR ...]``: start the Streamlit post-mortem app.

This launcher and the app it starts, ``app.py``, are the package
``triage_monitor.dashboards`` (the repository's ``dashboards/`` folder); the
app is found through the installed package, so the command works the same
after an editable or a regular ``pip install .[dashboard]``.  Run paths are
checked first (:func:`triage_monitor.offline.analysis.open_run`), so a typo is
reported at once instead of inside the page.  The records the page's cached reads return (:class:`LoadedRun`,
:class:`PostmortemView`, :class:`StepDetail`) are declared here, in an importable module: ``app.py`` runs as
Streamlit's ``__main__``, re-executed on every rerun, and ``st.cache_data`` pickles what it returns.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

from triage_monitor.offline.analysis import RunDirError, open_run

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from triage_monitor.offline.stages import TailLayout
    from triage_monitor.rundir.manifest import RunManifest

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501
#: The page's argument naming a run root it may open (``--allow-root=<root>``, after ``--``; repeated).
ROOT_ARG = "--allow-root="


# ------------------------------------------------------------------ what the page's cached reads return
class LoadedRun(NamedTuple):
    """A run as the page reads it (``app.load_run``): manifest, live step rows, alerts, ``(path, reason)`` skipped."""

    manifest: RunManifest
    steps: pd.DataFrame
    alerts: pd.DataFrame
    unreadable: list[tuple[str, str]]


class PostmortemView(NamedTuple):
    """``app.load_postmortem``: the snapshot's step and window metrics, and the ``(path, reason)`` files skipped."""

    frame: pd.DataFrame
    unreadable: list[tuple[str, str]]


class StepDetail(NamedTuple):
    """``app.step_detail``: one step's δ (float64, nats), tail layout (None without τ_tail), sample ids, Gate."""

    delta: np.ndarray
    layout: Optional[TailLayout]
    sample_ids: np.ndarray
    gate_weights: np.ndarray
    gate_width: int
    responses: pd.DataFrame
def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, as given to ``--host``) is only reachable from this machine:
    ``localhost`` or an address of the loopback range (127.0.0.0/8, ::1).  ``0.0.0.0``, ``::``, ``0`` and ``''``
    (every interface) and any other name are not."""
    import ipaddress

    if str(host).strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).strip().strip("[]")).is_loopback
    except ValueError:
        return False


def root_of(location: str) -> str:
    """A run root as the page compares it: a local path made absolute with symbolic links resolved; an ``s3://``
    URI without its query and trailing slash."""
    location = str(location).strip()
    if "://" in location and not location.startswith("file://"):
        return location.split("?", 1)[0].rstrip("/")
    import os

    return os.path.realpath(location[len("file://"):] if location.startswith("file://") else location)


def check_location(location: str, roots: Sequence[str], given: Sequence[str] = ()) -> Optional[str]:
    """Whether the page may open ``location`` (typed in its sidebar): None when it may, else the reason.

    A location the command line gave (``given``, as given) may always be opened.  Any other must lie in one of
    ``roots`` (:func:`root_of` each; empty: no restriction) and, on an object store, carry no query: options such as
    ``endpoint_override`` would have the server sign requests to an endpoint a visitor chooses.

    Args:
        location: a local path, ``file://`` or ``s3://`` URI.
        roots: the allowed run roots (``--allow-root``; by default the runs the dashboard was started with).
        given: the locations the command line gave.

    Returns:
        None, or one line naming the location and what to do."""
    location = str(location).strip()
    if location in given:
        return None
    remote = "://" in location and not location.startswith("file://")
    if remote and "?" in location:
        return (f"{location}: a location typed in the page may not carry query options (endpoint_override, scheme, "
                "...): the dashboard takes them only from its command line")
    if not roots:
        return None
    loc = root_of(location)
    for r in map(root_of, roots):
        if ("://" in r) == remote and (loc == r or loc.startswith(r.rstrip("/") + "/")):
            return None
    return (f"{location}: outside the run roots this dashboard serves ({', '.join(map(root_of, roots))}); start "
            "it with --allow-root DIR to open runs elsewhere")


def app_path() -> Path:
    """Path of the Streamlit script ``app.py`` inside the installed ``triage_monitor.dashboards`` package."""
    return Path(str(resources.files("triage_monitor.dashboards") / "app.py"))


def validate_runs(run_dirs: Sequence[str]) -> list[str]:
    """Absolute paths of ``run_dirs`` (an ``s3://`` URI as given); raises RunDirError naming the first location
    that is not a run directory."""
    if not run_dirs:
        raise RunDirError("give at least one run directory")
    out: list[str] = []
    for p in run_dirs:
        run = open_run(p)
        out.append(str(run.path.resolve()) if run.layout.is_local else run.layout.location)
    return out


def build_command(run_dirs: Sequence[str], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  headless: bool = True, python: Optional[str] = None, reference: Optional[str] = None,
                  roots: Optional[Sequence[str]] = None) -> list[str]:
    """The ``python -m streamlit run <app.py> ... -- RUN_DIR ... [--reference RUN] --allow-root=ROOT ...``
    argument list (nothing is started).

    ``headless`` keeps Streamlit from opening a browser; usage statistics are off; ``reference``: a reference run
    whose window ρ_asym range the page draws as the healthy band (docs/alerts.md#a-reference-run); ``roots``: the
    run roots the page may open (:func:`check_location`; None: the runs given and the reference).
    """
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    return [python or sys.executable, "-m", "streamlit", "run", str(app_path()),
            "--server.address", str(host), "--server.port", str(int(port)),
            "--server.headless", "true" if headless else "false",
            "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--server.fileWatcherType", "none",
            "--", *run_dirs, *(["--reference", str(reference)] if reference else []),
            *(f"{ROOT_ARG}{r}" for r in (roots if roots else [*run_dirs, *([reference] if reference else [])]))]
