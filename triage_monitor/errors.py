"""The errors triage-monitor raises, under one base: ``except TriageMonitorError`` catches any of them.

    TriageMonitorError
    ├── OutputError                  an output cannot be written as asked (raised at start, before any work)
    │   ├── UnwritableOutputError    the path cannot be created or written
    │   ├── RunConflictError         the directory holds another run
    │   └── RunLockedError           another live process writes the same rank
    ├── UnsupportedLocationError     (also a ValueError) a location given as a URI whose scheme is not supported there
    ├── ForkedWriterError            (also a RuntimeError) a writer used in a process forked after it was built
    ├── analysis.RunDirError         (also a ValueError) the path is not a readable run directory
    │   └── analysis.RunReadError    (also an OSError) its location could not be read (a store that timed out)
    ├── batch.InvalidTokenError      (also a ValueError) a valid token carries an impossible value
    └── exits.CommandError           a command stops with a message and an exit status

Each error keeps the base classes it had before this one existed (``RunDirError`` and ``InvalidTokenError``
are ``ValueError`` s), so ``except ValueError`` callers keep working.  This module imports nothing but the
standard library: every other module may import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class TriageMonitorError(Exception):
    """The base of every error triage-monitor raises on purpose (see the module's tree)."""


class OutputError(TriageMonitorError):
    """An output (a run directory, a file) cannot be written as asked; raised at start, before any work.

    Subclasses: :class:`UnwritableOutputError`, :class:`RunConflictError`, :class:`RunLockedError`.
    ``path`` is the output concerned (a :class:`~pathlib.Path`; the URI string of an object-store location; or
    None)."""

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = None if path is None else path if isinstance(path, str) and "://" in path else Path(path)


class UnwritableOutputError(OutputError):
    """The output path cannot be created or written (the message names the path and the OS reason)."""


class RunConflictError(OutputError):
    """The directory holds another run (another configuration, an unreadable manifest).

    ``differences``: ``{key: (old, new)}`` of the configuration keys that differ (docs/reliability.md#one-run-per-directory)."""

    def __init__(self, message: str, path=None, differences: Optional[dict] = None):
        super().__init__(message, path)
        self.differences = dict(differences or {})


class RunLockedError(OutputError):
    """Another live process is writing the same rank of the run (it holds the rank's writer lock file,
    :meth:`~triage_monitor.rundir.layout.RunLayout.lock_file`)."""


class UnsupportedLocationError(TriageMonitorError, ValueError):
    """A location given as a URI (``gs://...``, ``hdfs://...``; ``s3://`` where the output must be local) of a
    scheme that is not supported there: refused, never taken as a local folder of that name (``.scheme`` holds
    the scheme)."""

    #: what a run directory may be (triage_monitor.storage.OBJECT_STORE_SCHEMES)
    RUN_DIR = "a local path, a file:// URI, or an s3:// URI (AWS S3 or an S3-compatible store)"

    def __init__(self, location: str, scheme: str, what: str = "run directory", supported: Optional[str] = None):
        self.location, self.scheme = location, scheme
        super().__init__(f"{what} {location!r}: the {scheme!r} scheme is not supported; it must be "
                         f"{supported or self.RUN_DIR}")



class ForkedWriterError(TriageMonitorError, RuntimeError):
    """A monitor (or its background writer) built in one process was used in a child forked from it: the child
    has no writer thread, so nothing it logs would be written.  Build a new monitor in the child (after the fork),
    or fork before building it (docs/reliability.md#forked-processes)."""
