"""`lightning-rl runner`: a rollout runner on any machine, against a running server."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.app import app, fail


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

    from lightning_core.rollouts.agent_ref import load_agent
    from lightning_core.rollouts.runner import RunnerConfig

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
        fail(LightningError(f"invalid setting: {exc}"))
    except LightningError as exc:
        fail(exc)
    except KeyboardInterrupt:  # before the runner took over Ctrl-C: nothing was in flight
        raise typer.Exit(130) from None
    typer.echo(f"{stats.succeeded} succeeded, {stats.failed} failed", err=True)


async def _run_agent(agent, server, config, api_key, max_rollouts):
    import asyncio
    import signal

    from lightning_core.rollouts.runner import AttemptResult, Runner
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
