"""One iteration of a training run, a Prefect subflow `iteration-<k>`: its batch (rollouts, or
the run's captured episodes: flows/batch_source.py), analytics, the LoRA update, the new policy
version and, when due, a held-out evaluation; it ends by writing the run's checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from lightning_rl import progress
from lightning_rl.flows import pipeline, report
from lightning_rl.flows.batch_source import BatchSource, Taken, batch_source, curriculum_for
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.held_out import evaluate, evaluate_extra_splits, record_evaluation
from lightning_rl.flows.judging import judge_setup, spend_metrics
from lightning_rl.flows.profiles import AgentProfile, profile
from lightning_rl.flows.run_context import RunContext, policy_agents
from lightning_rl.flows.run_state import Checkpoint, save_checkpoint
from lightning_rl.redacted import flow
from lightning_rl.registry.runs import log_metrics_once
from lightning_rl.tasks.analysis import analyze_iteration
from lightning_rl.tasks.provenance import probe_served_policy
from lightning_rl.tasks.training import (
    Update,
    publish_policy,
    published_version,
    update_policy,
)


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
    """One iteration: its batch, analytics, the LoRA update, the new policy version and, when
    due, a held-out evaluation; it ends by writing the run's checkpoint."""
    agent, it = profile(config.agent, config.tasks), iteration
    agents = policy_agents(config, agent)
    newest = checkpoint.policy or run.base_model
    progress.report(run.root, "iteration", iteration=it, policy=newest)
    curriculum = curriculum_for(config, run, checkpoint.learnability)
    source = batch_source(config, run, agent)
    batch = source.take(it, newest, curriculum)
    # The update starts from the policy the previous iteration published (v0: base or warm).
    lag = pipeline.staleness_metrics(batch.collected, checkpoint.iteration, run.run_name, agents)
    breakdown = report.artifact_key(agent.name, "agent-breakdown")
    analysis = analyze_iteration(run.root, it, batch.collected, artifact_key=breakdown)
    progress.report(run.root, "training", iteration=it, transitions=len(batch.collected.trainable))
    policy, trained = _train_and_publish(config, run, checkpoint, it, agents, source, batch)
    metrics = {"iteration": it, "policy": policy, **analysis["metrics"], **batch.sampled}
    metrics |= {**trained, **batch.metrics, **lag, **source.published(it, policy)}
    metrics |= spend_metrics(judge_setup(config, agent, run))
    _record_iteration(run, checkpoint, metrics)
    evaluations, splits = _evaluate_when_due(config, agent, run, checkpoint, it, policy)
    done = checkpoint.model_copy(
        update={
            "iteration": it,
            "policy": policy,
            "adapter_dir": _adapter_dir(run, it),
            "learnability": dict(curriculum.learnability),
            "evaluations": evaluations,
            "split_evaluations": splits,
            "history": [*checkpoint.history, metrics],
        }
    )
    save_checkpoint(Path(run.root), done)
    return done


def _adapter_dir(run: RunContext, it: int) -> str:
    return str(Path(run.root) / "adapters" / f"v{it}")


def _train_and_publish(
    config: TrainConfig,
    run: RunContext,
    checkpoint: Checkpoint,
    it: int,
    agents: list[str] | None,
    source: BatchSource,
    batch: Taken,
) -> tuple[str, dict[str, Any]]:
    """The LoRA update on the batch, published as the run's version `it` (and probed): the
    policy's name and the update's metrics."""
    update = Update(
        trainer=config.trainer.model_copy(
            update={"model": config.server.model, "seed": config.seed}
        ),
        previous_adapter=checkpoint.adapter_dir or None,
        adapter_dir=_adapter_dir(run, it),
        updates=config.updates_per_iteration,
        seed=config.seed + it,
        agents=agents,
        offline=source.offline,
    )
    name = pipeline.PolicyRef(run=run.run_name, index=it).name()
    if published_version(run.server_url, name, run.key_file) is None:
        trained = update_policy(update, batch.collected.transitions, source.offline_batch())
    else:
        # A resumed run redoing an iteration whose policy an earlier attempt had published
        # (killed after the publish): a published version never changes, its adapter's hash
        # declared (docs/provenance.md), so the iteration keeps it rather than train another
        # into its folder, which the server would then refuse to load.
        get_run_logger().info("iteration %d: %s was published before the resume; kept", it, name)
        trained = {}
    policy = publish_policy(
        run.server_url, name, run.base_model, update.adapter_dir, it, key_file=run.key_file
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
    return policy, trained


def _evaluate_when_due(
    config: TrainConfig,
    agent: AgentProfile,
    run: RunContext,
    checkpoint: Checkpoint,
    it: int,
    policy: str,
) -> tuple[Any, Any]:
    """The held-out evaluation every eval_every iterations and at the last; the extra splits at
    the last only."""
    evaluations, splits = checkpoint.evaluations, checkpoint.split_evaluations
    if it % config.evaluation.eval_every == 0 or it == config.iterations:
        result = evaluate(config, agent, run, policy)
        evaluations = record_evaluation(run, checkpoint, it, result)
    if it == config.iterations:
        splits = evaluate_extra_splits(config, agent, run, checkpoint, it, policy)
    return evaluations, splits
