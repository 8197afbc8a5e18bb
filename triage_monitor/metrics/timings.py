"""Where a step's time goes: the phase names, each framework's timers mapped onto them, and the full-cycle arithmetic.

A faster generator (an NVFP4 rollout) speeds up the generation phase only; weight synchronisation, the
computation of quantisation scales, data conversions, the log-prob recompute and the update keep their time.
The published NVFP4 runs made generation 2.08–2.35× faster and the whole RL cycle 1.21–1.33× faster
(docs/metrics.md#published-reference).  This module is the arithmetic behind that, on a run's own timers
(docs/metrics.md#step-time-and-the-full-cycle):

* :data:`PHASES` — the phases of a step, stored in the steps table as ``time/<phase>`` seconds (float64, NaN where
  the phase was not timed; :data:`TIME_COLUMNS`), with ``time/step`` the whole step;
* :func:`frameworks` — the frameworks' own timer names (verl's ``timing_s/gen``, OpenRLHF's
  ``timing/generation``, ...) → phase (docs/hooks.md#phase-timings), one :class:`FrameworkTimers` per framework,
  declared beside the hooks (``hooks/frameworks.py``, imported by name on first use; :data:`FRAMEWORK_TIMERS` its
  tables); :func:`phase_times` maps a framework's timer dict onto the phases;
* the generation share g of a step, the projected full-cycle speedup ``1 / ((1 − g) + g / k)`` for a generator
  k times faster (:func:`projected_speedup`), a run's breakdown (:func:`cycle_frame`, :func:`cycle_summary`) and
  the comparison of two runs of the same job (:func:`compare_cycles`).

Torch-free; pandas is imported by the frame functions only.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Mapping, NamedTuple, Optional

from . import names as metric_names

if TYPE_CHECKING:                  # pandas only in the frame functions (imported there): the live path stays light
    import pandas as pd

#: The phases of one step, in the order they are stacked (docs/metrics.md#step-time-and-the-full-cycle).
PHASES = ("generation", "logprob", "reference", "reward", "update", "weight_sync", "quantize", "other")
#: The whole step (the framework's step timer).
STEP = "step"
#: Column name prefix in the steps table: ``time/<phase>`` and ``time/step``, seconds.
PREFIX = "time/"
#: ``{phase or "step": column}``.
COLUMNS = {p: f"{PREFIX}{p}" for p in (*PHASES, STEP)}
#: The steps table's timing columns, in file order.
TIME_COLUMNS = tuple(COLUMNS.values())
#: What each phase holds, for tables and legends.
LABELS = {"generation": "generation", "logprob": "log-prob recompute", "reference": "reference log-probs",
          "reward": "reward / advantage", "update": "update", "weight_sync": "weight sync",
          "quantize": "quantisation / conversion", "other": "other", "step": "whole step", "untimed": "untimed"}
#: Short column headers of the phases (the CLI's per-step table).
SHORT = {"generation": "gen", "logprob": "logprob", "reference": "ref", "reward": "reward", "update": "update",
         "weight_sync": "sync", "quantize": "quant", "other": "other", "step": "step"}
#: The phases a faster generator speeds up (every other phase keeps its time).
SPEEDS_UP = ("generation",)
#: Default generator speedup k of the projection: the published NVFP4 rollout speedup (2.08–2.35×, rounded).
DEFAULT_K = 2.3
#: Timed phases adding up to more than the step by this fraction: the timers overlap (an asynchronous pipeline).
OVERLAP_TOLERANCE = 0.01

#: The module holding each framework's timers (:func:`frameworks`): beside the hooks, imported by name on first use.
_FRAMEWORKS_MODULE = "triage_monitor.hooks.frameworks"


def _as_given(name: str) -> str:
    return name


class FrameworkTimers(NamedTuple):
    """One framework's timers, as the core reads them (:func:`frameworks`; declared per framework in
    ``hooks/frameworks.py``).

    Fields:
        name: the framework's key (``"verl"``, ``"trl"``, ...: ``framework=`` of :func:`phase_times`).
        timers: ``{timer name: phase or None}``, the names as the framework logs them; a phase is one of
            :data:`PHASES` or ``"step"``; None: recognised, not a phase of its own (a span that contains other
            timers, or one outside the step).
        key: a name the framework hands over → its key in ``timers`` (TRL's ``profiling/Time taken:
            <Trainer>.<span>`` → ``<span>``; verl's bare ``gen`` → ``timing_s/gen``); by default the name as given.
        needs_framework: ``key`` turns bare names (not as logged) into timer names: applied only where the framework
            is named (``phase_of("gen", "verl")``), never to a name of any framework (``framework=None``) nor to a
            logged metrics dict (:class:`~triage_monitor.rundir.timings_writer.TimingsWriter`).
    """
    name: str
    timers: Mapping[str, Optional[str]]
    key: Callable[[str], str] = _as_given
    needs_framework: bool = False


_frameworks: Optional[Mapping[str, FrameworkTimers]] = None


def frameworks() -> Mapping[str, FrameworkTimers]:
    """``{framework: FrameworkTimers}`` of every framework the hooks declare (``hooks/frameworks.py``, imported by
    name on the first call, so any framework's names are recognised without its hook imported).

    Returns:
        The mapping; empty where the hooks are not installed (the GPU kit runs the package tree without them), so
        only our own phase names are timers there.

    Raises:
        ModuleNotFoundError: a module other than the hooks package or its ``frameworks`` module is missing.
    """
    global _frameworks
    if _frameworks is None:
        try:
            _frameworks = importlib.import_module(_FRAMEWORKS_MODULE).FRAMEWORKS
        except ModuleNotFoundError as exc:
            if exc.name not in (_FRAMEWORKS_MODULE, _FRAMEWORKS_MODULE.rpartition(".")[0]):
                raise
            _frameworks = {}
    return _frameworks


def __getattr__(name: str) -> Dict[str, Mapping[str, Optional[str]]]:
    """``FRAMEWORK_TIMERS``: ``{framework: {timer name as logged: phase or None}}``, each framework's
    :attr:`FrameworkTimers.timers` (:func:`frameworks`; PEP 562, built on use)."""
    if name == "FRAMEWORK_TIMERS":
        return {f: fw.timers for f, fw in frameworks().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def timer_key(framework: str, name: str) -> str:
    """A framework's timer name as its table keys it (:attr:`FrameworkTimers.key`): TRL's
    ``profiling/Time taken: GRPOTrainer.vLLM.generate`` → ``vLLM.generate`` (the trainer's class name dropped);
    verl's in-process ``timing_raw`` key ``gen`` (``framework="verl"`` only) → ``timing_s/gen``, its logged name;
    every other name (and any name of a framework not in :func:`frameworks`) as given."""
    fw = frameworks().get(framework)
    return name if fw is None else fw.key(name)


def phase_of(name: str, framework: Optional[str] = None) -> Optional[str]:
    """The phase (or ``"step"``) a timer name stands for: one of :data:`PHASES`, ``"step"``, ``time/<phase>``
    (our own names), or a name of ``framework``'s timers (:func:`frameworks`; any framework's when
    ``framework`` is None and the name is unambiguous).

    Returns:
        The phase, or None when the name is not a timer we know or stands for no phase of its own.
    """
    bare = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if bare in COLUMNS:
        return bare
    known = frameworks()
    found = {known[f].timers[key] for f, key in _keys(name, framework)}
    found.discard(None)
    return found.pop() if len(found) == 1 else None


def _keys(name: str, framework: Optional[str]) -> list[tuple[str, str]]:
    """``[(framework, key)]`` of the tables holding ``name``; a framework's bare names (verl's ``timing_raw`` keys,
    :attr:`FrameworkTimers.needs_framework`) only when that framework is said (``gen`` alone is too common a word)."""
    known = frameworks()
    tables = [framework] if framework is not None else list(known)
    out: list[tuple[str, str]] = []
    for f in tables:
        fw = known.get(f)
        if fw is None:
            continue
        key = fw.key(name) if framework is not None or not fw.needs_framework else name
        if key in fw.timers:
            out.append((f, key))
    return out


def is_timer_name(name: str, framework: Optional[str] = None) -> bool:
    """True when ``name`` is one of our phase names (``generation``, ``time/generation``, ``step``, ...) or a
    timer name of ``framework`` (any framework when None) in :func:`frameworks`, mapped or not."""
    bare = name[len(PREFIX):] if name.startswith(PREFIX) else name
    return bare in COLUMNS or bool(_keys(name, framework))


def phase_times(raw: Mapping[str, object], framework: Optional[str] = None, *, strict: bool = False,
                unmapped: Optional[list[str]] = None) -> dict[str, float]:
    """Map timer readings onto the phases: ``{name: seconds}`` → ``{phase: seconds}`` (``"step"`` included).

    Several timers of one phase are added (verl's ``reward`` and ``adv`` make ``reward``); a timer recognised
    but of no phase of its own (its table in :func:`frameworks` maps it to None) is left out; our own names
    (``generation`` or ``time/generation``) are taken as they are.  NaN readings are left out (not timed).

    Args:
        raw: timer readings in seconds (numbers, or 0-dim tensors / numpy scalars: anything ``float()`` takes).
        framework: a key of :func:`frameworks` (``"verl"``, ``"trl"``, ...) whose names ``raw`` uses, or None
            for our names and any framework's unambiguous names.
        strict: raise on a name that is not a timer name (else it is skipped and appended to ``unmapped``).
        unmapped: a list that receives the names skipped (not timers, or timers of no phase of their own).

    Returns:
        ``{phase: seconds}`` (float) of the phases with a reading.

    Raises:
        ValueError: a reading that is not a number, negative or infinite (naming the timer and the value);
            with ``strict``, a name that is not a timer name (naming it and the accepted names).
    """
    out: dict[str, float] = {}
    for name, value in raw.items():
        if not isinstance(name, str):
            raise ValueError(f"timer name {name!r} ({type(name).__name__}) must be a string")
        phase = phase_of(name, framework)
        if phase is None:
            if strict and not is_timer_name(name, framework):
                raise ValueError(f"timings[{name!r}]: not a phase or a known timer name; use one of "
                                 f"{', '.join(COLUMNS)} (or time/<phase>), or a framework's timer names "
                                 "(docs/hooks.md#phase-timings)")
            if unmapped is not None:
                unmapped.append(name)
            continue
        seconds = _seconds(name, value)
        if math.isnan(seconds):
            continue
        out[phase] = out.get(phase, 0.0) + seconds
    return out


def integer(name: str, value) -> int:
    """``value`` as an int: an int or numpy integer (not a bool): a step number given with timings.

    Raises:
        ValueError: anything else (naming ``name`` and the value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} = {value!r}: must be an integer")
    return int(value)


def _seconds(name: str, value) -> float:
    bad = f"timings[{name!r}] = {value!r}: a duration must be a number of seconds"
    try:
        if hasattr(value, "item") and callable(value.item):
            value = value.item()        # a tensor / array of one value; of several: an error, named below
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(bad + " (one value)") from None
    if isinstance(value, bool):
        raise ValueError(bad)
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(bad) from None
    if math.isinf(v) or v < 0:
        raise ValueError(f"timings[{name!r}] = {v!r}: a duration must be a finite number of seconds >= 0")
    return v


def device_of(info: Mapping) -> Optional[str]:
    """Where a run's timings were measured, from its manifest facts (``RunManifest.info``): ``timings_device`` or
    ``device`` (``"cpu"``, ``"cuda:0"``); None when the run does not say.  The breakdown is labelled with it
    (CPU figures are not GPU figures: the phases' shares differ)."""
    for key in ("timings_device", "device"):
        v = info.get(key) if isinstance(info, Mapping) else None
        if isinstance(v, str) and v:
            return v
    return None


def figures(device: str) -> str:
    """``"CPU figures"`` for ``"cpu"``, ``"CUDA figures"`` for ``"cuda:0"``: the label of a breakdown measured there."""
    return f"{device.split(':')[0].upper()} figures"


def table_timings(table, framework: Optional[str] = None, step_column: str = "step"):
    """A framework's logged timers as a steps-like table: ``table`` (pandas.DataFrame, one row per step, a
    ``step_column`` and timer columns named as the framework logs them, e.g. a W&B history export) → a DataFrame
    with ``step`` and the ``time/<phase>`` columns (:func:`phase_times` per row; a phase no row has is absent).

    Raises:
        ValueError: no ``step_column``, a step that is not an integer, no column of a known timer (naming the
            columns), a reading that is negative or infinite (naming the row, the column and the value).
    """
    import numpy as np
    import pandas as pd

    if step_column not in table.columns:
        raise ValueError(f"the timings table has no {step_column!r} column (it has {', '.join(map(str, table.columns))})")
    names = [c for c in table.columns if c != step_column and isinstance(c, str) and phase_of(c, framework)]
    if not names:
        raise ValueError("no column of the timings table is a timer of " + (framework or "any framework")
                         + f" (columns: {', '.join(map(str, table.columns))}; names: docs/hooks.md#phase-timings)")
    rows = []
    for i, rec in enumerate(table[[step_column, *names]].to_dict("records")):
        step = rec.pop(step_column)
        try:
            s = float(step)
        except (TypeError, ValueError):
            s = math.nan
        if not math.isfinite(s) or s != int(s):
            raise ValueError(f"timings table row {i}: {step_column} = {step!r} is not an integer step")
        try:
            times = phase_times({k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))},
                                framework)
        except ValueError as exc:
            raise ValueError(f"timings table row {i} (step {int(s)}): {exc}") from None
        rows.append({"step": int(s), **columns_of(times)})
    out = pd.DataFrame(rows)
    out = out.groupby("step", as_index=False).last() if len(out) else out   # a step logged twice: its last row
    for c in TIME_COLUMNS:
        if c in out.columns:
            out[c] = out[c].astype(np.float64)
    return out


