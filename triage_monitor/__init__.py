"""triage-monitor: learner–sampler mismatch monitoring and TRIAGE loss weights for low-precision LLM RL.

Data flows one way: hooks → :class:`TokenBatch` → :class:`MismatchMonitor`
(metrics, Parquet records, alerts) and :class:`TriageController` (per-token
loss weights); offline, :mod:`triage_monitor.analysis` reads the run directory.
See SPEC.md for every term.
"""

__version__ = "0.1.0"

from .batch import InvalidTokenError, TokenBatch  # noqa: E402
from .controller import TriageConfig, TriageController  # noqa: E402
from .metrics import MetricConfig, MismatchStats  # noqa: E402
from .monitor import MismatchMonitor, MonitorConfig  # noqa: E402

__all__ = ["TokenBatch", "InvalidTokenError", "MismatchMonitor", "MonitorConfig", "MetricConfig", "MismatchStats",
           "TriageController", "TriageConfig", "__version__"]
