"""`lightning-rl production`: a registered policy served to agents in production, their
episodes and late feedback kept for retraining (data=episodes); the served version follows the
registry's aliases (hot reload, canary, live gate, rollback: registry/follower.py).

The server (`lightning-rl serve`) runs as a child process, without MLflow; this process follows
the registry beside it and tells it what to serve over its HTTP API, and stops it on exit."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from lightning_core.errors import LightningError
from lightning_core.serving.config import ServerConfig, serve_options
from lightning_rl.flows.cli.app import app, fail
from lightning_rl.flows.cli.common import agents_from_cwd, quiet_prefect


@app.command("production")
def production(
    agent: Annotated[str, typer.Option(help="Agent profile (calc) or 'module:function'.")] = "calc",
    policy: Annotated[
        str, typer.Option(help="Registered version to serve: champion, another alias, a number.")
    ] = "champion",
    port: Annotated[int, typer.Option(help="TCP port.")] = 4748,
    host: Annotated[str, typer.Option(help="Address to bind (off loopback: set a key).")] = (
        "127.0.0.1"
    ),
    db: Annotated[
        str | None,
        typer.Option(
            help="Store of the captured episodes (default runs/production/<agent>.duckdb)."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Base model of the adapter.")] = None,
    tasks: Annotated[str | None, typer.Option(help="Task loader 'module:function'.")] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI.")] = None,
    registered_model: Annotated[
        str | None, typer.Option(help="Registered model (default: the agent profile's).")
    ] = None,
    backend_options: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="More settings of the server's backend, as `lightning-rl serve "
            "--backend-options' takes them, e.g. '{\"threads\": 1}' for each of two servers "
            "sharing two cores.",
        ),
    ] = None,
    live: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="Settings of the alias follower, canary, live gate and rollback, LiveConfig's "
            'fields as a JSON object, e.g. \'{"canary_fraction": 0.2, "webhook_port": 4749}\' '
            "(also LIGHTNING_LIVE_<FIELD>). Never the webhook's secret: every user of the "
            "machine can read a command line; set LIGHTNING_LIVE_WEBHOOK_SECRET, or name a "
            "file that holds it (webhook_secret_file).",
        ),
    ] = None,
) -> None:
    """Serve a registered policy (the champion) to agents in production, and keep their episodes.

    Clients call the OpenAI or Anthropic API at http://HOST:PORT/v1 with model "champion" (or
    the version's own name) and an `X-Lightning-Episode` header (or metadata.episode_id); each
    episode's calls are stored with their exact tokens, and feedback arrives later at
    POST /episodes/<id>/feedback. A retraining run (data=episodes) reads both from this server.
    The API key is LIGHTNING_API_KEY, else a new one written to <db>.key (mode 0600).

    Serving the champion, it follows the registered model's champion and challenger aliases:
    a moved alias is served without a restart, a challenger in canary gets a share of the
    episodes and the live gate promotes it or ends its canary, and a champion whose live
    feedback falls below the previous one's is rolled back (see --live). A pinned --policy is
    served as it is.
    """
    quiet_prefect()
    import asyncio
    import secrets

    from pydantic import ValidationError

    from lightning_core.errors import Conflict
    from lightning_core.store.config import StoreConfig
    from lightning_core.store.duckdb_store import DuckDBStore
    from lightning_core.types import PolicyVersion
    from lightning_rl.flows.profiles import profile
    from lightning_rl.policy_server import read_key, write_key_file
    from lightning_rl.registry.config import RegistryConfig, resolve
    from lightning_rl.registry.follower import version_name
    from lightning_rl.registry.live_config import LiveConfig
    from lightning_rl.registry.versions import champion_adapter

    agents_from_cwd()
    try:
        try:
            live_given = json.loads(live) if live else {}
            if isinstance(live_given, dict) and "webhook_secret" in live_given:
                raise LightningError(_SECRET_ON_THE_COMMAND_LINE)
            live_config = LiveConfig(**live_given)
        except (json.JSONDecodeError, TypeError) as exc:
            raise LightningError(
                f"--live takes a JSON object of LiveConfig's fields: {exc}"
            ) from exc
        except ValidationError as exc:
            problems = (f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise LightningError(f"invalid --live setting: {'; '.join(problems)}") from exc
        try:
            options_given = json.loads(backend_options) if backend_options else {}
        except json.JSONDecodeError as exc:
            raise LightningError(f"--backend-options takes a JSON object: {exc}") from exc
        if not isinstance(options_given, dict):
            raise LightningError("--backend-options takes a JSON object, e.g. '{\"threads\": 1}'")
        spec = profile(agent, tasks)
        overrides = {"tracking_uri": tracking_uri, "registered_model": registered_model or ""}
        config = resolve(RegistryConfig(**overrides), spec.registered_model)
        store_path = Path(db or Path("runs") / "production" / f"{spec.name}.duckdb").resolve()
        store_path.parent.mkdir(parents=True, exist_ok=True)
        # Downloaded beside the store and renamed into place, whole; a temporary folder that
        # goes away either way.
        with tempfile.TemporaryDirectory(dir=store_path.parent, prefix=".download-") as download:
            found = champion_adapter(config, policy, dst=download)
            if found is None:
                raise LightningError(
                    f"registered model {config.registered_model!r} has no version {policy!r}: "
                    "train one first (lightning-rl train)"
                )
            name = version_name(config.registered_model, found.version)
            # The adapter beside the store, where it stays as long as episodes name it.
            adapter = store_path.parent / "adapters" / name
            if not adapter.exists():
                adapter.parent.mkdir(exist_ok=True)
                os.replace(found.adapter, adapter)

        async def register() -> None:
            store = DuckDBStore(StoreConfig(db=str(store_path)))
            try:
                # Served before: the same version in the same folder is there already.
                with contextlib.suppress(Conflict):
                    await store.add_policy_version(
                        PolicyVersion(
                            name=name,
                            base_model=model or "default",
                            adapter_path=str(adapter),
                            metadata={
                                "registered_model": config.registered_model,
                                "version": found.version,
                            },
                        )
                    )
            finally:
                await store.close()

        asyncio.run(register())
    except LightningError as exc:
        fail(exc)
    key_file = Path(f"{store_path}.key")
    key = (
        os.environ.get("LIGHTNING_API_KEY")
        or (read_key(str(key_file)) if key_file.exists() else None)
        or secrets.token_urlsafe(32)
    )
    write_key_file(key_file, key)
    typer.echo(
        f"serving {name} as {policy!r} (and {name!r}); episodes in {store_path}; key in {key_file}",
        err=True,
    )
    env = {
        **os.environ,
        "LIGHTNING_API_KEY": key,
        "LIGHTNING_MODEL_ALIASES": json.dumps({policy: name, "champion": name}),
    }
    options, server_env = serve_options(
        ServerConfig(host=host, model=model, backend_options=options_given)
    )
    env.update(server_env)
    argv = ["serve", *options, "--port", str(port), "--db", str(store_path)]
    if spec.tool_format:
        argv += ["--tool-format", spec.tool_format]
    command = [sys.executable, "-m", "lightning_rl.flows.cli", *argv]
    if not live_config.follow or policy != "champion":
        # A pinned version (or another alias) is served as it is: following would replace it.
        os.execvpe(sys.executable, command, env)
    from lightning_rl.flows.cli.live import run_following

    sys.exit(
        run_following(
            command,
            env,
            server_url=f"http://{_connect_host(host)}:{port}",
            key=key,
            registry=config,
            live=live_config,
            adapters=store_path.parent / "adapters",
            base_model=model or "default",
            bind_host=host,
        )
    )


# A command line is no place for a secret: `ps` shows it to every user of the machine, and the
# shell keeps it in its history.
_SECRET_ON_THE_COMMAND_LINE = (
    "--live does not take webhook_secret: a command line is readable by every user of this "
    "machine (ps) and stays in the shell's history. Give the secret by environment variable "
    "(LIGHTNING_LIVE_WEBHOOK_SECRET) or by file (--live '{\"webhook_secret_file\": PATH}', "
    "a file only you can read)"
)


def _connect_host(host: str) -> str:
    """Where this machine reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "", "localhost") else host
