"""The training flow: iterations of rollouts, credit assignment, analytics, a LoRA update and
evaluation, then MLflow registration with a gated promotion.

    serve      store + OpenAI-compatible gateway + backend (a child process)
    evaluate   the base model on the held-out split (iteration 0)
    each iteration k = 1..N, a subflow run `iteration-<k>`
      plan       draw tasks by the curriculum's tiers, G rollouts each on the current policy
      rollout    run-rollouts.map over workers (threads, Ray or Dask)
      collect    spans -> transitions, LightningRL credit, group advantages (stored)
                 (dynamic sampling: while too few groups carry a signal, more tasks)
      analyze    Parquet export + DuckDB metrics (MLflow, Prefect table)
      train      LoRA policy-gradient update (global concurrency limit "gpu")
      publish    adapter k registered as policy version <run>-v<k>; the next rollouts use it
      evaluate   every E iterations and at the end
      checkpoint the run folder's checkpoint.json: where a resumed run continues
    register   MLflow model version (challenger); champion only if it beats the champion

With staleness > 0 the rollouts leave the iteration subflows: a producer thread runs them as
subflow runs `rollouts-<k>` on the newest published policy, up to `staleness` versions ahead of
training, and each iteration trains on its batch (flows/pipeline.py).

A run started again with the name of a run folder that has a checkpoint (`lightning-rl train
--resume <run>`, or a deployment run with the same run_name) continues after the last finished
iteration, in the same folder and the same MLflow run (flows/run_state.py).

With `policy_per_agent`, each trained agent has its own adapter and trainer: train splits the
iteration's transitions by agent, publish registers <run>-v<k>-<agent> per agent and <run>-v<k>,
which serves each agent's calls with its own, and that one version is evaluated, registered
(the agents' adapters in one model version) and promoted or refused as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, unmapped
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel

from lightning_core import analytics, semconv
from lightning_core.adapter import AdapterConfig
from lightning_core.collect import Collected, CreditConfig
from lightning_core.comparison import compare
from lightning_core.curriculum import Curriculum, group_signal
from lightning_core.errors import InvalidInput
from lightning_core.evaluation import EvalResult, benchmark_id
from lightning_core.rewards import AIRRule
from lightning_core.types import RolloutStatus
from lightning_rl.flows import pipeline
from lightning_rl.flows.config import TrainConfig, train_config_parameters
from lightning_rl.flows.redacted import flow
from lightning_rl.flows.run_state import (
    Checkpoint,
    Evaluation,
    check_same_config,
    default_run_name,
    load_checkpoint,
    run_folder,
    run_path,
    save_checkpoint,
    save_config,
)
from lightning_rl.registry.config import RegistryConfig, resolve
from lightning_rl.registry.datasets import log_dataset
from lightning_rl.registry.names import TAG_BENCHMARK_ID
from lightning_rl.registry.runs import (
    log_artifact,
    log_metrics_once,
    log_params,
    set_run_tags,
    tracking,
)
from lightning_rl.registry.versions import champion_adapter, record_score
from lightning_rl.tasks import data as data_plan
from lightning_rl.tasks import progress, report
from lightning_rl.tasks.analysis import analyze_iteration
from lightning_rl.tasks.evaluation import evaluate_policy
from lightning_rl.tasks.gpu_slot import ensure_gpu_limit
from lightning_rl.tasks.profiles import AgentProfile, profile
from lightning_rl.tasks.registry import register_policy
from lightning_rl.tasks.rollouts import collect_transitions, plan_rollouts, run_rollouts
from lightning_rl.tasks.server import policy_server, store_client
from lightning_rl.tasks.training import (
    agent_trainer_configs,
    publish_policy,
    train_agent_policies,
    train_offline,
    train_policy,
)


def _cluster_runner(config: TrainConfig) -> Any:
    """The Ray or Dask task runner a cluster fan-out uses."""
    if config.task_runner == "ray":
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=config.task_runner_address)
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=config.task_runner_address)


def _fan_out(config: TrainConfig, parameters: dict[str, Any]) -> list[dict[str, int]]:
    """run-rollouts mapped over the workers: on the flow's thread pool, or a cluster's runner."""
    if config.task_runner == "threads":
        futures = run_rollouts.map(**parameters)
        return [f.result() for f in futures]
    # A cluster's workers may run on other machines, where paths on this one do not exist.
    parameters = dict(parameters)
    if os.environ.get("LIGHTNING_API_KEY"):
        # The policy server's key is then the user's (tasks/server.py): workers read it from
        # their own LIGHTNING_API_KEY, not from the key file.
        parameters["key_file"] = unmapped(None)
    if config.task_runner_address is not None:
        # The run folder's progress file stays on this machine; the flow reports the stages.
        parameters["run_dir"] = unmapped(None)
    with _cluster_runner(config) as runner:
        futures = runner.map(run_rollouts, parameters)
        return [f.result() for f in futures]


def _air(agent: AgentProfile, config: TrainConfig) -> list[AIRRule]:
    if config.air_reward is None:
        return agent.air
    if config.air_reward == 0:
        return []
    return [AIRRule(name=semconv.TOOL_SPAN, outcome="success", reward=config.air_reward)]


# Agent names become folder and policy version names with policy_per_agent.
_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _policy_agents(config: TrainConfig, agent: AgentProfile) -> list[str] | None:
    """The agents that get a policy each with policy_per_agent; None: one shared policy."""
    if not config.policy_per_agent:
        return None
    if config.data == "episodes":
        raise InvalidInput(
            "policy_per_agent with data=episodes is not supported yet: train production "
            "episodes into one shared policy (policy_per_agent=false)"
        )
    names = config.train_agents or agent.train_agents
    if not names:
        raise InvalidInput(
            f"policy_per_agent trains one adapter per agent, but agent {agent.name!r} names no "
            "agents to train: set train_agents to the agent names its calls carry "
            "(X-Lightning-Agent), e.g. train_agents=['writer', 'rewriter']"
        )
    bad = [n for n in names if not _AGENT_NAME.fullmatch(n)]
    if bad or len(set(names)) != len(names):
        raise InvalidInput(
            f"policy_per_agent needs distinct agent names of letters, digits, '.', '_' and '-' "
            f"(they name adapter folders and policy versions); got {names}"
        )
    return list(names)


def _server_env(config: TrainConfig) -> dict[str, str]:
    """With rollouts overlapping training on CPU, the policy server's OpenMP threads wait
    passively: spinning, they burn the cores the trainer (another process) needs while they
    wait for a sibling it pushed off a core, and both sides crawl (BENCHMARKS.md, issue 15)."""
    overlapping = config.staleness and config.backend == "transformers"
    if overlapping and "OMP_WAIT_POLICY" not in os.environ:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}


class RunContext(BaseModel):
    """What every iteration of a run needs to know beside its config: plain names and paths."""

    run_name: str
    root: str
    server_url: str
    base_model: str
    registered_model: str
    # The path of the policy server's 0600 key file, not the key: parameters are stored and
    # shown in the UI.
    key_file: str


@functools.lru_cache(maxsize=8)
def _load_tasks(
    agent: str, loader: str | None, split: str, size: int, source: str | None
) -> list[dict[str, Any]]:
    # Each iteration's subflow asks again; the run's process loads a split once.
    return profile(agent, loader).load_tasks(split, size, source)


@functools.lru_cache(maxsize=8)
def _plan_tasks(root: str) -> list[dict[str, Any]]:
    return data_plan.load_plan_tasks(root)


@functools.lru_cache(maxsize=2)
def _plan_batch(root: str) -> Any:
    return data_plan.load_plan_batch(root)


def _train_tasks(config: TrainConfig, root: str | None = None) -> list[dict[str, Any]]:
    """The tasks rollouts draw from: the agent's train split, or (data=new_tasks) the task
    table's new tasks the run's data plan saved in its folder."""
    if config.data == "new_tasks" and root is not None:
        return _plan_tasks(root)
    return _load_tasks(config.agent, config.tasks, "train", config.train_size, config.task_source)


def _test_tasks(config: TrainConfig) -> list[dict[str, Any]]:
    return _load_tasks(config.agent, config.tasks, "test", config.eval_size, config.task_source)


def _credit(config: TrainConfig, agent: AgentProfile) -> CreditConfig:
    """The credit config with its success threshold: the user's, else the agent profile's."""
    if config.credit.success_threshold is not None:
        return config.credit
    return config.credit.model_copy(update={"success_threshold": agent.success_threshold})


def _rollout_rounds(
    config: TrainConfig,
    agent: AgentProfile,
    run: RunContext,
    curriculum: Curriculum,
    policy: str,
    it: int,
) -> tuple[Collected, dict[str, float]]:
    """An iteration's rollouts: tasks drawn by the curriculum, G rollouts each, collected;
    then, while fewer than tasks_per_iteration groups carry a signal and rounds are left,
    another round of as many new tasks (dynamic sampling). Returns the merged transitions and
    what was sampled."""
    adapter = AdapterConfig(
        agents=config.train_agents or agent.train_agents, air=_air(agent, config)
    )
    credit = _credit(config, agent)
    wanted = config.tasks_per_iteration
    merged, drawn, with_signal = Collected(), [], 0
    weights = curriculum.weights()
    for round_ in range(config.curriculum.max_rounds):
        chosen = curriculum.sample(
            wanted - with_signal, it, round_, exclude=(str(t["id"]) for t in drawn)
        )
        if not chosen:
            break
        # Async tasks, submitted: their timeouts can cancel them, also on the producer's
        # thread (staleness > 0), where a sync task's timeout cannot interrupt it.
        rollout_ids = plan_rollouts.submit(
            run.server_url,
            chosen,
            config.group_size,
            policy,
            f"{run.run_name}-it{it}",
            {"temperature": config.temperature},
            config.max_attempts,
            seed=config.seed,
            iteration=it,
            first_index=len(drawn) * config.group_size,
            key_file=run.key_file,
        ).result()
        drawn += chosen
        _fan_out(
            config,
            {
                "worker": list(range(config.rollout_workers)),
                "server_url": unmapped(run.server_url),
                "agent": unmapped(agent.agent),
                "rollout_ids": unmapped(rollout_ids),
                "concurrency": unmapped(config.rollout_concurrency),
                "rollout_timeout_s": unmapped(config.rollout_timeout_s),
                "default_model": unmapped(policy),
                "run_dir": unmapped(run.root),
                "key_file": unmapped(run.key_file),
            },
        )
        collected = collect_transitions.submit(
            run.server_url, rollout_ids, adapter, credit, key_file=run.key_file
        ).result()
        merged.transitions += collected.transitions
        merged.facts |= collected.facts
        task_of = {r: str(f.task_id) for r, f in collected.facts.items()}
        with_signal += sum(group_signal(collected.transitions, task_of).values())
        if with_signal >= wanted:
            break
    task_of = {r: str(f.task_id) for r, f in merged.facts.items()}
    curriculum.observe(group_signal(merged.transitions, task_of), drawn)
    sampled = {
        "rollout/rounds": float(round_ + 1),
        "rollout/tasks_drawn": float(len(drawn)),
        "rollout/groups_with_signal": float(with_signal),
        **{f"curriculum/weight_{tier}": w for tier, w in weights.items()},
    }
    return merged, sampled


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
    curriculum = Curriculum(_train_tasks(config, run.root), config.curriculum, config.seed)
    curriculum.learnability.update(learnability)
    started = time.time()
    progress.report(run.root, "rollouts", iteration=iteration, policy=policy)
    collected, sampled = _rollout_rounds(config, agent, run, curriculum, policy, iteration)
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
    batch = _plan_batch(run.root)
    collected = Collected(transitions=list(batch.transitions), facts=dict(batch.facts))
    return collected, batch.metrics()


def _evaluate(config: TrainConfig, agent: AgentProfile, run: RunContext, policy: str) -> EvalResult:
    # An async task (its timeout can cancel it); submitted, it runs on the task runner.
    return evaluate_policy.submit(
        run.server_url,
        agent.agent,
        _test_tasks(config),
        policy,
        concurrency=config.rollout_workers * config.rollout_concurrency,
        rollout_timeout_s=config.rollout_timeout_s,
        success_threshold=_credit(config, agent).success_threshold,
        run_dir=run.root,
        key_file=run.key_file,
    ).result()


def _record_evaluation(
    run: RunContext, checkpoint: Checkpoint, iteration: int, result: EvalResult
) -> list[Evaluation]:
    """A held-out score into MLflow, the progress file and the log."""
    log_metrics_once(result.metrics(), step=iteration, run_id=checkpoint.mlflow_run_id)
    if result.benchmark_id is not None:
        # A tag, not a param: params cannot change, and a resumed run may pick another size.
        set_run_tags({TAG_BENCHMARK_ID: result.benchmark_id}, run_id=checkpoint.mlflow_run_id)
    progress.report(run.root, "evaluated", iteration=iteration, **result.model_dump())
    get_run_logger().info("held-out after iteration %d: %s", iteration, result.summary())
    return [*checkpoint.evaluations, Evaluation.of(iteration, result)]


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
    policy_agents = _policy_agents(config, agent)
    it = iteration
    policy = checkpoint.policy or run.base_model
    progress.report(run.root, "iteration", iteration=it, policy=policy)
    curriculum = Curriculum(_train_tasks(config, run.root), config.curriculum, config.seed)
    curriculum.learnability.update(checkpoint.learnability)
    ahead = pipeline.running(run.run_name)
    overlap: dict[str, float] = {}
    if config.data == "episodes":
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
        collected, sampled = _rollout_rounds(config, agent, run, curriculum, policy, it)
    trained_from = pipeline.version_index(checkpoint.policy, run.run_name)
    overlap |= pipeline.staleness_metrics(collected, trained_from, run.run_name)
    analysis = analyze_iteration(
        run.root, it, collected, artifact_key=report.artifact_key(agent.name, "agent-breakdown")
    )
    progress.report(run.root, "training", iteration=it, transitions=len(collected.trainable))
    trainer_config = config.trainer.model_copy(update={"model": config.model, "seed": config.seed})
    adapter_dir = str(Path(run.root) / "adapters" / f"v{it}")
    previous = checkpoint.adapter_dir or None
    if config.data == "episodes":
        trained = train_offline(
            trainer_config,
            _plan_batch(run.root),
            previous,
            adapter_dir,
            config.offline,
            config.updates_per_iteration,
            config.seed + it,
        )
    elif policy_agents:
        trained = train_agent_policies(
            agent_trainer_configs(trainer_config, policy_agents),
            collected.transitions,
            previous,
            adapter_dir,
            config.updates_per_iteration,
            config.seed + it,
        )
    else:
        trained = train_policy(
            trainer_config,
            collected.transitions,
            previous,
            adapter_dir,
            config.updates_per_iteration,
            config.seed + it,
        )
    policy = publish_policy(
        run.server_url,
        f"{run.run_name}-v{it}",
        run.base_model,
        adapter_dir,
        it,
        key_file=run.key_file,
    )
    if ahead is not None:
        ahead.published(it, policy)
        overlap["pipeline/producer_wait_s"] = ahead.producer_wait_s
    metrics = {
        "iteration": it,
        "policy": policy,
        **analysis["metrics"],
        **sampled,
        **trained,
        **overlap,
    }
    _record_iteration(run, checkpoint, metrics)
    evaluations = checkpoint.evaluations
    if it % config.eval_every == 0 or it == config.iterations:
        evaluations = _record_evaluation(run, checkpoint, it, _evaluate(config, agent, run, policy))
    done = checkpoint.model_copy(
        update={
            "iteration": it,
            "policy": policy,
            "adapter_dir": adapter_dir,
            "learnability": dict(curriculum.learnability),
            "evaluations": evaluations,
            "history": [*checkpoint.history, metrics],
        }
    )
    save_checkpoint(Path(run.root), done)
    return done


def _rollouts_ahead(
    config: TrainConfig, run: RunContext, checkpoint: Checkpoint
) -> contextlib.AbstractContextManager[Any]:
    """With staleness > 0, the producer that samples iterations' rollouts ahead of their
    training (flows/pipeline.py); with 0, nothing: each iteration samples its own."""
    if not config.staleness or config.data == "episodes":
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
        config.staleness,
    )


def _cancel_unfinished(server_url: str, key_file: str) -> int:
    """Rollouts a killed run left queued or running: cancelled, so that the redone iteration's
    workers never take them (the redo plans its own)."""

    async def cancel() -> int:
        async with store_client(server_url, key_file) as store:
            left = await store.query_rollouts(
                status=[RolloutStatus.queuing, RolloutStatus.running, RolloutStatus.requeuing]
            )
            for rollout in left:
                await store.cancel_rollout(rollout.rollout_id)
            return len(left)

    return asyncio.run(cancel())


def _start_or_resume(config: TrainConfig, run_name: str) -> tuple[Path, Checkpoint | None]:
    """The run folder, and its checkpoint when the run was started before."""
    root = run_folder(config.run_dir, run_name)
    checkpoint = load_checkpoint(root)
    given = config.model_dump(mode="json", exclude={"run_dir"})
    if checkpoint is not None:
        check_same_config(root, given)
        if checkpoint.iteration > config.iterations:
            raise InvalidInput(
                f"run {root.name} has already finished {checkpoint.iteration} iterations; "
                f"iterations={config.iterations} cannot undo them"
            )
    save_config(root, given)
    return root, checkpoint


def _progress_artifact(agent: AgentProfile, run_name: str, done: int, total: int) -> Any:
    return create_progress_artifact(
        progress=100.0 * done / total,
        key=report.artifact_key(agent.name, "training-progress"),
        description=f"Iterations of {run_name} finished, in percent of {total}",
    )


def _iterations_table(agent: AgentProfile, run_name: str, history: list[dict[str, Any]]) -> None:
    create_table_artifact(
        history,
        key=report.artifact_key(agent.name, "iterations"),
        description=f"Per-iteration metrics of {run_name} (as logged to MLflow)",
    )


def _check_benchmark(config: TrainConfig, agent: AgentProfile, tasks: list[dict[str, Any]]) -> str:
    """The held-out benchmark's id; with a pinned one, the run stops unless they agree."""
    found = benchmark_id(
        tasks, agent=agent.agent, threshold=_credit(config, agent).success_threshold
    )
    if config.benchmark_id is not None and found != config.benchmark_id:
        raise InvalidInput(
            f"the held-out benchmark is {found}, but the run pins benchmark_id="
            f"{config.benchmark_id}: its tasks or how they are scored changed (eval_size, "
            "task_source, the agent or its dataset). Scores on different benchmarks are not "
            f"comparable; pin {found} once you mean to move to it"
        )
    return found


