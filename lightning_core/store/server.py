"""The store's HTTP API: a FastAPI app over any LightningStore, plus an OTLP/HTTP traces endpoint.

Every user error is answered with a 4xx and a body `{"error": {"type", "message"}}`; `type` names
the exception class from `lightning_core.errors`, which the Python client raises again.

The store knows nothing of the gateway: `create_store_app` takes routers to mount beside its
own, hooks to run at start and close, and an `ErrorBody` that may answer errors on other paths
in their API's own shape (lightning_core/app.py joins the two).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_core.errors import InvalidInput, LightningError
from lightning_core.security.keys import check_span_owner
from lightning_core.serving.http_edge import HttpLimits
from lightning_core.store import api, otlp
from lightning_core.store.bodies import MAX_QUERY_IDS, MAX_WAIT_S
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.middleware import SPAN_ATTEMPT, ErrorBody, error_at, limits_and_auth
from lightning_core.store.routes import OrjsonRoute, Wrapper, add_store_routes, json_response
from lightning_core.types import PolicyVersion, Span

# The limits a request meets, for those who test them.
__all__ = ["MAX_QUERY_IDS", "MAX_WAIT_S", "OrjsonRoute", "Publishing", "create_store_app"]


# Wraps the adding of a policy version: entered before the store commits it, so that what
# serves versions (the gateway) can get it ready first, and no request sees a version that
# cannot be served; an error raised on entering refuses the version, and one raised inside
# (the store refused it) reaches the wrapper, to undo what it did.
Publishing = Callable[[PolicyVersion], AbstractAsyncContextManager[Any]]


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        reasons = (str((e.get("ctx") or {}).get("error", e.get("msg"))) for e in errors)
        return 400, "malformed JSON: " + "; ".join(reasons)
    parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors[:10]]
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return 422, "; ".join(parts) + more


def _span_attempt(request: Request) -> str | None:
    """The attempt whose agent key sent this request (store/middleware.py); None: any."""
    return request.scope.get("state", {}).get(SPAN_ATTEMPT)


def _check_writer(store: DuckDBStore, request: Request, spans: Sequence[Span]) -> None:
    """An agent's key writes its own attempt's spans only, and none of the attributes only the
    gateway writes (store/guards.py): its calls are recorded by the gateway, not by itself."""
    attempt = _span_attempt(request)
    check_span_owner(attempt, (span.attempt_id for span in spans))
    store.check_agent_spans(attempt, spans)


def _wrappers(store: DuckDBStore, publishing: Publishing | None) -> dict[api.Endpoint, Wrapper]:
    """What the server does around some endpoints' store calls, beyond the table's call."""

    @asynccontextmanager
    async def own_spans(request: Request, body: BaseModel):
        _check_writer(store, request, body.spans)
        yield

    wrappers: dict[api.Endpoint, Wrapper] = {api.ADD_SPANS: own_spans}
    if publishing is not None:
        wrappers[api.ADD_POLICY_VERSION] = lambda _request, version: publishing(version)
    return wrappers


def create_store_app(
    store: DuckDBStore,
    api_key: str | None = None,
    max_request_bytes: int = 64 * 1024 * 1024,
    close_store: bool = True,
    routers: Sequence[APIRouter] = (),
    on_start: Callable[[], Awaitable[Any]] | None = None,
    on_close: Callable[[], Awaitable[Any]] | None = None,
    error_body: ErrorBody | None = None,
    description: str = "The LightningStore: rollouts, spans, transitions, OTLP traces.",
    details: Callable[[], dict[str, Any]] | None = None,
    publishing: Publishing | None = None,
    limits: HttpLimits | None = None,
) -> Any:
    """The FastAPI app serving `store` and any `routers` beside it, wrapped in the auth and
    size-limit middleware. `on_start` runs before the first request, `on_close` at shutdown,
    before the store closes (when `close_store`); `details` adds to /health/details;
    `publishing` wraps the adding of each policy version (see Publishing); `limits` bounds
    each request's body time and OTLP spans."""
    started = time.monotonic()
    limits = limits or HttpLimits()
    # OTLP bodies are decoded off the event loop, two at a time: more would only share the GIL.
    decoders = anyio.CapacityLimiter(2)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if on_start is not None:
            await on_start()
        # What the server loaded to start (the model and its tokenizer, the frameworks' modules,
        # the routes) lives as long as it does: out of the cyclic GC's reach, as the store's
        # state is (duckdb_store.py). Else each full collection walks it all: 190 ms stalls of
        # every request, /health too, whenever a burst of spans set one off (issue 43).
        gc.freeze()
        yield
        if on_close is not None:
            await on_close()
        if close_store:
            await store.close()

    app = FastAPI(
        title="lightning-rl",
        description=description,
        lifespan=lifespan,
        # The store must not trace its own requests: an agent running in this process may have
        # set a global OpenTelemetry provider, whose spans belong to its rollout, not to us.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.router.route_class = OrjsonRoute

    @app.exception_handler(LightningError)
    async def lightning_error(request: Request, exc: LightningError) -> JSONResponse:
        response = error_at(
            request.url.path, exc.status_code, type(exc).__name__, str(exc), error_body
        )
        response.headers.update(exc.headers())
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = _validation_message(exc)
        return error_at(request.url.path, status, "InvalidInput", message, error_body)

    # The framework's own refusals (no such path, a method the path does not take) in the API's
    # error shape too, not Starlette's {"detail": ...}, which no client of ours parses.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message += f"; this path takes {exc.headers['Allow']}"
        response = error_at(request.url.path, exc.status_code, kind, message, error_body)
        response.headers.update(exc.headers or {})
        return response

    for router in routers:
        app.include_router(router)

    @app.get("/health", summary="Liveness probe, open without the API key")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health/details", summary="What the server runs and how busy it is (needs the key)")
    async def health_details() -> dict[str, Any]:
        return {
            "status": "ok",
            "uptime_s": round(time.monotonic() - started, 1),
            "db": str(store.config.db),
            "policy_versions": len(await store.list_policy_versions()),
            # This request included.
            "requests_in_flight": app.state.requests_in_flight,
            # Span writes refused by reason (store/guards.py): forged call attributes, quotas.
            "spans_refused": dict(store.spans_refused),
            **(details() if details is not None else {}),
        }

    add_store_routes(app, store, _wrappers(store, publishing))

    @app.post(
        "/v1/traces",
        summary="OTLP/HTTP trace export (application/x-protobuf or application/json)",
        # The handler reads the raw body itself; this tells OpenAPI clients (and fuzzers) what
        # it takes: an ExportTraceServiceRequest, in protobuf or in OTLP's JSON mapping.
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"resourceSpans": {"type": "array"}},
                        }
                    },
                },
            }
        },
    )
    async def otlp_traces(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        decoders_by_type = {
            "application/x-protobuf": otlp.decode_protobuf,
            "application/json": otlp.decode_json,
        }
        if content_type not in decoders_by_type:
            raise InvalidInput(
                f"Content-Type {content_type!r} is not OTLP: use application/x-protobuf or "
                "application/json"
            )
        encoding = request.headers.get("content-encoding", "").lower()
        decode = decoders_by_type[content_type]

        def decompress_and_decode(body: bytes) -> list[Span]:
            return decode(otlp.decompress(body, encoding, max_request_bytes), limits.max_otlp_spans)

        # 150k tiny spans took 5.6 s of the loop here; in a thread /health answers meanwhile.
        spans = await anyio.to_thread.run_sync(
            decompress_and_decode, await request.body(), limiter=decoders
        )
        _check_writer(store, request, spans)
        await store.add_spans(spans)
        if content_type == "application/json":
            return json_response({})
        return Response(otlp.EMPTY_PROTOBUF_RESPONSE, media_type="application/x-protobuf")

    return limits_and_auth(app, max_request_bytes, api_key, error_body, limits.body_timeout_s)
