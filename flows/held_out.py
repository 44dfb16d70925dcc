"""The held-out benchmark inside a training run: the base (or warm-start) policy before the
first iteration, then every `eval_every` iterations and at the end, each score recorded in
MLflow, the run's progress file and the log."""

from __future__ import annotations

from prefect import get_run_logger

from lightning_core.stats.evaluation import EvalResult
from lightning_rl import progress
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.profiles import AgentProfile
from lightning_rl.flows.run_context import RunContext, credit, heldout_tasks
from lightning_rl.flows.run_state import Checkpoint, Evaluation
from lightning_rl.registry.names import TAG_BENCHMARK_ID
from lightning_rl.registry.runs import log_metrics_once, set_run_tags
from lightning_rl.tasks.evaluation import evaluate_policy


def evaluate(
    config: TrainConfig, agent: AgentProfile, run: RunContext, policy: str, split: str = "test"
) -> EvalResult:
    """`policy`'s score on the held-out tasks (or those of another held-out split)."""
    # An async task (its timeout can cancel it); submitted, it runs on the task runner.
    return evaluate_policy.submit(
        run.server_url,
        agent.agent,
        heldout_tasks(config, split),
        policy,
        concurrency=config.rollouts.rollout_workers * config.rollouts.rollout_concurrency,
        rollout_timeout_s=config.rollouts.rollout_timeout_s,
        success_threshold=credit(config, agent).success_threshold,
        run_dir=run.root,
        key_file=run.key_file,
    ).result()


def record_evaluation(
    run: RunContext, checkpoint: Checkpoint, iteration: int, result: EvalResult
) -> list[Evaluation]:
    """A held-out score into MLflow, the progress file and the log; returns the checkpoint's
    evaluations with it."""
    log_metrics_once(result.metrics(), step=iteration, run_id=checkpoint.mlflow_run_id)
    if result.benchmark_id is not None:
        # A tag, not a param: params cannot change, and a resumed run may pick another size.
        set_run_tags({TAG_BENCHMARK_ID: result.benchmark_id}, run_id=checkpoint.mlflow_run_id)
    progress.report(run.root, "evaluated", iteration=iteration, **result.model_dump())
    get_run_logger().info("held-out after iteration %d: %s", iteration, result.summary())
    return [*checkpoint.evaluations, Evaluation.of(iteration, result)]


def evaluate_extra_splits(
    config: TrainConfig,
    agent: AgentProfile,
    run: RunContext,
    checkpoint: Checkpoint,
    iteration: int,
    policy: str,
) -> dict[str, list[Evaluation]]:
    """`policy` on each of evaluation.extra_splits, logged to MLflow as eval_<split>/...;
    returns the checkpoint's split evaluations with them. These splits are reported, never
    gated on: promotion reads the test split alone."""
    found = dict(checkpoint.split_evaluations)
    for split in config.evaluation.extra_splits:
        result = evaluate(config, agent, run, policy, split)
        log_metrics_once(
            result.metrics(f"eval_{split}"), step=iteration, run_id=checkpoint.mlflow_run_id
        )
        get_run_logger().info(
            "held-out split %r after iteration %d: %s", split, iteration, result.summary()
        )
        found[split] = [*found.get(split, []), Evaluation.of(iteration, result)]
    return found
