"""Bad input (docs/reliability.md): every hazard has a clear outcome, checked with hand-made values.

Invalid values raise naming the field, sample and position, or are quarantined and counted in
alertable per-step metrics; padding leaks and one-position shifts are detected and reported;
bad shapes / dtypes / devices / masks raise naming the argument and the shapes.
"""

import logging
import math
import re
from pathlib import Path

import pytest
import torch

from triage_monitor.alerting.alerts import AlertEngine, CallbackSink, Rule, default_rules
from triage_monitor.metrics.alignment import check_alignment, padding_diagnostics
from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import InvalidTokenError, TokenBatch
from triage_monitor.metrics.stats import compute_step_metrics
from triage_monitor.monitor import INTEGRITY_METRICS, MismatchMonitor, MonitorConfig

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


def healthy(B=6, T=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(B, T, generator=g) * 3 - 0.05
    lp = (s + torch.randn(B, T, generator=g) * 0.02).clamp(max=-1e-4)
    return lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool)


# ------------------------------------------------------------------ invalid values: raise or quarantine
HAZARDS = [  # (field, value, reason, metric)
    ("learner_logp", NAN, "nonfinite_learner_logp", "nonfinite_count"),
    ("learner_logp", -INF, "nonfinite_learner_logp", "nonfinite_count"),     # zero-probability token
    ("sampler_logp", INF, "nonfinite_sampler_logp", "nonfinite_count"),
    ("sampler_logp", 0.5, "positive_sampler_logp", "positive_logp_count"),
    ("learner_logp", -1e10, "sentinel_learner_logp", "sentinel_logp_count"),
    ("sampler_logp", -9999.0, "sentinel_sampler_logp", "sentinel_logp_count"),
    ("advantages", NAN, "nonfinite_advantage", "nonfinite_advantage_count"),
]


def _poisoned(field, value, layout):
    """Row 3, position 5 (row 3's advantage for 'advantages') poisoned, in the given layout."""
    lp, s, a, m = healthy()
    t = {"learner_logp": lp, "sampler_logp": s, "advantages": a.clone()}
    if field == "advantages":
        t["advantages"][3] = value
    else:
        t[field][3, 5] = value
    if layout == "padded":
        return TokenBatch.from_padded, (t["learner_logp"], t["sampler_logp"], t["advantages"], m)
    if layout == "packed":
        cu = torch.arange(0, lp.numel() + 1, lp.shape[1])
        return TokenBatch.from_packed, (t["learner_logp"].reshape(-1), t["sampler_logp"].reshape(-1),
                                        t["advantages"], cu)
    return TokenBatch.from_list, (list(t["learner_logp"]), list(t["sampler_logp"]), t["advantages"])


@pytest.mark.parametrize("layout", ["padded", "packed", "list"])
@pytest.mark.parametrize("field,value,reason,metric", HAZARDS)
def test_invalid_value_raises_naming_field_sample_position(field, value, reason, metric, layout):
    make, args = _poisoned(field, value, layout)
    with pytest.raises(InvalidTokenError) as ei:
        make(*args)
    e = ei.value
    assert (e.field, e.sample, e.reason) == (field, 3, reason)
    if field == "advantages":                 # a per-response advantage poisons the whole response: first token
        assert e.position == 0 and e.count == 80
    else:
        assert e.position == 5 and e.count == 1
        assert e.value == value or (math.isnan(e.value) and math.isnan(value))
    assert f"{field}[sample=3, position={e.position}]" in str(e)


@pytest.mark.parametrize("field,value,reason,metric", HAZARDS)
def test_quarantine_counts_excludes_and_keeps_records(field, value, reason, metric, tmp_path):
    make, args = _poisoned(field, value, "padded")
    b = make(*args, on_invalid="quarantine")
    n_bad = 80 if field == "advantages" else 1
    assert b.quarantine_counts == {reason: n_bad} and b.num_tokens == 6 * 80 - n_bad
    # excluded from the metrics: equal to the clean batch with those tokens masked out
    lp, s, a, m = healthy()
    m = m.clone()
    if field == "advantages":
        m[3] = False
    else:
        m[3, 5] = False
    clean = compute_step_metrics(TokenBatch.from_padded(lp, s, a, m))
    assert compute_step_metrics(b).values["delta_mean"] == clean.values["delta_mean"]
    # counted per step under an alertable name, and visible in the quarantine records
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, calibration_steps=1)) as mon:
        out = mon.log_step(0, b)
    assert out[metric] == n_bad and out["quarantined_count"] == n_bad
    assert all(out[k] == 0 for k in ("nonfinite_count", "positive_logp_count", "sentinel_logp_count",
                                      "nonfinite_advantage_count") if k != metric)
    q = open_run(tmp_path / "run").quarantine()
    assert q["reason"].tolist() == [reason] * n_bad and set(q["sample_id"]) == {3}
    assert q["position"].tolist() == (list(range(80)) if field == "advantages" else [5])


