"""`lightning-rl serve` as a child process, for the demo, the benchmarks and the tests.

Started from this interpreter (so the child runs the same installation), waited for until its
/health answers, and stopped with SIGINT so that it closes the store cleanly.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from lightning_core.errors import StoreUnavailable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Run in the child before exec: SIGINT it when the process that started it dies, even by
    SIGKILL (Linux; elsewhere nothing). A policy server outliving a killed flow would keep its
    store file locked, and a resumed run could not open it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGINT)


def serve_command(db: str | Path, port: int, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_core.cli",
        "serve",
        "--db",
        str(db),
        "--port",
        str(port),
        *options,
    ]


def start_serve(
    db: str | Path,
    port: int,
    *options: str,
    timeout: float = 120.0,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen:
    """Start the server and return once it answers; its output goes to `proc.log_path`."""
    # A file, not a pipe: a pipe nobody reads would block the server once it filled up.
    with tempfile.NamedTemporaryFile(prefix="lightning-serve-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            serve_command(db, port, *options),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StoreUnavailable(f"lightning-rl serve exited ({proc.returncode}): {_tail(proc)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise StoreUnavailable(f"lightning-rl serve did not answer within {timeout} s: {_tail(proc)}")


def stop_serve(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGINT (a clean shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _tail(proc: subprocess.Popen, lines: int = 20) -> str:
    try:
        text = Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
