"""The evaluation flow: a registered policy (the champion by default) on the held-out split.

For recurring checks of what is served, and for `lightning-rl eval`: it downloads the adapter
from the MLflow registry, serves it, runs the agent's benchmark greedily and records the score
as an MLflow run of its own and a Prefect artifact, and on the registered version's tags with
its benchmark id: a champion scored on the benchmark of a new version can be compared with it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from lightning_core.errors import InvalidInput, NotFound
from lightning_core.serving.config import ServerConfig
from lightning_rl.flows import report
from lightning_rl.flows.profiles import profile
from lightning_rl.policy_server import policy_server
from lightning_rl.redacted import flow
from lightning_rl.registry.config import RegistryConfig, resolve
from lightning_rl.registry.runs import log_metrics, log_params, tracking
from lightning_rl.registry.versions import champion_adapter, record_score
from lightning_rl.tasks.evaluation import evaluate_policy
from lightning_rl.tasks.training import publish_policy


@flow(name="evaluate", log_prints=True)
def evaluate(
    agent: str = "calc",
    policy: str = "champion",
    tasks: str | None = None,
    task_source: str | None = None,
    eval_size: int = 200,
    model: str | None = None,
    concurrency: int = 32,
    rollout_timeout_s: float | None = None,
    run_dir: str = "runs",
    registry: RegistryConfig | None = None,
    split: str = "test",
) -> dict[str, Any]:
    """Score `policy` on the agent's held-out split: 'base' (the base model), 'champion' or
    another alias, or a registered model version number. `split` is 'test' (the benchmark
    the registry's scores are on) or another held-out split the agent's loader serves, such
    as the example agents' 'kinds'; a score on another split is not recorded on the version."""
    log = get_run_logger()
    if eval_size < 1:
        raise InvalidInput(f"eval_size must be at least 1, not {eval_size}")
    if split == "train":
        raise InvalidInput("split 'train' is what training draws from, not a held-out split")
    spec = profile(agent, tasks)
    config = resolve(registry, spec.registered_model)
    test_tasks = spec.load_tasks(split, eval_size, task_source)
    root = Path(run_dir).resolve() / f"eval-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True, exist_ok=True)

    found = None
    if policy != "base":
        found = champion_adapter(config, policy, dst=root / "adapter")
        if found is None:
            raise NotFound(
                f"registered model {config.registered_model!r} has no version {policy!r}: "
                "train one first (lightning-rl train), or evaluate 'base'"
            )
    with policy_server(
        root / "store.duckdb", ServerConfig(model=model), tool_format=spec.tool_format
    ) as server:
        name = server.base_model
        if found is not None:
            name = publish_policy(
                server.url,
                f"{config.registered_model}-v{found.version}",
                name,
                str(found.adapter),
                0,
                key_file=server.key_file,
            )
        result = evaluate_policy.submit(
            server.url,
            spec.agent,
            test_tasks,
            name,
            concurrency=concurrency,
            rollout_timeout_s=rollout_timeout_s or spec.rollout_timeout_s,
            success_threshold=spec.success_threshold,
            run_dir=str(root),
            key_file=server.key_file,
        ).result()
    log.info("held-out: %s on benchmark %s", result.summary(), result.benchmark_id)
    if found is not None and result.benchmark_id is not None and split == "test":
        record_score(config, found.version, result.score, result.benchmark_id, result.tasks)
    with tracking(
        config, run_name=root.name, tags={"agent": spec.name, "kind": "evaluation"}
    ) as run:
        log_params(
            {
                "policy": policy,
                "version": found.version if found else "base",
                "tasks": eval_size,
                "split": split,
                "benchmark_id": result.benchmark_id,
            },
            run_id=run.info.run_id,
        )
        log_metrics(result.metrics(), step=0, run_id=run.info.run_id)
    summary = {
        "agent": spec.name,
        "policy": policy,
        "version": found.version if found else None,
        "split": split,
        "registered_score": found.score if found else None,
        **result.model_dump(),
        # Each task's reward: two evaluations of the same tasks compare task by task
        # (benchmarks/heldout_split.py).
        "rewards": result.rewards,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    create_markdown_artifact(
        f"# {spec.name}: {policy}\n\n{result.summary()}\n\n"
        f"Registered score: {found.score if found else 'n/a'}",
        key=report.artifact_key(spec.name, "evaluation"),
        description=f"Held-out evaluation of {policy}",
    )
    return summary
