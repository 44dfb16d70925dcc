"""Prefect task of the analytics stage: export an iteration's transitions, query them in DuckDB."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from lightning_core.data import analytics
from lightning_core.data.collect import Collected
from lightning_core.errors import DiskFull
from lightning_rl.retries import retry_unless


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    # NaN (no LLM call in the iteration) is not a metric value MLflow or a table can show.
    return {k: v for k, v in metrics.items() if not math.isnan(v)}


# Retries are safe: re-exporting an iteration replaces its file whole.
@task(
    name="analyze-iteration",
    retries=2,
    retry_delay_seconds=2,
    # A full disk stays full for the next try: fail at once with DiskFull's advice.
    retry_condition_fn=retry_unless(DiskFull),
    timeout_seconds=600,
    cache_policy=NO_CACHE,
)
def analyze_iteration(
    run_dir: str, iteration: int, collected: Collected, artifact_key: str | None = None
) -> dict[str, Any]:
    """Parquet export of the iteration, then its metrics and per-agent breakdown in SQL."""
    root = Path(run_dir)
    analytics.export_iteration(
        root, iteration, analytics.transition_rows(collected.transitions, collected.facts)
    )
    # In memory: the views read the Parquet files; no database file to lock or keep.
    con = analytics.connect(root, ":memory:")
    try:
        metrics = _finite(analytics.iteration_metrics(con, iteration))
        agents = analytics.agent_breakdown(con, iteration)
    finally:
        con.close()
    if artifact_key:
        rows = agents.astype(object).where(agents.notna(), None).to_dict("records")
        create_table_artifact(
            rows,
            key=artifact_key,
            description=f"Per-agent breakdown of iteration {iteration}",
        )
    return {"metrics": metrics, "agents": agents.to_dict("records")}
