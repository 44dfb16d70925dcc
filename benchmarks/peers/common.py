"""What the peer installs and runs share: a venv built step by step, a child's whole session
stopped, the tail of a log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def run_install_steps(steps: list[list[str]], install_log: Path, what: str) -> None:
    """Run each command, all output to `install_log`; the first that fails raises with its tail."""
    with install_log.open("w") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"installing {what} failed (code {done.returncode}) at: "
                    f"{' '.join(step)}\n--- {install_log} ---\n{tail(install_log)}"
                )


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process's own session (it and anything it forked), then SIGKILL stragglers.

    Each child is started with start_new_session=True, so its process group holds exactly the
    processes it started (the workload's forked runners included) and nothing of ours.
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        # The store shuts uvicorn down cleanly on SIGTERM in about 3 s.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    # Even after the leader exits, a forked runner could linger in the group. (Linux hands out
    # pids in sequence, so the group id is not reused by a stranger in the meantime.)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
