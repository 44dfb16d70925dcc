"""The calc agent: an AutoGen AgentChat assistant with a calculator tool (the paper's Calc-X).

It is plain AutoGen code pointed at an OpenAI-compatible endpoint; the only lightning-rl API it
uses is tracing (`emit_tool_result`), which does nothing outside a training rollout. It answers
one question: call the calculator, read the result, reply `ANSWER: <number>`.

The model context starts with one worked example (a question, a calculator call, its result and
the answer) as ordinary AutoGen messages, so whichever way the endpoint renders tool calls, the
example shows the model that same way.
"""

from __future__ import annotations

from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core import FunctionCall
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import (
    AssistantMessage,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    ModelFamily,
    UserMessage,
)
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

from lightning_core.tracing import emit_tool_result
from lightning_rl.agents.calc.calculator import CalculatorError, evaluate, format_number
from lightning_rl.agents.calc.reward import answer_reward

AGENT_NAME = "calc"
SYSTEM_MESSAGE = (
    "You solve arithmetic questions. Use the calculator for the whole expression, then reply "
    "with ANSWER: followed by the number."
)
# Calls are short (one tool line, then one answer line); a cap keeps a rambling sample cheap.
MAX_TOKENS = 48

_MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "structured_output": False,
    "family": ModelFamily.UNKNOWN,
}


async def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        result = format_number(evaluate(expression, require_operation=True))
    except CalculatorError as exc:
        emit_tool_result("calc", success=False, error=str(exc), expression=expression)
        return f"error: {exc}"
    emit_tool_result("calc", success=True, output=result, expression=expression)
    return result


def _example() -> list[Any]:
    call = FunctionCall(id="example", name="calc", arguments='{"expression": "3 * (4 + 5)"}')
    return [
        UserMessage(content="What is 3 * (4 + 5)?", source="user"),
        AssistantMessage(content=[call], source=AGENT_NAME),
        FunctionExecutionResultMessage(
            content=[FunctionExecutionResult(call_id="example", name="calc", content="27")]
        ),
        AssistantMessage(content="ANSWER: 27", source=AGENT_NAME),
    ]


def model_client(llm: Any, headers: dict[str, str] | None = None) -> OpenAIChatCompletionClient:
    """AutoGen's OpenAI client for an endpoint with `base_url`, `model`, `api_key`, `sampling`;
    `headers` go on every call (a production user's episode id, say)."""
    sampling = {k: v for k, v in (getattr(llm, "sampling", None) or {}).items() if v is not None}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        model_info=_MODEL_INFO,
        default_headers={"X-Lightning-Agent": AGENT_NAME, **(headers or {})},
        **sampling,
    )


def build_agent(client: OpenAIChatCompletionClient) -> AssistantAgent:
    """The AutoGen assistant: calculator tool, one worked example, a final reflection call."""
    tool = FunctionTool(calculate, name="calc", description="Evaluate an arithmetic expression.")
    return AssistantAgent(
        AGENT_NAME,
        model_client=client,
        tools=[tool],
        system_message=SYSTEM_MESSAGE,
        model_context=UnboundedChatCompletionContext(initial_messages=_example()),
        reflect_on_tool_use=True,
        max_tool_iterations=2,
    )


async def solve(question: str, llm: Any, headers: dict[str, str] | None = None) -> str:
    """The agent's final reply to a question."""
    client = model_client(llm, headers)
    try:
        result = await build_agent(client).run(task=question)
    finally:
        await client.close()
    final = result.messages[-1]
    content = getattr(final, "content", "")
    return content if isinstance(content, str) else str(content)


async def agent(task: dict[str, Any], llm: Any) -> float:
    """Rollout entry point: solve `task["question"]`; reward 1 for the right answer, else 0."""
    reply = await solve(task["question"], llm)
    return answer_reward(reply, float(task["answer"]))
