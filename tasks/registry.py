"""Prefect tasks over the MLflow registry (lightning_rl.registry): what a flow runs as a task.

The MLflow code itself lives in lightning_rl.registry: runs (tracking), pyfunc (the logged
model), promotion (the rule), versions (registering, promoting, lookups).
"""

from __future__ import annotations

from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from lightning_core.errors import InvalidInput
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.promotion import PromotionDecision
from lightning_rl.registry.versions import register_policy_version


def _transient(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    # A score that is no number or a folder that is no adapter fails the same way every time.
    return not isinstance(state.result(raise_on_failure=False), InvalidInput)


# Retries are safe: registration is idempotent per (MLflow run, policy version), so a retry
# after a lost connection (RegistryUnavailable) or a timeout finds the version the attempt
# registered, and finishes its alias moves, rather than registering a second version. (The
# attempt has stopped by then: the timeout interrupts it in the thread the retry runs in.)
@task(
    name="register-policy",
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=_transient,
    timeout_seconds=900,
    cache_policy=NO_CACHE,
)
def register_policy(
    config: RegistryConfig,
    adapter_dir: str,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    benchmark_id: str,
    benchmark_size: int,
    run_id: str,
) -> PromotionDecision:
    """New registered model version (alias challenger); champion moves only past the gate,
    comparing scores on benchmark `benchmark_id` (of `benchmark_size` tasks) only.

    `run_id` is the flow's MLflow run, which the version is logged in and recognised by: the
    same policy version registered again from that run returns the first decision.
    """
    return register_policy_version(
        config,
        adapter_dir,
        base_model=base_model,
        policy_version=policy_version,
        iteration=iteration,
        score=score,
        benchmark_id=benchmark_id,
        benchmark_size=benchmark_size,
        run_id=run_id,
    )
