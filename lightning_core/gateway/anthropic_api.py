"""Anthropic's Messages API (/v1/messages) on the gateway's chat call path.

A request is translated to a `ChatCall` (anthropic_protocol.py) and the answer back into a
`Message`: a text block and/or `tool_use` blocks, with Anthropic's stop reasons. Streamed, it
is Anthropic's event sequence, each as `event: <type>` + `data: <json>`: message_start (no
content yet), a ping, per block content_block_start / _delta (text_delta or input_json_delta)
/ _stop, then message_delta (stop reason, usage) and message_stop. An error after the stream
has started is an `error` event in Anthropic's error shape. The span is recorded by the core
with api "messages" (operation "chat", as the GenAI conventions name both chat APIs).

Stop reasons: tool calls give "tool_use", the token limit "max_tokens". A backend "stop" is
either the model's own end of turn ("end_turn") or a stop sequence ("stop_sequence"), which the
backend names (`Choice.stop_sequence`): its text is cut off the ids, so it cannot be read back
from them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from lightning_core.errors import LightningError
from lightning_core.gateway.anthropic_protocol import MessagesRequest, StopReason
from lightning_core.gateway.errors import anthropic_error_body
from lightning_core.gateway.service import (
    CallContext,
    ChatCall,
    ChatChoice,
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    Gateway,
    TextDelta,
)
from lightning_core.gateway.sse import named_sse as sse

__all__ = ["MessagesAPI", "MessagesRequest"]

log = logging.getLogger(__name__)


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": function["name"],
        "input": orjson.loads(function["arguments"]),
    }


async def _chain(first: ChatEvent, rest: AsyncIterator[ChatEvent]) -> AsyncIterator[ChatEvent]:
    yield first
    async for event in rest:
        yield event


class MessagesAPI:
    """/v1/messages of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _call(self, req: MessagesRequest) -> ChatCall:
        return ChatCall(
            model=req.model,
            messages=req.chat_messages(),
            params=req.sampling(),
            tools=req.offered_tools(),
            api="messages",
        )

    async def create(
        self, req: MessagesRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        call = self._call(req)
        if req.stream:
            # Started, up to its first event, before the response is: an unknown model, a bad
            # rollout or a backend's refusal (prompt too long) is then an HTTP error that the
            # client raises as such, not an error event in a stream.
            response_id, _, prompt_tokens, events = await self.gateway.chat_stream(
                call, ctx, id_prefix="msg_"
            )
            first = await anext(aiter(events))
            return self._stream(req, call, response_id, prompt_tokens, _chain(first, events))
        result = await self.gateway.chat_result(call, ctx, id_prefix="msg_")
        [choice] = result.choices
        calls = self._tool_calls(req, choice)
        text = choice.content if choice.tool_calls else choice.text
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        reason, sequence = self._stop(call, choice)
        return self._message(
            req,
            result.response_id,
            blocks + [_tool_use(c) for c in calls],
            reason,
            sequence,
            result.prompt_tokens,
            result.completion_tokens,
        )

    # ------------------------------------------------------------------ answers

    @staticmethod
    def _tool_calls(req: MessagesRequest, choice: ChatChoice) -> list[dict[str, Any]]:
        return choice.tool_calls[:1] if req.single_tool_use else choice.tool_calls

    def _stop(self, call: ChatCall, choice: ChatChoice) -> tuple[StopReason, str | None]:
        """Anthropic's stop reason and stop sequence (see the module doc for the rule)."""
        if choice.tool_calls:
            return "tool_use", None
        if choice.generated.finish_reason == "length":
            return "max_tokens", None
        if choice.generated.stop_sequence is not None:
            return "stop_sequence", choice.generated.stop_sequence
        return "end_turn", None

    @staticmethod
    def _message(
        req: MessagesRequest,
        response_id: str,
        content: list[dict[str, Any]],
        stop_reason: StopReason | None,
        stop_sequence: str | None,
        input_tokens: int,
        output_tokens: int,
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        req: MessagesRequest,
        call: ChatCall,
        response_id: str,
        prompt_tokens: int,
        events: AsyncIterator[ChatEvent],
    ) -> AsyncIterator[bytes]:
        message = self._message(req, response_id, [], None, None, prompt_tokens, 0)
        yield sse({"type": "message_start", "message": message})
        yield sse({"type": "ping"})
        blocks = _Blocks()
        result: ChatResult | None = None
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    for out in blocks.text(event.text):
                        yield out
                elif isinstance(event, ChoiceEnd):
                    for out in self._stream_end(req, event, blocks):
                        yield out
                else:
                    result = event
        except Exception as exc:  # the stream has started: the client learns of it in-band
            if not isinstance(exc, LightningError):
                log.exception("/v1/messages stream %s failed", response_id)
            status = exc.status_code if isinstance(exc, LightningError) else 500
            yield sse(anthropic_error_body(status, str(exc) or type(exc).__name__))
            return
        assert result is not None, "the gateway's events end with the call's result"
        reason, sequence = self._stop(call, result.choices[0])
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": prompt_tokens, "output_tokens": result.completion_tokens},
            }
        )
        yield sse({"type": "message_stop"})

    def _stream_end(self, req: MessagesRequest, end: ChoiceEnd, blocks: _Blocks) -> list[bytes]:
        calls = self._tool_calls(req, end.choice)
        out = blocks.text(end.rest)
        if not blocks.open and not calls and blocks.index == 0:
            out += blocks.text("", force=True)  # as unstreamed: never a message without blocks
        out += blocks.close()
        for call in calls:
            block = _tool_use(call)
            arguments = call["function"]["arguments"]
            out += blocks.start({**block, "input": {}})
            out += [blocks.delta({"type": "input_json_delta", "partial_json": arguments})]
            out += blocks.close()
        return out


class _Blocks:
    """The content block events of one streamed message: which block is open, at which index."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None

    def start(self, block: dict[str, Any]) -> list[bytes]:
        self.open = block["type"]
        return [sse({"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, text: str, force: bool = False) -> list[bytes]:
        """A text delta, opening a text block first if none is open."""
        if not text and not force:
            return []
        out = [] if self.open == "text" else self.close() + self.start({"type": "text", "text": ""})
        if text:
            out.append(self.delta({"type": "text_delta", "text": text}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [sse({"type": "content_block_stop", "index": self.index - 1})]
