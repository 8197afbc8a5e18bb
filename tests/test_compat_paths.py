"""Release 0.1's flat module paths keep working after the move into sub-packages
(docs/architecture.md#the-tree-in-import-order): an old path is the moved module itself, and the hooks and
dashboards import from a source checkout with nothing installed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from triage_monitor._compat import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module_itself(old):
    if old.endswith("hooks._hf_trainer"):
        pytest.importorskip("transformers")
    new = MOVED[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert importlib.import_module(new).__name__ == new


def test_the_old_paths_read_in_the_docs_still_import():
    """The import lines docs/ and README show (old paths), a monkeypatch through an old path reaching the new
    module, and ``triage_monitor.<old>`` as an attribute of the package."""
    import triage_monitor
    from triage_monitor.alerts import AlertEngine, NOISE_FLOOR_NATS  # noqa: F401
    from triage_monitor.analysis import open_run  # noqa: F401
    from triage_monitor.metrics import METRIC_NAMES, MismatchStats  # noqa: F401
    from triage_monitor.stages import stage_table  # noqa: F401
    import triage_monitor.offline.analysis as new

    assert triage_monitor.analysis is new and triage_monitor.views is importlib.import_module("triage_monitor.offline.views")
    old = importlib.import_module("triage_monitor.analysis")
    keep = old.open_run
    try:
        old.open_run = "patched"
        assert new.open_run == "patched"
    finally:
        old.open_run = keep
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        triage_monitor.not_a_module  # noqa: B018


def test_hooks_and_dashboards_import_from_a_source_checkout_with_nothing_installed(tmp_path):
    """``python -S`` (no site-packages finder, so no editable install) with only the repository root and the
    dependencies on the path: ``triage_monitor.hooks.<framework>`` and ``triage_monitor.dashboards.launch`` are the
    repository's ``hooks/`` and ``dashboards/`` folders."""
    import sysconfig

    code = ("import sys; sys.path[:0] = [%r, %r]\n"
            "import triage_monitor.hooks.prime_rl as p, triage_monitor.dashboards.launch as d\n"
            "import triage_monitor.hooks._runtime as old, triage_monitor.hooks.worker_runtime as new\n"
            "assert old is new\n"
            "print(p.__file__); print(d.__file__)\n") % (str(ROOT), sysconfig.get_paths()["purelib"])
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert files == [str(ROOT / "hooks" / "prime_rl.py"), str(ROOT / "dashboards" / "launch.py")]
