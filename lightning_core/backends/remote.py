"""`RemoteBackend`: the Backend protocol over a replica process's HTTP API (remote_server.py),
and `launch_replicas`, which starts the replica processes of `lightning-rl serve --replicas N`.

The tokenizer is loaded here, from the folder the replica loads its model from
(models.resolve_model), so the gateway renders and decodes with the very tokenizer whose ids the
replica consumes and produces: token ids stay exact across the process boundary.

A replica that cannot be reached (refused, reset, gone mid-answer) raises BackendUnavailable,
which ReplicatedBackend takes as "this replica is down, try another".
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from lightning_core.backends.base import (
    Choice,
    GenerationRequest,
    StreamDelta,
    check_stream_request,
)
from lightning_core.backends.remote_server import KEY_ENV
from lightning_core.errors import (
    BackendUnavailable,
    LightningError,
    error_from_answer,
    error_from_body,
)
from lightning_core.security.keys import bearer_header
from lightning_core.serving import process as serving

# Idle connections are dropped before the replica's keep-alive (remote_server.KEEPALIVE_S) runs
# out: reusing one the server is closing fails with "Server disconnected".
KEEPALIVE_S = 15.0
CONNECT_TIMEOUT_S = 10.0


class RemoteBackend:
    """A Backend served by a replica at `url`; `process`, when given, is stopped on close."""

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        api_key: str | None = None,
        process: subprocess.Popen | None = None,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.process = process
        self._headers = bearer_header(api_key)
        # Silence longer than this on one request (a stuck replica) counts as unreachable.
        self._timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S, pool=None)
        self._client: httpx.AsyncClient | None = None
        try:
            health = httpx.get(f"{self.url}/health", timeout=CONNECT_TIMEOUT_S).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise self._unreachable(exc) from exc
        self.base_model: str = health["base_model"]
        self.pid: int = health["pid"]
        self._adapters: set[str] = set(health["adapters"])

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, so that it belongs to the event loop that serves (uvicorn's).
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers={**self._headers, "content-type": "application/json"},
                timeout=self._timeout,
                # No cap: the replica batches whatever arrives; a cap here would only queue.
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
                ),
            )
        return self._client

    def _unreachable(self, exc: Exception) -> BackendUnavailable:
        return BackendUnavailable(f"cannot reach the policy replica at {self.url}: {exc!r}")

    def _error(self, status: int, payload: bytes) -> LightningError:
        return error_from_answer(status, payload, f"replica {self.url}", BackendUnavailable)

    async def _call(self, method: str, path: str, body: bytes | None = None) -> Any:
        try:
            response = await self._http().request(method, path, content=body)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise self._error(response.status_code, response.content)
        return orjson.loads(response.content)

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        data = await self._call("POST", "/generate", request.model_dump_json().encode())
        return [Choice.model_validate(c) for c in data]

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        check_stream_request(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        body = request.model_dump_json().encode()
        try:
            async with self._http().stream("POST", "/stream", content=body) as response:
                if response.status_code >= 400:
                    raise self._error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    data = orjson.loads(line)
                    if "error" in data:
                        raise error_from_body(data["error"])
                    delta = StreamDelta.model_validate(data)
                    yield delta
                    if delta.finish_reason is not None:
                        return
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        raise BackendUnavailable(f"the policy replica at {self.url} ended a stream unfinished")

    async def load_adapter(self, name: str, path: str) -> None:
        body = orjson.dumps({"path": str(path)})
        self._adapters = set(await self._call("PUT", f"/adapters/{name}", body))

    async def unload_adapter(self, name: str) -> None:
        self._adapters = set(await self._call("DELETE", f"/adapters/{name}"))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self.process is not None:
            await asyncio.to_thread(serving.stop_serve, self.process)


def replica_command(model: str | None, port: int, options: dict[str, Any]) -> list[str]:
    command = [sys.executable, "-m", "lightning_rl.flows.cli", "replica", "--port", str(port)]
    if model:
        command += ["--model", model]
    return [*command, "--backend-options", json.dumps(options)]


def launch_replicas(
    count: int, model: str | None, options: dict[str, Any], timeout_s: float = 600.0
) -> list[RemoteBackend]:
    """Start `count` transformers replicas of `model` (each with the backend `options`) on
    loopback and return their clients once all answer. They stop with the thread that started
    them (serving.die_with_parent), and when their client closes."""
    from transformers import AutoTokenizer

    from lightning_core.models import resolve_model

    # Here, once: a folder that is no model fails in one line, and the default model is
    # converted before N processes would wait on each other to do it.
    folder = resolve_model(model)
    key = secrets.token_urlsafe(32)
    env = {**os.environ, KEY_ENV: key}
    ports = serving.free_ports(count)
    procs = [
        serving.spawn(
            replica_command(model, port, options), f"replica{i}", serving.die_with_parent, env
        )
        for i, port in enumerate(ports)
    ]
    try:
        # They load at once; the first to answer has waited longest.
        for i, (proc, port) in enumerate(zip(procs, ports, strict=True)):
            serving.wait_healthy(proc, port, timeout_s, f"policy replica {i}", BackendUnavailable)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return [
            RemoteBackend(f"http://127.0.0.1:{port}", tokenizer, key, proc)
            for proc, port in zip(procs, ports, strict=True)
        ]
    except BaseException:
        for proc in procs:
            serving.stop_serve(proc)
        raise
