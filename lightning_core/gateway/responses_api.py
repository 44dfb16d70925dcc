"""OpenAI's Responses API (/v1/responses) on the gateway's chat call path.

A request is translated into a `ChatCall` (responses_protocol.py) and answered by the gateway's
one call path, which records its span (api "responses"). The answer comes back as a response
object: a `message` output item with the text and/or one `function_call` item per tool call,
status "incomplete" when the answer ran into `max_output_tokens`. Streamed, it is the Responses
event sequence, each event an SSE `event: <type>` / `data: <json>` pair with a `sequence_number`:
response.created, response.in_progress, then per output item its added / delta / done events,
and last response.completed (or response.incomplete) with the whole response and its usage. An
error once the stream has begun is an `error` event, which ends the stream.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from lightning_core.errors import LightningError
from lightning_core.gateway.responses_protocol import ResponsesRequest
from lightning_core.gateway.service import (
    CallContext,
    ChatCall,
    ChatChoice,
    ChatResult,
    ChoiceEnd,
    Gateway,
    TextDelta,
    new_id,
)
from lightning_core.gateway.sse import named_sse

__all__ = ["ResponsesAPI", "ResponsesRequest"]


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def status_of(choice: ChatChoice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A chat tool call (arguments already a JSON string) as a `function_call` output item."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def output_items(choice: ChatChoice) -> list[dict[str, Any]]:
    """The message (its text; none when the model only called tools), then the calls."""
    items = []
    text = choice.content if choice.tool_calls else choice.text
    if text or not choice.tool_calls:
        items.append(message_item(new_id("msg_"), status_of(choice), [text_part(text or "")]))
    items += [function_call_item(new_id("fc_"), c, "completed") for c in choice.tool_calls]
    return items


class ResponsesAPI:
    """/v1/responses of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _call(self, req: ResponsesRequest) -> ChatCall:
        return ChatCall(
            model=req.model,
            messages=req.messages(),
            tools=req.offered_tools(),
            params=req.sampling(
                self.gateway.max_tokens(req.max_output_tokens), 0, req.constraint()
            ),
            api="responses",
        )

    async def create(
        self, req: ResponsesRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        call = self._call(req)
        if req.stream:
            # Refusals found before generation (model, rollout) are still a plain HTTP error.
            response_id, start, _, events = await self.gateway.chat_stream(call, ctx, "resp_")
            return self._stream(req, response_id, start, events)
        result = await self.gateway.chat_result(call, ctx, "resp_")
        [choice] = result.choices
        return response_object(
            req, result.response_id, result.created, status_of(choice), output_items(choice), result
        )

    async def _stream(
        self,
        req: ResponsesRequest,
        response_id: str,
        start: float,
        events: AsyncIterator[TextDelta | ChoiceEnd | ChatResult],
    ) -> AsyncIterator[bytes]:
        stream = _EventStream()
        head = response_object(req, response_id, start, "in_progress", [])
        yield stream.event("response.created", response=head)
        yield stream.event("response.in_progress", response=head)
        status = "completed"
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    for chunk in stream.text(event.text):
                        yield chunk
                elif isinstance(event, ChoiceEnd):
                    choice = event.choice
                    status = status_of(choice)
                    for chunk in stream.text(event.rest):
                        yield chunk
                    if stream.message_id is not None or not choice.tool_calls:
                        for chunk in stream.close_message(status):
                            yield chunk
                    for call in choice.tool_calls:
                        for chunk in stream.function_call(call):
                            yield chunk
                else:
                    final = response_object(req, response_id, start, status, stream.output, event)
                    yield stream.event(f"response.{status}", response=final)
        except LightningError as exc:
            yield stream.event("error", code=type(exc).__name__, message=str(exc), param=None)


class _EventStream:
    """Numbers the events of one streamed response and keeps its output items as they close."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.message_id: str | None = None
        self._texts: list[str] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        return named_sse({"type": kind, **fields, "sequence_number": next(self._numbers)})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}

    def _open_message(self) -> list[bytes]:
        self.message_id = new_id("msg_")
        item = message_item(self.message_id, "in_progress", [])
        where = self._where()
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=item),
            self.event("response.content_part.added", **where, part=text_part("")),
        ]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open_message() if self.message_id is None else []
        self._texts.append(text)
        return [
            *out,
            self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[]),
        ]

    def close_message(self, status: str) -> list[bytes]:
        out = self._open_message() if self.message_id is None else []
        text, where = "".join(self._texts), self._where()
        item = message_item(where["item_id"], status, [text_part(text)])
        out += [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=text_part(text)),
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.message_id, self._texts = None, []
        return out

    def function_call(self, call: dict[str, Any]) -> list[bytes]:
        item_id, index = new_id("fc_"), len(self.output)
        item = function_call_item(item_id, call, "completed")
        where = {"item_id": item_id, "output_index": index}
        out = [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, "in_progress"),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return out


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created: float,
    status: str,
    output: list[dict[str, Any]],
    result: ChatResult | None = None,
) -> dict[str, Any]:
    """The response, with the request's settings echoed as the SDKs' Response model wants."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": req.format()},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage(result.prompt_tokens, result.completion_tokens) if result else None,
        "user": req.user,
        "metadata": req.metadata or {},
    }
