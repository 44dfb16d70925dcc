"""The gateway's HTTP routes, plain and under a rollout attempt's prefix.

OpenAI's chat completions, completions, responses and models, and Anthropic's messages. An agent
inside a rollout gets `base_url = <server>/rollouts/<rollout_id>/attempts/<attempt_id>/v1` (for
Anthropic's client, the same URL without `/v1`: it adds that itself) and needs nothing else:
every call it makes there is recorded on that attempt. It may name itself (for multi-agent
systems) with the `X-Lightning-Agent` header or `metadata.agent_name`.

A production agent calls the plain routes and names its episode (a session or conversation) with
the `X-Lightning-Episode` header or `metadata.episode_id`: the call is recorded on that episode
(see `GatewayConfig.capture`), and the answer, streamed or not, carries the header back. Under
a rollout prefix an episode id plays no part: the prefix says where the call belongs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import Response, StreamingResponse

from lightning_core import semconv
from lightning_core.gateway.anthropic_api import MessagesAPI, MessagesRequest
from lightning_core.gateway.openai_api import OpenAIAPI
from lightning_core.gateway.protocol import ChatCompletionRequest, CompletionRequest
from lightning_core.gateway.responses_api import ResponsesAPI, ResponsesRequest
from lightning_core.gateway.service import CallContext, Gateway

ROLLOUT_PREFIX = "/rollouts/{rollout_id}/attempts/{attempt_id}"
# A generating call answers with JSON, or with server-sent events when it asks to stream.
_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}}
}


def _context(gateway: Gateway, request: Request, metadata: dict[str, Any] | None) -> CallContext:
    params = request.path_params
    metadata = metadata or {}
    agent = request.headers.get(semconv.AGENT_HEADER) or metadata.get(semconv.AGENT_METADATA_KEY)
    episode = None
    if "rollout_id" not in params:
        given = request.headers.get(semconv.EPISODE_HEADER) or metadata.get(
            semconv.EPISODE_METADATA_KEY
        )
        episode = gateway.episode_for(given)
    return CallContext(
        rollout_id=params.get("rollout_id"),
        attempt_id=params.get("attempt_id"),
        agent_name=agent,
        traceparent=request.headers.get("traceparent"),
        episode_id=episode,
    )


def _attempt_path(
    rollout_id: Annotated[str, Path(description="The rollout the call is recorded on.")],
    attempt_id: Annotated[str, Path(description="Its attempt (from the runner's claim).")],
) -> None:
    """Declares the rollout prefix's path parameters in the OpenAPI schema: the endpoints read
    them from `request.path_params`, and a schema without them cannot be called from it."""


def _respond(result: dict[str, Any] | AsyncIterator[bytes], ctx: CallContext) -> Response:
    # The episode the call was kept in, so that a client can send feedback on it (and learn
    # the id the gateway gave it, when it captures every call).
    kept = {semconv.EPISODE_HEADER: ctx.episode_id} if ctx.episode_id is not None else {}
    # The version that answered (one per call, whatever the routing did meanwhile).
    if ctx.policy_version is not None:
        kept[semconv.POLICY_VERSION_HEADER] = ctx.policy_version
    if isinstance(result, dict):
        return Response(orjson.dumps(result), media_type="application/json", headers=kept)
    return StreamingResponse(
        result,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no", **kept},
    )


def gateway_router(gateway: Gateway, route_class: type | None = None) -> APIRouter:
    router = APIRouter(route_class=route_class) if route_class else APIRouter()
    openai_api = OpenAIAPI(gateway)
    responses_api = ResponsesAPI(gateway)
    messages_api = MessagesAPI(gateway)

    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        ctx = _context(gateway, request, body.metadata)
        return _respond(await openai_api.chat(body, ctx), ctx)

    async def completions(request: Request, body: CompletionRequest) -> Response:
        ctx = _context(gateway, request, body.metadata)
        return _respond(await openai_api.completions(body, ctx), ctx)

    async def responses(request: Request, body: ResponsesRequest) -> Response:
        ctx = _context(gateway, request, body.metadata)
        return _respond(await responses_api.create(body, ctx), ctx)

    async def messages(request: Request, body: MessagesRequest) -> Response:
        ctx = _context(gateway, request, body.metadata)
        return _respond(await messages_api.create(body, ctx), ctx)

    async def models(request: Request) -> Response:
        if "rollout_id" in request.path_params:
            gateway.check_rollout(_context(gateway, request, None))
        return Response(orjson.dumps(gateway.models()), media_type="application/json")

    routes: list[tuple[str, Callable[..., Awaitable[Response]], str, str]] = [
        ("/v1/chat/completions", chat_completions, "POST", "Chat completion (OpenAI)"),
        ("/v1/completions", completions, "POST", "Text completion (OpenAI)"),
        ("/v1/responses", responses, "POST", "Response (OpenAI Responses API)"),
        ("/v1/messages", messages, "POST", "Message (Anthropic Messages API)"),
        ("/v1/models", models, "GET", "Served models: base and LoRA adapters"),
    ]
    for prefix, scope in (("", "outside a rollout"), (ROLLOUT_PREFIX, "recorded on the attempt")):
        for path, endpoint, method, summary in routes:
            router.add_api_route(
                prefix + path,
                endpoint,
                methods=[method],
                summary=f"{summary}, {scope}",
                name=f"{endpoint.__name__}{'_in_rollout' if prefix else ''}",
                tags=["gateway"],
                dependencies=[Depends(_attempt_path)] if prefix else None,
                responses=_STREAMED if method == "POST" else None,
            )
    return router
