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


def report_unreadable(command: str, run) -> list[tuple[str, str]]:
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
    (:func:`triage_monitor.rundir.records.check_run_dir`)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue the run already in --out as a new attempt even if its model / task / correction / "
                        "seed / source differ (the changes are recorded in run.json); the metric configuration "
                        "must match")
    g.add_argument("--force", action="store_true",
                   help="start a new run in --out; a run already there is moved to <out>.replaced-<UTC time>")


# ------------------------------------------------------------------------------- commands printed for the user
#: The console script's name (pyproject.toml ``[project.scripts]``).
SCRIPT = "triage-monitor"


def _as_typed(path: str) -> str:
    """``path`` (absolute or relative to the working directory) as the user would type it from here: relative when
    it lies under the working directory, else absolute; symbolic links are kept (a virtual environment's
    ``bin/python`` is one, and its target lacks the environment's packages)."""
    import os

    full = os.path.abspath(path)
    try:
        rel = os.path.relpath(full)
    except ValueError:                       # another drive (Windows)
        return full
    return full if rel.startswith(os.pardir) else rel


def program() -> str:
    """How the user runs ``triage-monitor`` from where they stand, for the commands the tool prints
    (docs/cli.md#printed-commands): ``triage-monitor`` when that name on ``PATH`` is this installation's script (an
    activated environment, a ``pip install``); else that script's path as typed from the working directory
    (``.venv/bin/triage-monitor`` after the README's ``make demo``, whose environment is not activated); else, without
    the script, ``<python> -m triage_monitor``.  Shell-quoted."""
    import os
    import shlex
    import shutil

    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    script = argv0 if os.path.basename(argv0) == SCRIPT and os.path.isfile(argv0) else None
    if script is None:                       # imported, or run as python -m: the script next to this python
        beside = os.path.join(os.path.dirname(sys.executable), SCRIPT)
        script = beside if os.path.isfile(beside) else None
    if script is not None:
        found = shutil.which(SCRIPT)
        if found is not None and os.path.realpath(found) == os.path.realpath(script):
            return SCRIPT
        return shlex.quote(_as_typed(script))
    return f"{shlex.quote(_as_typed(sys.executable))} -m triage_monitor"


def command_line(*args) -> str:
    """A ``triage-monitor`` command line to print: :func:`program` and ``args`` (paths as given, quoted where the
    shell needs it), runnable as printed from the working directory."""
    import shlex

    return " ".join([program(), *(shlex.quote(str(a)) for a in args)])


# ---------------------------------------------------------------------------------------------- log output
def _tqdm_bar_active() -> bool:
    """Whether a tqdm progress bar (not disabled) is on screen in this process."""
    tqdm_mod = sys.modules.get("tqdm")
    cls = getattr(tqdm_mod, "tqdm", None) if tqdm_mod is not None else None
    bars = getattr(cls, "_instances", None) if cls is not None else None
    try:
        if not bars:
            return False
        return any(not getattr(b, "disable", False) for b in list(bars))
    except Exception:  # noqa: BLE001 — a bar set changing under us: write plainly
        return False


def progress_safe_handler(fmt: str = "%(levelname)s %(name)s: %(message)s"):
    """A ``logging.Handler`` for the commands' log lines: each record is written to the ``sys.stderr`` of the moment
    (a rich progress bar redirects it and prints the line above the bar; a handler that kept the stream it was built
    with would write into the bar), or, while a tqdm bar is on screen, through ``tqdm.write`` (above the bar, which
    is redrawn)."""
    import logging

    class _Handler(logging.Handler):
        def emit(self, record):
            try:
                msg = self.format(record)
                if _tqdm_bar_active():
                    sys.modules["tqdm"].tqdm.write(msg, file=sys.stderr)
                else:
                    stream = sys.stderr
                    stream.write(msg + "\n")
                    stream.flush()
            except Exception:  # noqa: BLE001 — logging never raises into the command
                self.handleError(record)

    h = _Handler()
    h.setFormatter(logging.Formatter(fmt))
    return h


#: Library loggers whose chatter stays out of a command's output unless ``-v`` is given: torchao's failed loads of
#: its optional CUDA extensions (``_C_mxfp8``, ``_C_cutlass_90a``) on a CPU, torch's pytree notes on torchao's enums.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def configure_logging(verbose: bool = False) -> None:
    """The commands' logging: WARNING and above (an alert line, a warning about the run), one line each on stderr
    through :func:`progress_safe_handler`; INFO chatter (an alert rule cleared, a resumed run's τ_tail) and the
    :data:`NOISY_LOGGERS` only with ``-v`` (which shows DEBUG too).  Like ``logging.basicConfig``, nothing is changed
    when the root logger already has a handler of someone else's (a program that calls ``main()`` with its own
    logging, a test runner's capture)."""
    import logging

    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_triage_monitor", False):
            root.removeHandler(h)
    if root.handlers:
        return
    h = progress_safe_handler()
    h._triage_monitor = True
    root.addHandler(h)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)


class quiet_imports:
    """``with quiet_imports(): import trl``: the :data:`NOISY_LOGGERS` are held at ERROR while a framework that
    loads torchao is imported (torchao's failed loads of CUDA extensions on a CPU, torch's pytree notes), then set
    back.  Python's warnings are untouched."""

    def __enter__(self):
        import logging

        self._saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in NOISY_LOGGERS]
        for lg, _ in self._saved:
            lg.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        for lg, level in self._saved:
            lg.setLevel(level)
        return False


class log_lines_above_progress_bars:
    """``with log_lines_above_progress_bars(): trainer.train()``: while a training loop draws a tqdm progress bar,
    triage-monitor's log lines (an alert, a warning) are written above the bar instead of into it.

    Without any logging configuration (neither the root logger nor ``triage_monitor``'s has a handler, so Python's
    last-resort handler would write each WARNING into the bar's line) a :func:`progress_safe_handler` (the message
    alone, WARNING and above, as the last-resort handler prints it) is added to the ``triage_monitor`` logger for the
    block; with the user's own console handlers on the root logger, tqdm's ``logging_redirect_tqdm`` routes them
    through ``tqdm.write`` for the block.  Everything is put back at the end."""

    def __init__(self, logger: str = "triage_monitor"):
        self.logger = logger

    def __enter__(self):
        import logging

        root, ours = logging.getLogger(), logging.getLogger(self.logger)
        self._added, self._redirect = None, None
        if not root.handlers and not ours.handlers:
            self._added = progress_safe_handler("%(message)s")
            self._added.setLevel(logging.WARNING)
            ours.addHandler(self._added)
        else:
            try:
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:                      # no tqdm: no tqdm bar either
                return self
            with_console = [lg for lg in (root, ours)
                            if any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
                                   for h in lg.handlers)]
            if with_console:                 # tqdm's redirect adds a handler to each logger named: only these
                self._redirect = logging_redirect_tqdm(loggers=with_console)
                self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        import logging

        if self._added is not None:
            logging.getLogger(self.logger).removeHandler(self._added)
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
        return False
