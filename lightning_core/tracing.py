"""Tracing for agent code: rewards, tool results and operations as spans of the current rollout.

The only training-side API an agent may use. Outside a rollout (evaluation, production) every
call here is a no-op, so the same agent code runs anywhere.

How spans find their rollout: the runner enters `rollout_context(rollout_id, attempt_id)` around
the agent; a span processor stamps every span started inside it, whoever starts it (this
module, the agent's own OpenTelemetry code, or a framework instrumentation such as
OpenInference's, enabled by `setup_tracing` where installed), with `lightning.rollout_id` and
`lightning.attempt_id`. A batch processor then ships the stamped spans to the store, in process
or over OTLP/HTTP; spans from outside any rollout are dropped, not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from lightning_core import semconv
from lightning_core.errors import InvalidInput, LightningError
from lightning_core.security.keys import bearer_header
from lightning_core.types import Span, check_reward

log = logging.getLogger(__name__)

# Attribute values longer than this are cut: an operation's input can be a whole document.
MAX_ATTRIBUTE_CHARS = 4000


@dataclass(frozen=True)
class RolloutContext:
    rollout_id: str
    attempt_id: str


_current: ContextVar[RolloutContext | None] = ContextVar("lightning_rollout", default=None)
_provider: TracerProvider | None = None


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt_id: str) -> Iterator[RolloutContext]:
    """Everything traced inside belongs to this rollout attempt (asyncio tasks inherit it)."""
    token = _current.set(RolloutContext(rollout_id, attempt_id))
    try:
        yield _current.get()  # type: ignore[misc]
    finally:
        _current.reset(token)


def current_rollout() -> RolloutContext | None:
    return _current.get()


class RolloutStamper(SpanProcessor):
    """Stamps each span started inside a rollout context with the rollout and attempt ids."""

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        ctx = _current.get()
        if ctx is not None:
            span.set_attribute(semconv.ROLLOUT_ID, ctx.rollout_id)
            span.set_attribute(semconv.ATTEMPT_ID, ctx.attempt_id)


class OnlyRolloutSpans(SpanExporter):
    """Passes on the spans that belong to a rollout; the store has nowhere to put the others."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        kept = [s for s in spans if s.attributes and semconv.ATTEMPT_ID in s.attributes]
        return self._inner.export(kept) if kept else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


_KINDS = {
    trace.SpanKind.INTERNAL: "internal",
    trace.SpanKind.SERVER: "server",
    trace.SpanKind.CLIENT: "client",
    trace.SpanKind.PRODUCER: "producer",
    trace.SpanKind.CONSUMER: "consumer",
}
_STATUS = {StatusCode.UNSET: "unset", StatusCode.OK: "ok", StatusCode.ERROR: "error"}


def to_store_span(s: ReadableSpan) -> Span:
    """An OpenTelemetry SDK span as the store's Span (it must carry the rollout ids)."""
    attributes = dict(s.attributes or {})
    return Span(
        rollout_id=str(attributes[semconv.ROLLOUT_ID]),
        attempt_id=str(attributes[semconv.ATTEMPT_ID]),
        trace_id=f"{s.context.trace_id:032x}",
        span_id=f"{s.context.span_id:016x}",
        parent_id=f"{s.parent.span_id:016x}" if s.parent else None,
        name=s.name,
        kind=_KINDS.get(s.kind, "internal"),
        start_time=(s.start_time or 0) / 1e9,
        end_time=s.end_time / 1e9 if s.end_time else None,
        status_code=_STATUS.get(s.status.status_code, "unset"),
        status_message=s.status.description,
        attributes={k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()},
        events=[
            {"name": e.name, "timestamp": e.timestamp / 1e9, "attributes": dict(e.attributes or {})}
            for e in s.events
        ],
        resource=dict(s.resource.attributes) if s.resource else {},
    )


