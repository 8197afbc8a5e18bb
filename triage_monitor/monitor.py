"""MismatchMonitor: the one object a training loop calls once per step.

    mon = MismatchMonitor("runs/exp1", MonitorConfig(), manifest={"framework": "verl"})
    for step, data in enumerate(loader):
        batch = TokenBatch.from_padded(learner_logp, sampler_logp, advantages, response_mask)
        metrics = mon.log_step(step, batch, extra={"reward": reward_mean})
    mon.close()

Per step it computes the docs/metrics.md#steps-and-windows metrics (per step and over the trailing
window, keys ``name`` and ``window/name``), evaluates the alert rules (the shipped defaults unless told
otherwise: docs/alerts.md), queues the valid tokens and the metric row for the background Parquet writer (the
caller only pays for a host copy), and feeds the optional trackers (W&B, TensorBoard, MLflow:
:mod:`triage_monitor.alerting.trackers`).

Alerts and trackers are the reporting rank's: in a multi-rank job every rank writes its own records, but only
rank 0 of the monitor's process group (``group``; the world group by default) — whose metrics are the ones
all-reduced over that group under ``torch.distributed`` — evaluates the rules and calls the trackers, so each
alert is raised, logged and sent once per job, not once per rank (:attr:`MismatchMonitor.reports`).

Monitoring I/O and sinks never raise into the training loop: failures are
counted, reported once and skipped.  Invalid training data does raise
(:class:`~triage_monitor.batch.InvalidTokenError`) unless the batch was built
with ``on_invalid="quarantine"``; quarantined tokens are counted in the step's
metrics (``quarantined_count``, ``nonfinite_count``, ...) and written to the
``quarantine/`` table.  Input diagnostics (padding leaks, one-position shifts on the first steps) and the
writer's dropped rows are per-step metrics too (:data:`INTEGRITY_METRICS`, docs/reliability.md).

One run per directory: a new monitor continues an existing run only when its configuration matches
(``resume=True`` / ``force=True`` for the other cases); one live writer per rank (a lock file).  These checks,
and whether the directory is writable, raise at construction, never later.

Resuming: every process start is a new attempt (one id shared by all ranks); put
:meth:`MismatchMonitor.state_dict` in your checkpoint and :meth:`~MismatchMonitor.load_state_dict` it on
resume to keep τ_tail; without it, a τ_tail frozen by an earlier attempt is read back from ``run.json``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, Optional, Sequence, TypedDict, TypeVar, Union

import numpy as np
import torch

from . import __version__
from .alerting.alert_rules import Rule
from .alerting.alerts import Alert, AlertObserver, AlertSink, Closable, RuleReporter, build_engine
from .metrics.alignment import check_alignment, padding_diagnostics
from .batch import TokenBatch
from .config import MetricConfig, MonitorConfig  # noqa: F401  (MonitorConfig's public home stays importable here)
from .rundir.layout import RunLayout
from .rundir.manifest import check_monitor_config
from .metrics.stats import METRIC_NAMES, MetricTracker
from .rundir.records import BOOKKEEPING_COLUMNS, TOKEN_SCHEMA, RunWriter, check_writer_options, new_attempt_id
from .rundir.sink import WAIT_TIMEOUT_S
from .rundir.records import steps_schema as records_steps_schema
from .metrics.timings import (COLUMNS as TIME_PHASES, PREFIX as TIME_PREFIX, TIME_COLUMNS, columns_of, integer, phase_of,
                      phase_times)
from .alerting.trackers import ConfigRecorder, MetricLogger, build_trackers

_R = TypeVar("_R")
log = logging.getLogger("triage_monitor")

#: Step-level counters taken from TokenBatch.quarantine_counts (docs/reliability.md), always present in the metrics.
QUARANTINE_METRICS = {
    "nonfinite_count": ("nonfinite_learner_logp", "nonfinite_sampler_logp"),
    "positive_logp_count": ("positive_learner_logp", "positive_sampler_logp"),
    "sentinel_logp_count": ("sentinel_learner_logp", "sentinel_sampler_logp"),
    "nonfinite_advantage_count": ("nonfinite_advantage",),
}

#: Input-integrity and writer-health metrics every step carries besides docs/metrics.md#steps-and-windows (all counts, alertable;
#: docs/reliability.md): the quarantine counters above, ``quarantined_count``, the padding-leak counters of
#: :func:`~triage_monitor.metrics.alignment.padding_diagnostics`, ``empty_response_count`` (responses with no valid
#: token) and ``writer_dropped_rows`` (rows the background writer dropped so far: full/read-only disk or
#: backpressure="drop").  The first ``alignment_check_steps`` steps also carry ``alignment_suspect``,
#: ``alignment_shift`` and ``alignment_ratio`` (:func:`~triage_monitor.metrics.alignment.check_alignment`).
INTEGRITY_METRICS = (*QUARANTINE_METRICS, "quarantined_count", "zero_logp_count", "padding_run_count",
                     "padding_run_tokens", "offset_response_count", "empty_response_count", "writer_dropped_rows")
#: The input-alignment check of the first ``alignment_check_steps`` steps (NaN on the later ones).
ALIGNMENT_METRICS = ("alignment_suspect", "alignment_shift", "alignment_ratio")
#: The alert state of the step: the number of rules that fired and have not cleared (the reporting rank, rank 0 of
#: the monitor's process group; NaN on the other ranks and without rules), so trackers and charts can overlay it (docs/alerts.md#trackers).
ALERT_STATE = "alerts_active"
STATE_VERSION = 1


#: Keys the monitor computes; an ``extra`` passed to log_step may not reuse them.
RESERVED_KEYS = frozenset({"step", "tau_tail_frozen", *ALIGNMENT_METRICS, *TIME_COLUMNS,
                           ALERT_STATE, *INTEGRITY_METRICS, *METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)})


def step_columns(extras: Sequence[str] = ()) -> tuple[str, ...]:
    """The float64 metric columns of the steps table, in file order: the step metrics (:data:`METRIC_NAMES`),
    the integrity counters (:data:`INTEGRITY_METRICS`, the alignment check before ``writer_dropped_rows``),
    ``tau_tail_frozen``, the ``window/<name>`` metrics, the phase timings ``time/<phase>`` and ``time/step``
    (seconds, NaN where not timed: :data:`triage_monitor.metrics.timings.TIME_COLUMNS`), the ``extras`` given at the first
    step (their order; names of the writer's bookkeeping columns and of the timing columns left out) and
    ``alerts_active`` — the order of :meth:`MismatchMonitor.log_step`'s keys."""
    counters = [k for k in INTEGRITY_METRICS if k != "writer_dropped_rows"]
    extras = [k for k in dict.fromkeys(extras) if k not in BOOKKEEPING_COLUMNS and k not in TIME_COLUMNS]
    return (*METRIC_NAMES, *counters, *ALIGNMENT_METRICS, "writer_dropped_rows", "tau_tail_frozen",
            *(f"window/{k}" for k in METRIC_NAMES), *TIME_COLUMNS, *extras, ALERT_STATE)


def steps_schema(extras: Sequence[str] = ()):
    """The declared schema of a monitor's steps table whose first step passed ``extras`` (their names): int64
    ``step`` / ``rank``, the float64 :func:`step_columns`, int64 ``attempt``, float64 ``wall_time`` and the
    string ``nan_reasons`` (:func:`triage_monitor.rundir.records.steps_schema`; docs/metrics.md#run-directory-tables)."""
    return records_steps_schema(step_columns(extras))


class MonitorState(TypedDict):
    """:meth:`MismatchMonitor.state_dict`: the state's version and the metric tracker's calibration state."""

    version: int
    tracker: dict[str, Any]


class MismatchMonitor:
    """Records per-token log-probs and computes direction-aware metrics each step.

    Args:
        run_dir: the run directory: a local path, a ``file://`` URI, or an ``s3://bucket/prefix`` URI (an S3 or
            S3-compatible object store; credentials and endpoint from the usual AWS variables and files,
            docs/reliability.md#object-stores).  Created; an existing run of the same configuration is resumed as a
            new attempt, its manifest kept and the attempt appended; one of another configuration is refused,
            docs/reliability.md#one-run-per-directory).
        config: :class:`MonitorConfig`.
        manifest: free-form facts stored in ``run.json`` (model, recipes,
            correction, framework, user config ...).  Must be JSON-serialisable.
        loggers: trackers: objects with ``log_metrics(step, metrics)`` and ``close()`` (e.g.
            :class:`~triage_monitor.alerting.wandb_logger.WandbLogger`), or tracker configuration
            (``"tensorboard"``, ``{"kind": "mlflow", ...}``, :class:`~triage_monitor.alerting.trackers.TrackerSpec`),
            built here.  Called on the reporting rank only (rank 0 of ``group``); a tracker with
            ``emit(alert)`` also receives the alerts of an engine built here.
        alerts: the alert rules evaluated live (:func:`~triage_monitor.alerting.alerts.build_engine`): None (default)
            or True — the shipped default rules, each alert logged once as a warning line, written to the run's
            ``alerts/`` table and sent to the trackers; False — none; a rule file path or a list of rules;
            or your own engine (anything with ``observe(step, metrics) -> list`` of alerts with ``to_row()``,
            and ``close()``; its sinks are yours).  Evaluated on the reporting rank only (rank 0 of ``group``).
        rank: this process's rank in the run directory's files (default: the torch.distributed rank, else 0).
            The process of rank 0 writes ``run.json``.  When only the processes of ``group`` write the run (the
            other ranks hold replicas or run no loss), pass ``rank=torch.distributed.get_rank(group)``: its
            reporting rank is then the files' rank 0, which writes ``run.json`` and is the rank readers default to
            (:meth:`triage_monitor.offline.analysis.RunView.steps`), as the framework hooks do.
        group: torch.distributed process group the metric state is all-reduced over (default: the world group
            when torch.distributed is initialised).  Only its members take part in the monitor's collectives (the
            attempt broadcast, the per-step all-reduce), so a process outside it never has to call ``log_step``;
            its rank 0 reports.  This process must be a member.
        attempt: attempt id shared by every process of this job start (default: the id of rank 0 of ``group``,
            broadcast over it, or a new one).  Framework hooks pass the id drawn on the driver so that Ray
            workers without a process group still write one attempt.
        resume: continue an existing run even though its :data:`~triage_monitor.rundir.manifest.IDENTITY_KEYS`
            (model, task, correction, seed, ...) differ; the new attempt records the changes.
        force: start a new run; an existing one is moved to ``<run_dir>.replaced-<UTC time>`` (rank 0).

    Raises:
        ValueError: ``group`` is given and this process is not a member of it; ``rank`` or ``attempt`` outside
            0..2**63 - 1; a ``rank`` other than 0 without a torch.distributed group of two or more and without
            ``attempt`` (ranks that each drew their own attempt id would hide each other's records).
        TypeError: ``rank`` / ``attempt`` not an integer, ``resume`` / ``force`` not a boolean, ``config`` not a
            :class:`MonitorConfig` (each named, before anything is written).
        triage_monitor.errors.UnsupportedLocationError: ``run_dir`` is a URI of a scheme other than ``file://`` and
            ``s3://`` (``gs://bucket/run``): a ValueError naming the scheme, raised before anything is built or
            written.
        triage_monitor.errors.OutputError: at construction, before any step: the run directory cannot be
            written (``UnwritableOutputError``, naming the path and the OS reason), holds a run of another
            configuration (``RunConflictError``, naming the differing keys), or another live process writes
            this rank (``RunLockedError``).  After construction, monitoring I/O never raises.
    """

    def __init__(self, run_dir, config: Optional[MonitorConfig] = None, *, manifest: Optional[dict] = None,
                 loggers: Sequence = (), alerts=None, rank: Optional[int] = None, group=None,
                 attempt: Optional[int] = None, resume: bool = False, force: bool = False):
        import torch.distributed as dist

        check_writer_options("MismatchMonitor", rank=rank, attempt=attempt, resume=resume, force=force)
        if config is not None and not isinstance(config, MonitorConfig):
            raise TypeError(f"MismatchMonitor: config must be a MonitorConfig, got {type(config).__name__} (a dict: "
                            "MonitorConfig.from_dict(d))")
        check_monitor_config((config or MonitorConfig()).to_dict(), "MonitorConfig")  # as readers will, before
                                                                                        # trackers or files exist
        layout = RunLayout(run_dir)     # gs://... and other URI schemes: UnsupportedLocationError, before any work
        #: the run directory as users name it (a local path, or the s3:// URI without its query)
        self.run_dir = layout.display
        self.config = config or MonitorConfig()
        dist_on = dist.is_available() and dist.is_initialized()
        self._distributed = dist_on
        self.rank = int(rank if rank is not None else (dist.get_rank() if dist_on else 0))
        self.group = group
        #: this process's rank in ``group`` (its rank, without a group or torch.distributed)
        self.group_rank = self.rank
        if dist_on and group is not None:
            self.group_rank = dist.get_rank(group)
            if self.group_rank < 0:
                raise ValueError(f"MismatchMonitor: this process (rank {dist.get_rank()}) is not a member of the "
                                 "process group given as group=; build the monitor in the group's processes only")
        #: the number of processes whose state is all-reduced: the size of ``group`` (the world's without one)
        self.world_size = dist.get_world_size(group) if dist_on else 1
        if attempt is not None:
            self.attempt = int(attempt)
        elif dist_on and self.world_size > 1:
            self.attempt = _shared_attempt_id(group)
        elif self.rank != 0 and not dist_on:
            # each process would draw its own id, and readers keep a step's latest attempt across ranks: the ranks
            # would hide each other's records (docs/reliability.md#many-ranks)
            raise ValueError(f"MismatchMonitor: rank={self.rank} without a torch.distributed process group needs "
                             "attempt=: the id every process of this job start shares (draw it once, e.g. "
                             "triage_monitor.records.new_attempt_id() in the launcher, and pass it to every rank); "
                             "ranks that each draw their own would hide each other's records")
        else:
            self.attempt = new_attempt_id()
        #: rank 0 of ``group`` reports: it evaluates the rules and calls the trackers (its metrics are those
        #: all-reduced over the group).  Without torch.distributed: rank 0.
        self.reports = self.group_rank == 0
        #: whether this process's metrics are all-reduced with other processes' (a group of two or more)
        self.synchronised = dist_on and self.world_size > 1
        #: whether this process writes the step's steps row: rank 0 of a synchronised group (every rank's row would
        #: repeat it), every process that is not synchronised, or every rank with ``per_rank_steps``
        self.writes_steps = self.reports or not self.synchronised or self.config.per_rank_steps
        self.loggers: list[MetricLogger] = build_trackers(_in_run_dir(loggers, layout)) if self.reports else []
        self.alerts: Optional[AlertObserver] = (
            build_engine(alerts, sinks=[lg for lg in self.loggers if isinstance(lg, AlertSink)])
            if self.reports else None)
        self._failed_sinks: set[tuple[int, str]] = set()
        # rules the user gave (a file, a list, an engine): their metrics are checked at the first step; the shipped
        # defaults include rules on metrics only a controller logs (gate_downweighted_frac)
        self._own_rules = alerts is not None and not isinstance(alerts, bool)
        self.tracker = MetricTracker(self.config.metrics, self.config.window, self.config.tau_tail,
                                     self.config.calibration_steps)
        self.steps_logged = 0
        self._last_step: Optional[int] = None
        self._warned: set = set()          # warn-once keys (alignment, padding, dropped rows)
        self.writer = RunWriter(layout.store, self.attempt, self.rank, self.world_size, self.config.to_dict(),
                                dict(manifest or {}), {"tool_version": __version__, "torch": torch.__version__},
                                self.config.max_queue_bytes, self.config.backpressure, resume=resume, force=force)
        #: the local run directory's (device, inode) when built: close() tells a directory removed meanwhile
        self._root_id = _dir_id(self.writer.store)
        if self.reports and self.rank != 0:
            log.warning("triage-monitor: this process reports for its process group (its rank 0) but writes the run's "
                        "files as rank %d; run.json is written by the process of rank 0 and readers default to rank "
                        "0. If no process of %s has rank 0, pass rank=torch.distributed.get_rank(group)",
                        self.rank, self.run_dir)
        if self.writer.resumed_tau_tail is not None:
            # resumed job: keep the τ_tail the earlier attempt froze (docs/metrics.md#tau_tail) instead of
            # re-calibrating on post-resume steps.  MismatchMonitor.load_state_dict (from the user's checkpoint)
            # overrides this.
            self.tracker.load_state_dict({"tau_tail": self.writer.resumed_tau_tail, "tau_frozen": True})
            log.info("triage-monitor: resumed run, tau_tail = %.6g nats from %s", self.writer.resumed_tau_tail,
                     self.writer.store.display("run.json"))
        for lg in self.loggers:            # record the run's config (manifest) with each logger that takes one
            if isinstance(lg, ConfigRecorder):
                self._guard(lg.log_config, self.manifest)

    @property
    def sink(self):
        """The background Parquet writer (:class:`~triage_monitor.rundir.sink.ParquetSink`)."""
        return self.writer.sink

    @property
    def manifest(self) -> dict[str, Any]:
        """The run's manifest as the JSON object of ``run.json`` (:class:`~triage_monitor.rundir.manifest.RunManifest`)."""
        return self.writer.manifest.to_dict()

    # ---------------------------------------------------------------- per step
    def log_step(self, step: int, batch: TokenBatch, extra: Optional[dict] = None,
                 token_extras: Optional[dict] = None, timings: Optional[dict] = None) -> dict[str, float]:
        """Compute, record and report one step.

        Args:
            step: optimizer update index (int).  A repeated step (resumed job)
                replaces the earlier one in the trailing window and, on disk,
                is kept under the newer attempt.
            batch: the step's :class:`TokenBatch` (learner_logp may carry grad; it is detached here).
            extra: scalars from the training loop (reward, accuracy,
                controller stats ...), recorded and returned as given.
            token_extras: optional per-token ``(N,)`` tensors (e.g. ``gate_weight``)
                stored as extra float32 token columns, in the batch's token order (the
                TokenBatch's rows, sorted by sample id then position; not necessarily the
                order of the tensors the batch was built from: map them with
                ``batch.gather`` or build them from the batch).
            timings: where the step's time went, seconds: ``{phase: seconds}`` with our phase names
                (``generation``, ``logprob``, ``reference``, ``reward``, ``update``, ``weight_sync``, ``quantize``,
                ``other``, and ``step`` for the whole step; or ``time/<phase>``), or a framework's own timer names
                (verl's ``timing_s/gen``, OpenRLHF's ``timing/generation``, ...: the table of
                docs/hooks.md#phase-timings; timers of one phase are added).  Recorded as the steps table's
                ``time/<phase>`` columns (docs/metrics.md#step-time-and-the-full-cycle); a phase not given is NaN.
                ``extra`` keys named ``time/<phase>`` are taken as timings too, and so are ``extra`` keys that are
                a framework's timer names (kept as extra columns as well); ``timings`` wins over both.

        Returns:
            dict name → float: the step metrics, ``window/<name>`` trailing-window
            metrics, the quarantine counters, the phase timings (``time/<phase>``, NaN where not timed) and
            ``extra``.

        Raises:
            TypeError: ``step`` is not an int, ``batch`` not a TokenBatch, or an ``extra`` key not a string
                (the message names the key).
            ValueError: ``step`` is outside the int64 range (the steps table's ``step`` column and the file
                names), an ``extra`` value is not a number, an ``extra`` key is the name of a computed metric or
                of a bookkeeping column of the steps table (``rank``, ``attempt``, ``wall_time``,
                ``nan_reasons``), or a ``token_extras`` entry has a reserved name (a token column, ``step``,
                ``rank``) or not ``N`` values, or a ``timings`` name that is no phase or known timer, or a duration
                that is not a finite number of seconds >= 0 (naming it).  Nothing is recorded or changed when it
                raises.
            ForkedWriterError: (a RuntimeError) called in a process forked after the monitor was built: its
                writer thread is not there (docs/reliability.md#forked-processes).
        """
        self.sink.check_process()            # a forked child: ForkedWriterError, never a silent loss
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int, got {step!r}")
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"batch must be a TokenBatch, got {type(batch).__name__}")
        step = int(step)
        if not -2 ** 63 <= step < 2 ** 63:
            raise ValueError(f"step {step} is outside the int64 range [-2**63, 2**63 - 1] of the steps table's "
                             "step column")
        for k in extra or {}:
            if not isinstance(k, str):
                raise TypeError(f"extra key {k!r} ({type(k).__name__}) must be a string: it names a column of the "
                                "steps table")
        bookkeeping = sorted(set(extra or {}) & (BOOKKEEPING_COLUMNS - {"step"}))
        if bookkeeping:
            raise ValueError(f"extra keys {bookkeeping} are bookkeeping columns of the steps table (written by the "
                             f"monitor: {', '.join(sorted(BOOKKEEPING_COLUMNS))}); rename them "
                             f"(e.g. 'user/{bookkeeping[0]}')")
        if step == self._last_step:
            self._warn_once("repeat", "triage-monitor: step %d logged twice in a row by this process: the later call "
                            "replaces the earlier one's records and window entry (log once per optimizer step, "
                            "with its micro-batches merged)", step)
        elif self._last_step is not None and step < self._last_step:
            self._warn_once("backwards", "triage-monitor: step %d logged after step %d by this process: steps should "
                            "increase. The live trailing windows pool steps in the order they are logged, readers "
                            "(analyze, report) in step order, so their window values of the steps after this one "
                            "will differ from the live ones; a step logged again replaces its earlier records", step,
                            self._last_step)
        if self.sink.closed:
            self._warn_once("closed", "triage-monitor: log_step(step=%d) after close(): metrics are returned but "
                            "nothing is recorded any more (rows counted in writer_dropped_rows)", step)
        extra = {k: _to_float(k, v) for k, v in (extra or {}).items()}
        times = _step_timings(timings, extra)     # pops the time/<phase> keys of extra
        clash = sorted(set(extra) & RESERVED_KEYS)
        if clash:
            raise ValueError(f"extra keys {clash} are names of computed metrics; rename them (e.g. 'user/{clash[0]}')")
        _check_token_extras(token_extras, batch.num_tokens)
        batch = batch.detach()
        # the given group, even of one process (None would mean the world's); none without torch.distributed (or
        # once its process groups are destroyed)
        group = self.group if self._distributed and _dist_initialized() else None
        was_frozen = self.tracker.tau_frozen
        step_res, win_res = self.tracker.step(step, batch, group=group)
        if self.tracker.tau_frozen and not was_frozen and not self.tracker.tau_given:
            self._save_calibration(step)
        metrics: dict[str, float] = {"step": step}
        metrics.update(step_res.values)
        q = batch.quarantine_counts
        for name, causes in QUARANTINE_METRICS.items():
            metrics[name] = float(sum(q.get(r, 0) for r in causes))
        metrics["quarantined_count"] = float(sum(q.values()))
        metrics.update(self._diagnose(step, batch))
        if self.synchronised and _dist_initialized():     # the counters of the group's one steps row
            _sum_over_group(metrics, group)
        metrics["tau_tail_frozen"] = float(self.tracker.tau_frozen)
        metrics.update({f"window/{k}": v for k, v in win_res.values.items()})
        metrics.update(times)
        metrics.update(extra)
        reasons = {**step_res.nan_reasons, **{f"window/{k}": r for k, r in win_res.nan_reasons.items()}}
        fired = self._evaluate_alerts(step, metrics)
        if self.writer.steps_schema is None:        # one schema for the run's steps table: declared at the first step
            self.writer.declare_steps(steps_schema(list(extra)))
        alert_rows = [a.to_row() if isinstance(a, Alert) else dict(a) for a in fired] if self.alerts is not None else None
        self.writer.record_step(step, batch, metrics, reasons, token_extras, self.config.record_tokens,
                                steps_row=self.writes_steps, alerts=alert_rows)
        for lg in self.loggers:
            self._guard(lg.log_metrics, step, metrics)
        self.steps_logged += 1
        self._last_step = step
        return metrics

    def _diagnose(self, step: int, batch: TokenBatch) -> dict[str, float]:
        """docs/reliability.md input diagnostics and writer health for one step (see :data:`INTEGRITY_METRICS`)."""
        out = padding_diagnostics(batch)
        out["empty_response_count"] = float((batch.num_valid == 0).sum())
        if out["zero_logp_count"] or out["padding_run_count"]:
            self._warn_once("padding", "triage-monitor step %d: %d valid token(s) with log-prob exactly 0.0 on one "
                            "side only and %d response(s) ending in a run of identical values: padding leaking "
                            "into the loss mask? (metrics zero_logp_count, padding_run_count)", step,
                            out["zero_logp_count"], out["padding_run_count"])
        if out["offset_response_count"]:
            self._warn_once("offset", "triage-monitor step %d: %d response(s) whose first valid token is not at "
                            "position 0: left padding or a prompt in the tensor without positions=? Segments "
                            "are cut by position (metric offset_response_count)", step, out["offset_response_count"])
        if self.steps_logged < self.config.alignment_check_steps:
            rep = check_alignment(batch)
            out.update(rep.to_metrics())
            if rep.suspect:
                self._warn_once("alignment", "triage-monitor step %d: %s", step, rep.message)
        dropped = self.sink.dropped_rows
        out["writer_dropped_rows"] = float(dropped)
        if dropped and self.sink.last_error is None and not self.sink.closed:   # I/O errors: reported by the sink
            self._warn_once("dropped", "triage-monitor dropped %d record rows so far (writer queue full with "
                            "backpressure='drop'); training continues, see metric writer_dropped_rows", dropped)
        return out

    def add_timings(self, step: int, timings: dict, framework: Optional[str] = None,
                    framework_step: Optional[int] = None, reward: Optional[float] = None) -> None:
        """Record phase timings (and the reward) of a step already logged: the framework's timers that close after
        the step's row was written (weight sync, the step timer), the reward a framework reports after it.  They go
        to the run's ``timings`` table (written by the background writer, as the rows), and readers fill the step's
        ``time/<phase>`` and ``reward`` columns its row left NaN (``open_run(p).steps()``;
        docs/metrics.md#step-time-and-the-full-cycle).  Only the process that writes the steps rows records them
        (rank 0 of a synchronised job); elsewhere this does nothing.

        Args:
            step: the monitored step they belong to.
            timings: ``{name: seconds}``: our phase names or ``framework``'s timer names
                (:func:`triage_monitor.metrics.timings.phase_times`); may be empty when only ``reward`` is given.
            framework: whose timer names ``timings`` uses (a key of ``timings.FRAMEWORK_TIMERS``), or None.
            framework_step: the framework's own step number, kept in the row (None: not said).
            reward: the framework's reward of the step (a finite number), or None.

        Raises:
            TypeError: ``timings`` is not a dict.
            ValueError: a name that is no phase or timer of ``framework``, a duration that is not a finite
                number >= 0, a ``step`` or ``framework_step`` that is not an integer, a ``reward`` that is not a
                finite number (naming it)."""
        if not hasattr(timings, "items"):
            raise TypeError(f"timings must be a dict of name -> seconds, got {type(timings).__name__}")
        times = phase_times(dict(timings), framework, strict=True)
        step = integer("add_timings: step", step)
        framework_step = None if framework_step is None else integer("add_timings: framework_step", framework_step)
        if reward is not None:
            reward = _to_float("reward", reward)
            if not math.isfinite(reward):
                raise ValueError(f"add_timings: reward must be a finite number, got {reward!r}")
        if (times or reward is not None) and self.writes_steps:
            self.writer.record_timings(step, times, framework, framework_step, reward)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _save_calibration(self, step: int) -> None:
        """Persist the frozen τ_tail in run.json so a resumed job keeps it."""
        self.writer.save_calibration(self.tracker.tau_tail, step)

    # -------------------------------------------------------------- resuming
    def state_dict(self) -> MonitorState:
        """Calibration state for a checkpoint: τ_tail, frozen or with the reference steps' δ sketches so far.

        Plain Python values and CPU tensors (``torch.save(..., weights_only=True)``-loadable).
        """
        return {"version": STATE_VERSION, "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output, so a resumed job keeps the same τ_tail.

        Raises:
            ValueError: unknown state version.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"MismatchMonitor state version {state.get('version')!r} is not {STATE_VERSION}")
        self.tracker.load_state_dict(state["tracker"])

    def _evaluate_alerts(self, step: int, metrics: dict) -> list[Alert]:
        """Run the rules on the step's metrics (the reporting rank) and add :data:`ALERT_STATE` to ``metrics``;
        returns the alerts fired at this step."""
        if self.alerts is None:
            metrics[ALERT_STATE] = float("nan")
            return []
        if self.steps_logged == 0 and self._own_rules:
            self._check_rule_metrics(metrics)
        fired = self._guard(self.alerts.observe, step, metrics) or []
        active = self.alerts.active if isinstance(self.alerts, RuleReporter) else None
        metrics[ALERT_STATE] = float(len(active)) if active is not None else float("nan")
        return fired

    def _check_rule_metrics(self, metrics: dict) -> None:
        """At the first step, for rules the user gave: one WARNING naming each live rule whose metric (or guard
        metric) is none of the step's keys (a misspelt name, an ``extra`` never passed): it would never fire."""
        rules: Sequence[Rule] = self.alerts.rules if isinstance(self.alerts, RuleReporter) else ()
        missing = sorted({(r.name, m) for r in rules
                          for m in (r.metric, getattr(r, "guard_metric", None)) if m and m not in metrics})
        if missing:
            log.warning("triage-monitor: alert rule(s) on metrics the monitor does not log: %s; they will never fire "
                        "(a misspelt name, or an extra= key not passed to log_step; the metric names: "
                        "docs/metrics.md, the extras of this step: %s)",
                        ", ".join(f"{n} ({m!r})" for n, m in missing),
                        sorted(k for k in metrics if k not in RESERVED_KEYS and k != ALERT_STATE) or "none")

    def _guard(self, call: Callable[..., _R], *args: Any) -> Optional[_R]:
        """``call(*args)`` — a bound method of a tracker, sink or alert engine, reached through its Protocol
        (:class:`~triage_monitor.alerting.trackers.MetricLogger`, ``ConfigRecorder``,
        :class:`~triage_monitor.alerting.alerts.AlertObserver`, ``AlertSink``, ``Closable``) — or None: a method
        that raised is reported once (one WARNING naming the object's class and the method) and skipped from then
        on, so a failing tracker never stops the training job."""
        owner = getattr(call, "__self__", None)
        name = getattr(call, "__name__", repr(call))
        key = (id(owner), name)
        if key in self._failed_sinks:
            return None
        try:
            return call(*args)
        except Exception as exc:  # a failing sink is reported once and skipped
            self._failed_sinks.add(key)
            log.warning("triage-monitor: %s.%s failed (%s: %s); it is skipped from now on",
                        type(owner).__name__, name, type(exc).__name__, exc)
            return None

    # ----------------------------------------------------------------- closing
    def flush(self, timeout: Optional[float] = WAIT_TIMEOUT_S) -> bool:
        """Wait until every queued record is written, at most ``timeout`` seconds (default
        :data:`~triage_monitor.rundir.sink.WAIT_TIMEOUT_S`, 60 s; None: no bound).

        Returns:
            True when the queue is empty; False when the bound passed first (one warning; the writer goes on and
            nothing is dropped by a flush).

        Raises:
            ForkedWriterError: called in a process forked after the monitor was built."""
        self.sink.check_process()
        done = self.sink.flush(timeout)
        if not done:
            log.warning("triage-monitor: flush() gave up after %g s with %d record row(s) still queued (a frozen or "
                        "slow store?); the writer goes on, training continues", timeout, self.sink.queued_rows)
        return done

    def close(self, status: str = "finished", timeout: Optional[float] = WAIT_TIMEOUT_S) -> bool:
        """Drain the writer, close loggers and alerts, mark the manifest ``status``
        ("finished"; "failed" when the ``with`` block raised, "interrupted" when it was stopped by Ctrl-C), all
        within about ``timeout`` seconds (default :data:`~triage_monitor.rundir.sink.WAIT_TIMEOUT_S`, 60 s; None: no bound;
        run.json gets at least :data:`~triage_monitor.rundir.records.CLOSE_GRACE_S` more when the writer used it up).

        At the bound (a frozen or slow store, a hung mount) the rows still queued are counted as dropped, run.json's
        ``writer`` records them (``dropped_rows``, ``unwritten_at_close``, ``close_timed_out``) when it can still be
        written, and the loss is alerted: one ERROR line and an ``records_dropped`` alert to the trackers that take
        alerts.  Any rows dropped during the run are alerted the same way at close.

        Returns:
            True when every record was written and run.json updated (a second call returns the first one's answer
            and does nothing else).

        Raises:
            ForkedWriterError: called in a process forked after the monitor was built."""
        self.sink.check_process()
        said: Optional[bool] = getattr(self, "_close_result", None)
        if said is not None:                                      # closed already: said once, returned as then
            return said
        timeout = None if timeout is None else max(float(timeout), 0.0)
        start = time.monotonic()
        drained = self.sink.close(timeout)
        if self.sink.dropped_rows:
            self._alert_dropped_at_close(drained, timeout)
        for obj in [*self.loggers, self.alerts]:
            if isinstance(obj, Closable):
                self._guard(obj.close)
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        if drained and status == "finished" and self._root_id is not None and _dir_id(self.writer.store) != self._root_id:
            # the directory was removed (or replaced) under the job: the writer made a new one for the later records
            log.error("triage-monitor: the run directory %s was removed or replaced while this monitor wrote it: the "
                      "records written before that are gone, the directory holds only the later ones; run.json says "
                      "'failed'", self.writer.store.display())
            status = "failed"
        result: bool = self.writer.close(status, self.steps_logged, left) and drained and not self.sink.dropped_rows
        self._close_result = result
        return result

    def _alert_dropped_at_close(self, drained: bool, timeout: Optional[float]) -> None:
        """The ERROR line and the ``records_dropped`` alert of a close with rows dropped."""
        sink = self.sink
        why = (f"close() gave up on the writer after {timeout:g} s (a frozen or slow store?) with "
               f"{sink.abandoned_rows} row(s) still queued; " if not drained else "")
        text = (f"triage-monitor: {why}{sink.dropped_rows} record row(s) of this run were not written "
                f"(rank {self.rank}; last error: {sink.last_error or 'none'}); they are counted in run.json's "
                f"writer.dropped_rows and readers report the run as incomplete")
        log.error("%s", text)
        if self.reports:
            alert = Alert(step=self._last_step if self._last_step is not None else -1, rule="records_dropped",
                          metric="writer_dropped_rows", value=float(sink.dropped_rows), threshold=0.0, window=1,
                          level="ERROR", title="triage-monitor: records dropped", text=text, tier="mismatch")
            for lg in self.loggers:
                if isinstance(lg, AlertSink):
                    self._guard(lg.emit, alert)

    def __enter__(self) -> "MismatchMonitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("finished" if exc_type is None else
                   "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")


