"""What every flow command does first: quiet Prefect's console (the live view owns the
terminal), stop on SIGTERM as on Ctrl-C, and find the user's agent modules from the current
directory."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def interrupt_on_sigterm() -> None:
    """SIGTERM stops a run like Ctrl-C does: the policy server (a child process) is stopped
    on the way out instead of being left behind."""

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def agents_from_cwd() -> None:
    # `--agent mypkg.agent:run` names a module of the user's project, found relative to the
    # current directory as `lightning-rl runner` (and uvicorn) find theirs; the console script,
    # unlike `python -m`, does not put it on the path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def quiet_prefect() -> None:
    # The live view owns the terminal; Prefect's own log lines would tear it. Only the console
    # handler is raised to WARNING (logging.yml's handlers.console.level): the loggers stay at
    # INFO, so the API handler still sends the flow's INFO lines to Prefect (the UI).
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Prefect's temporary API server gets 20 s to start by default; on a busy 2-core machine it
    # took longer and the run died with a traceback before it began (seen here under load).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
