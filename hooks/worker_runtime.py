"""Per-process state of a framework hook: adapters carry configuration, each process builds its own monitor.

In verl, OpenRLHF, SkyRL and NeMo RL the loss runs in Ray workers, and the loss object is pickled into them
(NeMo RL re-pickles it on every ``policy.train`` call).  A hook object therefore holds only picklable
:class:`HookSettings`; everything live — the :class:`~triage_monitor.monitor.MismatchMonitor`, the
:class:`~triage_monitor.triage.controller.TriageController` with its calibration, the step counter and the tokens of
the step being accumulated — lives in a :class:`WorkerRuntime`, one per process and per hook (keyed by
``HookSettings.key``).  Every unpickled copy of the same hook in a process shares that runtime, so re-pickling
loses and duplicates nothing.

**Run directory checks.**  The monitor is built at the first monitored step; there, before anything is written,
an unwritable ``run_dir``, a run of another configuration in it or a second live writer of the same rank raise
(``triage_monitor.records.OutputError``); later I/O errors never reach the training loop.

**Rank and run directory.**  Every process writes its own rank's files into the shared run directory (rank:
``HookSettings.rank``, else the rank in the monitor's process group when the hook gave one
(:meth:`WorkerRuntime.set_group`), else the ``torch.distributed`` rank, else the ``RANK`` environment variable,
else the first free rank claimed atomically in ``<run_dir>/.ranks/<attempt>/``).  All processes of one job share
the attempt id drawn when the hook was built (on the driver), so readers see one attempt.  Rank 0 owns ``run.json``
and reports (evaluates the alert rules, feeds the trackers).

**Process group.**  A live process group cannot travel in the picklable :class:`HookSettings`; a hook whose
framework records on some ranks only (slime: tensor-parallel rank 0 of the last pipeline stage) hands the group
of the recording ranks to the runtime in-process (:meth:`WorkerRuntime.set_group`, before the first monitored
step).  The monitor then all-reduces over that group only, its attempt id is that of the group's rank 0 broadcast
over the group, and the files are numbered by the rank in the group: its rank 0 reports, writes ``run.json`` and
is the rank readers default to.  The processes writing the run must then be exactly the group's members (the
other ranks record nothing), which keeps the ranks of the files unique across the job.

**Step.**  The monitored step is, in this order: the framework's own step metadata when the hook passes it
(``framework_step``: verl's ``global_steps``, TRL's ``state.global_step``, SkyRL's ``global_step``); otherwise the
number of optimizer steps this process has taken (a global ``torch.optim`` step post-hook; the first optimizer
that steps after a loss call is the one counted).  All loss calls (micro-batches, mini-batches of PPO epochs)
between two optimizer steps are one monitored step, logged by the optimizer step.  If no optimizer step is ever
seen, every step so far is one step: the runtime says so once, loudly, with the fix.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypedDict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from triage_monitor.alerting.alerts import check_alerts_setting
from triage_monitor.triage.controller import ControllerState, TriageConfig, TriageController
from triage_monitor.rundir.layout import RunLayout
from triage_monitor.rundir.storage import open_store
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.rundir.manifest import check_monitor_config
from triage_monitor.rundir.records import check_writer_options, new_attempt_id, probe_writable
from triage_monitor.metrics.timings import is_timer_name, phase_times
from triage_monitor.rundir.timings_writer import finite_or_none
from triage_monitor.alerting.trackers import check_keys, framework_metrics, specs_of

from .micro_batches import StepAccumulator

log = logging.getLogger("triage_monitor")

STEP_SOURCES = ("auto", "framework", "optimizer")
#: Loss calls without an optimizer step after which the runtime warns that steps are not being counted.
CALLS_WITHOUT_OPTIMIZER_WARNING = 10_000
#: Controller used by loss hooks without a TriageConfig: Gate, TIS and Repair off, so the loss is the
#: framework's own PPO loss and the hook only monitors.
PLAIN_PPO = TriageConfig(gate=False, tis=False, repair=False)


class RuntimeState(TypedDict):
    """:meth:`WorkerRuntime.state_dict`: a process's checkpoint state (``torch.save``-able), in this key order."""

    controller: Optional[ControllerState]
    optimizer_steps: int
    step_offset: int
    calls: int
    monitor: Optional[Mapping[str, Any]]


