"""A run's outcome from its recorded reward: did it destabilise, and at which step (docs/alerts.md#evaluating-the-alerts).

One definition serves the study (:mod:`triage_monitor.demo.study`), the alert evaluation
(``triage-monitor alerts --evaluate``, :mod:`triage_monitor.offline.evaluation`) and the run-level verdict:

* **destabilised** (:func:`destabilisation_step`): the trailing :data:`SMOOTH_STEPS`-step mean reward is
  below :data:`COLLAPSE_FRACTION` × its running peak on :data:`MIN_STAY` consecutive steps; the step is the
  first of them.  A deep dip that recovers counts; a drop in the last ``MIN_STAY`` − 1 steps cannot be called.

The fraction, smoothing and stay are parameters (:class:`OutcomeDefinition`), so a user whose reward is
noisier or whose collapses are shallower states their own definition and every figure says which one it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd

#: trailing-mean length of the reward, steps
SMOOTH_STEPS = 10
#: destabilised below this fraction of the running peak of the trailing mean
COLLAPSE_FRACTION = 0.5
#: consecutive steps the trailing mean must stay below it
MIN_STAY = 10


@dataclass(frozen=True)
class OutcomeDefinition:
    """The destabilisation definition: trailing ``smooth``-step mean reward below ``fraction`` × its running peak
    on ``stay`` consecutive steps.

    Raises:
        ValueError: ``smooth`` or ``stay`` not a positive integer, ``fraction`` outside (0, 1).
    """

    smooth: int = SMOOTH_STEPS
    fraction: float = COLLAPSE_FRACTION
    stay: int = MIN_STAY

    def __post_init__(self):
        for f in ("smooth", "stay"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"OutcomeDefinition: {f}={v!r} must be an integer >= 1")
        if not 0 < float(self.fraction) < 1:
            raise ValueError(f"OutcomeDefinition: fraction={self.fraction!r} must lie in (0, 1)")

    def describe(self) -> str:
        """The definition as one sentence (printed beside every figure that uses it)."""
        return (f"destabilised = the trailing {self.smooth}-step mean reward below {self.fraction:g} × its running "
                f"peak on {self.stay} consecutive steps (the first of them)")


DEFAULT_OUTCOME = OutcomeDefinition()


def trailing_mean(values, n: int = SMOOTH_STEPS) -> np.ndarray:
    """Trailing ``n``-row mean of ``values`` (``(rows,)`` floats), NaN before ``n`` rows exist (NaN values are
    skipped inside a window)."""
    return pd.Series(np.asarray(values, dtype=float)).rolling(n, min_periods=1).mean().where(
        pd.Series(np.arange(len(values))) >= n - 1).to_numpy()


def destabilisation_step(steps: Sequence[int] | np.ndarray, reward: Sequence[float] | np.ndarray,
                         definition: OutcomeDefinition = DEFAULT_OUTCOME) -> Optional[int]:
    """The step at which a run destabilised, or None.

    ``m(t)`` = mean reward over the trailing ``definition.smooth`` rows (defined once that many rows exist);
    ``peak(t)`` = the maximum of ``m`` up to ``t``.  The run destabilised at the first step ``t`` such that
    ``m < fraction · peak`` holds at ``t`` and the ``stay`` − 1 rows after it.

    Args:
        steps: ``(n,)`` increasing step numbers, one row per step; reward: ``(n,)`` mean reward per step (NaN
            where not recorded).
        definition: the thresholds (:class:`OutcomeDefinition`; default: the study's).

    Raises:
        ValueError: different lengths.
    """
    step_arr, reward_arr = np.asarray(steps), np.asarray(reward, dtype=float)
    if step_arr.shape != reward_arr.shape:
        raise ValueError(f"destabilisation_step: steps {step_arr.shape} and reward {reward_arr.shape} differ in "
                         f"length")
    m = trailing_mean(reward_arr, definition.smooth)
    peak = np.fmax.accumulate(np.where(np.isnan(m), -np.inf, m))
    below = ~np.isnan(m) & (m < definition.fraction * peak)
    run = 0
    for i, b in enumerate(below):
        run = run + 1 if b else 0
        if run == definition.stay:
            return int(step_arr[i - definition.stay + 1])
    return None


__all__ = ["SMOOTH_STEPS", "COLLAPSE_FRACTION", "MIN_STAY", "OutcomeDefinition", "DEFAULT_OUTCOME", "trailing_mean",
           "destabilisation_step"]
