"""Stage table of a run's post-mortem (docs/metrics.md#stages) with the C_tok shuffle null
(docs/metrics.md#shuffle_null).

Anchors sit at 25 %, 50 %, 75 % and 100 % of the run's recorded steps (or at
user-given steps); each anchor reports the trailing-window metrics ending
there, the C_tok shuffle null (median, central 95 % interval, excess) and the
dilution fraction -- the table a paper would print::

    run = open_run("runs/demo")
    table = stage_table(run)                       # one row per anchor
    layout = tail_layout(batch, tau, 64)           # one step's A<0 segments and their tail counts (drill-down)

Pure analysis on top of :mod:`triage_monitor.offline.analysis` and
:mod:`triage_monitor.metrics`; used by the dashboard and the static report.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd
from numba import njit

from ..rundir.layout import RunLayout
from .analysis import Run
from ..metrics import names
from ..metrics.definitions import is_negative_response, is_tail
from ..metrics.stats import c_tok_from_segments, top_tail_tokens
from ..metrics.state_kernel import NullInput, segment_number_nb, segment_shift_nb

if TYPE_CHECKING:      # torch only for the token-level paths: the stage table from the states needs numpy alone
    from torch import Tensor

    from ..batch import TokenBatch

#: Default anchor fractions of the run's horizon (docs/metrics.md#stages).
DEFAULT_FRACTIONS = (0.25, 0.50, 0.75, 1.00)
#: Window metrics shown in the stage table, in display order (docs/metrics.md).
STAGE_METRICS = ("n_tokens", "small_gap_share", "delta_q05", "k3_kl", "rho_asym", "rho_asym_lennorm", "amp_share",
                 "r_amp", "h_seg", "c_tok", "p_adj", "dilution", "tau_tail")


@dataclass(frozen=True)
class TailLayout:
    """Segments of the A<0 responses of one or more steps with their tail counts (docs/metrics.md#localisation).

    Attributes (K segments, in (response, k) order):
        response: ``(K,)`` int64, response of each segment, ascending (responses
            of several steps get distinct ids).
        valid: ``(K,)`` int64, valid tokens of each segment (>= 1).
        tail: ``(K,)`` int64, amplifying-tail tokens of each segment (A < 0 and δ < τ_tail).
        number: ``(K,)`` int64, k = position // W of each segment, or None when unknown.
    """

    response: np.ndarray
    valid: np.ndarray
    tail: np.ndarray
    number: Optional[np.ndarray] = None

    @property
    def num_segments(self) -> int:
        return int(self.response.shape[0])

    def c_tok(self, top_fraction: float = 0.05) -> float:
        """The observed C_tok of these segments (:func:`~triage_monitor.metrics.c_tok_from_segments`)."""
        import torch

        return c_tok_from_segments(torch.as_tensor(self.tail), torch.as_tensor(self.valid), top_fraction)

    @staticmethod
    def concat(parts: Sequence["TailLayout"]) -> "TailLayout":
        """Pool layouts (the steps of a window); response ids are offset so they stay distinct."""
        off, resp = 0, []
        for p in parts:
            resp.append(p.response + off)
            off += int(p.response.max()) + 1 if p.num_segments else 0
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
        numbers = None if any(p.number is None for p in parts) else cat([p.number for p in parts])
        return TailLayout(cat(resp), cat([p.valid for p in parts]), cat([p.tail for p in parts]), numbers)


def tail_layout(batch: TokenBatch, tau_tail: float, width: int) -> TailLayout:
    """Per-segment valid and tail counts of the A<0 responses of ``batch``.

    ``response`` holds the sample index in ``batch`` (``batch.sample_id[response]``
    is the recorded id).  The definitions of docs/metrics.md#localisation, as the state update counts them: a
    response's advantage is the mean over its valid tokens; a tail token has
    A < 0 and δ < ``tau_tail`` (nats); segments are ``width`` positions wide (:mod:`triage_monitor.metrics.segments`).
    """
    return _layout(batch.sample_index, batch.position, batch.advantage, batch.delta, batch.num_samples,
                   tau_tail, width)


def tail_layout_from_tokens(tokens: pd.DataFrame, tau_tail: float, width: int) -> TailLayout:
    """:func:`tail_layout` of a step's token rows as :meth:`Run.tokens` returns them (sorted by
    ``sample_id``, ``position``), without building a validated TokenBatch (the fast offline path).
    δ is computed in float32 as :attr:`TokenBatch.delta` does, so the counts are identical."""
    import torch

    codes, uniq = pd.factorize(tokens["sample_id"], sort=True)
    col = (lambda name, dtype: torch.from_numpy(tokens[name].to_numpy(dtype, copy=True)))
    return _layout(torch.from_numpy(codes.astype(np.int64)), col("position", np.int64), col("advantage", np.float32),
                   col("learner_logp", np.float32) - col("sampler_logp", np.float32), len(uniq), tau_tail, width)


def _layout(sample_index: Tensor, position: Tensor, advantage: Tensor, delta: Tensor, num_samples: int,
            tau_tail: float, width: int) -> TailLayout:
    # the definitions the state update uses (triage_monitor.metrics.definitions): segments, a tail token (δ compared
    # in float32), a response with A < 0 (its |A| masses by sign, float64)
    import torch

    from ..metrics.segments import segment_tokens

    adv = advantage.double()
    mass = (lambda a: torch.zeros(num_samples, dtype=torch.float64).index_add(0, sample_index, a.clamp(min=0)))
    negative = is_negative_response(mass(adv), mass(-adv))
    seg = segment_tokens(sample_index, position, width)
    tail = seg.sum(is_tail(advantage, delta.detach(), tau_tail).long())
    keep = negative[seg.sample]
    as_np = (lambda t: t[keep].numpy().astype(np.int64))
    return TailLayout(as_np(seg.sample), as_np(seg.count), as_np(tail), as_np(seg.number))


def anchor_steps(steps: Sequence[int], fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[int]:
    """Anchor steps at ``fractions`` of the run's horizon (docs/metrics.md#stages).

    With the ``n`` recorded steps sorted, the anchor of fraction ``f`` is the
    ``ceil(f·n)``-th step (so 25 % of a 100-step run ends at its 25th step).

    Raises:
        ValueError: no steps, or a fraction outside (0, 1].
    """
    s = sorted(int(x) for x in steps)
    if not s:
        raise ValueError("the run has no recorded steps, so there is no stage to anchor")
    for f in fractions:
        if not 0 < f <= 1:
            raise ValueError(f"anchor fraction must lie in (0, 1], got {f}")
    return [s[max(math.ceil(f * len(s)), 1) - 1] for f in fractions]


def anchor_windows(steps: Sequence[int], anchors: Sequence[int], window: int) -> list[list[int]]:
    """The recorded steps of each anchor's trailing window ``(anchor − window, anchor]`` (docs/metrics.md#stages),
    in the order of ``steps``: the steps a stage row merges (and whose token rows its null reads)."""
    return [[s for s in steps if a - window < s <= a] for a in anchors]


def stage_table(run: Run, anchors: Optional[Sequence[int]] = None, *, window: Optional[int] = None,
                draws: int = 499, seed: int = 0, metrics: Optional[pd.DataFrame] = None,
                states=None, steps: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """The stage table of a run (docs/metrics.md#stages): one row per anchor.

    Every value uses one τ_tail for the whole run (the frozen calibration, the first steps included):
    the window metrics are merges of the per-step states of
    :func:`~triage_monitor.offline.analysis.recompute_states` (shared through its cache with ``analyze``, the
    report and the dashboard), and the C_tok shuffle null is drawn from the window's states and the
    shuffle-null inputs recorded with them (:func:`shuffle_null_from_state`; the token records are read
    again only for states computed without them, or with another τ_tail).

    Args:
        run: an opened run.
        anchors: steps ending each stage; None = 25/50/75/100 % (:func:`anchor_steps`).
            A step that was not recorded raises ValueError naming it.
        window: trailing window in steps; None = the run's (manifest) window.
        draws, seed: shuffle-null draws and RNG seed (499, fixed).
        metrics: used only for a run without token records (``record_tokens=False``): its per-step metric
            frame (``step`` and ``window/<name>`` columns; default the live rows), whose values before the
            live τ_tail froze are provisional (``tau_frozen`` False in the table).
        states: the run's :class:`~triage_monitor.offline.analysis.StepStates` if already computed.
        steps: limit the table to these steps (a snapshot of a run still being written: the dashboard passes the
            steps of its one listing); None = every recorded step.

    Returns:
        DataFrame with ``stage`` (label), ``step``, ``first_step`` (window start), ``steps`` (steps in the
        window), the window values of :data:`STAGE_METRICS` under their plain names (ratios as fractions,
        not %), ``c_tok_null_median``, ``c_tok_null_lo``, ``c_tok_null_hi`` (2.5 % / 97.5 % quantiles of
        the null), ``c_tok_excess`` (``c_tok - null median``), ``tau_frozen`` (the row's localisation
        metrics use the run's one frozen τ_tail), ``max_segments`` (most segments of one A<0 response
        holding tail tokens in the window; 0 or 1 makes the null degenerate, :func:`degenerate_notice`), and the
        window's counts ``neg_tokens`` (valid tokens of A<0 responses), ``tail_tokens`` (amplifying-tail tokens among
        them) and ``neg_pairs`` (pairs of neighbouring segments in A<0 responses).  Without token records the null,
        ``max_segments`` and the counts are NaN.

    Raises:
        ValueError: no recorded step, an anchor step that was not recorded, or another window asked of a
            run without token records.
    """
    from .analysis import recompute_states

    run_window = run.config.window
    window = run_window if window is None else int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    cfg = run.metric_config()
    token_steps = run.step_numbers()
    frame = None
    if states is None and token_steps:
        todo = sorted(set(token_steps) & set(steps)) if steps is not None else []
        states = recompute_states(run, cache=True, steps=todo or None)
    if states is not None:
        steps = list(states.steps)
    else:
        live = run.steps() if metrics is None else metrics
        if window != run_window:
            raise ValueError(f"{run.path} has no token records to recompute a {window}-step window from")
        frame = live.set_index("step")
        steps = sorted(int(s) for s in frame.index)
    if anchors is None:
        labels = [f"{round(f * 100)}%" for f in DEFAULT_FRACTIONS]
        anchors = anchor_steps(steps, DEFAULT_FRACTIONS)
    else:
        anchors = [int(a) for a in anchors]
        missing = [a for a in anchors if a not in set(steps)]
        if missing:
            raise ValueError(f"anchor step(s) {missing} not recorded in {run.path} "
                             f"(recorded: {steps[0] if steps else '-'}..{steps[-1] if steps else '-'})")
        labels = [f"step {a}" for a in anchors]
    recomputed: dict = {}             # step -> (state, null input) recomputed with another τ_tail
    rows: list = []
    nulls: list = []
    costs: list = []                  # a window's null costs O(its tail tokens) per draw
    for label, a, win in zip(labels, anchors, anchor_windows(steps, anchors, window)):
        row = {"stage": label, "step": a, "first_step": win[0], "steps": len(win), "max_segments": math.nan,
               "neg_tokens": math.nan, "tail_tokens": math.nan, "neg_pairs": math.nan}
        nulls.append(None)
        costs.append(0.0)
        if states is not None:
            stats = states.window_stats(a, window)
            values = stats.compute().values
            costs[-1] = stats.sum("tail_tokens")
            row.update({name: float(values[name]) for name in STAGE_METRICS})
            # what the degenerate-localisation notice tells apart: A<0 tokens, tail tokens among them, and pairs of
            # neighbouring segments in A<0 responses (0: every A<0 response fits in one segment)
            row.update(neg_tokens=float(stats.sum("neg_valid_tokens")), tail_tokens=float(stats.sum("tail_tokens")),
                       neg_pairs=float(stats.sum("pairs")))
            row["tau_frozen"] = True
            tau = values["tau_tail"]
            if not math.isnan(tau):
                nulls[-1], row["max_segments"] = _window_null(run, states, win, stats, tau, cfg, draws, seed,
                                                              recomputed)
                nulls[-1] = _cached_null(run, states, win, tau, draws, seed, nulls[-1])
        else:
            assert frame is not None                  # no states: the live rows' frame was read above
            for name in STAGE_METRICS:
                col = f"window/{name}"
                row[name] = float(frame.at[a, col]) if col in frame.columns else math.nan
            row["tau_frozen"] = bool(frame["tau_tail_frozen"].loc[win].astype(float).eq(1).all()) \
                if "tau_tail_frozen" in frame.columns else False
        rows.append(row)
    # the windows' nulls are independent draws (the compiled sampler releases the GIL): one thread each, the
    # costliest windows first so that the threads finish together
    with cf.ThreadPoolExecutor(max(1, min(len(nulls), os.cpu_count() or 1))) as pool:
        futures = {i: pool.submit(nulls[i]) for i in sorted(range(len(nulls)), key=lambda i: -costs[i])
                   if nulls[i] is not None}
        nulls = [futures[i].result() if i in futures else np.full(draws, math.nan) for i in range(len(nulls))]
    for row, null in zip(rows, nulls):
        if np.isnan(null).all():
            row.update(c_tok_null_median=math.nan, c_tok_null_lo=math.nan, c_tok_null_hi=math.nan)
        else:
            lo, med, hi = np.quantile(null, [0.025, 0.5, 0.975])
            row.update(c_tok_null_median=float(med), c_tok_null_lo=float(lo), c_tok_null_hi=float(hi))
        row["c_tok_excess"] = row["c_tok"] - row["c_tok_null_median"]
    return pd.DataFrame(rows)


def _cached_null(run: Run, states, win: list, tau: float, draws: int, seed: int, draw):
    """``draw`` (a function returning one window's ``(draws,)`` null values) with its result kept in the run's
    ``analysis/null-<key>.npy``, the key covering the window's states, τ_tail, draws and seed: the report and the
    dashboard draw a window's null once (it is most of a stage table's time).  A cache that cannot be read or
    written is skipped.  None stays None (no null to draw)."""
    import hashlib
    import io

    if draw is None:
        return None
    h = hashlib.sha256(json.dumps([list(map(int, win)), float(tau), int(draws), int(seed), 1]).encode())
    for st in win:
        h.update(np.ascontiguousarray(states.states[states.steps.index(st)]).tobytes())
    rel = f"{RunLayout.analysis_dir}/null-{h.hexdigest()[:20]}.npy"

    def cached():
        try:
            out = np.load(io.BytesIO(run.store.read_bytes(rel)))
            if out.shape == (int(draws),):
                return out
        except (OSError, ValueError):
            pass
        out = draw()
        buf = io.BytesIO()
        np.save(buf, out)
        try:
            run.store.makedirs(RunLayout.analysis_dir)
            run.store.write_bytes(rel, buf.getvalue())
        except OSError:
            pass
        return out
    return cached


class DegenerateCause(NamedTuple):
    """One degenerate anchor window of a stage table (:func:`degenerate_causes`)."""

    stage: str
    cause: str             # "no_negative", "no_tail", "short" or "short_tails"
    row: pd.Series


def degenerate_causes(table: pd.DataFrame) -> list[DegenerateCause]:
    """Why each degenerate anchor window of a :func:`stage_table` has no localisation evidence: ``[(stage, cause,
    row), ...]`` for the rows whose ``max_segments`` is 0 or 1, cause one of

    * ``"no_negative"``: no A<0 response in the window (``neg_tokens`` = 0);
    * ``"no_tail"``: A<0 responses, but no amplifying-tail token among their tokens (``tail_tokens`` = 0);
    * ``"short"``: every A<0 response fits in one segment (``neg_pairs`` = 0);
    * ``"short_tails"``: longer A<0 responses exist, but every one holding tail tokens fits in one segment.

    Without the counts (a run without token records) ``max_segments`` 0 reads ``"no_tail"`` and 1 ``"short_tails"``.
    """
    if "max_segments" not in table.columns:
        return []
    out = []
    for _, row in table.iterrows():
        m = float(row["max_segments"])
        if math.isnan(m) or m > 1:
            continue
        neg, tail, pairs = (float(row.get(c, math.nan)) for c in ("neg_tokens", "tail_tokens", "neg_pairs"))
        if neg == 0:
            cause = "no_negative"
        elif tail == 0 or (math.isnan(tail) and m == 0):
            cause = "no_tail"
        elif pairs == 0:
            cause = "short"
        else:
            cause = "short_tails"
        out.append(DegenerateCause(str(row["stage"]), cause, row))
    return out


def degenerate_notice(table: pd.DataFrame, width: int) -> Optional[str]:
    """Why the stage table's C_tok null and P_adj say nothing, or None (docs/metrics.md#shuffle_null), naming the
    true cause of each degenerate window (:func:`degenerate_causes`) with the advice that fits it.

    When no A<0 response of an anchor window holds tail tokens in two or more segments (``max_segments`` 0 or 1),
    the within-response shuffle cannot move a tail token to another segment, so the null equals the observed C_tok
    (excess 0.00 by construction, or undefined without tail tokens) and P_adj is undefined (NaN).  That happens when
    the window holds no A<0 response, or no amplifying-tail token (nothing to localise: not a matter of the segment
    width), or when the A<0 responses that hold tail tokens are shorter than one segment of ``width`` positions (a
    smaller segment width, or longer responses, are needed).
    """
    causes = degenerate_causes(table)
    if not causes:
        return None
    parts = []
    for cause in ("short", "short_tails", "no_tail", "no_negative"):
        rows = [(st, row) for st, c, row in causes if c == cause]
        if not rows:
            continue
        which = "every stage" if len(rows) == len(table) else "stage(s) " + ", ".join(st for st, _ in rows)
        if cause == "short":
            parts.append(f"Degenerate localisation in {which}: every A<0 response is shorter than one segment "
                         f"(W = {width} positions), so the shuffle null cannot move a tail token to another segment "
                         "(null = C_tok, excess 0.00 by construction) and no segment has a predecessor (P_adj "
                         "undefined, shown as -). These values say nothing about localisation; use a smaller segment "
                         "width (MetricConfig(segment_width=...), the demo's --segment-width) or longer responses.")
        elif cause == "short_tails":
            parts.append(f"Degenerate localisation in {which}: every A<0 response that holds amplifying-tail tokens "
                         f"fits in one segment (W = {width} positions; longer A<0 responses hold none), so the "
                         "shuffle null cannot move a tail token to another segment (null = C_tok, excess 0.00 by "
                         "construction). These values say nothing about localisation; a smaller segment width "
                         "(MetricConfig(segment_width=...), the demo's --segment-width) would.")
        elif cause == "no_tail":
            counts = [f"0 of {int(r['neg_tokens']):,} A<0 tokens" for _, r in rows
                      if not math.isnan(float(r.get("neg_tokens", math.nan)))]
            tau = float(rows[0][1].get("tau_tail", math.nan))
            below = f" below τ_tail = {tau:.3g} nats" if math.isfinite(tau) else ""
            parts.append(f"No localisation in {which}: the window holds no amplifying-tail token"
                         + (f" ({'; '.join(counts)}{below})" if counts else "") + ", so there is nothing to "
                         "localise: C_tok, its null and P_adj are undefined there (shown as -). This is not a matter "
                         "of the segment width (keep it); the learner does not fall below τ_tail on any token of an "
                         "A<0 response in these steps — compare the δ histogram with τ_tail, which was calibrated on "
                         "the first steps.")
        else:
            parts.append(f"No localisation in {which}: the window holds no A<0 response (every advantage is >= 0), so "
                         "there is no amplifying tail to localise; check the advantages (a reward with no spread "
                         "within its groups gives A = 0 everywhere).")
    return " ".join(parts)


class WindowNull(NamedTuple):
    """A stage window's C_tok shuffle null (:func:`_window_null`): ``draw()`` returns its ``(draws,)`` values;
    ``max_segments``, the most segments of one A<0 response holding tail tokens."""

    draw: Callable[[], np.ndarray]
    max_segments: int


def _window_null(run: Run, states, win: list, window_stats, tau: float, cfg, draws: int, seed: int,
                 recomputed: dict) -> WindowNull:
    """The C_tok shuffle null of one stage window, as a function returning its ``(draws,)`` values, and the
    most segments of one A<0 response holding tail tokens (the responses whose tails the null moves;
    ``max_segments <= 1`` is the degenerate case of :func:`degenerate_notice`).  One path,
    :func:`shuffle_null_from_state`, on the window's C_tok table and shuffle-null inputs: those recorded with the
    steps' states when every step of the window was computed with the window's τ_tail, else the steps' recomputed
    now from their token records with that τ_tail (kept in ``recomputed`` for the other windows)."""
    from .analysis import _step_result, read_token_arrays

    idx = [states.steps.index(s) for s in win]
    if states.null_inputs is not None and all(states.taus[i] == tau for i in idx):
        null_input = NullInput.concat([NullInput(*states.null_inputs[i]) for i in idx])
        table = window_stats.array[window_stats.layout.slices["c_tok_table"]]
    else:
        for s in win:
            if s not in recomputed:
                recomputed[s] = _step_result(read_token_arrays(run.token_source(s)), tau, cfg, str(run.path))
        null_input = NullInput.concat([recomputed[s][1] for s in win])
        table = sum(recomputed[s][0][window_stats.layout.slices["c_tok_table"]] for s in win)
    most = int(null_input.response_segments.max()) if len(null_input.response_segments) else 0
    return WindowNull(lambda: shuffle_null_from_state(null_input, table, cfg.segment_width, draws, seed,
                                                       cfg.top_fraction), most)


def tail_layout_from_arrays(parts: list, tau_tail: float, width: int = 64) -> TailLayout:
    """:func:`tail_layout` of a step's decoded rank files (:func:`~triage_monitor.offline.analysis.read_token_arrays`),
    the responses of each rank file kept apart as the live monitor keeps them.  Rows are in the monitor's
    (sample_id, position) order."""
    import torch

    out = []
    for sid, pos, lp, sp, adv in parts:
        if sid.size == 0:
            continue
        codes = np.r_[0, np.cumsum(sid[1:] != sid[:-1])].astype(np.int64)
        delta = torch.from_numpy(np.asarray(lp, np.float32).copy()) - torch.from_numpy(np.asarray(sp, np.float32).copy())
        out.append(_layout(torch.from_numpy(codes), torch.from_numpy(pos.astype(np.int64)),
                           torch.from_numpy(np.asarray(adv, np.float32).copy()), delta, int(codes[-1]) + 1,
                           tau_tail, width))
    return TailLayout.concat(out)


#: The null's columns shown as percentages by :func:`format_stage_table` (besides the metrics declared ``percent``).
NULL_PERCENT_COLUMNS = ("c_tok_null_median", "c_tok_excess")
#: Headers of the null's columns in :func:`format_stage_table` (the metrics' come from their declarations).
NULL_HEADERS = {"c_tok_null_median": "null median %", "c_tok_null_95": "null 95% interval (%)",
                "c_tok_excess": "excess (pts)"}


def format_stage_table(table: pd.DataFrame) -> pd.DataFrame:
    """A display copy of :func:`stage_table`: ratios in %, the null as ``median [lo, hi]``, short headers."""
    t = table.copy()
    for c in (*(m for m in STAGE_METRICS if names.BY_NAME[m].percent), *NULL_PERCENT_COLUMNS):
        if c in t.columns:
            t[c] = t[c] * 100.0
    t["c_tok_null_95"] = [f"[{lo * 100:.2f}, {hi * 100:.2f}]" if not (math.isnan(lo) or math.isnan(hi)) else "-"
                          for lo, hi in zip(t["c_tok_null_lo"], t["c_tok_null_hi"])]
    t["window"] = [f"{a}-{b}" for a, b in zip(t["first_step"], t["step"])]
    null_after = STAGE_METRICS.index("c_tok") + 1          # the null's columns follow C_tok
    cols = ["stage", "step", "window", *STAGE_METRICS[:null_after], *NULL_HEADERS, *STAGE_METRICS[null_after:]]
    headers = {**{m: names.label(m) + (" %" if names.BY_NAME[m].percent else "") for m in STAGE_METRICS},
               **NULL_HEADERS}
    t["n_tokens"] = t["n_tokens"].map(lambda v: "-" if math.isnan(v) else f"{int(v):,}")
    return t[cols].rename(columns=headers)


# --------------------------------------------------------------------------- shuffle null from the states
def shuffle_null_from_state(null_input: NullInput, c_tok_table, width: int, draws: int = 499, seed: int = 0,
                            top_fraction: float = 0.05) -> np.ndarray:
    """C_tok under the shuffle null (docs/metrics.md#shuffle_null) from a window's state: ``(draws,)`` float64.

    The law of docs/metrics.md#shuffle_null (each A<0 response keeps its valid positions and its number of
    tail tokens ``t_i``, placed uniformly at random among its ``n_i`` valid positions: the per-segment counts
    follow a multivariate hypergeometric law, which tests/reference_metrics.py draws exactly as a chain of
    univariate hypergeometric draws to check this sampler against), drawn as follows:
    per draw and response, ``t_i`` distinct positions are drawn (Floyd's algorithm, from a seeded
    xorshift64* generator; an index in [0, m) is the high word of m times 32 random bits,
    uniform to within m / 2³², under 10⁻⁵ for responses under 40k tokens) and counted into the response's
    segments (position // W when every segment but the last is full, else a binary search of the segments'
    cumulative valid counts), and the segments of responses without tail tokens stay at 0 tails; C_tok is then
    read from the (valid, tail) segment table exactly as :func:`~triage_monitor.metrics.c_tok_from_table` does.
    Cost per draw: O(tail tokens + tail-holding segments + (W+1)²), not O(tokens); the working memory of a
    response (one flag per valid position, one count per segment) is reused from response to response, so it
    stays in the CPU's first-level cache.

    Args:
        null_input: the window's :class:`NullInput` (its steps' concatenated).
        c_tok_table: ``((W+1)²,)`` the window's segment counts by (valid, tail) (the state's ``c_tok_table``):
            gives every A<0 segment's valid count, those of responses without tail tokens included.
        width: W.

    Returns:
        NaN values when there is no tail token.
    """
    from ..metrics.stats import _cell_order

    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    W1 = width + 1
    table = np.asarray(c_tok_table, dtype=np.float64).reshape(W1, W1)
    by_valid = np.rint(table.sum(1)).astype(np.int64)          # segments by valid count
    K = int(by_valid.sum())
    tails = np.asarray(null_input.response_tails, dtype=np.int64)
    total = int(tails.sum())
    if K == 0 or total == 0:
        return np.full(draws, math.nan)
    seg_valid = np.asarray(null_input.segment_valid, dtype=np.int64)
    nseg = np.asarray(null_input.response_segments, dtype=np.int64)
    starts = np.r_[0, np.cumsum(nseg)]
    cum = np.cumsum(seg_valid)                    # valid tokens of its response up to each segment's end
    cum -= np.repeat(np.r_[0, cum][starts[:-1]], nseg)
    order, order_tails = _cell_order(int(width))
    return _null_draws(seg_valid, cum, starts, tails, by_valid, order.astype(np.int64),
                       order_tails.astype(np.int64), int(width), math.ceil(top_fraction * K), float(total),
                       int(draws), int(seed))




@njit(cache=True, nogil=True, inline="always")
def _floyd_take(x, j, taken):                                # pragma: no cover - compiled
    """One step of Floyd's draw: the xorshift64* state ``x`` advanced, an index in [0, j] (the high word of
    (j + 1) times 32 random bits), ``j`` itself when that index is already ``taken``; marks it taken.  Returns
    ``(x, position)``."""
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    u = (x * np.uint64(2685821657736338717)) >> np.uint64(32)
    p = np.int64((u * np.uint64(j + 1)) >> np.uint64(32))
    if taken[p]:
        p = j
    taken[p] = True
    return x, p


@njit(cache=True, nogil=True)
def _null_draws(seg_valid, cum, starts, tails, by_valid, order, order_tails, width, top, total, draws,
                seed):                                       # pragma: no cover - compiled
    W1 = width + 1
    R = tails.shape[0]
    out = np.empty(draws)
    hist = np.zeros(W1 * W1, np.int64)
    # per response: valid tokens n, whether every segment but the last is full (segment = position // W)
    n_of = np.zeros(R, np.int64)
    regular = np.zeros(R, np.bool_)
    longest_n = 1
    most_seg = 1
    longest_t = 1
    for r in range(R):
        s0 = starts[r]
        s1 = starts[r + 1]
        reg = True
        for s in range(s0, s1 - 1):
            if seg_valid[s] != width:
                reg = False
        regular[r] = reg
        n_of[r] = cum[s1 - 1] if s1 > s0 else 0
        longest_n = max(longest_n, n_of[r])
        most_seg = max(most_seg, s1 - s0)
        longest_t = max(longest_t, tails[r])
    shift = segment_shift_nb(width)
    taken = np.zeros(longest_n, np.bool_)       # one response's positions: stays in L1 across responses
    cnt = np.zeros(most_seg, np.int64)
    chosen = np.empty(longest_t, np.int64)
    x = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    if x == 0:
        x = np.uint64(1)
    for d in range(draws):
        hist[:] = 0
        for v in range(W1):
            hist[v * W1] = by_valid[v]
        for r in range(R):
            t = tails[r]
            if t == 0:                              # no tail token: its segments stay at 0 tails
                continue
            n = n_of[r]
            s0 = starts[r]
            k = starts[r + 1] - s0
            # Floyd's draw of t distinct positions among n; each position is counted into its segment as it is
            # drawn (the same positions, so the same counts, as counting them after the draw), the flags reset after
            if regular[r]:                          # the segment of the p-th valid position is its number
                for j in range(n - t, n):
                    x, p = _floyd_take(x, j, taken)
                    chosen[j - (n - t)] = p
                    cnt[segment_number_nb(p, width, shift)] += 1
            else:
                for j in range(n - t, n):
                    x, p = _floyd_take(x, j, taken)
                    chosen[j - (n - t)] = p
                    lo = 0
                    hi = k - 1
                    while lo < hi:                    # first segment whose cumulative end exceeds p
                        mid = (lo + hi) >> 1
                        if cum[s0 + mid] > p:
                            hi = mid
                        else:
                            lo = mid + 1
                    cnt[lo] += 1
            for i in range(t):
                taken[chosen[i]] = False
            for j in range(k):
                c = cnt[j]
                if c:
                    v = seg_valid[s0 + j]
                    hist[v * W1] -= 1
                    hist[v * W1 + c] += 1
                    cnt[j] = 0
        out[d] = top_tail_tokens(hist, order, order_tails, top) / total
    return out