@dataclass
class HookSettings:
    """Everything a hook needs in a worker process: plain, picklable configuration (no live objects).

    Attributes:
        run_dir: the shared run directory; None = no monitoring (controller only).
        monitor: :class:`MonitorConfig` of the per-process monitor.
        triage: :class:`TriageConfig` of the controller; None = monitoring only (the framework's own loss).
        manifest: facts stored in ``run.json`` (framework, model, ...); JSON-serialisable.
        on_invalid: ``"raise"`` or ``"quarantine"`` (:class:`~triage_monitor.batch.TokenBatch`).
        step_source: ``"auto"`` (framework step when the hook has one, else optimizer steps), ``"framework"``
            (require it), ``"optimizer"`` (always count optimizer steps).
        rank: fixed rank for this process's files; None = resolved in the worker (module docstring).
        attempt: attempt id shared by every process of this job (drawn at construction, on the driver);
            None = resolved in each worker: the id of rank 0 of the monitor's process group (the group given to
            :meth:`WorkerRuntime.set_group`, else the default group) broadcast over it when ``torch.distributed``
            is up (processes that build their hook themselves, e.g. torchrun ranks), else a new id.
        key: identity of the hook across pickling: copies with the same key share one runtime per process.
        resume: continue a run in ``run_dir`` whose model / task / correction / seed differ (``MismatchMonitor``'s
            ``resume``); a run of the same configuration is continued without it, another one is refused with
            ``triage_monitor.records.RunConflictError`` when the monitor starts (the first monitored step).
        alerts: the rules the monitor evaluates live (rank 0 of its process group): True (default) the shipped default rules, False
            none, a rule file path, or a list of :class:`~triage_monitor.alerting.alert_rules.Rule`
            (:func:`~triage_monitor.alerting.alerts.build_engine`); each alert is logged once as a warning line, written to
            the run's ``alerts/`` table and sent to the trackers.
        loggers: trackers the monitor feeds (rank 0 of its process group), as configuration each process builds itself:
            ``"wandb"``, ``"tensorboard"``, ``"mlflow"``, ``{"kind": ..., "keys": ..., <options>}`` or
            :class:`~triage_monitor.alerting.trackers.TrackerSpec` (docs/alerts.md#trackers).
        framework_keys: the metrics the hook hands to the framework's own logger under ``triage/``:
            ``"curated"`` (default, :data:`~triage_monitor.alerting.trackers.CURATED_KEYS`), ``"all"`` or a list of names.

    Raises:
        ValueError: a bad option, naming it (an ``alerts`` or ``loggers`` entry that is a live object included:
            a hook carries configuration only).
    """

    run_dir: Optional[str] = None
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    triage: Optional[TriageConfig] = None
    manifest: dict = field(default_factory=dict)
    on_invalid: str = "raise"
    step_source: str = "auto"
    rank: Optional[int] = None
    attempt: Optional[int] = field(default_factory=new_attempt_id)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    resume: bool = False
    alerts: object = True
    loggers: list = field(default_factory=list)
    framework_keys: object = "curated"

    def __post_init__(self):
        self.alerts = check_alerts_setting(self.alerts, "HookSettings.alerts")
        self.loggers = specs_of(self.loggers)
        self.framework_keys = check_keys(self.framework_keys, "HookSettings.framework_keys")
        if self.step_source not in STEP_SOURCES:
            raise ValueError(f"HookSettings.step_source must be one of {STEP_SOURCES}, got {self.step_source!r}")
        if self.on_invalid not in ("raise", "quarantine"):
            raise ValueError(f"HookSettings.on_invalid must be 'raise' or 'quarantine', got {self.on_invalid!r}")
        if isinstance(self.monitor, dict):
            self.monitor = MonitorConfig.from_dict(self.monitor)
        if not isinstance(self.monitor, MonitorConfig):
            raise TypeError(f"HookSettings.monitor must be a MonitorConfig or a dict of its settings, got "
                            f"{type(self.monitor).__name__}")
        # on the driver, with the readers' rules, naming the option: not a bare error in a worker at step 1
        check_monitor_config(self.monitor.to_dict(), "HookSettings.monitor")
        check_writer_options("HookSettings", rank=self.rank, attempt=self.attempt, resume=self.resume)
        if isinstance(self.triage, dict):
            self.triage = TriageConfig(**self.triage)
        if self.run_dir is not None:
            # an unsupported URI scheme is refused here, not at step 1; a local path or an s3:// URI is kept as text
            self.run_dir = open_store(self.run_dir).location


