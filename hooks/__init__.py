"""Framework hooks, one thin module per framework (see docs/hooks.md).

``triage_monitor.hooks.trl`` (TriageGRPOTrainer), ``.verl`` (DataProto adapter, registered policy
loss), ``.openrlhf``, ``.skyrl``, ``.prime_rl``, ``.nemo_rl``, ``.slime``.  Importing this package
imports no framework; each module imports its framework only where it needs it.
"""
