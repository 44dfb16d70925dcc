"""AIR, automatic intermediate rewards: system signals in the trace turned into rewards.

A rule matches spans by name (glob) and, optionally, by outcome (the span's status, or the
`lightning.tool.success` attribute that `emit_tool_result` sets) and by attribute values; each
matching span adds `reward` to the step it follows. For example a small bonus for every
successful calculator call, or a penalty for each tool call that raised.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Literal

from pydantic import BaseModel, Field

from lightning_core import semconv
from lightning_core.types import FiniteFloat, Span, SpanStatusCode


class AIRRule(BaseModel):
    """Turn matching spans into an intermediate reward."""

    name: str = Field(
        semconv.TOOL_SPAN, description="Span name to match; shell-style globs allowed."
    )
    outcome: Literal["success", "failure", "any"] = Field(
        "any",
        description="success: the tool reported success (or the span did not end in error); "
        "failure: the opposite; any: both.",
    )
    attributes: dict[str, Any] = Field(
        default_factory=dict, description="Attribute values the span must also have."
    )
    reward: FiniteFloat = Field(description="Reward added to the step the span follows.")

    def matches(self, span: Span) -> bool:
        if not fnmatch.fnmatchcase(span.name, self.name):
            return False
        if any(span.attributes.get(k) != v for k, v in self.attributes.items()):
            return False
        if self.outcome == "any":
            return True
        succeeded = span.attributes.get(semconv.TOOL_SUCCESS)
        if succeeded is None:
            succeeded = span.status_code is not SpanStatusCode.error
        return bool(succeeded) == (self.outcome == "success")


def air_reward(span: Span, rules: list[AIRRule]) -> float:
    """The total reward the rules give one span (0 when none matches)."""
    return sum(rule.reward for rule in rules if rule.matches(span))
