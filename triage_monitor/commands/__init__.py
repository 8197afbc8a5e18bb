"""The ``triage-monitor`` sub-commands, one module each, with one convention: ``add_arguments(parser)`` declares
the options (importing nothing heavy, so ``--help`` is fast and works without optional extras) and
``run(args) -> int`` runs the command and returns its exit status (docs/cli.md#exit-statuses).
:mod:`triage_monitor.cli` wires them into one parser (:data:`COMMANDS`)."""

#: (command, module under triage_monitor.commands, help line)
COMMANDS = (
    ("demo", "demo", "run the built-in GRPO job (a stale NVFP4 sampler vs the learner) with monitoring"),
    ("study", "study", "run the built-in job's arms (none/tis/triage on a stale NVFP4 sampler, fp32-lag, the fp32 "
                       "control) x seeds and compare"),
    ("analyze", "analyze", "recompute every metric of a run from its token Parquet files"),
    ("cycle", "cycle", "where a run's step time goes, what a faster generator buys, two runs compared"),
    ("report", "report", "write a self-contained HTML post-mortem of a run"),
    ("dashboard", "dashboard", "start the Streamlit post-mortem dashboard on 127.0.0.1"),
    ("alerts", "alerts", "replay the alert rules over a finished run or a metrics CSV"),
    ("import", "import_", "turn a framework's dumped rollouts / a per-token table into a run directory"),
)
