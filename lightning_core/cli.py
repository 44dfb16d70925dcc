"""The `lightning-rl` command line."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lightning_core.errors import LightningError

app = typer.Typer(
    name="lightning-rl",
    help="Reinforcement learning for any LLM agent: store, gateway, training pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _fail(exc: Exception) -> None:
    """Print a user error as one line, without a traceback, and exit non-zero."""
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.callback()
def _root() -> None:
    """Reinforcement learning for any LLM agent: store, gateway, training pipeline."""


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 4747).")] = None,
    db: Annotated[
        str | None, typer.Option(help="DuckDB file of the store (default lightning.duckdb).")
    ] = None,
    max_request_bytes: Annotated[
        int | None, typer.Option(help="Largest request body accepted (default 64 MiB).")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="uvicorn log level.")] = None,
) -> None:
    """Serve the store's HTTP API (and OTLP traces endpoint) on a DuckDB file.

    Set LIGHTNING_API_KEY to require 'Authorization: Bearer <key>'; it is required when --host is
    not a loopback address. Every option can also be set as LIGHTNING_<OPTION>.
    """
    import uvicorn
    from pydantic import ValidationError

    from lightning_core.settings import ServeSettings
    from lightning_core.store.duckdb_store import DuckDBStore
    from lightning_core.store.server import create_app

    flags = {
        "host": host,
        "port": port,
        "db": db,
        "max_request_bytes": max_request_bytes,
        "log_level": log_level,
    }
    try:
        settings = ServeSettings(**{k: v for k, v in flags.items() if v is not None})
        settings.check_exposure()
        store = DuckDBStore(settings.store_config())
    except ValidationError as exc:
        _fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        _fail(exc)
    # The store's writer thread hands the GIL to DuckDB and must win it back from the event loop
    # several times per commit; a 0.5 ms switch interval (default 5 ms) keeps commits short.
    sys.setswitchinterval(0.0005)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    server_app = create_app(store, api_key=key, max_request_bytes=settings.max_request_bytes)
    typer.echo(
        f"lightning-rl store on http://{settings.host}:{settings.port} (db: {settings.db}, "
        f"auth: {'bearer key' if key else 'none, loopback only'})",
        err=True,
    )
    try:
        uvicorn.run(
            server_app, host=settings.host, port=settings.port, log_level=settings.log_level
        )
    except OSError as exc:
        _fail(LightningError(f"cannot listen on {settings.host}:{settings.port}: {exc}"))


@app.command()
def status(
    server: Annotated[
        str, typer.Option(help="Root URL of a running `lightning-rl serve`.")
    ] = "http://127.0.0.1:4747",
) -> None:
    """Count a store's rollouts by status (API key from LIGHTNING_API_KEY)."""
    import asyncio
    from collections import Counter

    from lightning_core.store.client import HttpStoreClient

    async def count() -> Counter[str]:
        client = HttpStoreClient(server)
        try:
            return Counter(r.status.value for r in await client.query_rollouts())
        finally:
            await client.close()

    try:
        counts = asyncio.run(count())
    except LightningError as exc:
        _fail(exc)
    typer.echo(f"{'status':<12} rollouts")
    for name, n in sorted(counts.items()):
        typer.echo(f"{name:<12} {n}")
    typer.echo(f"{'total':<12} {sum(counts.values())}")


def main() -> None:
    try:
        app()
    except LightningError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
