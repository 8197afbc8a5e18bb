"""The destabilisation definition (triage_monitor.outcome) at its edges: the first rows of the trailing mean and the
first step of the stay, on data where an off-by-one gives another answer (docs/testing.md#test-data)."""

from __future__ import annotations

import math

import numpy as np

from triage_monitor.alerting.outcome import OutcomeDefinition, destabilisation_step, trailing_mean


def test_the_trailing_mean_is_defined_from_row_n_minus_1():
    """n = 3 over 1, 2, 4, 8, 16: NaN, NaN, then (1+2+4)/3, (2+4+8)/3, (4+8+16)/3 — defined from row 2, not 3."""
    m = trailing_mean([1.0, 2.0, 4.0, 8.0, 16.0], 3)
    assert math.isnan(m[0]) and math.isnan(m[1])
    assert m[2:].tolist() == [7 / 3, 14 / 3, 28 / 3]


def test_a_collapse_from_the_first_full_window_is_dated_at_the_first_step_below():
    """smooth 2, fraction 0.5, stay 3; rewards 1, 1, 0, 0, 0, 0: m = NaN, 1, 0.5, 0, 0, 0 with peak 1 from step 1,
    so m < 0.5 from step 3 on (steps 3, 4, 5: three in a row) — the run destabilised at step 3, the first of them
    (a mean defined one row late has peak 0.5 at step 2 and says step 3 too, but a stay counted to its last step
    says 5; a peak taken from step 2 on, 0.5, would never be crossed by half)."""
    d = OutcomeDefinition(smooth=2, fraction=0.5, stay=3)
    steps = np.arange(10, 16)                       # step numbers that are not row numbers
    assert destabilisation_step(steps, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0], d) == 13
    # the peak is the first full window's: 4, 0, 0, 0 → m = NaN, 2, 0, 0: below 1 from the row after the peak
    assert destabilisation_step(steps[:4], [4.0, 0.0, 0.0, 0.0], OutcomeDefinition(smooth=2, fraction=0.5,
                                                                                  stay=2)) == 12
