"""How a training run starts: what it trains on (its data plan, or the end of a recurring run
that finds nothing new), its folder and checkpoint (new or resumed), the policy server and the
MLflow run, and the base policy's held-out score (iteration 0)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from lightning_core.errors import InvalidInput
from lightning_core.stats.evaluation import benchmark_id
from lightning_core.types import RolloutStatus
from lightning_rl import progress
from lightning_rl.flows import data_plan, report
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.held_out import evaluate, evaluate_extra_splits, record_evaluation
from lightning_rl.flows.judging import check_judge
from lightning_rl.flows.pipeline import PolicyRef
from lightning_rl.flows.profiles import AgentProfile, profile
from lightning_rl.flows.run_context import (
    RunContext,
    credit,
    heldout_tasks,
    plan_batch,
    plan_tasks,
    policy_agents,
    train_tasks,
)
from lightning_rl.flows.run_state import (
    Checkpoint,
    check_same_config,
    default_run_name,
    load_checkpoint,
    run_folder,
    run_path,
    save_checkpoint,
    save_config,
)
from lightning_rl.flows.sft import check_sft, sft_warm_start
from lightning_rl.gpu_slot import ensure_gpu_limit
from lightning_rl.policy_server import PolicyServer, policy_server, store_client
from lightning_rl.registry.config import RegistryConfig, resolve
from lightning_rl.registry.live import warm_start_alias
from lightning_rl.registry.run_start import RunDataset, log_run_start
from lightning_rl.registry.runs import set_run_tags, tracking
from lightning_rl.registry.versions import champion_adapter, record_score
from lightning_rl.tasks.training import publish_policy


@dataclass
class Start:
    """A run ready for its policy server: its settings with the profile's defaults filled in,
    its folder, data plan and held-out benchmark, and the checkpoint it resumes (None: new)."""

    config: TrainConfig
    agent: AgentProfile
    registry: RegistryConfig
    root: Path
    checkpoint: Checkpoint | None
    plan: data_plan.DataPlan
    test_tasks: list[dict[str, Any]]
    benchmark: str
    started: float


def _check_benchmark(config: TrainConfig, agent: AgentProfile, tasks: list[dict[str, Any]]) -> str:
    """The held-out benchmark's id; with a pinned one, the run stops unless they agree."""
    found = benchmark_id(
        tasks, agent=agent.agent, threshold=credit(config, agent).success_threshold
    )
    if config.evaluation.benchmark_id is not None and found != config.evaluation.benchmark_id:
        raise InvalidInput(
            f"the held-out benchmark is {found}, but the run pins benchmark_id="
            f"{config.evaluation.benchmark_id}: its tasks or how they are scored changed "
            "(eval_size, task_source, the agent or its dataset). Scores on different benchmarks "
            f"are not comparable; pin {found} once you mean to move to it"
        )
    return found


def _plan_data(
    config: TrainConfig, agent: AgentProfile, registry: RegistryConfig
) -> tuple[data_plan.DataPlan, list[dict[str, Any]] | None, Any]:
    """(plan, the new tasks, the offline batch): what this run trains on."""
    if config.data.source == "new_tasks":
        plan, tasks = data_plan.plan_new_tasks(
            data_plan.table_folder(config, agent.name), registry, agent.name
        )
        return plan, tasks, None
    if config.data.source == "episodes":
        offline = config.data.offline
        if "success_threshold" not in offline.model_fields_set:
            threshold = credit(config, agent).success_threshold
            offline = offline.model_copy(update={"success_threshold": threshold})
        plan, batch = data_plan.plan_episodes(
            str(config.data.episodes_from),
            config.data.episodes_key_file,
            registry,
            agent.name,
            offline,
            config.train_agents or agent.train_agents,
            config.data.episodes_archive,
            config.data.episodes_once,
        )
        return plan, None, batch
    return data_plan.plan_profile(agent.name, train_tasks(config)), None, None


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


def _folder(config: TrainConfig, run_name: str) -> tuple[Path, Checkpoint | None]:
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


