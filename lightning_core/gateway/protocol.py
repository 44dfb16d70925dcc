"""OpenAI's request shapes for chat and text completions, as the official client sends them.

Unknown fields are accepted (clients and frameworks send many), but a field that would change
the answer and that the gateway does not implement is refused with a clear 400, rather than
silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning_core.backends.base import Constraint, SamplingParams
from lightning_core.errors import InvalidInput

# Fields that change the output and are not implemented, with the value that means "unused".
_UNSUPPORTED = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
# vLLM's older structured-output fields, replaced there by `structured_outputs`.
_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)


def check_tool_choice(tool_choice: Any) -> None:
    """OpenAI's string tool choices; a dict names one tool (checked against the tools)."""
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise InvalidInput(f"tool_choice {tool_choice!r} is not none, auto or required")


class OpenAIRequest(BaseModel):
    """What OpenAI's request bodies share: model, sampling, stop, streaming, metadata."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="Base model name or a LoRA adapter (policy version) name.")
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's structured-output field (sent as `extra_body`): {'grammar': Lark "
        "text}, {'json': schema} or {'json_object': true}, enforced by constrained decoding.",
    )

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> OpenAIRequest:
        extra = self.model_extra or {}
        for name, unused in _UNSUPPORTED.items():
            if extra.get(name) not in unused:
                raise InvalidInput(f"'{name}' is not supported by this gateway; leave it unset")
        for name in _GUIDED:
            if extra.get(name) is not None:
                raise InvalidInput(
                    f"'{name}' is vLLM's old field; send structured_outputs "
                    "({'grammar': ...}, {'json': ...} or {'json_object': true}) instead"
                )
        return self

    def structured_constraint(self) -> Constraint | None:
        """The grammar `structured_outputs` asks for, if any (one of its keys, not several)."""
        spec = self.structured_outputs
        if not spec:
            return None
        given = {k: v for k, v in spec.items() if v not in (None, False)}
        if len(given) != 1:
            raise InvalidInput(
                "structured_outputs takes exactly one of grammar, json or json_object; "
                f"got {sorted(given) or 'none'}"
            )
        ((key, value),) = given.items()
        if key == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise InvalidInput("structured_outputs.grammar must be a Lark grammar (text)")
            return Constraint(kind="grammar", grammar=value)
        if key == "json":
            try:
                schema = orjson.loads(value) if isinstance(value, str) else value
            except orjson.JSONDecodeError as e:
                raise InvalidInput(f"structured_outputs.json is not valid JSON: {e}") from e
            return json_constraint("json_schema", schema, "structured_outputs.json")
        if key == "json_object":
            return Constraint(kind="json_object")
        raise InvalidInput(
            f"structured_outputs.{key} is not supported by this gateway; use grammar, json or "
            "json_object"
        )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4:
            raise InvalidInput("at most 4 stop sequences are allowed")
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(
        self, max_new_tokens: int, top_logprobs: int, constraint: Constraint | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_list(),
            top_logprobs=top_logprobs,
            constraint=constraint,
        )


def json_constraint(
    kind: str | None, schema: Any, where: str, strict: bool | None = None
) -> Constraint | None:
    """A structured-output format (OpenAI's `response_format` or `text.format`) as a grammar."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise InvalidInput(f"{where} of type json_schema needs a 'schema' object")
        return Constraint(kind="json_schema", json_schema=schema)
    raise InvalidInput(f"{where} type {kind!r} is not text, json_object or json_schema")


# Messages and tools stay plain dicts (clients send many extra fields), but the fields the chat
# renderer reads must have OpenAI's types: anything else is a 400 that names the field.
def _check_message(message: dict[str, Any], where: str) -> None:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise InvalidInput(f"{where}.content must be a string or a list of content parts")
        for k, part in enumerate(content):
            if part.get("type") == "text" and not isinstance(part.get("text", ""), str):
                raise InvalidInput(f"{where}.content[{k}].text must be a string")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidInput(f"{where}.tool_calls must be a list of tool calls")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidInput(
                f"{where}.tool_calls[{k}] must be an object with function.name (a string) and "
                "function.arguments (a JSON string)"
            )


def _check_function(function: Any, where: str) -> None:
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidInput(f"{where} must be an object with a name (a string)")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise InvalidInput(f"{where}.parameters must be a JSON schema object")


class ChatCompletionRequest(OpenAIRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema: enforced by constrained decoding."
    )

    @model_validator(mode="after")
    def _check_messages(self) -> ChatCompletionRequest:
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise InvalidInput(f"messages[{i}].role {m.get('role')!r} is not a chat role")
            _check_message(m, f"messages[{i}]")
        for k, tool in enumerate(self.tools or []):
            _check_function(tool.get("function", tool), f"tools[{k}].function")
        if self.top_logprobs and not self.logprobs:
            raise InvalidInput("top_logprobs needs logprobs=true")
        check_tool_choice(self.tool_choice)
        if isinstance(self.tool_choice, dict) and not isinstance(
            self.tool_choice.get("function", {}), dict
        ):
            raise InvalidInput("tool_choice.function must be an object with the tool's name")
        return self

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call, after tool_choice."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            wanted = self.tool_choice.get("function", {}).get("name")
            chosen = [t for t in self.tools if t.get("function", {}).get("name") == wanted]
            if not chosen:
                raise InvalidInput(f"tool_choice names {wanted!r}, which is not in tools")
            return chosen
        return self.tools

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def constraint(self) -> Constraint | None:
        fmt = self.response_format or {}
        spec = fmt.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise InvalidInput("response_format.json_schema must be an object")
        answer = json_constraint(fmt.get("type"), spec.get("schema"), "response_format")
        structured = self.structured_constraint()
        if answer is not None and structured is not None:
            raise InvalidInput("set response_format or structured_outputs, not both")
        return answer or structured


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids as given."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidInput("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


ModelObject = dict[str, Any]


def model_object(name: str, owned_by: str = "lightning-rl", parent: str | None = None):
    out: ModelObject = {"id": name, "object": "model", "created": 0, "owned_by": owned_by}
    if parent:
        out["parent"] = parent
    return out


ErrorType = Literal["invalid_request_error", "not_found_error", "server_error"]
