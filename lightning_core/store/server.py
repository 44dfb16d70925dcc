"""The store's HTTP API: a FastAPI app over any LightningStore, plus an OTLP/HTTP traces endpoint.

Every user error is answered with a 4xx and a body `{"error": {"type", "message"}}`; `type` names
the exception class from `lightning_core.errors`, which the Python client raises again.

The store knows nothing of the gateway: `create_store_app` takes routers to mount beside its
own, hooks to run at start and close, and an `ErrorBody` that may answer errors on other paths
in their API's own shape (lightning_core/app.py joins the two).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import anyio
import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_core.errors import InvalidInput, LightningError
from lightning_core.security.keys import check_span_owner
from lightning_core.serving.http_edge import HttpLimits
from lightning_core.store import otlp
from lightning_core.store.base import MAX_PAGE_SIZE, NEXT_PAGE_HEADER, PAGE_SIZE
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.middleware import SPAN_ATTEMPT, ErrorBody, error_at, limits_and_auth
from lightning_core.store.schema import check_json_depth
from lightning_core.types import (
    Attempt,
    Claim,
    Feedback,
    FeedbackIn,
    FeedbackReceipt,
    FiniteFloat,
    Labels,
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


def _each_once(ids: list[str]) -> list[str]:
    # 100 long polls on 10,000 copies of one id cost 190 ms of the loop per finished rollout,
    # each rescanning its copies; the same id twice asks nothing more.
    return list(dict.fromkeys(ids))


QueryIds = Annotated[
    list[str],
    Field(
        max_length=MAX_QUERY_IDS,
        description=f"At most {MAX_QUERY_IDS}; ask in batches. Each id counts once.",
    ),
    AfterValidator(_each_once),
]
PageLimit = Annotated[
    int | None,
    Field(
        ge=0,
        le=MAX_PAGE_SIZE,
        description=f"Items in this page, at most {MAX_PAGE_SIZE}; null: {PAGE_SIZE}. When more "
        f"are left the answer's {NEXT_PAGE_HEADER} header is the cursor to send as `after`.",
    ),
]
PageCursor = Annotated[
    str | None,
    Field(
        max_length=1000,
        description=f"The {NEXT_PAGE_HEADER} header of the previous page; null: the first.",
    ),
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
    limit: PageLimit = None
    after: PageCursor = None


class WaitBody(BaseModel):
    rollout_ids: QueryIds
    timeout: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class SpansBody(BaseModel):
    spans: list[Span]


class SpanQuery(BaseModel):
    rollout_ids: QueryIds
    attempt_id: str | None = Field(None, description='An attempt id, "latest" or null for all.')
    limit: PageLimit = None
    after: PageCursor = None


class TransitionsBody(BaseModel):
    transitions: list[Transition]


class TransitionQuery(BaseModel):
    rollout_ids: QueryIds | None = None
    policy_version: str | None = None
    limit: PageLimit = None
    after: PageCursor = None


class Count(BaseModel):
    count: int


class EpisodeBody(BaseModel):
    agent_name: str | None = Field(None, description="The agent of the first call.")
    policy_version: str | None = Field(None, description="The policy that served it.")
    metadata: Labels = Field(default_factory=dict, description="Free-form labels.")


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
    limit: PageLimit = None
    after: PageCursor = None


class _OrjsonRequest(Request):
    """Request bodies parsed with orjson: twice as fast as the json module on 2 MB of spans.

    On the event loop, not in a thread: orjson holds the GIL for the whole parse (25 ms a MB;
    1.5 s for 62 MB), so a thread would stall the loop just as long. The body's size bounds it.
    """

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


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _page(body: bytes, following: str | None) -> Response:
    """A page of a query (a JSON array), with the cursor of the next one when one is left."""
    headers = {NEXT_PAGE_HEADER: following} if following is not None else None
    return Response(body, media_type="application/json", headers=headers)


def _page_size(limit: int | None) -> int:
    return PAGE_SIZE if limit is None else limit


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
            **(details() if details is not None else {}),
        }

    @app.post("/store/rollouts", response_model=list[Rollout])
    async def enqueue(body: EnqueueBody) -> Response:
        rollouts = await store.enqueue_rollouts(body.rollouts)
        return _json([r.model_dump(mode="json") for r in rollouts])

    @app.post("/store/rollouts/query", response_model=list[Rollout])
    async def query_rollouts(body: RolloutQuery) -> Response:
        query = body.model_dump()
        query["limit"] = _page_size(body.limit)
        rollouts, following = await store.query_rollouts_page(**query)
        return _page(orjson.dumps([r.model_dump(mode="json") for r in rollouts]), following)

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
    async def add_spans(body: SpansBody, request: Request) -> Response:
        check_span_owner(_span_attempt(request), (span.attempt_id for span in body.spans))
        return _json({"count": await store.add_spans(body.spans)})

    @app.post("/store/spans/query", response_model=list[Span])
    async def query_spans(body: SpanQuery) -> Response:
        # The database worker answers with finished JSON: sent on without parsing.
        return _page(
            *await store.query_spans_json(
                body.rollout_ids, body.attempt_id, _page_size(body.limit), body.after
            )
        )

    @app.post("/store/transitions", response_model=Count)
    async def add_transitions(body: TransitionsBody) -> Response:
        return _json({"count": await store.add_transitions(body.transitions)})

    @app.post("/store/transitions/query", response_model=list[Transition])
    async def query_transitions(body: TransitionQuery) -> Response:
        return _page(
            *await store.query_transitions_json(
                body.rollout_ids, body.policy_version, _page_size(body.limit), body.after
            )
        )

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
        limit: Annotated[int | None, Query(ge=0, le=MAX_PAGE_SIZE)] = None,
        after: Annotated[str | None, Query(max_length=1000)] = None,
    ) -> Response:
        return _page(
            *await store.query_feedback_json(after_seq, through_seq, None, _page_size(limit), after)
        )

    # The same with a body, where a list of episode ids fits (a query string of thousands
    # does not fit in a request line).
    @app.post("/feedback/query", response_model=list[Feedback], summary="Feedback that counts")
    async def query_feedback(body: FeedbackQuery) -> Response:
        return _page(
            *await store.query_feedback_json(
                body.after_seq,
                body.through_seq,
                body.episode_ids,
                _page_size(body.limit),
                body.after,
            )
        )

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
        check_span_owner(_span_attempt(request), (span.attempt_id for span in spans))
        await store.add_spans(spans)
        if content_type == "application/json":
            return _json({})
        return Response(otlp.EMPTY_PROTOBUF_RESPONSE, media_type="application/x-protobuf")

    return limits_and_auth(app, max_request_bytes, api_key, error_body, limits.body_timeout_s)
