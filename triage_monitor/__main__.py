"""``python -m triage_monitor`` is the ``triage-monitor`` command."""

import sys

from .cli import main

sys.exit(main())
