"""MLflow tracking of flow runs: one MLflow run per flow run, holding the flow's params and its
metrics against `step=iteration`, and files attached to it (reward curves, reports)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from pydantic import BaseModel

from lightning_core.security.redaction import MASK, is_secret_name, redact
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import experiment_id, mlflow_client

# MLflow refuses longer param values; a param is for reading in the UI, not for a whole config.
_MAX_PARAM_CHARS = 6000


def _prefect_tags() -> dict[str, str]:
    """Links the MLflow run to the Prefect flow run it belongs to, when there is one."""
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return {}
    return {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)}


@contextlib.contextmanager
def tracking(
    config: RegistryConfig,
    run_name: str | None = None,
    tags: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> Iterator[mlflow.ActiveRun]:
    """The MLflow run of one flow run: active inside the block, FAILED if the block raises.

    `run_id` resumes that run instead of starting one: a flow run resumed after a crash keeps
    its MLflow run, so that its metrics continue there and registering its adapter again finds
    the version it registered before (register_policy_version is idempotent per run).
    """
    client = mlflow_client(config)
    experiment = experiment_id(client, config)
    run_tags = {**_prefect_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
    with mlflow.start_run(
        run_id=run_id, experiment_id=experiment, run_name=run_name, tags=run_tags
    ) as run:
        yield run


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            # A URL's password (tracking_uri, vllm_url), or a credential by its name (a backend
            # option's api_key, which no SecretStr types), is no param for every reader to see.
            secret = is_secret_name(str(key)) and value not in (None, "")
            flat[name] = MASK if secret else redact(str(value))[:_MAX_PARAM_CHARS]
    return flat


def log_params(params: Mapping[str, Any], run_id: str | None = None) -> dict[str, str]:
    """Log params, nested dicts and pydantic models flattened to dotted keys (`trainer.lora.rank`).

    `run_id` None is this thread's active run; pass the run's id from tasks run in other threads.
    Secrets inside URLs, and the values of settings named as secrets (`api_key`), are logged
    as '***' (lightning_core.security.redaction).
    Returns what was logged.
    """
    flat = _flatten(params)
    mlflow.log_params(flat, run_id=run_id)
    return flat


def log_metrics(metrics: Mapping[str, float | None], step: int, run_id: str | None = None) -> None:
    """Log namespaced metrics (`train/loss`, `eval/score`) at `step`, the iteration; skip None."""
    values = {key: float(value) for key, value in metrics.items() if value is not None}
    if values:
        mlflow.log_metrics(values, step=step, run_id=run_id)


def log_metrics_once(
    metrics: Mapping[str, float | None], step: int, run_id: str | None = None
) -> dict[str, float]:
    """log_metrics, less the metrics the run already has a value of at `step`: a flow run
    resumed after a crash repeats the steps it had not checkpointed, and each step's point
    must be in the run's history once. The first value stays. Returns what was logged."""
    if run_id is None:
        run_id = mlflow.active_run().info.run_id
    client = MlflowClient()
    # Only keys the run has any value of can have one at this step: one query, then a history
    # query per such key.
    known = client.get_run(run_id).data.metrics
    values = {
        key: float(value)
        for key, value in metrics.items()
        if value is not None
        and not (
            key in known and any(m.step == step for m in client.get_metric_history(run_id, key))
        )
    }
    if values:
        mlflow.log_metrics(values, step=step, run_id=run_id)
    return values


def set_run_tags(tags: Mapping[str, str], run_id: str) -> None:
    """Set tags on the run: facts about it that, unlike params, may change (a resumed run)."""
    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def log_artifact(path: str | Path, run_id: str, folder: str | None = None) -> None:
    """Attach a file (a reward curve, a report) to the run."""
    MlflowClient().log_artifact(run_id, str(path), artifact_path=folder)
