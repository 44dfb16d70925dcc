"""`VLLMBackend`: the Backend protocol over a vLLM server's HTTP API, launched or attached."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

from lightning_core.backends.base import (
    Choice,
    GenerationRequest,
    StreamDelta,
    check_stream_request,
)
from lightning_core.backends.text import IncrementalText
from lightning_core.backends.vllm_backend.completions import (
    finish_reason,
    parse_tokens,
    request_body,
    stopped_on_string,
)
from lightning_core.backends.vllm_backend.config import VLLMBackendConfig, VLLMUnavailable
from lightning_core.backends.vllm_backend.server import VLLMServer
from lightning_core.errors import InvalidInput, LightningError, NotFound
from lightning_core.models import resolve_model
from lightning_core.security.adapter_folder import WEIGHTS_FILE
from lightning_core.security.keys import bearer_header
from lightning_core.security.redaction import redact_url

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# How often a launched server is checked for having died: its restart (30 s and more) dwarfs it.
_WATCH_INTERVAL_S = 1.0
# How long a request cut off by a dying server waits to see the process exit.
_EXIT_GRACE_S = 2.0


class VLLMBackend:
    """A `Backend` served by vLLM. `await start()` (or `async with`) before use.

    `VLLMBackend(config, **overrides)`: overrides are config fields (`url=...`).
    """

    def __init__(self, config: VLLMBackendConfig | None = None, **overrides: Any) -> None:
        base = config.model_dump() if config is not None else {}
        self.config = VLLMBackendConfig.model_validate({**base, **overrides})
        self.model_dir = Path(resolve_model(self.config.model))
        if not (self.model_dir / "config.json").is_file():
            raise InvalidInput(
                f"{self.config.model!r} is not a local model folder; the vLLM backend needs one "
                "(it loads the tokenizer here and the hub is unreachable)"
            )
        self.base_model = self.config.served_model_name or self.model_dir.name
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # An OpenAI base URL often ends in /v1; the paths below carry it themselves.
        self.url = (self.config.url or "").rstrip("/").removesuffix("/v1")
        self._server: VLLMServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._scratch: Path | None = None
        self._adapters: dict[str, str] = {}  # name -> folder as the caller gave it
        self._snapshots: dict[str, Path] = {}  # name -> private copy vLLM reads
        self._adapter_lock = asyncio.Lock()
        # Supervision of a launched server: restarted when it dies (see _restart).
        self.restarts = 0
        self._watcher: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._gave_up: str | None = None

    @classmethod
    def from_config(cls, config: VLLMBackendConfig) -> VLLMBackend:
        return cls(config)

    @property
    def log_path(self) -> Path | None:
        """The launched server's log (None when attached)."""
        return self._server.log_path if self._server is not None else None

    @property
    def server_key(self) -> str | None:
        """The launched server's key (None when attached): what another client of it needs."""
        return self._server.api_key if self._server is not None else None

    @property
    def server_pid(self) -> int | None:
        """The process id of the launched server's API process (None when attached)."""
        return self._server.pid if self._server is not None else None

    # ---- lifecycle

    async def start(self) -> VLLMBackend:
        self._scratch = Path(tempfile.mkdtemp(prefix="lightning-vllm-"))
        try:
            if self.config.url is None:
                self._server = VLLMServer(
                    self.config, self.model_dir, self.base_model, self._scratch
                )
                await self._server.start()
                self.url = self._server.url
            key = self._server.api_key if self._server is not None else self.config.secret_key()
            self._session = aiohttp.ClientSession(
                # The server's key on every request (server.py says why).
                headers=bearer_header(key),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=10, sock_read=self.config.request_timeout_s
                ),
                # No client-side cap: vLLM queues and batches; a cap here would only serialize.
                # Idle connections close before the server's own keep-alive (uvicorn's 5 s)
                # does: a request sent on one the server has just closed fails with "Server
                # disconnected" (seen in CI between two tests).
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                read_bufsize=1 << 20,
            )
            if self.config.url is not None:
                await self._attach()
            else:
                self._watcher = asyncio.create_task(self._watch())
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> VLLMBackend:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._watcher, self._restarting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, LightningError):
                    await task
        self._watcher = self._restarting = None
        if self._server is None and self._session is not None:
            # An attached server outlives us, but the snapshots it reads our adapters from are
            # about to be deleted.
            for name in list(self._snapshots):
                with contextlib.suppress(LightningError):
                    await self._unload(name)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._server is not None:
            await self._server.stop()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    async def _attach(self) -> None:
        models = (await self._request("GET", "/v1/models"))["data"]
        names = [m["id"] for m in models]
        if self.base_model not in names:
            raise InvalidInput(
                f"the vLLM server at {redact_url(self.url)} serves {names}, not "
                f"{self.base_model!r}; set "
                "served_model_name to the name it serves the base model under"
            )
        # Adapters loaded before we attached (--lora-modules, or by another client).
        self._adapters = {m["id"]: m.get("root") or "" for m in models if m.get("parent")}
        log.info("attached to vLLM at %s serving %s", redact_url(self.url), names)

    # ---- supervision of a launched server
    # A server that dies (killed, out of memory) is started again on the same port and given
    # back the adapters it had. Requests sent meanwhile wait for it; those it was serving when
    # it died fail with VLLMUnavailable (503), which the caller may retry.

    async def _watch(self) -> None:
        assert self._server is not None
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._server.exited() and self._gave_up is None:
                with contextlib.suppress(LightningError):  # recorded in _gave_up
                    await self._restart_once()

    def _restart_once(self) -> asyncio.Task[None]:
        """The restart under way, or a new one: one at a time, however many callers notice."""
        if self._restarting is None or self._restarting.done():
            self._restarting = asyncio.create_task(self._restart())
        return self._restarting

    async def _restart(self) -> None:
        assert self._server is not None
        if self.restarts >= self.config.max_restarts:
            self._gave_up = (
                f"; it died after {self.restarts} restarts, the most allowed "
                f"(max_restarts={self.config.max_restarts}); see {self._server.log_path}"
            )
            log.error("the vLLM server died again%s", self._gave_up)
            raise VLLMUnavailable(f"the vLLM server is down{self._gave_up}")
        self.restarts += 1
        log.warning(
            "the vLLM server exited; restarting it on %s (restart %d of at most %d)%s",
            self.url,
            self.restarts,
            self.config.max_restarts,
            self._died(),
        )
        await self._server.restart()
        # The same snapshots as before: the folders they were copied from may have changed.
        for name, snapshot in list(self._snapshots.items()):
            body = {"lora_name": name, "lora_path": str(snapshot)}
            try:
                await self._request(
                    "POST", "/v1/load_lora_adapter", body, adapter_path=str(snapshot)
                )
            except LightningError as exc:
                # Not served rather than served wrong: a caller gets NotFound and may load it.
                log.error("adapter %s could not be loaded again: %s", name, exc)
                self._adapters.pop(name, None)
                self._drop_snapshot(name)
        log.warning("the vLLM server is back with adapters %s", self.adapters())

    async def _ready(self) -> None:
        """Wait out a restart under way; VLLMUnavailable if the server stays down."""
        if self._gave_up is not None:
            raise VLLMUnavailable(f"the vLLM server is down{self._gave_up}")
        if self._server is not None and self._server.exited():
            # Dead, and the watcher has not looked yet: restart now rather than fail the call.
            self._restart_once()
        if self._restart_under_way():
            assert self._restarting is not None
            try:
                # Shielded: a caller that gives up waiting must not cancel the restart.
                await asyncio.shield(self._restarting)
            except LightningError as exc:
                raise VLLMUnavailable(f"the vLLM server could not be restarted: {exc}") from exc

    async def _lost(self, error: Exception, restarts: int) -> VLLMUnavailable:
        """The error of a request the server failed by dying; a restart begins at once.
        `restarts` is self.restarts when the request was sent."""
        if self._restarted_since(restarts):
            # The server that failed it was restarted meanwhile, or is being restarted: the
            # watcher's restart stops what is left of it (its engine core, which still held the
            # port, resets the connection) and may have launched the new server before this
            # error was handled, so the new process is alive and `exited()` says no. Answered
            # "cannot reach" before (the race in test_fault_vllm.py).
            return self._restarting_error(error)
        if self._server is not None and self._gave_up is None:
            # The reset connection can reach us before the dying process is reaped: without
            # this wait a request cut off by the kill was answered "cannot reach" (seen here).
            # The watcher may see the exit first and launch the new server between two looks,
            # which then find it alive: a restart since the request counts as its exit.
            deadline = time.monotonic() + _EXIT_GRACE_S
            while not self._server.exited() and time.monotonic() < deadline:
                if self._restarted_since(restarts):
                    return self._restarting_error(error)
                await asyncio.sleep(0.05)
        if self._restarted_since(restarts):
            return self._restarting_error(error)
        if self._server is not None and self._server.exited() and self._gave_up is None:
            self._restart_once()
            return self._restarting_error(error)
        return VLLMUnavailable(
            f"cannot reach the vLLM server at {redact_url(self.url)}: {error}{self._died()}"
        )

    def _restarted_since(self, restarts: int) -> bool:
        """Whether a restart began after a request sent when self.restarts was `restarts`."""
        return self.restarts != restarts or self._restart_under_way()

    def _restart_under_way(self) -> bool:
        restarting = self._restarting
        return (
            restarting is not None
            and not restarting.done()
            and restarting is not asyncio.current_task()
        )

    def _restarting_error(self, error: Exception) -> VLLMUnavailable:
        return VLLMUnavailable(
            f"the vLLM server at {redact_url(self.url)} died during the request and is being "
            f"restarted; send it again ({error}){self._died()}"
        )

    def _live_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(
                "the vLLM backend is not started or was closed; await start() (or use "
                "`async with`) before sending requests"
            )
        return self._session

    # ---- generation
    # vLLM keeps the token that completed a stop string; the ids are cut before the token in
    # which it begins (base.py), found in this side's decoding of them.

    def _stop_cut(self, text: IncrementalText) -> int:
        """How many of the ids pushed into `text` to keep, given that vLLM stopped on a stop
        string."""
        if text.stopped is None:
            log.warning("vLLM stopped on a stop string this side cannot find; keeping all ids")
            return len(text.token_ids)
        return text.stopped

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        body = request_body(request, request.adapter or self.base_model, stream=False)
        data = await self._request("POST", "/v1/completions", body, request)
        choices = []
        for raw in sorted(data["choices"], key=lambda c: c["index"]):
            ids, logprobs, top = parse_tokens(raw, request.params.top_logprobs)
            finish = finish_reason(raw)
            stop = None
            if stopped_on_string(raw):
                stop = raw["stop_reason"]
                text = IncrementalText(self.tokenizer, request.params.stop)
                text.push(ids)
                keep = self._stop_cut(text)
                ids, logprobs = ids[:keep], logprobs[:keep]
                top = top[:keep] if top is not None else None
            choices.append(
                Choice(
                    token_ids=ids,
                    logprobs=logprobs,
                    top_logprobs=top,
                    finish_reason=finish,
                    stop_sequence=stop,
                )
            )
        return choices

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        check_stream_request(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        k = request.params.top_logprobs
        # Tokens a stop string may begin in are held back until it is clear they are not.
        text = IncrementalText(self.tokenizer, request.params.stop) if request.params.stop else None
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        sent = 0

        def delta(end: int, finish: Any = None, stop: str | None = None) -> StreamDelta:
            return StreamDelta(
                token_ids=ids[sent:end],
                logprobs=logprobs[sent:end],
                top_logprobs=top[sent:end] if k else None,
                finish_reason=finish,
                stop_sequence=stop,
            )

        body = request_body(request, request.adapter or self.base_model, stream=True)
        async for raw in self._stream_chunks(body, request):
            new_ids, new_logprobs, new_top = parse_tokens(raw, k)
            ids += new_ids
            logprobs += new_logprobs
            top += new_top or []
            if text is not None:
                text.push(new_ids)
            if raw.get("finish_reason") is None:
                safe = text.ready_tokens() if text is not None else len(ids)
                if safe > sent:
                    yield delta(safe)
                    sent = safe
                continue
            finish = finish_reason(raw)
            end, stop = len(ids), None
            if text is not None and stopped_on_string(raw):
                end, stop = self._stop_cut(text), raw["stop_reason"]
            # Held-back tokens never include a stop string's start, so `end` >= `sent`.
            yield delta(max(end, sent), finish, stop)
            return
        raise VLLMUnavailable(f"vLLM ended a stream without a finish reason{self._died()}")

    async def _stream_chunks(
        self, body: dict[str, Any], request: GenerationRequest
    ) -> AsyncIterator[dict[str, Any]]:
        session = self._live_session()
        await self._ready()
        restarts = self.restarts
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status >= 400:
                    raise self._error(resp.status, await resp.text(), request)
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise VLLMUnavailable(f"vLLM failed the stream: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        yield choice
        except aiohttp.ClientError as e:
            raise await self._lost(e, restarts) from e

    # ---- adapters

    def adapters(self) -> list[str]:
        return list(self._adapters)

    async def load_adapter(self, name: str, path: str) -> None:
        if name == self.base_model:
            raise InvalidInput(f"{name!r} is the base model's name; give the adapter another")
        folder = Path(path).expanduser()
        if self._server_is_local():
            self._check_adapter(folder)
        async with self._adapter_lock:
            if name in self._adapters:
                # A fresh load (new LoRA id) rather than vLLM's load_inplace, which would make
                # every batch that uses the adapter reload it from disk.
                await self._unload(name)
            served = str(folder)
            if self._server_is_local():
                assert self._scratch is not None
                snapshot = self._scratch / "adapters" / uuid.uuid4().hex
                await asyncio.to_thread(shutil.copytree, folder, snapshot)
                self._snapshots[name] = snapshot
                served = str(snapshot)
            body = {"lora_name": name, "lora_path": served}
            try:
                await self._request("POST", "/v1/load_lora_adapter", body, adapter_path=path)
            except BaseException:
                self._drop_snapshot(name)
                raise
            self._adapters[name] = path
        log.info("loaded LoRA adapter %s from %s", name, path)

    async def unload_adapter(self, name: str) -> None:
        async with self._adapter_lock:
            await self._unload(name)
        log.info("unloaded LoRA adapter %s", name)

    async def _unload(self, name: str) -> None:
        try:
            await self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except NotFound:
            raise NotFound(
                f"no LoRA adapter named {name!r} is loaded (loaded: {self.adapters()})"
            ) from None
        finally:
            self._adapters.pop(name, None)
            self._drop_snapshot(name)

    def _drop_snapshot(self, name: str) -> None:
        snapshot = self._snapshots.pop(name, None)
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)

    def _check_adapter(self, folder: Path) -> None:
        config_file = folder / "adapter_config.json"
        if not folder.is_absolute() or not config_file.is_file():
            raise InvalidInput(
                f"{folder} is not the absolute path of a local PEFT LoRA folder (no "
                "adapter_config.json); adapters are loaded from local folders only"
            )
        if not (folder / WEIGHTS_FILE).is_file():
            raise InvalidInput(
                f"{folder} has no {WEIGHTS_FILE}; pickled weights (adapter_model.bin) are never "
                "loaded: save the adapter with save_pretrained(safe_serialization=True)"
            )
        config = json.loads(config_file.read_text())
        rank = max([config.get("r", 0), *config.get("rank_pattern", {}).values()])
        if rank > self.config.max_lora_rank:
            raise InvalidInput(
                f"adapter {folder} has LoRA rank {rank}, above the server's max_lora_rank "
                f"{self.config.max_lora_rank}; raise max_lora_rank (restarts vLLM)"
            )

    def _server_is_local(self) -> bool:
        return self._server is not None or urlparse(self.url).hostname in _LOOPBACK

    # ---- HTTP

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        request: GenerationRequest | None = None,
        adapter_path: str | None = None,
    ) -> Any:
        session = self._live_session()
        await self._ready()
        restarts = self.restarts
        try:
            async with session.request(method, f"{self.url}{path}", json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise self._error(resp.status, text, request, adapter_path)
        except aiohttp.ClientError as e:
            raise await self._lost(e, restarts) from e
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # the adapter endpoints answer in plain text

    def _error(
        self,
        status: int,
        text: str,
        request: GenerationRequest | None = None,
        adapter_path: str | None = None,
    ) -> LightningError:
        try:
            error = json.loads(text)
            message = (error.get("error") or error).get("message", text)
        except (json.JSONDecodeError, AttributeError):
            message = text
        if adapter_path is not None:
            if status == 404:
                return NotFound(f"vLLM found no LoRA adapter at {adapter_path}: {message}")
            return InvalidInput(f"vLLM could not load the adapter at {adapter_path}: {message}")
        if status == 404 and request is not None:
            return NotFound(
                f"{request.adapter or self.base_model!r} is not served by vLLM (base model "
                f"{self.base_model!r}, adapters {self.adapters()}); load an adapter with "
                f"load_adapter(name, path) first. vLLM said: {message}"
            )
        if status == 404:
            return NotFound(message)
        if status < 500:
            return InvalidInput(f"vLLM rejected the request: {message}")
        return VLLMUnavailable(f"vLLM failed ({status}): {message}{self._died()}")

    def _died(self) -> str:
        return self._server.died() if self._server is not None else ""
