"""The fresh hostile pass of issue 39 (its "Not done until"): each break it found, fixed, with a test on real
processes and real files.  The commands run as processes of their own (``python -m triage_monitor``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

ROOT = Path(__file__).resolve().parents[1]


def _batch(step, B=4, T=24):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 10 * step)


def _cli(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "triage_monitor", *map(str, args)], cwd=ROOT, text=True,
                       capture_output=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout + p.stderr


def _run(d, steps=12, **cfg):
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2, roll_steps=4, **cfg)) as mon:
        for s in range(steps):
            mon.log_step(s, _batch(s))


def test_a_removed_token_block_is_named_as_missing_token_records(tmp_path):
    """A finished run one of whose token blocks was removed (steps 4-7: their steps rows count tokens, no token
    records remain): ``analyze``, ``alerts`` and ``report`` name the four steps on an ``incomplete records:`` line and
    exit 1 (before: ``analyze`` blamed 24 metrics without saying why and ``report`` exited 0).  A run written with
    ``record_tokens=False`` is not named."""
    d = tmp_path / "run"
    _run(d)
    (block,) = [f for f in (d / "tokens").iterdir() if f.name.startswith("steps-00000004-00000007-")]
    block.unlink()
    want = "4 step(s) have a steps row counting tokens but no token records (a token file removed or never written): " \
           "4, 5, 6, 7"
    for cmd in (["analyze"], ["alerts"], ["report", "-o", tmp_path / "r.html", "--draws", "9"]):
        code, out = _cli(cmd[0], d, *cmd[1:])
        assert code == 1 and want in out and "the records are complete" not in out, (cmd, out)
    steps_only = tmp_path / "steps-only"
    _run(steps_only, steps=4, record_tokens=False)
    code, out = _cli("alerts", steps_only)
    assert "no token records" not in out, out
