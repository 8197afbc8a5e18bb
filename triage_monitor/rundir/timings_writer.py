"""Phase timings from a process without a monitor: :class:`TimingsWriter`, for a framework's driver.

In most RL frameworks the steps row is written by a training worker at its optimizer step, while the step's
timers live in the driver and close later (weight sync, the step timer; docs/hooks.md#phase-timings).  The
driver hands its timer dict to :meth:`TimingsWriter.record` once the step is over; the writer puts one row in the
run's ``timings`` table (:data:`triage_monitor.rundir.records.TIMINGS_SCHEMA`), and readers fill the step's
``time/<phase>`` columns its row left NaN (``open_run(p).steps()``, docs/metrics.md#step-time-and-the-full-cycle).

The rows go into blocks of ``roll_steps`` steps like every table (each step first in a pending file, on disk when
``record`` returns; :mod:`triage_monitor.rundir.blocks`), under rank 0 and an attempt id of the writer's own, sealed at
:meth:`TimingsWriter.close` (also at interpreter exit).  A killed driver leaves at most ``roll_steps`` pending
files, which readers read.  Monitoring never stops the job: ``record`` warns once and returns None on any error.

Torch-free.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
from typing import Mapping, Optional

import pyarrow as pa

from .blocks import ROLL_STEPS, BlockWriter
from .layout import RunLayout
from .records import TIMINGS_SCHEMA, new_attempt_id, timings_row
from ..metrics.timings import frameworks, integer, is_timer_name, phase_times

log = logging.getLogger("triage_monitor.records")


def finite_or_none(value) -> Optional[float]:
    """``value`` as a float when it is a finite number (a Python or numpy number, a one-element tensor or array),
    else None: a framework's reward reading that can be recorded."""
    try:
        v = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return v if math.isfinite(v) else None


