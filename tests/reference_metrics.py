"""An independent implementation of docs/metrics.md for tests: plain Python/numpy loops over responses and
segments, written from the document, with the documented constants as defaults.  It imports nothing from
triage_monitor, so a test comparing a product path with it is not an agreement test.

``responses`` everywhere is a list of ``(delta, position, advantage)``: δ of the response's valid tokens as
float64 (nats, the float32 values the product sees), their positions (int) and the response's A (mean advantage
of its valid tokens).
"""

from __future__ import annotations

import math

import numpy as np

W, SMALL_GAP, HEAVY, TOP, DILUTION = 64, 0.05, 0.10, 0.05, 0.05


def responses_from_tokens(df):
    """Token records (a pandas frame with ``sample_id``, ``position``, ``learner_logp``, ``sampler_logp``,
    ``advantage``, one row per valid token) → ``responses``; δ is the float32 difference of the float32 records."""
    out = []
    for _, g in df.sort_values(["sample_id", "position"]).groupby("sample_id", sort=True):
        d = (g["learner_logp"].to_numpy(np.float32) - g["sampler_logp"].to_numpy(np.float32)).astype(np.float64)
        out.append((d, g["position"].to_numpy(np.int64), float(g["advantage"].to_numpy(np.float64).mean())))
    return out


