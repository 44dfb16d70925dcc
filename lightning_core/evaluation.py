"""Held-out evaluation: a policy's score on a benchmark, with its uncertainty.

Evaluation rollouts run like training ones (same agent, same gateway, spans stored) but in test
mode and greedy, so a score measures the policy rather than the sampler. A benchmark of a few
hundred tasks is small: the score comes with a Wilson 95 % interval, which behaves near 0 and 1
where the normal approximation does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, Field

from lightning_core.runner import Runner
from lightning_core.store.base import LightningStore
from lightning_core.types import Rollout, RolloutMode, RolloutRequest, RolloutStatus

Z_95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


class EvalResult(BaseModel):
    """A policy's score on a benchmark."""

    policy_version: str = Field(description="The policy evaluated.")
    tasks: int = Field(description="Benchmark tasks run.")
    successes: int = Field(description="Rollouts whose episode return reached the threshold.")
    score: float = Field(
        # Runs before the glossary's renames wrote `accuracy`; their summaries still load.
        validation_alias=AliasChoices("score", "accuracy"),
        description="The held-out score: successes / tasks, what promotion compares.",
    )
    ci_low: float = Field(description="Lower end of the Wilson 95 % interval of the score.")
    ci_high: float = Field(description="Upper end of the Wilson 95 % interval of the score.")
    mean_reward: float = Field(description="Mean episode return (failed rollouts count 0).")
    failed: int = Field(0, description="Rollouts whose agent failed on every attempt.")
    rewards: dict[str, float] = Field(
        default_factory=dict,
        exclude=True,
        description="Each task's final reward (task id -> reward; failed rollouts 0): what a "
        "paired comparison of two policies on the same tasks needs. Left out of dumps.",
    )

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {
            f"{prefix}/score": self.score,
            f"{prefix}/ci_low": self.ci_low,
            f"{prefix}/ci_high": self.ci_high,
            f"{prefix}/mean_reward": self.mean_reward,
            f"{prefix}/failed": float(self.failed),
        }

    def summary(self) -> str:
        return (
            f"{self.policy_version}: {self.score:.1%} ({self.successes}/{self.tasks}, "
            f"95% CI {self.ci_low:.1%}-{self.ci_high:.1%})"
        )


def score_rollouts(
    policy_version: str, rollouts: Sequence[Rollout], threshold: float = 1.0
) -> EvalResult:
    """The score of finished evaluation rollouts."""
    n = len(rollouts)
    rewards = [
        (r.episode_return or 0.0) if r.status is RolloutStatus.succeeded else 0.0 for r in rollouts
    ]
    successes = sum(1 for value in rewards if value >= threshold)
    low, high = wilson_interval(successes, n)
    return EvalResult(
        policy_version=policy_version,
        tasks=n,
        successes=successes,
        score=successes / n if n else 0.0,
        ci_low=low,
        ci_high=high,
        mean_reward=sum(rewards) / n if n else 0.0,
        failed=sum(1 for r in rollouts if r.status is not RolloutStatus.succeeded),
        rewards={str(r.task_id): value for r, value in zip(rollouts, rewards, strict=True)},
    )


def eval_requests(
    tasks: Sequence[dict[str, Any]],
    policy_version: str,
    sampling: dict[str, Any] | None = None,
    max_attempts: int = 2,
) -> list[RolloutRequest]:
    """Greedy test-mode rollouts of `tasks` (each a dict with an "id")."""
    sampling = {"temperature": 0.0, **(sampling or {})}
    return [
        RolloutRequest(
            input=task,
            task_id=str(task.get("id")),
            mode=RolloutMode.test,
            policy_version=policy_version,
            max_attempts=max_attempts,
            metadata={"sampling": sampling, "purpose": "evaluation"},
        )
        for task in tasks
    ]


async def evaluate(
    store: LightningStore,
    runner: Runner,
    tasks: Sequence[dict[str, Any]],
    policy_version: str,
    threshold: float = 1.0,
    timeout: float | None = None,
) -> EvalResult:
    """Run `tasks` greedily on `policy_version` with `runner` and score them."""
    queued = await store.enqueue_rollouts(eval_requests(tasks, policy_version))
    ids = [r.rollout_id for r in queued]
    await runner.run_until_done(ids, timeout=timeout)
    finished = await store.query_rollouts(rollout_ids=ids)
    return score_rollouts(policy_version, finished, threshold)
