"""The data a run trained and was judged on, recorded in MLflow; and what the previous run read.

`log_dataset` attaches rows to a run as an MLflow input dataset (the runs table's Datasets
column, the run page's inputs), named and with the rows' content hash as its digest, and sets
run tags `data.<context>.dataset_id|rows|hash` that searches and other runs can read.
`previous_run_tag` finds what the last finished run of an agent recorded (its watermark), so a
scheduled run trains on what came after it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.data import from_pandas
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.http_dataset_source import HTTPDatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from lightning_core.errors import InvalidInput
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import filter_literal, mlflow_client, reachable

# MLflow keeps a dataset's digest in a 36-character column; the first 12 hex of the sha256 are
# also the suffix of a dataset id (`table@<12 hex>`), so the UI's digest reads as that id's.
_DIGEST_CHARS = 12
# What mlflow.entities.Dataset takes of a dataset's to_dict().
_DATASET_FIELDS = ("name", "digest", "source_type", "source", "schema", "profile")
# Finished runs fetched per search page while looking for the newest with the wanted tag.
_PAGE = 100


def log_dataset(
    rows: Sequence[dict[str, Any]],
    *,
    name: str,
    dataset_id: str,
    content_hash: str,
    context: str,
    source: str,
    run_id: str,
    config: RegistryConfig,
) -> None:
    """Record `rows` as an input dataset of the run `run_id` (no active run needed).

    `name` is the dataset's name in MLflow (the same for every version of one table),
    `dataset_id` and `content_hash` its identity, `context` what the run used it for
    ("training", "evaluation"), `source` where the rows came from: a folder, a URL, or words.
    Logging the same dataset again on the same run (a resumed run) adds nothing.
    """
    if not content_hash:
        raise InvalidInput(f"dataset {name!r} needs a content hash")
    if not context:
        raise InvalidInput(f"dataset {name!r} needs a context such as 'training'")
    client = mlflow_client(config)
    identity = {"dataset_id": dataset_id, "rows": str(len(rows)), "content_hash": content_hash}
    # The frame gives MLflow the rows' schema and profile (row count); the rows themselves stay
    # where they are.
    dataset = from_pandas(
        pd.DataFrame.from_records(list(rows)),
        source=_source(source),
        name=name,
        digest=content_hash[:_DIGEST_CHARS],
    )
    with warnings.catch_warnings():
        # Inferring the schema warns that integer columns cannot hold missing values: advice
        # for model signatures, not for a record of what a run read.
        warnings.simplefilter("ignore", UserWarning)
        described = dataset.to_dict()
    entity = Dataset(**{k: v for k, v in described.items() if k in _DATASET_FIELDS})
    tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)]
    tags += [InputTag(key=key, value=value) for key, value in identity.items()]
    with reachable(client.tracking_uri, f"logging dataset {dataset_id} on run {run_id}"):
        client.log_inputs(run_id, datasets=[DatasetInput(dataset=entity, tags=tags)])
        client.log_batch(
            run_id,
            tags=[
                RunTag(f"data.{context}.dataset_id", dataset_id),
                RunTag(f"data.{context}.rows", str(len(rows))),
                RunTag(f"data.{context}.hash", content_hash),
            ],
        )


def _source(source: str) -> DatasetSource:
    """MLflow's kind of source for `source`: a URL, a local path, else words (code)."""
    if source.startswith(("http://", "https://")):
        return HTTPDatasetSource(source)
    if source and "://" not in source and Path(source).exists():
        uri = Path(source).resolve().as_uri()
        # MLflow warns that a file URI matches two of its source kinds (both local files).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                return resolve_dataset_source(uri)
            except MlflowException:
                pass
    return CodeDatasetSource(tags={"source": source})


def previous_run_tag(config: RegistryConfig, agent: str, key: str) -> tuple[str, str] | None:
    """(run id, value) of tag `key` on the newest FINISHED run of the experiment tagged
    `agent=<agent>` and `data.complete=true` that has that tag; None when there is none.

    Newest by start time: a run's watermark was taken when it started, so the run that started
    last read the most, even if an earlier one finished after it.
    """
    client = mlflow_client(config)
    with reachable(client.tracking_uri, f"looking up the previous run of agent {agent!r}"):
        experiment = client.get_experiment_by_name(config.experiment)
        if experiment is None:
            return None
        conditions = ["attributes.status = 'FINISHED'", "tags.`data.complete` = 'true'"]
        quoted = filter_literal(agent)
        if quoted is not None:
            conditions.append(f"tags.agent = {quoted}")
        token = None
        while True:
            page = client.search_runs(
                [experiment.experiment_id],
                filter_string=" and ".join(conditions),
                order_by=["attributes.start_time DESC", "attributes.end_time DESC"],
                max_results=_PAGE,
                page_token=token,
            )
            for run in page:
                # The tag's presence and an agent name no filter can quote are checked here.
                tags = run.data.tags
                if tags.get("agent") == agent and key in tags:
                    return run.info.run_id, tags[key]
            token = page.token
            if not token:
                return None
