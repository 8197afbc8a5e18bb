"""Input-alignment diagnostics (docs/reliability.md): one-position shifts and padding leaks.

Two checks that :class:`~triage_monitor.batch.TokenBatch` validation cannot
make token by token, because each token looks plausible on its own:

* :func:`check_alignment` -- a one-token shift between the learner's and the
  sampler's log-probs (an off-by-one after a label-shift change).  The gap
  then looks like noise.  docs/reliability.md: "detect it by checking whether shifting
  one side by one position shrinks |δ| markedly".
* :func:`padding_diagnostics` -- padding values read as log-probs inside the
  valid region that are *not* caught as sentinels (``logp <= -1e8`` and the exact
  fill values −9999 / −65504, :func:`triage_monitor.batch.is_sentinel`, are
  quarantined / raised by the batch itself): an exact ``0.0`` (probability 1)
  on one side facing a clearly uncertain token on the other, and a trailing
  run of bit-identical values at the end of a response on one side only
  (a pad value leaking through a mask that is too long).

Both are vectorised over the flat batch (no Python loop over responses) and
cheap enough to run every step; :class:`~triage_monitor.monitor.MismatchMonitor`
runs :func:`padding_diagnostics` every step and :func:`check_alignment` on its
first steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from numba import njit

from ..batch import TokenBatch

Tensor = torch.Tensor

#: The best one-position shift must bring the mean |δ| below this fraction of
#: the unshifted mean |δ| to call the batch misaligned ("markedly", docs/reliability.md).
SHIFT_RATIO_THRESHOLD = 0.5
#: Below this unshifted mean |δ| (nats) the paths agree already; no shift is reported.
MIN_ALIGNED_ABS_DELTA = 0.05
#: Fewer adjacent (t, t+1) token pairs than this: no verdict.
MIN_PAIRS = 16
#: A one-sided exact 0.0 log-prob counts as a padding leak when the other side is below −ZERO_LOGP_GAP nats
#: (probability < 0.61): one path says "certain", the other a clearly uncertain token.
ZERO_LOGP_GAP = 0.5
#: A trailing run of at least this many bit-identical values on one side is a padding-leak candidate.
PADDING_MIN_RUN = 4


@dataclass(frozen=True)
class AlignmentReport:
    """Result of :func:`check_alignment` (all |δ| figures are means in nats over the same token pairs).

    Attributes:
        pairs: number of adjacent valid token pairs (same response, positions t and t+1) compared.
        aligned_abs_delta: mean |learner[t] − sampler[t]|.
        learner_late_abs_delta: mean |learner[t+1] − sampler[t]| (the learner's values sit one
            position too late).
        learner_early_abs_delta: mean |learner[t] − sampler[t+1]| (the learner's values sit one
            position too early).
        shift: 0 (aligned / no verdict), +1 (learner late) or −1 (learner early).
        ratio: best shifted mean |δ| / aligned mean |δ| (NaN without a verdict).
        suspect: True when a shift shrinks mean |δ| below ``SHIFT_RATIO_THRESHOLD`` × the aligned value.
        message: one sentence saying what was found and which way to shift.
    """

    pairs: int
    aligned_abs_delta: float
    learner_late_abs_delta: float
    learner_early_abs_delta: float
    shift: int
    ratio: float
    suspect: bool
    message: str

    def to_metrics(self) -> dict[str, float]:
        """``{alignment_suspect, alignment_shift, alignment_ratio}`` as floats (monitor metric names)."""
        return {"alignment_suspect": float(self.suspect), "alignment_shift": float(self.shift),
                "alignment_ratio": float(self.ratio)}

    def to_dict(self) -> dict[str, Any]:
        """The report's fields by name (:func:`dataclasses.asdict`)."""
        return asdict(self)


