"""The `lightning-rl` command line."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lightning_core.errors import InvalidInput, LightningError

app = typer.Typer(
    name="lightning-rl",
    help="Reinforcement learning for any LLM agent: store, gateway, training pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


SERVER_KEEPALIVE_S = 30


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

    from lightning_core import serving
    from lightning_core.app import create_app
    from lightning_core.http_edge import run_server
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
        _fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        _fail(exc)
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
            # Longer than clients keep idle connections (15 s in HttpStoreClient), so that a
            # client never sends on a connection the server is closing.
            keepalive_s=SERVER_KEEPALIVE_S,
            limits=settings.http_limits(),
        )
    except OSError as exc:
        _fail(LightningError(f"cannot listen on {settings.host}:{settings.port}: {exc}"))


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
        _fail(exc)


@app.command()
def status(
    server: Annotated[
        str, typer.Option(help="Root URL of a running `lightning-rl serve`.")
    ] = "http://127.0.0.1:4747",
    api_key: Annotated[
        str | None, typer.Option(envvar="LIGHTNING_API_KEY", help="The server's API key.")
    ] = None,
) -> None:
    """Count a store's rollouts by status."""
    import asyncio
    from collections import Counter

    from lightning_core.store.client import HttpStoreClient

    async def count() -> Counter[str]:
        client = HttpStoreClient(server, api_key=api_key)
        try:
            await client.check()
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


@app.command()
def analyze(
    sql: Annotated[
        str,
        typer.Argument(
            help="SQL over the views transitions (one row per LLM call), episodes (one per "
            "rollout) and exported_rows (the Parquet files as written)."
        ),
    ],
    root: Annotated[
        str,
        typer.Option(
            envvar="LIGHTNING_RUN_DIR",
            help="Training run folder holding transitions/iteration=<k>/part-0.parquet.",
        ),
    ] = "runs/latest",
    output_format: Annotated[
        str, typer.Option("--format", help="Output: table, csv or json.")
    ] = "table",
) -> None:
    """Query a training run's exported transitions with DuckDB SQL."""
    from pathlib import Path

    from lightning_core import analytics

    try:
        fmt = analytics.OutputFormat(output_format)
    except ValueError:
        _fail(LightningError(f"unknown --format {output_format!r}; use table, csv or json"))
    run = Path(root)
    try:
        if not run.is_dir():
            raise LightningError(
                f"run folder {run} does not exist; pass --root or set LIGHTNING_RUN_DIR"
            )
        if not analytics.exported_iterations(run):
            raise LightningError(
                f"no transitions exported under {run} yet: training writes "
                "transitions/iteration=<k>/part-0.parquet after each iteration"
            )
        # In memory: a training flow may hold the run's analytics.duckdb open.
        con = analytics.connect(run, ":memory:")
        try:
            frame = analytics.run_sql(con, sql)
        finally:
            con.close()
    except LightningError as exc:
        _fail(exc)
    typer.echo(analytics.format_frame(frame, fmt), nl=False)


