"""TensorBoard: per-step scalars and alert text (optional).

``tensorboard`` is imported lazily (through ``torch.utils.tensorboard.SummaryWriter``, which needs the
``tensorboard`` package: ``pip install 'triage-monitor[tensorboard]'``).  Without it, :class:`TensorBoardLogger`
is a no-op and one warning says so; nothing else in triage-monitor needs it.

Layout in the event files of ``log_dir`` (docs/alerts.md#trackers):

* ``triage/<name>`` scalars (``triage/window/rho_asym``, ...) of the curated set
  (:data:`triage_monitor.alerting.trackers.CURATED_KEYS`; ``keys="all"`` for every metric), at ``global_step`` = the monitored
  step; NaN is written as NaN;
* ``triage/alerts`` text: one entry per alert at the alert's step (``**<title>** at step <step>`` and the alert
  text), and the ``triage/alerts_fired`` scalar: the number of alerts this logger received so far, at that step;
* ``triage/config`` text at step 0: the run's manifest (and your ``config=``), as indented JSON.

A resumed job repeats step numbers; TensorBoard's reader then drops the earlier events from the repeated step on
(its handling of a restarted job), so the latest attempt is what TensorBoard shows, as in the run directory.

Nothing here raises into the training loop: a failing writer call is reported once (with its traceback) and
skipped; calls after :meth:`TensorBoardLogger.close` do nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Optional

from .trackers import PREFIX, CallGuard, check_keys, tracker_metrics

log = logging.getLogger("triage_monitor.tensorboard")
_missing_reported = False


def import_summary_writer():
    """``torch.utils.tensorboard.SummaryWriter``, or None (reported once per process) when ``tensorboard`` is not
    installed."""
    global _missing_reported
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _missing_reported:
            _missing_reported = True
            log.warning("tensorboard is not installed: TensorBoard logging and alerts are disabled "
                        "(pip install 'triage-monitor[tensorboard]')")
        return None
    return SummaryWriter


def _indented(obj) -> str:
    """JSON as a Markdown code block (four-space indent), which TensorBoard's text view shows verbatim."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardLogger:
    """Write the monitor's per-step metrics and its alerts to TensorBoard event files.

    Args:
        log_dir: the event-file directory (``SummaryWriter(log_dir)``; None: SummaryWriter's default
            ``runs/<date>_<host>`` under the working directory).
        keys: the metrics logged: ``"curated"`` (default, :data:`~triage_monitor.alerting.trackers.CURATED_KEYS`),
            ``"all"``, or a list of names (:func:`~triage_monitor.alerting.trackers.check_keys`).
        prefix: tag prefix (default ``"triage/"``).
        writer: a ``SummaryWriter`` of your own to write into instead (flushed, never closed, by this logger).
        flush_secs: how often the writer flushes to disk, seconds (SummaryWriter's ``flush_secs``); every alert
            is flushed at once.
        config: facts of yours written with the manifest under ``triage/config``.
        metrics: False writes only alerts and config (e.g. where the framework's own TensorBoard callback
            already receives the metrics).

    ``log_metrics(step, metrics)``: ``step`` int, ``metrics`` ``dict[str, float]`` (a value that is not a number
    is skipped).  ``emit(alert)``: one :class:`~triage_monitor.alerting.alerts.Alert` as text.

    Raises:
        ValueError: a bad ``keys`` selection.
    """

    def __init__(self, log_dir: Optional[str] = None, *, keys="curated", prefix: str = PREFIX, writer=None,
                 flush_secs: int = 30, config: Optional[Mapping] = None, metrics: bool = True):
        self.keys = check_keys(keys)
        self.log_dir, self.prefix, self.flush_secs, self.metrics = log_dir, prefix, int(flush_secs), bool(metrics)
        self._writer, self._owned = writer, writer is None
        self._cls = import_summary_writer() if writer is None else None
        self._tried = writer is not None
        self._closed = False
        self._config_written = False
        self._config: dict = dict(config or {})
        self._guard = CallGuard("TensorBoardLogger", log)
        #: alerts received so far (the ``triage/alerts_fired`` scalar)
        self.alerts_sent = 0

    @property
    def writer(self):
        """The ``SummaryWriter`` in use (created on first use); None when TensorBoard is unavailable, creating it
        failed, or the logger is closed."""
        if self._closed:
            return None
        if self._writer is None and not self._tried and self._cls is not None:
            self._tried = True             # one attempt: an unwritable log_dir is reported once, not retried
            self._writer = self._guard("SummaryWriter", self._cls, log_dir=self.log_dir, flush_secs=self.flush_secs)
        return self._writer

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write one step: a scalar ``prefix + name`` per selected metric at ``global_step=step``."""
        w = self.writer
        if w is None:
            return
        if self._config and not self._config_written:
            self.log_config({})
        if not self.metrics:
            return
        for name, value in tracker_metrics(metrics, self.keys).items():
            self._guard("add_scalar", w.add_scalar, self.prefix + name, value, global_step=int(step))

    def emit(self, alert) -> None:
        """Write one alert: text under ``prefix + "alerts"`` and the running count under
        ``prefix + "alerts_fired"``, both at the alert's step; flushed now."""
        w = self.writer
        if w is None:
            return
        self.alerts_sent += 1
        step = int(alert.step)
        text = f"**{alert.title}** at step {step}\n\n{alert.text}"
        self._guard("add_text", w.add_text, self.prefix + "alerts", text, global_step=step)
        self._guard("add_scalar", w.add_scalar, self.prefix + "alerts_fired", float(self.alerts_sent),
                    global_step=step)
        self._guard("flush", w.flush)

    def log_config(self, config: Mapping) -> None:
        """Write ``config`` (JSON-able mapping, e.g. the run manifest), merged with earlier calls' and the
        constructor's ``config``, as text ``prefix + "config"`` at step 0."""
        w = self.writer
        if w is None:
            return
        self._config.update(config)
        self._config_written = True
        self._guard("add_text", w.add_text, self.prefix + "config", _indented(self._config), global_step=0)

    def close(self) -> None:
        """Flush; close the writer if this logger created it.  Idempotent; later calls write nothing."""
        w = None if self._closed else self._writer
        self._closed = True
        if w is None:
            return
        self._guard("flush", w.flush)
        if self._owned:
            self._guard("close", w.close)


__all__ = ["TensorBoardLogger", "import_summary_writer"]