class TimingsWriter:
    """Writes a framework's phase timings of a run's steps from the process that holds the timers.

    Args:
        run_dir: the run directory the monitors write (a local path, ``file://`` or ``s3://`` URI).
        framework: whose timer names :meth:`record` gets (a key of ``timings.frameworks()``: ``"openrlhf"``,
            ``"skyrl"``, ...), or None for our phase names.
        roll_steps: steps per sealed block (as ``MonitorConfig.roll_steps``).

    Raises:
        UnsupportedLocationError: ``run_dir`` is of a URI scheme that is not supported (naming it).
        ValueError: an empty ``run_dir``, or a ``framework`` that is not a key of ``timings.frameworks()``
            (naming the accepted ones).
    """

    def __init__(self, run_dir, framework: Optional[str] = None, roll_steps: int = ROLL_STEPS):
        if run_dir is None or not str(run_dir).strip():
            raise ValueError(f"TimingsWriter: run_dir must name the run directory, got {run_dir!r}")
        if framework is not None and framework not in frameworks():
            raise ValueError(f"TimingsWriter: framework {framework!r} is not one of {sorted(frameworks())} "
                             "(or None for our phase names)")
        self.layout = RunLayout(run_dir)
        self.framework = framework
        self.attempt = new_attempt_id()
        self.roll_steps = int(roll_steps)
        #: the last monitored step a row was written for
        self.last_step: Optional[int] = None
        #: rows written
        self.rows = 0
        self._writer: Optional[BlockWriter] = None
        self._lock = threading.Lock()
        self._warned: set = set()
        self._closed = False
        atexit.register(self.close)

    def latest_step(self) -> Optional[int]:
        """The newest step the run's newest attempt wrote to its steps table (its index: a listing, nothing
        opened; a resumed job's new attempt, not the steps an earlier attempt wrote beyond it); None when none."""
        parts = RunLayout(self.layout.store).index("steps").parts
        if not parts:
            return None
        newest = max(p.attempt for p in parts)
        return max(p.hi for p in parts if p.attempt == newest)

    def record(self, timers: Mapping[str, object], step: Optional[int] = None,
               framework_step: Optional[int] = None, reward: Optional[float] = None) -> Optional[int]:
        """Write the phase timings (and the framework's reward) of one monitored step.

        Args:
            timers: ``{name: seconds}``: the framework's metrics dict as it logs it; only the framework's own
                timer names are read (``timings.frameworks()``, as the framework logs them; a ``reward`` or
                ``step`` key of its metrics is no duration), our phase names when no framework was said; timers of
                no phase of their own are left out (:func:`triage_monitor.metrics.timings.phase_times`).
            step: the monitored step they belong to (an int); None: the newest step the run's newest attempt
                wrote, when it is newer than the last one recorded — for a synchronous trainer whose workers have
                written (flushed) the step's rows before the driver's step timer closed (in a framework's Ray
                workers they are on disk at the optimizer step); a monitor in this process writes its rows in the
                background, so pass ``step`` there.
            framework_step: the framework's own step number, kept in the row.
            reward: the framework's reward of the step (its mean over the step's responses, as the framework
                logs it); readers fill the steps table's ``reward`` column from it where the row has none.  None,
                or a value that is not a finite number: no reward (a NaN reward of a step whose samples were all
                aborted is no reading).

        Returns:
            The monitored step written, or None when nothing was: no timer among ``timers`` and no reward (a
            framework logs other metrics through the same call), after :meth:`close`, or — each said once in the
            log — a bad reading or step, no new step in the run, an I/O error.  Never raises.
        """
        with self._lock:
            if self._closed:
                return None
            try:
                return self._record(timers, step, framework_step, reward)
            except Exception as exc:  # noqa: BLE001 — monitoring never stops the training job
                self._warn_once("io", "triage-monitor: phase timings of step %s not written to %s (%s: %s)", step,
                                self.layout.display, type(exc).__name__, exc)
                return None

    def _record(self, timers, step, framework_step, reward=None) -> Optional[int]:
        if not isinstance(timers, Mapping):
            self._warn_once("type", "triage-monitor: phase timings not recorded: timers must be a dict of name -> "
                            "seconds, got %s", type(timers).__name__)
            return None
        try:
            times = phase_times({k: v for k, v in timers.items() if self._is_timer(k)}, self.framework)
            if step is not None:
                step = integer("step", step)
            if framework_step is not None:
                framework_step = integer("framework_step", framework_step)
        except ValueError as exc:
            self._warn_once("bad", "triage-monitor: phase timings not recorded (%s)", exc)
            return None
        reward = finite_or_none(reward)
        if not times and reward is None:
            return None
        if step is None:
            step = self.latest_step()
            if step is None or (self.last_step is not None and step <= self.last_step):
                self._warn_once("no-step", "triage-monitor: phase timings of %s step %s not recorded: the run %s "
                                "holds no monitored step newer than the last one timed (%s)",
                                self.framework or "a", framework_step, self.layout.display, self.last_step)
                return None
        row = timings_row(step, 0, self.attempt, times, self.framework, framework_step, reward)
        if self._writer is None:
            self._writer = BlockWriter(self.layout.store, "timings", 0, self.attempt, self.roll_steps)
        self._writer.write(step, pa.Table.from_pylist([row], schema=TIMINGS_SCHEMA))
        if self._writer.error is not None:
            err, self._writer.error = self._writer.error, None
            self._warn_once("block", "triage-monitor: a block of the timings table in %s could not be written "
                            "(%s); its steps stay in pending files", self.layout.display, err)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.rows += 1
        return step

    def _is_timer(self, name) -> bool:
        """A timer of the framework as it logs it (its own names only, through its ``key`` — TRL's profiling
        prefix — but no bare name its key would complete: verl's ``step`` or ``reward`` metric is no duration,
        :attr:`~triage_monitor.metrics.timings.FrameworkTimers.needs_framework`), or one of our phase names when no
        framework was said."""
        if not isinstance(name, str):
            return False
        if self.framework is None:
            return is_timer_name(name)
        fw = frameworks()[self.framework]
        return name in fw.timers or (not fw.needs_framework and fw.key(name) in fw.timers)

    def close(self) -> None:
        """Seal the open block (idempotent; never raises)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            w, self._writer = self._writer, None
        atexit.unregister(self.close)
        if w is not None:
            try:
                w.close()
            except Exception as exc:  # noqa: BLE001 — its steps stay in pending files, which readers read
                log.warning("triage-monitor: the last block of the timings table in %s could not be sealed (%s); "
                            "its steps stay in pending files", self.layout.display, exc)

    def __enter__(self) -> "TimingsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
