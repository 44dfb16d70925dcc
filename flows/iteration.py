"""One iteration of a training run, a Prefect subflow `iteration-<k>`: rollouts, credit,
analytics, the LoRA update, the new policy version and, when due, a held-out evaluation; it
ends by writing the run's checkpoint.

With staleness > 0 the rollouts are sampled ahead by the run's producer thread, each batch a
subflow `rollouts-<k>` (flows/pipeline.py); with data=episodes there are none, the update
trains on the run's captured episodes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect import get_run_logger, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import Collected
from lightning_core.rollouts.curriculum import Curriculum
from lightning_core.rollouts.dynamic_sampling import sample_rounds
from lightning_rl.flows import pipeline, progress, report
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.held_out import evaluate, evaluate_extra_splits, record_evaluation
from lightning_rl.flows.judging import judge_setup, spend_metrics
from lightning_rl.flows.profiles import AgentProfile, profile
from lightning_rl.flows.redacted import flow
from lightning_rl.flows.run_context import (
    RunContext,
    air,
    credit,
    plan_batch,
    policy_agents,
    train_tasks,
)
from lightning_rl.flows.run_state import Checkpoint, save_checkpoint
from lightning_rl.registry.runs import log_metrics_once
from lightning_rl.tasks.analysis import analyze_iteration
from lightning_rl.tasks.provenance import probe_served_policy
from lightning_rl.tasks.rollouts import collect_transitions, plan_rollouts, run_rollouts
from lightning_rl.tasks.training import (
    Update,
    publish_policy,
    published_version,
    update_policy,
)


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
        # The policy server's key is then the user's (flows/policy_server.py): workers read it from
        # their own LIGHTNING_API_KEY, not from the key file.
        parameters["key_file"] = unmapped(None)
    if config.rollouts.task_runner_address is not None:
        # The run folder's progress file stays on this machine; the flow reports the stages.
        parameters["run_dir"] = unmapped(None)
    with _cluster_runner(config) as runner:
        futures = runner.map(run_rollouts, parameters)
        return [f.result() for f in futures]


def _rollouts(
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


def _curriculum(config: TrainConfig, run: RunContext, learnability: dict[str, float]) -> Curriculum:
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
    curriculum = _curriculum(config, run, learnability)
    started = time.time()
    progress.report(run.root, "rollouts", iteration=iteration, policy=policy)
    collected, sampled = _rollouts(config, agent, run, curriculum, policy, iteration)
    return pipeline.Batch(
        collected=collected,
        sampled=sampled,
        learnability=dict(curriculum.learnability),
        policy=policy,
        started=started,
        ended=time.time(),
    )


def _offline_data(run: RunContext) -> tuple[Collected, dict[str, float]]:
    """data=episodes: every iteration trains on the run's episodes (an epoch each)."""
    batch = plan_batch(run.root)
    collected = Collected(transitions=list(batch.transitions), facts=dict(batch.facts))
    return collected, batch.metrics()


