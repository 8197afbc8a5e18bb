"""The self-contained HTML post-mortem report (``triage-monitor report``)."""

from __future__ import annotations

import argparse
import re

import pytest

pytest.importorskip("plotly")

from triage_monitor.offline import report  # noqa: E402
from triage_monitor.commands import report as report_cmd  # noqa: E402
from triage_monitor.offline.analysis import open_run  # noqa: E402
from triage_monitor.monitor import MismatchMonitor  # noqa: E402
from triage_monitor.offline.stages import stage_table  # noqa: E402


def _parse(argv):
    return report_cmd.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_report_is_self_contained_with_charts_and_stage_table(demo_run_dir, demo_run_dir_none, tmp_path, capsys):
    out = tmp_path / "sub" / "report.html"
    assert report_cmd.run(_parse([str(demo_run_dir), str(demo_run_dir_none), "-o", str(out), "--draws", "99"])) == 0
    assert "self-contained" in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    # offline: no external script, stylesheet or font; plotly.js inlined exactly once
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)
    assert "@import" not in text          # (plotly.js mentions cdn.plot.ly only as the unused topojson default)
    assert len(re.findall(r"\* plotly\.js v\d", text)) == 1
    # the charts: 6 time-series panels, quadrants, localisation, the step time by phase of the subject and of the
    # two runs (the demo's own phase timings)
    assert text.count('class="plotly-graph-div"') == 10
    for title in ("Direction: ", "Small-gap share", "q0.05 of ", "k3 KL estimator", "Reward and accuracy",
                  "Quadrant masses (share of |A| mass)", "Localisation", "Step time and the full cycle",
                  "Mean step time by phase, the two runs"):          # (plotly JSON escapes non-ASCII)
        assert title in text
    assert "CPU figures" in text and "demo-none compared with demo-triage (the baseline)" in text
    assert "overlay of 2 runs" in text
    # the stage table, with the values of stages.stage_table
    body = text.split('<table class="stage-table">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", body.split("<tbody>", 1)[1])
    assert len(rows) == 4
    ref = stage_table(open_run(demo_run_dir), draws=99, seed=0)
    for row, (_, r) in zip(rows, ref.iterrows()):
        cells = re.findall(r"<td>(.*?)</td>", row)
        assert cells[0] == r["stage"] and cells[1] == str(r["step"])
        assert f"{100 * r['c_tok']:.2f}" in cells and f"{100 * r['c_tok_null_median']:.2f}" in cells
    for head in ("C_tok %", "null median %", "null 95% interval (%)", "excess (pts)", "dilution %", "ρ_asym"):
        assert f"<th>{head}</th>" in text
    assert "Overview" in text and "triage" in text and "Steps" in text


def test_report_options_and_errors(demo_run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert report_cmd.run(_parse([str(demo_run_dir), "-o", str(out), "--anchors", "4", "9", "--window", "3",
                                  "--draws", "19"])) == 0
    text = out.read_text(encoding="utf-8")
    assert "<td>step 4</td>" in text and "<td>2-4</td>" in text and "<td>7-9</td>" in text
    assert "3-step window" in text
    (tmp_path / "plain").mkdir()
    assert report_cmd.run(_parse([str(tmp_path / "plain"), "-o", str(tmp_path / "x.html")])) == 2
    assert "not a triage-monitor run directory" in capsys.readouterr().err
    MismatchMonitor(tmp_path / "empty").close()
    assert report_cmd.run(_parse([str(tmp_path / "empty"), "-o", str(tmp_path / "y.html")])) == 2
    assert "no recorded steps" in capsys.readouterr().err
    assert report_cmd.run(_parse([str(demo_run_dir), "-o", str(tmp_path / "z.html"), "--anchors", "999"])) == 2
    assert "not recorded" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "z.html").exists()
    (tmp_path / "afile").write_text("")
    assert report_cmd.run(_parse([str(demo_run_dir), "-o", str(tmp_path / "afile" / "r.html"), "--draws", "9"])) == 3
    err = capsys.readouterr().err
    assert "triage-monitor report: error: cannot write" in err and "afile" in err


def _short_responses_run(path, width: int):
    """8 steps of A<0 and A>0 responses 40 tokens long, with tail tokens, monitored with segment width ``width``."""
    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.metrics.stats import MetricConfig
    from triage_monitor.monitor import MonitorConfig

    g = torch.Generator().manual_seed(3)
    cfg = MonitorConfig(window=4, calibration_steps=2, metrics=MetricConfig(segment_width=width))
    with MismatchMonitor(path, cfg) as mon:
        for step in range(8):
            s = -torch.rand(8, 40, generator=g) * 3 - 0.01
            lp = (s + torch.randn(8, 40, generator=g) * 0.05 - (torch.rand(8, 40, generator=g) < 0.1) * 1.5).clamp(max=0)
            mon.log_step(step, TokenBatch.from_padded(lp, s, torch.linspace(-1, 1, 8), torch.ones(8, 40, dtype=torch.bool)))


def test_degenerate_shuffle_null_is_explained_not_shown_as_a_result(tmp_path):
    """Responses shorter than one segment: every A<0 response is one segment, so the shuffle null equals
    C_tok (excess exactly 0) and P_adj is NaN; the stage table says why, in the report too."""
    from triage_monitor.offline.stages import degenerate_notice

    _short_responses_run(tmp_path / "short", width=64)          # 40 tokens < W = 64
    table = stage_table(open_run(tmp_path / "short"), draws=49)
    assert table["max_segments"].tolist() == [1, 1, 1, 1]
    assert (table["c_tok_excess"] == 0).all() and table["p_adj"].isna().all()
    notice = degenerate_notice(table, 64)
    assert notice and "every stage" in notice and "W = 64" in notice
    html = report.build_report([tmp_path / "short"], draws=49)
    assert "Degenerate localisation in every stage" in html
    # the same responses cut in 8-token segments: a real null, no notice
    _short_responses_run(tmp_path / "cut", width=8)
    table = stage_table(open_run(tmp_path / "cut"), draws=49)
    assert table["max_segments"].tolist() == [5, 5, 5, 5] and degenerate_notice(table, 8) is None
    assert "Degenerate localisation" not in report.build_report([tmp_path / "cut"], draws=49)
