"""Weights & Biases: per-step metric logging and an alert sink (both optional).

``wandb`` is imported lazily: without it installed, :class:`WandbLogger` and
:class:`WandbAlertSink` turn into no-ops and say so once (a logging warning);
nothing else in triage-monitor needs it.

Logging layout: the curated metrics of a step (:data:`triage_monitor.alerting.trackers.CURATED_KEYS`; ``keys="all"``
for every metric) go to ``triage/<name>`` (``window/rho_asym`` -> ``triage/window/rho_asym``) together with
``triage/step``, which ``wandb.Run.define_metric`` declares the x-axis of
``triage/*``.  The logger is also an alert sink: :meth:`WandbLogger.emit` sends an alert with
``wandb.Run.alert`` (what :class:`WandbAlertSink` does for a run you hold yourself).  The logger never passes ``step=`` to ``wandb.Run.log``: W&B's
own ``_step`` must increase, and a resumed job repeats training steps, so a
repeated step is logged again as a new history row with the same
``triage/step`` (charts plot the later point over the earlier one; the
run directory's Parquet is where the latest attempt replaces the earlier).

Nothing here raises into the training loop: a failing W&B call is reported
once (with its traceback) and skipped.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Sequence

from .alert_rules import TIERS
from .trackers import PREFIX, CallGuard, check_keys, tracker_metrics

log = logging.getLogger("triage_monitor.wandb")
_missing_reported = False


def import_wandb():
    """Return the ``wandb`` module, or None (reported once) when it is not installed."""
    global _missing_reported
    try:
        import wandb
    except ImportError:
        if not _missing_reported:
            _missing_reported = True
            log.warning("wandb is not installed: W&B logging and alerts are disabled "
                        "(pip install 'triage-monitor[wandb]')")
        return None
    return wandb


def check_tiers(tiers: Sequence[str], where: str) -> tuple[str, ...]:
    """``tiers`` as a tuple of known alert tiers (:data:`~triage_monitor.alerting.alert_rules.TIERS`).

    Raises:
        ValueError: a string instead of a list, or an unknown tier, naming ``where`` and the value.
    """
    if isinstance(tiers, str) or not all(t in TIERS for t in tiers):
        raise ValueError(f"{where}={tiers!r}: give a list of tiers out of {TIERS}")
    return tuple(tiers)


class _Guard(CallGuard):
    """Report the first failure of each named operation, count the rest (on the ``triage_monitor.wandb`` logger)."""

    def __init__(self, owner: str):
        super().__init__(owner, log)


class WandbLogger:
    """Log the monitor's per-step metrics to a W&B run.

    Args:
        run: a ``wandb.Run``; None uses the active run (``wandb.run``) or, with
            ``start=True``, starts one with ``wandb.init(**init_kwargs)`` on the
            first call and finishes it in :meth:`close`.
        config: recorded in the run config under ``triage`` (your own facts: model, recipe ...); the
            monitor's manifest is merged into the same ``triage`` entry, so both are kept.
        prefix: key prefix (default ``"triage/"``).
        init_kwargs: passed to ``wandb.init`` (default ``project="triage-monitor"``).
        start: allow starting a run when none is given or active (tried once; a failure
            is reported and the logger stays inactive).
        keys: the metrics logged: ``"curated"`` (default, :data:`~triage_monitor.alerting.trackers.CURATED_KEYS`),
            ``"all"``, or a list of names.
        alert_tiers: the alert tiers raised as W&B alerts (:class:`WandbAlertSink`'s ``tiers``): the collapse tier
            only by default; ``("mismatch", "collapse")`` for both.

    ``log_metrics(step, metrics)``: step is an int; metrics ``dict[str, float]``
    (NaN allowed: logged as NaN; a value that is not a number is skipped).  ``emit(alert)``: the alert as a
    W&B alert (:class:`WandbAlertSink`).

    Raises:
        ValueError: a bad ``keys`` selection or an unknown tier.
    """

    def __init__(self, run=None, *, config: Optional[Mapping] = None, prefix: str = PREFIX,
                 init_kwargs: Optional[Mapping] = None, start: bool = True, keys="curated",
                 alert_tiers: Sequence[str] = ("collapse",)):
        self.prefix, self.start = prefix, start
        self.alert_tiers = check_tiers(alert_tiers, "WandbLogger: alert_tiers")
        self.keys = check_keys(keys)
        self.init_kwargs = dict(init_kwargs or {"project": "triage-monitor"})
        self._run, self._owned, self._defined = run, False, False
        self._pending_config = dict(config) if config else None
        self._config: dict = {}            # everything recorded under "triage" so far (merged, never replaced)
        self._guard = _Guard("WandbLogger")
        self._wandb = import_wandb()

    @property
    def run(self):
        """The W&B run in use, starting one if allowed; None when W&B is unavailable."""
        if self._run is None and self._wandb is not None:
            self._run = self._wandb.run
            if self._run is None and self.start:
                self.start = False     # one attempt: a failing init (no API key, no network) is not retried
                self._run = self._guard("wandb.init", self._wandb.init, **self.init_kwargs)
                self._owned = self._run is not None
        return self._run

    def log_config(self, config: Mapping) -> None:
        """Merge ``config`` (JSON-able mapping, e.g. the run manifest) into the run config's ``triage`` entry.

        Earlier calls' keys are kept (the user's ``config=`` and the monitor's manifest both survive); a key given
        again takes the newer value.
        """
        run = self.run
        if run is not None:
            self._config.update(config)
            self._guard("config.update", run.config.update, {"triage": dict(self._config)}, allow_val_change=True)

    def _setup(self, run) -> None:
        self._defined = True
        step_key = self.prefix + "step"
        self._guard("define_metric", run.define_metric, step_key)
        self._guard("define_metric", run.define_metric, self.prefix + "*", step_metric=step_key)
        if self._pending_config:
            self.log_config(self._pending_config)
            self._pending_config = None

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log one step: ``{prefix+"step": step, prefix+name: float(value), ...}``."""
        run = self.run
        if run is None:
            return
        if not self._defined:
            self._setup(run)
        row: dict[str, float] = {self.prefix + "step": int(step)}
        row.update((self.prefix + k, v) for k, v in tracker_metrics(metrics, self.keys).items())
        self._guard("run.log", run.log, row)

    def emit(self, alert) -> None:
        """Send one alert as a W&B alert on this logger's run (:class:`WandbAlertSink`)."""
        if self._sink is None:
            self._sink = WandbAlertSink(self, tiers=self.alert_tiers)
        self._sink.emit(alert)

    _sink: Optional["WandbAlertSink"] = None

    def close(self) -> None:
        """Finish the run if this logger started it."""
        if self._owned and self._run is not None:
            self._guard("run.finish", self._run.finish)
        self._owned = False


class WandbAlertSink:
    """Send alerts with ``wandb.Run.alert(title, text, level, wait_duration)``.

    Args:
        target: a ``wandb.Run``, a :class:`WandbLogger` (its run is used), or None
            (the active ``wandb.run`` at alert time).
        tiers: the alert tiers raised as W&B alerts (docs/alerts.md#tiers): ``("collapse",)`` by default, the
            warnings of a coming divergence; ``("mismatch", "collapse")`` raises the informational tier too.
    The alert's ``wait_s`` becomes ``wait_duration`` (seconds; W&B suppresses a
    second alert with the same title within it).  Failures are reported once.

    Raises:
        ValueError: ``tiers`` names an unknown tier.
    """

    def __init__(self, target=None, tiers: Sequence[str] = ("collapse",)):
        self.target = target
        self.tiers = check_tiers(tiers, "WandbAlertSink: tiers")
        self._wandb = import_wandb()
        self._guard = _Guard("WandbAlertSink")
        self._no_run_reported = False

    def _run(self):
        if isinstance(self.target, WandbLogger):
            return self.target.run
        if self.target is not None:
            return self.target
        return self._wandb.run if self._wandb is not None else None

    def emit(self, alert) -> None:
        """Send one :class:`~triage_monitor.alerting.alerts.Alert` (no-op without wandb or a run, or for a tier not in
        :attr:`tiers`)."""
        if self._wandb is None or getattr(alert, "tier", "collapse") not in self.tiers:
            return
        run = self._run()
        if run is None:
            if not self._no_run_reported:
                self._no_run_reported = True
                log.warning("WandbAlertSink: no W&B run; alerts go to the other sinks only")
            return
        wait = alert.wait_s if math.isfinite(alert.wait_s) and alert.wait_s > 0 else None
        self._guard("run.alert", run.alert, title=alert.title, text=alert.text, level=alert.level,
                    wait_duration=wait)


__all__ = ["WandbLogger", "WandbAlertSink", "import_wandb", "PREFIX"]
