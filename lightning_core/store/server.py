"""The store's HTTP API: a FastAPI app over any LightningStore, plus an OTLP/HTTP traces endpoint.

Every user error is answered with a 4xx and a body `{"error": {"type", "message"}}`; `type` names
the exception class from `lightning_core.errors`, which the Python client raises again.

The store knows nothing of the gateway: `create_store_app` takes routers to mount beside its
own, hooks to run at start and close, and an `ErrorBody` that may answer errors on other paths
in their API's own shape (lightning_core/app.py joins the two).
"""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_core.errors import InvalidInput, LightningError, PayloadTooLarge, error_body
from lightning_core.keys import key_check
from lightning_core.store import otlp
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.schema import check_json_depth
from lightning_core.types import (
    Attempt,
    Claim,
    Feedback,
    FeedbackIn,
    FeedbackReceipt,
    FiniteFloat,
    PolicyVersion,
    Rollout,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    Span,
    Transition,
)

# Long polls are capped so that a proxy or client timeout never cuts a request mid-wait.
MAX_WAIT_S = 30.0
# Rollouts one query or wait may name: a wait rescans its ids whenever any rollout finishes, and
# a 64 MB body holds a million ids. An iteration's batch (hundreds) is far under it.
MAX_QUERY_IDS = 10_000
QueryIds = Annotated[
    list[str],
    Field(max_length=MAX_QUERY_IDS, description=f"At most {MAX_QUERY_IDS}; ask in batches."),
]


class EnqueueBody(BaseModel):
    rollouts: list[RolloutRequest]


class DequeueBody(BaseModel):
    worker_id: str = Field(min_length=1, description="Who claims the work (host:pid:n).")
    wait: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="Seconds to wait for work.")


class CompleteBody(BaseModel):
    reward: FiniteFloat | None = None


class FailBody(BaseModel):
    error: str
    retry: bool = True


class RolloutQuery(BaseModel):
    rollout_ids: QueryIds | None = None
    status: list[RolloutStatus] | None = None
    mode: RolloutMode | None = None
    group_id: str | None = None
    limit: int | None = Field(None, ge=0)


class WaitBody(BaseModel):
    rollout_ids: QueryIds
    timeout: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class SpansBody(BaseModel):
    spans: list[Span]


class SpanQuery(BaseModel):
    rollout_ids: QueryIds
    attempt_id: str | None = Field(None, description='An attempt id, "latest" or null for all.')


class TransitionsBody(BaseModel):
    transitions: list[Transition]


class TransitionQuery(BaseModel):
    rollout_ids: QueryIds | None = None
    policy_version: str | None = None


class Count(BaseModel):
    count: int


class EpisodeBody(BaseModel):
    agent_name: str | None = Field(None, description="The agent of the first call.")
    policy_version: str | None = Field(None, description="The policy that served it.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form labels.")


class Episode(BaseModel):
    rollout: Rollout
    feedback: list[Feedback]


class Watermark(BaseModel):
    seq: int


# Seqs are DuckDB BIGINTs: a bigger number in a query is refused here, not by the database.
MAX_SEQ = 2**63 - 1
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]


class FeedbackQuery(BaseModel):
    after_seq: Seq = Field(0, description="Read feedback recorded after this seq.")
    through_seq: Seq | None = Field(None, description="Up to this seq; None: the watermark.")
    episode_ids: QueryIds | None = Field(
        None, description="These episodes' feedback instead of a window's (after_seq aside)."
    )


