"""Where MLflow tracks runs and models, and the gate a new model version must pass.

Plain pydantic, without MLflow: flow configs import it, and a config is read and validated
before anything talks to a tracking server.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


class RegistryConfig(BaseModel):
    """Where runs and models are tracked, and the gate a new version must pass to be champion."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking (and registry) URI: sqlite:///path.db, http://host:5000, ...; "
        f"None: $MLFLOW_TRACKING_URI, else {DEFAULT_TRACKING_URI} in the working directory.",
    )
    artifact_location: str | None = Field(
        None,
        description="Where a new experiment stores artifacts (folder or URI); None: an "
        "`mlartifacts` folder beside a SQLite database, or the tracking server's default. "
        "An existing experiment keeps its own.",
    )
    experiment: str = Field("lightning-rl", description="MLflow experiment of the runs.")
    registered_model: str = Field(
        "lightning-policy", description="Registered model whose versions are the trained adapters."
    )
    promotion_margin: float = Field(
        0.02,
        ge=0,
        description="Held-out score a version must gain over the champion to replace it; above "
        "the benchmark's noise, so that equal policies do not swap places.",
    )
    promotion_threshold: float = Field(
        0.0,
        description="Score the first version needs to become champion when there is none; set "
        "it to the base model's score so that only an adapter that helps gets served.",
    )
    live_gate: bool = Field(
        False,
        description="A version past the offline gate becomes champion only through a canary "
        "on live traffic (`lightning-rl production` runs the live gate); False: at once.",
    )
    lock_ttl_s: float = Field(
        300.0,
        gt=0,
        description="Seconds a promotion may hold the registry's promotion lock before others "
        "take it over as abandoned (its holder crashed); far above a promotion's few seconds. "
        "Machines sharing the tracking server must agree on the time to well within it.",
    )
    lock_wait_s: float = Field(
        600.0,
        ge=0,
        description="Seconds a promotion waits for the promotion lock (another promotion of "
        "the same registered model) before it fails, to be retried.",
    )


def resolve(config: RegistryConfig | None, registered_model: str) -> RegistryConfig:
    """`config` (None: the defaults) with `registered_model` filled in where it names none:
    a flow's config leaves it empty ("") for the agent's own registered model."""
    config = config or RegistryConfig(registered_model="")
    if config.registered_model:
        return config
    return config.model_copy(update={"registered_model": registered_model})
