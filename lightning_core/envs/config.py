"""An environment service's limits: every one bounds what a client can make it spend."""

from __future__ import annotations

from pydantic import BaseModel, Field


class EnvServiceConfig(BaseModel):
    """Limits of one environment service process."""

    max_sessions: int = Field(
        256, ge=1, description="Sessions open at once; past it a new session gets a 429."
    )
    idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A session without a call for this long is closed (an agent that died "
        "without closing it frees its slot).",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest reset or step; past it the call answers 504 and the session is "
        "closed (its state is no longer known).",
    )
    max_request_bytes: int = Field(
        1_000_000, ge=1024, description="Largest request body (a task, an action)."
    )
    max_observation_bytes: int = Field(
        4_000_000,
        ge=1024,
        description="Largest answer; a bigger observation is an environment error (500).",
    )
    workers: int = Field(
        32, ge=1, le=1024, description="Threads that run environment calls at once."
    )
