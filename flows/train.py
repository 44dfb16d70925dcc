"""The training flow: iterations of rollouts, credit assignment, analytics, a LoRA update and
evaluation, then MLflow registration with a gated promotion.

    serve      store + OpenAI-compatible gateway + backend (a child process)
    evaluate   the base model on the held-out split (iteration 0)
    each iteration k = 1..N
      plan       draw tasks by the curriculum's tiers, G rollouts each on the current policy
      rollout    run-rollouts.map over workers (threads, Ray or Dask)
      collect    spans -> transitions, LightningRL credit, group advantages (stored)
                 (dynamic sampling: while too few groups carry a signal, more tasks)
      analyze    Parquet export + DuckDB metrics (MLflow, Prefect table)
      train      LoRA policy-gradient update (global concurrency limit "gpu")
      publish    adapter k registered as policy version <run>-v<k>; the next rollouts use it
      evaluate   every E iterations and at the end
    register   MLflow model version (challenger); champion only if it beats the champion

With `policy_per_agent`, each trained agent has its own adapter and trainer: train splits the
iteration's transitions by agent, publish registers <run>-v<k>-<agent> per agent and <run>-v<k>,
which serves each agent's calls with its own, and that one version is evaluated, registered
(the agents' adapters in one model version) and promoted or refused as a whole.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from lightning_rl.flows.config import TrainConfig
from lightning_rl.tasks import progress, registry, report
from lightning_rl.tasks.analysis import analyze_iteration
from lightning_rl.tasks.evaluation import evaluate_policy
from lightning_rl.tasks.profiles import AgentProfile, profile
from lightning_rl.tasks.rollouts import collect_transitions, plan_rollouts, run_rollouts
from lightning_rl.tasks.server import PolicyServer, policy_server
from lightning_rl.tasks.training import (
    ensure_gpu_limit,
    publish_policy,
    train_agent_policies,
    train_policy,
)
from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from lightning_core import analytics, semconv
from lightning_core.adapter import AdapterConfig
from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.collect import Collected, CreditConfig
from lightning_core.comparison import compare
from lightning_core.curriculum import Curriculum, CurriculumConfig, group_signal
from lightning_core.errors import InvalidInput
from lightning_core.evaluation import EvalResult
from lightning_core.rewards import AIRRule

_D = TrainConfig()


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
    with _cluster_runner(config) as runner:
        futures = runner.map(run_rollouts, parameters)
        return [f.result() for f in futures]


def _run_folder(config: TrainConfig, agent: AgentProfile) -> tuple[str, Path]:
    name = config.run_name or f"{agent.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = Path(config.run_dir).resolve() / name
    root.mkdir(parents=True, exist_ok=True)
    # runs/latest: where `lightning-rl analyze` looks by default.
    latest = root.parent / "latest"
    tmp = root.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(root.name)
    os.replace(tmp, latest)
    return name, root


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


def _trainers(trainer_config: TrainerConfig, agents: list[str]) -> dict[str, LoRATrainer]:
    # Each agent's adapter starts from its own seed, so they are independent from step 0.
    return {
        name: LoRATrainer(trainer_config.model_copy(update={"seed": trainer_config.seed + i}))
        for i, name in enumerate(agents)
    }


def _rollout_rounds(
    config: TrainConfig,
    agent: AgentProfile,
    server_url: str,
    curriculum: Curriculum,
    policy: str,
    run_name: str,
    it: int,
    root: Path,
) -> tuple[Collected, dict[str, float]]:
    """An iteration's rollouts: tasks drawn by the curriculum, G rollouts each, collected;
    then, while fewer than tasks_per_iteration groups carry a signal and rounds are left,
    another round of as many new tasks (dynamic sampling). Returns the merged transitions and
    what was sampled."""
    adapter = AdapterConfig(
        agents=config.train_agents or agent.train_agents, air=_air(agent, config)
    )
    credit = config.credit.model_copy(update={"success_threshold": agent.success_threshold})
    wanted = config.tasks_per_iteration
    merged, drawn, with_signal = Collected(), [], 0
    weights = curriculum.weights()
    for round_ in range(config.curriculum.max_rounds):
        chosen = curriculum.sample(
            wanted - with_signal, it, round_, exclude=(str(t["id"]) for t in drawn)
        )
        if not chosen:
            break
        rollout_ids = plan_rollouts(
            server_url,
            chosen,
            config.group_size,
            policy,
            f"{run_name}-it{it}",
            {"temperature": config.temperature},
            config.max_attempts,
            seed=config.seed,
            iteration=it,
            first_index=len(drawn) * config.group_size,
        )
        drawn += chosen
        _fan_out(
            config,
            {
                "worker": list(range(config.rollout_workers)),
                "server_url": unmapped(server_url),
                "agent": unmapped(agent.agent),
                "rollout_ids": unmapped(rollout_ids),
                "concurrency": unmapped(config.rollout_concurrency),
                "rollout_timeout_s": unmapped(config.rollout_timeout_s),
                "default_model": unmapped(policy),
                "run_dir": unmapped(str(root)),
            },
        )
        collected = collect_transitions(server_url, rollout_ids, adapter, credit)
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


@task(name="register-policy", timeout_seconds=900, cache_policy=NO_CACHE)
def register_policy(
    config: registry.RegistryConfig,
    adapter_dir: str,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    run_id: str,
) -> registry.PromotionDecision:
    """New registered model version (alias challenger); champion moves only past the gate.
    No retries: a retry would register a second version."""
    return registry.publish_adapter(
        config,
        adapter_dir,
        base_model=base_model,
        policy_version=policy_version,
        iteration=iteration,
        score=score,
        run_id=run_id,
    )


def _evaluate(
    config: TrainConfig,
    agent: AgentProfile,
    server: PolicyServer,
    tasks: list[dict[str, Any]],
    policy: str,
    root: Path,
) -> EvalResult:
    # An async task (its timeout can cancel it); submitted, it runs on the task runner.
    return evaluate_policy.submit(
        server.url,
        agent.agent,
        tasks,
        policy,
        concurrency=config.rollout_workers * config.rollout_concurrency,
        rollout_timeout_s=config.rollout_timeout_s,
        success_threshold=agent.success_threshold,
        run_dir=str(root),
    ).result()


def run_training(config: TrainConfig) -> dict[str, Any]:
    """The flow's body, for a validated config."""
    log = get_run_logger()
    agent = profile(config.agent, config.tasks)
    policy_agents = _policy_agents(config, agent)
    if config.rollout_timeout_s is None:
        config = config.model_copy(update={"rollout_timeout_s": agent.rollout_timeout_s})
    run_name, root = _run_folder(config, agent)
    (root / "config.json").write_text(config.model_dump_json(indent=2))
    train_tasks = agent.load_tasks("train", config.train_size, config.task_source)
    test_tasks = agent.load_tasks("test", config.eval_size, config.task_source)
    registry_config = config.registry
    if not registry_config.registered_model:
        registry_config = registry_config.model_copy(
            update={"registered_model": agent.registered_model}
        )
    curriculum = Curriculum(train_tasks, config.curriculum, config.seed)
    trainer_config: TrainerConfig = config.trainer.model_copy(
        update={"model": config.model, "seed": config.seed}
    )
    started = time.time()
    ensure_gpu_limit()
    progress.report(root, "start", run=run_name, iterations=config.iterations)
    log.info(
        "run %s in %s: %d train / %d test tasks", run_name, root, len(train_tasks), len(test_tasks)
    )

    with (
        policy_server(
            root / "store.duckdb",
            host=config.host,
            backend=config.backend,
            model=config.model,
            tool_format=agent.tool_format,
            vllm_url=config.vllm_url,
        ) as server,
        registry.tracking(registry_config, run_name=run_name, tags={"agent": agent.name}) as ml,
    ):
        run_id = ml.info.run_id
        registry.log_params(
            {
                **config.model_dump(mode="json"),
                "registered_model": registry_config.registered_model,
            },
            run_id=run_id,
        )
        log.info(
            "policy server %s serving %s (log: %s)", server.url, server.base_model, server.log_path
        )

        evals: list[tuple[int, EvalResult]] = []
        base = _evaluate(config, agent, server, test_tasks, server.base_model, root)
        evals.append((0, base))
        registry.log_metrics(base.metrics(), step=0, run_id=run_id)
        progress.report(root, "evaluated", iteration=0, **base.model_dump())
        log.info("base model: %s", base.summary())

        # One trainer per agent with policy_per_agent (each loads its own copy of the model).
        trainers = _trainers(trainer_config, policy_agents) if policy_agents else {}
        trainer = None if trainers else LoRATrainer(trainer_config)
        policy, adapter_dir = server.base_model, ""
        for it in range(1, config.iterations + 1):
            progress.report(root, "iteration", iteration=it, policy=policy)
            collected, sampled = _rollout_rounds(
                config, agent, server.url, curriculum, policy, run_name, it, root
            )
            analysis = analyze_iteration(
                str(root),
                it,
                collected,
                artifact_key=report.artifact_key(agent.name, "agent-breakdown"),
            )
            progress.report(root, "training", iteration=it, transitions=len(collected.trainable))
            adapter_dir = str(root / "adapters" / f"v{it}")
            if trainers:
                trained = train_agent_policies(
                    trainers,
                    collected.transitions,
                    adapter_dir,
                    config.updates_per_iteration,
                    config.seed + it,
                )
            else:
                trained = train_policy(
                    trainer,
                    collected.transitions,
                    adapter_dir,
                    config.updates_per_iteration,
                    config.seed + it,
                )
            policy = publish_policy(
                server.url, f"{run_name}-v{it}", server.base_model, adapter_dir, it
            )
            metrics = {**analysis["metrics"], **sampled, **trained}
            registry.log_metrics(metrics, step=it, run_id=run_id)
            progress.report(root, "iterated", iteration=it, policy=policy, **metrics)
            log.info(
                "iteration %d: reward %.3f, success %.3f, %d transitions trained -> %s",
                it,
                metrics.get("rollout/reward_mean", float("nan")),
                metrics.get("rollout/success_rate", float("nan")),
                int(trained["train/transitions"]),
                policy,
            )
            if it % config.eval_every == 0 or it == config.iterations:
                result = _evaluate(config, agent, server, test_tasks, policy, root)
                evals.append((it, result))
                registry.log_metrics(result.metrics(), step=it, run_id=run_id)
                progress.report(root, "evaluated", iteration=it, **result.model_dump())
                log.info("held-out after iteration %d: %s", it, result.summary())

        final = evals[-1][1]
        # Base and final on the same tasks: per-tier rows and the paired interval of the gain.
        comparison = compare(
            base,
            final,
            test_tasks,
            config.curriculum.tier_key,
            agent.success_threshold,
            config.seed,
        )
        (root / "heldout_comparison.json").write_text(comparison.model_dump_json(indent=2))
        log.info("held-out, base vs final:\n%s", comparison.markdown())
        decision = register_policy(
            registry_config,
            adapter_dir,
            config.model or "smollm2",
            policy,
            config.iterations,
            final.accuracy,
            run_id,
        )
        log.info("registry: %s", decision.reason)

        con = analytics.connect(root, ":memory:")
        try:
            history = analytics.history(con)
        finally:
            con.close()
        title = f"{agent.name}: {run_name}"
        curve = report.reward_curve(history, evals, root / "reward_curve.png", title)
        registry.log_artifact(curve, run_id=run_id)
        summary = {
            "run": run_name,
            "run_dir": str(root),
            "agent": agent.name,
            "iterations": config.iterations,
            "base": base.model_dump(),
            "final": final.model_dump(),
            "gain_points": round((final.accuracy - base.accuracy) * 100, 1),
            "gain_ci_points": list(comparison.gain_ci_points),
            "per_tier": [r.model_dump() for r in comparison.rows],
            "policy_version": policy,
            "adapter": adapter_dir,
            "policy_agents": policy_agents,
            "promotion": decision.model_dump(),
            "reward_curve": str(curve),
            "minutes": round((time.time() - started) / 60, 1),
            "mlflow_run_id": run_id,
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
            description="Held-out accuracy per evaluation",
        )
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    progress.report(root, "done", **{k: v for k, v in summary.items() if k != "promotion"})
    return summary


