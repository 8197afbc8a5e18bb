"""Shared pytest fixtures: real demo runs (the built-in GRPO job), produced once per session."""

from __future__ import annotations

import pytest


def _demo(tmp_path_factory, name: str, **overrides):
    from triage_monitor.demo import DemoConfig, run_demo

    # the demo's job (DemoConfig's defaults: the study's walk job) with an on-policy sampler: NVFP4 alone, so
    # the short run raises no alert (a stale sampler trips delta_q05_low within 10 steps, docs/study.md)
    cfg = dict(steps=30, sft_steps=300, eval_size=32, calibration_steps=5, window=10, seed=0, sampler_lag=0)
    cfg.update(overrides)
    out = tmp_path_factory.mktemp("runs") / name
    run_demo(DemoConfig(**cfg), out, quiet=True)
    return out


@pytest.fixture(scope="session")
def demo_run_dir(tmp_path_factory):
    """A short finished demo run (correction ``triage``, 30 steps, window 10): its run directory."""
    return _demo(tmp_path_factory, "demo-triage")


@pytest.fixture(scope="session")
def demo_run_dir_none(tmp_path_factory):
    """A second, shorter demo run with ``correction="none"`` (for overlays / comparisons)."""
    return _demo(tmp_path_factory, "demo-none", steps=20, correction="none", seed=1)


@pytest.fixture
def plain_main(monkeypatch):
    """For tests that spawn processes: spawned workers re-import ``__main__``, and another test (Streamlit's
    AppTest) may have left the dashboard script there, which must not run in a worker.  A bare ``__main__``
    module stands in for the test's."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))


@pytest.fixture(scope="session")
def side_env():
    """``side_env(name) -> Path`` of the python of the side environment ``.venv-fw/<name>`` (made by
    ``scripts/side_env.sh`` from ``scripts/install_frameworks.sh``), for tests that drive a second release of a
    framework in a subprocess.  Missing: a skip on a developer machine, a failure under ``CI=true``."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def get(name: str) -> Path:
        py = root / ".venv-fw" / name / "bin" / "python"
        if not py.exists():
            msg = f"side environment {name} missing: run scripts/install_frameworks.sh"
            if os.environ.get("CI") == "true":
                pytest.fail(msg)
            pytest.skip(msg)
        return py

    return get


# ----------------------------------------------------------------------------- no silent skips in CI
def _skip_allowlist():
    """``(pattern, reason)`` pairs of tests/skip_allowlist.txt: fnmatch patterns on the test's node id."""
    from pathlib import Path

    out = []
    for line in (Path(__file__).with_name("skip_allowlist.txt")).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pattern, _, reason = line.partition(" # ")
            out.append((pattern.strip(), reason.strip()))
    return out


def pytest_sessionfinish(session, exitstatus):
    """Under ``CI=true`` a skipped test fails the run unless tests/skip_allowlist.txt names it with a reason: a CI
    machine missing an install step must not go green without the tests that need it."""
    import fnmatch
    import os

    if os.environ.get("CI") != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    allow = _skip_allowlist()
    bad = []
    for rep in reporter.stats.get("skipped", []):
        nodeid = getattr(rep, "nodeid", "") or ""
        if not any(fnmatch.fnmatch(nodeid, p) for p, _ in allow):
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            bad.append(f"{nodeid or '<collection>'}: {reason}")
    if bad:
        reporter.write_line(f"CI=true: {len(bad)} test(s) skipped without an entry in tests/skip_allowlist.txt "
                            "(install what they need, or allow-list them with a reason):", red=True)
        for line in bad:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = 1


# ----------------------------------------------------------------------------- mutation runs
def _mutated_hooks_package():
    """Under mutmut (scripts/mutation.sh) the tests run in ``mutants/``, which holds the mutated ``triage_monitor``
    and ``hooks`` trees; the editable install maps ``triage_monitor.hooks`` to the unmutated ``hooks/``, so point
    the package at the mutated copy.  No effect outside a mutation run."""
    from pathlib import Path

    here = Path.cwd()
    if here.name != "mutants" or not (here / "hooks" / "worker_runtime.py").exists():
        return
    import triage_monitor

    if str(here) not in triage_monitor.__path__ and Path(triage_monitor.__file__).parent.parent == here:
        triage_monitor.__path__.append(str(here))


_mutated_hooks_package()


@pytest.fixture
def held_file():
    """``held_file(release, rows=2, nbytes=100) -> DeferredColumns``: a file of ``rows`` rows (column ``x`` =
    0 .. rows-1) that the writer thread builds only once the ``threading.Event`` ``release`` is set (at most
    10 s), so the writer stays busy with it meanwhile; ``release=None`` builds it at once.  ``nbytes`` is its
    size for the queue bound."""
    import numpy as np

    from triage_monitor.rundir.sink import DeferredColumns

    def make(release, rows: int = 2, nbytes: int = 100) -> DeferredColumns:
        return DeferredColumns(lambda: (release is None or release.wait(10)) and {"x": np.arange(rows)}, nbytes, rows)

    return make
