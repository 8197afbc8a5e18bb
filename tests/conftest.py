"""Shared pytest fixtures: real demo runs (the built-in GRPO job), produced once per session."""

from __future__ import annotations

import pytest


def _demo(tmp_path_factory, name: str, **overrides):
    from triage_monitor.demo import DemoConfig, run_demo

    cfg = dict(steps=30, sft_steps=300, eval_size=32, calibration_steps=5, window=10, seed=0)
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
