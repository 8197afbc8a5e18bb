"""The mutation run (scripts/mutation.sh) covers every module that computes a number: a module left out of
``[tool.mutmut].only_mutate`` must be named below with the reason, so a new module cannot be left out silently."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.static

ROOT = Path(__file__).resolve().parents[1]

#: Modules outside the mutation selection, and why: none of them computes, stores or reports a number a user
#: reads, except state_kernel (numba).
NOT_MUTATED = {
    "__init__.py": "package marker (each package's; the top one's lazy table of public names)",
    "__main__.py": "python -m entry point",
    "_compat.py": "the table of release 0.1's import paths (tests/test_architecture.py and tests/test_compat_paths.py)",
    "cli.py": "argument parsing and exit statuses (tests/test_cli.py runs it in real processes)",
    "commands": "printing of what analysis, alerts and report compute",
    "config.py": "plain dataclasses of settings and their defaults (tests/test_constants_*.py pin each value)",
    "errors.py": "exception classes",
    "exits.py": "exit-status constants and the one-line error printer",
    "offline/engines.py": "where the work runs (process, pool, Ray): the numbers are analysis.py's",
    "rundir/manifest.py": "reading and validating run.json (tests/test_manifest.py)",
    "rundir/locks.py": "writer locks (tests/test_faults.py, real processes)",
    "alerting/references.py": "published constants, each pinned by tests/test_constants_metrics.py",
    "offline/report.py": "HTML assembly of views.py's figures",
    "metrics/definitions.py": "the segment number, tail token and A<0 response, compiled inline into the numba passes "
                              "(a mutmut trampoline cannot compile there, as for state_kernel); every caller's test checks "
                              "them bit for bit (tests/test_segments.py, test_state_kernel.py, test_stages.py)",
    "metrics/state_kernel.py": "compiled by numba (@njit): mutmut replaces each function by a Python trampoline that picks "
                       "the mutant at run time, which numba cannot compile, so no mutant of it could run; "
                       "tests/test_state_kernel.py checks it bit for bit against the torch path",
    "demo": "the built-in job (its runs are judged by tests/test_study.py)",
}


def test_every_module_that_computes_a_number_is_mutated():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    selected = {p.removeprefix("triage_monitor/") for p in cfg["only_mutate"] if p.startswith("triage_monitor/")
                and not p.startswith("triage_monitor/hooks/")}
    pkg = ROOT / "triage_monitor"
    modules = {("__init__.py" if p.name == "__init__.py" else p.relative_to(pkg).as_posix())
               for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}
    modules = {m for m in modules if m.split("/")[0] not in ("commands", "demo")} | {"commands", "demo"}
    for p in cfg["only_mutate"]:
        assert (ROOT / p.replace("triage_monitor/hooks/", "hooks/")).exists(), p
    unexplained = sorted(modules - selected - set(NOT_MUTATED))
    assert not unexplained, f"modules neither mutated nor excluded with a reason: {unexplained}"
    both = sorted(selected & set(NOT_MUTATED))
    assert not both, both
    for t in cfg["pytest_add_cli_args_test_selection"]:
        assert (ROOT / t).exists(), t


#: What the mutation run must cover besides the metric core (docs/testing.md#mutation-testing): the modules that
#: store a run's numbers and hand them to the trackers.
STORING_AND_REPORTING = ("rundir/storage.py", "rundir/layout.py", "rundir/timings_writer.py", "alerting/trackers.py",
                         "alerting/wandb_logger.py", "alerting/tensorboard_logger.py", "alerting/mlflow_logger.py")


def test_the_modules_that_store_and_report_numbers_are_mutated_with_their_tests():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    for m in STORING_AND_REPORTING:
        assert f"triage_monitor/{m}" in cfg["only_mutate"], m
    for t in ("tests/test_layout.py", "tests/test_object_store.py", "tests/test_trackers.py", "tests/test_wandb.py",
              "tests/test_atomic_write.py", "tests/test_sink.py", "tests/test_timings.py"):
        assert t in cfg["pytest_add_cli_args_test_selection"], t
    assert "numba" in NOT_MUTATED["metrics/state_kernel.py"]


def test_the_hooks_runtime_is_named_where_the_export_puts_it():
    """``only_mutate`` names ``triage_monitor/hooks/worker_runtime.py`` and ``frameworks.py`` (the frameworks' timer
    tables): the path in the export, where scripts/mutation.sh
    copies the repository's ``hooks/`` (the installed layout); the repository's file is ``hooks/worker_runtime.py``.  Both
    must hold, or the path is stale and the hooks' runtime silently gets no mutant."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    hooks = [p for p in cfg["only_mutate"] if p.startswith("triage_monitor/hooks/")]
    assert hooks == ["triage_monitor/hooks/worker_runtime.py", "triage_monitor/hooks/frameworks.py"]
    for p in hooks:
        assert (ROOT / "hooks" / p.removeprefix("triage_monitor/hooks/")).exists(), p
    assert not (ROOT / "triage_monitor" / "hooks").exists()       # only the export has it
    assert "cp -r hooks triage_monitor/hooks" in (ROOT / "scripts" / "mutation.sh").read_text()


def test_the_report_says_which_modules_and_tests_the_run_covered():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "scripts" / "mutation_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)                      # importable without mutmut: it is imported in main()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    text = "\n".join(report.coverage_lines(cfg, mutated={"triage_monitor.rundir.storage", "triage_monitor.metrics.stats"}))
    for p in cfg["only_mutate"]:
        assert p in text, p
    for t in cfg["pytest_add_cli_args_test_selection"]:
        assert t in text, t
    assert "not multiprocess" in text and "substitute" in text
    no_mutant = next(line for line in text.splitlines() if line.startswith("modules with no mutant"))
    assert "triage_monitor/rundir/layout.py" in no_mutant and "triage_monitor/rundir/storage.py" not in no_mutant