def start_run(config: TrainConfig) -> Start | dict[str, Any]:
    """The run's folder, data plan and checkpoint; or, for a recurring run that finds nothing
    new, the summary that says so (before any run folder or MLflow run exists)."""
    agent = profile(config.agent, config.tasks)
    policy_agents(config, agent)  # refused here, before any run folder or server
    check_judge(config, agent)
    check_sft(config)
    run_name = config.run_name or default_run_name(agent.name)
    # The saved config names its run, so `--resume` finds the same name.
    config = config.model_copy(update={"run_name": run_name})
    registry = resolve(config.registry, agent.registered_model)
    test_tasks = heldout_tasks(config)
    benchmark = _check_benchmark(config, agent, test_tasks)
    for split in config.evaluation.extra_splits:
        heldout_tasks(config, split)  # a split the agent lacks is refused before any folder
    # A resumed run trains on the data it planned when it started; a new one plans it now.
    path = run_path(config.run_dir, run_name)
    resumed = load_checkpoint(path) is not None
    plan = data_plan.load_plan(path) if resumed else None
    if plan is None:
        plan, new_tasks, batch = _plan_data(config, agent, registry)
        if plan.empty and config.data.source != "profile" and not resumed:
            return _nothing_new(agent, run_name, plan)
        root, checkpoint = _folder(config, run_name)
        data_plan.save_plan(root, plan, new_tasks, batch)
    else:
        root, checkpoint = _folder(config, run_name)
    if config.rollouts.rollout_timeout_s is None:
        rollouts = config.rollouts.model_copy(update={"rollout_timeout_s": agent.rollout_timeout_s})
        config = config.model_copy(update={"rollouts": rollouts})
    ensure_gpu_limit()
    progress.report(root, "start", run=run_name, iterations=config.iterations)
    get_run_logger().info(
        "run %s in %s: %d train / %d test tasks; data %s (%d rows, %s)",
        run_name,
        root,
        len(train_tasks(config, str(root))),
        len(test_tasks),
        plan.dataset_id,
        plan.rows,
        plan.source,
    )
    return Start(
        config, agent, registry, root, checkpoint, plan, test_tasks, benchmark, time.time()
    )


def server_env(config: TrainConfig) -> dict[str, str]:
    """With rollouts overlapping training on CPU, the policy server's OpenMP threads wait
    passively: spinning, they burn the cores the trainer (another process) needs while they
    wait for a sibling it pushed off a core, and both sides crawl (BENCHMARKS.md, issue 15)."""
    overlapping = config.rollouts.staleness and config.server.backend == "transformers"
    if overlapping and "OMP_WAIT_POLICY" not in os.environ:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}


@contextlib.contextmanager
def serve(start: Start) -> Iterator[tuple[RunContext, PolicyServer, str]]:
    """The run's policy server (store + gateway) and its MLflow run, for the iterations:
    yields the run's context, the server and the MLflow run's id."""
    config, checkpoint = start.config, start.checkpoint
    with (
        policy_server(
            start.root / "store.duckdb",
            config.server,
            tool_format=start.agent.tool_format,
            env=server_env(config),
        ) as server,
        tracking(
            start.registry,
            run_name=config.run_name,
            tags={"agent": start.agent.name},
            run_id=checkpoint.mlflow_run_id if checkpoint else None,
        ) as ml,
    ):
        get_run_logger().info(
            "policy server %s serving %s (log: %s)", server.url, server.base_model, server.log_path
        )
        run = RunContext(
            run_name=str(config.run_name),
            root=str(start.root),
            server_url=server.url,
            base_model=server.base_model,
            registered_model=start.registry.registered_model,
            key_file=server.key_file,
            template_fingerprint=server.template_fingerprint,
        )
        yield run, server, ml.info.run_id


def _training_rows(start: Start) -> list[dict[str, Any]]:
    if start.plan.source == "episodes":
        return [dict(e) for e in plan_batch(str(start.root)).episodes]
    if start.plan.source == "new_tasks":
        return plan_tasks(str(start.root))
    return train_tasks(start.config)


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