def test_nonfinite_count_fires_the_shipped_alert_rule(tmp_path):
    fired = []
    make, args = _poisoned("learner_logp", NAN, "padded")
    with MismatchMonitor(tmp_path / "run", alerts=AlertEngine(default_rules(), [CallbackSink(fired.append)])) as mon:
        mon.log_step(0, TokenBatch.from_padded(*healthy()))
        assert not fired
        mon.log_step(1, make(*args, on_invalid="quarantine"))
    assert [a.rule for a in fired] == ["nonfinite_logp"]


def test_integrity_metrics_present_every_step_and_documented(tmp_path):
    with MismatchMonitor(tmp_path / "run", MonitorConfig(alignment_check_steps=2)) as mon:
        outs = [mon.log_step(s, TokenBatch.from_padded(*healthy(seed=s))) for s in range(3)]
    for out in outs:
        assert all(out[k] == 0 for k in INTEGRITY_METRICS), {k: out[k] for k in INTEGRITY_METRICS}
    assert [("alignment_suspect" in o) for o in outs] == [True, True, False]
    doc = (ROOT / "docs" / "reliability.md").read_text()
    for name in (*INTEGRITY_METRICS, "alignment_suspect", "alignment_shift", "alignment_ratio"):
        assert f"`{name}`" in doc, name


# ------------------------------------------------------------------ padding leaks
def test_zero_logp_on_one_side_is_counted_but_confident_tokens_are_not():
    lp, s, a, m = healthy()
    lp[0, 10] = 0.0                          # learner reads prob 1, sampler says ≈ -1.x: a pad value
    s[1, 20], lp[1, 20] = 0.0, -1e-6         # bf16 rounding of a confident token: both sides ≈ 0
    s[2, 30] = 0.0                           # sampler 0.0 against a real log-prob below -0.5
    lp[2, 30] = -2.0
    d = padding_diagnostics(TokenBatch.from_padded(lp, s, a, m))
    assert d["zero_logp_count"] == 2 and d["padding_run_count"] == 0


def test_padding_diagnostics_cpu_pass_equals_the_torch_form():
    """Agreement test: the compiled CPU pass and the torch form (run on accelerators) of padding_diagnostics, on
    random batches with planted zeros and trailing runs of both kinds and lengths around PADDING_MIN_RUN; the
    hand-worked cases around this test check the values themselves."""
    from triage_monitor.metrics.alignment import PADDING_MIN_RUN, ZERO_LOGP_GAP, _padding_diagnostics_torch

    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        B, T = 24, 50
        lp = -torch.rand(B, T, generator=g) * 3
        s = (lp - torch.randn(B, T, generator=g) * 0.1).clamp(max=-1e-3)
        m = torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)
        for b in range(B):
            n = int(m[b].sum())
            k = int(torch.randint(0, 8, (1,), generator=g))
            if k and n:
                kind = b % 4
                if kind == 0:
                    lp[b, n - k:n] = 0.0
                elif kind == 1:
                    s[b, n - k:n] = -11.5
                elif kind == 2:
                    lp[b, n - k:n], s[b, n - k:n] = 0.0, -1e-7
                else:
                    lp[b, int(torch.randint(0, n, (1,), generator=g))] = 0.0
        batch = TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), m)
        got = padding_diagnostics(batch)
        assert got == _padding_diagnostics_torch(batch, ZERO_LOGP_GAP, PADDING_MIN_RUN, 0.05), trial
        assert got["padding_run_count"] > 0 and got["zero_logp_count"] > 0


