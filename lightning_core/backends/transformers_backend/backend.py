"""`TransformersBackend`: the async face of the engine thread, one event loop or many."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from lightning_core.backends.base import (
    Choice,
    GenerationRequest,
    StreamDelta,
    check_stream_request,
)
from lightning_core.backends.transformers_backend.config import TransformersBackendConfig
from lightning_core.backends.transformers_backend.engine import Engine
from lightning_core.backends.transformers_backend.requests import Job
from lightning_core.errors import InvalidInput
from lightning_core.models import DEFAULT_MODEL, TINY_MODEL
from lightning_core.serving.offload import off_loop


def _served_model_name(model: str | None) -> str:
    if model in (None, "", DEFAULT_MODEL, "smollm2"):
        return DEFAULT_MODEL
    if model in ("tiny", TINY_MODEL):
        return TINY_MODEL
    path = Path(model).expanduser()
    return path.name if path.exists() else model


class TransformersBackend:
    """The `Backend` protocol on transformers + PEFT, batching concurrent requests continuously.

    `TransformersBackend(config, **overrides)`: overrides are config fields (`model="tiny"`).
    Construct it outside or inside an event loop (loading takes about a second); its async
    methods may be called from any event loop, and the model runs on its own thread.
    """

    def __init__(self, config: TransformersBackendConfig | None = None, **overrides: Any) -> None:
        base = config.model_dump() if config is not None else {}
        self.config = TransformersBackendConfig.model_validate({**base, **overrides})
        self._engine = Engine(self.config)
        self.base_model: str = self.config.served_model_name or _served_model_name(
            self.config.model
        )
        self.tokenizer: Any = self._engine.tokenizer

    @classmethod
    def from_config(cls, config: TransformersBackendConfig) -> TransformersBackend:
        return cls(config)

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    def adapters(self) -> list[str]:
        return sorted(self._engine.adapters.ids)

    def stats(self) -> dict[str, int]:
        """Sequences decoding now, requests waiting for a row, and prompt tokens served from
        shared prefixes (a snapshot, for metrics)."""
        return self._engine.stats()

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        job = await self._submit(request, streaming=False)
        choices: list[Choice | None] = [None] * request.n
        try:
            for _ in range(request.n):
                item = await job.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                choices[index] = Choice(
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs,
                    top_logprobs=delta.top_logprobs,
                    finish_reason=delta.finish_reason,
                    stop_sequence=delta.stop_sequence,
                )
        finally:
            self._engine.abort(job)
        return [choice for choice in choices if choice is not None]

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        check_stream_request(request)
        self._engine.validate(request)  # refused here, before a stream starts
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        job = await self._submit(request, streaming=True)
        try:
            while True:
                item = await job.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                _, delta = item
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._engine.abort(job)

    async def _submit(self, request: GenerationRequest, streaming: bool) -> Job:
        self._engine.validate(request)
        # Compiling a grammar takes milliseconds to a second: off the loop (its errors raise
        # from the stream's first step).
        grammar = None
        if request.params.constraint is not None:
            grammar = await off_loop(self._engine.grammar, request)
        job = Job(
            request=request,
            streaming=streaming,
            loop=asyncio.get_running_loop(),
            outbox=asyncio.Queue(),
            grammar=grammar,
        )
        self._engine.submit(job)
        return job

    async def load_adapter(self, name: str, path: str) -> None:
        if name == self.base_model:
            raise InvalidInput(f"{name!r} is the base model's name; give the adapter another")
        engine = self._engine
        await asyncio.wrap_future(engine.call(engine.adapters.load, name, str(path)))

    async def unload_adapter(self, name: str) -> None:
        engine = self._engine
        await asyncio.wrap_future(engine.call(engine.adapters.unload, name))

    async def close(self) -> None:
        await asyncio.to_thread(self._engine.close)