def begin(start: Start, run: RunContext, mlflow_run_id: str) -> Checkpoint:
    """A new run's first checkpoint and its MLflow records; a resumed run's checkpoint, with
    what the killed run left unfinished cancelled."""
    if start.checkpoint is not None:
        cancelled = _cancel_unfinished(run.server_url, run.key_file)
        get_run_logger().info(
            "resuming run %s after iteration %d (%d unfinished rollouts cancelled)",
            run.run_name,
            start.checkpoint.iteration,
            cancelled,
        )
        return start.checkpoint
    checkpoint = Checkpoint(mlflow_run_id=mlflow_run_id)
    save_checkpoint(start.root, checkpoint)
    plan, agent = start.plan, start.agent
    log_run_start(
        start.registry,
        mlflow_run_id,
        start.config.model_dump(mode="json"),
        training=RunDataset(
            _training_rows(start), plan.name, plan.dataset_id, plan.content_hash, plan.source_uri
        ),
        benchmark=RunDataset(
            start.test_tasks,
            f"{agent.name}-heldout",
            start.benchmark,
            data_plan.content_hash(start.test_tasks),
            f"agent profile {agent.name}, test split",
        ),
        tags=plan.tags(),
    )
    return checkpoint


def _warm_start(
    start: Start, run: RunContext, checkpoint: Checkpoint
) -> tuple[Checkpoint, str | None]:
    """With warm_start=champion (or challenger), that version's adapter becomes the run's
    policy v0; returns the checkpoint and the champion's version (None: starting from the base
    model or from a challenger, whose score is not the champion's)."""
    log, registry = get_run_logger(), start.registry
    if start.config.warm_start == "base":
        return checkpoint, None
    if start.config.warm_start == "sft":
        return sft_warm_start(start.config, start.agent, run, checkpoint), None
    alias = warm_start_alias(registry, start.config.warm_start)
    found = champion_adapter(registry, alias, dst=Path(run.root) / "warm_start")
    if found is None:
        log.info(
            "warm start: %s has no champion yet, so this run starts from the base model",
            registry.registered_model,
        )
        set_run_tags({"warm_start": "base (no champion)"}, run_id=checkpoint.mlflow_run_id)
        return checkpoint, None
    policy = publish_policy(
        run.server_url,
        PolicyRef(run=run.run_name, index=0).name(),
        run.base_model,
        str(found.adapter),
        0,
        key_file=run.key_file,
    )
    log.info(
        "warm start from %s version %s (%s, registered score %s)",
        registry.registered_model,
        found.version,
        alias,
        found.score,
    )
    set_run_tags(
        {"warm_start": f"{registry.registered_model}/{found.version}"},
        run_id=checkpoint.mlflow_run_id,
    )
    started = checkpoint.model_copy(update={"policy": policy, "adapter_dir": str(found.adapter)})
    return started, found.version if alias == "champion" else None


def evaluate_start(start: Start, run: RunContext, checkpoint: Checkpoint) -> Checkpoint:
    """Iteration 0, once per run: the starting policy (the base model, or the champion with
    warm_start=champion) scored on the held-out benchmark."""
    if checkpoint.iteration >= 0:
        return checkpoint
    checkpoint, champion = _warm_start(start, run, checkpoint)
    base = evaluate(start.config, start.agent, run, checkpoint.policy or run.base_model)
    if champion is not None and base.benchmark_id is not None:
        # The champion's score on this benchmark, on its version: what the gate compares this
        # run's adapter with.
        record_score(start.registry, champion, base.score, base.benchmark_id, base.tasks)
    evaluations = record_evaluation(run, checkpoint, 0, base)
    splits = evaluate_extra_splits(
        start.config, start.agent, run, checkpoint, 0, checkpoint.policy or run.base_model
    )
    checkpoint = checkpoint.model_copy(
        update={"iteration": 0, "evaluations": evaluations, "split_evaluations": splits}
    )
    save_checkpoint(start.root, checkpoint)
    return checkpoint
