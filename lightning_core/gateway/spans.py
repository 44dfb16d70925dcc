"""The span recorded for one LLM call through the gateway.

GenAI semantic-convention attributes (`gen_ai.*`) describe the call as any OpenTelemetry tool
expects; ours (`lightning.*`, see semconv.py) carry what training needs: the exact prompt and
response token ids, the logprobs of the behaviour policy, the policy version and the agent.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import orjson

from lightning_core import semconv
from lightning_core.backends.base import Choice, SamplingParams
from lightning_core.types import Span, SpanKind

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_rng = random.SystemRandom()


@dataclass
class LLMCall:
    """What the gateway knows about one call once it has answered it."""

    rollout_id: str
    attempt_id: str
    operation: str  # "chat" or "text_completion"
    api: str  # the client API called: chat.completions, completions, responses, messages
    request_model: str
    policy_version: str
    response_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    choices: list[Choice]
    start_time: float
    end_time: float
    agent_name: str | None = None
    traceparent: str | None = None
    input_messages: Any = None
    output_messages: Any = None
    # What answered (security/provenance.py): the adapter's content hash (None: the base
    # model) and the fingerprint of the tokenizer and chat template.
    adapter_hash: str | None = None
    template_fingerprint: str | None = None


def trace_context(traceparent: str | None) -> tuple[str, str | None]:
    """(trace id, parent span id) from a W3C traceparent header, or a new trace.

    An agent instrumented with OpenTelemetry propagates its context in this header, so the
    gateway's span lands inside the agent's own trace, under the span that made the call.
    """
    match = _TRACEPARENT.match((traceparent or "").strip().lower())
    if match:
        return match.group(1), match.group(2)
    return f"{_rng.getrandbits(128):032x}", None


def llm_call_span(call: LLMCall) -> Span:
    trace_id, parent_id = trace_context(call.traceparent)
    p = call.params
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": call.operation,
        "gen_ai.provider.name": "lightning-rl",
        "gen_ai.request.model": call.request_model,
        "gen_ai.response.model": call.policy_version,
        "gen_ai.response.id": call.response_id,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.max_tokens": p.max_new_tokens,
        "gen_ai.request.choice.count": len(call.choices),
        "gen_ai.usage.input_tokens": len(call.prompt_token_ids),
        "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in call.choices),
        "gen_ai.response.finish_reasons": [c.finish_reason for c in call.choices],
        semconv.ROLLOUT_ID: call.rollout_id,
        semconv.ATTEMPT_ID: call.attempt_id,
        semconv.POLICY_VERSION: call.policy_version,
        semconv.PROMPT_TOKEN_IDS: call.prompt_token_ids,
        semconv.RESPONSE_COUNT: len(call.choices),
    }
    attributes[semconv.API] = call.api
    if call.adapter_hash is not None:
        attributes[semconv.ADAPTER_HASH] = call.adapter_hash
    if call.template_fingerprint is not None:
        attributes[semconv.TEMPLATE_FINGERPRINT] = call.template_fingerprint
    if p.constraint is not None:
        # Constrained decoding: the logprobs are those of the masked distribution sampled from.
        attributes["gen_ai.output.type"] = "text" if p.constraint.kind == "grammar" else "json"
        attributes[semconv.CONSTRAINT] = p.constraint.kind
        if p.constraint.json_schema is not None:
            attributes[semconv.CONSTRAINT_SCHEMA] = orjson.dumps(p.constraint.json_schema).decode()
        if p.constraint.grammar is not None:
            attributes[semconv.CONSTRAINT_GRAMMAR] = p.constraint.grammar
    if p.seed is not None:
        attributes["gen_ai.request.seed"] = p.seed
    if p.stop:
        attributes["gen_ai.request.stop_sequences"] = p.stop
    if call.agent_name:
        attributes["gen_ai.agent.name"] = call.agent_name
        attributes[semconv.AGENT_NAME] = call.agent_name
    if call.input_messages is not None:
        attributes["gen_ai.input.messages"] = orjson.dumps(call.input_messages).decode()
    if call.output_messages is not None:
        attributes["gen_ai.output.messages"] = orjson.dumps(call.output_messages).decode()
    for i, choice in enumerate(call.choices):
        attributes[semconv.RESPONSE.format(i=i, key="token_ids")] = choice.token_ids
        attributes[semconv.RESPONSE.format(i=i, key="logprobs")] = choice.logprobs
        attributes[semconv.RESPONSE.format(i=i, key="finish_reason")] = choice.finish_reason
    return Span(
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        trace_id=trace_id,
        span_id=f"{_rng.getrandbits(64):016x}",
        parent_id=parent_id,
        name=f"{call.operation} {call.request_model}",
        kind=SpanKind.server,
        start_time=call.start_time,
        end_time=call.end_time,
        attributes=attributes,
    )
