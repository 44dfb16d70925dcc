"""What the live gate and a rollback do to the registry: the second gate's decision on a canary
(promote the challenger, or end the canary) and the return of the previous champion.

Each is one step under the promotion lock, recorded on the version's tags with its reason and
emitted as a Prefect event (events.py), like a promotion. The decisions themselves are pure
functions of feedback (lightning_core/stats/sequential.py); this module only writes them.
"""

from __future__ import annotations

import logging
import time

from mlflow import MlflowClient

from lightning_core.errors import Conflict, NotFound
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import mlflow_client, reachable
from lightning_rl.registry.events import CANARY_ENDED_EVENT, ROLLED_BACK_EVENT, emit_registry_event
from lightning_rl.registry.history import champion_history, write_history
from lightning_rl.registry.names import (
    CANARY,
    CHALLENGER,
    CHAMPION,
    PROMOTED,
    REJECTED,
    TAG_DECISION,
    TAG_LIVE_DECISION,
    TAG_LIVE_REASON,
    TAG_ROLLBACK_REASON,
)
from lightning_rl.registry.promotion import recorded_decision
from lightning_rl.registry.versions import move_champion, registry_lock, version_by_alias

logger = logging.getLogger(__name__)


def _version(client: MlflowClient, name: str, alias: str) -> str | None:
    found = version_by_alias(client, name, alias)
    return None if found is None else str(found.version)


def aliases(config: RegistryConfig) -> dict[str, str | None]:
    """Where `champion` and `challenger` point now (version numbers; None: nowhere), and
    whether the challenger awaits the live gate (`canary`: its version, else None)."""
    client = mlflow_client(config)
    name = config.registered_model
    with reachable(client.tracking_uri, f"reading the aliases of {name}"):
        champion, challenger = _version(client, name, CHAMPION), _version(client, name, CHALLENGER)
        canary = None
        if challenger is not None and challenger != champion:
            tags = client.get_model_version(name, challenger).tags
            if tags.get(TAG_DECISION) == CANARY:
                canary = challenger
    return {CHAMPION: champion, CHALLENGER: challenger, "canary": canary}


def warm_start_alias(config: RegistryConfig, warm_start: str) -> str:
    """The alias a run with `warm_start` (champion or challenger) continues: the challenger
    while its canary awaits the live gate, else the champion."""
    if warm_start == "challenger" and aliases(config)["canary"] is not None:
        return CHALLENGER
    return CHAMPION


def decide_canary(config: RegistryConfig, version: str, promote: bool, reason: str) -> bool:
    """The live gate's decision on version `version` in canary: promote it to champion, or end
    the canary (its `challenger` alias removed, the champion kept). False when the registry
    moved on meanwhile (the challenger is another version now, or no longer awaits the gate)."""
    client = mlflow_client(config)
    name = config.registered_model
    where = f"deciding the canary of {name} v{version}"
    with reachable(client.tracking_uri, where), registry_lock(client, config):
        if _version(client, name, CHALLENGER) != version:
            return False
        tags = client.get_model_version(name, version).tags
        recorded = recorded_decision(version, tags)
        if recorded is None or not recorded.canary:
            return False
        client.set_model_version_tag(name, version, TAG_LIVE_REASON, reason)
        if promote:
            client.set_model_version_tag(name, version, TAG_LIVE_DECISION, PROMOTED)
            client.set_model_version_tag(name, version, TAG_DECISION, PROMOTED)
            champion = _version(client, name, CHAMPION)
            decision = recorded.model_copy(
                update={
                    "promote": True,
                    "canary": False,
                    "reason": f"live gate: {reason}",
                    "champion_version": champion,
                }
            )
            move_champion(client, name, decision)
        else:
            client.set_model_version_tag(name, version, TAG_LIVE_DECISION, REJECTED)
            client.set_model_version_tag(name, version, TAG_DECISION, REJECTED)
            client.delete_registered_model_alias(name, CHALLENGER)
            emit_registry_event(
                CANARY_ENDED_EVENT, name, version, {"reason": reason, "promote": False}
            )
    logger.info(
        "%s v%s: live gate %s (%s)", name, version, "promoted" if promote else "ended", reason
    )
    return True


def rollback(config: RegistryConfig, reason: str, expected: str | None = None) -> tuple[str, str]:
    """Move `champion` back to the previous champion, in one step: (from, to) versions.

    `expected`: roll back only if that version is still champion (Conflict otherwise), so an
    automatic rollback decided on old feedback never undoes a newer promotion. The rolled-back
    version's tags and a Prefect event say why; the history loses its last entry, so a second
    rollback goes one further back.
    """
    if not reason.strip():
        raise Conflict("a rollback needs a reason (it is recorded on the version)")
    client = mlflow_client(config)
    name = config.registered_model
    with reachable(client.tracking_uri, f"rolling back {name}"), registry_lock(client, config):
        current = _version(client, name, CHAMPION)
        if current is None:
            raise NotFound(f"registered model {name!r} has no champion to roll back")
        if expected is not None and current != expected:
            raise Conflict(f"{name}'s champion is v{current} now, not v{expected}: not rolled back")
        history = champion_history(client, name)
        while history and history[-1] == current:
            history.pop()
        if not history:
            raise NotFound(
                f"{name} v{current} is the first champion: there is none before it to return to"
            )
        previous = history.pop()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        client.set_model_version_tag(name, current, TAG_ROLLBACK_REASON, f"{stamp} {reason}")
        write_history(client, name, history)
        client.set_registered_model_alias(name, CHAMPION, previous)
        emit_registry_event(
            ROLLED_BACK_EVENT,
            name,
            previous,
            {"from_version": current, "to_version": previous, "reason": reason},
        )
    logger.warning("%s: champion rolled back from v%s to v%s (%s)", name, current, previous, reason)
    return current, previous
