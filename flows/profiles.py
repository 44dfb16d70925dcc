"""What the pipeline needs to know about each example agent, by name.

An agent itself is only a callable; training it also needs its tasks, how its rewards are read
and where its models are registered. A profile holds those facts, so `--agent calc` is all a user
types. Other agents train with `--agent module:function` plus `--tasks module:function`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from lightning_core import semconv
from lightning_core.algo.rewards import AIRRule
from lightning_core.errors import InvalidInput
from lightning_core.judge.config import JudgeBrief
from lightning_core.rollouts.agent_ref import load_agent, parse_agent_ref


class AgentProfile(BaseModel):
    """An agent, its tasks and its training defaults."""

    name: str = Field(description="Short name: runs, policy versions and reports use it.")
    agent: str = Field(description="The agent callable, as 'module:function'.")
    tasks: str = Field(
        description="Task loader 'module:function', called as (split, size, source) and "
        "returning dicts with at least an 'id'."
    )
    task_source: str | None = Field(None, description="Default dataset the loader draws from.")
    air: list[AIRRule] = Field(
        default_factory=list, description="Automatic intermediate rewards for its spans."
    )
    train_agents: list[str] | None = Field(
        None, description="Agent names whose LLM calls are trained; None trains all."
    )
    registered_model: str = Field(description="MLflow registered model name of its adapters.")
    success_threshold: float = Field(
        1.0, description="A final reward at least this counts as solved in success rates."
    )
    rollout_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Time budget of one attempt; agents with many LLM calls need more.",
    )
    tool_format: Literal["auto", "hermes", "line"] = Field(
        "line", description="How the gateway renders its tools for a model without a tool template."
    )
    judge: JudgeBrief | None = Field(
        None,
        description="What a judge checks in its trajectories (judge.endpoint turns a judge on); "
        "None: the agent has no rubric, and a judge needs judge.rubric.",
    )

    def load_agent(self) -> Callable[..., Any]:
        return load_agent(self.agent)

    def check_loaders(self) -> None:
        """Import the agent and its task loader now: a misspelt module is one line before a
        run starts (a Prefect server, a run folder), naming the reference that failed."""
        self.load_agent()
        load_agent(self.tasks, "task loader")

    def load_tasks(self, split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
        loader = load_agent(self.tasks, "task loader")
        try:
            tasks = loader(split, size, source or self.task_source)
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"cannot load {split} tasks of agent {self.name!r}: {exc}") from exc
        if not tasks:
            raise InvalidInput(f"the {split} split of agent {self.name!r} is empty")
        return tasks


PROFILES: dict[str, AgentProfile] = {
    "calc": AgentProfile(
        name="calc",
        agent="lightning_rl.agents.calc:agent",
        tasks="lightning_rl.agents.calc:load_tasks",
        task_source="arithmetic",
        # A small bonus per successful calculator call: the behaviour that makes answers right.
        air=[AIRRule(name=semconv.TOOL_SPAN, outcome="success", reward=0.1)],
        registered_model="lightning-calc",
    ),
    "sql": AgentProfile(
        name="sql",
        agent="lightning_rl.agents.sql:agent",
        tasks="lightning_rl.agents.sql:load_tasks",
        registered_model="lightning-sql",
        # No AIR: a bonus for a query that returned rows paid wrong queries as much as nearly
        # right ones (the final policy of the demo returned rows more often but was mostly
        # wrong); the train split's graded reward (agents/sql/reward.py) replaces it.
        # Selective optimisation, as in the paper: the checker's calls are not trained.
        train_agents=["writer", "rewriter"],
        # Up to 5 calls of up to 128 tokens each, queued with many other rollouts on a CPU.
        rollout_timeout_s=900.0,
        tool_format="auto",
        success_threshold=1.0,
        judge=JudgeBrief(
            rubric="The final SQL query answers the question exactly on the database: the "
            "right tables, joins, filters and columns, no extra or missing rows.",
            task_fields=["question", "db"],
        ),
    ),
    "rag": AgentProfile(
        name="rag",
        agent="lightning_rl.agents.rag:agent",
        tasks="lightning_rl.agents.rag:load_tasks",
        registered_model="lightning-rag",
        # The model's own searches (agents/rag/agent.py): one that brings a document it has
        # not read earns a little, one that finds nothing or only what it has read (the base
        # model repeats a search until it runs out of turns) costs a little. MAX_TURNS = 4
        # searches earn less than an answer's 0.1 for its format: never answering cannot pay.
        air=[
            AIRRule(
                name=semconv.TOOL_SPAN,
                outcome="success",
                attributes={semconv.TOOL_NAME: "search", "new_document": True},
                reward=0.02,
            ),
            AIRRule(
                name=semconv.TOOL_SPAN,
                outcome="success",
                attributes={semconv.TOOL_NAME: "search", "new_document": False},
                reward=-0.05,
            ),
            AIRRule(
                name=semconv.TOOL_SPAN,
                outcome="failure",
                attributes={semconv.TOOL_NAME: "search"},
                reward=-0.05,
            ),
        ],
        rollout_timeout_s=600.0,
        tool_format="line",
        # The reward is 0.1 * format + 0.9 * F1: at least 0.9 means the answer is right.
        success_threshold=0.9,
        judge=JudgeBrief(
            rubric="The final line gives ANSWER: followed by the correct short answer to the "
            "question, and the search results shown support it.",
            task_fields=["question"],
            # F1 >= 0.9 in 0.1 * format + 0.9 * F1.
            gold_threshold=0.91,
        ),
    ),
}


def profile(agent: str, tasks: str | None = None) -> AgentProfile:
    """The profile of a named agent, or one made up for `module:function` agents."""
    if agent in PROFILES:
        found = PROFILES[agent]
        return found.model_copy(update={"tasks": tasks}) if tasks else found
    if ":" not in agent:
        raise InvalidInput(
            f"unknown agent {agent!r}: use one of {', '.join(sorted(PROFILES))}, or "
            "'module:function' together with --tasks 'module:function'"
        )
    if tasks is None:
        load_agent(agent)  # a misspelt agent module is the first thing to say
        raise InvalidInput(f"agent {agent!r} needs a task loader: pass tasks='module:function'")
    module, _ = parse_agent_ref(agent)
    name = module.rsplit(".", 1)[-1]
    return AgentProfile(name=name, agent=agent, tasks=tasks, registered_model=f"lightning-{name}")
