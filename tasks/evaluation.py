"""Prefect task of the evaluation stage: a policy's held-out score."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning_core.rollouts.runner import AttemptResult
from lightning_core.stats.evaluation import EvalResult, evaluate
from lightning_rl import progress
from lightning_rl.policy_server import store_client
from lightning_rl.tasks.rollouts import make_runner


@task(
    name="evaluate-policy",
    retries=1,
    retry_delay_seconds=5,
    timeout_seconds=3 * 3600,
    cache_policy=NO_CACHE,
)
async def evaluate_policy(
    server_url: str,
    agent: str,
    tasks: Sequence[dict[str, Any]],
    policy_version: str,
    concurrency: int,
    rollout_timeout_s: float,
    success_threshold: float = 1.0,
    run_dir: str | None = None,
    key_file: str | None = None,
) -> EvalResult:
    """Greedy rollouts of every held-out task on `policy_version`; the score with its 95 % CI."""

    def on_attempt(result: AttemptResult) -> None:
        if run_dir is not None:
            progress.report(run_dir, "eval", policy=policy_version, total=len(tasks))

    async with store_client(server_url, key_file) as store:
        runner = make_runner(
            agent, store, server_url, concurrency, rollout_timeout_s, policy_version, on_attempt
        )
        return await evaluate(store, runner, tasks, policy_version, success_threshold, agent=agent)
