"""The settings of the monitor and its metrics: plain dataclasses, importable without torch.

:class:`MetricConfig` holds the thresholds of docs/metrics.md, :class:`MonitorConfig` the monitor's own settings
(window, τ_tail calibration, records); ``run.json`` stores ``MonitorConfig.to_dict()`` and
``triage_monitor.analysis.Run.config`` reads it back.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class MetricConfig:
    """Thresholds of docs/metrics.md (defaults are the documented ones).

    Attributes:
        small_gap_threshold: |δ| below this (nats) counts as a small gap (docs/metrics.md#small_gap_share).
        segment_width: W, tokens per localisation segment (docs/metrics.md#localisation).
        tail_quantile: τ_tail is this quantile of δ over the reference window (docs/metrics.md#tau_tail).
        heavy_fraction: a segment is tail-heavy when its tail fraction exceeds this (docs/metrics.md#h_seg).
        top_fraction: C_tok counts tail tokens inside the top ``ceil(top_fraction · segments)`` segments.
        dilution_threshold: |mean δ| of a response below this is "diluted" (docs/metrics.md#dilution).
    """

    small_gap_threshold: float = 0.05
    segment_width: int = 64
    tail_quantile: float = 0.05
    heavy_fraction: float = 0.10
    top_fraction: float = 0.05
    dilution_threshold: float = 0.05

    def __post_init__(self):
        for name in ("small_gap_threshold", "segment_width", "heavy_fraction", "top_fraction", "dilution_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MetricConfig.{name} must be > 0, got {getattr(self, name)}")
        if isinstance(self.segment_width, bool) or not isinstance(self.segment_width, numbers.Integral):
            raise ValueError(f"MetricConfig.segment_width must be an integer (tokens), got {self.segment_width!r}")
        if not 0 < self.tail_quantile < 1 or not self.top_fraction <= 1:
            raise ValueError(f"MetricConfig: tail_quantile must lie in (0, 1) and top_fraction in (0, 1], got "
                             f"{self.tail_quantile}, {self.top_fraction}")


@dataclass
class MonitorConfig:
    """Settings of :class:`MismatchMonitor`.

    Attributes:
        metrics: thresholds of docs/metrics.md#steps-and-windows (:class:`~triage_monitor.metrics.MetricConfig`, or a dict of its fields).
        window: trailing window in steps (docs/metrics.md#steps-and-windows: 25 updates, inclusive).
        calibration_steps: τ_tail reference window, the first N steps (docs/metrics.md#localisation).
        tau_tail: explicit τ_tail in nats; None calibrates it.
        record_tokens: write the token rows (False keeps only step metrics).
        max_queue_bytes: bound of the writer's queue.
        backpressure: "block" (wait for the disk) or "drop" (drop and count rows) when the queue is full.
        alignment_check_steps: run :func:`~triage_monitor.metrics.alignment.check_alignment` on this many
            first steps of each process start (0 disables); a suspected shift logs a warning.
        per_rank_steps: in a job whose metrics are all-reduced over a process group, every rank writes its steps
            row too (default False: rank 0 of the group writes the step's one row, the metrics being the same on
            every rank; its integrity counters are summed over the group).  Without a process group every rank's
            metrics are its own and every rank writes its row.
        roll_steps: steps per file of each table and rank (docs/reliability.md#what-a-killed-job-keeps): a rank's
            steps go into one Parquet block per ``roll_steps`` consecutive steps (aligned: a block ends at a step S
            with ``(S + 1) % roll_steps == 0``), so a run's file count grows as ranks x steps / roll_steps.
            Until its block is sealed, each step is also in a pending file of its own (what a killed job keeps).
        roll_bytes: a block is also sealed once the columns written to it pass this many bytes.
    """

    metrics: MetricConfig = field(default_factory=MetricConfig)
    window: int = 25
    calibration_steps: int = 25
    tau_tail: Optional[float] = None
    record_tokens: bool = True
    max_queue_bytes: int = 256 << 20
    backpressure: str = "block"
    alignment_check_steps: int = 3
    per_rank_steps: bool = False
    roll_steps: int = 50
    roll_bytes: int = 1 << 30

    def __post_init__(self):
        if isinstance(self.metrics, dict):
            _no_unknown_keys(self.metrics, MetricConfig, "MonitorConfig.metrics")
            self.metrics = MetricConfig(**self.metrics)
        if not isinstance(self.metrics, MetricConfig):
            raise TypeError(f"MonitorConfig.metrics must be a MetricConfig or a dict of its fields, got "
                            f"{type(self.metrics).__name__}")
        for name in ("roll_steps", "roll_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MonitorConfig.{name} must be an integer >= 1, got {v!r}")
        if self.backpressure not in ("block", "drop"):
            raise ValueError(f"MonitorConfig.backpressure must be 'block' or 'drop', got {self.backpressure!r}")
        for name, lo in (("max_queue_bytes", 1), ("alignment_check_steps", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"MonitorConfig.{name} must be an integer >= {lo}, got {v!r}")
        # window, calibration_steps, tau_tail, record_tokens, ...: checked with the readers' own rules by every writer
        # before it writes anything (manifest.check_monitor_config: MismatchMonitor, HookSettings)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values, ``{field: value}`` (``metrics`` a dict of :class:`MetricConfig` fields): what
        run.json's ``monitor_config`` holds and :meth:`from_dict` reads."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, strict: bool = True) -> "MonitorConfig":
        """A :class:`MonitorConfig` from ``to_dict()``'s form (``metrics`` a dict of :class:`MetricConfig` fields).

        Args:
            d: the settings; a missing key takes its default.
            strict: refuse a key this version does not know (a misspelt ``windw`` would otherwise be dropped and
                its default used); readers of a run.json written by another release pass False to ignore them.

        Raises:
            ValueError: an unknown key (``strict``), or a value :class:`MonitorConfig` refuses (naming it).
            TypeError: ``d`` is not a dict."""
        if not isinstance(d, dict):
            raise TypeError(f"MonitorConfig.from_dict takes a dict, got {type(d).__name__}")
        d = dict(d)
        metrics = dict(d.get("metrics") or {})
        if strict:
            _no_unknown_keys(d, cls, "MonitorConfig")
        else:
            metrics = {k: v for k, v in metrics.items() if k in MetricConfig.__dataclass_fields__}
        d["metrics"] = metrics
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _no_unknown_keys(d: dict, cls, where: str) -> None:
    """Raise ValueError naming the keys of ``d`` that are no field of dataclass ``cls``."""
    unknown = sorted(str(k) for k in d if k not in cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown} (known: {', '.join(cls.__dataclass_fields__)})")


#: Fields of a per-token table that ``triage-monitor import table`` maps to columns (docs/hooks.md).
TABLE_REQUIRED_FIELDS = ("step", "sample_id", "learner_logp", "sampler_logp", "advantage")
TABLE_OPTIONAL_FIELDS = ("position", "mask", "group_id")
