"""An environment written to OpenEnv's standard, hosted by an environment service.

OpenEnv's `Environment` has `reset(seed=None, episode_id=None, **kwargs) -> Observation`,
`step(action) -> Observation` and `close()`, where an Observation is a pydantic model whose
`reward` and `done` fields say what the step earned and whether the episode ended, and an
Action a pydantic model the environment declares. `from_openenv` turns such a class into a
factory of this service's environments: the task's fields are the reset's keyword arguments,
and an action is validated into the declared Action class. Nothing of OpenEnv is imported here:
the standard is the shape, so an environment that follows it needs no adapter code of its own.

    python -m lightning_core.envs --env my_env:factory     # factory = from_openenv(MyEnv, MyAction)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from lightning_core.envs.base import EnvironmentFactory, InvalidAction, StepOutcome

# The Observation fields OpenEnv lifts out of the observation itself.
_LIFTED = {"reward", "done", "metadata"}


def _outcome(observation: Any) -> StepOutcome:
    if isinstance(observation, BaseModel):
        data = observation.model_dump(mode="json")
    else:
        data = dict(observation)
    reward = data.get("reward")
    return StepOutcome(
        observation={k: v for k, v in data.items() if k not in _LIFTED},
        reward=None if reward is None else float(reward),
        done=bool(data.get("done", False)),
        info=dict(data.get("metadata") or {}),
    )


class OpenEnvHosted:
    """One session's OpenEnv-standard environment."""

    def __init__(self, env: Any, action_cls: type[BaseModel]) -> None:
        self.env, self.action_cls = env, action_cls

    def reset(self, task: Any, seed: int | None) -> StepOutcome:
        kwargs = dict(task) if isinstance(task, dict) else {}
        return _outcome(self.env.reset(seed=seed, **kwargs))

    def step(self, action: Any) -> StepOutcome:
        try:
            typed = self.action_cls.model_validate(action)
        except ValidationError as exc:
            raise InvalidAction(f"not a {self.action_cls.__name__}: {exc}") from None
        return _outcome(self.env.step(typed))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


def from_openenv(env_cls: Callable[[], Any], action_cls: type[BaseModel]) -> EnvironmentFactory:
    """A factory of service environments, each a new instance of the OpenEnv environment."""
    return lambda: OpenEnvHosted(env_cls(), action_cls)
