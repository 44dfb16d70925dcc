"""The champions a registered model had, newest last: what a rollback returns to.

MLflow keeps no history of an alias, so each move of `champion` appends the version it leaves
to a tag of the registered model (TAG_CHAMPION_HISTORY, bounded); a rollback takes the last one
back. Written under the promotion lock by whatever moves the champion.
"""

from __future__ import annotations

import json

from mlflow import MlflowClient

from lightning_rl.registry.names import CHAMPION_HISTORY_LENGTH, TAG_CHAMPION_HISTORY


def champion_history(client: MlflowClient, name: str) -> list[str]:
    """The earlier champions of `name`, oldest first; [] when none (or the tag is not ours)."""
    raw = client.get_registered_model(name).tags.get(TAG_CHAMPION_HISTORY)
    try:
        history = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return []
    if not isinstance(history, list):
        return []
    return [str(v) for v in history if isinstance(v, str | int) and str(v).isdigit()]


def write_history(client: MlflowClient, name: str, history: list[str]) -> None:
    kept = history[-CHAMPION_HISTORY_LENGTH:]
    client.set_registered_model_tag(name, TAG_CHAMPION_HISTORY, json.dumps(kept))


def push_champion(client: MlflowClient, name: str, leaving: str | None) -> None:
    """Note that `leaving` (None: there was no champion) stops being champion."""
    if leaving is not None:
        write_history(client, name, [*champion_history(client, name), leaving])
