"""Where an iteration's training batch comes from, chosen once per iteration by the run's
settings, so the iteration itself never asks (`batch_source`):

- `Rollouts` (staleness 0): the iteration samples its own rollouts on the newest policy, rounds
  of G per task fanned out as Prefect tasks until enough groups carry a signal;
- `RolloutsAheadSource` (staleness > 0): the run's producer sampled them ahead, each batch a
  subflow `rollouts-<k>` (flows/pipeline.py);
- `Episodes` (data=episodes): no rollouts, the run's captured production episodes, an epoch
  each iteration, trained off-policy (the update's `offline` settings).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect import unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import Collected
from lightning_core.data.offline import OfflineBatch, OfflineConfig
from lightning_core.rollouts.curriculum import Curriculum
from lightning_core.rollouts.dynamic_sampling import sample_rounds
from lightning_rl import progress
from lightning_rl.flows import pipeline
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.judging import judge_setup
from lightning_rl.flows.profiles import AgentProfile, profile
from lightning_rl.flows.run_context import RunContext, air, credit, plan_batch, train_tasks
from lightning_rl.flows.run_state import Checkpoint
from lightning_rl.redacted import flow
from lightning_rl.tasks.rollouts import collect_transitions, plan_rollouts, run_rollouts


@dataclass
class Taken:
    """An iteration's batch: its transitions, how they were sampled, and the pipeline's times."""

    collected: Collected
    sampled: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


class BatchSource:
    """Where an iteration's batch comes from (the subclasses below)."""

    # The off-policy settings of the update (data=episodes); None: on-policy rollouts.
    offline: OfflineConfig | None = None

    def take(self, it: int, policy: str, curriculum: Curriculum) -> Taken:
        raise NotImplementedError

    def offline_batch(self) -> OfflineBatch | None:
        """The episodes the update weighs off-policy (data=episodes), else None."""
        return None

    def published(self, it: int, policy: str) -> dict[str, float]:
        """Iteration `it` published `policy`: the source's metrics from then on."""
        return {}


@dataclass
class Rollouts(BatchSource):
    config: TrainConfig
    agent: AgentProfile
    run: RunContext

    def take(self, it: int, policy: str, curriculum: Curriculum) -> Taken:
        collected, sampled = sample_rollouts(
            self.config, self.agent, self.run, curriculum, policy, it
        )
        return Taken(collected, sampled)


@dataclass
class RolloutsAheadSource(BatchSource):
    ahead: pipeline.RolloutsAhead

    def take(self, it: int, policy: str, curriculum: Curriculum) -> Taken:
        batch, waited = self.ahead.take(it)
        curriculum.learnability.update(batch.learnability)
        times = {
            "pipeline/trainer_wait_s": waited,
            "pipeline/rollouts_s": batch.ended - batch.started,
        }
        return Taken(batch.collected, batch.sampled, times)

    def published(self, it: int, policy: str) -> dict[str, float]:
        self.ahead.published(it, policy)
        return {"pipeline/producer_wait_s": self.ahead.producer_wait_s}


@dataclass
class Episodes(BatchSource):
    run: RunContext
    offline: OfflineConfig | None = None

    def take(self, it: int, policy: str, curriculum: Curriculum) -> Taken:
        batch = self.offline_batch()
        collected = Collected(transitions=list(batch.transitions), facts=dict(batch.facts))
        return Taken(collected, batch.metrics())

    def offline_batch(self) -> OfflineBatch:
        return plan_batch(self.run.root)


def batch_source(config: TrainConfig, run: RunContext, agent: AgentProfile) -> BatchSource:
    """The one place that reads which source a run's iterations train on."""
    if config.data.source == "episodes":
        return Episodes(run, config.data.offline)
    ahead = pipeline.running()
    if ahead is not None:
        return RolloutsAheadSource(ahead)
    return Rollouts(config, agent, run)


def _cluster_runner(config: TrainConfig) -> Any:
    """The Ray or Dask task runner a cluster fan-out uses."""
    if config.rollouts.task_runner == "ray":
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=config.rollouts.task_runner_address)
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=config.rollouts.task_runner_address)


def fan_out(config: TrainConfig, parameters: dict[str, Any]) -> list[dict[str, int]]:
    """run-rollouts mapped over the workers: on the flow's thread pool, or a cluster's runner."""
    if config.rollouts.task_runner == "threads":
        futures = run_rollouts.map(**parameters)
        return [f.result() for f in futures]
    # A cluster's workers may run on other machines, where paths on this one do not exist.
    parameters = dict(parameters)
    if os.environ.get("LIGHTNING_API_KEY"):
        # The policy server's key is then the user's (lightning_rl/policy_server.py): workers
        # read it from their own LIGHTNING_API_KEY, not from the key file.
        parameters["key_file"] = unmapped(None)
    if config.rollouts.task_runner_address is not None:
        # The run folder's progress file stays on this machine; the flow reports the stages.
        parameters["run_dir"] = unmapped(None)
    with _cluster_runner(config) as runner:
        futures = runner.map(run_rollouts, parameters)
        return [f.result() for f in futures]