def check_alignment(batch_or_learner: Union[TokenBatch, Tensor], sampler_logp: Optional[Tensor] = None,
                    mask: Optional[Tensor] = None, *, ratio_threshold: float = SHIFT_RATIO_THRESHOLD,
                    min_pairs: int = MIN_PAIRS) -> AlignmentReport:
    """Test whether the learner and sampler log-probs are shifted by one position (docs/reliability.md).

    Over every pair of valid tokens at positions t and t+1 of the same response
    (masked gaps break pairs), compare the mean |δ| of the aligned pairing
    ``learner[t] − sampler[t]`` with the two one-position shifts
    ``learner[t+1] − sampler[t]`` (learner late) and ``learner[t] − sampler[t+1]``
    (learner early).  All three use the same pairs, so they are comparable.
    The batch is called misaligned when the better shift brings the mean |δ|
    below ``ratio_threshold`` × the aligned value and the aligned value is at
    least :data:`MIN_ALIGNED_ABS_DELTA` nats.  With real, aligned log-probs a
    shift compares different tokens and *grows* |δ|, so a healthy batch gives a
    ratio well above 1.

    Args:
        batch_or_learner: a :class:`TokenBatch`, or the learner log-probs as a padded
            ``(B, T)`` or a single response ``(T,)`` float tensor (nats).
        sampler_logp: same shape as the learner tensor (tensor form only).
        mask: optional loss mask of the same shape (default: every token valid).
        ratio_threshold: "markedly" (default 0.5).
        min_pairs: fewer comparable pairs give no verdict (``shift = 0``, ``ratio`` NaN).

    Returns:
        :class:`AlignmentReport`.

    Raises:
        ValueError / TypeError: from :meth:`TokenBatch.from_padded` on bad shapes, dtypes or
        masks (naming the argument); ``sampler_logp`` missing in tensor form.
        Invalid values (NaN, sentinels) are excluded, never raised, so the check can run on raw input.
    """
    if isinstance(batch_or_learner, TokenBatch):
        if sampler_logp is not None or mask is not None:
            raise ValueError("check_alignment: pass either a TokenBatch or (learner_logp, sampler_logp, mask)")
        batch = batch_or_learner
    else:
        if sampler_logp is None:
            raise ValueError("check_alignment: sampler_logp is required with a learner_logp tensor")
        lp, sp = batch_or_learner, sampler_logp
        if isinstance(lp, Tensor) and lp.dim() == 1:
            lp, sp = lp.unsqueeze(0), sp.unsqueeze(0) if isinstance(sp, Tensor) else sp
            mask = mask.unsqueeze(0) if isinstance(mask, Tensor) else mask
        if mask is None and isinstance(lp, Tensor):
            mask = torch.ones(lp.shape, dtype=torch.bool, device=lp.device)
        # no advantages in this form: zeros per row (from_padded rejects a learner that is not a (B, T) float
        # tensor before it reads them)
        rows = lp.shape[0] if isinstance(lp, Tensor) and lp.dim() == 2 else 0
        adv = torch.zeros(rows, device=lp.device if isinstance(lp, Tensor) else None)
        batch = TokenBatch.from_padded(lp, sp, adv, mask, on_invalid="quarantine")

    lp = batch.learner_logp.detach().float()
    sp = batch.sampler_logp.detach().float()
    if batch.num_tokens >= 2:
        same = (batch.sample_index[1:] == batch.sample_index[:-1]) & (batch.position[1:] == batch.position[:-1] + 1)
        n = int(same.sum())

        def mean_abs(a: Tensor, b: Tensor) -> float:   # mean |a − b| over the pairs, float64 accumulation
            return float(torch.where(same, (a - b).abs(), 0.0).sum(dtype=torch.float64)) / n if n else math.nan

        aligned, late, early = mean_abs(lp[:-1], sp[:-1]), mean_abs(lp[1:], sp[:-1]), mean_abs(lp[:-1], sp[1:])
    else:
        n, aligned, late, early = 0, math.nan, math.nan, math.nan
    if n < min_pairs:
        return AlignmentReport(n, aligned, late, early, 0, math.nan, False,
                               f"alignment: no verdict ({n} adjacent token pairs < {min_pairs})")
    if aligned < MIN_ALIGNED_ABS_DELTA:
        ratio = min(late, early) / aligned if aligned > 0 else math.inf
        return AlignmentReport(n, aligned, late, early, 0, ratio, False,
                               f"alignment: aligned (mean |delta| {aligned:.4g} nats)")
    shift = 1 if late <= early else -1
    best = min(late, early)
    ratio = best / aligned
    if ratio >= ratio_threshold:
        return AlignmentReport(n, aligned, late, early, 0, ratio, False,
                               f"alignment: no one-position shift shrinks mean |delta| markedly "
                               f"({aligned:.4g} nats aligned, best shift {best:.4g})")
    if shift == 1:
        how = ("learner_logp sits one position late: learner_logp[t+1] matches sampler_logp[t]; "
               "shift learner_logp left by one (learner_logp[:, 1:]) or sampler_logp right by one")
    else:
        how = ("learner_logp sits one position early: learner_logp[t] matches sampler_logp[t+1]; "
               "shift learner_logp right by one or sampler_logp left by one (sampler_logp[:, 1:])")
    return AlignmentReport(n, aligned, late, early, shift, ratio, True,
                           f"alignment: {how} (mean |delta| {aligned:.4g} -> {best:.4g} nats over {n} pairs); "
                           f"check the label shift of the log-prob computation")