def test_trailing_padding_run_is_a_leak_but_a_confident_ending_is_not():
    lp, s, a, m = healthy()
    lp[0, -7:] = 0.0                         # learner padded with 0.0 inside the mask, sampler real
    s[1, -5:] = -11.5                        # sampler padded with log(1/V)
    lp[2, -6:], s[2, -6:] = 0.0, -1e-7       # confident ending on both sides: |δ| ≈ 0
    lp[3, -3:] = -0.25                       # a run of 3 < PADDING_MIN_RUN
    d = padding_diagnostics(TokenBatch.from_padded(lp, s, a, m))
    assert d["padding_run_count"] == 2 and d["padding_run_tokens"] == 7 + 5
    # masked-out padding is never read
    lp2, s2, a2, m2 = healthy()
    lp2[:, -10:], m2[:, -10:] = 0.0, False
    assert padding_diagnostics(TokenBatch.from_padded(lp2, s2, a2, m2)) == {
        "zero_logp_count": 0.0, "padding_run_count": 0.0, "padding_run_tokens": 0.0, "offset_response_count": 0.0}


def test_left_padding_without_positions_is_reported(tmp_path, caplog):
    lp, s, a, m = healthy(B=4, T=20)
    m[0, :5] = False                          # left-padded rows: valid tokens start at columns 5 and 2
    m[2, :2] = False
    d = padding_diagnostics(TokenBatch.from_padded(lp, s, a, m))
    assert d["offset_response_count"] == 2
    pos = (torch.arange(20)[None] - (~m).sum(1, keepdim=True)).clamp(min=0)
    assert padding_diagnostics(TokenBatch.from_padded(lp, s, a, m, positions=pos))["offset_response_count"] == 0
    caplog.set_level(logging.WARNING, "triage_monitor")
    with MismatchMonitor(tmp_path / "run") as mon:
        assert mon.log_step(0, TokenBatch.from_padded(lp, s, a, m))["offset_response_count"] == 2
        mon.log_step(1, TokenBatch.from_padded(lp, s, a, m))
    assert len([r for r in caplog.records if "position 0" in r.getMessage()]) == 1


def test_quarantined_first_token_and_masked_packed_start_are_not_left_padding(tmp_path, caplog):
    """A bad token quarantined at column 0 and packed responses that start with a masked span (a tool
    output or prompt masked inside a response-relative sequence) are not left padding: no count, no
    warning.  Real left padding in the same monitor still warns once."""
    caplog.set_level(logging.WARNING, "triage_monitor")
    lp, s, a, m = healthy(B=3, T=12)
    lp[1, 0] = float("nan")                   # quarantined at position 0: the response still starts there
    quarantined = TokenBatch.from_padded(lp, s, a, m, on_invalid="quarantine")
    assert quarantined.quarantine_counts and int(quarantined.position[quarantined.sample_index == 1].min()) == 1
    assert padding_diagnostics(quarantined)["offset_response_count"] == 0
    lens = [12, 12, 12]
    mask = torch.ones(36, dtype=torch.bool)
    mask[0:4] = False                         # response 0 starts with 4 masked tokens
    mask[24:26] = False                       # response 2 with 2
    packed = TokenBatch.from_packed(lp.reshape(-1), s.reshape(-1), a.reshape(-1).nan_to_num(0.0).clamp(-1, 1),
                                    torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), mask,
                                    on_invalid="quarantine")
    assert int(packed.position[packed.sample_index == 0].min()) == 4       # positions stay response-relative
    assert padding_diagnostics(packed)["offset_response_count"] == 0
    with MismatchMonitor(tmp_path / "run") as mon:
        assert mon.log_step(0, quarantined)["offset_response_count"] == 0
        assert mon.log_step(1, packed)["offset_response_count"] == 0
        assert not [r for r in caplog.records if "position 0" in r.getMessage()]
        m2 = m.clone()
        m2[0, :3] = False                     # genuine left padding, no positions=
        lp2 = lp.nan_to_num(-0.5)
        assert mon.log_step(2, TokenBatch.from_padded(lp2, s, a, m2))["offset_response_count"] == 1
    assert len([r for r in caplog.records if "position 0" in r.getMessage()]) == 1


def test_monitor_warns_once_about_padding_leaks(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "triage_monitor")
    with MismatchMonitor(tmp_path / "run") as mon:
        for step in range(3):
            lp, s, a, m = healthy(seed=step)
            lp[0, -8:] = 0.0
            out = mon.log_step(step, TokenBatch.from_padded(lp, s, a, m))
            assert out["padding_run_count"] == 1 and out["padding_run_tokens"] == 8
    assert len([r for r in caplog.records if "padding" in r.getMessage() and r.name == "triage_monitor"]) == 1
    assert len([r for r in caplog.records if "padding_leak" in r.getMessage()]) == 1       # the default rule, once


