"""The gateway: OpenAI chat and text completions over a token-id backend, recorded as spans.

Each call inside a rollout attempt becomes one span in the store (see spans.py) with the token
ids the backend consumed and produced; calls outside a rollout (evaluation, plain serving) are
answered the same way and recorded nowhere. The `model` of a request names the policy version:
the base model, a loaded LoRA adapter, or a policy version registered in the store, whose
adapter is then loaded on first use.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, Field

from lightning_core.backends.base import Backend, Choice, GenerationRequest, StreamDelta
from lightning_core.errors import InvalidInput, LightningError, NotFound
from lightning_core.gateway import chat as chat_format
from lightning_core.gateway.protocol import ChatCompletionRequest, CompletionRequest, model_object
from lightning_core.gateway.spans import LLMCall, llm_call_span
from lightning_core.store.duckdb_store import DuckDBStore


class GatewayConfig(BaseModel):
    """How the gateway answers."""

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


@dataclass
class CallContext:
    """Where a call comes from: its rollout attempt (if any), agent name and trace context."""

    rollout_id: str | None = None
    attempt_id: str | None = None
    agent_name: str | None = None
    traceparent: str | None = None


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _IncrementalText:
    """Turns streamed token ids into text deltas, never sending text that may still change.

    Decoding the whole prefix each time keeps multi-byte characters and merges right; a
    trailing replacement character (half a UTF-8 sequence) waits for the next token. With tools
    offered, text from a `<tool_call>` tag on (or a suffix that may start one) is held back: it
    is sent as tool_calls at the end.
    """

    def __init__(self, tokenizer: Any, hold_tool_calls: bool, hold_all: bool = False) -> None:
        self._tokenizer = tokenizer
        self._hold = hold_tool_calls
        # A line-format call can start on any line, so nothing is sent before the end.
        self._hold_all = hold_tool_calls and hold_all
        self.token_ids: list[int] = []
        self.sent = 0

    def text(self) -> str:
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = self.text()
        safe = len(text.rstrip("\ufffd"))
        if self._hold_all:
            return ""
        if self._hold:
            tag = text.find(chat_format.TOOL_CALL_OPEN)
            if tag >= 0:
                safe = min(safe, tag)
            else:
                for k in range(len(chat_format.TOOL_CALL_OPEN) - 1, 0, -1):
                    if text[:safe].endswith(chat_format.TOOL_CALL_OPEN[:k]):
                        safe -= k
                        break
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta


class Gateway:
    """Serves a Backend with OpenAI semantics and records rollout calls into a store."""

    def __init__(
        self,
        backend: Backend,
        store: DuckDBStore | None = None,
        config: GatewayConfig | None = None,
    ) -> None:
        self.backend = backend
        self.store = store
        self.config = config or GatewayConfig()
        self._loading = asyncio.Lock()

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    # ------------------------------------------------------------------ models

    def models(self) -> dict[str, Any]:
        base = self.backend.base_model
        data = [model_object(base)]
        data += [model_object(name, parent=base) for name in self.backend.adapters()]
        return {"object": "list", "data": data}

    async def _adapter_for(self, model: str) -> str | None:
        """The adapter serving `model` (None: the base model), loading a registered one."""
        if model == self.backend.base_model:
            return None
        if model in self.backend.adapters():
            return model
        version = None
        if self.store is not None:
            try:
                version = await self.store.get_policy_version(model)
            except NotFound:
                version = None
        if version is None:
            served = [self.backend.base_model, *self.backend.adapters()]
            raise NotFound(
                f"model {model!r} is not served here; served: {', '.join(served)} "
                "(or any policy version registered in the store)"
            )
        if version.adapter_path is None:
            return None
        async with self._loading:
            if model not in self.backend.adapters():
                await self.backend.load_adapter(model, version.adapter_path)
        return model

    def _check_rollout(self, ctx: CallContext) -> None:
        if ctx.rollout_id is None:
            return
        if self.store is None:
            raise InvalidInput("this gateway has no store: call /v1/... without a rollout")
        self.store.check_attempt(ctx.rollout_id, ctx.attempt_id or "")

    def _record(self, ctx: CallContext, call: LLMCall) -> None:
        if ctx.rollout_id is None or self.store is None:
            return
        self.store.add_spans_nowait([llm_call_span(call)])

    def _max_tokens(self, asked: int | None) -> int:
        return asked or self.config.default_max_tokens

    # ------------------------------------------------------------------ formatting

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[float], top: list | None
    ) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            item = entry(token_id, logprob)
            item["top_logprobs"] = [entry(t, lp) for t, lp in top[k]] if top else []
            content.append(item)
        return {"content": content, "refusal": None}

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[float], top: list | None, offset: int = 0
    ) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": [{self._token_text(t): lp for t, lp in row} for row in top]
            if top
            else None,
            "text_offset": offsets,
        }

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    # ------------------------------------------------------------------ chat

    async def chat(
        self, req: ChatCompletionRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        self._check_rollout(ctx)
        adapter = await self._adapter_for(req.model)
        tools = req.offered_tools()
        prompt_ids = chat_format.encode(
            self.tokenizer,
            chat_format.render_chat(self.tokenizer, req.messages, tools, self.config.tool_format),
        )
        params = req.sampling(self._max_tokens(req.token_limit()), req.top_logprobs or 0)
        request = GenerationRequest(
            prompt_token_ids=prompt_ids, params=params, n=req.n, adapter=adapter
        )
        if req.stream:
            return self._chat_stream(req, ctx, request, tools)
        start = time.time()
        choices = await self.backend.generate(request)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        out = []
        for i, choice in enumerate(choices):
            message, finish = self._chat_message(choice.token_ids, tools)
            out.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish or choice.finish_reason,
                    "logprobs": self._chat_logprobs(
                        choice.token_ids, choice.logprobs, choice.top_logprobs
                    )
                    if req.logprobs
                    else None,
                }
            )
        self._record(
            ctx,
            self._call(
                req, ctx, "chat", response_id, request, choices, start, [c["message"] for c in out]
            ),
        )
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": int(start),
            "model": req.model,
            "choices": out,
            "usage": self._usage(len(prompt_ids), completion_tokens),
        }

    @property
    def _tool_format(self) -> chat_format.ToolFormat | None:
        return chat_format.resolve_tool_format(self.tokenizer, self.config.tool_format)

    def _chat_message(
        self, token_ids: list[int], tools: list[dict[str, Any]] | None
    ) -> tuple[dict[str, Any], str | None]:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tools:
            content, calls = chat_format.parse_tool_calls(text, tools, self._tool_format)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                return message, "tool_calls"
        return message, None

    def _call(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        ctx: CallContext,
        operation: str,
        response_id: str,
        request: GenerationRequest,
        choices: list[Choice],
        start: float,
        output_messages: Any,
    ) -> LLMCall:
        record = self.config.record_messages
        inputs = getattr(req, "messages", None) if operation == "chat" else None
        return LLMCall(
            rollout_id=ctx.rollout_id or "",
            attempt_id=ctx.attempt_id or "",
            operation=operation,
            request_model=req.model,
            policy_version=request.adapter or self.backend.base_model,
            response_id=response_id,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            choices=choices,
            start_time=start,
            end_time=time.time(),
            agent_name=ctx.agent_name,
            traceparent=ctx.traceparent,
            input_messages=inputs if record else None,
            output_messages=output_messages if record else None,
        )

    async def _merged_streams(
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

    def _per_choice(self, request: GenerationRequest, n: int) -> list[GenerationRequest]:
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

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        ctx: CallContext,
        request: GenerationRequest,
        tools: list[dict[str, Any]] | None,
    ) -> AsyncIterator[bytes]:
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        start = time.time()
        head = {"id": response_id, "object": "chat.completion.chunk", "created": int(start)}
        head["model"] = req.model

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None):
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return _sse({**head, "choices": [choice]})

        hold_all = self._tool_format == "line"
        texts = [
            _IncrementalText(self.tokenizer, tools is not None, hold_all) for _ in range(req.n)
        ]
        logprobs: list[list[float]] = [[] for _ in range(req.n)]
        tops: list[list] = [[] for _ in range(req.n)]
        finishes: list[str | None] = [None] * req.n
        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, delta in self._merged_streams(self._per_choice(request, req.n)):
                content = texts[i].push(delta.token_ids)
                logprobs[i].extend(delta.logprobs)
                tops[i].extend(delta.top_logprobs or [])
                lp = (
                    self._chat_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
                    if req.logprobs and delta.token_ids
                    else None
                )
                if content or lp:
                    yield chunk(i, {"content": content}, logprobs=lp)
                if delta.finish_reason is not None:
                    finishes[i] = delta.finish_reason
                    message, tool_finish = self._chat_message(texts[i].token_ids, tools)
                    if tool_finish:
                        if not texts[i].sent and message["content"]:
                            yield chunk(i, {"content": message["content"]})
                        calls = [
                            {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                        ]
                        yield chunk(i, {"tool_calls": calls}, tool_finish)
                    else:
                        rest = texts[i].text()[texts[i].sent :]
                        yield chunk(i, {"content": rest} if rest else {}, delta.finish_reason)
        except LightningError as exc:
            yield _sse({"error": {"message": str(exc), "type": "invalid_request_error"}})
            yield _DONE
            return
        choices = [
            Choice(
                token_ids=t.token_ids,
                logprobs=logprobs[i],
                top_logprobs=tops[i] or None,
                finish_reason=finishes[i] or "stop",
            )
            for i, t in enumerate(texts)
        ]
        messages = [self._chat_message(t.token_ids, tools)[0] for t in texts]
        self._record(
            ctx, self._call(req, ctx, "chat", response_id, request, choices, start, messages)
        )
        if req.include_usage():
            usage = self._usage(len(request.prompt_token_ids), sum(len(t.token_ids) for t in texts))
            yield _sse({**head, "choices": [], "usage": usage})
        yield _DONE

    # ------------------------------------------------------------------ text completions

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInput("prompt must not be empty")
            return self.tokenizer(prompt)["input_ids"]
        vocab = len(self.tokenizer)
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise InvalidInput(f"prompt token ids must be non-empty and within [0, {vocab})")
        return prompt

    async def completions(
        self, req: CompletionRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        self._check_rollout(ctx)
        adapter = await self._adapter_for(req.model)
        params = req.sampling(self._max_tokens(req.max_tokens), req.logprobs or 0)
        requests = [
            GenerationRequest(
                prompt_token_ids=self._prompt_ids(p), params=params, n=req.n, adapter=adapter
            )
            for p in req.prompts()
        ]
        if req.stream:
            return self._completion_stream(req, ctx, requests)
        start = time.time()
        results = await asyncio.gather(*(self.backend.generate(r) for r in requests))
        response_id = f"cmpl-{uuid.uuid4().hex}"
        out = []
        for p, (request, choices) in enumerate(zip(requests, results, strict=True)):
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in choices]
            for j, (choice, text) in enumerate(zip(choices, texts, strict=True)):
                out.append(
                    {
                        "index": p * req.n + j,
                        "text": text,
                        "finish_reason": choice.finish_reason,
                        "logprobs": self._completion_logprobs(
                            choice.token_ids, choice.logprobs, choice.top_logprobs
                        )
                        if req.logprobs is not None
                        else None,
                    }
                )
            call = self._call(
                req, ctx, "text_completion", response_id, request, choices, start, texts
            )
            self._record(ctx, call)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        completion_tokens = sum(len(c.token_ids) for cs in results for c in cs)
        return {
            "id": response_id,
            "object": "text_completion",
            "created": int(start),
            "model": req.model,
            "choices": out,
            "usage": self._usage(prompt_tokens, completion_tokens),
        }

    async def _completion_stream(
        self, req: CompletionRequest, ctx: CallContext, requests: list[GenerationRequest]
    ) -> AsyncIterator[bytes]:
        response_id = f"cmpl-{uuid.uuid4().hex}"
        start = time.time()
        head = {"id": response_id, "object": "text_completion", "created": int(start)}
        head["model"] = req.model
        singles = [s for r in requests for s in self._per_choice(r, req.n)]
        texts = [_IncrementalText(self.tokenizer, False) for _ in singles]
        logprobs: list[list[float]] = [[] for _ in singles]
        finishes: list[str | None] = [None] * len(singles)
        try:
            async for i, delta in self._merged_streams(singles):
                text = texts[i].push(delta.token_ids)
                logprobs[i].extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finishes[i] = delta.finish_reason
                    text += texts[i].text()[texts[i].sent :]
                lp = (
                    self._completion_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
                    if req.logprobs is not None and delta.token_ids
                    else None
                )
                if text or lp or delta.finish_reason:
                    choice = {
                        "index": i,
                        "text": text,
                        "finish_reason": delta.finish_reason,
                        "logprobs": lp,
                    }
                    yield _sse({**head, "choices": [choice]})
        except LightningError as exc:
            yield _sse({"error": {"message": str(exc), "type": "invalid_request_error"}})
            yield _DONE
            return
        for p, request in enumerate(requests):
            rows = range(p * req.n, (p + 1) * req.n)
            choices = [
                Choice(
                    token_ids=texts[k].token_ids,
                    logprobs=logprobs[k],
                    finish_reason=finishes[k] or "stop",
                )
                for k in rows
            ]
            outputs = [texts[k].text() for k in rows]
            self._record(
                ctx,
                self._call(
                    req, ctx, "text_completion", response_id, request, choices, start, outputs
                ),
            )
        if req.include_usage():
            prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
            usage = self._usage(prompt_tokens, sum(len(t.token_ids) for t in texts))
            yield _sse({**head, "choices": [], "usage": usage})
        yield _DONE
