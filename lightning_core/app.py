"""The HTTP app of `lightning-rl serve`: the store's routes and the gateway's, side by side.

It sits above both packages so that neither imports the other: the store serves rollouts and
spans, the gateway serves the policy and records its calls through the store's `SpanRecorder`
protocol. Errors on the gateway's paths are answered in the shape of the API that was called
(OpenAI's, or Anthropic's on /v1/messages), so each official client raises its own error types.
A new policy version's adapter is loaded on the backend (every replica) before the store
commits the version (`_publishing`). `/serving/routing` shows and replaces what `champion` and
`challenger` serve (gateway/routing.py), with each version's live feedback from the store: what
the production loop's alias follower reads and writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from lightning_core.errors import LightningError
from lightning_core.gateway.errors import error_response, is_gateway_path
from lightning_core.gateway.routes import gateway_router
from lightning_core.gateway.routing import Routing
from lightning_core.gateway.service import Gateway
from lightning_core.serving.http_edge import HttpLimits
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.episodes import VersionFeedback
from lightning_core.store.server import OrjsonRoute, Publishing, create_store_app
from lightning_core.types import PolicyVersion


def _gateway_error(path: str, status: int, kind: str, message: str) -> JSONResponse | None:
    if not is_gateway_path(path):
        return None
    return error_response(path, status, kind, message)


def _gateway_details(gateway: Gateway) -> dict[str, Any]:
    backend = gateway.backend
    details = {
        "backend": type(backend).__name__,
        "base_model": backend.base_model,
        "adapters_loaded": len(backend.adapters()),
        # What renders its prompts (security/provenance.py): a run records it when it starts.
        "template_fingerprint": gateway.known_template_fingerprint,
    }
    # The transformers backend counts its decoding and waiting sequences, a replicated one its
    # replicas' calls; vLLM has its own /metrics for that.
    stats = getattr(backend, "stats", None)
    if callable(stats):
        details["backend_stats"] = stats()
    return details


def _publishing(gateway: Gateway) -> Publishing:
    """Each new policy version's adapter loaded on the backend (every replica) before the store
    commits the version, and unloaded again if the store refuses it."""

    @asynccontextmanager
    async def publishing(version: PolicyVersion) -> AsyncIterator[None]:
        loaded = await gateway.load_version(version)
        try:
            yield
        except BaseException:
            if loaded:
                with contextlib.suppress(LightningError):
                    await gateway.backend.unload_adapter(version.name)
            raise
        gateway.published(version)

    return publishing


def _starting(gateway: Gateway) -> Callable[[], Awaitable[None]]:
    """Before the first request: the backend's own start (vLLM runs a server), then the
    tokenizer's fingerprint, so /health/details shows it from the start."""
    start = getattr(gateway.backend, "start", None)

    async def starting() -> None:
        if start is not None:
            await start()
        await gateway.template_fingerprint()

    return starting


class ServingState(BaseModel):
    """What a production server serves, and how each version does on live feedback."""

    routing: Routing = Field(description="The versions behind champion and challenger.")
    feedback: list[VersionFeedback] = Field(
        description="Live feedback per policy version that served episodes (in the window)."
    )


def _serving_router(gateway: Gateway, store: DuckDBStore) -> APIRouter:
    router = APIRouter(tags=["serving"])

    async def state(window: int | None, since: float | None) -> ServingState:
        feedback = await store.feedback_by_version(window, since)
        return ServingState(routing=gateway.routing, feedback=feedback)

    @router.get("/serving/routing", summary="What champion and challenger serve, and feedback")
    async def get_routing(
        window: int | None = Query(
            None, ge=1, le=1_000_000, description="Newest episodes per version counted."
        ),
        since: float | None = Query(
            None, ge=0, description="Only episodes begun at or after this time (epoch seconds)."
        ),
    ) -> ServingState:
        return await state(window, since)

    @router.put("/serving/routing", summary="Serve other versions as champion and challenger")
    async def put_routing(routing: Routing) -> ServingState:
        await gateway.apply_routing(routing)
        return await state(None, None)

    return router


def create_app(
    store: DuckDBStore,
    api_key: str | None = None,
    max_request_bytes: int = 64 * 1024 * 1024,
    close_store: bool = True,
    gateway: Gateway | None = None,
    limits: HttpLimits | None = None,
) -> Any:
    """The app serving `store` (and `gateway`, if given), wrapped in the auth and size-limit
    middleware. Closing the app closes the store and the gateway's backend."""
    if gateway is None:
        return create_store_app(store, api_key, max_request_bytes, close_store, limits=limits)
    # A backend that runs a server of its own (vLLM) starts on the app's loop, before requests.
    return create_store_app(
        store,
        api_key,
        max_request_bytes,
        close_store,
        routers=[gateway_router(gateway, route_class=OrjsonRoute), _serving_router(gateway, store)],
        on_start=_starting(gateway),
        on_close=gateway.backend.close,
        error_body=_gateway_error,
        details=lambda: _gateway_details(gateway),
        publishing=_publishing(gateway),
        limits=limits,
        description="The LightningStore (rollouts, spans, transitions, OTLP traces) and the "
        "policy gateway (OpenAI chat, completions and responses; Anthropic messages).",
    )
