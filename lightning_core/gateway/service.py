"""The gateway's one call path: chat messages in, token ids through a backend, spans recorded.

Every client API the gateway speaks (OpenAI chat completions and responses, Anthropic messages)
is a thin translator onto `Gateway.chat_result` / `Gateway.chat_stream`, which take OpenAI-shaped
chat messages and tools (`ChatCall`), render and tokenize them, run the backend, parse tool calls
and record one span per call. So every API gets the same exact token ids on its span, streamed
or not. Text completions (`/v1/completions`) take token ids or text directly (openai_api.py).

Each call inside a rollout attempt becomes one span in the store (see spans.py). A call on the
plain routes that names a production episode (X-Lightning-Episode, or metadata.episode_id) is
recorded the same way on that episode's attempt, which the store opens on its first call
(`GatewayConfig.capture` says which plain calls are kept); other calls outside a rollout
(evaluation, plain serving) are answered the same way and recorded nowhere. The `model`
of a request names the policy version: the base model, a loaded LoRA adapter, or a policy
version registered in the store, whose adapter is then loaded on first use. A version with one
policy per agent (`agent_policies`) serves each named agent's calls with that agent's own version,
picked by the agent name the call carries, and records that version on the call's span.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import Field

from lightning_core.backends.base import (
    Backend,
    Choice,
    GenerationRequest,
    SamplingParams,
    StreamDelta,
)
from lightning_core.backends.grammar_limits import check_constraint
from lightning_core.backends.text import IncrementalText
from lightning_core.errors import InvalidInput
from lightning_core.gateway import chat as chat_format
from lightning_core.gateway.limits import CallLimits, CallSlot, chars_per_token
from lightning_core.gateway.loading import AdapterLoading
from lightning_core.gateway.protocol import model_object
from lightning_core.gateway.routing import Routed
from lightning_core.gateway.spans import LLMCall, llm_call_span
from lightning_core.security.adapter_folder import AdapterRules
from lightning_core.serving.offload import off_loop
from lightning_core.store.base import SpanRecorder
from lightning_core.types import episode_rollout_id


class GatewayConfig(AdapterRules):
    """How the gateway answers, and which adapters it loads (AdapterRules)."""

    default_max_tokens: int = Field(
        512, ge=1, description="Completion length when a request sets no max_tokens."
    )
    tool_format: chat_format.ToolFormat = Field(
        "auto",
        description="How tools reach a chat template that does not render them: hermes "
        "(<tool_call> JSON), line (`NAME: input` lines, for models too small to write JSON) or "
        "auto (the template's own tool rendering when it has one, else hermes).",
    )
    record_messages: bool = Field(
        True,
        description="Also store the chat messages and answers as text on each span "
        "(gen_ai.input.messages / gen_ai.output.messages), for reading traces.",
    )
    # Limits (gateway/limits.py). The example agents ask for far less (prompts under 2k tokens,
    # max_tokens 32-128, n=1, under 20 calls a rollout); one runaway agent asks for far more.
    max_prompt_tokens: int = Field(
        32768,
        ge=1,
        description="Longest prompt one call may send, in tokens; longer is refused with a 400.",
    )
    max_generation_tokens: int = Field(
        32768,
        ge=1,
        description="Most tokens one call may ask to generate, n x max_tokens (over all prompts "
        "of a completions batch); more is refused with a 400. Allows n=64 at the default "
        "max_tokens.",
    )
    max_concurrent_calls_per_rollout: int = Field(
        16,
        ge=1,
        description="Calls one rollout attempt may have running at once; one more is refused "
        "with a 429, which the OpenAI and Anthropic clients retry after a backoff.",
    )
    max_calls_per_rollout: int = Field(
        1024,
        ge=1,
        description="LLM calls one rollout attempt may make in all; past it a 429 that clients "
        "do not retry (x-should-retry: false) stops an agent that loops without end. Not "
        "applied to production episodes (gateway/limits.py says why).",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Request model names served as another model or policy version, e.g. "
        '{"champion": "lightning-calc-v3"}: clients keep one name while what it serves changes; '
        "spans record the version that answered.",
    )
    capture: Literal["episodes", "all", "off"] = Field(
        "episodes",
        description="Which calls on the plain /v1 routes are kept in the store as production "
        "episodes: episodes (calls naming one with X-Lightning-Episode or metadata.episode_id), "
        "all (every call; one without an id is an episode of its own, its new id in the "
        "answer's X-Lightning-Episode header) or off (none). Calls under a rollout prefix are "
        "always recorded.",
    )


@dataclass
class CallContext:
    """Where a call comes from: its rollout attempt (if any), agent name and trace context.

    `episode_id`: the production episode the call is kept in (plain routes only); once the
    episode is open (`Gateway.admit`), `rollout_id` and `attempt_id` are its own.
    `policy_version`: the version that answers it, once picked (`Gateway.route`).
    """

    rollout_id: str | None = None
    attempt_id: str | None = None
    agent_name: str | None = None
    traceparent: str | None = None
    episode_id: str | None = None
    policy_version: str | None = None


@dataclass
class ChatCall:
    """One chat call, whichever API it came in through, in OpenAI's chat vocabulary."""

    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    # The function tools the model may call now (after tool_choice), OpenAI-shaped.
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    # The client API the call came in through, recorded on its span.
    api: str = "chat.completions"


