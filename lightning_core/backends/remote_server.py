"""One policy backend served over HTTP in its own process: a replica (`lightning-rl replica`).

The API is the Backend protocol in token ids, nothing more: the gateway in front of the replicas
renders, tokenizes, decodes and records (backends/remote.py is its client). Replicas bind
127.0.0.1 only; every route that generates or changes adapters wants the key the parent gave in
LIGHTNING_REPLICA_KEY, since any local user could otherwise load an adapter from any folder.
GET /health and GET /adapters are open: they tell names and counts only.

    POST   /generate          GenerationRequest -> list[Choice]
    POST   /stream            GenerationRequest -> NDJSON, one StreamDelta a line
    GET    /adapters          names of the loaded adapters
    PUT    /adapters/{name}   {"path": folder}: load (or replace) an adapter
    DELETE /adapters/{name}   unload it
    GET    /health            base model, pid, calls served and in flight, the backend's stats

Errors are answered as the store answers them, `{"error": {"type", "message"}}` with the
error's status; an error after a stream started comes as its last line, `{"error": ...}`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from lightning_core.backends.base import Backend, GenerationRequest, StreamDelta
from lightning_core.errors import LightningError, Unauthorized, error_body
from lightning_core.security.keys import key_check

KEY_ENV = "LIGHTNING_REPLICA_KEY"
# Longer than the client keeps idle connections (remote.KEEPALIVE_S), as in `serve`.
KEEPALIVE_S = 30


class AdapterBody(BaseModel):
    path: str


def _body(exc: LightningError) -> dict[str, Any]:
    return error_body(type(exc).__name__, str(exc))


def create_replica_app(backend: Backend, api_key: str | None = None) -> FastAPI:
    """The HTTP app serving `backend`; closing the app closes the backend."""
    key_ok = key_check(api_key)
    counts = {"calls": 0, "in_flight": 0}

    def authorized(request: Request) -> None:
        if not key_ok(request.headers.get("authorization", "").encode()):
            raise Unauthorized("missing or wrong replica key (LIGHTNING_REPLICA_KEY)")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="lightning-rl replica", lifespan=lifespan)
    keyed = [Depends(authorized)]

    @app.exception_handler(LightningError)
    async def lightning_error(_: Request, exc: LightningError) -> JSONResponse:
        return JSONResponse(_body(exc), status_code=exc.status_code, headers=exc.headers())

    @app.post("/generate", dependencies=keyed)
    async def generate(body: GenerationRequest) -> Response:
        counts["calls"] += 1
        counts["in_flight"] += 1
        try:
            choices = await backend.generate(body)
        finally:
            counts["in_flight"] -= 1
        body = orjson.dumps([c.model_dump() for c in choices])
        return Response(body, media_type="application/json")

    @app.post("/stream", dependencies=keyed)
    async def stream(body: GenerationRequest) -> StreamingResponse:
        # Refusals before the first token (n != 1, a bad request) are answered as plain errors.
        deltas = backend.stream(body)
        return StreamingResponse(_lines(deltas, counts), media_type="application/x-ndjson")

    @app.get("/adapters")
    async def adapters() -> list[str]:
        return backend.adapters()

    @app.put("/adapters/{name}", dependencies=keyed)
    async def load_adapter(name: str, body: AdapterBody) -> list[str]:
        await backend.load_adapter(name, body.path)
        return backend.adapters()

    @app.delete("/adapters/{name}", dependencies=keyed)
    async def unload_adapter(name: str) -> list[str]:
        await backend.unload_adapter(name)
        return backend.adapters()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = getattr(backend, "stats", None)
        return {
            "status": "ok",
            "base_model": backend.base_model,
            "pid": os.getpid(),
            **counts,
            "adapters": backend.adapters(),
            "backend_stats": stats() if callable(stats) else {},
        }

    return app


async def _lines(
    deltas: AsyncIterator[StreamDelta], counts: dict[str, int]
) -> AsyncIterator[bytes]:
    counts["calls"] += 1
    counts["in_flight"] += 1
    try:
        async for delta in deltas:
            yield orjson.dumps(delta.model_dump()) + b"\n"
    except LightningError as exc:
        yield orjson.dumps(_body(exc)) + b"\n"
    finally:
        counts["in_flight"] -= 1
        close = getattr(deltas, "aclose", None)
        if close is not None:  # a client gone mid-stream: the backend stops its sequence
            await close()


def serve_replica(
    model: str | None, port: int, options: dict[str, Any], log_level: str = "warning"
) -> None:
    """Load a transformers backend and serve it on 127.0.0.1:`port` until SIGINT."""
    from lightning_core.backends import create_backend
    from lightning_core.serving import process as serving
    from lightning_core.serving.http_edge import HttpLimits, run_server

    serving.limit_malloc_arenas(2)  # as `serve` does (serving.limit_malloc_arenas says why)
    backend = create_backend("transformers", model, options=options)
    assert backend is not None
    app = create_replica_app(backend, os.environ.get(KEY_ENV) or None)
    # The edge's defaults: the gateway, its one client, sends whole requests at once.
    run_server(app, "127.0.0.1", port, log_level, KEEPALIVE_S, HttpLimits())
