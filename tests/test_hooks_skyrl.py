"""SkyRL hook (skyrl 0.3.0, the oldest release it claims, and 0.4.0, the newest, from PyPI).

SkyRL 0.3.0 pins transformers ≤ 5.8 and ray 2.56, so it lives in the side environment ``.venv-fw/skyrl-0.3.0``;
0.4.0 needs Python ≥ 3.12 and ray 2.57: a Python 3.12 venv ``.venv-fw/skyrl-0.4.0`` (both made by
scripts/install_frameworks.sh).  ``tests/skyrl_checks.py`` holds the checks against SkyRL's own code and runs
in each in a subprocess: TRIAGE off = SkyRL's registered ``regular`` / ``dual_clip`` loss under all five loss
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

from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks.worker_runtime import HookSettings
from triage_monitor.hooks.skyrl import SkyRLTriageLoss, batch_from_skyrl

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]
CHECKS = 19          # tests in tests/skyrl_checks.py


@pytest.mark.parametrize("release, python", [("0.3.0", "3.11"), ("0.4.0", "3.12")])
def test_skyrl_real_code_paths(side_env, release, python):
    py = side_env(f"skyrl-{release}")
    probe = "import sys; from importlib.metadata import version; print(version('skyrl'), '%d.%d' % sys.version_info[:2])"
    assert subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True).stdout.split() == \
        [release, python]
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


def test_dp_metrics_have_the_same_keys_on_every_rank(tmp_path):
    """SkyRL all-reduces loss metrics key by key, so every rank must hand over the same keys: a rank's own NaN
    keeps its key, the alert state (rank 0's only) is rank 0's count × the DP size there and 0 elsewhere (SkyRL's
    mean is then rank 0's count), left out on every rank without rules; names ending in _loss are not handed over
    (SkyRL sums those)."""
    from triage_monitor.hooks.option_strings import dp_framework_metrics

    nan = float("nan")
    rank0 = {"step": 7, "window/rho_asym": 1.6, "rho_asym": 2.0, "gate_downweighted_frac": 0.25, "alerts_active": 2.0,
             "window/c_tok": nan, "n_tokens": 10.0}
    rank1 = {**rank0, "gate_downweighted_frac": nan, "alerts_active": nan}
    got = [dp_framework_metrics(m, "curated", r, 4, True) for r, m in ((0, rank0), (1, rank1))]
    assert list(got[0]) == list(got[1])                                  # same keys, same order
    assert got[0]["triage/alerts_active"] == 8.0 and got[1]["triage/alerts_active"] == 0.0
    assert (8.0 + 0.0 * 3) / 4 == rank0["alerts_active"]
    assert got[0]["triage/metrics_step"] == 7.0 and "triage/n_tokens" not in got[0]
    assert got[1]["triage/gate_downweighted_frac"] != got[1]["triage/gate_downweighted_frac"]     # NaN kept
    off = [dp_framework_metrics({**m, "alerts_active": nan}, "curated", r, 4, False) for r, m in ((0, rank0), (1, rank1))]
    assert "triage/alerts_active" not in off[0] and list(off[0]) == list(off[1])
    assert dp_framework_metrics(None, "curated", 0, 4, True) == {}
    fn = SkyRLTriageLoss(HookSettings(framework_keys="all"))
    assert fn.framework_report() == {}                                   # no run directory: nothing
    fn = SkyRLTriageLoss(HookSettings(run_dir=str(tmp_path / "run"), framework_keys="all", rank=0))
    fn.runtime.last_metrics = {"step": 3, "repair_loss": 0.1, "window/rho_asym": 1.2}
    assert fn.framework_report() == {"triage/window/rho_asym": 1.2, "triage/metrics_step": 3.0}
    fn.runtime.last_metrics = {"step": 4, "window/rho_asym": 1.3}        # same block of optimizer steps: frozen
    assert fn.framework_report()["triage/metrics_step"] == 3.0
    fn.close()
    from triage_monitor.hooks.skyrl import optimizer_steps_per_step
    from types import SimpleNamespace
    assert optimizer_steps_per_step(SimpleNamespace(train_batch_size=1024, policy_mini_batch_size=256,
                                                    update_epochs_per_batch=1)) == 4
    with pytest.raises(ValueError, match=r"positive integer \['update_epochs_per_batch'\]"):
        optimizer_steps_per_step(SimpleNamespace(train_batch_size=8, policy_mini_batch_size=4,
                                                 update_epochs_per_batch=0))


def test_global_token_normalization_is_refused_at_construction():
    """SkyRL sums the loss (its loss_reduction divides the advantages): the weights are renormalised per response,
    so a TriageConfig asking for the global token mean is refused where the loss is built, naming the setting."""
    with pytest.raises(ValueError, match=r"SkyRLTriageLoss: TriageConfig.normalization='global_token' cannot be "
                                         r"honoured: SkyRL sums the loss"):
        SkyRLTriageLoss(HookSettings(triage=TriageConfig(normalization="global_token")))
    SkyRLTriageLoss(HookSettings(triage=TriageConfig()))
    SkyRLTriageLoss(HookSettings())                                       # monitoring only: no controller


def test_call_site_gives_skyrls_global_step_and_the_optimizer_steps_of_the_step():
    """The loss call gets tensors only; SkyRL's batch metadata (global_step, the mini-batch boundaries) is read from
    the worker's frame above it: FSDP's ``_forward_backward_micro(self, experience)``, or a ``data`` local
    (``forward_backward(self, data)``) further up.  Steps of the SkyRL step = mini-batches × the worker's
    update_epochs_per_batch; nothing found: (None, None)."""
    from types import SimpleNamespace

    from triage_monitor.hooks.skyrl import skyrl_call_site

    worker = SimpleNamespace(cfg=SimpleNamespace(update_epochs_per_batch=2))

    def loss_fn():                                   # the loss: looks from its caller upwards
        return skyrl_call_site()

    def _forward_backward_micro(self, experience):
        return loss_fn()

    def forward_backward(self, data):
        micro = SimpleNamespace(metadata=None)       # a frame in between without the metadata
        return _forward_backward_micro(self, micro)

    meta = {"global_step": 7, "policy_mini_batch_boundaries": [(0, 4), (4, 8), (8, 12)], "response_length": 5}
    assert _forward_backward_micro(worker, SimpleNamespace(metadata=meta)) == (7, 6)
    assert forward_backward(worker, SimpleNamespace(metadata=meta)) == (7, 6)
    assert _forward_backward_micro(worker, SimpleNamespace(metadata={"global_step": 3})) == (3, None)
    assert _forward_backward_micro(object(), SimpleNamespace(metadata=meta)) == (7, None)   # no worker config
    assert _forward_backward_micro(worker, SimpleNamespace(metadata={"global_step": True})) == (None, None)
    assert loss_fn() == (None, None)
