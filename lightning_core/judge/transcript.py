"""A rollout's trajectory as the judge reads it: the task's chosen fields, then the conversation
of the rollout's last LLM call from the task's own turn on, and its answer.

The last call's prompt holds everything the agent had seen (searches, tool results, earlier
answers); what comes before the last user turn is the agent's set-up (instructions, worked
examples), which tells a judge nothing about this trajectory and costs its tokens. Calls a
judge made itself (agent name semconv.JUDGE_AGENT) are never part of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from lightning_core import semconv
from lightning_core.data.adapter import timeline_order
from lightning_core.types import Span

_ELIDED = "\n[...]\n"


def is_judge_call(span: Span) -> bool:
    return span.attributes.get(semconv.AGENT_NAME) == semconv.JUDGE_AGENT


def task_text(task: Any, fields: Sequence[str]) -> str:
    """The task as the judge sees it: the chosen fields, one per line."""
    if not isinstance(task, Mapping):
        return str(task)
    return "\n".join(f"{f}: {task[f]}" for f in fields if f in task)


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts
        return " ".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in value)
    return str(value)


def _message(message: Any) -> str:
    if not isinstance(message, Mapping):
        return str(message)
    role = str(message.get("role", "?"))
    text = _content(message.get("content"))
    calls = [
        f"{c.get('function', {}).get('name', '?')}({c.get('function', {}).get('arguments', '')})"
        for c in message.get("tool_calls") or []
        if isinstance(c, Mapping)
    ]
    if calls:
        text = (text + " " if text else "") + "calls " + ", ".join(calls)
    return f"{role}: {text}"


def _messages(span: Span, key: str) -> list[Any]:
    raw = span.attributes.get(key)
    if not raw:
        return []
    try:
        value = orjson.loads(raw) if isinstance(raw, str | bytes) else raw
    except orjson.JSONDecodeError:
        return []
    return value if isinstance(value, list) else []


def clip_middle(text: str, limit: int) -> str:
    """`text` within `limit` characters, its middle cut: the start says what was asked, the
    end holds the answer."""
    if len(text) <= limit:
        return text
    keep = limit - len(_ELIDED)
    return text[: keep // 3] + _ELIDED + text[len(text) - (keep - keep // 3) :]


def render(spans: Sequence[Span], limit: int) -> str | None:
    """The trajectory of one attempt's spans, or None when it made no LLM call the gateway
    recorded with its messages."""
    calls = [
        s
        for s in spans
        if semconv.PROMPT_TOKEN_IDS in s.attributes
        and not is_judge_call(s)
        and "gen_ai.output.messages" in s.attributes
    ]
    if not calls:
        return None
    last = max(calls, key=timeline_order)
    prompt = _messages(last, "gen_ai.input.messages")
    users = [i for i, m in enumerate(prompt) if isinstance(m, Mapping) and m.get("role") == "user"]
    shown = prompt[users[-1] :] if users else prompt[-1:]
    answer = _messages(last, "gen_ai.output.messages")[:1]
    lines = [_message(m) for m in [*shown, *answer]]
    return clip_middle("\n".join(lines), limit)