def reference_metrics(responses, tau, width=W, heavy=HEAVY, top=TOP, dilution=DILUTION, small=SMALL_GAP,
                      token_advantage=None):
    """docs/metrics.md#magnitude, #direction and #localisation, one token / segment / response at a time."""
    deltas = np.concatenate([d for d, _, _ in responses])
    advs = np.concatenate([np.full(len(d), a) for d, _, a in responses]) if token_advantage is None else \
        np.asarray(token_advantage, dtype=np.float64)
    n_tok = len(deltas)
    out = {"n_tokens": n_tok, "small_gap_share": float(np.sum(np.abs(deltas) < small)) / n_tok,
           "delta_mean": float(np.sum(deltas)) / n_tok, "delta_abs_mean": float(np.sum(np.abs(deltas))) / n_tok,
           "k3_kl": float(np.sum(np.exp(deltas) - deltas - 1)) / n_tok}
    mass = {"amp_neg": 0.0, "amp_pos": 0.0, "con_neg": 0.0, "con_pos": 0.0}
    for x, a in zip(deltas, advs):
        if a < 0 and x < 0:
            mass["amp_neg"] += abs(a)
        elif a > 0 and x > 0:
            mass["amp_pos"] += abs(a)
        elif a < 0 and x > 0:
            mass["con_neg"] += abs(a)
        elif a > 0 and x < 0:
            mass["con_pos"] += abs(a)
    out.update({f"mass_{k}": v for k, v in mass.items()})
    out["rho_asym"] = mass["amp_neg"] / mass["amp_pos"] if mass["amp_pos"] else math.nan
    if tau is None or math.isnan(tau):
        return out
    segs = []                                     # (response, k, valid, tail)
    neg_valid = tails = resp_heavy = resp_diluted = 0
    for r, (d, pos, a) in enumerate(responses):
        if not a < 0:
            continue
        neg_valid += len(d)
        by_k = {}
        for x, p in zip(d, pos):
            v, t = by_k.get(int(p) // width, (0, 0))
            by_k[int(p) // width] = (v + 1, t + (1 if x < tau else 0))
        any_heavy = False
        for k in sorted(by_k):
            v, t = by_k[k]
            segs.append((r, k, v, t))
            tails += t
            any_heavy |= t > heavy * v
        if any_heavy:
            resp_heavy += 1
            resp_diluted += abs(float(np.mean(d))) < dilution
    is_heavy = {(r, k): t > heavy * v for r, k, v, t in segs}
    K = len(segs)
    ranked = sorted(segs, key=lambda s: (-(s[3] / s[2]), -s[3]))
    pairs = [(is_heavy[(r, k - 1)], is_heavy[(r, k)]) for r, k, _, _ in segs if (r, k - 1) in is_heavy]
    prev_heavy = [cur for prev, cur in pairs if prev]
    any_cur = [cur for _, cur in pairs]
    out.update({
        "r_amp": tails / neg_valid if neg_valid else math.nan,
        "h_seg": sum(is_heavy.values()) / K if K else math.nan,
        "c_tok": sum(s[3] for s in ranked[:math.ceil(top * K)]) / tails if tails else math.nan,
        "p_adj": (np.mean(prev_heavy) / np.mean(any_cur)) if prev_heavy and any(any_cur) else math.nan,
        "dilution": resp_diluted / resp_heavy if resp_heavy else math.nan,
        "segments": K,
    })
    return out

# ------------------------------------------------------------------ the C_tok shuffle null, drawn exactly
# The exact law of docs/metrics.md#shuffle_null as a chain of hypergeometric draws over a
# triage_monitor.offline.stages.TailLayout: the reference the product's one sampler
# (stages.shuffle_null_from_state) is checked against (it lived in stages.py before the product kept one path).
from triage_monitor.offline.stages import TailLayout  # noqa: E402


def null_segment_counts(layout: TailLayout, draws: int = 499, seed: int = 0) -> np.ndarray:
    """Tail counts per segment under the shuffle null: ``(draws, K)`` int64.

    Each response keeps its valid positions and its number of tail tokens
    ``t_i``; the labels are placed uniformly at random among its ``n_i``
    valid positions (docs/metrics.md#shuffle_null).  Only the per-segment counts matter for
    C_tok, and those follow a multivariate hypergeometric law, drawn exactly
    as a chain of univariate hypergeometric draws: segment j of a response
    gets ``Hypergeom(tails left, tokens left - tails left, n_ij)``.  The loop
    runs over the segment ordinal j (at most max segments per response),
    vectorised over every response and draw; a fixed ``seed`` makes it
    reproducible.
    """
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    K = layout.num_segments
    counts = np.zeros((draws, K), dtype=np.int64)
    if K == 0:
        return counts
    _, resp = np.unique(layout.response, return_inverse=True)
    first = np.r_[0, np.flatnonzero(np.diff(resp)) + 1]                  # first segment of each response
    ordinal = np.arange(K) - first[resp]                                  # j: segment number inside the response
    tails_left = np.tile(np.bincount(resp, weights=layout.tail).astype(np.int64), (draws, 1))
    tokens_left = np.bincount(resp, weights=layout.valid).astype(np.int64)
    for j in range(int(ordinal.max()) + 1):
        seg = np.flatnonzero(ordinal == j)
        r = resp[seg]
        good = tails_left[:, r]
        x = rng.hypergeometric(good, tokens_left[r] - good, np.broadcast_to(layout.valid[seg], good.shape))
        counts[:, seg] = x
        tails_left[:, r] -= x
        tokens_left[r] -= layout.valid[seg]
    return counts


def shuffle_null_c_tok(layout: TailLayout, draws: int = 499, seed: int = 0, top_fraction: float = 0.05
                       ) -> np.ndarray:
    """C_tok under the shuffle null (docs/metrics.md#shuffle_null): ``(draws,)`` float64 in [0, 1].

    Tail counts per segment come from :func:`null_segment_counts`; each draw
    is ranked like :func:`~triage_monitor.metrics.stats.c_tok_from_segments`
    (tail fraction descending, ties by count) and the top
    ``ceil(top_fraction · K)`` segments' share of the tail tokens is kept.
    Returns NaN values when the layout has no tail token.
    """
    total = int(layout.tail.sum())
    K = layout.num_segments
    if total == 0 or K == 0:
        return np.full(draws, math.nan)
    keep = np.flatnonzero(np.bincount(layout.response, weights=layout.tail)[layout.response] > 0)
    sub = TailLayout(layout.response[keep], layout.valid[keep], layout.tail[keep])   # only these can hold tails
    counts = null_segment_counts(sub, draws, seed)
    # rank by tail fraction, ties by count (as c_tok_from_segments), in O(K) per draw: distinct
    # fractions a/b differ by >= 1/max_valid², so a count term < 0.5/max_valid² only breaks ties
    frac = counts / sub.valid
    key = frac + counts * (0.5 / (float(sub.valid.max()) ** 2 * (float(counts.max()) + 1.0)))
    top = min(math.ceil(top_fraction * K), sub.num_segments)
    best = np.argpartition(-key, top - 1, axis=1)[:, :top]
    return np.take_along_axis(counts, best, 1).sum(1) / total