def padding_diagnostics(batch: TokenBatch, *, zero_gap: float = ZERO_LOGP_GAP,
                        min_run: int = PADDING_MIN_RUN, run_gap: float = 0.05) -> dict[str, float]:
    """Padding values that leak into the valid region without being sentinels (docs/reliability.md).

    * ``zero_logp_count``: valid tokens whose log-prob is exactly 0.0 (probability 1,
      the usual pad value) on one side while the other side is below ``−zero_gap``
      nats.  A real token can round to 0.0 in bf16, but then the other path also
      rates it near-certain; a confident 0.0 against an uncertain token is a pad value.
    * ``padding_run_count`` / ``padding_run_tokens``: responses (and their tokens) that
      end in a run of at least ``min_run`` bit-identical values on either side with a
      mean |δ| over the run of at least ``run_gap`` nats: a pad value (0.0, −1.0,
      log(1/V), ...) read through a mask that is too long, on one side or on both with
      different pad values.  Confident endings (both sides ≈ 0, e.g. bf16 rounding to
      0.0) have |δ| ≈ 0 and are not counted.

    * ``offset_response_count``: rows of a :meth:`TokenBatch.from_padded` batch built without
      ``positions=`` whose first unmasked column is not 0 (:attr:`TokenBatch.offset_responses`): left
      padding or a prompt kept in the tensor, so positions and the segments cut from them
      (docs/metrics.md#localisation) are shifted.  A quarantined token in column 0 does not count (the
      response did start there); packed, list and flat batches count 0, their positions being
      response-relative by construction (a masked leading span there is a real masked span).

    Entirely masked-out padding is never read, so these count only leaks.  Sentinels
    (log p ≤ −1e8, e.g. −1e10, and the exact fills −9999 / −65504: :func:`~triage_monitor.batch.is_sentinel`) are
    already raised or quarantined by :class:`TokenBatch`.

    Args:
        batch: :class:`TokenBatch` (N valid tokens, S responses).

    Returns:
        dict of floats ``zero_logp_count``, ``padding_run_count``, ``padding_run_tokens``,
        ``offset_response_count``.
    """
    if batch.learner_logp.device.type != "cpu":
        return _padding_diagnostics_torch(batch, zero_gap, min_run, run_gap)
    # on the CPU one compiled pass (tests/test_reliability.py checks it against the torch form) over the batch's
    # one host copy (TokenBatch.host: shared with the metrics and the record writer)
    host = batch.host()
    zero, runs, run_tokens = _padding_scan(host.learner_logp.numpy(), host.sampler_logp.numpy(), batch.num_valid.numpy(),
                                           np.float32(zero_gap), int(min_run), float(run_gap))
    return {"zero_logp_count": float(zero), "padding_run_count": float(runs), "padding_run_tokens": float(run_tokens),
            "offset_response_count": float(batch.offset_responses)}