@flow(name="train", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def train(
    agent: str = _D.agent,
    tasks: str | None = _D.tasks,
    task_source: str | None = _D.task_source,
    iterations: int = _D.iterations,
    tasks_per_iteration: int = _D.tasks_per_iteration,
    group_size: int = _D.group_size,
    temperature: float = _D.temperature,
    max_attempts: int = _D.max_attempts,
    rollout_timeout_s: float | None = _D.rollout_timeout_s,
    rollout_workers: int = _D.rollout_workers,
    rollout_concurrency: int = _D.rollout_concurrency,
    task_runner: str = _D.task_runner,
    task_runner_address: str | None = _D.task_runner_address,
    eval_every: int = _D.eval_every,
    eval_size: int = _D.eval_size,
    train_size: int = _D.train_size,
    updates_per_iteration: int = _D.updates_per_iteration,
    model: str | None = _D.model,
    backend: str = _D.backend,
    vllm_url: str | None = _D.vllm_url,
    host: str = _D.host,
    run_dir: str = _D.run_dir,
    run_name: str | None = _D.run_name,
    train_agents: list[str] | None = _D.train_agents,
    policy_per_agent: bool = _D.policy_per_agent,
    air_reward: float | None = _D.air_reward,
    seed: int = _D.seed,
    trainer: TrainerConfig = _D.trainer,
    credit: CreditConfig = _D.credit,
    curriculum: CurriculumConfig = _D.curriculum,
    registry_config: registry.RegistryConfig = _D.registry,
) -> dict[str, Any]:
    """Train an agent's policy with LightningRL; every parameter is a field of TrainConfig
    (flows/config.py), where each is described."""
    params = dict(locals())
    params["registry"] = params.pop("registry_config")
    return run_training(TrainConfig.model_validate(params))
