"""What every stage of a training run reads beside its config: the run's names and paths
(RunContext), its tasks (each split loaded once per process), and the agent profile's defaults
that the config leaves open (success threshold, AIR rules)."""

from __future__ import annotations

import functools
import re
from typing import Any

from pydantic import BaseModel

from lightning_core import semconv
from lightning_core.algo.rewards import AIRRule
from lightning_core.data.collect import CreditConfig
from lightning_core.data.offline import OfflineBatch
from lightning_core.errors import InvalidInput
from lightning_rl.flows import data_plan
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.profiles import AgentProfile, profile


class RunContext(BaseModel):
    """What every iteration of a run needs to know beside its config: plain names and paths."""

    run_name: str
    root: str
    server_url: str
    base_model: str
    registered_model: str
    # The path of the policy server's 0600 key file, not the key: parameters are stored and
    # shown in the UI.
    key_file: str
    # The run's record of what renders prompts (docs/provenance.md): the server's fingerprint when
    # the run started; transitions rendered otherwise are refused. None: not checked.
    template_fingerprint: str | None = None


@functools.lru_cache(maxsize=8)
def _load_tasks(
    agent: str, loader: str | None, split: str, size: int, source: str | None
) -> list[dict[str, Any]]:
    # Each iteration's subflow asks again; the run's process loads a split once.
    return profile(agent, loader).load_tasks(split, size, source)


@functools.lru_cache(maxsize=8)
def plan_tasks(root: str) -> list[dict[str, Any]]:
    """data=new_tasks: the task table's new tasks the run's data plan saved in its folder."""
    return data_plan.load_plan_tasks(root)


@functools.lru_cache(maxsize=2)
def plan_batch(root: str) -> OfflineBatch:
    """data=episodes: the production episodes the run's data plan saved in its folder."""
    return data_plan.load_plan_batch(root)


def train_tasks(config: TrainConfig, root: str | None = None) -> list[dict[str, Any]]:
    """The tasks rollouts draw from: the agent's train split, or (data=new_tasks) the task
    table's new tasks the run's data plan saved in its folder."""
    if config.data.source == "new_tasks" and root is not None:
        return plan_tasks(root)
    return _load_tasks(
        config.agent, config.tasks, "train", config.data.train_size, config.data.task_source
    )


def heldout_tasks(config: TrainConfig, split: str = "test") -> list[dict[str, Any]]:
    """The held-out benchmark's tasks, or those of another held-out split
    (evaluation.extra_splits)."""
    return _load_tasks(
        config.agent, config.tasks, split, config.evaluation.eval_size, config.data.task_source
    )


def credit(config: TrainConfig, agent: AgentProfile) -> CreditConfig:
    """The credit config with its success threshold: the user's, else the agent profile's."""
    if config.credit.success_threshold is not None:
        return config.credit
    return config.credit.model_copy(update={"success_threshold": agent.success_threshold})


def air(agent: AgentProfile, config: TrainConfig) -> list[AIRRule]:
    """The automatic intermediate rewards: the profile's, or one rule from air_reward."""
    if config.air_reward is None:
        return agent.air
    if config.air_reward == 0:
        return []
    return [AIRRule(name=semconv.TOOL_SPAN, outcome="success", reward=config.air_reward)]


# Agent names become folder and policy version names with policy_per_agent.
_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def policy_agents(config: TrainConfig, agent: AgentProfile) -> list[str] | None:
    """The agents that get a policy each with policy_per_agent; None: one shared policy."""
    if not config.policy_per_agent:
        return None
    if config.data.source == "episodes":
        raise InvalidInput(
            "policy_per_agent with data=episodes is not supported yet: train production "
            "episodes into one shared policy (policy_per_agent=false)"
        )
    names = config.train_agents or agent.train_agents
    if not names:
        raise InvalidInput(
            f"policy_per_agent trains one adapter per agent, but agent {agent.name!r} names no "
            "agents to train: set train_agents to the agent names its calls carry "
            "(X-Lightning-Agent), e.g. train_agents=['writer', 'rewriter']"
        )
    bad = [n for n in names if not _AGENT_NAME.fullmatch(n)]
    if bad or len(set(names)) != len(names):
        raise InvalidInput(
            f"policy_per_agent needs distinct agent names of letters, digits, '.', '_' and '-' "
            f"(they name adapter folders and policy versions); got {names}"
        )
    return list(names)