# ------------------------------------------------------------------ one-position shift
def _late(lp):   # learner_logp[t+1] holds what belongs to t
    return torch.cat([lp[:, :1], lp[:, :-1]], 1)


def _early(lp):  # learner_logp[t] holds what belongs to t+1
    return torch.cat([lp[:, 1:], lp[:, -1:]], 1)


def test_alignment_detects_both_directions_and_says_which_way():
    lp, s, a, m = healthy()
    ok = check_alignment(lp, s, m)
    assert not ok.suspect and ok.shift == 0 and ok.ratio > 10 and ok.pairs == 6 * 79
    # hand-checkable: mean |δ| of the aligned pairs over the same (t, t+1) pairs
    assert ok.aligned_abs_delta == pytest.approx(float((lp[:, :-1] - s[:, :-1]).double().abs().mean()), rel=1e-12)
    late = check_alignment(_late(lp), s, m)
    assert late.suspect and late.shift == 1 and late.ratio < 0.05
    assert late.learner_late_abs_delta == pytest.approx(ok.aligned_abs_delta, rel=1e-12)
    assert "shift learner_logp left by one" in late.message
    early = check_alignment(_early(lp), s, m)
    assert early.suspect and early.shift == -1 and "learner_logp sits one position early" in early.message
    # TokenBatch form and single-response 1-D form give the same verdict
    assert check_alignment(TokenBatch.from_padded(_late(lp), s, a, m)).shift == 1
    assert check_alignment(_late(lp)[0], s[0]).shift == 1


def test_alignment_pairs_respect_masks_and_responses():
    lp, s, a, m = healthy(B=2, T=40)
    m[:, 1::2] = False                        # no two valid tokens are adjacent: no pairs, no verdict
    r = check_alignment(_late(lp), s, m)
    assert r.pairs == 0 and not r.suspect and "no verdict" in r.message
    lp, s, a, m = healthy(B=40, T=1)           # one token per response: pairs never cross responses
    assert check_alignment(lp, s, m).pairs == 0


def test_alignment_ignores_invalid_values_and_rejects_bad_arguments():
    lp, s, a, m = healthy()
    lp = _late(lp)
    lp[0, 3] = NAN
    assert check_alignment(lp, s, m).shift == 1          # raw input with NaN: excluded, not raised
    with pytest.raises(ValueError, match="sampler_logp is required"):
        check_alignment(lp)
    with pytest.raises(ValueError, match=r"sampler_logp has shape \(6, 79\), but learner_logp has shape \(6, 80\)"):
        check_alignment(lp, s[:, 1:])


def test_monitor_runs_alignment_on_first_steps_and_warns_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "triage_monitor")
    with MismatchMonitor(tmp_path / "run", MonitorConfig(alignment_check_steps=3)) as mon:
        outs = []
        for step in range(5):
            lp, s, a, m = healthy(seed=step)
            outs.append(mon.log_step(step, TokenBatch.from_padded(_late(lp), s, a, m)))
    assert [o.get("alignment_suspect") for o in outs] == [1.0, 1.0, 1.0, None, None]
    assert outs[0]["alignment_shift"] == 1 and outs[0]["alignment_ratio"] < 0.05
    warns = [r.getMessage() for r in caplog.records if "alignment" in r.getMessage() and r.name == "triage_monitor"]
    assert len(warns) == 1 and "learner_logp sits one position late" in warns[0]
    assert len([r for r in caplog.records if "logp_shift" in r.getMessage()]) == 1         # the default rule, once
    assert warns[0].startswith("triage-monitor step 0: alignment: learner_logp sits one position late")   # step, report
    steps = open_run(tmp_path / "run").steps()
    assert steps["alignment_suspect"].tolist()[:3] == [1.0, 1.0, 1.0] and steps["alignment_suspect"][3:].isna().all()


def test_alignment_suspect_can_drive_an_alert(tmp_path):
    fired = []
    rule = Rule(name="logp_shift", metric="alignment_suspect", condition="above", threshold=0.5, level="ERROR")
    with MismatchMonitor(tmp_path / "run", alerts=AlertEngine([rule], [CallbackSink(fired.append)])) as mon:
        lp, s, a, m = healthy()
        mon.log_step(0, TokenBatch.from_padded(_early(lp), s, a, m))
    assert [f.rule for f in fired] == ["logp_shift"]


