"""MLflow: per-step metrics, alerts as run tags and text artifacts (optional).

``mlflow`` is imported lazily (``pip install 'triage-monitor[mlflow]'`` installs ``mlflow-skinny``, the tracking
client; the full ``mlflow`` works the same).  Without it, :class:`MLflowLogger` is a no-op and one warning says
so; nothing else in triage-monitor needs it.

What a run receives (docs/alerts.md#trackers):

* metrics ``triage/<name>`` of the curated set (:data:`triage_monitor.alerting.trackers.CURATED_KEYS`; ``keys="all"`` for
  every metric) with ``step`` = the monitored step, one ``log_batch`` per step; NaN is logged as NaN;
* per alert: the tag ``triage.alert.<rule>`` = ``"<LEVEL> at step <step>: <text>"`` (the rule's latest alert),
  ``triage.alerts_fired`` (alerts received so far), ``triage.last_alert`` (``"step <step>: <title>"``), the
  metric ``triage/alerts_fired`` at the alert's step, and a text artifact
  ``triage/alerts/step<step, 8 digits>-<rule>.txt`` (title, text and the alert's fields as JSON);
* the run's manifest (and your ``config=``) as the artifact ``triage/config.json`` (rewritten, merged, on each
  :meth:`MLflowLogger.log_config`).

All calls go through an ``MlflowClient`` with the run id, so the logger never changes the process's active
(fluent) run: a framework callback that starts its own run (transformers' ``MLflowCallback``) is not affected.

Nothing here raises into the training loop: a failing MLflow call is reported once (with its traceback) and
skipped; calls after :meth:`MLflowLogger.close` do nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any, Mapping, Optional

from .trackers import PREFIX, CallGuard, check_keys, tracker_metrics

log = logging.getLogger("triage_monitor.mlflow")
_missing_reported = False

#: MLflow's limits: tag values (characters) and metrics per ``log_batch`` call.
MAX_TAG_CHARS = 5000
BATCH = 1000


def import_mlflow():
    """Return the ``mlflow`` module, or None (reported once per process) when it is not installed."""
    global _missing_reported
    try:
        import mlflow
        from mlflow.tracking import MlflowClient  # noqa: F401  (the client is what the logger uses)
    except ImportError:
        if not _missing_reported:
            _missing_reported = True
            log.warning("mlflow is not installed: MLflow logging and alerts are disabled "
                        "(pip install 'triage-monitor[mlflow]')")
        return None
    return mlflow


def _safe_name(name: str) -> str:
    """A rule name as MLflow accepts it in tag keys and artifact file names (other characters become ``_``)."""
    return re.sub(r"[^0-9A-Za-z_\-.]", "_", str(name)) or "_"


class MLflowLogger:
    """Log the monitor's per-step metrics and its alerts to an MLflow run.

    Args:
        tracking_uri: the tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db`` (full ``mlflow``
            package), ``file:/path/mlruns``); None: MLflow's own (``MLFLOW_TRACKING_URI``, else its default).
            MLflow 3.18 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set: a ``file:`` URI
            given here is an explicit choice of that store, so the logger sets the variable in its process (unless
            it is set already: ``false`` keeps MLflow's refusal, reported once); the worker process that builds the
            logger is the one that needs it, so a Ray job needs nothing more.
        experiment: experiment name of a run this logger starts (created if missing); None:
            ``MLFLOW_EXPERIMENT_NAME``, else ``"triage-monitor"``.
        run_id: log into this existing run (never ended by the logger).  None: the active run
            (``mlflow.active_run()``, when ``tracking_uri`` is None or MLflow's current one), else, with
            ``start=True``, a new run that :meth:`close` ends.
        keys: the metrics logged: ``"curated"`` (default, :data:`~triage_monitor.alerting.trackers.CURATED_KEYS`),
            ``"all"``, or a list of names.
        prefix: metric key prefix (default ``"triage/"``).
        run_name, tags: of a run this logger starts.
        config: facts of yours written with the manifest into ``triage/config.json``.
        metrics: False logs only alerts and config (e.g. into the run of transformers' ``MLflowCallback``,
            which already receives the framework's ``triage/*`` keys at the framework's step).
        start: allow starting a run (tried once; a failure is reported and the logger stays inactive).

    ``log_metrics(step, metrics)``: ``step`` int, ``metrics`` ``dict[str, float]`` (a value that is not a number
    is skipped).  ``emit(alert)``: one :class:`~triage_monitor.alerting.alerts.Alert` as tags and an artifact.

    Raises:
        ValueError: a bad ``keys`` selection.
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 run_id: Optional[str] = None, *, keys="curated", prefix: str = PREFIX,
                 run_name: Optional[str] = None, tags: Optional[Mapping[str, str]] = None,
                 config: Optional[Mapping] = None, metrics: bool = True, start: bool = True):
        self.keys = check_keys(keys)
        self.tracking_uri, self.prefix, self.metrics, self.start = tracking_uri, prefix, bool(metrics), start
        if isinstance(tracking_uri, str) and tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")      # asked for by name (see tracking_uri)
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "triage-monitor"
        self.run_name, self.tags = run_name, dict(tags or {})
        self._run_id, self._owned = run_id, False
        self._client: Any = None           # an mlflow.tracking.MlflowClient once resolved (mlflow is imported lazily)
        self._resolved, self._closed = False, False
        self._config: dict = dict(config or {})
        self._config_written = False
        self._guard = CallGuard("MLflowLogger", log)
        self._mlflow = import_mlflow()
        #: alerts received so far (tag ``triage.alerts_fired``)
        self.alerts_sent = 0

    # ------------------------------------------------------------------ the run
    @property
    def client(self):
        """The ``MlflowClient`` in use (None when MLflow is unavailable or the run could not be resolved)."""
        return self._client if self.run_id is not None else None

    @property
    def run_id(self) -> Optional[str]:
        """The run logged into, resolved on first use (the given run, the active run, or a new one); None when
        MLflow is unavailable, resolving failed, or the logger is closed."""
        if self._closed:
            return None
        if not self._resolved and self._mlflow is not None:
            self._resolved = True          # one attempt: an unreachable store is reported once, not retried
            self._resolve()
        return self._run_id if self._client is not None else None

    def _resolve(self) -> None:
        mlflow, g = self._mlflow, self._guard
        current = g("get_tracking_uri", mlflow.get_tracking_uri)
        active = g("active_run", mlflow.active_run) if self._run_id is None else None
        if active is not None and self.tracking_uri not in (None, current):
            active = None                  # the active run lives in another store
        self._client = g("MlflowClient", mlflow.tracking.MlflowClient, tracking_uri=self.tracking_uri or current)
        if self._client is None or self._run_id is not None:
            return
        if active is not None:
            self._run_id = active.info.run_id
            return
        if not self.start:
            return
        exp = g("get_experiment_by_name", self._client.get_experiment_by_name, self.experiment)
        exp_id = exp.experiment_id if exp is not None else g("create_experiment", self._client.create_experiment,
                                                              self.experiment)
        if exp_id is None:
            self._client = None
            return
        run = g("create_run", self._client.create_run, exp_id, tags=self.tags or None, run_name=self.run_name)
        if run is None:
            self._client = None
            return
        self._run_id, self._owned = run.info.run_id, True

    # ------------------------------------------------------------------ logging
    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log one step: metric ``prefix + name`` per selected metric with ``step``, in one ``log_batch``."""
        run_id = self.run_id
        if run_id is None:
            return
        if self._config and not self._config_written:
            self.log_config({})
        if not self.metrics:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(self.prefix + k, v, now, int(step)) for k, v in tracker_metrics(metrics, self.keys).items()]
        for i in range(0, len(rows), BATCH):
            self._guard("log_batch", self._client.log_batch, run_id, metrics=rows[i:i + BATCH])

    def emit(self, alert) -> None:
        """Record one alert: tags ``triage.alert.<rule>``, ``triage.alerts_fired``, ``triage.last_alert``, the
        metric ``prefix + "alerts_fired"`` at the alert's step (not with ``metrics=False``: that run's metric axis
        is another logger's, e.g. transformers' global step), and a text artifact."""
        run_id = self.run_id
        if run_id is None:
            return
        from mlflow.entities import Metric, RunTag

        self.alerts_sent += 1
        step, rule = int(alert.step), _safe_name(alert.rule)
        tags = [RunTag(f"triage.alert.{rule}", f"{alert.level} at step {step}: {alert.text}"[:MAX_TAG_CHARS]),
                RunTag("triage.alerts_fired", str(self.alerts_sent)),
                RunTag("triage.last_alert", f"step {step}: {alert.title}"[:MAX_TAG_CHARS])]
        count = ([Metric(self.prefix + "alerts_fired", float(self.alerts_sent), int(time.time() * 1000), step)]
                 if self.metrics else [])
        self._guard("log_batch", self._client.log_batch, run_id, metrics=count, tags=tags)
        fields = alert.to_row() if hasattr(alert, "to_row") else {}
        body = f"{alert.title}\n\n{alert.text}\n\n{json.dumps(fields, indent=2, sort_keys=True, default=str)}\n"
        self._guard("log_text", self._client.log_text, run_id, body, f"triage/alerts/step{step:08d}-{rule}.txt")

    def log_config(self, config: Mapping) -> None:
        """Write ``config`` (JSON-able mapping, e.g. the run manifest), merged with earlier calls' and the
        constructor's ``config``, as the artifact ``triage/config.json``."""
        run_id = self.run_id
        if run_id is None:
            return
        self._config.update(config)
        self._config_written = True
        text = json.dumps(self._config, indent=2, sort_keys=True, default=str)
        self._guard("log_text", self._client.log_text, run_id, text, "triage/config.json")

    def close(self) -> None:
        """End the run (status ``FINISHED``) if this logger started it.  Idempotent; later calls log nothing."""
        if self._closed:
            return
        if self._owned and self._client is not None:
            self._guard("set_terminated", self._client.set_terminated, self._run_id, "FINISHED")
        self._owned, self._closed = False, True


__all__ = ["MLflowLogger", "import_mlflow"]