def _plan_data(
    config: TrainConfig, agent: AgentProfile, registry: RegistryConfig
) -> tuple[data_plan.DataPlan, list[dict[str, Any]] | None, Any]:
    """(plan, the new tasks, the offline batch): what this run trains on."""
    if config.data == "new_tasks":
        plan, tasks = data_plan.plan_new_tasks(
            data_plan.table_folder(config, agent.name), registry, agent.name
        )
        return plan, tasks, None
    if config.data == "episodes":
        offline = config.offline
        if "success_threshold" not in offline.model_fields_set:
            threshold = _credit(config, agent).success_threshold
            offline = offline.model_copy(update={"success_threshold": threshold})
        plan, batch = data_plan.plan_episodes(
            str(config.episodes_from),
            config.episodes_key_file,
            registry,
            agent.name,
            offline,
            config.train_agents or agent.train_agents,
        )
        return plan, None, batch
    return data_plan.plan_profile(agent.name, _train_tasks(config)), None, None


def _nothing_new(agent: AgentProfile, run_name: str, plan: data_plan.DataPlan) -> dict[str, Any]:
    """A recurring run with no new data: it says so (log, Prefect artifact) and ends."""
    reason = plan.reason()
    get_run_logger().info("%s", reason)
    create_markdown_artifact(
        f"# {agent.name}: nothing new to train on\n\n{reason}.\n\n"
        f"Data: `{plan.source}` from `{plan.source_uri}`, read through `{plan.after}`.",
        key=report.artifact_key(agent.name, "training-report"),
        description=f"Run {run_name} found no new data",
    )
    return {
        "run": run_name,
        "agent": agent.name,
        "skipped": True,
        "reason": reason,
        "data": plan.model_dump(),
    }


