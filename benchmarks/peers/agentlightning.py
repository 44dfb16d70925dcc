"""Agent Lightning 0.3.0's store throughput on our workload, driven from our own environment.

Standard library only: Agent Lightning cannot share our virtual environment (it needs
OpenTelemetry 1.44, we run 1.45), so this module builds a separate one under a cache folder,
starts Agent Lightning's own store server (`agl store --backend memory`) in it, runs
`agentlightning_workload.py` against that server in the same environment, and hands back the
JSON figures that script writes. `benchmarks/store_throughput.py` calls `run_agentlightning`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers.common import run_install_steps, stop_group, tail

try:
    # Imported as benchmarks.peers.agentlightning: share the caller's WorkloadShape class.
    from ..workload import WorkloadShape
except ImportError:
    # Run as a script, or imported as a top-level `peers` package from inside benchmarks/.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from workload import WorkloadShape

AL_VERSION = "0.3.0"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "lightning-rl" / "peers"
WORKLOAD_SCRIPT = Path(__file__).resolve().parent / "agentlightning_workload.py"

# Agent Lightning's OTLP exporter sends no spans with OpenTelemetry 1.45 (it reads a private
# `_headers` attribute that 1.45 removed), so the whole family is pinned to 1.44 (PEERS.md).
OTEL_PINS = (
    "opentelemetry-api==1.44.0",
    "opentelemetry-sdk==1.44.0",
    "opentelemetry-exporter-otlp==1.44.0",
    "opentelemetry-exporter-otlp-proto-http==1.44.0",
    "opentelemetry-exporter-otlp-proto-grpc==1.44.0",
    "opentelemetry-instrumentation==0.65b0",
    "opentelemetry-semantic-conventions==0.65b0",
)
# Packages split out of the exporters in 1.45; left behind, they shadow the 1.44 modules.
OTEL_UNINSTALL = ("opentelemetry-exporter-otlp-common", "opentelemetry-exporter-http-transport")
REQUIREMENTS = (f"agentlightning=={AL_VERSION}", *OTEL_PINS)

# Written last, so a venv without it (install killed half-way) is rebuilt, not trusted. It holds
# the requirement list so that changing the pins above also forces a rebuild.
MARKER_NAME = ".lightning-rl-complete"


def venv_dir(cache_dir: Path | None = None) -> Path:
    """Where the Agent Lightning environment lives: `<cache_dir>/agentlightning-0.3.0`."""
    return (cache_dir or DEFAULT_CACHE_DIR) / f"agentlightning-{AL_VERSION}"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _marker_text() -> str:
    return "\n".join([*REQUIREMENTS, *(f"-{name}" for name in OTEL_UNINSTALL)]) + "\n"


def is_installed(cache_dir: Path | None = None) -> bool:
    """Whether a complete venv is there already (`ensure_venv` would not build one)."""
    venv = venv_dir(cache_dir)
    marker = venv / MARKER_NAME
    return marker.is_file() and marker.read_text() == _marker_text() and _venv_python(venv).exists()


def ensure_venv(cache_dir: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Create the Agent Lightning venv unless a complete one is there; return its python."""
    venv = venv_dir(cache_dir)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two benchmark runs starting at once must not build into the same folder together.
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_venv_locked(venv, log)


def _ensure_venv_locked(venv: Path, log: Callable[[str], None]) -> Path:
    marker = venv / MARKER_NAME
    python = _venv_python(venv)
    if is_installed(venv.parent):
        return python
    if venv.exists():
        log(f"agentlightning: removing incomplete or outdated venv {venv}")
        shutil.rmtree(venv)
    started = time.perf_counter()
    install_log = venv.parent / f"{venv.name}-install.log"
    log(f"agentlightning: creating venv {venv} (about a minute, about 800 MB; log {install_log})")
    # The base interpreter, not our venv's python, so the peer does not depend on our venv.
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    steps = [
        [base_python, "-m", "venv", str(venv)],
        # One resolve with the pins in it, so pip never installs 1.45 first and downgrades after.
        [*pip, "install", *REQUIREMENTS],
        [*pip, "uninstall", "-y", *OTEL_UNINSTALL],
    ]
    run_install_steps(steps, install_log, "Agent Lightning")
    marker.write_text(_marker_text())
    log(f"agentlightning: venv ready in {time.perf_counter() - started:.0f} s")
    return python


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Poll the store's health route until it answers 200; return the seconds it took."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"agl store exited with code {server.returncode} before healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"agl store not healthy at {url} after {timeout_s:.0f} s")


