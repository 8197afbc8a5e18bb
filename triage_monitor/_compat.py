"""Import paths that moved into the layers' sub-packages, and the mount of the repository's ``hooks/`` and
``dashboards/``.

* :data:`MOVED`: every module path of release 0.1 that moved into a layer's sub-package.  ``import
  triage_monitor.analysis`` gives the module object of ``triage_monitor.offline.analysis`` itself (not a copy),
  so monkeypatching, pickles naming the old path and documented paths all keep working.
* A source checkout (the repository root on ``sys.path``, nothing installed): ``triage_monitor.hooks`` and
  ``triage_monitor.dashboards`` are the root's ``hooks/`` and ``dashboards/`` folders, as an install maps them
  (pyproject's package-dir).  Installed, the installer's own mapping is found first and this finder is not asked.
The standard library only: imported by ``triage_monitor/__init__.py`` at no cost.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_P = "triage_monitor."
#: old module path -> new module path
MOVED = {_P + old: _P + new for old, new in {
    "storage": "rundir.storage", "layout": "rundir.layout", "manifest": "rundir.manifest", "locks": "rundir.locks",
    "blocks": "rundir.blocks", "sink": "rundir.sink", "records": "rundir.records",
    "timings_writer": "rundir.timings_writer",
    "segments": "metrics.segments", "sketch": "metrics.sketch", "state_kernel": "metrics.state_kernel",
    "calibration": "metrics.calibration", "alignment": "metrics.alignment", "timings": "metrics.timings",
    "corrections": "triage.corrections", "controller": "triage.controller", "loss": "triage.loss",
    "alert_rules": "alerting.alert_rules", "outcome": "alerting.outcome", "references": "alerting.references",
    "alerts": "alerting.alerts", "trackers": "alerting.trackers", "wandb_logger": "alerting.wandb_logger",
    "tensorboard_logger": "alerting.tensorboard_logger", "mlflow_logger": "alerting.mlflow_logger",
    "engines": "offline.engines", "analysis": "offline.analysis", "stages": "offline.stages",
    "evaluation": "offline.evaluation", "verdict": "offline.verdict", "views": "offline.views",
    "report": "offline.report", "importers": "offline.importers",
    "nvfp4": "demo.nvfp4",
    "hooks._common": "hooks.micro_batches", "hooks._options": "hooks.option_strings",
    "hooks._framework_options": "hooks.loss_hook_options", "hooks._runtime": "hooks.worker_runtime",
    "hooks._hf_trainer": "hooks.trainer_mixin",
}.items()}
# ("metrics" is not here: triage_monitor.metrics is the metrics package, which forwards metrics.py's old names.)

_ROOT = Path(__file__).resolve().parent.parent
_MOUNTED = {_P + "hooks": _ROOT / "hooks", _P + "dashboards": _ROOT / "dashboards"}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)     # the module itself: its __name__ and __spec__ stay new

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))
        folder = _MOUNTED.get(fullname)
        if folder is not None and (folder / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        return None


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once): every other finder, an install's included, goes first."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def moved_attribute(name: str):
    """``triage_monitor.<old module>`` as an attribute of the package (``from triage_monitor import views``)."""
    target = MOVED.get(_P + name)
    return None if target is None else importlib.import_module(target)
