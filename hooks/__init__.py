"""Framework hooks, one thin module per framework (see docs/hooks.md).

``triage_monitor.hooks.trl`` (TriageGRPOTrainer), ``.verl`` (v1 trainers, registered policy
loss; ``.verl_plugin`` is the module verl imports), ``.openrlhf``, ``.skyrl``, ``.prime_rl``, ``.nemo_rl``, ``.slime``,
``.miles`` (MilesTriageLoss), ``.ms_swift`` (TriageSwiftGRPOTrainer, register).  Importing this package
imports no framework; each module imports its framework only where it needs it.
"""

__all__ = ["HookSettings"]


def __getattr__(name):
    """``from triage_monitor.hooks import HookSettings``: the hooks' settings, public here (imported on first use:
    importing the package stays light)."""
    if name == "HookSettings":
        from .worker_runtime import HookSettings

        return HookSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
