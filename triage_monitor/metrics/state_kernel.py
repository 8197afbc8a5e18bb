"""The one update of the metric state (docs/metrics.md#state): a compiled pass over the tokens (numba).

:class:`~triage_monitor.metrics.MismatchStats` keeps one fixed-size float64 state vector
(docs/metrics.md#state).  This module is the only code that writes it from tokens -- live, on the host copy of
the step's tokens whatever device the trainer uses, and in every offline recomputation -- in one pass over
the tokens, response by response, with no intermediate arrays: each token's δ is read once for the magnitude
sums, the region masses, the δ sketch, min and max, and once more (while still in cache) for the segments of
an A < 0 response.

The additive part of the state is declared here, once (:data:`SUM_FIELDS`, each with the pass that writes
it); the kernel writes every field by its name's index and marks it written, and :func:`update_state` refuses
to return a state in which a declared field of the pass was not written, so a field added to the declaration
and forgotten in the kernel fails the first update (and the tests), never silently stays 0.

The kernel releases the GIL, so the offline map decodes the next step's Parquet files on another
thread while this one computes.

Sums are accumulated per response, then added to the totals, so rounding grows with the response length
and the number of responses, not with their product.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
from numba import njit

from . import sketch
from .definitions import is_negative_response, is_tail, segment_number, segment_shift
from .names import REGIONS  # the region names of docs/metrics.md#regions, in the order of the mass_* / count_* fields

#: Modes of :func:`update_state`: the τ-independent part, the τ-dependent part, or both.
MAGNITUDE, LOCALISATION, BOTH = 1, 2, 3
#: :func:`update_state` status codes.
OK, UNSORTED = 0, 1


#: The additive state of :class:`~triage_monitor.metrics.MismatchStats`, one float64 each (reduced with SUM
#: across steps and ranks), declared once: (name, the pass of :func:`update_state` that writes it).
SUM_FIELD_PASSES = (
    *((name, MAGNITUDE) for name in (
        "n_tokens", "n_responses_all", "n_responses_nonempty", "small_gap_count", "delta_sum", "delta_abs_sum",
        "k3_sum", "exp_r_sq_sum", "log_ppl_diff_sum", "abs_adv_sum",
        *(f"mass_{r}" for r in REGIONS), *(f"count_{r}" for r in REGIONS),
        "lennorm_amp_neg", "lennorm_amp_pos")),
    # localisation (docs/metrics.md#localisation), over responses with A < 0
    *((name, LOCALISATION) for name in (
        "neg_valid_tokens", "tail_tokens", "segments", "heavy_segments",
        "pairs", "pairs_heavy", "pairs_prev_heavy", "pairs_both_heavy",
        "responses_with_heavy", "responses_diluted")),
)
#: The names of :data:`SUM_FIELD_PASSES`, in state order.
SUM_FIELDS = tuple(name for name, _ in SUM_FIELD_PASSES)
_AT = {name: i for i, name in enumerate(SUM_FIELDS)}
# the kernel addresses each field by its name (numba freezes these module constants when it compiles)
F_N_TOKENS, F_N_RESPONSES_ALL, F_N_RESPONSES_NONEMPTY = _AT["n_tokens"], _AT["n_responses_all"], \
    _AT["n_responses_nonempty"]
F_SMALL_GAP, F_DELTA_SUM, F_DELTA_ABS_SUM = _AT["small_gap_count"], _AT["delta_sum"], _AT["delta_abs_sum"]
F_K3_SUM, F_EXP_R_SQ_SUM, F_LOG_PPL_DIFF_SUM, F_ABS_ADV_SUM = _AT["k3_sum"], _AT["exp_r_sq_sum"], \
    _AT["log_ppl_diff_sum"], _AT["abs_adv_sum"]
F_MASS_AMP_NEG, F_MASS_AMP_POS, F_MASS_CON_NEG, F_MASS_CON_POS = (_AT[f"mass_{r}"] for r in REGIONS)
F_COUNT_AMP_NEG, F_COUNT_AMP_POS, F_COUNT_CON_NEG, F_COUNT_CON_POS = (_AT[f"count_{r}"] for r in REGIONS)
F_LENNORM_AMP_NEG, F_LENNORM_AMP_POS = _AT["lennorm_amp_neg"], _AT["lennorm_amp_pos"]
F_NEG_VALID, F_TAIL, F_SEGMENTS, F_HEAVY = _AT["neg_valid_tokens"], _AT["tail_tokens"], _AT["segments"], \
    _AT["heavy_segments"]
F_PAIRS, F_PAIRS_HEAVY, F_PAIRS_PREV_HEAVY, F_PAIRS_BOTH_HEAVY = _AT["pairs"], _AT["pairs_heavy"], \
    _AT["pairs_prev_heavy"], _AT["pairs_both_heavy"]
F_RESP_HEAVY, F_RESP_DILUTED = _AT["responses_with_heavy"], _AT["responses_diluted"]
N_SUMS = len(SUM_FIELDS)

_SHIFT = np.int32(23 - sketch.MANTISSA_BITS)
_KEY_LO = np.int32(sketch._KEY_LO - 1)
_HALF = np.int32(sketch.HALF)
_E20_SQ = math.exp(20.0) * math.exp(20.0)
_EM20_SQ = math.exp(-20.0) * math.exp(-20.0)


@njit(nogil=True, cache=True)
def _sorted(sid, pos, check_pos):                           # pragma: no cover - compiled
    for i in range(1, sid.shape[0]):
        if sid[i] < sid[i - 1] or (check_pos and sid[i] == sid[i - 1] and pos[i] <= pos[i - 1]):
            return False
    return True


_LOG2E = 1.4426950408889634
# ln 2 split in two (fdlibm's ln2_hi has its low 32 bits zero, so k·ln2_hi is exact for |k| < 2²⁰)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_ROUND = 6755399441055744.0                      # 1.5·2⁵²: x + _ROUND holds round(x) in its low mantissa bits
_ROUND_BITS = int(np.float64(_ROUND).view(np.int64))


@njit(nogil=True, cache=True, fastmath={"contract"})
def _exp_into(delta, out, work):                            # pragma: no cover - compiled
    """``out[i] = exp(float64(delta[i]))`` to within 1 ulp of the C library's exp, in loops the compiler
    vectorises (the library call, one value at a time, was half the magnitude pass): exp(x) = 2ᵏ·exp(r) with
    k = round(x / ln 2), r = x − k·ln 2 (|r| ≤ ln 2 / 2) and exp(r) by its Taylor series to degree 13
    (truncation below 10⁻¹⁷).  exp(0) = 1 exactly.  Beyond ±700 nats (and NaN) the library exp is used, so
    overflow to inf and underflow behave as before.  ``work``: float64 scratch of the same length."""
    n = delta.shape[0]
    for i in range(n):
        x = np.float64(delta[i])
        x = x if x > -700.0 else -700.0
        x = x if x < 700.0 else 700.0
        t = x * _LOG2E + _ROUND
        k = t - _ROUND
        r = (x - k * _LN2_HI) - k * _LN2_LO
        p = 1.6059043836821613e-10
        p = p * r + 2.08767569878681e-09
        p = p * r + 2.505210838544172e-08
        p = p * r + 2.755731922398589e-07
        p = p * r + 2.7557319223985893e-06
        p = p * r + 2.48015873015873e-05
        p = p * r + 0.0001984126984126984
        p = p * r + 0.001388888888888889
        p = p * r + 0.008333333333333333
        p = p * r + 0.041666666666666664
        p = p * r + 0.16666666666666666
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        out[i] = p
        work[i] = t
    bits = work.view(np.int64)
    for i in range(n):
        bits[i] = (bits[i] - _ROUND_BITS + 1023) << 52       # 2ᵏ
    for i in range(n):
        out[i] *= work[i]
    for i in range(n):
        x = np.float64(delta[i])
        if not (-700.0 <= x <= 700.0):
            out[i] = math.exp(x)


@njit(nogil=True, cache=True, inline="always")
def _put(sums, written, field, value):                       # pragma: no cover - compiled
    sums[field] += value
    written[field] = True


#: The definitions of docs/metrics.md (:mod:`triage_monitor.metrics.definitions`) as numba functions inlined into
#: the compiled passes that call them: this module's, the segment cutter's (``segments``) and the C_tok null
#: sampler's (``offline.stages``).
segment_shift_nb = njit(inline="always")(segment_shift)
segment_number_nb = njit(inline="always")(segment_number)
is_tail_nb = njit(inline="always")(is_tail)
is_negative_response_nb = njit(inline="always")(is_negative_response)


@njit(nogil=True, cache=True, error_model="numpy")
def _kernel(delta, adv, sid, pos, n_samples, mode, tau, width, small_thr, heavy_frac, dil_thr,
            sums, written, sk, table, ext, rec_seg, rec_resp, rec_n):    # pragma: no cover - compiled
    N = delta.shape[0]
    bits = delta.view(np.int32)
    shift = segment_shift_nb(width)
    W1 = width + 1
    do_mag = mode & 1
    do_loc = mode & 2
    # totals
    t_small = 0
    t_sd = 0.0
    t_sad = 0.0
    t_k3 = 0.0
    t_e2 = 0.0
    t_lpd = 0.0
    t_absa = 0.0
    t_mass = np.zeros(4)
    t_cnt = np.zeros(4, np.int64)
    t_ln0 = 0.0
    t_ln1 = 0.0
    racc = np.zeros(9)
    ebuf = np.empty(N)
    work = np.empty(N)
    rcnt = np.zeros(9, np.int64)
    nonempty = 0
    l_valid = 0
    record = rec_seg.shape[0] > 0
    n_rec_seg = 0
    n_rec_resp = 0
    l_tail = 0
    l_seg = 0
    l_heavy = 0
    l_pairs = 0
    l_pairs_h = 0
    l_pairs_ph = 0
    l_pairs_bh = 0
    l_resp_h = 0
    l_dil = 0
    mn = math.inf
    mx = -math.inf
    i = 0
    while i < N:
        s = sid[i]
        j = i
        r_sd = 0.0
        r_pos = 0.0                 # Σ|A| of the response's A > 0 tokens
        r_neg = 0.0                 # Σ|A| of its A < 0 tokens
        if do_mag:
            r_sad = 0.0
            r_k3 = 0.0
            r_e2 = 0.0
            r_absa = 0.0
            r_small = 0
            for q in range(9):
                racc[q] = 0.0
                rcnt[q] = 0
            end = i
            while end < N and sid[end] == s:
                end += 1
            # exp(δ) of the response first, in vectorised loops of their own (still in cache for the main loop)
            _exp_into(delta[i:end], ebuf[i:end], work[i:end])
            while j < end:
                d32 = delta[j]
                d = np.float64(d32)
                a32 = adv[j]
                aa = abs(np.float64(a32))
                ad = abs(d)
                r_sd += d
                r_sad += ad
                r_absa += aa
                r_small += ad < small_thr
                e = ebuf[j]
                r_k3 += e - d - 1.0
                if d > 20.0:                                 # chi2_token clamps r = δ to ±20 before exp
                    r_e2 += _E20_SQ
                elif d < -20.0:
                    r_e2 += _EM20_SQ
                else:
                    r_e2 += e * e
                # quadrant key 3·sign(A) + sign(δ) + 4, as the torch path: 0 amp_neg, 8 amp_pos, 2 con_neg,
                # 6 con_pos; |A| mass and count per key (an index, not branches: δ's sign is unpredictable)
                q = 3 * ((a32 > 0) - (a32 < 0)) + (d32 > 0) - (d32 < 0) + 4
                racc[q] += aa
                rcnt[q] += 1
                mn = min(mn, d)
                mx = max(mx, d)
                u = bits[j]
                k = ((u & 0x7FFFFFFF) >> _SHIFT) - _KEY_LO
                if k < 0:
                    k = 0
                elif k > _HALF:
                    k = _HALF
                sg = u >> 31
                sk[(k ^ sg) - sg + _HALF] += 1.0
                j += 1
            nv = j - i
            inv = 1.0 / nv
            t_small += r_small
            t_sd += r_sd
            t_sad += r_sad
            t_k3 += r_k3
            t_e2 += r_e2
            t_absa += r_absa
            t_lpd -= r_sd / nv
            t_mass[0] += racc[0]
            t_mass[1] += racc[8]
            t_mass[2] += racc[2]
            t_mass[3] += racc[6]
            t_cnt[0] += rcnt[0]
            t_cnt[1] += rcnt[8]
            t_cnt[2] += rcnt[2]
            t_cnt[3] += rcnt[6]
            t_ln0 += racc[0] * inv
            t_ln1 += racc[8] * inv
            r_pos = racc[6] + racc[7] + racc[8]
            r_neg = racc[0] + racc[1] + racc[2]
        else:
            while j < N and sid[j] == s:
                a = np.float64(adv[j])
                r_sd += np.float64(delta[j])
                if a < 0.0:
                    r_neg -= a
                elif a > 0.0:
                    r_pos += a
                j += 1
            nv = j - i
        nonempty += 1
        if do_loc and is_negative_response_nb(r_pos, r_neg):          # an A < 0 response: its segments
            cur = np.int64(-1)
            num = cur
            prev = np.int64(-2)
            prev_heavy = False
            resp_heavy = False
            valid = 0
            tail = 0
            r_tail = 0
            seg0 = n_rec_seg
            for t in range(i, j + 1):
                if t < j:
                    p = pos[t]
                    num = segment_number_nb(p, width, shift)
                if t == j or num != cur:
                    if valid > 0:                   # close segment `cur`
                        heavy = tail > heavy_frac * valid
                        has_prev = prev == cur - 1
                        l_seg += 1
                        l_valid += valid
                        l_tail += tail
                        if heavy:
                            l_heavy += 1
                            resp_heavy = True
                        if has_prev:
                            l_pairs += 1
                            if heavy:
                                l_pairs_h += 1
                            if prev_heavy:
                                l_pairs_ph += 1
                                if heavy:
                                    l_pairs_bh += 1
                        table[valid * W1 + tail] += 1.0
                        r_tail += tail
                        if record:
                            rec_seg[n_rec_seg] = valid
                            n_rec_seg += 1
                        prev = cur
                        prev_heavy = heavy
                    if t == j:
                        break
                    cur = num
                    valid = 0
                    tail = 0
                valid += 1
                tail += is_tail_nb(adv[t], delta[t], tau)
            if record:
                if r_tail > 0:                      # a response the shuffle null can move tails in
                    rec_resp[n_rec_resp, 0] = n_rec_seg - seg0
                    rec_resp[n_rec_resp, 1] = r_tail
                    n_rec_resp += 1
                else:
                    n_rec_seg = seg0
            if resp_heavy:
                l_resp_h += 1
                if abs(r_sd / nv) < dil_thr:
                    l_dil += 1
        i = j
    if do_mag:
        _put(sums, written, F_N_TOKENS, N)
        _put(sums, written, F_N_RESPONSES_ALL, n_samples if n_samples >= 0 else nonempty)
        _put(sums, written, F_N_RESPONSES_NONEMPTY, nonempty)
        _put(sums, written, F_SMALL_GAP, t_small)
        _put(sums, written, F_DELTA_SUM, t_sd)
        _put(sums, written, F_DELTA_ABS_SUM, t_sad)
        _put(sums, written, F_K3_SUM, t_k3)
        _put(sums, written, F_EXP_R_SQ_SUM, t_e2)
        _put(sums, written, F_LOG_PPL_DIFF_SUM, t_lpd)
        _put(sums, written, F_ABS_ADV_SUM, t_absa)
        _put(sums, written, F_MASS_AMP_NEG, t_mass[0])
        _put(sums, written, F_MASS_AMP_POS, t_mass[1])
        _put(sums, written, F_MASS_CON_NEG, t_mass[2])
        _put(sums, written, F_MASS_CON_POS, t_mass[3])
        _put(sums, written, F_COUNT_AMP_NEG, t_cnt[0])
        _put(sums, written, F_COUNT_AMP_POS, t_cnt[1])
        _put(sums, written, F_COUNT_CON_NEG, t_cnt[2])
        _put(sums, written, F_COUNT_CON_POS, t_cnt[3])
        _put(sums, written, F_LENNORM_AMP_NEG, t_ln0)
        _put(sums, written, F_LENNORM_AMP_POS, t_ln1)
        if N > 0:
            ext[0] = min(ext[0], mn)
            ext[1] = max(ext[1], mx)
    if do_loc:
        _put(sums, written, F_NEG_VALID, l_valid)
        _put(sums, written, F_TAIL, l_tail)
        _put(sums, written, F_SEGMENTS, l_seg)
        _put(sums, written, F_HEAVY, l_heavy)
        _put(sums, written, F_PAIRS, l_pairs)
        _put(sums, written, F_PAIRS_HEAVY, l_pairs_h)
        _put(sums, written, F_PAIRS_PREV_HEAVY, l_pairs_ph)
        _put(sums, written, F_PAIRS_BOTH_HEAVY, l_pairs_bh)
        _put(sums, written, F_RESP_HEAVY, l_resp_h)
        _put(sums, written, F_RESP_DILUTED, l_dil)
    rec_n[0] = n_rec_seg
    rec_n[1] = n_rec_resp
    return OK


class NullInput(NamedTuple):
    """What the C_tok shuffle null of a window needs beyond its state (docs/metrics.md#shuffle_null), recorded
    by :func:`update_state` while it cuts the segments.

    Attributes:
        segment_valid: ``(M,)`` int32, valid tokens of each segment of every A<0 response holding at least one
            amplifying-tail token, response by response.
        response_segments: ``(R,)`` int32, segments of each such response.
        response_tails: ``(R,)`` int32, its amplifying-tail tokens.
    """

    segment_valid: np.ndarray
    response_segments: np.ndarray
    response_tails: np.ndarray

    @staticmethod
    def concat(parts: Sequence["NullInput"]) -> "NullInput":
        """The parts one after the other (the ranks of a step, the steps of a window); empty for no part."""
        cat = (lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32))
        return NullInput(cat([p.segment_valid for p in parts]), cat([p.response_segments for p in parts]),
                         cat([p.response_tails for p in parts]))


#: Tokens per piece: a batch is cut at the first response start at or after every multiple of this and the
#: pieces' float sums are added in piece order, so rounding does not grow with the batch and live and offline
#: updates of one batch add the same partial sums.
PIECE_TOKENS = 1 << 16


@njit(nogil=True, cache=True)
def _cuts(sid, step):                                        # pragma: no cover - compiled
    """Piece bounds: 0, the first response start at or after each multiple of ``step``, N."""
    N = sid.shape[0]
    out = [0]
    t = step
    i = step
    while i < N:
        while i < N and sid[i] == sid[i - 1]:
            i += 1
        if i < N:
            out.append(i)
        t = max(t + step, i + 1)
        i = t
    out.append(N)
    return np.array(out, dtype=np.int64)


def update_state(state: np.ndarray, slices: dict, delta: np.ndarray, advantage: np.ndarray,
                 sample: np.ndarray, position: np.ndarray, num_samples: int, *, mode: int, tau_tail: float,
                 width: int, small_gap_threshold: float, heavy_fraction: float, dilution_threshold: float,
                 null_input: Optional[list] = None) -> int:
    """Add one batch to a metric state vector in place, in one pass (docs/metrics.md#state).

    Args:
        state: ``(size,)`` float64, C-contiguous, laid out by ``slices`` (the ``sums``, ``delta_sketch``,
            ``c_tok_table``, ``delta_min``, ``delta_max`` fields of
            :func:`~triage_monitor.metrics.state_layout`; ``sums`` holds :data:`SUM_FIELDS` in order).
        delta: ``(N,)`` float32 δ (nats); advantage: ``(N,)`` float32.
        sample: ``(N,)`` int64 response id of each token; position: ``(N,)`` int64.  Rows must be ordered by
            (sample, position) with unique pairs; a response is a run of equal ids.
        num_samples: S, the responses of the batch (empty ones included: ``n_responses_all``); -1: the
            responses holding a token (a run of ids), as a recomputation from the records counts them.
        mode: :data:`MAGNITUDE`, :data:`LOCALISATION` or :data:`BOTH`.
        tau_tail: τ_tail (nats), compared with δ in float32; ignored without :data:`LOCALISATION`.
        width: segment width W (tokens).
        null_input: a list to which the batch's shuffle-null input is appended (with
            :data:`LOCALISATION`): a :class:`NullInput` of int32 arrays --
            the valid tokens of each segment of every A < 0 response holding a tail token, in order, and per
            such response its number of segments and of tail tokens (:func:`triage_monitor.offline.stages.shuffle_null_from_state`).

    Returns:
        :data:`OK`, or :data:`UNSORTED` (nothing added) when the rows are not in (sample, position) order
        or a pair repeats (with :data:`MAGNITUDE` alone, only the sample order is checked and ``position``
        is not read).

    Raises:
        AssertionError: a field of :data:`SUM_FIELDS` that the pass should write was not written (a field
            declared and forgotten in the kernel).
    """
    delta = np.ascontiguousarray(delta, dtype=np.float32)
    advantage = np.ascontiguousarray(advantage, dtype=np.float32)
    sample = np.ascontiguousarray(sample, dtype=np.int64)
    position = np.ascontiguousarray(position, dtype=np.int64)
    N = delta.shape[0]
    if N and not _sorted(sample, position, bool(mode & LOCALISATION)):
        return UNSORTED
    sums, sk, table = state[slices["sums"]], state[slices["delta_sketch"]], state[slices["c_tok_table"]]
    cuts = _cuts(sample, PIECE_TOKENS) if N else np.array([0, 0], dtype=np.int64)
    pieces = len(cuts) - 1
    partial = np.zeros((pieces, N_SUMS))                    # each piece's float sums, added in piece order
    written = np.zeros(N_SUMS, dtype=np.bool_)
    ext = np.tile(np.array([[state[slices["delta_min"]][0], state[slices["delta_max"]][0]]]), (pieces, 1))
    args = (int(mode), np.float32(tau_tail), int(width), float(small_gap_threshold), float(heavy_fraction),
            float(dilution_threshold))
    record = null_input is not None and bool(mode & LOCALISATION)
    rec_seg = np.empty(N if record else 0, dtype=np.int32)
    rec_resp = np.empty((N if record else 0, 2), dtype=np.int32)
    rec_n = np.zeros((pieces, 2), dtype=np.int64)
    for p in range(pieces):
        a, b = cuts[p], cuts[p + 1]
        _kernel(delta[a:b], advantage[a:b], sample[a:b], position[a:b],
                int(num_samples) if p == 0 else (0 if num_samples >= 0 else -1), *args,
                partial[p], written, sk, table, ext[p], rec_seg[a:b] if record else rec_seg,
                rec_resp[a:b] if record else rec_resp, rec_n[p])
    missing = [name for (name, part), w in zip(SUM_FIELD_PASSES, written) if part & mode and not w]
    assert not missing, f"state_kernel: declared state field(s) {missing} not written by the kernel"
    for p in range(pieces):
        sums += partial[p]
    state[slices["delta_min"]] = ext[:, 0].min()
    state[slices["delta_max"]] = ext[:, 1].max()
    if record:
        assert null_input is not None         # record implies it
        segs = [rec_seg[cuts[p]:cuts[p] + rec_n[p, 0]] for p in range(pieces)]
        resp = [rec_resp[cuts[p]:cuts[p] + rec_n[p, 1]] for p in range(pieces)]
        null_input.append(NullInput(np.concatenate(segs) if segs else np.zeros(0, np.int32),
                                    np.concatenate([r[:, 0] for r in resp]) if resp else np.zeros(0, np.int32),
                                    np.concatenate([r[:, 1] for r in resp]) if resp else np.zeros(0, np.int32)))
    return OK