def _log_datasets(
    config: TrainConfig,
    registry: RegistryConfig,
    run_id: str,
    root: Path,
    plan: data_plan.DataPlan,
    test_tasks: list[dict[str, Any]],
    benchmark: str,
    agent: AgentProfile,
) -> None:
    """The run's training data and benchmark as MLflow input datasets, and the plan's tags."""
    if plan.source == "episodes":
        rows = [dict(e) for e in _plan_batch(str(root)).episodes]
    elif plan.source == "new_tasks":
        rows = _plan_tasks(str(root))
    else:
        rows = _train_tasks(config)
    log_dataset(
        rows,
        name=plan.name,
        dataset_id=plan.dataset_id,
        content_hash=plan.content_hash,
        context="training",
        source=plan.source_uri,
        run_id=run_id,
        config=registry,
    )
    log_dataset(
        test_tasks,
        name=f"{agent.name}-heldout",
        dataset_id=benchmark,
        content_hash=data_plan.content_hash(test_tasks),
        context="evaluation",
        source=f"agent profile {agent.name}, test split",
        run_id=run_id,
        config=registry,
    )
    set_run_tags(plan.tags(), run_id=run_id)


def _warm_start(
    config: TrainConfig, registry: RegistryConfig, run: RunContext, checkpoint: Checkpoint
) -> tuple[Checkpoint, str | None]:
    """With warm_start=champion, the champion's adapter becomes the run's policy v0; returns
    the checkpoint and the champion's version (None: starting from the base model)."""
    log = get_run_logger()
    if config.warm_start != "champion":
        return checkpoint, None
    found = champion_adapter(registry, "champion", dst=Path(run.root) / "warm_start")
    if found is None:
        log.info(
            "warm start: %s has no champion yet, so this run starts from the base model",
            registry.registered_model,
        )
        set_run_tags({"warm_start": "base (no champion)"}, run_id=checkpoint.mlflow_run_id)
        return checkpoint, None
    policy = publish_policy(
        run.server_url,
        f"{run.run_name}-v0",
        run.base_model,
        str(found.adapter),
        0,
        key_file=run.key_file,
    )
    log.info(
        "warm start from %s version %s (champion, registered score %s)",
        registry.registered_model,
        found.version,
        found.score,
    )
    set_run_tags(
        {"warm_start": f"{registry.registered_model}/{found.version}"},
        run_id=checkpoint.mlflow_run_id,
    )
    started = checkpoint.model_copy(update={"policy": policy, "adapter_dir": str(found.adapter)})
    return started, found.version


