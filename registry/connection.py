"""Which MLflow: the tracking URI a config resolves to, a client on it, and its experiment;
and a tracking server that cannot be reached, told apart from MLflow's other errors.

The client also sets the process's tracking and registry URIs, because MLflow's fluent calls
(start_run, Model.log, register_model) read those rather than take a client.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import mlflow
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from lightning_core.errors import LightningError
from lightning_core.security.redaction import redact
from lightning_rl.registry.config import DEFAULT_TRACKING_URI, RegistryConfig


class RegistryUnavailable(LightningError):
    """The MLflow tracking server cannot be reached (down, or refusing connections)."""

    status_code = 503


def tracking_uri(config: RegistryConfig) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else a SQLite file here; made absolute."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    # A relative SQLite path would follow the working directory; pin it where it was first meant.
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return uri


def mlflow_client(config: RegistryConfig) -> MlflowClient:
    """A client on the configured URI, which also becomes the process's for fluent calls."""
    uri = tracking_uri(config)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(uri, registry_uri=uri)


def _artifact_location(config: RegistryConfig, uri: str) -> str | None:
    location = config.artifact_location
    if location is None and uri.startswith("sqlite:///"):
        location = str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")
    if location is None or "://" in location:
        return location
    return Path(location).resolve().as_uri()


def experiment_id(client: MlflowClient, config: RegistryConfig) -> str:
    """The id of the configured experiment, created (with its artifact location) if new."""
    experiment = client.get_experiment_by_name(config.experiment)
    if experiment is not None:
        return experiment.experiment_id
    location = _artifact_location(config, client.tracking_uri)
    try:
        return client.create_experiment(config.experiment, artifact_location=location)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        # Another run created it between the lookup and the create.
        return client.get_experiment_by_name(config.experiment).experiment_id


def filter_literal(value: str) -> str | None:
    """`value` quoted for an MLflow filter string; None when it holds both quote characters,
    which MLflow's filters cannot write (they have no escapes): match it in Python instead."""
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    return None


def _unreachable(error: BaseException) -> bool:
    # MLflow's REST client wraps what `requests` raised, after its own retries, in a plain
    # MlflowException without `from`: the cause is in the context chain.
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(
            seen,
            requests.exceptions.ConnectionError
            | requests.exceptions.Timeout
            | requests.exceptions.RetryError,
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def reachable(uri: str, doing: str) -> Iterator[None]:
    """Turn a tracking server that cannot be reached, while `doing` (what, in words), into
    RegistryUnavailable with what to do about it; other errors pass unchanged."""
    try:
        yield
    except (MlflowException, requests.exceptions.RequestException) as e:
        if not _unreachable(e):
            raise
        raise RegistryUnavailable(
            f"the MLflow tracking server at {redact(uri)} cannot be reached while {doing}: "
            f"{redact(str(e).splitlines()[0])[:300]}. Start it (or point registry.tracking_uri, or "
            "MLFLOW_TRACKING_URI, at a running one); doing it again then finishes what was "
            "cut short, without a second version"
        ) from e
