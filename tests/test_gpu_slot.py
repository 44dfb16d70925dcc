"""The `gpu` slot of a flow process that died holding it (issue 25, item 10): a flow SIGKILLed in
train-policy left the slot taken, and its resumed run waited for it with no message forever.

Each process here is a flow's process as `lightning-rl train` makes it: its own temporary Prefect
server (flows/prefect_server.py) on one PREFECT_HOME, a slot taken with lightning_rl/gpu_slot.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A flow's process: a temporary server, the gpu limit, then one slot taken for `wait_s` at most.
PROCESS = textwrap.dedent(
    """
    import sys, time
    from lightning_rl.flows.prefect_server import temporary_server
    from lightning_rl.gpu_slot import SlotUnavailable, ensure_gpu_limit, gpu_slot

    with temporary_server():
        ensure_gpu_limit()
        started = time.monotonic()
        try:
            with gpu_slot(wait_s=float(sys.argv[1])):
                print(f"held after {time.monotonic() - started:.1f} s", flush=True)
                if sys.argv[2] == "hold":
                    time.sleep(3600)
        except SlotUnavailable as exc:
            print(f"unavailable after {time.monotonic() - started:.1f} s: {exc}", flush=True)
    """
)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_", "PREFECT_"))}
    env["PREFECT_HOME"] = str(home)
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    return env


def _process(env: dict[str, str], wait_s: float, then: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(wait_s), then],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_a_dead_runs_gpu_slot_is_released_and_a_live_ones_bounds_the_wait(tmp_path):
    """A slot its holder still uses ends another run's wait after the bound, with the limit's
    name and the command that frees it; once its holder is SIGKILLed, the next run takes it at
    once, and the holder's temporary Prefect server has died with it."""
    env = _env(tmp_path / "prefect")
    holder = _process(env, 300, "hold")
    try:
        line = holder.stdout.readline()
        assert line.startswith("held"), line

        waiting = subprocess.run(
            [sys.executable, "-c", PROCESS, "3", "release"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert waiting.stdout.startswith("unavailable"), waiting.stdout + waiting.stderr[-2000:]
        assert "'gpu'" in waiting.stdout
        assert "`prefect gcl update gpu --active-slots 0`" in waiting.stdout

        # Its lease was renewed meanwhile (every 20 s), through its own server: one child.
        [server] = psutil.Process(holder.pid).children(recursive=True)
        assert "prefect.server.api.server:create_app" in server.cmdline()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert _gone(server.pid, within_s=30), "the temporary Prefect server outlived its flow"

        # The lease (60 s) has not run out: the slot is free because its holder is gone.
        resumed = subprocess.run(
            [sys.executable, "-c", PROCESS, "30", "release"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.stdout.startswith("held"), resumed.stdout + resumed.stderr[-2000:]
        assert float(resumed.stdout.split()[2]) < 20, resumed.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
