"""`lightning-rl eval`: a registered policy scored on its agent's held-out benchmark (the
Prefect flow 'evaluate', run here)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.app import app, fail
from lightning_rl.flows.cli.common import agents_from_cwd, interrupt_on_sigterm, quiet_prefect


@app.command("eval")
def evaluate(
    agent: Annotated[str, typer.Option(help="Agent profile (calc) or 'module:function'.")] = "calc",
    policy: Annotated[
        str,
        typer.Option(help="What to score: champion (or another alias), a version number, base."),
    ] = "champion",
    eval_size: Annotated[int, typer.Option(help="Held-out tasks.")] = 200,
    split: Annotated[
        str,
        typer.Option(
            help="Held-out split: test (the benchmark), or another the agent serves (kinds)."
        ),
    ] = "test",
    base_model: Annotated[str | None, typer.Option(help="Base model of the adapter.")] = None,
    tasks: Annotated[str | None, typer.Option(help="Task loader 'module:function'.")] = None,
    model: Annotated[
        str | None, typer.Option(hidden=True, help="Deprecated name of --policy.")
    ] = None,
) -> None:
    """Score a registered policy on the agent's held-out benchmark (Prefect flow 'evaluate')."""
    if model is not None:
        # --model meant the policy here but the base model in `train`: renamed, kept a while.
        typer.echo("note: eval's --model is now --policy (--model will go away)", err=True)
        policy = model
    quiet_prefect()
    interrupt_on_sigterm()
    from lightning_rl.flows.evaluate import evaluate as evaluate_flow
    from lightning_rl.flows.prefect_server import temporary_server
    from lightning_rl.flows.profiles import profile

    agents_from_cwd()
    try:
        profile(agent, tasks).check_loaders()  # a bad name fails here, before any flow starts
    except LightningError as exc:
        fail(exc)
    try:
        with temporary_server():
            result = evaluate_flow(
                agent=agent,
                policy=policy,
                eval_size=eval_size,
                model=base_model,
                tasks=tasks,
                split=split,
            )
    except LightningError as exc:
        fail(exc)
    except ValidationError as exc:
        fail(LightningError(f"invalid parameters: {exc}"))
    typer.echo(
        f"{result['agent']} {policy}: {result['score']:.1%} "
        f"[{result['ci_low']:.1%}, {result['ci_high']:.1%}] on {result['tasks']} {split} tasks"
    )