class StoreSpanExporter(SpanExporter):
    """Exports into an in-process store that lives on an event loop in another thread."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0):
        self._store, self._loop, self._timeout = store, loop, timeout_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        future = asyncio.run_coroutine_threadsafe(
            self._store.add_spans([to_store_span(s) for s in spans]), self._loop
        )
        try:
            future.result(self._timeout)
        except (LightningError, TimeoutError) as exc:
            log.warning("could not store %d spans: %s", len(spans), exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def setup_tracing(
    server_url: str | None = None,
    *,
    store: Any = None,
    loop: asyncio.AbstractEventLoop | None = None,
    api_key: str | None = None,
    provider: TracerProvider | None = None,
    instrument: bool = True,
    schedule_delay_ms: int = 200,
) -> TracerProvider:
    """Ship spans of rollouts to the store: over OTLP/HTTP to `server_url`, or to an in-process
    `store` running on `loop`. Returns the provider (also made the global one if none is set).

    With `instrument`, the OpenInference instrumentors that are installed (openai, langchain,
    autogen, openai-agents) are enabled, so framework spans land on the rollout too.
    """
    global _provider
    if (server_url is None) == (store is None):
        raise InvalidInput("setup_tracing needs exactly one of server_url or store")
    provider = provider or TracerProvider()
    provider.add_span_processor(RolloutStamper())
    if server_url is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        headers = bearer_header(api_key) or None
        exporter: SpanExporter = OTLPSpanExporter(
            endpoint=f"{server_url.rstrip('/')}/v1/traces", headers=headers
        )
    else:
        exporter = StoreSpanExporter(store, loop or asyncio.get_running_loop())
    provider.add_span_processor(
        BatchSpanProcessor(OnlyRolloutSpans(exporter), schedule_delay_millis=schedule_delay_ms)
    )
    _provider = provider
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    if instrument:
        instrument_frameworks(provider)
    return provider


# OpenInference instrumentors: (module, class) for each framework, enabled when installed.
_INSTRUMENTORS = (
    ("openinference.instrumentation.openai", "OpenAIInstrumentor"),
    ("openinference.instrumentation.langchain", "LangChainInstrumentor"),
    ("openinference.instrumentation.autogen_agentchat", "AutogenAgentChatInstrumentor"),
    ("openinference.instrumentation.openai_agents", "OpenAIAgentsInstrumentor"),
)


def instrument_frameworks(provider: TracerProvider) -> list[str]:
    """Enable the installed framework instrumentations; returns the ones enabled."""
    enabled = []
    for module, cls in _INSTRUMENTORS:
        try:
            if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
                continue
        except ModuleNotFoundError:  # a parent package (openinference) is not installed at all
            continue
        try:
            instrumentor = getattr(importlib.import_module(module), cls)()
            if not instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.instrument(tracer_provider=provider)
            enabled.append(cls)
        except (ImportError, AttributeError) as exc:
            log.debug("instrumentor %s unavailable: %s", cls, exc)
    return enabled


def flush(timeout_s: float = 30.0) -> bool:
    """Send every finished span now; a runner calls this before completing an attempt."""
    if _provider is None:
        return True
    return _provider.force_flush(int(timeout_s * 1000))


def _tracer() -> trace.Tracer:
    return (_provider or trace.get_tracer_provider()).get_tracer("lightning-rl")


def _clip(value: Any) -> Any:
    if isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_ATTRIBUTE_CHARS else text[:MAX_ATTRIBUTE_CHARS] + "…"


def emit_reward(value: float, name: str = "reward", primary: bool = True, **attributes) -> None:
    """Record a reward at this point of the rollout.

    Several named rewards may be emitted; the last primary one is the episode's return, the
    others are intermediate rewards on the step they follow. The value must be within the
    reward range (types.check_reward): refused here already, not by the store after the agent ran.
    """
    value = check_reward(value, "a reward")
    if _current.get() is None:
        return
    fields = {semconv.REWARD_VALUE: value, semconv.REWARD_NAME: name}
    fields[semconv.REWARD_PRIMARY] = primary
    with _tracer().start_as_current_span(semconv.REWARD_SPAN, attributes=fields) as span:
        span.set_attributes({k: _clip(v) for k, v in attributes.items()})


def emit_tool_result(
    name: str, success: bool, output: Any = None, error: str | None = None, **attributes
) -> None:
    """Record the outcome of a tool call (AIR turns these into intermediate rewards)."""
    if _current.get() is None:
        return
    fields: dict[str, Any] = {semconv.TOOL_NAME: name, semconv.TOOL_SUCCESS: bool(success)}
    if output is not None:
        fields["lightning.tool.output"] = _clip(output)
    with _tracer().start_as_current_span(semconv.TOOL_SPAN, attributes=fields) as span:
        span.set_attributes({k: _clip(v) for k, v in attributes.items()})
        if not success:
            span.set_status(Status(StatusCode.ERROR, error or "tool call failed"))


def operation(fn: Callable | None = None, *, name: str | None = None) -> Callable:
    """Decorator: trace each call of a function (sync or async) as a span with its inputs,
    output and any exception."""

    def wrap(func: Callable) -> Callable:
        span_name = f"{semconv.OPERATION_SPAN_PREFIX}.{name or func.__qualname__}"

        def start(args: tuple, kwargs: dict) -> Any:
            inputs = {f"lightning.operation.input.{i}": _clip(a) for i, a in enumerate(args)}
            inputs |= {f"lightning.operation.input.{k}": _clip(v) for k, v in kwargs.items()}
            return _tracer().start_as_current_span(span_name, attributes=inputs)

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_traced(*args: Any, **kwargs: Any) -> Any:
                with start(args, kwargs) as span:
                    result = await func(*args, **kwargs)
                    span.set_attribute("lightning.operation.output", _clip(result))
                    return result

            return async_traced

        @functools.wraps(func)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with start(args, kwargs) as span:
                result = func(*args, **kwargs)
                span.set_attribute("lightning.operation.output", _clip(result))
                return result

        return traced

    return wrap(fn) if fn is not None else wrap
