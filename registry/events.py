"""The Prefect events the registry emits when what is served changes (a promotion, a canary
started by register-policy or ended by the live gate, a rollback), for automations and
deployments triggered on them: an automation that calls `lightning-rl production`'s reload
webhook makes it follow at once."""

from __future__ import annotations

import logging

from lightning_rl.registry.promotion import PromotionDecision

logger = logging.getLogger(__name__)

PROMOTED_EVENT = "lightning.model.promoted"
CANARY_STARTED_EVENT = "lightning.model.canary-started"
CANARY_ENDED_EVENT = "lightning.model.canary-ended"
ROLLED_BACK_EVENT = "lightning.model.rolled-back"


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


def emit_registry_event(event: str, name: str, version: str, payload: dict) -> None:
    """Emit `event` about version `version` of registered model `name`; best effort, as
    emit_promoted: the registry has changed already."""
    try:
        if not _should_emit_events():
            return
        from prefect.events import emit_event

        emit_event(
            event=event,
            resource={
                "prefect.resource.id": f"mlflow.model.{name}.{version}",
                "prefect.resource.name": f"{name} v{version}",
                "mlflow.registered_model": name,
                "mlflow.model_version": str(version),
            },
            payload=payload,
        )
    except Exception:
        logger.warning("could not emit %s for %s", event, name, exc_info=True)
