"""What a training run records in MLflow once, when its MLflow run is new: its settings as
params, the data it trains on and the benchmark it is judged on as input datasets, and the
data plan's tags (what a later recurring run reads on from).

Once only: MLflow refuses a param whose value changes, and a resumed run may have been given
more iterations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.datasets import log_dataset
from lightning_rl.registry.runs import log_params, set_run_tags


@dataclass(frozen=True)
class RunDataset:
    """Rows a run used, with the identity MLflow shows for them."""

    rows: Sequence[dict[str, Any]]
    name: str
    dataset_id: str
    content_hash: str
    # Where the rows came from: a folder, a URL, or words.
    source: str


def log_run_start(
    config: RegistryConfig,
    run_id: str,
    params: Mapping[str, Any],
    training: RunDataset,
    benchmark: RunDataset,
    tags: Mapping[str, str],
) -> None:
    """Record a new run's params, its training data and benchmark, and its data tags."""
    log_params({**params, "registered_model": config.registered_model}, run_id=run_id)
    for dataset, context in ((training, "training"), (benchmark, "evaluation")):
        log_dataset(
            dataset.rows,
            name=dataset.name,
            dataset_id=dataset.dataset_id,
            content_hash=dataset.content_hash,
            context=context,
            source=dataset.source,
            run_id=run_id,
            config=config,
        )
    set_run_tags(dict(tags), run_id=run_id)
