"""The metrics layer (docs/architecture.md): segments, the δ sketch, the one-pass state kernel, calibration, input
diagnostics, step timings, the metric declarations (names) and :class:`MismatchStats` (stats).

``triage_monitor.metrics`` was one module in release 0.1; its names are still read here (``from
triage_monitor.metrics import MismatchStats, METRIC_NAMES``), imported on first use so that importing a light
module of this package (``metrics.names``, ``metrics.timings``) imports neither torch nor numba.
"""


def __getattr__(name):
    import importlib

    stats = importlib.import_module(".stats", __name__)
    try:
        return getattr(stats, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
