"""Prefect tasks of the rollout stage: plan, run (fanned out), collect transitions."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import Collected, CreditConfig, collect
from lightning_core.data.provenance import ProvenanceRecord
from lightning_core.errors import BudgetSpent
from lightning_core.rollouts.agent_ref import load_agent
from lightning_core.rollouts.runner import AttemptResult, Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest, Sampling
from lightning_rl import progress
from lightning_rl.judge_setup import JudgeSetup, judge_collected
from lightning_rl.policy_server import store_client
from lightning_rl.retries import retry_unless


def make_runner(
    agent: str,
    store: HttpStoreClient,
    server_url: str,
    concurrency: int,
    rollout_timeout_s: float,
    default_model: str,
    on_attempt: Callable[[AttemptResult], None] | None = None,
) -> Runner:
    """A Runner of `agent` (a reference) on the server's queue, as the flow's tasks use it;
    its agents and spans use `store`'s API key."""
    config = RunnerConfig(
        concurrency=concurrency,
        rollout_timeout_s=rollout_timeout_s,
        default_model=default_model,
        poll_wait_s=0.5,
    )
    return Runner(load_agent(agent), store, server_url, config, on_attempt=on_attempt)


def rollout_seed(seed: int, iteration: int, index: int) -> int:
    """The sampling seed of rollout `index` of an iteration's plan: a fixed function of the
    run's seed, the iteration and the rollout's place in the plan."""
    digest = hashlib.blake2b(f"{seed}/{iteration}/{index}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "big")


@task(
    name="plan-rollouts",
    retries=2,
    retry_delay_seconds=2,
    timeout_seconds=120,
    cache_policy=NO_CACHE,
)
async def plan_rollouts(
    server_url: str,
    tasks: Sequence[dict[str, Any]],
    group_size: int,
    policy_version: str,
    group_prefix: str,
    sampling: Sampling,
    max_attempts: int,
    seed: int | None = None,
    iteration: int = 0,
    first_index: int = 0,
    key_file: str | None = None,
) -> list[str]:
    """Queue G rollouts per task on the current policy; the ids of the queued rollouts.

    With the run's `seed`, each rollout samples with a seed of its own (`rollout_seed`), so
    that a repeated run samples the same rollouts, and the G of a group still differ.
    `first_index` is the place of this plan's first rollout in the iteration (a later round of
    dynamic sampling continues where the earlier ones stopped). `key_file` holds the server's
    API key (lightning_rl/policy_server.py), here and in every task that talks to the server.
    """
    requests = [
        RolloutRequest(
            input=t,
            task_id=str(t["id"]),
            group_id=f"{group_prefix}-{t['id']}",
            policy_version=policy_version,
            max_attempts=max_attempts,
            metadata={
                "sampling": (
                    sampling
                    if seed is None
                    else sampling.model_copy(
                        update={"seed": rollout_seed(seed, iteration, first_index + k)}
                    )
                ).as_kwargs()
            },
        )
        for k, t in enumerate(t for t in tasks for _ in range(group_size))
    ]

    async with store_client(server_url, key_file) as store:
        return [r.rollout_id for r in await store.enqueue_rollouts(requests)]


async def sample_episodes(
    server_url: str,
    agent: str,
    tasks: Sequence[dict[str, Any]],
    group_size: int,
    policy_version: str,
    group_prefix: str,
    sampling: Sampling,
    concurrency: int,
    rollout_timeout_s: float,
    seed: int | None = None,
    key_file: str | None = None,
    run_dir: str | None = None,
    stage: str = "rollout",
) -> list[str]:
    """G rollouts of `policy_version` on each of `tasks`, queued and run here by one worker
    outside any iteration (a judge's calibration, a supervised warm start's samples); the ids
    of the finished rollouts. Each finished attempt is reported in the run folder's progress
    under `stage`."""
    ids = await plan_rollouts.fn(
        server_url,
        tasks,
        group_size,
        policy_version,
        group_prefix,
        sampling,
        max_attempts=2,
        seed=seed,
        iteration=0,
        key_file=key_file,
    )
    await run_rollouts.fn(
        worker=0,
        server_url=server_url,
        agent=agent,
        rollout_ids=ids,
        concurrency=concurrency,
        rollout_timeout_s=rollout_timeout_s,
        default_model=policy_version,
        run_dir=run_dir,
        stage=stage,
        key_file=key_file,
    )
    return ids


@task(
    name="run-rollouts",
    retries=1,
    retry_delay_seconds=5,
    timeout_seconds=3 * 3600,
    tags=["rollout"],
    cache_policy=NO_CACHE,
)
async def run_rollouts(
    worker: int,
    server_url: str,
    agent: str,
    rollout_ids: list[str],
    concurrency: int,
    rollout_timeout_s: float,
    default_model: str,
    run_dir: str | None = None,
    stage: str = "rollout",
    key_file: str | None = None,
) -> dict[str, int]:
    """One rollout worker: run agents on queued rollouts until all of `rollout_ids` are done.

    Mapped over workers, each takes rollouts from the shared queue, so work spreads by itself
    and a worker that dies only slows the others down (its attempts time out and are retried).
    """
    total = len(rollout_ids)

    def on_attempt(result: AttemptResult) -> None:
        if run_dir is not None:
            progress.report(run_dir, stage, worker=worker, status=str(result.status), total=total)

    async with store_client(server_url, key_file) as store:
        runner = make_runner(
            agent, store, server_url, concurrency, rollout_timeout_s, default_model, on_attempt
        )
        await runner.run_until_done(rollout_ids)
        return {"succeeded": runner.stats.succeeded, "failed": runner.stats.failed}


@task(
    name="collect-transitions",
    retries=2,
    retry_delay_seconds=2,
    # A spent judge budget stays spent for the next try: fail at once with its advice.
    retry_condition_fn=retry_unless(BudgetSpent),
    # A judge's calls are part of it: a hosted judge on a big round takes minutes.
    timeout_seconds=3600,
    cache_policy=NO_CACHE,
)
async def collect_transitions(
    server_url: str,
    rollout_ids: list[str],
    adapter: AdapterConfig,
    credit: CreditConfig,
    key_file: str | None = None,
    base_model: str | None = None,
    template_fingerprint: str | None = None,
    judge: JudgeSetup | None = None,
    max_call_tokens: int | None = None,
) -> Collected:
    """Spans to transitions with LightningRL credit and group advantages, stored back. With
    `base_model` (the name the server serves it under), each rollout's calls are checked
    against the run's record (data/provenance.py): the adapter hashes the run's policy versions
    declared when published, and `template_fingerprint`; a rollout that disagrees is refused.
    With `judge`, the judge scores each group first (docs/judge.md) and its combined reward is
    each rollout's final one. A rollout with a call over `max_call_tokens` (the trainer's
    max_call_tokens) is not trained on."""
    async with store_client(server_url, key_file) as store:
        rollouts = await store.query_rollouts(rollout_ids=rollout_ids)
        spans = await store.query_spans(rollout_ids, "latest")
        record = None
        if base_model is not None:
            versions = await store.list_policy_versions()
            record = ProvenanceRecord.of(base_model, versions, template_fingerprint)
        judged = await judge_collected(store, judge, rollout_ids) if judge is not None else None
        collected = collect(
            rollouts, spans, adapter, credit, record, judged, max_call_tokens=max_call_tokens
        )
        if collected.transitions:
            await store.add_transitions(collected.transitions)
        return collected