def sample_rollouts(
    config: TrainConfig,
    agent: AgentProfile,
    run: RunContext,
    curriculum: Curriculum,
    policy: str,
    it: int,
) -> tuple[Collected, dict[str, float]]:
    """An iteration's rollouts on `policy`: rounds of G rollouts per task, planned, fanned out
    and collected as Prefect tasks, until enough groups carry a signal (dynamic sampling)."""
    adapter = AdapterConfig(
        agents=config.train_agents or agent.train_agents, air=air(agent, config)
    )
    credit_config = credit(config, agent)
    judge = judge_setup(config, agent, run)

    def run_round(tasks: Sequence[Mapping[str, Any]], first_index: int) -> Collected:
        # Async tasks, submitted: their timeouts can cancel them, also on the producer's
        # thread (staleness > 0), where a sync task's timeout cannot interrupt it.
        rollout_ids = plan_rollouts.submit(
            run.server_url,
            list(tasks),
            config.rollouts.group_size,
            policy,
            f"{run.run_name}-it{it}",
            config.rollouts.sampling,
            config.rollouts.max_attempts,
            seed=config.seed,
            iteration=it,
            first_index=first_index,
            key_file=run.key_file,
        ).result()
        fan_out(
            config,
            {
                "worker": list(range(config.rollouts.rollout_workers)),
                "server_url": unmapped(run.server_url),
                "agent": unmapped(agent.agent),
                "rollout_ids": unmapped(rollout_ids),
                "concurrency": unmapped(config.rollouts.rollout_concurrency),
                "rollout_timeout_s": unmapped(config.rollouts.rollout_timeout_s),
                "default_model": unmapped(policy),
                "run_dir": unmapped(run.root),
                "key_file": unmapped(run.key_file),
            },
        )
        return collect_transitions.submit(
            run.server_url,
            rollout_ids,
            adapter,
            credit_config,
            key_file=run.key_file,
            base_model=run.base_model if config.provenance.check_transitions else None,
            template_fingerprint=run.template_fingerprint,
            judge=judge,
            max_call_tokens=config.trainer.max_call_tokens,
        ).result()

    return sample_rounds(
        curriculum, config.rollouts.tasks_per_iteration, config.rollouts.group_size, it, run_round
    )


def curriculum_for(
    config: TrainConfig, run: RunContext, learnability: dict[str, float]
) -> Curriculum:
    curriculum = Curriculum(train_tasks(config, run.root), config.curriculum, config.seed)
    curriculum.learnability.update(learnability)
    return curriculum


@flow(name="rollouts", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def rollout_batch(
    config: TrainConfig,
    run: RunContext,
    learnability: dict[str, float],
    policy: str,
    iteration: int,
) -> pipeline.Batch:
    """With staleness > 0: iteration k's rollouts, sampled ahead of its training on `policy`
    (flows/pipeline.py), from the producer's thread; the iteration subflow trains on them."""
    agent = profile(config.agent, config.tasks)
    curriculum = curriculum_for(config, run, learnability)
    started = time.time()
    progress.report(run.root, "rollouts", iteration=iteration, policy=policy)
    collected, sampled = sample_rollouts(config, agent, run, curriculum, policy, iteration)
    return pipeline.Batch(
        collected=collected,
        sampled=sampled,
        learnability=dict(curriculum.learnability),
        policy=policy,
        started=started,
        ended=time.time(),
    )


def rollouts_ahead(
    config: TrainConfig, run: RunContext, checkpoint: Checkpoint
) -> contextlib.AbstractContextManager[Any]:
    """With staleness > 0, the producer that samples iterations' rollouts ahead of their
    training (flows/pipeline.py); with 0, nothing: each iteration samples its own."""
    if not config.rollouts.staleness or config.data.source == "episodes":
        return contextlib.nullcontext()

    # Each batch starts from the learnability the previous batch left: one curriculum.
    learnability = dict(checkpoint.learnability)

    def collect(iteration: int, policy: str) -> pipeline.Batch:
        nonlocal learnability
        batch = rollout_batch.with_options(flow_run_name=f"rollouts-{iteration}")(
            config=config, run=run, learnability=learnability, policy=policy, iteration=iteration
        )
        learnability = batch.learnability
        return batch

    return pipeline.RolloutsAhead(
        run.run_name,
        collect,
        checkpoint.iteration + 1,
        config.iterations,
        checkpoint.policy or run.base_model,
        config.rollouts.staleness,
    )
