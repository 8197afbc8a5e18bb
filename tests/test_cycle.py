"""The full-cycle breakdown on screen: ``triage-monitor cycle`` (one run, two runs, a framework's logged timers),
the report's section and the study's lines, on runs with hand-chosen phase times
(docs/metrics.md#step-time-and-the-full-cycle, docs/cli.md#cycle)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.cli import main
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step: int, gap: float) -> TokenBatch:
    g = torch.Generator().manual_seed(step)
    lp = -torch.rand(6, 24, generator=g) * 2 - 0.01
    return TokenBatch.from_padded(lp, (lp + gap * torch.randn(6, 24, generator=g)).clamp(max=-1e-4),
                                  torch.linspace(-1, 1, 6)[:, None].expand(6, 24), torch.ones(6, 24, dtype=torch.bool))


#: A BF16 baseline's step (seconds): generation 6.0 of 10.5, update 3.0, weight sync 0.5 (1.0 untimed).
BF16 = {"generation": 6.0, "update": 3.0, "weight_sync": 0.5, "step": 10.5}
#: The NVFP4 run of the same job: generation 2.4× faster (2.5 s), a new quantisation phase of 0.6 s, step 7.6.
NVFP4 = {"generation": 2.5, "update": 3.0, "weight_sync": 0.5, "quantize": 0.6, "step": 7.6}


def _run(path, times, gap, device="cuda:0", steps=6):
    with MismatchMonitor(path, MonitorConfig(window=3, calibration_steps=2), manifest={"device": device}) as mon:
        for s in range(steps):
            mon.log_step(s, _batch(s, gap), timings=times)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle")
    return _run(root / "bf16", BF16, 1e-3), _run(root / "nvfp4", NVFP4, 0.5)


def test_cycle_prints_the_breakdown_worked_out_by_hand(pair, capsys):
    assert main(["cycle", str(pair[0])]) == 0
    out = capsys.readouterr().out
    assert "g = 0.571" in out and "1.48×" in out and "CUDA figures" in out
    assert "update 28.6 %" in out and "untimed 9.5 %" in out and "weight sync 4.8 %" in out
    assert main(["cycle", str(pair[0]), "--k", "4"]) == 0            # 1 / (3/7 + 4/7/4) = 1.75
    assert "1.75×" in capsys.readouterr().out


def test_cycle_compares_two_runs_with_their_mismatch(pair, capsys):
    assert main(["cycle", str(pair[0]), "--compare", str(pair[1])]) == 0
    out = capsys.readouterr().out
    assert re.search(r"generation\s+│\s+6\s+│\s+2\.5\s+│\s+2\.4×", out)
    assert re.search(r"whole step\s+│\s+10\.5\s+│\s+7\.6\s+│\s+1\.38×", out)
    assert "quantisation / conversion" in out
    assert "measured whole-cycle speedup nvfp4 vs bf16: 1.38×; generation 2.40×" in out
    assert "measured generation speedup: 1.50×; at k = 2.3: 1.48×" in out
    assert "0.92× the projection" in out
    assert "mean |δ| (nats)" in out and "alerts raised" in out


def test_cycle_refuses_what_it_cannot_break_down(tmp_path, pair, capsys):
    with MismatchMonitor(tmp_path / "untimed", MonitorConfig()) as mon:
        mon.log_step(0, _batch(0, 0.1))
    assert main(["cycle", str(tmp_path / "untimed")]) == 2
    assert "no step has phase timings" in capsys.readouterr().err
    assert main(["cycle", str(pair[0]), "--k", "0"]) == 2
    assert "--k = 0.0" in capsys.readouterr().err
    assert main(["cycle", str(tmp_path / "nope")]) == 2
    assert main(["cycle", str(pair[0]), "--compare", str(tmp_path / "untimed")]) == 2
    assert "nothing to compare" in capsys.readouterr().err


def test_cycle_reads_a_frameworks_logged_timers(tmp_path, pair, capsys):
    """An export of OpenRLHF's logged status (its own timer names), one row per step: the same breakdown."""
    rows = [{"step": s, "timing/generation": 6.0, "timing/ppo_train": 3.0, "timing/broadcast": 0.5,
             "timing/step_total": 10.5, "policy_loss": 0.1} for s in range(5)]
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pd.DataFrame(rows).to_csv(tmp_path / "log.csv", index=False)
    for f in ("log.jsonl", "log.csv"):
        assert main(["cycle", str(pair[1]), "--timings", str(tmp_path / f), "--framework", "openrlhf"]) == 0
        out = capsys.readouterr().out
        assert "5 timed step(s), mean step 10.5 s" in out and "g = 0.571" in out and "1.48×" in out
    pd.DataFrame({"step": [0], "loss": [1.0]}).to_csv(tmp_path / "bad.csv", index=False)
    assert main(["cycle", str(pair[1]), "--timings", str(tmp_path / "bad.csv")]) == 2
    assert "no column of the timings table is a timer" in capsys.readouterr().err
    assert main(["cycle", str(pair[1]), "--timings", str(tmp_path / "log.txt")]) == 2


def test_the_report_shows_the_cycle_and_the_comparison(pair):
    pytest.importorskip("plotly")
    from triage_monitor.offline.report import build_report

    text = build_report(list(pair), draws=9)
    assert "Step time and the full cycle" in text and "generation share g = 0.571" in text
    assert "nvfp4 compared with bf16 (the baseline)" in text and "2.4×" in text
    assert "the measured cycle is 0.92× the projection" in text
    assert "Mean step time by phase, the two runs" in text and "CUDA figures" in text
    alone = build_report([pair[0]], draws=9, k=4.0)
    assert "1.75×" in alone and "compared with" not in alone


def test_the_study_says_its_step_time_in_cpu_figures():
    """The study's lines on two arms of hand-made step rows: fp32 (baseline) 0.2 s generation of 0.4 s, none 0.3 of
    0.5 with 0.01 s of quantisation: g 0.5 and 0.6, generation 0.67×, cycle 0.8×."""
    from triage_monitor.demo.grpo import DemoConfig
    from triage_monitor.demo.study import cycle_lines

    def rows(gen, step, q):
        return pd.DataFrame({"step": range(4), "time/generation": gen, "time/quantize": q, "time/update": 0.1,
                             "time/step": step})

    lines = cycle_lines(DemoConfig(), {("fp32", 0): rows(0.2, 0.4, 0.0), ("none", 0): rows(0.3, 0.5, 0.01)})
    assert lines[0].startswith("step time (CPU figures, measured on this machine")
    assert any(x.startswith("none: 500 ms a step, generation 300 ms (g = 0.60)") for x in lines)
    assert any(x.startswith("fp32: 400 ms a step, generation 200 ms (g = 0.50)") for x in lines)
    cmp = [x for x in lines if x.startswith("none (")][0]
    assert "generation 0.67×, whole cycle 0.80× measured" in cmp and "quantisation 10 ms" in cmp
