"""Prefect task of judge rewards: the judge's calibration against gold before a run trusts it
(docs/judge.md)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning_core.errors import InvalidInput
from lightning_core.judge.calibration import Calibration, calibrate
from lightning_core.types import RolloutStatus, Sampling
from lightning_rl.judge_setup import JudgeSetup, judge_collected
from lightning_rl.policy_server import store_client
from lightning_rl.tasks.rollouts import sample_episodes


@task(
    name="calibrate-judge",
    retries=1,
    retry_delay_seconds=5,
    timeout_seconds=3 * 3600,
    cache_policy=NO_CACHE,
)
async def calibrate_judge(
    server_url: str,
    agent: str,
    tasks: list[dict[str, Any]],
    setup: JudgeSetup,
    policy_version: str,
    group_prefix: str,
    sampling: Sampling,
    gold_threshold: float,
    concurrency: int,
    rollout_timeout_s: float,
    seed: int | None = None,
    key_file: str | None = None,
    run_dir: str | None = None,
) -> Calibration:
    """The judge against gold: G rollouts of the starting policy on each of `tasks`, judged,
    each judge score paired with the agent's own reward."""
    ids = await sample_episodes(
        server_url,
        agent,
        tasks,
        setup.config.calibration.group_size,
        policy_version,
        group_prefix,
        sampling,
        concurrency,
        rollout_timeout_s,
        seed,
        key_file,
        run_dir,
        "calibration",
    )
    async with store_client(server_url, key_file) as store:
        judged = await judge_collected(store, setup, ids)
        rollouts = await store.query_rollouts(rollout_ids=ids)
    pairs = [
        (judged.scores[r.rollout_id], r.episode_return or 0.0)
        for r in rollouts
        if r.status is RolloutStatus.succeeded and r.rollout_id in judged.scores
    ]
    if not pairs:
        raise InvalidInput(
            "the judge scored none of the calibration's trajectories: "
            f"{len(judged.failed)} failed (see the lightning.judge spans), "
            f"{len(rollouts) - len(judged.failed)} had no recorded LLM call"
        )
    scores, gold = zip(*pairs, strict=True)
    return calibrate(
        list(scores), list(gold), gold_threshold, setup.config.calibration.verdict_threshold
    )
