"""The store server's ASGI middleware: what every request passes before any route.

In order: where it comes from (a keyless server answers this machine only:
http_edge.origin_refusal), the API key, then its body, read whole here, within a size cap and a
deadline between chunks, and dropped when the client leaves before its end. Refusals are answered
in the shape of the API that was called (`ErrorBody`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from lightning_core.errors import error_body
from lightning_core.security.keys import agent_key_check, key_check
from lightning_core.serving.http_edge import HttpLimits, origin_refusal

# The request state naming the attempt whose agent key wrote a request's spans.
SPAN_ATTEMPT = "span_attempt"


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(kind, message), status_code=status)


# Answers an error on a path in that API's own shape, or None for the store's shape.
ErrorBody = Callable[[str, int, str, str], JSONResponse | None]


def error_at(
    path: str, status: int, kind: str, message: str, shape: ErrorBody | None = None
) -> JSONResponse:
    shaped = shape(path, status, kind, message) if shape is not None else None
    return shaped if shaped is not None else _error(status, kind, message)


def limits_and_auth(
    app: Any,
    max_bytes: int,
    api_key: str | None,
    shape: ErrorBody | None = None,
    body_timeout_s: float = HttpLimits().body_timeout_s,
) -> Any:
    """ASGI middleware: where a request comes from (http_edge.origin_refusal), API-key auth,
    then a cap on the request body's size and on the time between its chunks.

    The key comes as `Authorization: Bearer <key>` (OpenAI's clients, ours) or as `x-api-key`
    (Anthropic's clients, which never send the bearer form). Requests it lets through are
    counted in `app.state.requests_in_flight` while they run (for /health/details).
    """
    bearer_ok, x_api_key_ok = key_check(api_key), key_check(api_key, scheme="")
    # An agent's key (keys.py) opens its attempt's gateway routes and span writes only.
    agent_ok = agent_key_check(api_key)
    # The bare liveness probe only: it answers {"status": "ok"} and nothing about the server,
    # so a load balancer or `start_serve` can poll it without the key.
    open_paths = {"/health"}
    app.state.requests_in_flight = 0

    async def middleware(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refused = origin_refusal(headers, keyed=bool(api_key))
        if refused is not None:
            await error_at(scope["path"], 403, "Forbidden", refused, shape)(scope, receive, send)
            return
        if api_key and scope["path"] not in open_paths:
            given_key = headers.get(b"x-api-key", b"")
            admin = bearer_ok(headers.get(b"authorization", b"")) or (
                given_key and x_api_key_ok(given_key)
            )
            agent_attempt = None if admin else agent_ok(headers, scope["path"])
            if agent_attempt is not None:
                # The span routes let this key write its own attempt's spans only.
                scope.setdefault("state", {})[SPAN_ATTEMPT] = agent_attempt
            if not admin and agent_attempt is None:
                await error_at(
                    scope["path"],
                    401,
                    "Unauthorized",
                    "missing or wrong API key: send 'Authorization: Bearer <LIGHTNING_API_KEY>'",
                    shape,
                )(scope, receive, send)
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await _too_large(scope["path"], max_bytes, shape)(scope, receive, send)
            return
        # Read the whole body here, up to the limit, and replay it: an error raised while the
        # app reads it would be turned into a generic 400 by the framework.
        chunks: list[bytes] = []
        seen = 0
        while True:
            try:
                async with asyncio.timeout(body_timeout_s):
                    message = await receive()
            except TimeoutError:
                await _body_timed_out(scope["path"], body_timeout_s, shape)(scope, receive, send)
                return
            if message["type"] != "http.request":
                # The client left before its body ended: the part that came (600 of 1,000
                # spans) is not the request it meant, and its retry will send the whole.
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > max_bytes:
                await _too_large(scope["path"], max_bytes, shape)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        app.state.requests_in_flight += 1
        try:
            await app(scope, replay, send)
        finally:
            app.state.requests_in_flight -= 1

    # The FastAPI app inside, for its routes and OpenAPI schema (tests walk its route table).
    middleware.app = app  # type: ignore[attr-defined]
    return middleware


def _body_timed_out(path: str, timeout_s: float, shape: ErrorBody | None) -> JSONResponse:
    response = error_at(
        path,
        408,
        "RequestTimeout",
        f"no byte of the request body came for {timeout_s:g} s; the request is dropped "
        "(LIGHTNING_BODY_TIMEOUT_S)",
        shape,
    )
    # The rest of the body may still come: the connection cannot carry another request.
    response.headers["connection"] = "close"
    return response


def _too_large(path: str, max_bytes: int, shape: ErrorBody | None) -> JSONResponse:
    return error_at(
        path,
        413,
        "PayloadTooLarge",
        f"request body over the limit of {max_bytes} bytes: send smaller batches, or raise "
        "--max-request-bytes (LIGHTNING_MAX_REQUEST_BYTES)",
        shape,
    )