@app.command()
def runner(
    agent: Annotated[
        str,
        typer.Option(
            help="Agent to run: 'package.module:function' (imported from the current directory "
            "or the installed packages), or an example agent's name such as 'calc'."
        ),
    ],
    server: Annotated[
        str, typer.Option(help="Root URL of the `lightning-rl serve` whose queue to work.")
    ] = "http://127.0.0.1:4747",
    concurrency: Annotated[
        int | None, typer.Option(help="Attempts run at once (default 8).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="LIGHTNING_API_KEY", help="The server's API key.")
    ] = None,
    max_rollouts: Annotated[
        int | None, typer.Option(help="Stop after this many attempts (default: until Ctrl-C).")
    ] = None,
    default_model: Annotated[
        str | None,
        typer.Option(help="Model for rollouts that name no policy version (default 'base')."),
    ] = None,
) -> None:
    """Run an agent on the rollouts a server queues, shipping its spans back to the server.

    Ctrl-C stops taking work and lets attempts in flight finish; a second Ctrl-C fails them, so
    that the server requeues their rollouts at once.
    """
    import asyncio
    import os

    from pydantic import ValidationError

    from lightning_core.agent_ref import load_agent
    from lightning_core.runner import RunnerConfig

    flags = {"concurrency": concurrency, "default_model": default_model}
    try:
        config = RunnerConfig(**{k: v for k, v in flags.items() if v is not None})
        if max_rollouts is not None and max_rollouts < 1:
            raise LightningError(f"--max-rollouts must be at least 1, got {max_rollouts}")
        # Agents are found relative to the current directory, as uvicorn finds apps.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        agent_fn = load_agent(agent)
        stats = asyncio.run(_run_agent(agent_fn, server, config, api_key, max_rollouts))
    except ValidationError as exc:
        _fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        _fail(exc)
    except KeyboardInterrupt:  # before the runner took over Ctrl-C: nothing was in flight
        raise typer.Exit(130) from None
    typer.echo(f"{stats.succeeded} succeeded, {stats.failed} failed", err=True)


async def _run_agent(agent, server, config, api_key, max_rollouts):
    import asyncio
    import signal

    from lightning_core.runner import AttemptResult, Runner
    from lightning_core.store.client import HttpStoreClient

    def report(result: AttemptResult) -> None:
        outcome = f"reward {result.reward}" if result.error is None else result.error
        typer.echo(
            f"{result.rollout_id} attempt {result.sequence_id} {result.status.value} "
            f"in {result.duration_s:.1f} s: {outcome}",
            err=True,
        )

    client = HttpStoreClient(server, api_key=api_key)
    try:
        # Unreachable server or refused key: say so at once, before taking any work.
        await client.check()
        worker = Runner(agent, client, server, config, api_key=api_key, on_attempt=report)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop, max_rollouts))

        def interrupt() -> None:
            if stop.is_set():
                task.cancel()
                return
            stop.set()
            typer.echo("stopping: finishing attempts in flight (Ctrl-C again fails them)", err=True)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        return worker.stats
    finally:
        await client.close()


data_app = typer.Typer(
    name="data",
    help="Task tables: folders of Parquet files that training reads new tasks from.",
    no_args_is_help=True,
)
app.add_typer(data_app)


@data_app.command("add-tasks")
def add_tasks(
    table: Annotated[str, typer.Argument(help="The task table's folder (created if new).")],
    file: Annotated[
        str,
        typer.Argument(
            help="Tasks to add: a .jsonl file (one JSON object a line) or a .json list of "
            "objects, each with a string 'id'; '-' reads standard input."
        ),
    ],
    note: Annotated[
        str | None, typer.Option(help="A word on where the tasks came from, kept with them.")
    ] = None,
) -> None:
    """Append tasks to a task table as one new file; ids already in the table are refused."""
    from lightning_core.task_table import TaskTable

    try:
        tasks = _read_tasks(file)
        tasks_table = TaskTable(table)
        name = tasks_table.append(tasks, note=note)
        whole = tasks_table.snapshot()
    except LightningError as exc:
        _fail(exc)
    typer.echo(f"added {len(tasks)} tasks to {table} as {name}")
    typer.echo(
        f"table: {len(whole.files)} file{'' if len(whole.files) == 1 else 's'}, {whole.rows} "
        f"tasks, dataset id {whole.dataset_id}"
    )


@data_app.command("show")
def show(
    table: Annotated[str, typer.Argument(help="The task table's folder.")],
) -> None:
    """List a task table's files with their rows, and the identity of the whole table."""
    from pathlib import Path

    from lightning_core.errors import NotFound
    from lightning_core.task_table import TaskTable

    try:
        if not Path(table).is_dir():
            raise NotFound(
                f"no task table at {table}: `lightning-rl data add-tasks {table} FILE` creates it"
            )
        tasks_table = TaskTable(table)
        counts = tasks_table.counts()
        whole = tasks_table.snapshot()
    except LightningError as exc:
        _fail(exc)
    width = max([len("file"), *(len(name) for name in counts)])
    typer.echo(f"{'file':<{width}} {'rows':>8}")
    for name, rows in counts.items():
        typer.echo(f"{name:<{width}} {rows:>8}")
    typer.echo(f"{'total':<{width}} {whole.rows:>8}")
    typer.echo(f"dataset id {whole.dataset_id}")
    typer.echo(f"content hash {whole.content_hash}")


def _read_tasks(file: str) -> list:
    """Tasks from a JSON list or JSON lines (told apart by the first character), or stdin."""
    import json
    from pathlib import Path

    source = "standard input" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read tasks from {source}: {exc}") from exc
    if text.lstrip().startswith("["):
        try:
            tasks = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{source} is not a JSON list: {exc}") from exc
        return tasks
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidInput(
                f"{source} line {number} is not JSON ({exc}); give one JSON object a line, "
                "or a JSON list"
            ) from exc
    return tasks


def main() -> None:
    try:
        app()
    except LightningError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