def _record_iteration(run: RunContext, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
    """An iteration's metrics, one dict, into MLflow, the progress file and the log."""
    it = int(metrics["iteration"])
    values = {k: v for k, v in metrics.items() if k not in ("iteration", "policy")}
    log_metrics_once(values, step=it, run_id=checkpoint.mlflow_run_id)
    progress.report(run.root, "iterated", **metrics)
    get_run_logger().info(
        "iteration %d: reward %.3f, success %.3f, %d transitions trained -> %s",
        it,
        metrics.get("rollout/reward_mean", float("nan")),
        metrics.get("rollout/success_rate", float("nan")),
        int(metrics.get("train/transitions", 0)),
        metrics["policy"],
    )


@flow(name="iteration", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def train_iteration(
    config: TrainConfig, run: RunContext, checkpoint: Checkpoint, iteration: int
) -> Checkpoint:
    """One iteration: rollouts, credit, analytics, the LoRA update, the new policy version
    and, when due, a held-out evaluation; it ends by writing the run's checkpoint."""
    agent = profile(config.agent, config.tasks)
    agents = policy_agents(config, agent)
    it = iteration
    policy = checkpoint.policy or run.base_model
    progress.report(run.root, "iteration", iteration=it, policy=policy)
    curriculum = _curriculum(config, run, checkpoint.learnability)
    ahead = pipeline.running()
    overlap: dict[str, float] = {}
    if config.data.source == "episodes":
        collected, sampled = _offline_data(run)
    elif ahead is not None:
        batch, waited = ahead.take(it)
        collected, sampled = batch.collected, batch.sampled
        curriculum.learnability.update(batch.learnability)
        overlap = {
            "pipeline/trainer_wait_s": waited,
            "pipeline/rollouts_s": batch.ended - batch.started,
        }
    else:
        collected, sampled = _rollouts(config, agent, run, curriculum, policy, it)
    # The update starts from the policy the previous iteration published (v0: base or warm).
    overlap |= pipeline.staleness_metrics(collected, checkpoint.iteration, run.run_name, agents)
    analysis = analyze_iteration(
        run.root, it, collected, artifact_key=report.artifact_key(agent.name, "agent-breakdown")
    )
    progress.report(run.root, "training", iteration=it, transitions=len(collected.trainable))
    adapter_dir = str(Path(run.root) / "adapters" / f"v{it}")
    update = Update(
        trainer=config.trainer.model_copy(
            update={"model": config.server.model, "seed": config.seed}
        ),
        previous_adapter=checkpoint.adapter_dir or None,
        adapter_dir=adapter_dir,
        updates=config.updates_per_iteration,
        seed=config.seed + it,
        agents=agents,
        offline=config.data.offline if config.data.source == "episodes" else None,
    )
    offline = plan_batch(run.root) if config.data.source == "episodes" else None
    name = pipeline.PolicyRef(run=run.run_name, index=it).name()
    if published_version(run.server_url, name, run.key_file) is None:
        trained = update_policy(update, collected.transitions, offline)
    else:
        # A resumed run redoing an iteration whose policy an earlier attempt had published
        # (killed after the publish): a published version never changes, its adapter's hash
        # declared (docs/provenance.md), so the iteration keeps it rather than train another
        # into its folder, which the server would then refuse to load.
        get_run_logger().info("iteration %d: %s was published before the resume; kept", it, name)
        trained = {}
    policy = publish_policy(
        run.server_url,
        name,
        run.base_model,
        adapter_dir,
        it,
        key_file=run.key_file,
    )
    if config.provenance.probe and trained.get("train/transitions", 0):
        # Before any rollout samples from it: fail closed if the server kept the old weights.
        trained |= probe_served_policy(
            run.server_url,
            policy,
            checkpoint.policy or run.base_model,
            config.provenance,
            key_file=run.key_file,
        )
    if ahead is not None:
        ahead.published(it, policy)
        overlap["pipeline/producer_wait_s"] = ahead.producer_wait_s
    metrics = {"iteration": it, "policy": policy, **analysis["metrics"], **sampled}
    metrics |= {**trained, **overlap, **spend_metrics(judge_setup(config, agent, run))}
    _record_iteration(run, checkpoint, metrics)
    evaluations, splits = checkpoint.evaluations, checkpoint.split_evaluations
    if it % config.evaluation.eval_every == 0 or it == config.iterations:
        result = evaluate(config, agent, run, policy)
        evaluations = record_evaluation(run, checkpoint, it, result)
    if it == config.iterations:
        splits = evaluate_extra_splits(config, agent, run, checkpoint, it, policy)
    done = checkpoint.model_copy(
        update={
            "iteration": it,
            "policy": policy,
            "adapter_dir": adapter_dir,
            "learnability": dict(curriculum.learnability),
            "evaluations": evaluations,
            "split_evaluations": splits,
            "history": [*checkpoint.history, metrics],
        }
    )
    save_checkpoint(Path(run.root), done)
    return done


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
