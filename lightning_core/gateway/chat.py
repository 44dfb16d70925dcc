"""Chat messages and tools to prompt token ids, and generated text back to tool calls.

Templates that know tools (their source mentions `tools`) get them through the tokenizer's own
`apply_chat_template(tools=...)`. Many small models' templates do not (SmolLM2's ignores
`tools=`); for those the tools are described in the system message with the Hermes calling
convention, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and earlier tool calls
and results are rendered in that convention too, so the model sees one consistent format.

Parsing accepts the Hermes form with one call per tag, a JSON list of calls inside one tag (the
form SmolLM2 was trained on), and either with "parameters" in place of "arguments".
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from lightning_core.errors import InvalidInput

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, answer with only\n"
    '<tool_call>{{"name": <tool name>, "arguments": <arguments as a JSON object>}}</tool_call>\n'
    "and wait for its result. The tools, as JSON schemas:\n{tools}"
)


def template_supports_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def _text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidInput(
                f"message content part of type {part.get('type')!r} is not supported"
            )
        parts.append(part.get("text", ""))
    return "".join(parts)


def _hermes_call(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        parsed = arguments
    body = orjson.dumps({"name": function.get("name"), "arguments": parsed}).decode()
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def _fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system message, calls and
    results as Hermes-style text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_hermes_call(c) for c in m["tool_calls"])
            out.append(
                {"role": "assistant", "content": "\n".join(x for x in (content, calls) if x)}
            )
        elif role == "tool":
            # Templates without tool support often reject a "tool" role: results come back as
            # the user's turn, marked so the model can tell them from a question.
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif role == "developer":
            out.append({"role": "system", "content": content})
        else:
            out.append({"role": role, "content": content})
    if tools:
        schemas = "\n".join(orjson.dumps(t.get("function", t)).decode() for t in tools)
        tool_prompt = _FALLBACK_TOOL_PROMPT.format(tools=schemas)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tool_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt})
    return out


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn to speak."""
    if not messages:
        raise InvalidInput("messages must not be empty")
    if tokenizer.chat_template is None:
        raise InvalidInput("the model's tokenizer has no chat template; use /v1/completions")
    if template_supports_tools(tokenizer):
        normalised = [
            {**m, "content": _text(m.get("content"))} if "content" in m else m for m in messages
        ]
        return tokenizer.apply_chat_template(
            normalised, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    return tokenizer.apply_chat_template(
        _fallback_messages(messages, tools), add_generation_prompt=True, tokenize=False
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote every special token; adding BOS again would change the prompt.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _calls_in(payload: Any) -> list[dict[str, Any]] | None:
    """Tool calls in a parsed tag payload: an object or a list of objects with a name."""
    items = payload if isinstance(payload, list) else [payload]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": item["name"], "arguments": orjson.dumps(arguments).decode()},
            }
        )
    return calls


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into its plain content and OpenAI-shaped tool calls.

    Text inside a tag that is not a valid call stays in the content, so that nothing the model
    wrote is lost.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            found = _calls_in(orjson.loads(match.group(1)))
        except orjson.JSONDecodeError:
            found = None
        if found is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.extend(found)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
