"""The Prefect event a promotion emits, for automations and deployments triggered on it."""

from __future__ import annotations

import logging

from lightning_rl.registry.promotion import PromotionDecision

logger = logging.getLogger(__name__)

PROMOTED_EVENT = "lightning.model.promoted"


def _should_emit_events() -> bool:
    # Outside a run and without a server, Prefect would start a local ephemeral server (seconds)
    # to store an event no automation is listening to.
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    return bool(FlowRunContext.get() or TaskRunContext.get() or PREFECT_API_URL.value())


def emit_promoted(name: str, decision: PromotionDecision) -> None:
    """Tell Prefect (automations, deployments triggered on it) that the champion changed.

    Best effort: the alias has already moved, and a lost event must not undo that.
    """
    try:
        if not _should_emit_events():
            return
        from prefect.events import emit_event

        emit_event(
            event=PROMOTED_EVENT,
            resource={
                "prefect.resource.id": f"mlflow.model.{name}.{decision.challenger_version}",
                "prefect.resource.name": f"{name} v{decision.challenger_version}",
                "mlflow.registered_model": name,
                "mlflow.model_version": str(decision.challenger_version),
            },
            payload=decision.model_dump(mode="json"),
        )
    except Exception:
        logger.warning("could not emit %s for %s", PROMOTED_EVENT, name, exc_info=True)