def resolve_rank(run_dir, attempt: int, fixed: Optional[int] = None, group=None) -> int:
    """This process's rank for the run's files: ``fixed``, the rank in ``group`` (a process group whose members
    are the processes writing the run), the torch.distributed rank, ``$RANK``, else a claim.

    The claim is the smallest n for which ``<run_dir>/.ranks/<attempt>/<n>`` can be created exclusively, so two
    worker processes of one job never share a rank (and only one is rank 0, the owner of ``run.json``).  An
    object store has no exclusive create: there a process needs one of the other sources.

    Raises:
        ValueError: a claim is needed on an object store (the message names the ways to give the rank).
    """
    if fixed is not None:
        return int(fixed)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group) if group is not None else dist.get_rank()
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    layout = RunLayout(run_dir)
    if not layout.is_local:
        raise ValueError(f"triage-monitor: this process has no rank (no torch.distributed process group, no RANK "
                         f"variable, no HookSettings.rank) and ranks cannot be claimed on an object store "
                         f"({layout.display}): set RANK, or pass the hook's rank")
    claims = layout.root / layout.rank_claims(attempt)
    claims.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            fd = os.open(claims / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            n += 1
            continue
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return n


def in_ray_worker() -> bool:
    """True inside a Ray worker process (an actor or task), where interpreter-exit hooks do not run."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except Exception:
        return False


class WorkerRuntime:
    """The live side of one hook in one process: controller, monitor, step counting, step accumulation."""

    def __init__(self, settings: HookSettings):
        self.settings = settings
        self.controller: Optional[TriageController] = (
            TriageController(settings.triage) if settings.triage is not None else None)
        self.plain_controller = TriageController(PLAIN_PPO)
        self._monitor: Optional[MismatchMonitor] = None
        self._group = None
        self._acc: Optional[StepAccumulator] = None
        self.optimizer_steps = 0           # optimizer steps seen (the bound optimizer's)
        self.step_offset = 0               # added to optimizer steps (resume)
        self.calls = 0
        self._calls_since_step = 0
        self._bound_optimizer: Optional[weakref.ref] = None
        self._framework_step_seen = False
        self._warned: set = set()
        self._lock = threading.RLock()
        self.closed = False
        #: the metrics of the last step this process logged (None before the first)
        self.last_metrics: Optional[dict] = None
        #: phase timings waiting for their step's row: ``{step: {phase: seconds}}`` (:meth:`add_timings`)
        self._timings: dict = {}
        #: ``fn(step) -> {timer: seconds} or None``: where the hook finds a step's timings when it logs the step
        #: (e.g. the verl trainer's published timings); its phases fill what :meth:`add_timings` left out
        self.timings_source = None
        self._logged_through: Optional[int] = None
        #: the framework's rewards waiting for their step's row: ``{step: {key: reward}}`` (:meth:`add_reward`)
        self._rewards: dict = {}
        #: the reward of every row logged from now on (:meth:`set_reward`); None: none
        self.current_reward: Optional[float] = None
        #: ``fn(step) -> reward or None``: where the hook finds a step's reward when it logs the step (e.g. the verl
        #: trainer's published reward), asked when :meth:`add_reward` gave none
        self.reward_source = None
        #: whether this process's rows carry ``reward`` (decided at its first row; a column first seen later would
        #: change the steps table's schema, so a reward that first comes later goes to the timings table instead)
        self._reward_in_rows: Optional[bool] = None

    # ------------------------------------------------------------- monitor
    @property
    def group(self):
        """The process group the monitor syncs over (:meth:`set_group`; None: the default group, when one is up)."""
        return self._group

    def set_group(self, group) -> None:
        """Make ``group`` (a live ``torch.distributed`` process group) the one this process's monitor all-reduces
        over, broadcasts the attempt id over and numbers the files by (module docstring, **Process group**).

        Call it in-process before the first monitored step, in the processes that record, with the group of all
        the processes that write the run; the same group again is a no-op.

        Raises:
            ValueError: the monitor was already built with another group.
        """
        with self._lock:
            if group is self._group:
                return
            if self._monitor is not None:
                raise ValueError("triage-monitor: set_group after this process's monitor was built (at the first "
                                 "monitored step) with another group; hand the group over before the first step")
            self._group = group

    @property
    def monitor(self) -> Optional[MismatchMonitor]:
        """This process's monitor, built on first use (None without ``run_dir``)."""
        s = self.settings
        if self._monitor is None and s.run_dir is not None:
            run_dir = probe_writable(s.run_dir)      # an unwritable run_dir: a clear error at the first step
            group = self._group
            attempt = s.attempt if s.attempt is not None else _worker_attempt(group)
            rank = resolve_rank(run_dir, attempt, s.rank, group)
            manifest = {**s.manifest, "hook_pid": os.getpid()} if rank == 0 else dict(s.manifest)
            if self.controller is not None:
                manifest.setdefault("triage", _plain(self.controller.config))
            self._monitor = MismatchMonitor(run_dir, s.monitor, manifest=manifest, rank=rank, attempt=attempt,
                                            group=group, resume=s.resume, alerts=s.alerts, loggers=s.loggers)
            self._acc = StepAccumulator(self._monitor, timings_for=self._timings_for, extra_for=self._extra_for)
        return self._monitor

    # --------------------------------------------------------------- steps
    def step_for_call(self, framework_step: Optional[int] = None) -> int:
        """The monitored step of the loss call now starting (module docstring for the order of sources).

        Raises:
            ValueError: ``step_source="framework"`` and the hook passed no framework step.
        """
        src = self.settings.step_source
        if framework_step is not None and src != "optimizer":
            self._framework_step_seen = True
            return int(framework_step)
        if src == "framework":
            raise ValueError("triage-monitor: step_source='framework' but this framework call carries no step "
                             "metadata; use step_source='auto' (count optimizer steps)")
        if self._calls_since_step >= CALLS_WITHOUT_OPTIMIZER_WARNING:
            self._warn_no_optimizer()
        return self.step_offset + self.optimizer_steps

    def _warn_no_optimizer(self) -> None:
        if "no-optimizer" not in self._warned:
            self._warned.add("no-optimizer")
            log.warning(
                "triage-monitor: %d loss calls and no torch.optim optimizer step seen in this process (pid %d): all of "
                "them are being logged as ONE step (%d). Fix: pass the step yourself (hook.set_step(step) before each "
                "update, or step_source='framework' where the hook reads the framework's step), or make sure the "
                "optimizer is a torch.optim.Optimizer stepping in this process (docs/hooks.md#how-a-hook-runs-inside-the-frameworks-workers)",
                self._calls_since_step, os.getpid(), self.step_offset + self.optimizer_steps)

    def set_step(self, step: int) -> None:
        """Start counting from ``step``: the next loss calls belong to ``step`` (e.g. after a resume)."""
        with self._lock:
            self.flush()
            self.step_offset = int(step) - self.optimizer_steps

    def on_optimizer_step(self, optimizer) -> None:
        """Called by the global optimizer post-hook: closes the step when this runtime's optimizer stepped."""
        with self._lock:
            if self.settings.step_source != "optimizer" and self._framework_step_seen:
                return
            if self._bound_optimizer is None:
                if self._calls_since_step == 0:      # an optimizer stepping before any loss call is not ours
                    return
                self._bound_optimizer = weakref.ref(optimizer)
            elif self._bound_optimizer() is not optimizer:
                return
            self.optimizer_steps += 1
            self._calls_since_step = 0
            self.flush()
            if self._monitor is not None and in_ray_worker():
                # Ray ends its worker processes without running atexit: the step just logged must reach the disk
                # now, or the job's last step would be lost with the writer's queue.
                self._monitor.flush(timeout=300)

    # ------------------------------------------------------------- records
    def record(self, step: int, batch, gate_weights: Optional[torch.Tensor] = None,
               extra: Optional[dict] = None) -> None:
        """Buffer one loss call's tokens under ``step`` (logged when the step closes). Never raises on I/O."""
        with self._lock:
            self.calls += 1
            self._calls_since_step += 1
            if self.monitor is None:
                return
            token_extras = {"gate_weight": gate_weights} if gate_weights is not None else None
            self._keep(self._acc.add(step, batch, token_extras, extra))

    def flush(self) -> Optional[dict]:
        """Log the step being accumulated now; returns its metrics (None when nothing was buffered)."""
        with self._lock:
            return self._keep(self._acc.flush() if self._acc is not None else None)

    def _keep(self, metrics: Optional[dict]) -> Optional[dict]:
        if metrics is not None:
            self.last_metrics = metrics
        return metrics

    # ------------------------------------------------------------- timings
    def add_timings(self, step: int, timers: dict, framework: Optional[str] = None) -> None:
        """Add the framework's timer readings of ``step`` (seconds) to the phase timings of that step's row
        (docs/metrics.md#step-time-and-the-full-cycle): mapped with :func:`triage_monitor.metrics.timings.phase_times`
        (``framework``'s names, docs/hooks.md#phase-timings), added to what the step already has.  Timers of no
        phase are said once in the log; readings for a step whose row is already written go to the run's timings
        table (``MismatchMonitor.add_timings``), which readers join to the row.
        Never raises: monitoring never stops the training job."""
        with self._lock:
            try:
                skipped: list = []
                times = phase_times(timers, framework, unmapped=skipped)
                step = int(step)
            except Exception as exc:   # noqa: BLE001 — a bad reading: said once, never raised into the job
                self._warn_once("timings-bad", "triage-monitor: phase timings of step %s not recorded (%s)", step, exc)
                return
            unknown = [n for n in skipped if not is_timer_name(n, framework)]
            if unknown:
                self._warn_once("timings-unmapped", "triage-monitor: %s timer(s) %s are no phase of "
                                "docs/hooks.md#phase-timings; their time counts as untimed", framework or "the",
                                sorted(unknown))
            step = int(step)
            if self._logged_through is not None and step <= self._logged_through:
                # the row is written: the timings go to the run's timings table, which readers join to it
                try:
                    if self._monitor is not None and times:
                        self._monitor.add_timings(step, times, framework)
                except Exception as exc:   # noqa: BLE001 — monitoring never stops the job
                    self._warn_once("timings-late", "triage-monitor: phase timings of step %d, which arrived after "
                                    "its row was written, not recorded (%s)", step, exc)
                return
            into = self._timings.setdefault(step, {})
            for phase, v in times.items():
                into[phase] = into.get(phase, 0.0) + v

    def _timings_for(self, step: int) -> Optional[dict]:
        """The phase timings of ``step``'s row: :meth:`add_timings`' readings, then :attr:`timings_source`'s for the
        phases they lack; older steps' leftovers are dropped."""
        step = int(step)
        own = self._timings.pop(step, {})
        for s in [s for s in self._timings if s < step]:
            del self._timings[s]
        self._logged_through = step if self._logged_through is None else max(self._logged_through, step)
        src = self.timings_source
        if src is not None:
            try:
                more = src(step) or {}
                for phase, v in phase_times(more).items():
                    own.setdefault(phase, v)
            except Exception as exc:   # noqa: BLE001 — monitoring never stops the job
                self._warn_once("timings-source", "triage-monitor: reading the phase timings of step %d failed (%s: "
                                "%s); the step is recorded without them", step, type(exc).__name__, exc)
        return own or None

    # -------------------------------------------------------------- reward
    def add_reward(self, step: int, value, key=None) -> None:
        """The framework's reward of monitored step ``step`` (its mean over the step's responses, as the framework
        logs it), recorded as the steps table's ``reward`` column, the column the report, the dashboard and the
        verdict read (docs/hooks.md#rewards).  Readings of one step under different ``key``s are averaged (a step
        trained on two generation batches), a reading under the same key replaces the earlier one.  A reward for a
        step whose row is already written goes to the run's timings table, which readers join to the row.  A value
        that is not a finite number (None, NaN: e.g. every sample aborted) is no reading.  Never raises."""
        with self._lock:
            v = finite_or_none(value)
            try:
                step = int(step)
            except (TypeError, ValueError):
                self._warn_once("reward-step", "triage-monitor: a reward for step %r not recorded: the step is no "
                                "integer", step)
                return
            if v is None:
                return
            if self._logged_through is not None and step <= self._logged_through:
                self._late_reward(step, v)
                return
            self._rewards.setdefault(step, {})[key] = v

    def set_reward(self, value) -> None:
        """The framework's reward for every row this process logs from now on, until the next call (a framework that
        reports a rollout's reward before it trains on it: slime, Miles); a value that is not a finite number
        clears it.  Never raises."""
        with self._lock:
            self.current_reward = finite_or_none(value)

    def _late_reward(self, step: int, value: float) -> None:
        try:
            if self._monitor is not None:
                self._monitor.add_timings(step, {}, reward=value)
        except Exception as exc:   # noqa: BLE001 — monitoring never stops the job
            self._warn_once("reward-late", "triage-monitor: the reward of step %d not recorded (%s: %s)", step,
                            type(exc).__name__, exc)

    def _extra_for(self, step: int) -> Optional[dict]:
        """``{"reward": r}`` for ``step``'s row: :meth:`add_reward`'s readings (their mean), else
        :attr:`reward_source`'s, else :meth:`set_reward`'s; None without one.  When this process's first row had
        none, a reward goes to the timings table instead (one schema for the steps table)."""
        step = int(step)
        own = self._rewards.pop(step, None)
        for s in [s for s in self._rewards if s < step]:
            del self._rewards[s]
        r = sum(own.values()) / len(own) if own else None
        if r is None and self.reward_source is not None:
            try:
                r = finite_or_none(self.reward_source(step))
            except Exception as exc:   # noqa: BLE001 — monitoring never stops the job
                self._warn_once("reward-source", "triage-monitor: reading the reward of step %d failed (%s: %s); the "
                                "step is recorded without it", step, type(exc).__name__, exc)
        if r is None:
            r = self.current_reward
        if self._reward_in_rows is None:
            self._reward_in_rows = r is not None
        if r is None:
            return None
        if self._reward_in_rows:
            return {"reward": r}
        self._late_reward(step, r)
        return None

    def framework_metrics(self) -> dict[str, float]:
        """The metrics to hand to the framework's own logger: ``settings.framework_keys`` of the last step this
        process logged, as ``triage/<name>`` floats, with ``triage/metrics_step`` (the step they belong to);
        ``{}`` before the first step.  In a loss hook the step being trained is logged when it closes, so a loss
        call reports the previous step's values (docs/hooks.md#alerts-trackers-and-what-reaches-the-frameworks-logger)."""
        return framework_metrics(self.last_metrics, self.settings.framework_keys)

    def close(self) -> None:
        """Log the last step, close the monitor (drains its writer); idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._acc is not None and self.optimizer_steps == 0 and not self._framework_step_seen and self.calls:
                self._calls_since_step = max(self._calls_since_step, self.calls)
                self._warn_no_optimizer()
            self.flush()
            if self._monitor is not None:
                self._monitor.close()

    # --------------------------------------------------------------- state
    def state_dict(self) -> RuntimeState:
        """Controller calibration, step counters and monitor calibration (``torch.save``-able)."""
        return {"controller": self.controller.state_dict() if self.controller is not None else None,
                "optimizer_steps": self.optimizer_steps, "step_offset": self.step_offset, "calls": self.calls,
                "monitor": self.monitor.state_dict() if self.monitor is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (a resumed job continues identically)."""
        with self._lock:
            if self.controller is not None and state.get("controller") is not None:
                self.controller.load_state_dict(state["controller"])
            self.step_offset = int(state["step_offset"]) + int(state["optimizer_steps"]) - self.optimizer_steps
            self.calls = int(state["calls"])
            if self.monitor is not None and state.get("monitor") is not None:
                self.monitor.load_state_dict(state["monitor"])

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def _worker_attempt(group=None) -> int:
    """The attempt id of rank 0 of ``group`` (the default process group without one) broadcast over it when
    torch.distributed is up and the group has more than one process, else a new id."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        from triage_monitor.monitor import _shared_attempt_id
        return _shared_attempt_id(group)
    return new_attempt_id()


def _plain(obj):
    from dataclasses import asdict, is_dataclass
    return asdict(obj) if is_dataclass(obj) else obj


# ------------------------------------------------------------ process registry
_RUNTIMES: dict = {}
_REGISTRY_LOCK = threading.Lock()
_HOOK_HANDLE = None


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for rt in list(_RUNTIMES.values()):
        try:
            rt.on_optimizer_step(optimizer)
        except Exception as exc:     # monitoring never breaks the optimizer step
            rt._warn_once("optimizer-hook", "triage-monitor: logging the step failed (%s: %s); training continues",
                          type(exc).__name__, exc)


def runtime_for(settings: HookSettings) -> WorkerRuntime:
    """The :class:`WorkerRuntime` of ``settings.key`` in this process (created on first use)."""
    global _HOOK_HANDLE
    with _REGISTRY_LOCK:
        rt = _RUNTIMES.get(settings.key)
        if rt is None or rt.closed:
            rt = _RUNTIMES[settings.key] = WorkerRuntime(settings)
        if _HOOK_HANDLE is None:
            _HOOK_HANDLE = register_optimizer_step_post_hook(_on_optimizer_step)
        return rt


def close_all() -> None:
    """Log every hook's last step and close its monitor in this process (also run at interpreter exit)."""
    for rt in list(_RUNTIMES.values()):
        try:
            rt.close()
        except Exception as exc:
            log.warning("triage-monitor: closing a hook failed (%s: %s)", type(exc).__name__, exc)


atexit.register(close_all)


class HookAdapter:
    """Base of every framework adapter: picklable settings outside, a per-process runtime inside.

    Subclasses keep only plain attributes (numbers, strings, :class:`HookSettings`); the live objects are
    reached through :attr:`runtime`.  A cloudpickle round trip (Ray) keeps ``settings.key``, so the copy in a
    worker finds that worker's runtime again.
    """

    settings: HookSettings

    @property
    def runtime(self) -> WorkerRuntime:
        """This process's runtime for this hook."""
        return runtime_for(self.settings)

    @property
    def controller(self) -> Optional[TriageController]:
        """This process's controller (None for monitoring-only hooks)."""
        return self.runtime.controller

    @property
    def monitor(self) -> Optional[MismatchMonitor]:
        """This process's monitor (built on first use; None without ``run_dir``)."""
        return self.runtime.monitor

    def set_step(self, step: int) -> None:
        """Tell the hook the step of the coming loss calls (only needed where neither the framework nor an
        optimizer step gives it)."""
        self.runtime.set_step(step)

    def set_group(self, group) -> None:
        """Make ``group`` the process group this process's monitor syncs over (:meth:`WorkerRuntime.set_group`)."""
        self.runtime.set_group(group)

    def flush(self) -> Optional[dict]:
        """Log the step being accumulated now."""
        return self.runtime.flush()

    def framework_metrics(self) -> dict[str, float]:
        """The last logged step's metrics for the framework's own logger (:meth:`WorkerRuntime.framework_metrics`)."""
        return self.runtime.framework_metrics()

    def close(self) -> None:
        """Log the last step and close this process's monitor."""
        self.runtime.close()

    def state_dict(self) -> RuntimeState:
        """This process's controller calibration, step counters and monitor calibration."""
        return self.runtime.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output in this process."""
        self.runtime.load_state_dict(state)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_live")}

    def __setstate__(self, state):
        self.__dict__.update(state)


class LossHook(HookAdapter):
    """Base of the hooks that replace a framework's policy loss (verl, OpenRLHF, SkyRL, prime-rl, NeMo RL).

    :meth:`compute_loss` is the whole per-call path: step of the call → :func:`~triage_monitor.triage.loss.triage_policy_loss`
    (the controller of ``settings.triage``, or plain PPO when it is None) → the call's tokens buffered for the
    monitored step.
    """

    def compute_loss(self, batch, *, old_logp=None, framework_step: Optional[int] = None, **loss_kwargs):
        """The TRIAGE (or plain PPO) loss of one framework call, recorded for the monitor.

        Args:
            batch: the call's :class:`~triage_monitor.batch.TokenBatch` (live learner log-probs, nats).
            old_logp: ``(N,)`` PPO anchor log-probs in the batch's flat order, nats.
            framework_step: the framework's step metadata for this call, when it has one.
            loss_kwargs: ``clip_low``, ``clip_high``, ``dual_clip``, ``agg_mode``, ``denominator``,
                ``loss_scale``, ``token_scale``, ``repair_denominator`` of
                :func:`~triage_monitor.triage.loss.triage_policy_loss`.

        Returns:
            :class:`~triage_monitor.triage.loss.TriageLoss`.
        """
        from triage_monitor.triage.loss import triage_policy_loss

        rt = self.runtime
        step = rt.step_for_call(framework_step)
        plain = rt.controller is None
        ctrl = rt.plain_controller if plain else rt.controller
        res = triage_policy_loss(ctrl, batch, step, old_logp=old_logp, **loss_kwargs)
        rt.record(step, res.batch, None if plain else res.output.gate_weights, None if plain else res.output.stats)
        return res
