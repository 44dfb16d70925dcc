"""OpenAI's chat completions and text completions, on the gateway's call path.

Chat completions translate to a `ChatCall` and back; text completions take text or token ids
as the prompt, so they run the backend directly, with the same span recording.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from lightning_core.backends.base import Choice, Constraint, GenerationRequest
from lightning_core.backends.grammar_limits import check_constraint
from lightning_core.backends.text import IncrementalText
from lightning_core.errors import InvalidInput, LightningError
from lightning_core.gateway.protocol import ChatCompletionRequest, CompletionRequest
from lightning_core.gateway.service import (
    CallContext,
    ChatCall,
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    Gateway,
    TextDelta,
    held,
    new_id,
)
from lightning_core.gateway.sse import DONE, sse
from lightning_core.serving.offload import off_loop


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _stream_error(exc: LightningError) -> bytes:
    return sse({"error": {"message": str(exc), "type": "invalid_request_error"}})


class OpenAIAPI:
    """/v1/chat/completions and /v1/completions of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _token_text(self, token_id: int) -> str:
        return self.gateway.tokenizer.decode([token_id])

    def chat_logprobs(
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

    # ------------------------------------------------------------------ chat

    def _call(self, req: ChatCompletionRequest) -> ChatCall:
        return ChatCall(
            model=req.model,
            messages=req.messages,
            tools=req.offered_tools(),
            n=req.n,
            params=req.sampling(
                self.gateway.max_tokens(req.token_limit()),
                req.top_logprobs or 0,
                req.constraint(),
            ),
        )

    async def chat(
        self, req: ChatCompletionRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        call = self._call(req)
        if req.stream:
            # Refusals found before generation (model, rollout, prompt) are a plain HTTP error.
            started = await self.gateway.chat_stream(call, ctx)
            return self._chat_stream(req, *started)
        result = await self.gateway.chat_result(call, ctx)
        out = []
        for choice in result.choices:
            g = choice.generated
            out.append(
                {
                    "index": choice.index,
                    "message": choice.message(),
                    "finish_reason": choice.finish_reason,
                    "logprobs": self.chat_logprobs(g.token_ids, g.logprobs, g.top_logprobs)
                    if req.logprobs
                    else None,
                }
            )
        return {
            "id": result.response_id,
            "object": "chat.completion",
            "created": int(result.created),
            "model": req.model,
            "choices": out,
            "usage": usage(result.prompt_tokens, result.completion_tokens),
        }

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        response_id: str,
        start: float,
        prompt_tokens: int,
        events: AsyncIterator[ChatEvent],
    ) -> AsyncIterator[bytes]:
        head = {"id": response_id, "object": "chat.completion.chunk", "created": int(start)}
        head["model"] = req.model

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None):
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return sse({**head, "choices": [choice]})

        result: ChatResult | None = None
        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for event in events:
                if isinstance(event, TextDelta):
                    d = event.delta
                    lp = (
                        self.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
                        if req.logprobs and d.token_ids
                        else None
                    )
                    if event.text or lp:
                        yield chunk(event.index, {"content": event.text}, logprobs=lp)
                elif isinstance(event, ChoiceEnd):
                    choice = event.choice
                    if choice.tool_calls:
                        if event.rest:
                            yield chunk(event.index, {"content": event.rest})
                        calls = [{"index": k, **c} for k, c in enumerate(choice.tool_calls)]
                        yield chunk(event.index, {"tool_calls": calls}, "tool_calls")
                    else:
                        delta = {"content": event.rest} if event.rest else {}
                        yield chunk(event.index, delta, choice.finish_reason)
                else:
                    result = event
        except LightningError as exc:
            yield _stream_error(exc)
            yield DONE
            return
        if req.include_usage() and result is not None:
            yield sse(
                {
                    **head,
                    "choices": [],
                    "usage": usage(prompt_tokens, result.completion_tokens),
                }
            )
        yield DONE

    # ------------------------------------------------------------------ text completions

    def _prompts_ids(
        self, prompts: list[str | list[int]], constraint: Constraint | None
    ) -> list[list[int]]:
        """Each prompt's token ids, the prompts' and the grammar's limits checked: CPU work in
        proportion to the request, for a worker thread (`off_loop`)."""
        check_constraint(constraint)
        return [self._prompt_ids(prompt) for prompt in prompts]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        tokenizer = self.gateway.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInput("prompt must not be empty")
            self.gateway.check_prompt_text(len(prompt))
            return tokenizer(prompt)["input_ids"]
        vocab = len(tokenizer)
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise InvalidInput(f"prompt token ids must be non-empty and within [0, {vocab})")
        return prompt

    def _record_completion(
        self,
        req: CompletionRequest,
        ctx: CallContext,
        response_id: str,
        request: GenerationRequest,
        choices: list[Choice],
        start: float,
        texts: list[str],
    ) -> None:
        call = self.gateway.llm_call(
            ctx,
            operation="text_completion",
            api="completions",
            model=req.model,
            response_id=response_id,
            request=request,
            choices=choices,
            start=start,
            input_messages=None,
            output_messages=texts,
        )
        self.gateway.record(ctx, call)

    async def completions(
        self, req: CompletionRequest, ctx: CallContext
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        gateway = self.gateway
        gateway.check_rollout(ctx)
        adapter = await gateway.route(req.model, ctx)
        params = req.sampling(
            gateway.max_tokens(req.max_tokens), req.logprobs or 0, req.structured_constraint()
        )
        prompts = await off_loop(self._prompts_ids, req.prompts(), params.constraint)
        requests = [
            GenerationRequest(
                prompt_token_ids=ids,
                params=params,
                n=req.n,
                adapter=adapter,
                affinity=gateway.affinity(ctx),
            )
            for ids in prompts
        ]
        gateway.limits.check_size(
            sum(len(r.prompt_token_ids) for r in requests),
            req.n,
            params.max_new_tokens,
            prompts=len(requests),
        )
        slot = await gateway.admit(ctx, requests[0])
        if req.stream:
            return held(slot, self._completion_stream(req, ctx, requests))
        start = time.time()
        try:
            results = await asyncio.gather(*(gateway.backend.generate(r) for r in requests))
        finally:
            slot.release()
        response_id = new_id("cmpl-")
        decode = gateway.tokenizer.decode
        out = []
        for p, (request, choices) in enumerate(zip(requests, results, strict=True)):
            texts = [decode(c.token_ids, skip_special_tokens=True) for c in choices]
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
            self._record_completion(req, ctx, response_id, request, choices, start, texts)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        completion_tokens = sum(len(c.token_ids) for cs in results for c in cs)
        return {
            "id": response_id,
            "object": "text_completion",
            "created": int(start),
            "model": req.model,
            "choices": out,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    async def _completion_stream(
        self, req: CompletionRequest, ctx: CallContext, requests: list[GenerationRequest]
    ) -> AsyncIterator[bytes]:
        gateway = self.gateway
        response_id = new_id("cmpl-")
        start = time.time()
        head = {"id": response_id, "object": "text_completion", "created": int(start)}
        head["model"] = req.model
        singles = [s for r in requests for s in gateway.per_choice(r, req.n)]
        texts = [IncrementalText(gateway.tokenizer) for _ in singles]
        logprobs: list[list[float]] = [[] for _ in singles]
        finishes: list[str | None] = [None] * len(singles)
        try:
            async for i, delta in gateway.merged_streams(singles):
                texts[i].push(delta.token_ids)
                text = texts[i].take()
                logprobs[i].extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finishes[i] = delta.finish_reason
                    text += texts[i].rest()
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
                    yield sse({**head, "choices": [choice]})
        except LightningError as exc:
            yield _stream_error(exc)
            yield DONE
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
            self._record_completion(req, ctx, response_id, request, choices, start, outputs)
        if req.include_usage():
            prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
            completion = sum(len(t.token_ids) for t in texts)
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion)})
        yield DONE