def _start(
    command: list[str], log_file: Path, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (so stop_group reaches all it forks), logging to a file."""
    with log_file.open("wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def run_agentlightning(
    shape: WorkloadShape,
    cache_dir: Path | None = None,
    port: int = 4748,
    log: Callable[[str], None] = print,
    *,
    poll_seconds: float = 0.5,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run the workload against Agent Lightning 0.3.0's store server; return its figures.

    Builds or reuses the peer venv (`<cache_dir>/agentlightning-0.3.0`, cache_dir defaulting
    to ~/.cache/lightning-rl/peers), starts `agl store --backend memory` on 127.0.0.1:`port`,
    runs `agentlightning_workload.py` with `shape` in that venv, and always stops the server.
    `poll_seconds` is the algorithm's poll interval (Agent Lightning's benchmark uses 5 s).
    Returns the workload's JSON: store, runners, rollouts, spans, seconds, rollouts_per_s,
    spans_per_s, add_span_p50_ms, add_span_p99_ms and some context keys.
    """
    python = ensure_venv(cache_dir, log)
    if not _port_is_free(port):
        raise RuntimeError(f"port {port} on 127.0.0.1 is in use; pass another port")
    # At PEERS.md's 20-odd rollouts/s a 2048-rollout run takes about 100 s; allow ample slack
    # for a slower machine before calling it hung.
    timeout = timeout_s if timeout_s is not None else 300 + shape.total_rollouts * 0.5
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    # Our own venv's variables must not leak into the peer's interpreter.
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    url = f"http://127.0.0.1:{port}"
    # Exactly PEERS.md's command; the in-memory backend keeps the comparison about the server.
    agl = str(python.parent / "agl")
    server_command = [
        agl, "store", "--host", "127.0.0.1", "--port", str(port), "--backend", "memory",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
        # Also the children's working folder: AgentOps writes an agentops.log into it.
        workdir = Path(tmp)
        server_log = workdir / "server.log"
        workload_log = workdir / "workload.log"
        out = workdir / "result.json"
        server: subprocess.Popen[bytes] | None = None
        try:
            server = _start(server_command, server_log, env, workdir)
            try:
                took = _wait_healthy(f"{url}/v1/agl/health", server, timeout_s=120)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n--- agl store log ---\n{tail(server_log)}") from exc
            log(f"agentlightning: store healthy at {url} after {took:.1f} s")
            command = [
                str(python),
                str(WORKLOAD_SCRIPT),
                "--store-url", url,
                "--total-rollouts", str(shape.total_rollouts),
                "--batch-size", str(shape.batch_size),
                "--max-rounds", str(shape.max_rounds),
                "--sleep-seconds", str(shape.sleep_seconds),
                "--runners", str(shape.runners),
                "--poll-seconds", str(poll_seconds),
                "--out", str(out),
            ]  # fmt: skip
            log(
                f"agentlightning: {shape.total_rollouts} rollouts, batch {shape.batch_size}, "
                f"{shape.runners} runners, up to {shape.max_rounds} rounds, "
                f"timeout {timeout:.0f} s"
            )
            workload = _start(command, workload_log, env, workdir)
            try:
                workload.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"agentlightning workload timed out after {timeout:.0f} s\n"
                    f"--- workload log ---\n{tail(workload_log)}"
                ) from None
            finally:
                # Runners are the workload's forked children: make sure none outlives it.
                stop_group(workload)
            if workload.returncode != 0 or not out.is_file():
                raise RuntimeError(
                    f"agentlightning workload failed with code {workload.returncode}\n"
                    f"--- workload log ---\n{tail(workload_log)}\n"
                    f"--- agl store log ---\n{tail(server_log, 15)}"
                )
            result: dict[str, Any] = json.loads(out.read_text())
        finally:
            if server is not None:
                stop_group(server)
    log(
        f"agentlightning: {result['rollouts_per_s']} rollouts/s, {result['spans_per_s']} spans/s, "
        f"add span p50 {result['add_span_p50_ms']} ms, p99 {result['add_span_p99_ms']} ms"
    )
    return result


if __name__ == "__main__":
    print(json.dumps(run_agentlightning(WorkloadShape()), indent=2))
