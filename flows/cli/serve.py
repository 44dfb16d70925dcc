"""`lightning-rl serve`: the store, its OTLP endpoint and the gateway in one server; and the
hidden `replica` command that `serve --replicas N` starts for each policy replica."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lightning_core.errors import InvalidInput, LightningError
from lightning_rl.flows.cli.app import app, fail


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
        str | None,
        typer.Option(
            help="With --backend vllm: attach to this server (with --replicas, to these, "
            "comma-separated)."
        ),
    ] = None,
    vllm_python: Annotated[
        str | None, typer.Option(help="With --backend vllm: Python of a vLLM environment.")
    ] = None,
    tool_format: Annotated[
        str | None,
        typer.Option(help="Tools for templates without them: auto, hermes or line."),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Backend processes serving the policy (default 1); each call goes to the "
            "least-loaded one, a rollout's calls stay on one."
        ),
    ] = None,
    backend_options: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="More settings of the backend, its config's fields as a JSON object, e.g. "
            '\'{"max_batch_size": 16, "dtype": "bfloat16"}\' (transformers) or '
            "'{\"max_model_len\": 4096}' (vllm).",
        ),
    ] = None,
) -> None:
    """Serve the store's HTTP API, its OTLP traces endpoint and the OpenAI-compatible gateway.

    Set LIGHTNING_API_KEY to require 'Authorization: Bearer <key>'; it is required when --host is
    not a loopback address. Every option can also be set as LIGHTNING_<OPTION>, and so can the
    store's and the gateway's other settings (LIGHTNING_ATTEMPT_TIMEOUT_S,
    LIGHTNING_DEFAULT_MAX_TOKENS, ...).
    """
    import json

    from pydantic import ValidationError

    from lightning_core.app import create_app
    from lightning_core.serving import process as serving
    from lightning_core.serving.http_edge import SERVER_KEEPALIVE_S, run_server
    from lightning_core.settings import ServeSettings
    from lightning_core.store.duckdb_store import DuckDBStore

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
        "tool_format": tool_format,
        "replicas": replicas,
    }
    try:
        if backend_options is not None:
            try:
                flags["backend_options"] = json.loads(backend_options)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"--backend-options takes a JSON object: {exc}") from exc
        settings = ServeSettings(**{k: v for k, v in flags.items() if v is not None})
        settings.check_exposure()
        # Before the store's, the backend's and uvicorn's threads first allocate.
        serving.limit_malloc_arenas(settings.malloc_arenas)
        store = DuckDBStore(settings.store_config())
        gateway = _gateway(settings, store)
    except ValidationError as exc:
        fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        fail(exc)
    # The store's writer thread hands the GIL to DuckDB and must win it back from the event loop
    # several times per commit; a 0.5 ms switch interval (default 5 ms) keeps commits short.
    sys.setswitchinterval(0.0005)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    server_app = create_app(
        store,
        api_key=key,
        max_request_bytes=settings.max_request_bytes,
        gateway=gateway,
        limits=settings.http_limits(),
    )
    url = f"http://{settings.host}:{settings.port}"
    served = f"gateway {url}/v1 serving {gateway.backend.base_model}" if gateway else "no gateway"
    if gateway is not None and settings.replicas > 1:
        served += f" from {settings.replicas} replicas"
    typer.echo(
        f"lightning-rl store on {url} (db: {settings.db}, auth: "
        f"{'bearer key' if key else 'none, loopback only'}); {served}",
        err=True,
    )
    try:
        run_server(
            server_app,
            settings.host,
            settings.port,
            settings.log_level,
            keepalive_s=SERVER_KEEPALIVE_S,
            limits=settings.http_limits(),
        )
    except OSError as exc:
        fail(LightningError(f"cannot listen on {settings.host}:{settings.port}: {exc}"))


def _gateway(settings, store):
    from lightning_core.backends import create_backend
    from lightning_core.gateway.service import Gateway

    try:
        backend = create_backend(
            settings.backend,
            settings.model,
            settings.vllm_url,
            settings.vllm_python,
            options=settings.backend_options,
            replicas=settings.replicas,
        )
    except OSError as exc:  # transformers' word for "no such folder, and the hub is unreachable"
        raise LightningError(f"cannot load model {settings.model!r}: {exc}") from exc
    if backend is None:
        return None
    return Gateway(backend, store, settings.gateway_config())


@app.command(hidden=True)
def replica(
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1.")],
    model: Annotated[str | None, typer.Option(help="Base model folder or hub id.")] = None,
    backend_options: Annotated[
        str, typer.Option(metavar="JSON", help="TransformersBackendConfig fields.")
    ] = "{}",
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """One policy replica of `serve --replicas N`, which starts it: the backend alone, over HTTP
    on loopback, with the key from LIGHTNING_REPLICA_KEY (backends/remote_server.py)."""
    import json

    from lightning_core.backends.remote_server import serve_replica

    try:
        serve_replica(model, port, json.loads(backend_options), log_level)
    except LightningError as exc:
        fail(exc)
