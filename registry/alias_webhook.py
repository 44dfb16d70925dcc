"""The MLflow webhook that tells a production server's alias follower when an alias moves:
registered on the tracking server for model-version-alias events (created, deleted) while the
server runs, removed when it stops. Only a tracking server delivers webhooks (a SQLite or file
registry has no events: the follower polls it)."""

from __future__ import annotations

import logging

from mlflow.entities.webhook import WebhookAction, WebhookEntity, WebhookEvent
from mlflow.exceptions import MlflowException

from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import mlflow_client

logger = logging.getLogger(__name__)


def delivers_webhooks(config: RegistryConfig) -> bool:
    """Whether the registry of `config` is a tracking server, which can call webhooks."""
    return mlflow_client(config).tracking_uri.startswith(("http://", "https://"))


def register_alias_webhook(config: RegistryConfig, url: str, secret: str) -> str | None:
    """Register `url` for alias events of the registered model's server; its id, or None when
    the server refuses it (say, it allows no http URLs or no private addresses: its
    MLFLOW_WEBHOOK_ALLOWED_SCHEMES and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS), in which case the
    follower polls."""
    client = mlflow_client(config)
    events = [
        WebhookEvent(WebhookEntity.MODEL_VERSION_ALIAS, action)
        for action in (WebhookAction.CREATED, WebhookAction.DELETED)
    ]
    try:
        hook = client.create_webhook(
            name=f"lightning-production-{config.registered_model}"[:60],
            url=url,
            events=events,
            description="lightning-rl production: follow the champion and challenger aliases",
            secret=secret,
        )
    except MlflowException as exc:
        logger.warning("MLflow refused the alias webhook (%s); polling only", exc.message)
        return None
    return hook.webhook_id


def remove_alias_webhook(config: RegistryConfig, webhook_id: str) -> None:
    try:
        mlflow_client(config).delete_webhook(webhook_id)
    except Exception:  # the server gone first: nothing to clean up there
        logger.warning("could not remove MLflow webhook %s", webhook_id, exc_info=True)
