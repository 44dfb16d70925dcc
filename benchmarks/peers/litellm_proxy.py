"""LiteLLM's proxy as the gateway benchmark's peer: built in its own cached venv, run as a child.

LiteLLM cannot share our virtual environment (its proxy extra pins its own FastAPI, uvicorn and
OpenTelemetry stack), so `ensure_venv` builds `<cache_dir>/peers/litellm-<version>` once with
`litellm[proxy]` and `litellm_proxy` starts the proxy from there on 127.0.0.1, in front of an
OpenAI-compatible backend, with every callback and log it can drop turned off: the comparison
is about the work a proxy does per call, not about where it writes. `benchmarks/gateway.py`
uses both.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.peers.common import run_install_steps, stop_group, tail
from lightning_core.models import cache_dir

# PEERS.md measured 1.108. An exact pin, not a range: 1.107.0 was a compromised release, and
# from 1.108.9 on the proxy extra pins `.post` builds of litellm-enterprise / litellm-proxy-extras
# that the package index may lack (1.108.9 to 1.108.14 and 1.110.2 failed to resolve here).
LITELLM_VERSION = "1.108.4"
REQUIREMENTS = (f"litellm[proxy]=={LITELLM_VERSION}",)
# Written last, so a venv without it (install killed half-way) is rebuilt, not trusted. It holds
# the requirement list so that changing the pin also forces a rebuild.
MARKER_NAME = ".lightning-rl-complete"

# Without it litellm downloads its model cost map from the internet at import (PEERS.md).
PROXY_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOG": "ERROR",
    "PYTHONUNBUFFERED": "1",
}

# No master key, as our gateway checks none: this proxy listens on loopback for one run only,
# and the comparison is about forwarding a call, not authenticating it. LiteLLM refuses to start
# keyless unless told it is on purpose (dangerously_permit_weak_or_unset_master_key).
CONFIG_TEMPLATE = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {api_base}
      api_key: fake-key
litellm_settings:
  callbacks: []
  success_callback: []
  failure_callback: []
  turn_off_message_logging: true
  set_verbose: false
  telemetry: false
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
  dangerously_permit_weak_or_unset_master_key: true
"""


def venv_dir() -> Path:
    """Where the LiteLLM environment lives: `<cache_dir>/peers/litellm-<version>`."""
    return cache_dir() / "peers" / f"litellm-{LITELLM_VERSION}"


def is_installed(venv: Path | None = None) -> bool:
    """Whether a complete venv is there already (`ensure_venv` would not build one)."""
    venv = venv or venv_dir()
    marker = venv / MARKER_NAME
    return (
        marker.is_file()
        and marker.read_text() == _marker_text()
        and (venv / "bin" / "python").exists()
    )


def _marker_text() -> str:
    return "\n".join(REQUIREMENTS) + "\n"


def ensure_venv(log: Callable[[str], None] = print) -> tuple[Path, float | None]:
    """Create the LiteLLM venv unless a complete one is there.

    Returns the venv's python and the seconds the install took (None when it was cached).
    """
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two benchmark runs starting at once must not build into the same folder together.
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_venv_locked(venv, log)


def _ensure_venv_locked(venv: Path, log: Callable[[str], None]) -> tuple[Path, float | None]:
    marker = venv / MARKER_NAME
    python = venv / "bin" / "python"
    marker_text = _marker_text()
    if is_installed(venv):
        return python, None
    if venv.exists():
        log(f"litellm: removing incomplete or outdated venv {venv}")
        shutil.rmtree(venv)
    started = time.perf_counter()
    install_log = venv.parent / f"{venv.name}-install.log"
    log(f"litellm: creating venv {venv} (about a minute; log {install_log})")
    # The base interpreter, not our venv's python, so the peer does not depend on our venv.
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    steps = [
        [base_python, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "--disable-pip-version-check", "install", *REQUIREMENTS],
    ]
    run_install_steps(steps, install_log, "LiteLLM")
    marker.write_text(marker_text)
    seconds = time.perf_counter() - started
    log(f"litellm: venv ready in {seconds:.0f} s")
    return python, seconds


@contextlib.contextmanager
def litellm_proxy(
    python: Path,
    backend_url: str,
    model: str,
    port: int,
    preexec_fn: Callable[[], None] | None = None,
    timeout_s: float = 180.0,
) -> Iterator[str]:
    """Run LiteLLM's proxy on 127.0.0.1:`port`, routing `model` to `backend_url`/v1.

    Yields the proxy's base URL; always stops the proxy (and anything it forked) on exit.
    `preexec_fn` runs in the child before exec, e.g. to pin it to a core.
    """
    env = {**os.environ, **PROXY_ENV}
    # Our own venv's variables must not leak into the peer's interpreter.
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="litellm-bench-") as tmp:
        workdir = Path(tmp)
        config = workdir / "config.yaml"
        config.write_text(CONFIG_TEMPLATE.format(model=model, api_base=f"{backend_url}/v1"))
        server_log = workdir / "proxy.log"
        command = [
            str(python.parent / "litellm"),
            "--config", str(config),
            "--host", "127.0.0.1",
            "--port", str(port),
            # Newer releases default to one worker per CPU; the peer gets one, like our gateway.
            "--num_workers", "1",
        ]  # fmt: skip
        with server_log.open("wb") as out:
            proxy = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=workdir,
                preexec_fn=preexec_fn,
                # Its own session, so stop_group reaches every process it forks.
                start_new_session=True,
            )
        try:
            _wait_alive(f"http://127.0.0.1:{port}/health/liveliness", proxy, server_log, timeout_s)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_group(proxy)


def _wait_alive(url: str, proxy: subprocess.Popen, log_file: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proxy.poll() is not None:
            raise RuntimeError(
                f"litellm proxy exited with code {proxy.returncode}\n--- log ---\n{tail(log_file)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(
        f"litellm proxy not alive at {url} after {timeout_s:.0f} s\n{tail(log_file)}"
    )
