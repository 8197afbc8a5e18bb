"""triage-monitor: learner–sampler mismatch monitoring and TRIAGE loss weights for low-precision LLM RL.

Data flows one way: hooks → :class:`TokenBatch` → :class:`MismatchMonitor`
(metrics, Parquet records, alerts) and :class:`TriageController` (per-token
loss weights); offline, :mod:`triage_monitor.offline.analysis` reads the run directory.
docs/metrics.md defines every term.
"""

__version__ = "0.1.0"

from . import _compat  # noqa: E402  (the standard library only: old module paths and the hooks/dashboards mount)
from .errors import TriageMonitorError  # noqa: E402  (the standard library only: costs nothing to import)

_compat.install()

# Public names, imported on first use (PEP 562): `import triage_monitor.analysis` (the dashboard's step-level
# path) then does not import torch.
_LAZY = {"TokenBatch": "batch", "InvalidTokenError": "batch", "TriageConfig": "triage.controller",
         "TriageController": "triage.controller", "MetricConfig": "config", "MismatchStats": "metrics.stats",
         "MismatchMonitor": "monitor", "MonitorConfig": "config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    moved = _compat.moved_attribute(name)
    if moved is not None:
        return moved
    raise AttributeError(f"module 'triage_monitor' has no attribute {name!r}")

__all__ = ["TokenBatch", "InvalidTokenError", "TriageMonitorError", "MismatchMonitor", "MonitorConfig", "MetricConfig", "MismatchStats",
           "TriageController", "TriageConfig", "__version__"]
