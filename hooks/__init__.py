"""Framework hooks, one thin module per framework (see docs/hooks.md).

``triage_monitor.hooks.trl`` (TriageGRPOTrainer), ``.verl`` (v1 trainers, registered policy
loss; ``.verl_plugin`` is the module verl imports), ``.openrlhf``, ``.skyrl``, ``.prime_rl``, ``.nemo_rl``, ``.slime``,
``.miles`` (MilesTriageLoss), ``.ms_swift`` (TriageSwiftGRPOTrainer, register).  Importing this package
imports no framework; each module imports its framework only where it needs it.
"""