def _collective_device(group) -> torch.device:
    """Where a tensor handed to a collective of ``group`` must live: the current CUDA device under NCCL (it
    reduces device tensors only), else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sum_over_group(metrics: dict, group) -> None:
    """Replace the :data:`INTEGRITY_METRICS` in ``metrics`` by their sums over ``group`` (one SUM all-reduce of a
    float64 vector), so that the group's one steps row (rank 0's) and the alert rules count every rank's bad tokens
    and dropped rows; the alignment check of the first steps stays local.  Every member calls it at the same step,
    as it does the metric sync."""
    import torch.distributed as dist

    keys = [k for k in INTEGRITY_METRICS if k in metrics]
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    metrics.update(zip(keys, t.cpu().tolist()))


def _dist_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _shared_attempt_id(group=None) -> int:
    """The attempt id of rank 0 of ``group`` (the world's without one), broadcast over the group, so one process
    start of a multi-rank job writes one attempt id everywhere (the manifest lists it; readers can match ranks of
    the same attempt).  Only the group's members take part."""
    import torch.distributed as dist

    t = torch.tensor([new_attempt_id()], dtype=torch.int64, device=_collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())


def _dir_id(store) -> Union[tuple[int, int], tuple[str], None]:
    """``(st_dev, st_ino)`` of a local store's root, ``("gone",)`` when it cannot be read, None on an object store."""
    if not store.is_local:
        return None
    try:
        st = os.stat(store.root)
    except OSError:
        return ("gone",)
    return st.st_dev, st.st_ino


def _in_run_dir(loggers: Sequence, layout: RunLayout) -> list[object]:
    """``loggers`` with a TensorBoard tracker given without ``log_dir`` (``"tensorboard"``) writing into the run
    directory's ``tensorboard/`` folder (a local run), not SummaryWriter's ``./runs/<date>_<host>`` in whatever
    working directory the reporting process has (a Ray worker's is the driver's); an object-store run keeps the
    default (SummaryWriter writes local files) and one WARNING names that folder."""
    from .alerting.trackers import TrackerSpec

    out: list[object] = []
    for item in loggers or ():
        if (item == "tensorboard" or (isinstance(item, TrackerSpec) and item.kind == "tensorboard"
                                      and "log_dir" not in item.options and "writer" not in item.options)
                or (isinstance(item, dict) and item.get("kind") == "tensorboard"
                    and "log_dir" not in item and "writer" not in item)):
            if layout.is_local:
                spec = TrackerSpec.parse(item)
                item = TrackerSpec(spec.kind, spec.keys, {**spec.options, "log_dir": str(layout.root / "tensorboard")})
            else:
                log.warning("triage-monitor: the run %s is on an object store, so a bare 'tensorboard' tracker writes "
                            "its event files on this machine, under %s/<date>_<host> (SummaryWriter's default, in "
                            "this process's working directory); give {'kind': 'tensorboard', 'log_dir': DIR} to "
                            "choose the folder", layout.display, os.path.abspath("runs"))
        out.append(item)
    return out


def _check_token_extras(token_extras: Optional[dict], n: int) -> None:
    """Reject, before any state changes, extra token columns that would break the token table:
    a reserved name (a token column or a hive partition key) or not ``n`` values."""
    reserved = (*TOKEN_SCHEMA.names, "step", "rank")
    for k, v in (token_extras or {}).items():
        if k in reserved:
            raise ValueError(f"token_extras[{k!r}]: reserved column name (reserved: {', '.join(reserved)})")
        size = torch.as_tensor(v).numel()
        if size != n:
            raise ValueError(f"token_extras[{k!r}] has {size} values, batch has {n}")


def _step_timings(timings: Optional[dict], extra: dict) -> dict[str, float]:
    """The step's ``{"time/<phase>": seconds}`` (every timing column, NaN where not timed) from ``timings`` (our
    phase names or a framework's timer names, :func:`triage_monitor.metrics.timings.phase_times`), the ``time/<phase>`` keys of ``extra`` (removed from it) and the
    framework timer names among the other ``extra`` keys (kept there), in that order of precedence.

    Raises:
        ValueError: a ``timings`` name that is no phase or timer, a duration that is not a finite number >= 0."""
    if timings is not None and not hasattr(timings, "items"):
        raise TypeError(f"timings must be a dict of name -> seconds, got {type(timings).__name__}")
    own = {k: extra.pop(k) for k in [k for k in extra if k.startswith(TIME_PREFIX) and k in TIME_COLUMNS]}
    out = dict.fromkeys(TIME_COLUMNS, float("nan"))
    # a framework's timer names among the extras; never our bare phase names ("reward" is the user's reward)
    found = phase_times({k: v for k, v in extra.items() if k not in TIME_PHASES and phase_of(k) is not None})
    found.update(phase_times(own, strict=True))
    found.update(phase_times(dict(timings or {}), strict=True))
    out.update(columns_of(found))
    return out


def _to_float(name: str, v) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"extra[{name!r}] must be a scalar, got a tensor of shape {tuple(v.shape)}")
        v = v.item()
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"extra[{name!r}] must be a number, got {v!r}") from None
