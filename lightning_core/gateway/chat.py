"""Chat messages and tools to prompt token ids, and generated text back to tool calls.

Templates that know tools (their source mentions `tools`) get them through the tokenizer's own
`apply_chat_template(tools=...)`. Many small models' templates do not (SmolLM2's ignores
`tools=`); for those the tools are described in the system message with the Hermes calling
convention, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and earlier tool calls
and results are rendered in that convention too, so the model sees one consistent format.

Parsing accepts the Hermes form with one call per tag, a JSON list of calls inside one tag (the
form SmolLM2 was trained on), and either with "parameters" in place of "arguments".

Very small models cannot write JSON calls at all (SmolLM2-135M: none well formed in our tries) but
follow a one-line text protocol. The "line" format describes each tool as a keyword, the tool's
name in capitals: a call is a line `CALC: 2 * (3 + 4)`, whose text after the colon is the tool's
one argument (or a JSON object of its arguments when it takes several), and a result comes back
as the user's turn `RESULT: 14`.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

import orjson

from lightning_core.errors import InvalidInput

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, answer with only\n"
    '<tool_call>{{"name": <tool name>, "arguments": <arguments as a JSON object>}}</tool_call>\n'
    "and wait for its result. The tools, as JSON schemas:\n{tools}"
)


ToolFormat = Literal["auto", "hermes", "line"]
RESULT_PREFIX = "RESULT:"

_LINE_TOOL_PROMPT = (
    "You can use these tools:\n{tools}\n"
    "To use a tool, write one line with its name in capitals, a colon and its input, for "
    "example `{example}: ...`, and nothing else; the result comes back as `RESULT: ...`."
)


def resolve_tool_format(tokenizer: Any, tool_format: ToolFormat) -> ToolFormat | None:
    """The format to use: None when the chat template renders tools itself."""
    if tool_format == "auto":
        return None if template_supports_tools(tokenizer) else "hermes"
    return tool_format


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


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments", "{}")
    try:
        return orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        return arguments


def _hermes_call(call: dict[str, Any]) -> str:
    name = call.get("function", {}).get("name")
    body = orjson.dumps({"name": name, "arguments": _arguments(call)})
    return f"{TOOL_CALL_OPEN}{body.decode()}{TOOL_CALL_CLOSE}"


def _keyword(name: str) -> str:
    return name.upper()


def _line_call(call: dict[str, Any]) -> str:
    arguments = _arguments(call)
    if isinstance(arguments, dict) and len(arguments) == 1:
        value = next(iter(arguments.values()))
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
    else:
        text = orjson.dumps(arguments).decode()
    return f"{_keyword(call.get('function', {}).get('name', ''))}: {text}"


def _line_tool(tool: dict[str, Any]) -> str:
    function = tool.get("function", tool)
    params = list(function.get("parameters", {}).get("properties", {}))
    shape = f"<{params[0]}>" if len(params) == 1 else "<arguments as a JSON object>"
    description = function.get("description")
    return f"{_keyword(function['name'])}: {shape}" + (f"  ({description})" if description else "")


def _tool_prompt(tools: list[dict[str, Any]], tool_format: ToolFormat) -> str:
    if tool_format == "line":
        return _LINE_TOOL_PROMPT.format(
            tools="\n".join(_line_tool(t) for t in tools),
            example=_keyword(tools[0].get("function", tools[0])["name"]),
        )
    schemas = "\n".join(orjson.dumps(t.get("function", t)).decode() for t in tools)
    return _FALLBACK_TOOL_PROMPT.format(tools=schemas)


def _fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_format: ToolFormat
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system message, calls and
    results as text in `tool_format`."""
    write_call = _line_call if tool_format == "line" else _hermes_call
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(write_call(c) for c in m["tool_calls"])
            out.append(
                {"role": "assistant", "content": "\n".join(x for x in (content, calls) if x)}
            )
        elif role == "tool":
            # Templates without tool support often reject a "tool" role: results come back as
            # the user's turn, marked so the model can tell them from a question.
            result = (
                f"{RESULT_PREFIX} {content}"
                if tool_format == "line"
                else f"<tool_response>\n{content}\n</tool_response>"
            )
            out.append({"role": "user", "content": result})
        elif role == "developer":
            out.append({"role": "system", "content": content})
        else:
            out.append({"role": role, "content": content})
    if tools:
        tool_prompt = _tool_prompt(tools, tool_format)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tool_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt})
    return out


def text_size(message: dict[str, Any]) -> int:
    """Characters of a message's text content, all of which its rendered prompt holds."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return sum(len(text) for text in texts if isinstance(text, str))
    return 0


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_format: ToolFormat = "auto",
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn to speak."""
    if not messages:
        raise InvalidInput("messages must not be empty")
    if tokenizer.chat_template is None:
        raise InvalidInput("the model's tokenizer has no chat template; use /v1/completions")
    tool_format = resolve_tool_format(tokenizer, tool_format)  # type: ignore[assignment]
    if tool_format is None:
        normalised = [
            {**m, "content": _text(m.get("content"))} if "content" in m else m for m in messages
        ]
        return _apply_template(tokenizer, normalised, tools or None)
    return _apply_template(tokenizer, _fallback_messages(messages, tools, tool_format), None)


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:
        # Templates refuse what they cannot render (roles out of order, a missing field) with
        # raise_exception: the request's mistake, not the server's.
        raise InvalidInput(f"the model's chat template cannot render the messages: {exc}") from exc


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote every special token; adding BOS again would change the prompt.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


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
        try:
            calls.append(_openai_call(item["name"], arguments))
        except orjson.JSONEncodeError:  # nested deeper than orjson writes: not a call
            return None
    return calls


_LINE = re.compile(r"^[ \t`*]*([A-Za-z_][\w.-]*)[ \t]*:[ \t]*(.*?)[ \t`]*$", re.MULTILINE)


def _line_arguments(function: dict[str, Any], text: str) -> Any:
    params = list(function.get("parameters", {}).get("properties", {}))
    if len(params) == 1:
        return {params[0]: text}
    try:
        parsed = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def parse_line_tool_call(
    text: str, tools: list[dict[str, Any]]
) -> tuple[str | None, list[dict[str, Any]]]:
    """The first `KEYWORD: input` line naming an offered tool, as one call.

    What the model wrote after the call (often a made-up result) is dropped: the real result is
    what comes back. Text before it stays as content.
    """
    by_keyword = {_keyword(t.get("function", t)["name"]): t.get("function", t) for t in tools}
    for match in _LINE.finditer(text):
        function = by_keyword.get(match.group(1).upper())
        if function is None or not match.group(2):
            continue
        arguments = _line_arguments(function, match.group(2))
        if arguments is None:
            continue
        content = text[: match.start()].strip()
        return content or None, [_openai_call(function["name"], arguments)]
    return text, []


def parse_tool_calls(
    text: str,
    tools: list[dict[str, Any]] | None = None,
    tool_format: ToolFormat | None = "hermes",
) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into its plain content and OpenAI-shaped tool calls.

    Text inside a tag that is not a valid call stays in the content, so that nothing the model
    wrote is lost.
    """
    if tool_format == "line":
        return parse_line_tool_call(text, tools or [])
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