def columns_of(times: Mapping[str, float]) -> dict[str, float]:
    """``{phase: seconds}`` (:func:`phase_times`) as steps-table columns ``{"time/<phase>": seconds}``."""
    return {COLUMNS[p]: float(v) for p, v in times.items()}


# --------------------------------------------------------------------------------------------- arithmetic
def generation_share(generation: float, total: float) -> float:
    """g = generation / total: the share of a step's time spent generating (docs/metrics.md#step-time-and-the-full-cycle).

    Args:
        generation, total: seconds (the generation phase, the whole step).

    Returns:
        g in [0, 1] (a generation phase longer than the step gives more than 1: overlapping timers); NaN when
        either is NaN or the step took no time.
    """
    if not (math.isfinite(generation) and math.isfinite(total)) or total <= 0:
        return math.nan
    return generation / total


def projected_speedup(g: float, k: float = DEFAULT_K) -> float:
    """The full-cycle speedup when generation becomes ``k`` times faster and nothing else changes (Amdahl):
    ``1 / ((1 − g) + g / k)``.  Worked case: g = 6.0 / 10.5 = 0.571, k = 2.3 → 1.48×.

    Args:
        g: the generation share of the step, in [0, 1] (:func:`generation_share`).
        k: the generator's speedup, > 0 (default :data:`DEFAULT_K`, the published NVFP4 rollout 2.3×).

    Returns:
        The projected speedup (NaN when g is NaN).

    Raises:
        ValueError: k not a positive finite number, or g outside [0, 1].
    """
    check_k(k)
    if math.isnan(g):
        return math.nan
    if not 0.0 <= g <= 1.0:
        raise ValueError(f"generation share g = {g!r} must lie in [0, 1] (generation timed longer than the step?)")
    return 1.0 / ((1.0 - g) + g / k)