class _OrjsonRequest(Request):
    """Request bodies parsed with orjson: twice as fast as the json module on 2 MB of spans."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # orjson.JSONDecodeError subclasses json.JSONDecodeError, so FastAPI still answers
            # malformed JSON as such.
            value = orjson.loads(await self.body())
            check_json_depth(value)
            self._json = value
        return self._json


class OrjsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return orjson_handler


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(kind, message), status_code=status)


# Wraps the adding of a policy version: entered before the store commits it, so that what
# serves versions (the gateway) can get it ready first, and no request sees a version that
# cannot be served; an error raised on entering refuses the version, and one raised inside
# (the store refused it) reaches the wrapper, to undo what it did.
Publishing = Callable[[PolicyVersion], AbstractAsyncContextManager[Any]]

# Answers an error on a path in that API's own shape, or None for the store's shape.
ErrorBody = Callable[[str, int, str, str], JSONResponse | None]


def _error_at(
    path: str, status: int, kind: str, message: str, shape: ErrorBody | None = None
) -> JSONResponse:
    shaped = shape(path, status, kind, message) if shape is not None else None
    return shaped if shaped is not None else _error(status, kind, message)


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        reasons = (str((e.get("ctx") or {}).get("error", e.get("msg"))) for e in errors)
        return 400, "malformed JSON: " + "; ".join(reasons)
    parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors[:10]]
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return 422, "; ".join(parts) + more


def _limits_and_auth(
    app: Any, max_bytes: int, api_key: str | None, shape: ErrorBody | None = None
) -> Any:
    """ASGI middleware: API-key auth, then a cap on the request body size.

    The key comes as `Authorization: Bearer <key>` (OpenAI's clients, ours) or as `x-api-key`
    (Anthropic's clients, which never send the bearer form). Requests it lets through are
    counted in `app.state.requests_in_flight` while they run (for /health/details).
    """
    bearer_ok, x_api_key_ok = key_check(api_key), key_check(api_key, scheme="")
    # The bare liveness probe only: it answers {"status": "ok"} and nothing about the server,
    # so a load balancer or `start_serve` can poll it without the key.
    open_paths = {"/health"}
    app.state.requests_in_flight = 0

    async def middleware(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if api_key and scope["path"] not in open_paths:
            given_key = headers.get(b"x-api-key", b"")
            if not (
                bearer_ok(headers.get(b"authorization", b""))
                or (given_key and x_api_key_ok(given_key))
            ):
                await _error_at(
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
            message = await receive()
            if message["type"] != "http.request":
                break
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


def _too_large(path: str, max_bytes: int, shape: ErrorBody | None) -> JSONResponse:
    return _error_at(
        path,
        413,
        "PayloadTooLarge",
        f"request body over the limit of {max_bytes} bytes: send smaller batches, or raise "
        "--max-request-bytes (LIGHTNING_MAX_REQUEST_BYTES)",
        shape,
    )


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidInput(f"unsupported Content-Encoding {encoding!r}; use gzip or none")
    try:
        d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = d.decompress(body, max_bytes + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise InvalidInput(f"body is not valid {encoding}: {exc}") from None
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"decompressed body over the limit of {max_bytes} bytes")
    return out


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
) -> Any:
    """The FastAPI app serving `store` and any `routers` beside it, wrapped in the auth and
    size-limit middleware. `on_start` runs before the first request, `on_close` at shutdown,
    before the store closes (when `close_store`); `details` adds to /health/details;
    `publishing` wraps the adding of each policy version (see Publishing)."""
    started = time.monotonic()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if on_start is not None:
            await on_start()
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
        response = _error_at(
            request.url.path, exc.status_code, type(exc).__name__, str(exc), error_body
        )
        response.headers.update(exc.headers())
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = _validation_message(exc)
        return _error_at(request.url.path, status, "InvalidInput", message, error_body)

    # The framework's own refusals (no such path, a method the path does not take) in the API's
    # error shape too, not Starlette's {"detail": ...}, which no client of ours parses.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message += f"; this path takes {exc.headers['Allow']}"
        response = _error_at(request.url.path, exc.status_code, kind, message, error_body)
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
            **(details() if details is not None else {}),
        }

    @app.post("/store/rollouts", response_model=list[Rollout])
    async def enqueue(body: EnqueueBody) -> Response:
        rollouts = await store.enqueue_rollouts(body.rollouts)
        return _json([r.model_dump(mode="json") for r in rollouts])

    @app.post("/store/rollouts/query", response_model=list[Rollout])
    async def query_rollouts(body: RolloutQuery) -> Response:
        rollouts = await store.query_rollouts(**body.model_dump())
        return _json([r.model_dump(mode="json") for r in rollouts])

    @app.get("/store/rollouts/{rollout_id}", response_model=Rollout)
    async def get_rollout(rollout_id: str) -> Response:
        return _json((await store.get_rollout(rollout_id)).model_dump(mode="json"))

    @app.post("/store/rollouts/{rollout_id}/cancel", response_model=Rollout)
    async def cancel(rollout_id: str) -> Response:
        return _json((await store.cancel_rollout(rollout_id)).model_dump(mode="json"))

    @app.get("/store/rollouts/{rollout_id}/attempts", response_model=list[Attempt])
    async def attempts(rollout_id: str) -> Response:
        return _json([a.model_dump(mode="json") for a in await store.query_attempts(rollout_id)])

    @app.post("/store/wait", response_model=list[Rollout])
    async def wait(body: WaitBody) -> Response:
        rollouts = await store.wait_for_rollouts(body.rollout_ids, body.timeout)
        return _json([r.model_dump(mode="json") for r in rollouts])

    @app.post("/store/dequeue", response_model=Claim | None)
    async def dequeue(body: DequeueBody) -> Response:
        claim = await store.dequeue(body.worker_id, body.wait)
        return _json(claim.model_dump(mode="json") if claim else None)

    @app.post("/store/attempts/{attempt_id}/heartbeat", response_model=Attempt)
    async def heartbeat(attempt_id: str) -> Response:
        return _json((await store.heartbeat(attempt_id)).model_dump(mode="json"))

    @app.post("/store/attempts/{attempt_id}/complete", response_model=Rollout)
    async def complete(attempt_id: str, body: CompleteBody) -> Response:
        rollout = await store.complete_attempt(attempt_id, body.reward)
        return _json(rollout.model_dump(mode="json"))

    @app.post("/store/attempts/{attempt_id}/fail", response_model=Rollout)
    async def fail(attempt_id: str, body: FailBody) -> Response:
        rollout = await store.fail_attempt(attempt_id, body.error, body.retry)
        return _json(rollout.model_dump(mode="json"))

    @app.post("/store/spans", response_model=Count)
    async def add_spans(body: SpansBody) -> Response:
        return _json({"count": await store.add_spans(body.spans)})

    @app.post("/store/spans/query", response_model=list[Span])
    async def query_spans(body: SpanQuery) -> Response:
        # The database worker answers with finished JSON: sent on without parsing.
        body = await store.query_spans_json(body.rollout_ids, body.attempt_id)
        return Response(body, media_type="application/json")

    @app.post("/store/transitions", response_model=Count)
    async def add_transitions(body: TransitionsBody) -> Response:
        return _json({"count": await store.add_transitions(body.transitions)})

    @app.post("/store/transitions/query", response_model=list[Transition])
    async def query_transitions(body: TransitionQuery) -> Response:
        transitions = await store.query_transitions(body.rollout_ids, body.policy_version)
        return _json([t.model_dump(mode="json") for t in transitions])

    @app.post("/store/policy-versions", response_model=PolicyVersion)
    async def add_policy_version(body: PolicyVersion) -> Response:
        if publishing is None:
            return _json((await store.add_policy_version(body)).model_dump(mode="json"))
        async with publishing(body):
            added = await store.add_policy_version(body)
        return _json(added.model_dump(mode="json"))

    @app.get("/store/policy-versions", response_model=list[PolicyVersion])
    async def list_policy_versions() -> Response:
        return _json([v.model_dump(mode="json") for v in await store.list_policy_versions()])

    @app.get("/store/policy-versions/{name}", response_model=PolicyVersion)
    async def get_policy_version(name: str) -> Response:
        return _json((await store.get_policy_version(name)).model_dump(mode="json"))

    # Production episodes and their feedback: the paths a production app calls, outside /store.

    @app.post("/episodes/{episode_id}", response_model=Attempt, summary="Open an episode")
    async def open_episode(episode_id: str, body: EpisodeBody) -> Response:
        attempt = await store.open_episode(
            episode_id, body.agent_name, body.policy_version, body.metadata
        )
        return _json(attempt.model_dump(mode="json"))

    @app.get("/episodes/{episode_id}", response_model=Episode, summary="An episode and feedback")
    async def get_episode(episode_id: str) -> Response:
        rollout = await store.get_episode(episode_id)
        feedback = await store.query_feedback(episode_ids=[episode_id])
        return _json(
            {
                "rollout": rollout.model_dump(mode="json"),
                "feedback": [f.model_dump(mode="json") for f in feedback],
            }
        )

    @app.post(
        "/episodes/{episode_id}/feedback",
        response_model=FeedbackReceipt,
        status_code=201,
        responses={200: {"model": FeedbackReceipt, "description": "unchanged or replaced"}},
        summary="Give an episode a reward (201 recorded; 200 unchanged or replaced)",
    )
    async def add_feedback(episode_id: str, body: FeedbackIn) -> Response:
        receipt = await store.add_feedback(episode_id, body)
        response = _json(receipt.model_dump(mode="json"))
        response.status_code = 201 if receipt.status == "recorded" else 200
        return response

    @app.get("/feedback", response_model=list[Feedback], summary="Feedback that counts, by window")
    async def feedback_window(
        after_seq: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
        through_seq: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None,
    ) -> Response:
        rows = await store.query_feedback(after_seq, through_seq)
        return _json([f.model_dump(mode="json") for f in rows])

    # The same with a body, where a list of episode ids fits (a query string of thousands
    # does not fit in a request line).
    @app.post("/feedback/query", response_model=list[Feedback], summary="Feedback that counts")
    async def query_feedback(body: FeedbackQuery) -> Response:
        rows = await store.query_feedback(body.after_seq, body.through_seq, body.episode_ids)
        return _json([f.model_dump(mode="json") for f in rows])

    @app.get("/feedback/watermark", response_model=Watermark, summary="Highest feedback seq")
    async def feedback_watermark() -> Response:
        return _json({"seq": await store.feedback_watermark()})

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
        body = _decompress(
            await request.body(),
            request.headers.get("content-encoding", "").lower(),
            max_request_bytes,
        )
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "application/x-protobuf":
            await store.add_spans(otlp.decode_protobuf(body))
            return Response(otlp.EMPTY_PROTOBUF_RESPONSE, media_type="application/x-protobuf")
        if content_type == "application/json":
            await store.add_spans(otlp.decode_json(body))
            return _json({})
        raise InvalidInput(
            f"Content-Type {content_type!r} is not OTLP: use application/x-protobuf or "
            "application/json"
        )

    return _limits_and_auth(app, max_request_bytes, api_key, error_body)
