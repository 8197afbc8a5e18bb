"""``triage-monitor`` command line: demo | study | analyze | cycle | report | dashboard | alerts | import.

Each sub-command is a module of :mod:`triage_monitor.commands` with ``add_arguments(parser)`` and
``run(args)``; this module only wires them into one argparse parser and runs the chosen one under the
exit-status convention (:func:`run_command`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
from typing import Callable

from .commands import COMMANDS


# ---------------------------------------------------------------------------- main
def _version() -> str:
    from . import __version__

    return __version__


def build_parser(command=None) -> argparse.ArgumentParser:
    """The argparse parser; only ``command``'s module is imported (keeps ``--help`` fast)."""
    from .exits import EPILOG

    parser = argparse.ArgumentParser(prog="triage-monitor", description=__doc__.splitlines()[0].replace("``", ""),
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging: also the INFO lines (an alert rule cleared, ...) and library messages")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, help_ in COMMANDS:
        p = sub.add_parser(name, help=help_, description=help_)
        if name != command:
            continue
        try:
            mod = importlib.import_module(f"triage_monitor.commands.{module}")
        except ImportError as exc:  # a component whose optional dependency is missing
            p.set_defaults(_missing=f"'{name}' is unavailable: {exc}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


#: Seconds a Ctrl-C'd command may take to unwind before the process is ended with status 130 anyway.
FORCE_EXIT_AFTER_S = 10.0


class _InterruptReport(threading.Event):
    """What :func:`_install_sigint_watchdog` returns: an event set once the interrupt line is printed, and
    ``restore()``, which puts the previous Ctrl-C handling back (a no-op until the watchdog is installed)."""

    def __init__(self) -> None:
        super().__init__()
        self.restore: Callable[[], None] = lambda: None


def _install_sigint_watchdog(command: str) -> _InterruptReport:
    """Ctrl-C raises KeyboardInterrupt as usual and also arms a timer that ends the process (status 130, the
    one "interrupted" line) if unwinding has not finished after :data:`FORCE_EXIT_AFTER_S`: an interrupt that
    lands inside a lazy import can leave CPython's import lock held, and the clean-up would then wait forever.
    An interrupt that lands in a finalizer (where Python only prints "Exception ignored") is re-delivered to the
    main thread, so it always stops the command.
    Returns the event the normal path sets once it has printed the line (its ``restore()`` puts the previous
    handler back).  Only in the main thread."""
    import os
    import signal

    from . import exits

    reported = _InterruptReport()
    if threading.current_thread() is not threading.main_thread():
        return reported

    def force_exit() -> None:
        if not reported.is_set():
            exits.note(command, "interrupted (Ctrl-C); stopped")
        sys.stderr.flush()
        os._exit(exits.INTERRUPTED)

    def on_sigint(signum, frame):
        if not getattr(on_sigint, "armed", False):
            on_sigint.armed = True
            timer = threading.Timer(FORCE_EXIT_AFTER_S, force_exit)
            timer.daemon = True
            timer.start()
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook
    main_ident = threading.main_thread().ident

    def on_unraisable(unraisable) -> None:
        # The interrupt landed where Python cannot raise it (a __del__, a weakref or garbage-collector callback):
        # Python would print "Exception ignored ... KeyboardInterrupt" and go on.  Interrupt the main thread
        # again instead, from another thread once this hook has returned (a signal handled inside the hook would
        # itself be ignored); it is raised in ordinary code and unwinds the command, or lands here once more.
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            again = threading.Timer(0.05, signal.pthread_kill, (main_ident, signal.SIGINT))
            again.daemon = True
            again.start()
            return
        previous_hook(unraisable)

    previous = signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = on_unraisable

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook

    reported.restore = restore
    return reported


def run_command(command: str, fn, args) -> int:
    """Run one command's ``run(args)`` under the exit-status convention of :mod:`triage_monitor.exits`:
    :class:`~triage_monitor.exits.CommandError` → its code, an OS error → 3, Ctrl-C → 130, each as one
    line on stderr (``triage-monitor <command>: ...``), never a traceback."""
    from . import exits
    from .rundir import records
    from .errors import UnsupportedLocationError

    reported = _install_sigint_watchdog(command)
    try:
        return int(fn(args) or 0)
    except exits.CommandError as exc:
        exits.error(command, exc)
        return exc.code
    except UnsupportedLocationError as exc:      # s3://... given where a run directory is a local path
        exits.error(command, exc)
        return exits.INPUT_ERROR
    except KeyboardInterrupt:
        reported.set()
        exits.note(command, "interrupted (Ctrl-C); stopped")
        return exits.INTERRUPTED
    except OSError as exc:          # a read or write the OS refused (the message names the path)
        exits.error(command, exc)
        return exits.OUTPUT_ERROR
    except records.OutputError as exc:
        # the run writer's start checks: an unwritable output is an I/O error (3); a directory holding another
        # run, or a rank another live process writes, is a usage error (2)
        exits.error(command, exc)
        return exits.OUTPUT_ERROR if isinstance(exc, records.UnwritableOutputError) else exits.INPUT_ERROR
    finally:
        reported.restore()        # an armed timer keeps running: a hang after this still ends at 130


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {c[0] for c in COMMANDS}
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command if command in names else None)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("triage-monitor: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    from .exits import configure_logging

    configure_logging(args.verbose)       # INFO chatter and library noise only with -v; lines never inside a bar
    if getattr(args, "_missing", None):
        from .exits import error

        error(args.command, args._missing)
        return 2
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
