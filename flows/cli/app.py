"""The `lightning-rl` Typer app and what every command shares: a user's error as one line."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="lightning-rl",
    help="Reinforcement learning for any LLM agent: store, gateway, training pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def fail(exc: Exception) -> None:
    """Print a user error as one line, without a traceback, and exit non-zero."""
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.callback()
def _root() -> None:
    """Reinforcement learning for any LLM agent: store, gateway, training pipeline."""
