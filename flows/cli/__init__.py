"""The `lightning-rl` command, every subcommand in this package. The server-side commands
import no Prefect (they start as child processes: `serve`, `replica`, `runner`); the flows'
commands load Prefect only when they run.

    app.py         the Typer app, and a user's error as one line
    serve.py       lightning-rl serve (and the hidden replica command)
    runner.py      lightning-rl runner
    data.py        lightning-rl status, analyze, data add-tasks, data show
    common.py      what every flow command does first
    options.py     train's options, generated from TrainConfig, and the config layering
    view.py        train's live view
    train.py       lightning-rl train
    evaluate.py    lightning-rl eval
    production.py  lightning-rl production
    live.py        production's live side: the server as a child, the alias follower beside it
    registry.py    lightning-rl registry rollback
    openmp.py      OpenMP's wait policy, set before torch loads

Prefect runs without a server (a temporary local one), MLflow writes to ./mlflow.db, the store
is a DuckDB file in the run folder and the policy is SmolLM2 on this machine, unless told
otherwise.
"""

from __future__ import annotations

import importlib
import sys

import typer

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.app import app
from lightning_rl.flows.cli.openmp import passive_openmp

# Each module adds its commands to `app` when imported; `lightning-rl --help` lists them in
# this order: serving, then data, then the flows.
for _module in ("serve", "runner", "data", "train", "evaluate", "production", "registry"):
    importlib.import_module(f"lightning_rl.flows.cli.{_module}")

__all__ = ["app", "main"]


def main() -> None:
    passive_openmp(sys.argv[1:])
    try:
        app()
    except LightningError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
