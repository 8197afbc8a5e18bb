"""The mutation run (scripts/mutation.sh) covers every module that computes a number: a module left out of
``[tool.mutmut].only_mutate`` must be named below with the reason, so a new module cannot be left out silently."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.static

ROOT = Path(__file__).resolve().parents[1]

#: Modules outside the mutation selection, and why: none of them computes a number a user reads.
NOT_MUTATED = {
    "__init__.py": "package marker",
    "__main__.py": "python -m entry point",
    "cli.py": "argument parsing and exit statuses (tests/test_cli.py runs it in real processes)",
    "commands": "printing of what analysis, alerts and report compute",
    "config.py": "plain dataclasses of settings and their defaults (tests/test_constants_*.py pin each value)",
    "errors.py": "exception classes",
    "exits.py": "exit-status constants and the one-line error printer",
    "engines.py": "where the work runs (process, pool, Ray): the numbers are analysis.py's",
    "layout.py": "file names of a run directory",
    "manifest.py": "reading and validating run.json (tests/test_manifest.py)",
    "locks.py": "writer locks (tests/test_faults.py, real processes)",
    "storage.py": "where the bytes go: pyarrow.fs calls and temporary-name renames (tests/test_atomic_write.py, tests/test_object_store.py against a real S3 server)",
    "references.py": "published constants, each pinned by tests/test_constants_metrics.py",
    "report.py": "HTML assembly of views.py's figures",
    "state_kernel.py": "compiled by numba: mutmut's trampolines cannot be compiled; tests/test_state_kernel.py "
                       "checks it bit for bit against the torch path",
    "trackers.py": "hands metrics to W&B / TensorBoard / MLflow",
    "timings_writer.py": "writes a driver's timer readings as rows (the mapping onto phases is timings.py's, "
                         "mutated; tests/test_timings.py reads the rows back)",
    "wandb_logger.py": "tracker adapter",
    "tensorboard_logger.py": "tracker adapter",
    "mlflow_logger.py": "tracker adapter",
    "demo": "the built-in job (its runs are judged by tests/test_study.py)",
}


def test_every_module_that_computes_a_number_is_mutated():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    selected = {Path(p).name for p in cfg["only_mutate"] if p.startswith("triage_monitor/")
                and not p.startswith("triage_monitor/hooks/")}
    modules = {p.name for p in (ROOT / "triage_monitor").iterdir()
               if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    for p in cfg["only_mutate"]:
        assert (ROOT / p.replace("triage_monitor/hooks/", "hooks/")).exists(), p
    unexplained = sorted(modules - selected - set(NOT_MUTATED))
    assert not unexplained, f"modules neither mutated nor excluded with a reason: {unexplained}"
    both = sorted(selected & set(NOT_MUTATED))
    assert not both, both
    for t in cfg["pytest_add_cli_args_test_selection"]:
        assert (ROOT / t).exists(), t