@dataclass
class ChatChoice:
    """One answer of a chat call: the backend's tokens and what they say."""

    index: int
    generated: Choice
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """stop, length or tool_calls (OpenAI's words; each API translates them)."""
        return "tool_calls" if self.tool_calls else self.generated.finish_reason

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message."""
        if self.tool_calls:
            return {"role": "assistant", "content": self.content, "tool_calls": self.tool_calls}
        return {"role": "assistant", "content": self.text}


@dataclass
class ChatResult:
    response_id: str
    created: float
    prompt_tokens: int
    choices: list[ChatChoice]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.generated.token_ids) for c in self.choices)


@dataclass
class TextDelta:
    """Streamed: text of choice `index` that can no longer change, and the tokens behind it."""

    index: int
    text: str
    delta: StreamDelta


@dataclass
class ChoiceEnd:
    """Streamed: choice `index` is finished; `rest` is its text not sent as deltas (none when
    it called tools and text went out already)."""

    index: int
    choice: ChatChoice
    rest: str


ChatEvent = TextDelta | ChoiceEnd | ChatResult


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


T = TypeVar("T")


def held(slot: CallSlot, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """`events`, with the call's slot released when they end, fail or are closed, and also
    when the stream is dropped without being read (a client gone before the first byte)."""

    async def run() -> AsyncIterator[T]:
        try:
            async for event in events:
                yield event
        finally:
            slot.release()

    stream = run()
    weakref.finalize(stream, slot.release)
    return stream


class Gateway(Routed, AdapterLoading):
    """Serves a Backend behind client APIs and records rollout calls through a span recorder."""

    def __init__(
        self,
        backend: Backend,
        store: SpanRecorder | None = None,
        config: GatewayConfig | None = None,
    ) -> None:
        self.backend = backend
        self.store = store
        self.config = config or GatewayConfig()
        self.limits = CallLimits(
            max_prompt_tokens=self.config.max_prompt_tokens,
            max_generation_tokens=self.config.max_generation_tokens,
            max_concurrent_calls=self.config.max_concurrent_calls_per_rollout,
            max_calls=self.config.max_calls_per_rollout,
        )
        self._loading = asyncio.Lock()
        # Policy versions never change once registered, so their agent maps are kept after the
        # first lookup: an agent's calls then skip the store.
        self._agent_policies: dict[str, dict[str, str]] = {}
        self._adapter_hashes: dict[str, str] = {}  # AdapterLoading's

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @functools.cached_property
    def chars_per_token(self) -> int:
        return chars_per_token(self.tokenizer)

    def check_prompt_text(self, chars: int) -> None:
        """400 for prompt text too long to tokenize (limits.CHARS_PER_TOKEN)."""
        self.limits.check_text(chars, self.chars_per_token)

    # ------------------------------------------------------------------ models

    def models(self) -> dict[str, Any]:
        base = self.backend.base_model
        data = [model_object(base)]
        data += [model_object(name, parent=base) for name in self.backend.adapters()]
        return {"object": "list", "data": data}

    @staticmethod
    def affinity(ctx: CallContext) -> str | None:
        """A call's routing key (GenerationRequest.affinity): its rollout, whose calls (a
        retried attempt's too) share their prompt prefixes; or its production episode."""
        return ctx.rollout_id or ctx.episode_id

    def episode_for(self, given: Any) -> str | None:
        """The episode a plain call is kept in: `given` (the header's or metadata's id, checked:
        InvalidInput for a bad one, whatever the capture), a new id when every call is
        captured, or None when the call is not kept (capture off, or no store to keep it in)."""
        if given is not None:
            episode_rollout_id(given)
        if self.store is None or self.config.capture == "off":
            return None
        if given is None and self.config.capture == "all":
            return uuid.uuid4().hex
        return given

    def check_rollout(self, ctx: CallContext) -> None:
        if ctx.rollout_id is None:
            return
        if self.store is None:
            raise InvalidInput("this gateway has no store: call /v1/... without a rollout")
        self.store.check_attempt(ctx.rollout_id, ctx.attempt_id or "")

    def record(self, ctx: CallContext, call: LLMCall) -> None:
        if ctx.rollout_id is None or self.store is None:
            return
        self.store.add_spans_nowait([llm_call_span(call)])

    def max_tokens(self, asked: int | None) -> int:
        return asked or self.config.default_max_tokens

    def llm_call(
        self,
        ctx: CallContext,
        *,
        operation: str,
        api: str,
        model: str,
        response_id: str,
        request: GenerationRequest,
        choices: list[Choice],
        start: float,
        input_messages: Any,
        output_messages: Any,
    ) -> LLMCall:
        record = self.config.record_messages
        return LLMCall(
            rollout_id=ctx.rollout_id or "",
            attempt_id=ctx.attempt_id or "",
            operation=operation,
            api=api,
            request_model=model,
            policy_version=request.adapter or self.backend.base_model,
            adapter_hash=self.adapter_hash(request.adapter),
            template_fingerprint=self._template_fingerprint,
            response_id=response_id,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            choices=choices,
            start_time=start,
            end_time=time.time(),
            agent_name=ctx.agent_name,
            traceparent=ctx.traceparent,
            input_messages=input_messages if record else None,
            output_messages=output_messages if record else None,
        )

    # ------------------------------------------------------------------ chat

    @property
    def tool_format(self) -> chat_format.ToolFormat | None:
        return chat_format.resolve_tool_format(self.tokenizer, self.config.tool_format)

    async def _prepare(self, call: ChatCall, ctx: CallContext) -> GenerationRequest:
        self.check_rollout(ctx)
        adapter = await self.route(call.model, ctx)
        request = GenerationRequest(
            prompt_token_ids=await off_loop(self._chat_prompt, call),
            params=call.params,
            n=call.n,
            adapter=adapter,
            affinity=self.affinity(ctx),
        )
        self.limits.check_size(len(request.prompt_token_ids), call.n, call.params.max_new_tokens)
        return request

    def _chat_prompt(self, call: ChatCall) -> list[int]:
        """The call's prompt token ids, its limits checked first (on a worker thread)."""
        check_constraint(call.params.constraint)
        # The prompt holds all the messages' text: too much of it is refused unrendered.
        self.check_prompt_text(sum(map(chat_format.text_size, call.messages)))
        prompt = chat_format.render_chat(
            self.tokenizer, call.messages, call.tools, self.config.tool_format
        )
        self.check_prompt_text(len(prompt))
        return chat_format.encode(self.tokenizer, prompt)

    async def admit(self, ctx: CallContext, request: GenerationRequest) -> CallSlot:
        """Open the call's production episode, if it has one, so that it is recorded there;
        then count the call on its attempt (429 past the attempt's limits). Release the slot
        when the call has finished. Called once the request is known to be servable, so a
        refused call leaves no empty episode behind."""
        ended = None  # an episode's call: feedback on the episode waits for it (episodes.py)
        if ctx.episode_id is not None and ctx.rollout_id is None and self.store is not None:
            attempt, ended = await self.store.open_episode_call(
                ctx.episode_id,
                agent_name=ctx.agent_name,
                policy_version=request.adapter or self.backend.base_model,
            )
            ctx.rollout_id, ctx.attempt_id = attempt.rollout_id, attempt.attempt_id
        # Episode calls are not capped in number (limits.py): a long session is no runaway loop.
        return self.limits.admit(ctx.rollout_id, ctx.attempt_id, ctx.episode_id is None, ended)

    def _chat_choice(
        self, index: int, generated: Choice, tools: list[dict[str, Any]] | None
    ) -> ChatChoice:
        text = self.tokenizer.decode(generated.token_ids, skip_special_tokens=True)
        if tools:
            content, calls = chat_format.parse_tool_calls(text, tools, self.tool_format)
            if calls:
                return ChatChoice(index, generated, text, content, calls)
        return ChatChoice(index, generated, text, text)

    def _record_chat(
        self, call: ChatCall, ctx: CallContext, request: GenerationRequest, result: ChatResult
    ) -> None:
        self.record(
            ctx,
            self.llm_call(
                ctx,
                operation="chat",
                api=call.api,
                model=call.model,
                response_id=result.response_id,
                request=request,
                choices=[c.generated for c in result.choices],
                start=result.created,
                input_messages=call.messages,
                output_messages=[c.message() for c in result.choices],
            ),
        )

    async def chat_result(
        self, call: ChatCall, ctx: CallContext, id_prefix: str = "chatcmpl-"
    ) -> ChatResult:
        """Answer a chat call whole, and record it."""
        request = await self._prepare(call, ctx)
        slot = await self.admit(ctx, request)
        start = time.time()
        try:
            generated = await self.backend.generate(request)
        finally:
            slot.release()
        result = ChatResult(
            response_id=new_id(id_prefix),
            created=start,
            prompt_tokens=len(request.prompt_token_ids),
            choices=[self._chat_choice(i, g, call.tools) for i, g in enumerate(generated)],
        )
        self._record_chat(call, ctx, request, result)
        return result

    async def chat_stream(
        self, call: ChatCall, ctx: CallContext, id_prefix: str = "chatcmpl-"
    ) -> tuple[str, float, int, AsyncIterator[ChatEvent]]:
        """Start a streamed chat call: (response id, start time, prompt tokens, its events).

        Errors found before generation (unknown model, bad rollout, a limit passed) raise
        here, before a client sees a stream start; the backend's own refusals raise from the
        events. The events are TextDelta (text that can no longer change), one ChoiceEnd per
        choice and, last, the whole ChatResult, once the call is recorded. Text that may begin
        a tool call is held back until the end.
        """
        request = await self._prepare(call, ctx)
        singles = self.per_choice(request, call.n)
        slot = await self.admit(ctx, request)
        response_id, start = new_id(id_prefix), time.time()
        return (
            response_id,
            start,
            len(request.prompt_token_ids),
            held(slot, self._chat_events(call, ctx, request, singles, response_id, start)),
        )

    async def _chat_events(
        self,
        call: ChatCall,
        ctx: CallContext,
        request: GenerationRequest,
        singles: list[GenerationRequest],
        response_id: str,
        start: float,
    ) -> AsyncIterator[ChatEvent]:
        tools = call.tools
        hold_all = bool(tools) and self.tool_format == "line"
        markers = [chat_format.TOOL_CALL_OPEN] if tools else []
        texts = [IncrementalText(self.tokenizer, hold=markers, hold_all=hold_all) for _ in singles]
        logprobs: list[list[float]] = [[] for _ in singles]
        tops: list[list] = [[] for _ in singles]
        ends: list[ChatChoice | None] = [None] * len(singles)
        async for i, delta in self.merged_streams(singles):
            texts[i].push(delta.token_ids)
            text = texts[i].take()
            logprobs[i].extend(delta.logprobs)
            tops[i].extend(delta.top_logprobs or [])
            if text or delta.token_ids:
                yield TextDelta(i, text, delta)
            if delta.finish_reason is not None:
                generated = Choice(
                    token_ids=texts[i].token_ids,
                    logprobs=logprobs[i],
                    top_logprobs=tops[i] or None,
                    finish_reason=delta.finish_reason,
                    stop_sequence=delta.stop_sequence,
                )
                choice = ends[i] = self._chat_choice(i, generated, tools)
                if choice.tool_calls:
                    rest = choice.content or "" if not texts[i].sent else ""
                else:
                    rest = texts[i].rest()
                yield ChoiceEnd(i, choice, rest)
        result = ChatResult(
            response_id=response_id,
            created=start,
            prompt_tokens=len(request.prompt_token_ids),
            choices=[c for c in ends if c is not None],
        )
        self._record_chat(call, ctx, request, result)
        yield result

    # ------------------------------------------------------------------ streaming helpers

    async def merged_streams(
        self, requests: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Deltas of several single-completion streams, tagged with their index, as they come."""
        queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: GenerationRequest) -> None:
            try:
                async for delta in self.backend.stream(request):
                    await queue.put((index, delta))
            except BaseException as exc:  # surfaced to the consumer below
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    @staticmethod
    def per_choice(request: GenerationRequest, n: int) -> list[GenerationRequest]:
        """n single-completion requests; seeds differ so that the samples do too."""
        seed = request.params.seed
        return [
            request.model_copy(
                update={
                    "n": 1,
                    "params": request.params.model_copy(
                        update={"seed": None if seed is None else seed + i}
                    ),
                }
            )
            for i in range(n)
        ]
