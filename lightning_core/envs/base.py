"""What an environment is to the service that hosts it: one instance per session.

The methods are plain (synchronous) Python: the service runs each call on a worker thread,
within its time limit, so an environment may block (a database query, a subprocess) without
holding up other sessions. An instance never sees another session's calls, so whatever state
it keeps is the session's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, Field

from lightning_core.errors import LightningError
from lightning_core.types import FiniteFloat


class StepOutcome(BaseModel):
    """What one action did: what the agent sees next, a reward if the environment gives one,
    and whether the episode is over."""

    observation: Any = None
    reward: FiniteFloat | None = None
    done: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class Environment(Protocol):
    def reset(self, task: Any, seed: int | None) -> StepOutcome:
        """Begin an episode of `task`; its first observation."""
        ...

    def step(self, action: Any) -> StepOutcome:
        """Apply one action."""
        ...

    def close(self) -> None:
        """Release what the session holds (its database, its processes)."""
        ...


# Makes a fresh environment for each new session.
EnvironmentFactory = Callable[[], Environment]


class InvalidAction(ValueError):
    """An action the environment refuses: the service answers 422 with the message, and the
    session goes on (the agent may try another)."""


class ActionRefused(LightningError):
    """The environment refused an action (or a task): the service answers 422 with why; a
    session that had begun goes on."""

    status_code = 422
