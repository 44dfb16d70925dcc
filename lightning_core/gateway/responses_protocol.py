"""OpenAI's Responses API request (/v1/responses), and its translation into a chat call's parts.

A request's `input` (a string, or items: messages, `function_call` and `function_call_output`)
becomes OpenAI chat messages, its flat function `tools` become chat tools, `text.format` a
decoding constraint, so that the gateway's one chat call path answers it.

The gateway keeps nothing between calls: a request that points at stored state
(`previous_response_id`, `conversation`, `item_reference` items) is refused with a 400 that says
to send the whole conversation in `input`. `store` is accepted either way, and nothing is
stored. Like chat completions, `stop` and `seed` are accepted as extensions (the Responses API
has neither); other fields that would change the answer and are not implemented are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from lightning_core.backends.base import Constraint
from lightning_core.errors import InvalidInput
from lightning_core.gateway.protocol import OpenAIRequest, check_tool_choice, json_constraint

STATELESS = (
    "not supported: this gateway stores no responses; send the whole conversation in `input`"
)

# Fields that change the output and are not implemented, with the values that mean "unused".
_UNSUPPORTED = {
    "background": (None, False),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "context_management": (None,),
}
# `include` asks for more in the output; only what this gateway never produces may be asked.
_INCLUDABLE = {"reasoning.encrypted_content"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(OpenAIRequest):
    """POST /v1/responses, as the official clients and the Agents SDK send it."""

    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, description="A system message before `input`.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: dict[str, Any] | None = Field(
        None, description="format: text, json_object or json_schema (constrained decoding)."
    )
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    store: bool | None = Field(None, description="Accepted either way; nothing is stored.")
    include: list[str] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_served(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise InvalidInput(f"previous_response_id is {STATELESS}")
        if self.conversation is not None:
            raise InvalidInput(f"conversation is {STATELESS}")
        if self.n != 1:
            raise InvalidInput("n is not a Responses API field: a response has one output")
        if self.max_tokens is not None:
            raise InvalidInput("max_tokens is not a Responses API field: use max_output_tokens")
        for name, unused in _UNSUPPORTED.items():
            if (self.model_extra or {}).get(name) not in unused:
                raise InvalidInput(f"'{name}' is not supported by this gateway; leave it unset")
        asked = set(self.include or ()) - _INCLUDABLE
        if asked:
            raise InvalidInput(f"include {sorted(asked)} is not supported by this gateway")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidInput("'reasoning' is not supported by this gateway; leave it unset")
        if (self.text or {}).get("verbosity") is not None:
            raise InvalidInput("'text.verbosity' is not supported by this gateway; leave it unset")
        check_tool_choice(self.tool_choice)
        return self

    # ------------------------------------------------------------------ input -> chat messages

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as OpenAI chat messages.

        Function calls join the assistant message just before them (the text the model wrote
        with them), as one chat turn; each output becomes a `tool` message.
        """
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = {
                    "id": _required(item, "call_id", where),
                    "type": "function",
                    "function": {
                        "name": _required(item, "name", where),
                        "arguments": item.get("arguments") or "{}",
                    },
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": _required(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, where),
                    }
                )
            elif kind == "item_reference":
                raise InvalidInput(f"{where}: item_reference is {STATELESS}")
            elif kind == "reasoning":
                continue  # none of this gateway's models reason; a chat call has no place for it
            else:
                raise InvalidInput(
                    f"{where}: input items of type {kind!r} are not supported; send messages, "
                    "function_call and function_call_output items"
                )
        if not messages:
            raise InvalidInput("input must not be empty")
        return messages

    # ------------------------------------------------------------------ tools, format, sampling

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The function tools the model may call, after tool_choice, in the chat shape."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function":
                raise InvalidInput(
                    f"tool_choice of type {self.tool_choice.get('type')!r} is not supported; "
                    'use none, auto, required or {"type": "function", "name": ...}'
                )
            wanted = self.tool_choice.get("name")
            tools = [t for t in tools if t["function"]["name"] == wanted]
            if not tools:
                raise InvalidInput(f"tool_choice names {wanted!r}, which is not in tools")
        return tools

    def format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}

    def constraint(self) -> Constraint | None:
        fmt = self.format()
        return json_constraint(fmt.get("type"), fmt.get("schema"), "text.format", fmt.get("strict"))


def _required(item: dict[str, Any], key: str, where: str) -> Any:
    if not item.get(key):
        raise InvalidInput(f"{where} of type {item.get('type')!r} needs '{key}'")
    return item[key]


def _text(content: Any, where: str) -> str:
    """Text content: a string, or parts of type input_text / output_text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput(f"{where}: content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidInput(f"{where}: content parts of type {kind!r} are not supported")
        texts.append(part.get("text") or "")
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidInput(f"{where}.role {role!r} is not user, system, developer or assistant")
    return {"role": role, "content": _text(item.get("content"), where)}


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A flat Responses function tool in the chat shape (`strict` has no place there)."""
    if tool.get("type") != "function":
        raise InvalidInput(
            f"{where}: tools of type {tool.get('type')!r} are not supported; only function tools"
        )
    function: dict[str, Any] = {"name": _required(tool, "name", where)}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    return {"type": "function", "function": function}
