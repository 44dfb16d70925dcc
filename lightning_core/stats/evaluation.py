"""Held-out evaluation: a policy's score on a benchmark, with its uncertainty.

Evaluation rollouts run like training ones (same agent, same gateway, spans stored) but in test
mode and greedy, so a score measures the policy rather than the sampler. A benchmark of a few
hundred tasks is small: the score comes with a Wilson 95 % interval, which behaves near 0 and 1
where the normal approximation does not.

Every score names its benchmark: a content hash of the tasks and of what makes the measure
(agent, success threshold, sampling, attempts), so that two scores are compared only when they
measure the same thing (the promotion rule, lightning_rl.registry.promotion).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, Field

from lightning_core.rollouts.runner import Runner
from lightning_core.store.base import LightningStore
from lightning_core.types import Rollout, RolloutMode, RolloutRequest, RolloutStatus, Sampling

Z_95 = 1.959963984540054
# How evaluation rollouts run: greedy, so the score measures the policy rather than the sampler;
# a second attempt only for a rollout whose agent failed (not for a wrong answer).
EVAL_SAMPLING = Sampling(temperature=0.0)
EVAL_MAX_ATTEMPTS = 2
# Hex digits of the benchmark id: 64 bits, short enough for a tag key, far from collisions.
_BENCHMARK_ID_CHARS = 16


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
    tasks: int = Field(description="Benchmark tasks run: the benchmark's size.")
    benchmark_id: str | None = Field(
        None,
        description="What the score was measured on (benchmark_id()); scores of different ids "
        "are never compared. None: scored before benchmarks had ids (an older checkpoint).",
    )
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


def benchmark_id(
    tasks: Sequence[Mapping[str, Any]],
    *,
    agent: str,
    threshold: float,
    sampling: Sampling = EVAL_SAMPLING,
    max_attempts: int = EVAL_MAX_ATTEMPTS,
) -> str:
    """The id of a benchmark: a hash of its tasks' content and of what defines the measure.

    The tasks count as a multiset (their order does not change a score); `agent` is the
    agent's reference (a profile's `module:function`), which plays them; `threshold` the
    episode return that counts as a success. The rollout timeout and concurrency are left out:
    they decide how fast a benchmark runs, not what it measures.
    """
    tasks_digests = sorted(_digest(task) for task in tasks)
    spec = {
        "tasks": tasks_digests,
        "agent": agent,
        "success_threshold": float(threshold),
        "sampling": sampling.as_kwargs(),
        "max_attempts": max_attempts,
    }
    return _digest(spec)[:_BENCHMARK_ID_CHARS]


def _digest(value: Any) -> str:
    # Canonical JSON: keys sorted, no whitespace, anything JSON lacks (a date) as its str().
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def score_rollouts(
    policy_version: str,
    rollouts: Sequence[Rollout],
    threshold: float = 1.0,
    benchmark: str | None = None,
) -> EvalResult:
    """The score of finished evaluation rollouts (of the benchmark whose id is `benchmark`)."""
    n = len(rollouts)
    rewards = [
        (r.episode_return or 0.0) if r.status is RolloutStatus.succeeded else 0.0 for r in rollouts
    ]
    successes = sum(1 for value in rewards if value >= threshold)
    low, high = wilson_interval(successes, n)
    return EvalResult(
        policy_version=policy_version,
        tasks=n,
        benchmark_id=benchmark,
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
    sampling: Sampling = EVAL_SAMPLING,
    max_attempts: int = EVAL_MAX_ATTEMPTS,
) -> list[RolloutRequest]:
    """Greedy test-mode rollouts of `tasks` (each a dict with an "id")."""
    return [
        RolloutRequest(
            input=task,
            task_id=str(task.get("id")),
            mode=RolloutMode.test,
            policy_version=policy_version,
            max_attempts=max_attempts,
            metadata={"sampling": sampling.as_kwargs(), "purpose": "evaluation"},
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
    *,
    agent: str,
) -> EvalResult:
    """Run `tasks` greedily on `policy_version` with `runner` (playing `agent`, its reference)
    and score them; the result names the benchmark they make."""
    queued = await store.enqueue_rollouts(eval_requests(tasks, policy_version))
    ids = [r.rollout_id for r in queued]
    await runner.run_until_done(ids, timeout=timeout)
    finished = await store.query_rollouts(rollout_ids=ids)
    benchmark = benchmark_id(tasks, agent=agent, threshold=threshold)
    return score_rollouts(policy_version, finished, threshold, benchmark)