# ------------------------------------------------------------------ shapes, dtypes, devices, masks, empties
def _args():
    lp, s, a, m = healthy(B=2, T=3)
    return lp, s, a, m


@pytest.mark.parametrize("mutate,exc,pattern", [
    (lambda lp, s, a, m: (lp, s[:, :2], a, m), ValueError,
     r"sampler_logp has shape \(2, 2\), but learner_logp has shape \(2, 3\)"),
    (lambda lp, s, a, m: (lp, s, a, m.T), ValueError, r"mask has shape \(3, 2\), but learner_logp has shape \(2, 3\)"),
    (lambda lp, s, a, m: (lp, s, a[:1], m), ValueError, r"advantages must be \(2, 3\) per token or \(2,\) per sample, got \(1,\)"),
    (lambda lp, s, a, m: (lp.long(), s, a, m), TypeError, r"learner_logp must be a floating-point tensor .* torch.int64"),
    (lambda lp, s, a, m: (lp, s.int(), a, m), TypeError, r"sampler_logp must be a floating-point tensor .* torch.int32"),
    (lambda lp, s, a, m: (lp.numpy(), s, a, m), TypeError, r"learner_logp must be a torch.Tensor, got ndarray"),
    (lambda lp, s, a, m: (lp[0], s[0], a, m[0]), ValueError, r"learner_logp must be \(B, T\), got shape \(3,\)"),
    (lambda lp, s, a, m: (lp, s.to("meta"), a, m), ValueError, r"sampler_logp is on meta, but learner_logp is on cpu"),
    (lambda lp, s, a, m: (lp, s, a, m.float() * 2), ValueError, r"mask must be boolean-like \(0/1\), found 2.0 at index \(0, 0\)"),
    (lambda lp, s, a, m: (lp, s, a, m.to(torch.complex64)), TypeError, r"mask must be bool or 0/1 numeric"),
])
def test_padded_argument_errors_name_argument_and_shapes(mutate, exc, pattern):
    with pytest.raises(exc, match=pattern):
        TokenBatch.from_padded(*mutate(*_args()))


def test_packed_and_list_argument_errors():
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing from 0 to N_total=4"):
        TokenBatch.from_packed(-torch.ones(4), -torch.ones(4), torch.ones(4), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"sample 1: learner_logp shape \(3,\) and sampler_logp shape \(2,\)"):
        TokenBatch.from_list([-torch.ones(2), -torch.ones(3)], [-torch.ones(2), -torch.ones(2)], [1., 1.])
    with pytest.raises(ValueError, match=r"masks\[0\] has shape \(3,\), expected \(2,\)"):
        TokenBatch.from_list([-torch.ones(2)], [-torch.ones(2)], [1.], masks=[torch.ones(3)])
    with pytest.raises(ValueError, match=r"sample_ids must be unique within a step"):
        TokenBatch.from_padded(*_args(), sample_ids=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="on_invalid must be 'raise' or 'quarantine'"):
        TokenBatch.from_padded(*_args(), on_invalid="ignore")


def test_mixed_precision_paths_are_accepted():
    lp, s, a, m = _args()
    b = TokenBatch.from_padded(lp.bfloat16(), s.double(), a, m)      # learner bf16, sampler fp64: normal
    assert b.delta.dtype == torch.float32 and b.num_tokens == 6


def test_empty_batches_and_empty_responses_give_nan_with_reasons(tmp_path):
    lp, s, a, m = healthy(B=3, T=10)
    m[1] = False                                          # a response with no valid token
    empties = [TokenBatch.from_padded(lp[:0], s[:0], a[:0], m[:0]),
               TokenBatch.from_padded(lp, s, a, torch.zeros_like(m)),
               TokenBatch.from_list([], [], [])]
    with MismatchMonitor(tmp_path / "run") as mon:
        part = mon.log_step(0, TokenBatch.from_padded(lp, s, a, m))
        assert part["empty_response_count"] == 1 and part["n_samples"] == 2 and part["n_tokens"] == 20
        for step, b in enumerate(empties, 1):
            out = mon.log_step(step, b)
            assert out["n_tokens"] == 0 and math.isnan(out["delta_mean"]) and math.isnan(out["rho_asym"])
        assert out["empty_response_count"] == 0
    reasons = open_run(tmp_path / "run").steps().set_index("step").loc[2, "nan_reasons"]
    assert '"delta_mean": "no valid tokens"' in reasons


