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
    backend: Annotated[
        str | None,
        typer.Option(help="Policy backend: transformers, vllm or none (store only)."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Base model folder or hub id (default SmolLM2-135M-Instruct)."),
    ] = None,
    vllm_url: Annotated[
        str | None, typer.Option(help="With --backend vllm: attach to this server.")
    ] = None,
    vllm_python: Annotated[
        str | None, typer.Option(help="With --backend vllm: Python of a vLLM environment.")
    ] = None,
) -> None:
    """Serve the store's HTTP API, its OTLP traces endpoint and the OpenAI-compatible gateway.

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
        "backend": backend,
        "model": model,
        "vllm_url": vllm_url,
        "vllm_python": vllm_python,
    }
    try:
        settings = ServeSettings(**{k: v for k, v in flags.items() if v is not None})
        settings.check_exposure()
        store = DuckDBStore(settings.store_config())
        gateway = _gateway(settings, store)
    except ValidationError as exc:
        _fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        _fail(exc)
    # The store's writer thread hands the GIL to DuckDB and must win it back from the event loop
    # several times per commit; a 0.5 ms switch interval (default 5 ms) keeps commits short.
    sys.setswitchinterval(0.0005)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    server_app = create_app(
        store, api_key=key, max_request_bytes=settings.max_request_bytes, gateway=gateway
    )
    url = f"http://{settings.host}:{settings.port}"
    served = f"gateway {url}/v1 serving {gateway.backend.base_model}" if gateway else "no gateway"
    typer.echo(
        f"lightning-rl store on {url} (db: {settings.db}, auth: "
        f"{'bearer key' if key else 'none, loopback only'}); {served}",
        err=True,
    )
    try:
        uvicorn.run(
            server_app, host=settings.host, port=settings.port, log_level=settings.log_level
        )
    except OSError as exc:
        _fail(LightningError(f"cannot listen on {settings.host}:{settings.port}: {exc}"))


def _gateway(settings, store):
    from lightning_core.backends import create_backend
    from lightning_core.gateway.service import Gateway, GatewayConfig

    try:
        backend = create_backend(
            settings.backend, settings.model, settings.vllm_url, settings.vllm_python
        )
    except OSError as exc:  # transformers' word for "no such folder, and the hub is unreachable"
        raise LightningError(f"cannot load model {settings.model!r}: {exc}") from exc
    if backend is None:
        return None
    return Gateway(backend, store, GatewayConfig(default_max_tokens=settings.default_max_tokens))


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
