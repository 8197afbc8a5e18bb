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
