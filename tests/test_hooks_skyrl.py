"""SkyRL hook (skyrl 0.3.0 from PyPI).

SkyRL pins transformers ≤ 5.8 and ray 2.56, so it lives in the side environment ``.venv-fw/skyrl-0.3.0``
(scripts/install_frameworks.sh); ``tests/skyrl_checks.py`` holds the checks against SkyRL's own code and runs
there in a subprocess: TRIAGE off = SkyRL's registered ``regular`` / ``dual_clip`` loss under all five loss
reductions, left-padded positions, SkyRL's off-policy correction and metrics, construction errors, and the
registry shipping the loss into two real ``PolicyWorkerBase`` workers of a local Ray cluster.  The checks here
need no SkyRL.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import cloudpickle
import pytest
import torch

from triage_monitor.controller import TriageConfig
from triage_monitor.hooks._runtime import HookSettings
from triage_monitor.hooks.skyrl import SkyRLTriageLoss, batch_from_skyrl

ROOT = Path(__file__).resolve().parents[1]
CHECKS = 15          # tests in tests/skyrl_checks.py


def test_skyrl_0_3_0_real_code_paths(side_env):
    py = side_env("skyrl-0.3.0")
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/skyrl_checks.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) == CHECKS and "skipped" not in proc.stdout, tail


def test_right_aligned_rows_count_positions_from_the_response_start():
    # SkyRL's layout: response i occupies the last len_i columns; column 4 of row 0 is a tool token (mask 0)
    lp = torch.tensor([[0.0, 0.0, -1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    b = batch_from_skyrl(lp, lp.clone(), torch.ones(2, 6), mask)
    assert b.position.tolist() == [0, 1, 3, 0, 1, 2, 3, 4, 5]
    assert b.learner_logp.tolist() == [-1.0, -2.0, -4.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]


def test_loss_object_pickles_as_configuration():
    fn = SkyRLTriageLoss(HookSettings(triage=TriageConfig()), base="dual_clip")
    assert fn.controller is not None                  # live controller (and its runtime's locks) in this process
    data = cloudpickle.dumps(fn)
    assert b"TriageController" not in data and b"RLock" not in data
    copy = cloudpickle.loads(data)
    assert copy.base == "dual_clip" and copy.runtime is fn.runtime
    fn.close()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="base must be one of"):
        SkyRLTriageLoss(base="cispo")
    with pytest.raises(ValueError, match="generator.sampling_params.logprobs"):
        batch_from_skyrl(torch.zeros(1, 2), None, torch.zeros(1, 2), torch.ones(1, 2))