def check_k(k: float, what: str = "k") -> float:
    """``k`` as a float when it is a finite number > 0; else ValueError naming ``what`` and the value."""
    try:
        v = float(k)
    except (TypeError, ValueError):
        raise ValueError(f"{what} = {k!r}: the generator speedup must be a number > 0") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what} = {k!r}: the generator speedup must be a finite number > 0")
    return v


def speedup(base: float, other: float) -> float:
    """Measured speedup of a phase: base seconds ÷ other seconds (``2.0`` = twice as fast); NaN when either is NaN
    or other is 0 (a phase the other run does not have), inf never."""
    if not (math.isfinite(base) and math.isfinite(other)) or other <= 0:
        return math.nan
    return base / other


# ------------------------------------------------------------------------------------------------ frames
def cycle_frame(steps, k: float = DEFAULT_K):
    """Per-step breakdown of a run's steps table.

    Args:
        steps: pandas.DataFrame with ``step`` and any ``time/<phase>`` columns (``open_run(p).steps()``).
        k: generator speedup of the projection (:func:`projected_speedup`).

    Returns:
        pandas.DataFrame, one row per step with a step total: ``step``, one column per phase of :data:`PHASES`
        (seconds, NaN where not timed), ``total`` (``time/step`` where timed, else the sum of the timed phases),
        ``total_from`` (``"step timer"`` or ``"sum of phases"``), ``untimed`` (total − timed phases, seconds; < 0
        when the timers overlap), ``g`` (generation share, NaN without a generation timing) and ``projected``
        (the full-cycle speedup at ``k``, NaN where g is NaN or outside [0, 1]).  Empty when no step is timed.
    """
    import numpy as np
    import pandas as pd

    k = check_k(k)
    n = len(steps)
    cols = {p: (steps[COLUMNS[p]].astype(float).to_numpy() if COLUMNS[p] in steps.columns else np.full(n, np.nan))
            for p in PHASES}
    step_t = steps[COLUMNS[STEP]].astype(float).to_numpy() if COLUMNS[STEP] in steps.columns else np.full(n, np.nan)
    timed = np.column_stack([cols[p] for p in PHASES]) if n else np.zeros((0, len(PHASES)))
    any_phase = ~np.isnan(timed).all(axis=1) if n else np.zeros(0, bool)
    phase_sum = np.nansum(timed, axis=1) if n else np.zeros(0)
    has_step = np.isfinite(step_t)
    total = np.where(has_step, step_t, np.where(any_phase, phase_sum, np.nan))
    df = pd.DataFrame({"step": steps["step"].to_numpy() if n else np.zeros(0, np.int64), **cols, "total": total,
                       "total_from": np.where(has_step, "step timer", "sum of phases"),
                       "untimed": np.where(np.isfinite(total), total - phase_sum, np.nan)})
    df = df[np.isfinite(total)].reset_index(drop=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(df["total"].to_numpy() > 0, df["generation"].to_numpy() / df["total"].to_numpy(), np.nan)
    df["g"] = g
    inside = (g >= 0) & (g <= 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        df["projected"] = np.where(inside, 1.0 / ((1.0 - g) + g / k), np.nan)
    return df


@dataclass(frozen=True)
class CycleSummary:
    """A run's full-cycle breakdown (:func:`cycle_summary`); times in seconds, shares in [0, 1].

    Attributes:
        steps: steps with a total; generation_steps: of them, steps with a generation timing.
        mean: ``{phase: mean seconds per step}`` over those steps (an untimed phase counts 0), with ``"step"``
            (the mean total) and ``"untimed"``; phases never timed are left out.
        share: ``{phase: Σ phase / Σ total}`` (pooled over the steps; ``"untimed"`` included).
        g: pooled generation share Σ generation / Σ total (NaN without a generation timing).
        g_median: median of the per-step g.
        k: the generator speedup of the projection; projected: ``1 / ((1 − g) + g / k)``.
        not_sped_up: ``[(phase, share), ...]`` of the phases a faster generator does not touch, largest first
            (those of at least 0.05 % of the time; ``"untimed"`` from 0.5 %).
        overlapping_steps: steps whose timed phases add up to more than the step (:data:`OVERLAP_TOLERANCE`):
            the timers overlap, the projection's sequential assumption does not hold there.
        total_from: ``"step timer"``, ``"sum of phases"`` or ``"mixed"``.
    """

    steps: int
    generation_steps: int
    mean: dict[str, float]
    share: dict[str, float]
    g: float
    g_median: float
    k: float
    projected: float
    not_sped_up: list[tuple[str, float]] = field(default_factory=list)
    overlapping_steps: int = 0
    total_from: str = "step timer"

    def lines(self, device: Optional[str] = None) -> list[str]:
        """The breakdown in words, one line each (the CLI's and the report's)."""
        if not self.steps:
            return ["no step of this run has phase timings (time/<phase> columns): nothing to break down"]
        where = f"; {figures(device)}" if device else ""
        out = [f"{self.steps} timed step(s), mean step {self.mean.get('step', math.nan):.4g} s "
               f"({self.total_from}){where}"]
        if math.isnan(self.g):
            out.append("generation is not timed: no generation share, no projection")
        else:
            out.append(f"generation share g = {self.g:.3f} (pooled; per-step median {self.g_median:.3f}); "
                       f"a generator {self.k:g}× faster gives at most {self.projected:.2f}× on the full cycle "
                       f"(1 / ((1 − g) + g / k))")
        if self.not_sped_up:
            out.append("not sped up by a faster generator: " + ", ".join(
                f"{LABELS.get(p, p)} {100 * s:.1f} %" for p, s in self.not_sped_up))
        if self.overlapping_steps:
            out.append(f"{self.overlapping_steps} step(s) whose timed phases add up to more than the step: the "
                       "timers overlap (an asynchronous pipeline); the projection assumes phases run one after another")
        return out


def cycle_summary(steps, k: float = DEFAULT_K) -> CycleSummary:
    """A run's full-cycle breakdown over all its timed steps (:class:`CycleSummary`).

    Args:
        steps: pandas.DataFrame of the steps table (``open_run(p).steps()``), or :func:`cycle_frame`'s output.
        k: generator speedup of the projection (default :data:`DEFAULT_K`).

    Raises:
        ValueError: k not a finite number > 0.
    """
    import numpy as np

    k = check_k(k)
    f = steps if "total" in getattr(steps, "columns", ()) else cycle_frame(steps, k)
    if f.empty:
        return CycleSummary(0, 0, {}, {}, math.nan, math.nan, k, math.nan)
    tot = float(f["total"].sum())
    mean, share = {}, {}
    for p in PHASES:
        col = f[p].astype(float)
        if col.notna().any():
            mean[p] = float(col.fillna(0.0).mean())
            share[p] = float(col.fillna(0.0).sum()) / tot if tot > 0 else math.nan
    mean["step"] = float(f["total"].mean())
    untimed = float(f["untimed"].sum())
    mean["untimed"] = untimed / len(f)
    share["untimed"] = untimed / tot if tot > 0 else math.nan
    gen = f["generation"].astype(float)
    g = float(gen.fillna(0.0).sum()) / tot if gen.notna().any() and tot > 0 else math.nan
    proj = projected_speedup(g, k) if 0.0 <= g <= 1.0 else math.nan
    rest = [(p, s) for p, s in share.items() if p not in SPEEDS_UP and math.isfinite(s)
            and s >= (0.005 if p == "untimed" else 0.0005)]
    rest.sort(key=lambda t: -t[1])
    timed_sum = f[list(PHASES)].astype(float).fillna(0.0).sum(axis=1)
    overlap = int((timed_sum > f["total"] * (1 + OVERLAP_TOLERANCE)).sum())
    sources = set(f["total_from"])
    return CycleSummary(int(len(f)), int(gen.notna().sum()), mean, share, g,
                        float(np.nanmedian(f["g"])) if f["g"].notna().any() else math.nan, k, proj, rest, overlap,
                        sources.pop() if len(sources) == 1 else "mixed")


#: The mismatch figures shown beside a comparison: (column, label, how it is reduced over the run's steps), each
#: labelled as the metric is declared (:func:`triage_monitor.metrics.names.label`, with its unit).
MISMATCH_FIGURES = (*((c, metric_names.label(c, unit=True), "mean") for c in ("delta_abs_mean", "k3_kl", "small_gap_share",
                                                                   "delta_q05")),
                    *(("window/rho_asym", f"{metric_names.label('window/rho_asym')}, {how}", how) for how in ("last", "max")))


def mismatch_figures(steps) -> dict[str, float]:
    """``{label: value}`` of :data:`MISMATCH_FIGURES` over a run's steps table (NaN where the column is absent)."""
    out: dict[str, float] = {}
    for col, label, how in MISMATCH_FIGURES:
        s = steps[col].astype(float).dropna() if col in steps.columns else None
        if s is None or s.empty:
            out[label] = math.nan
        elif how == "mean":
            out[label] = float(s.mean())
        elif how == "max":
            out[label] = float(s.max())
        else:
            out[label] = float(steps.loc[s.index].sort_values("step")[col].iloc[-1])
    return out


@dataclass(frozen=True)
class CycleComparison:
    """Two runs of one job, a baseline (BF16) and a low-precision one (:func:`compare_cycles`).

    Attributes:
        table: pandas.DataFrame, one row per phase timed in either run and ``step``: ``phase``, ``label``,
            ``base_s`` / ``other_s`` (mean seconds per step), ``speedup`` (base ÷ other; NaN where a run lacks
            the phase), ``sped_up_by_generator`` (bool).
        cycle: measured whole-cycle speedup (mean step base ÷ mean step other).
        generation: measured generation speedup k_measured.
        g_base: the baseline's generation share.
        projected_measured: ``1 / ((1 − g_base) + g_base / k_measured)``: the cycle speedup if only generation had
            changed, by what it measured.
        k, projected_k: the projection at the user's k.
        mismatch: pandas.DataFrame (``figure``, ``base``, ``other``) of :data:`MISMATCH_FIGURES` of both runs.
        base, other: the two :class:`CycleSummary`.
    """

    table: pd.DataFrame
    cycle: float
    generation: float
    g_base: float
    projected_measured: float
    k: float
    projected_k: float
    mismatch: pd.DataFrame
    base: CycleSummary
    other: CycleSummary

    def lines(self, names: Iterable[str] = ("base", "other")) -> list[str]:
        """The comparison's headline in words."""
        a, b = list(names)
        out = [f"measured whole-cycle speedup {b} vs {a}: {_x(self.cycle)}; generation {_x(self.generation)}"]
        if math.isfinite(self.projected_measured):
            out.append(f"projected from {a}'s generation share g = {self.g_base:.3f} and the measured generation "
                       f"speedup: {_x(self.projected_measured)}; at k = {self.k:g}: {_x(self.projected_k)}")
            if math.isfinite(self.cycle):
                gap = self.cycle / self.projected_measured
                if abs(gap - 1) > 0.02:
                    out.append(f"the measured cycle is {gap:.2f}× the projection: phases other than generation "
                               f"changed too ({'faster' if gap > 1 else 'slower'} in {b}; the table says which)")
        return out


def _x(v: float) -> str:
    return f"{v:.2f}×" if math.isfinite(v) else "-"


def compare_cycles(base_steps, other_steps, k: float = DEFAULT_K) -> CycleComparison:
    """Per-phase and whole-cycle speedup of ``other`` over ``base`` (same job, other numerics), beside the
    projection and both runs' mismatch figures (docs/metrics.md#comparing-two-runs).

    Each phase's time is its mean per step over the run's timed steps (an untimed phase counts 0 on a step where
    others are timed); a phase's speedup is base ÷ other.  The projection uses the baseline's pooled generation
    share with the measured generation speedup and with ``k``.

    Args:
        base_steps, other_steps: the two runs' steps tables (``open_run(p).steps()``).
        k: the user's generator speedup (default :data:`DEFAULT_K`).

    Raises:
        ValueError: k not a finite number > 0.
    """
    import pandas as pd

    k = check_k(k)
    a, b = cycle_summary(base_steps, k), cycle_summary(other_steps, k)
    rows = []
    for p in (*PHASES, "untimed", "step"):
        if p not in a.mean and p not in b.mean:
            continue
        if p == "untimed" and not (abs(a.mean.get(p, 0.0)) > 0 or abs(b.mean.get(p, 0.0)) > 0):
            continue
        x, y = a.mean.get(p, math.nan), b.mean.get(p, math.nan)
        rows.append({"phase": p, "label": LABELS.get(p, p), "base_s": x, "other_s": y, "speedup": speedup(x, y),
                     "sped_up_by_generator": p in SPEEDS_UP})
    table = pd.DataFrame(rows, columns=["phase", "label", "base_s", "other_s", "speedup", "sped_up_by_generator"])
    cycle = speedup(a.mean.get("step", math.nan), b.mean.get("step", math.nan))
    gen = speedup(a.mean.get("generation", math.nan), b.mean.get("generation", math.nan))
    g = a.g
    ok = math.isfinite(g) and 0.0 <= g <= 1.0
    proj_m = projected_speedup(g, gen) if ok and math.isfinite(gen) and gen > 0 else math.nan
    proj_k = projected_speedup(g, k) if ok else math.nan
    fa, fb = mismatch_figures(base_steps), mismatch_figures(other_steps)
    mismatch = pd.DataFrame({"figure": list(fa), "base": list(fa.values()), "other": [fb[f] for f in fa]})
    return CycleComparison(table, cycle, gen, g, proj_m, k, proj_k, mismatch, a, b)


__all__ = ["PHASES", "STEP", "PREFIX", "COLUMNS", "TIME_COLUMNS", "LABELS", "SHORT", "SPEEDS_UP", "DEFAULT_K",
           "FrameworkTimers", "frameworks",
           "FRAMEWORK_TIMERS",  # noqa: F822 — a lazy module attribute (__getattr__)
           "timer_key", "phase_of", "is_timer_name", "phase_times", "device_of", "figures",
           "table_timings",
           "columns_of",
           "generation_share", "projected_speedup", "check_k", "speedup", "cycle_frame", "CycleSummary",
           "cycle_summary", "MISMATCH_FIGURES", "mismatch_figures", "CycleComparison", "compare_cycles"]
