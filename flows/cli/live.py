"""`lightning-rl production`'s live side: the server as a child process, and beside it the alias
follower (registry/follower.py) and its reload webhook (registry/webhook.py), for as long as the
server runs. SIGINT and SIGTERM stop the server cleanly; the command exits with its code."""

from __future__ import annotations

import logging
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import typer

from lightning_core.errors import LightningError
from lightning_core.serving.process import die_with_parent, stop_serve, wait_healthy
from lightning_rl.registry.alias_webhook import (
    delivers_webhooks,
    register_alias_webhook,
    remove_alias_webhook,
)
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.follower import AliasFollower
from lightning_rl.registry.live_config import LiveConfig
from lightning_rl.registry.webhook import MLFLOW_PATH, ReloadHook

# The base model loads in seconds; a busy machine (or the first download) takes minutes.
_START_TIMEOUT_S = 600.0


def run_following(
    command: list[str],
    env: dict[str, str],
    *,
    server_url: str,
    key: str,
    registry: RegistryConfig,
    live: LiveConfig,
    adapters: Path,
    base_model: str,
    bind_host: str,
) -> int:
    """Run the server `command` and follow the registry for it until it exits; its code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    proc = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
    # The server shuts down cleanly on SIGINT; SIGTERM (a service manager) does the same here.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.poll() is None and proc.send_signal(signal.SIGINT))
    follower = hook = webhook_id = None
    try:
        where = urlsplit(server_url)
        wait_healthy(
            proc,
            where.port,
            _START_TIMEOUT_S,
            "the production server",
            LightningError,
            where.hostname,
        )
        follower = AliasFollower(registry, live, server_url, key, adapters, base_model)
        follower.follow()  # serving what the aliases say before any look of the loop
        if live.webhook_port is not None:
            secret = (
                live.webhook_secret.get_secret_value()
                if live.webhook_secret
                else secrets.token_urlsafe(32)
            )
            hook = ReloadHook(
                bind_host, live.webhook_port, secret, registry.registered_model, follower.nudge
            ).start()
            url = live.webhook_url or f"{hook.url}{MLFLOW_PATH}"
            typer.echo(
                f"reload webhook on {hook.url} (POST {MLFLOW_PATH}, /hooks/reload)", err=True
            )
            if delivers_webhooks(registry):
                webhook_id = register_alias_webhook(registry, url, secret)
        follower.start()
        return proc.wait()
    except LightningError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        return 2
    finally:
        if follower is not None:
            follower.close()
        if hook is not None:
            hook.close()
        if webhook_id is not None:
            remove_alias_webhook(registry, webhook_id)
        stop_serve(proc)
        sys.stdout.flush()