def _padding_diagnostics_torch(batch: TokenBatch, zero_gap: float, min_run: int, run_gap: float) -> dict[str, float]:
    """:func:`padding_diagnostics` as torch operations, for tensors on an accelerator."""
    lp = batch.learner_logp.detach().float()
    sp = batch.sampler_logp.detach().float()
    z = torch.nonzero(lp * sp == 0).squeeze(1)          # candidates: a side is 0 (or the product underflows)
    zl, zs = lp[z], sp[z]
    zero = ((zl == 0) & (zs < -zero_gap)) | ((zs == 0) & (zl < -zero_gap))
    out = {"zero_logp_count": float(zero.sum()), "padding_run_count": 0.0, "padding_run_tokens": 0.0,
           "offset_response_count": float(batch.offset_responses)}
    N = batch.num_tokens
    if N == 0:
        return out
    # tokens are ordered by (sample, position): each response is a contiguous slice [first, last]
    nv = batch.num_valid
    last = torch.cumsum(nv, 0) - 1
    first = last - nv + 1
    if min_run < 1:
        return out
    # cheap pre-filter: a run of >= min_run needs the last min_run values of a side to be equal
    k = torch.arange(1, min_run, device=lp.device)
    long_enough = nv >= min_run
    back = (last[:, None] - k[None]).clamp(min=0)
    end = last.clamp(min=0)
    cand = long_enough & (((lp[back] == lp[end][:, None]).all(1)) | ((sp[back] == sp[end][:, None]).all(1)))
    if not bool(cand.any()):
        return out
    si = batch.sample_index
    idx = torch.arange(N, device=lp.device)
    resp = torch.nonzero(cand).squeeze(1)

    def trailing_run(x: Tensor) -> Tensor:
        """(R,) length of the run of values equal to the response's last value, counted from its end."""
        differs = x != x[end][si]
        last_diff = torch.cummax(torch.where(differs, idx, -1), 0).values   # last differing index <= i
        begin = torch.maximum(last_diff[last[resp]] + 1, first[resp])
        return last[resp] - begin + 1

    run = torch.maximum(trailing_run(lp), trailing_run(sp))
    csum = torch.cat([torch.zeros(1, dtype=torch.float64, device=lp.device),
                      torch.cumsum((lp - sp).abs().double(), 0)])
    gap = (csum[last[resp] + 1] - csum[last[resp] + 1 - run]) / run.double()
    leak = (run >= min_run) & (gap >= run_gap)
    out["padding_run_count"] = float(leak.sum())
    out["padding_run_tokens"] = float(run[leak].sum())
    return out


@njit(nogil=True, cache=True)
def _padding_scan(lp, sp, nv, zero_gap, min_run, run_gap):          # pragma: no cover - compiled
    """CPU form of :func:`padding_diagnostics`: ``lp``, ``sp`` (N,) float32 in (response, position) order,
    ``nv`` (S,) valid tokens per response; returns (zero_logp_count, padding_run_count, padding_run_tokens)."""
    zero = 0
    for i in range(lp.shape[0]):
        if (lp[i] == 0 and sp[i] < -zero_gap) or (sp[i] == 0 and lp[i] < -zero_gap):
            zero += 1
    runs = 0
    run_tokens = 0
    last = -1
    for r in range(nv.shape[0]):
        n = nv[r]
        first = last + 1
        last = last + n
        if min_run < 1 or n < min_run:
            continue
        best = 0
        for x in (lp, sp):                       # the trailing run of values equal to the last one, each side
            k = 1
            while last - k >= first and x[last - k] == x[last]:
                k += 1
            best = max(best, k)
        if best < min_run:
            continue
        gap = 0.0
        for i in range(last - best + 1, last + 1):
            gap += abs(np.float32(lp[i] - sp[i]))
        if gap / best >= run_gap:
            runs += 1
            run_tokens += best
    return zero, runs, run_tokens


__all__ = ["AlignmentReport", "check_alignment", "padding_diagnostics"]
