"""A rollout's trajectory as the judge reads it: the task's chosen fields, then every LLM call
the rollout made, in the order the store received them, each call's new messages and its answer.

Order is the store's: `sequence_id` is assigned on arrival, so an agent cannot move a call by
the times it puts on a span (an agent may export spans of its own attempt, end_time included).
All calls are shown, not only the last one, so a span written after the real answer sits beside
it instead of replacing it. Each call shows what it adds to the conversation: the messages past
the previous call's prompt and answer (of the same agent), or, when the prompt does not extend
them, the conversation from its task's last user turn on; what comes before that turn is the
agent's set-up (instructions, worked examples), which tells a judge nothing about this
trajectory and costs its tokens. Calls a judge made itself (agent name semconv.JUDGE_AGENT) are
never part of it.

Every message sits between tags that carry a code (`fence`) which no text of the trajectory
contains, so an answer cannot close its message, start a role's turn or end the trajectory:
whatever it writes stays inside its own message (docs/judge.md).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import orjson

from lightning_core import semconv
from lightning_core.types import Span

_ELIDED = "\n[...]\n"
# A role is the agent's text: only a short word is shown as one, so it cannot carry markup.
_ROLE = re.compile(r"[A-Za-z_]{1,20}")


def is_judge_call(span: Span) -> bool:
    return span.attributes.get(semconv.AGENT_NAME) == semconv.JUDGE_AGENT


def fence(*texts: str) -> str:
    """A code for section tags that none of `texts` contains: 16 hex digits of a hash of them.

    From the texts, not random, so that the same trajectory is the same prompt each time (its
    cache key, a calibration's sample). Not forgeable from inside: to write the code a text
    would have to contain a hash of itself. Redrawn (a counter in the hash) in the unlikely
    case that one of them contains it anyway, so the guarantee does not rest on chance."""
    joined = b"\x00".join(t.encode("utf-8", "surrogatepass") for t in texts)
    for salt in count():
        code = hashlib.sha256(salt.to_bytes(8, "big") + joined).hexdigest()[:16]
        if not any(code in t for t in texts):
            return code
    raise AssertionError("unreachable")


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


def _message(message: Any, role: str) -> tuple[str, str]:
    """(role, text) of one message; `role` for one that names none (a completion's text)."""
    if not isinstance(message, Mapping):
        return role, str(message)
    given = str(message.get("role", ""))
    text = _content(message.get("content"))
    calls = [
        f"{c.get('function', {}).get('name', '?')}({c.get('function', {}).get('arguments', '')})"
        for c in message.get("tool_calls") or []
        if isinstance(c, Mapping)
    ]
    if calls:
        text = (text + " " if text else "") + "calls " + ", ".join(calls)
    return (given if _ROLE.fullmatch(given) else "other"), text


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
    keep = max(limit - len(_ELIDED), 0)
    return text[: keep // 3] + _ELIDED + text[len(text) - (keep - keep // 3) :]


def agent_calls(spans: Sequence[Span]) -> list[Span]:
    """The agent's recorded LLM calls among `spans`, in the order the store received them
    (`sequence_id`; spans without one, not read from a store, keep their order, after)."""
    calls = [
        s
        for s in spans
        if semconv.PROMPT_TOKEN_IDS in s.attributes
        and not is_judge_call(s)
        and "gen_ai.output.messages" in s.attributes
    ]
    return sorted(calls, key=lambda s: (s.sequence_id is None, s.sequence_id or 0))


@dataclass
class _Turn:
    call: int  # 1 for the rollout's first call
    role: str
    text: str


def _turns(calls: Sequence[Span]) -> list[_Turn]:
    turns: list[_Turn] = []
    # Per agent: what the last call of that agent had seen and answered, so that a call that
    # continues the conversation shows only what it adds.
    seen: dict[Any, list[tuple[str, str]]] = {}
    for number, call in enumerate(calls, 1):
        prompt = [_message(m, "other") for m in _messages(call, "gen_ai.input.messages")]
        answer = [_message(m, "assistant") for m in _messages(call, "gen_ai.output.messages")[:1]]
        agent = call.attributes.get(semconv.AGENT_NAME)
        before = seen.get(agent)
        if before and prompt[: len(before)] == before:
            new = prompt[len(before) :]
        else:
            users = [i for i, (role, _) in enumerate(prompt) if role == "user"]
            new = prompt[users[-1] :] if users else prompt[-1:]
        turns += [_Turn(number, role, text) for role, text in [*new, *answer]]
        seen[agent] = prompt + answer
    return turns


def _show(turns: Sequence[_Turn | int], code: str) -> str:
    """The turns as tagged messages; an int stands for that many messages left out."""
    parts = []
    for turn in turns:
        if isinstance(turn, int):
            parts.append(f"[{turn} messages left out]")
            continue
        parts.append(
            f'<message-{code} call="{turn.call}" role="{turn.role}">\n{turn.text}\n'
            f"</message-{code}>"
        )
    return "\n".join(parts)


def _clip(text: str, limit: int) -> str:
    # clip_middle, or, with no room for its mark, the end alone (the answer).
    if len(text) <= limit or limit > len(_ELIDED):
        return clip_middle(text, limit)
    return text[len(text) - max(limit, 0) :]


def _fit(turns: list[_Turn], code: str, limit: int) -> str:
    """The turns within `limit` characters: the oldest messages between the first (what was
    asked) and the last (the answer) go first; then those two lose their middles. Tags are never
    cut, so every message stays closed."""
    sizes = [len(_show([t], code)) for t in turns]
    if sum(sizes) + len(turns) - 1 <= limit:
        return _show(turns, code)
    first, last = turns[0], turns[-1]
    # Lengths counted, not rendered again for each message left out: a long rollout has
    # hundreds.
    kept = sum(sizes[1:-1]) + len(sizes[1:-1])  # each with the newline before it
    middle: list[_Turn | int] = []
    for dropped in range(1, len(turns) - 1):
        kept -= sizes[dropped] + 1
        if sizes[0] + len(_show([dropped], code)) + kept + sizes[-1] + 2 <= limit:
            return _show([first, dropped, *turns[dropped + 1 : -1], last], code)
        middle = [dropped]
    if len(turns) == 1:
        bare = _show([_Turn(last.call, last.role, "")], code)
        return _show([_Turn(last.call, last.role, _clip(last.text, limit - len(bare)))], code)
    bare = _show(
        [_Turn(first.call, first.role, ""), *middle, _Turn(last.call, last.role, "")], code
    )
    room = max(limit - len(bare), 0)
    head = min(len(first.text), room // 3)
    return _show(
        [
            _Turn(first.call, first.role, _clip(first.text, head)),
            *middle,
            _Turn(last.call, last.role, _clip(last.text, room - head)),
        ],
        code,
    )


def render(spans: Sequence[Span], limit: int) -> str | None:
    """The trajectory of one attempt's spans, at most `limit` characters, or None when it made
    no LLM call the gateway recorded with its messages."""
    turns = _turns(agent_calls(spans))
    if not turns:
        return None
    return _fit(turns, fence(*(t.text for t in turns), *(t.role for t in turns)), limit)
