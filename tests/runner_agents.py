"""Agents for the runner's tests, importable by reference (`tests.runner_agents:echo_agent`)."""

from __future__ import annotations

import time
from typing import Any

from lightning_core import tracing
from lightning_core.types import LLMEndpoint


def echo_agent(task: Any, llm: LLMEndpoint) -> float:
    """Rewards the task's own `reward` field, after recording what it was given."""
    tracing.emit_tool_result("echo", success=True, output=llm.base_url)
    return float(task["reward"])


async def emitting_agent(task: Any, llm: LLMEndpoint) -> None:
    """Records its reward as a span and returns None, as agents that score themselves do."""
    tracing.emit_reward(float(task["reward"]))


def sleepy_agent(task: Any, llm: LLMEndpoint) -> float:
    """Takes `task["sleep"]` seconds, in its thread, to earn 1.0."""
    time.sleep(task["sleep"])
    return 1.0


NOT_CALLABLE = 42
