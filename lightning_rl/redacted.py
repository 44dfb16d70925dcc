"""`flow`: Prefect's decorator, but the parameters Prefect records hold no secrets.

Prefect stores a flow run's parameters (the UI shows them, the API serves them to anyone who
can read runs), and this project's flows take URLs that can carry a password
(`registry.tracking_uri`, `vllm_url`). Prefect serializes the parameters only for that record;
the flow's body still gets the values it was called with. So the record is redacted
(lightning_core.security.redaction) and the run keeps its credentials.

A deployment run is the exception: Prefect hands its body the recorded parameters, so a
deployment gives credentials through the environment (MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD for an MLflow server), not inside a URL parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect.flows import Flow

from lightning_core.security.redaction import redact_values


class RedactedFlow(Flow):
    """A Prefect flow whose recorded parameters have the secrets inside URLs as '***'."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return redact_values(super().serialize_parameters(parameters))


def flow(**options: Any) -> Callable[[Callable[..., Any]], RedactedFlow]:
    """`@flow(name=..., ...)` as Prefect's, making a RedactedFlow."""
    return lambda fn: RedactedFlow(fn, **options)