def run_training(config: TrainConfig) -> dict[str, Any]:
    """The flow's body, for a validated config."""
    log = get_run_logger()
    agent = profile(config.agent, config.tasks)
    policy_agents = _policy_agents(config, agent)
    run_name = config.run_name or default_run_name(agent.name)
    # The saved config names its run, so `--resume` finds the same name.
    config = config.model_copy(update={"run_name": run_name})
    registry_config = resolve(config.registry, agent.registered_model)
    test_tasks = _test_tasks(config)
    benchmark = _check_benchmark(config, agent, test_tasks)
    # A resumed run trains on the data it planned when it started; a new one plans it now,
    # and ends here, before any run folder or MLflow run exists, when nothing is new.
    path = run_path(config.run_dir, run_name)
    resumed = load_checkpoint(path) is not None
    saved = data_plan.load_plan(path) if resumed else None
    if saved is None:
        plan, new_tasks, batch = _plan_data(config, agent, registry_config)
        if plan.empty and config.data != "profile" and not resumed:
            return _nothing_new(agent, run_name, plan)
    else:
        plan = saved
    root, checkpoint = _start_or_resume(config, run_name)
    if config.rollout_timeout_s is None:
        config = config.model_copy(update={"rollout_timeout_s": agent.rollout_timeout_s})
    if saved is None:
        data_plan.save_plan(root, plan, new_tasks, batch)
    train_tasks = _train_tasks(config, str(root))
    started = time.time()
    ensure_gpu_limit()
    progress.report(root, "start", run=run_name, iterations=config.iterations)
    log.info(
        "run %s in %s: %d train / %d test tasks; data %s (%d rows, %s)",
        run_name,
        root,
        len(train_tasks),
        len(test_tasks),
        plan.dataset_id,
        plan.rows,
        plan.source,
    )

    with (
        policy_server(
            root / "store.duckdb",
            host=config.host,
            backend=config.backend,
            model=config.model,
            tool_format=agent.tool_format,
            vllm_url=config.vllm_url,
            replicas=config.replicas,
            env=_server_env(config),
        ) as server,
        tracking(
            registry_config,
            run_name=run_name,
            tags={"agent": agent.name},
            run_id=checkpoint.mlflow_run_id if checkpoint else None,
        ) as ml,
    ):
        run = RunContext(
            run_name=run_name,
            root=str(root),
            server_url=server.url,
            base_model=server.base_model,
            registered_model=registry_config.registered_model,
            key_file=server.key_file,
        )
        if checkpoint is None:
            checkpoint = Checkpoint(mlflow_run_id=ml.info.run_id)
            save_checkpoint(root, checkpoint)
            # Once, when the MLflow run is new: MLflow refuses a param's value to change, and
            # a resumed run may have more iterations.
            log_params(
                {
                    **config.model_dump(mode="json"),
                    "registered_model": registry_config.registered_model,
                },
                run_id=checkpoint.mlflow_run_id,
            )
            _log_datasets(
                config,
                registry_config,
                checkpoint.mlflow_run_id,
                root,
                plan,
                test_tasks,
                benchmark,
                agent,
            )
        else:
            cancelled = _cancel_unfinished(server.url, server.key_file)
            log.info(
                "resuming run %s after iteration %d (%d unfinished rollouts cancelled)",
                run_name,
                checkpoint.iteration,
                cancelled,
            )
        log.info(
            "policy server %s serving %s (log: %s)", server.url, server.base_model, server.log_path
        )
        if checkpoint.iteration < 0:
            checkpoint, champion = _warm_start(config, registry_config, run, checkpoint)
            base = _evaluate(config, agent, run, checkpoint.policy or server.base_model)
            if champion is not None and base.benchmark_id is not None:
                # The champion's score on this benchmark, on its version: what the gate
                # compares this run's adapter with.
                record_score(registry_config, champion, base.score, base.benchmark_id, base.tasks)
            evaluations = _record_evaluation(run, checkpoint, 0, base)
            checkpoint = checkpoint.model_copy(update={"iteration": 0, "evaluations": evaluations})
            save_checkpoint(root, checkpoint)

        bar = _progress_artifact(agent, run_name, checkpoint.iteration, config.iterations)
        with _rollouts_ahead(config, run, checkpoint):
            for it in range(checkpoint.iteration + 1, config.iterations + 1):
                checkpoint = train_iteration.with_options(flow_run_name=f"iteration-{it}")(
                    config=config, run=run, checkpoint=checkpoint, iteration=it
                )
                # Restarts of the policy server so far (it is brought back when it dies).
                log_metrics_once(
                    {"server/restarts": server.restarts}, step=it, run_id=checkpoint.mlflow_run_id
                )
                update_progress_artifact(bar, progress=100.0 * it / config.iterations)
                _iterations_table(agent, run_name, checkpoint.history)

        evals = [(e.iteration, e.restored()) for e in checkpoint.evaluations]
        base, final = evals[0][1], evals[-1][1]
        # Base and final on the same tasks: per-tier rows and the paired interval of the gain.
        comparison = compare(
            base,
            final,
            test_tasks,
            config.curriculum.tier_key,
            _credit(config, agent).success_threshold,
            config.seed,
        )
        (root / "heldout_comparison.json").write_text(comparison.model_dump_json(indent=2))
        log.info("held-out, base vs final:\n%s", comparison.markdown())
        decision = register_policy(
            registry_config,
            checkpoint.adapter_dir,
            config.model or "smollm2",
            checkpoint.policy,
            config.iterations,
            final.score,
            # None only from a checkpoint written before scores had one: refused, with why.
            benchmark_id=final.benchmark_id or "",
            benchmark_size=final.tasks,
            run_id=checkpoint.mlflow_run_id,
        )
        log.info("registry: %s", decision.reason)
        # The data is taken: the next recurring run reads on from this run's watermark.
        set_run_tags({data_plan.TAG_COMPLETE: "true"}, run_id=checkpoint.mlflow_run_id)

        con = analytics.connect(root, ":memory:")
        try:
            history = analytics.history(con)
        finally:
            con.close()
        title = f"{agent.name}: {run_name}"
        curve = report.reward_curve(history, evals, root / "reward_curve.png", title)
        log_artifact(curve, run_id=checkpoint.mlflow_run_id)
        summary = {
            "run": run_name,
            "run_dir": str(root),
            "agent": agent.name,
            "iterations": config.iterations,
            "base": base.model_dump(),
            "final": final.model_dump(),
            "gain_points": round((final.score - base.score) * 100, 1),
            "gain_ci_points": list(comparison.gain_ci_points),
            "per_tier": [r.model_dump() for r in comparison.rows],
            "policy_version": checkpoint.policy,
            "adapter": checkpoint.adapter_dir,
            "policy_agents": policy_agents,
            "promotion": decision.model_dump(),
            "reward_curve": str(curve),
            "minutes": round((time.time() - started) / 60, 1),
            "mlflow_run_id": checkpoint.mlflow_run_id,
            "data": plan.model_dump(),
            "benchmark_id": benchmark,
            "warm_start": config.warm_start,
        }
        create_markdown_artifact(
            report.markdown(title, history, evals, curve, decision.reason, extra=summary),
            key=report.artifact_key(agent.name, "training-report"),
            description=f"Training report of {run_name}",
        )
        create_markdown_artifact(
            comparison.markdown(),
            key=report.artifact_key(agent.name, "heldout-comparison"),
            description="Base vs final on the held-out tasks, per tier, with the paired gain",
        )
        create_table_artifact(
            [{"iteration": i, **e.model_dump()} for i, e in evals],
            key=report.artifact_key(agent.name, "heldout"),
            description="Held-out score per evaluation",
        )
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    progress.report(root, "done", **{k: v for k, v in summary.items() if k != "promotion"})
    return summary


def _flow_run_name() -> str:
    # The flow run is named after the run (a resumed run's flow runs share its name); without
    # a run_name yet, after the agent.
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return str(params.get("run_name") or f"train-{params.get('agent') or 'calc'}")


@flow(
    name="train",
    flow_run_name=_flow_run_name,
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=16),
)
@train_config_parameters
def train(**params: Any) -> dict[str, Any]:
    """Train an agent's policy with LightningRL; every parameter is a field of TrainConfig
    (flows/config.py), where each is described."""
    return run_training(TrainConfig.model_validate(params))
