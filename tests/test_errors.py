"""One base for every error triage-monitor raises on purpose, exported at the top level; each error keeps the
base classes it had (``except ValueError`` callers keep working)."""

import subprocess
import sys

import pytest
import torch

import triage_monitor
from triage_monitor import TriageMonitorError, errors, exits
from triage_monitor.rundir import records
from triage_monitor.offline.analysis import RunDirError, open_run
from triage_monitor.batch import InvalidTokenError, TokenBatch


def test_every_error_derives_from_the_one_base_and_keeps_its_bases():
    assert triage_monitor.TriageMonitorError is errors.TriageMonitorError and "TriageMonitorError" in triage_monitor.__all__
    for cls in (errors.OutputError, errors.UnwritableOutputError, errors.RunConflictError, errors.RunLockedError,
                RunDirError, InvalidTokenError, exits.CommandError):
        assert issubclass(cls, TriageMonitorError), cls
    for cls in (errors.UnwritableOutputError, errors.RunConflictError, errors.RunLockedError):
        assert issubclass(cls, errors.OutputError)
    assert issubclass(RunDirError, ValueError) and issubclass(InvalidTokenError, ValueError)
    assert not issubclass(errors.OutputError, ValueError) and not issubclass(exits.CommandError, ValueError)
    # the writer's names are the same classes
    assert (records.OutputError, records.UnwritableOutputError, records.RunConflictError, records.RunLockedError) == (
        errors.OutputError, errors.UnwritableOutputError, errors.RunConflictError, errors.RunLockedError)


def test_one_except_catches_what_the_package_raises(tmp_path):
    with pytest.raises(TriageMonitorError):
        open_run(tmp_path / "missing")
    with pytest.raises(TriageMonitorError):
        TokenBatch.from_list([torch.tensor([float("nan")])], [torch.tensor([-1.0])], torch.tensor([1.0]))
    with pytest.raises(ValueError):                       # and the ValueError callers still catch these two
        open_run(tmp_path / "missing")


def test_importing_the_package_and_its_base_error_imports_no_third_party_package():
    code = ("import sys; from triage_monitor import TriageMonitorError; "
            "print(sorted(m for m in ('torch', 'numpy', 'pandas', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
