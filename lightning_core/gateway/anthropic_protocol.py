"""Anthropic's Messages API request, as the official client sends it, in OpenAI's chat vocabulary.

The gateway's call path speaks OpenAI chat messages and function tools (service.py), so a
Messages request is translated here: `system` becomes the first (system) message, `tool_use`
blocks become an assistant message's `tool_calls`, `tool_result` blocks become `tool` messages
(placed before the text of the same user turn, the order in which the model saw them), and a
tool's `input_schema` becomes the function's `parameters`. A request with the same content as
an OpenAI chat request thus renders the same prompt, token for token.

Unknown fields are accepted (clients send many), but what would change the answer and is not
implemented (images, documents, server tools, extended thinking, an assistant prefill, top_k
above 1) is refused with a 400 that names it, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning_core.backends.base import Constraint, SamplingParams
from lightning_core.errors import InvalidInput
from lightning_core.gateway.protocol import json_constraint

_TEXT_ONLY = (
    "this gateway serves a text-only policy: send text, tool_use and tool_result blocks only"
)


def _text_part(block: Any, where: str) -> dict[str, str]:
    """A text block as an OpenAI text part (cache_control and citations do not reach the model)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise InvalidInput(f"{where} is a {kind!r} block; {_TEXT_ONLY}")
    return {"type": "text", "text": block.get("text", "")}


def _text_parts(blocks: list[Any], where: str) -> list[dict[str, str]]:
    return [_text_part(block, f"{where}[{k}]") for k, block in enumerate(blocks)]


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if not isinstance(content, str):
        content = _text_parts(content, f"{where}.content")
    if block.get("is_error"):
        # OpenAI's tool message has no error flag: the model reads it in the result itself.
        error = "Error: "
        content = (
            error + content
            if isinstance(content, str)
            else [{"type": "text", "text": error}, *content]
        )
    return {"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": content}


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": block.get("id", ""),
        "type": "function",
        "function": {
            "name": block.get("name", ""),
            "arguments": orjson.dumps(block.get("input", {})).decode(),
        },
    }


def _content(parts: list[dict[str, str]]) -> str | list[dict[str, str]]:
    # One text block is sent as a plain string, so it renders like OpenAI's string content.
    return parts[0]["text"] if len(parts) == 1 else parts


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for k, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            results.append(_tool_message(block, f"{where}[{k}]"))
        else:
            texts.append(_text_part(block, f"{where}[{k}]"))
    text = [{"role": "user", "content": _content(texts)}] if texts else []
    return results + text


def _assistant_message(content: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for k, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_use":
            calls.append(_tool_call(block))
        else:
            texts.append(_text_part(block, f"{where}[{k}]"))
    message: dict[str, Any] = {"role": "assistant"}
    if texts or not calls:
        message["content"] = _content(texts) if texts else ""
    if calls:
        message["tool_calls"] = calls
    return message


def _function_tool(tool: dict[str, Any], k: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise InvalidInput(
            f"tools[{k}] is Anthropic's server tool {tool.get('type')!r}; only custom tools "
            "(name, description, input_schema) are served"
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise InvalidInput(f"tools[{k}] needs a 'name' and an 'input_schema' object")
    # Keys in OpenAI's order, so that the rendered tool list matches an OpenAI request's.
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="Base model name or a LoRA adapter (policy version) name.")
    max_tokens: int = Field(ge=1, description="Upper bound on generated tokens (required).")
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = Field(
        None, description="user_id, and agent_name: the calling agent, recorded on the span."
    )
    thinking: dict[str, Any] | None = Field(
        None, description="disabled or adaptive (the policy never thinks); enabled is refused."
    )
    output_config: dict[str, Any] | None = Field(
        None, description="format (json_schema): enforced by constrained decoding; effort: unused."
    )
    stream: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> MessagesRequest:
        if (self.thinking or {}).get("type") == "enabled":
            raise InvalidInput("'thinking' (extended thinking) is not supported; leave it unset")
        if self.top_k not in (None, 0, 1):
            raise InvalidInput("'top_k' is not supported by this gateway; leave it unset")
        kind = (self.tool_choice or {}).get("type", "auto")
        if kind not in ("auto", "any", "tool", "none"):
            raise InvalidInput(f"tool_choice type {kind!r} is not auto, any, tool or none")
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("user", "assistant"):
                raise InvalidInput(
                    f"messages[{i}].role {m.get('role')!r} is not user or assistant "
                    "(a system prompt goes in the top-level 'system')"
                )
        if self.messages[-1].get("role") == "assistant":
            raise InvalidInput(
                "the last message is the assistant's: continuing a prefilled assistant turn "
                "is not supported; end with a user turn"
            )
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            content = system if isinstance(system, str) else _content(_text_parts(system, "system"))
            out.append({"role": "system", "content": content})
        for i, m in enumerate(self.messages):
            role, content, where = m["role"], m.get("content", ""), f"messages[{i}].content"
            if isinstance(content, str):
                out.append({"role": role, "content": content})
            elif not isinstance(content, list):
                raise InvalidInput(f"{where} must be a string or a list of content blocks")
            elif role == "user":
                out.extend(_user_messages(content, where))
            else:
                out.append(_assistant_message(content, where))
        return out

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call, after tool_choice, as OpenAI function tools.

        "any" and "tool" are not enforced by decoding (as OpenAI's "required" is not): "tool"
        offers only the named tool.
        """
        choice = self.tool_choice or {}
        if not self.tools or choice.get("type") == "none":
            return None
        tools = [_function_tool(t, k) for k, t in enumerate(self.tools)]
        if choice.get("type") == "tool":
            chosen = [t for t in tools if t["function"]["name"] == choice.get("name")]
            if not chosen:
                raise InvalidInput(f"tool_choice names {choice.get('name')!r}, not in tools")
            return chosen
        return tools

    @property
    def single_tool_use(self) -> bool:
        return bool((self.tool_choice or {}).get("disable_parallel_tool_use"))

    def sampling(self) -> SamplingParams:
        greedy = self.top_k == 1  # the one most likely token: greedy decoding
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=0.0 if greedy else 1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=[s for s in self.stop_sequences or [] if s],
            constraint=self._constraint(),
        )

    def _constraint(self) -> Constraint | None:
        fmt = (self.output_config or {}).get("format") or {}
        if fmt and fmt.get("type") != "json_schema":
            raise InvalidInput(f"output_config.format type {fmt.get('type')!r} is not json_schema")
        return json_constraint(fmt.get("type"), fmt.get("schema"), "output_config.format")


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
