"""`lightning-rl registry rollback`: the champion moved back to the previous one, in one step,
recorded with its reason (registry/live.py); a running `lightning-rl production` follows."""

from __future__ import annotations

from typing import Annotated

import typer

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.app import app, fail
from lightning_rl.flows.cli.common import agents_from_cwd

registry_app = typer.Typer(
    help="The registered model's aliases: roll the champion back.", no_args_is_help=True
)
app.add_typer(registry_app, name="registry")


@registry_app.command("rollback")
def rollback(
    reason: Annotated[str, typer.Option(help="Why (recorded on the version and the event).")],
    agent: Annotated[str, typer.Option(help="Agent profile (calc) or 'module:function'.")] = "calc",
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI.")] = None,
    registered_model: Annotated[
        str | None, typer.Option(help="Registered model (default: the agent profile's).")
    ] = None,
    expected: Annotated[
        str | None,
        typer.Option(help="Roll back only if this version is still champion (a number)."),
    ] = None,
) -> None:
    """Move `champion` back to the version that was champion before it.

    The version rolled back gets a `rollback.reason` tag, a `lightning.model.rolled-back`
    Prefect event is emitted, and the registered model's champion history loses its last
    entry, so a second rollback goes one further back.
    """
    from lightning_rl.flows.profiles import profile
    from lightning_rl.registry.config import RegistryConfig, resolve
    from lightning_rl.registry.live import rollback as roll_back

    agents_from_cwd()
    try:
        spec = profile(agent, None)
        overrides = {"tracking_uri": tracking_uri, "registered_model": registered_model or ""}
        config = resolve(RegistryConfig(**overrides), spec.registered_model)
        before, after = roll_back(config, reason, expected=expected)
    except LightningError as exc:
        fail(exc)
    typer.echo(f"{config.registered_model}: champion rolled back from v{before} to v{after}")