# ------------------------------------------------------------------ security
@pytest.mark.static
def test_nothing_is_unpickled_from_a_run_directory():
    """No arbitrary unpickling anywhere in the package (hooks and dashboards included): analysis reads Parquet and
    JSON; ranks exchange tensors (no all_gather_object); torch.load only with weights_only=True (tensors,
    containers, numbers)."""
    banned = re.compile(r"\bimport pickle|pickle\.loads?\(|all_gather_object\(|allow_pickle\s*=\s*True|"
                        r"read_pickle|joblib|weights_only\s*=\s*False")
    hits = []
    for p in [f for d in ("triage_monitor", "hooks", "dashboards") for f in (ROOT / d).rglob("*.py")]:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if banned.search(code) or ("torch.load(" in code and "weights_only=True" not in code):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, f"arbitrary unpickling (use torch.load(..., weights_only=True)): {hits}"


def test_dashboard_binds_localhost_by_default():
    dash = pytest.importorskip("triage_monitor.dashboards.launch")
    assert dash.DEFAULT_HOST == "127.0.0.1"
    cmd = dash.build_command([str(ROOT)])
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"


def test_analysis_skips_malformed_entries_in_a_run_directory(tmp_path):
    d = tmp_path / "run"
    with MismatchMonitor(d) as mon:
        mon.log_step(0, TokenBatch.from_padded(*healthy()))
    (d / "tokens" / "step=0" / "rank=x").mkdir(parents=True)
    (d / "tokens" / "step=7").write_text("not a directory")
    (d / "tokens" / "step-00000009-rank-0000-attempt-1.parquet").mkdir()       # a directory with a table file's name
    (d / "tokens" / "notes.txt").write_text("not a table file")
    run = open_run(d)
    assert run.step_numbers() == [0]


# ------------------------------------------------------------------ log_step: what the steps table cannot hold
def test_log_step_refuses_extras_and_steps_the_steps_table_cannot_hold(tmp_path):
    """Refused at the call, naming the key or the value (messages typed out here), with nothing recorded: a
    non-string ``extra`` key (it would become a column name: before this change ``{0: 1.0}`` was taken and every
    later steps file failed to write), an ``extra`` named like a bookkeeping column (it overwrote the writer's
    ``rank`` or was overwritten), a step outside int64 (its rows were dropped on the writer thread).  After the
    refusals the same monitor records every step, the largest int64 step (9223372036854775807) included, with
    nothing dropped."""
    import numpy as np

    d = tmp_path / "run"
    b = TokenBatch.from_padded(*healthy(B=2, T=8))
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2)) as mon:
        for key, shown in ((0, "0 (int)"), (1.5, "1.5 (float)"), (("a",), "('a',) (tuple)")):
            with pytest.raises(TypeError) as err:
                mon.log_step(0, b, extra={"reward": 1.0, key: 1.0})
            assert str(err.value) == f"extra key {shown} must be a string: it names a column of the steps table"
        for name in ("rank", "attempt", "wall_time", "nan_reasons"):
            with pytest.raises(ValueError) as err:
                mon.log_step(0, b, extra={name: 1.0})
            assert str(err.value) == (
                f"extra keys ['{name}'] are bookkeeping columns of the steps table (written by the monitor: attempt, "
                f"nan_reasons, rank, step, wall_time); rename them (e.g. 'user/{name}')")
        for step in (2 ** 63, np.uint64(2 ** 63), -2 ** 63 - 1, 10 ** 30):
            with pytest.raises(ValueError) as err:
                mon.log_step(step, b)
            assert str(err.value) == (f"step {int(step)} is outside the int64 range [-2**63, 2**63 - 1] of the steps "
                                      "table's step column")
        assert mon.steps_logged == 0 and not (d / "steps").exists() and mon.tracker.state_dict()["calib"] == []
        for s in range(3):
            mon.log_step(s, b, extra={"reward": float(s)})
        mon.log_step(9223372036854775807, b, extra={"reward": 9.0})
    steps = open_run(d).steps()
    assert steps["step"].tolist() == [0, 1, 2, 9223372036854775807] and steps["rank"].tolist() == [0] * 4
    assert steps["reward"].tolist() == [0.0, 1.0, 2.0, 9.0] and steps["writer_dropped_rows"].tolist() == [0.0] * 4
    assert open_run(d).manifest.writer == {"written_rows": 4 * (b.num_tokens + 1), "dropped_rows": 0,
                                           "last_error": None}
