"""What a recurring run trains on: the data plan against a real task table and a real MLflow
(SQLite), the pinned benchmark, and runs of the real flow that find nothing new."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from pydantic import ValidationError

from lightning_core.data.task_table import TaskTable
from lightning_core.errors import InvalidInput
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.data_plan import TAG_COMPLETE, plan_new_tasks
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig

REPO = Path(__file__).resolve().parents[1]
AGENT = {"agent": "tests.flow_agents:agent", "tasks": "tests.flow_agents:load_tasks"}


def _tasks(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "question": f"Say {i}."} for i in range(n)]


def _finished_run(registry: RegistryConfig, agent: str, tags: dict[str, str]) -> str:
    mlflow.set_tracking_uri(registry.tracking_uri)
    experiment = mlflow.set_experiment(registry.experiment)
    client = MlflowClient(registry.tracking_uri)
    run = client.create_run(experiment.experiment_id, tags={"agent": agent, **tags})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_new_tasks_are_the_files_after_the_previous_complete_run(tmp_path):
    registry = RegistryConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    table = TaskTable(tmp_path / "calc-tasks")
    first = table.append(_tasks("week1", 3))
    plan, tasks = plan_new_tasks(tmp_path / "calc-tasks", registry, "calc")
    assert (plan.rows, plan.after, plan.through) == (3, None, first)
    assert [t["id"] for t in tasks] == ["week1-0", "week1-1", "week1-2"]

    run_id = _finished_run(registry, "calc", {TAG_COMPLETE: "true", "data.tasks.through": first})
    # A run that started but never finished its gate does not move the watermark.
    _finished_run(registry, "calc", {"data.tasks.through": "zzz"})
    second = table.append(_tasks("week2", 2))
    plan, tasks = plan_new_tasks(tmp_path / "calc-tasks", registry, "calc")
    assert (plan.rows, plan.after, plan.through, plan.previous_run) == (2, first, second, run_id)
    assert [t["id"] for t in tasks] == ["week2-0", "week2-1"]
    assert plan.dataset_id.startswith("calc-tasks@") and len(plan.content_hash) == 64

    _finished_run(registry, "calc", {TAG_COMPLETE: "true", "data.tasks.through": second})
    plan, tasks = plan_new_tasks(tmp_path / "calc-tasks", registry, "calc")
    assert plan.empty and tasks == []
    assert "no new tasks" in plan.reason() and second in plan.reason()


def test_episodes_need_a_production_server():
    with pytest.raises(ValidationError, match="episodes_from"):
        TrainConfig(data="episodes")


def test_a_run_with_no_new_tasks_says_why_and_trains_nothing(prefect_harness, tmp_path):
    registry = RegistryConfig(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", registered_model="plan-test"
    )
    summary = train(
        **AGENT,
        warm_start="champion",
        run_dir=str(tmp_path / "runs"),
        run_name="nothing",
        registry=registry,
        server={"model": "tiny"},
        data={"source": "new_tasks"},
        evaluation={"eval_size": 3},
    )
    assert summary["skipped"] is True
    assert "no new tasks" in summary["reason"] and "nothing trained" in summary["reason"]
    assert not (tmp_path / "runs" / "nothing").exists()
    assert MlflowClient(registry.tracking_uri).search_registered_models() == []


def test_a_changed_benchmark_stops_a_pinned_run_before_it_trains(prefect_harness, tmp_path):
    with pytest.raises(InvalidInput, match="pins benchmark_id=0123456789abcdef"):
        train(
            **AGENT,
            run_dir=str(tmp_path / "runs"),
            run_name="pinned",
            registry=RegistryConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"),
            server={"model": "tiny"},
            data={"source": "new_tasks"},
            evaluation={"eval_size": 3, "benchmark_id": "0123456789abcdef"},
        )
    assert not (tmp_path / "runs" / "pinned").exists()


def test_production_without_a_registered_policy_says_what_to_do(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "lightning_rl.flows.cli", "production", *_agent_flags(),
         "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--registered-model", "none-yet",
         "--db", str(tmp_path / "prod.duckdb")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "has no version 'champion'" in done.stderr and "Traceback" not in done.stderr


def _agent_flags() -> list[str]:
    return ["--agent", AGENT["agent"], "--tasks", AGENT["tasks"]]
