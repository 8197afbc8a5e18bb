"""ms-swift hook (ms-swift 4.6.0, the newest release, and 4.4.0, the oldest the hook claims: the first whose GRPO
loss call is ``_compute_loss_and_metrics(model, model_inputs, grpo_batch)``).

ms-swift pins trl < 1.0, peft < 0.21 and datasets < 4.8.5 (the main venv holds TRL 1.16), so it lives in the side
environments ``.venv-fw/ms-swift-4.6.0`` and ``.venv-fw/ms-swift-4.4.0`` (scripts/install_frameworks.sh);
``tests/swift_checks.py`` holds the checks against ms-swift's own code and runs there in a subprocess: the real
``swift rlhf`` GRPO job on CPU with the hook registered by a plugin, TRIAGE off = ms-swift's own loss and gradients
for every loss type and rollout importance-sampling mode, each mode reproduced by our corrections, ms-swift's metrics
kept beside ours, alerts and trackers, refusals.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]
CHECKS = 32          # tests in tests/swift_checks.py


@pytest.mark.parametrize("release", ["4.6.0", "4.4.0"])
def test_ms_swift_real_code_paths(side_env, release):
    py = side_env(f"ms-swift-{release}")
    env = {**os.environ, "TRIAGE_SWIFT_RELEASE": release}
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/swift_checks.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) == CHECKS and "skipped" not in proc.stdout, tail
