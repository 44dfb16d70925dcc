"""registry/datasets.py against a real MLflow (SQLite): the data a run read shows as its input
datasets and tags, and the previous run's watermark is the newest finished run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_core.data.task_table import TaskTable
from lightning_core.errors import InvalidInput
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import experiment_id, mlflow_client
from lightning_rl.registry.datasets import log_dataset, previous_run_tag


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> Path:
    # One database for the module: MLflow's first connection runs its migrations (seconds).
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def config(database, monkeypatch, request) -> RegistryConfig:
    # mlflow_client sets MLFLOW_TRACKING_URI; monkeypatch removes it after the test.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    return RegistryConfig(tracking_uri=f"sqlite:///{database}", experiment=request.node.name)


def new_run(config: RegistryConfig, start: int = 0, **tags: str) -> str:
    client = mlflow_client(config)
    run = client.create_run(experiment_id(client, config), start_time=start, tags=tags)
    return run.info.run_id


def test_a_table_slice_shows_as_the_runs_input_dataset(config, tmp_path):
    table = TaskTable(tmp_path / "calc-tasks")
    table.append([{"id": "a", "question": "What is 2 + 3?", "answer": 5, "meta": {"k": 1}}])
    table.append([{"id": "b", "question": "What is 2 * 3?", "answer": 6, "meta": {"k": 2}}])
    data = table.snapshot()
    run_id = new_run(config, agent="calc")

    def log() -> None:
        log_dataset(
            data.tasks,
            name="calc-tasks",
            dataset_id=data.dataset_id,
            content_hash=data.content_hash,
            context="training",
            source=str(table.folder),
            run_id=run_id,
            config=config,
        )

    log()
    log()  # a resumed run logs it again: still one input
    run = MlflowClient(config.tracking_uri).get_run(run_id)
    assert run.info.status == "RUNNING"  # logged on the run as it is, none started
    [logged] = run.inputs.dataset_inputs
    assert logged.dataset.name == "calc-tasks"
    assert logged.dataset.digest == data.content_hash[:12] == data.dataset_id.split("@")[1]
    assert json.loads(logged.dataset.profile)["num_rows"] == 2
    assert json.loads(logged.dataset.source) == {"uri": table.folder.resolve().as_uri()}
    assert {t.key: t.value for t in logged.tags} == {
        "mlflow.data.context": "training",
        "dataset_id": data.dataset_id,
        "rows": "2",
        "content_hash": data.content_hash,
    }
    assert {k: v for k, v in run.data.tags.items() if k.startswith("data.")} == {
        "data.training.dataset_id": data.dataset_id,
        "data.training.rows": "2",
        "data.training.hash": data.content_hash,
    }


def test_datasets_from_a_server_or_from_code_and_each_context_apart(config):
    run_id = new_run(config)
    episodes = [{"episode_id": "e1", "reward": 1.0}]
    for rows, name, context, source in (
        (episodes, "calc-episodes", "training", "http://127.0.0.1:4747"),
        ([], "calc-heldout", "evaluation", "agent profile calc, test split"),
    ):
        log_dataset(
            rows,
            name=name,
            dataset_id=f"{name}@0123456789ab",
            content_hash="0123456789ab" + "0" * 52,
            context=context,
            source=source,
            run_id=run_id,
            config=config,
        )
    run = MlflowClient(config.tracking_uri).get_run(run_id)
    sources = {i.dataset.name: i.dataset.source_type for i in run.inputs.dataset_inputs}
    assert sources == {"calc-episodes": "http", "calc-heldout": "code"}
    assert run.data.tags["data.training.rows"] == "1"
    assert run.data.tags["data.evaluation.rows"] == "0"
    with pytest.raises(InvalidInput, match="content hash"):
        log_dataset(
            episodes,
            name="x",
            dataset_id="x@",
            content_hash="",
            context="training",
            source="s",
            run_id=run_id,
            config=config,
        )


def test_the_previous_run_is_the_newest_finished_complete_run_of_the_agent(config):
    assert previous_run_tag(config, "calc", "data.tasks.through") is None  # no experiment yet
    client = mlflow_client(config)
    complete = {"agent": "calc", "data.complete": "true"}

    def run(start: int, status: str | None, **tags: str) -> str:
        run_id = new_run(config, start=start, **tags)
        if status is not None:
            client.set_terminated(run_id, status)
        return run_id

    assert previous_run_tag(config, "calc", "data.tasks.through") is None  # no runs yet
    run(1, "FINISHED", **complete, **{"data.tasks.through": "f1"})
    second = run(2, "FINISHED", **complete, **{"data.tasks.through": "f2"})
    # Newer, but each disqualified: still running, failed, another agent, not complete, no tag.
    run(3, None, **complete, **{"data.tasks.through": "f3"})
    run(4, "FAILED", **complete, **{"data.tasks.through": "f4"})
    sql = run(5, "FINISHED", **{**complete, "agent": "sql"}, **{"data.tasks.through": "f5"})
    run(6, "FINISHED", agent="calc", **{"data.tasks.through": "f6"})
    run(7, "FINISHED", **{**complete, "data.complete": "false"}, **{"data.tasks.through": "f7"})
    run(8, "FINISHED", **complete, **{"data.feedback.through": "17"})
    assert previous_run_tag(config, "calc", "data.tasks.through") == (second, "f2")
    assert previous_run_tag(config, "calc", "data.feedback.through")[1] == "17"
    assert previous_run_tag(config, "sql", "data.tasks.through") == (sql, "f5")
    assert previous_run_tag(config, "rag", "data.tasks.through") is None


def test_an_agent_name_no_filter_can_quote_is_matched_exactly(config):
    odd = 'it\'s "odd"'
    found = new_run(config, start=1, agent=odd, **{"data.complete": "true", "k": "v"})
    MlflowClient(config.tracking_uri).set_terminated(found, "FINISHED")
    other = new_run(config, start=2, agent="calc", **{"data.complete": "true", "k": "w"})
    MlflowClient(config.tracking_uri).set_terminated(other, "FINISHED")
    assert previous_run_tag(config, odd, "k") == (found, "v")
