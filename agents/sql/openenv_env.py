"""The SQL environment written to OpenEnv's standard (openenv-core's `Environment`, `Action` and
`Observation`): served by OpenEnv's own server, or by an environment service of this project
through `lightning_core.envs.openenv.from_openenv` (docs/environments.md).

It is agents/sql/env_service.py's environment (a private in-memory copy of the task's
database per session), with OpenEnv's typed action and observation around it. Needs
openenv-core (`make setup-dev` installs it without its UI dependencies).
"""

from __future__ import annotations

import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from lightning_core.envs.base import InvalidAction
from lightning_rl.agents.sql.env_service import SQLEnvironment


class SQLAction(Action):
    """Run a statement on the session's database, or submit the final query."""

    sql: str | None = None
    submit: str | None = None


class SQLObservation(Observation):
    """What the statement gave (or the database's tables, after a reset)."""

    columns: list[str] = Field(default_factory=list)
    rows: list[list[Any]] = Field(default_factory=list)
    truncated: bool = False
    error: str | None = None
    tables: list[str] = Field(default_factory=list)


class SQLOpenEnv(Environment[SQLAction, SQLObservation, State]):
    """One session: a private copy of one database (`reset(db=...)`)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._sql = SQLEnvironment()
        self._state = State(episode_id=None, step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **task: Any
    ) -> SQLObservation:
        try:
            first = self._sql.reset(task, seed)
        except InvalidAction as exc:
            return SQLObservation(error=str(exc), done=True)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return SQLObservation(tables=first.observation["tables"])

    def step(
        self, action: SQLAction, timeout_s: float | None = None, **kwargs: Any
    ) -> SQLObservation:
        self._state.step_count += 1
        given = {"submit": action.submit} if action.submit is not None else {"sql": action.sql}
        try:
            outcome = self._sql.step(given)
        except InvalidAction as exc:
            return SQLObservation(error=str(exc))
        observation = dict(outcome.observation)
        observation.pop("submitted", None)
        return SQLObservation(**observation, reward=outcome.reward, done=outcome.done)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self._sql.close()


def factory():
    """This environment for `python -m lightning_core.envs --env ...:factory`."""
    from lightning_core.envs.openenv import from_openenv

    return from_openenv(SQLOpenEnv, SQLAction)()
