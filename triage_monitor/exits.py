"""Exit statuses and error lines shared by every ``triage-monitor`` command (docs/cli.md#exit-statuses).

One convention, so a script or CI job can tell the outcomes apart without parsing text:

====  ==========================================================================================
 0    done, nothing to flag
 1    done, and found what the command looks for: ``analyze``'s live and recomputed values differ
      (beyond the expected consequence of a resume), ``alerts`` replayed at least one alert
 2    usage or input error: a bad option, a path that is not a run, a run with no recorded step,
      an input file that cannot be read or parsed; nothing was written
 3    I/O error: the OS refused a read or a write (permission, disk full, a path that is a file);
      the message names the path and the OS reason
130   interrupted (Ctrl-C / SIGINT), stopped cleanly with one line on stderr
====  ==========================================================================================

Errors are one line on stderr: ``triage-monitor <command>: error: <what, naming the path or option>``.
"""

from __future__ import annotations

import sys

from .errors import TriageMonitorError

OK = 0
FINDING = 1
INPUT_ERROR = 2
OUTPUT_ERROR = 3
INTERRUPTED = 130

#: The table of the top-level ``--help`` epilog (plain text).
EPILOG = """exit statuses (every command):
  0    done, nothing to flag
  1    a finding: analyze's live and recomputed values differ, alerts replayed at least one alert
  2    usage or input error (bad option, not a run directory, a run with no recorded step,
       an unreadable or malformed input file); nothing was written
  3    I/O error: the OS refused a read or write (the message names the path and the OS reason)
  130  interrupted (Ctrl-C)
errors are printed as: triage-monitor COMMAND: error: MESSAGE"""


class CommandError(TriageMonitorError):
    """A command stops with ``message`` and exit status ``code`` (:data:`INPUT_ERROR` by default)."""

    def __init__(self, message: str, code: int = INPUT_ERROR):
        super().__init__(message)
        self.code = int(code)


def error(command: str, message) -> None:
    """Print the one-line error of ``command`` to stderr (``triage-monitor <command>: error: <message>``)."""
    print(f"triage-monitor {command}: error: {message}", file=sys.stderr, flush=True)


def note(command: str, message) -> None:
    """Print a one-line note / progress line of ``command`` to stderr."""
    print(f"triage-monitor {command}: {message}", file=sys.stderr, flush=True)


def report_unreadable(command: str, run) -> list:
    """Print the count and names of a run's unreadable files (``Run.unreadable``: ``(path, reason)`` pairs,
    counted by the reader as it met them) as one warning line on stderr; returns them."""
    bad = list(getattr(run, "unreadable", []) or [])
    if bad:
        names = "; ".join(f"{p} ({why})" for p, why in bad[:5]) + (f"; … {len(bad) - 5} more" if len(bad) > 5 else "")
        note(command, f"warning: {len(bad)} unreadable file(s) in {run.path} skipped: {names}")
    return bad


def add_existing_run_arguments(parser) -> None:
    """``--resume`` / ``--force`` (mutually exclusive) of the commands that write a run directory (``demo``,
    ``study``, ``import``): what to do with a run already in ``--out``
    (:func:`triage_monitor.records.check_run_dir`)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue the run already in --out as a new attempt even if its model / task / correction / "
                        "seed / source differ (the changes are recorded in run.json); the metric configuration "
                        "must match")
    g.add_argument("--force", action="store_true",
                   help="start a new run in --out; a run already there is moved to <out>.replaced-<UTC time>")
