"""The temporary Prefect server a flow run from the command line talks to when no Prefect API is
configured: Prefect's own temporary server, started here so that it dies with its flow.

Prefect starts one itself (SubprocessASGIServer) and stops it at exit, which a SIGKILLed flow
never reaches: the server lived on, one more per killed run. Started here, the same command
with the same settings, it gets serving.die_with_parent, so the kernel stops it with the
process that started it. Its concurrency leases are kept in files under PREFECT_HOME rather
than in its memory, so that the next run's server still knows the leases a killed run held and
can release them (lightning_rl/gpu_slot.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from lightning_core.errors import LightningError
from lightning_core.serving import process as serving

# Prefect's lease storage that several servers on one PREFECT_HOME share.
FILE_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def _command(port: int) -> list[str]:
    # As SubprocessASGIServer runs it (prefect/server/api/server.py).
    return [
        sys.executable, "-m", "uvicorn",
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "error",
        "--lifespan", "on",
    ]  # fmt: skip


def _wait_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LightningError(
                f"the temporary Prefect server exited with code {process.returncode} while "
                "starting; run `prefect server start` and set PREFECT_API_URL to use your own"
            )
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.2)
    raise LightningError(
        f"the temporary Prefect server did not answer within {timeout_s:.0f} s; raise "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run `prefect server start` and set "
        "PREFECT_API_URL"
    )


def flush_to_server() -> None:
    """Send the flow's last logs and events while the server still runs. Left to Prefect's exit
    hooks, they went to the stopped server and retried for over a minute before the process
    could exit, ending with "--- Error logging to API ---"."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=10)


@contextlib.contextmanager
def temporary_server() -> Iterator[str | None]:
    """A temporary Prefect server for the block when no PREFECT_API_URL is set (yields its API
    URL), else nothing (yields None). Call it from the thread that runs the flow: the server
    is signalled when that thread ends."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        get_current_settings,
        temporary_settings,
    )

    settings = get_current_settings()
    if settings.api.url:
        yield None
        return
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        **settings.to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": FILE_LEASES,
    }
    process = subprocess.Popen(
        _command(port),
        env=env,
        stdin=subprocess.DEVNULL,
        preexec_fn=functools.partial(serving.die_with_parent, signal.SIGTERM),
    )
    try:
        _wait_healthy(process, url, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        # The environment too: a thread started without the flow's context (and a child
        # process) reads its settings from it, and would start a server of its own.
        os.environ["PREFECT_API_URL"] = url
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        flush_to_server()
        os.environ.pop("PREFECT_API_URL", None)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
