"""The `lightning-rl` command: lightning_core's commands (serve, status, runner, data, ...),
which import no Prefect, and the flows' commands added here (train, eval, production).

    common.py      what every flow command does first
    options.py     train's options, generated from TrainConfig, and the config layering
    view.py        train's live view
    train.py       lightning-rl train
    evaluate.py    lightning-rl eval
    production.py  lightning-rl production
    openmp.py      OpenMP's wait policy, set before torch loads

Prefect runs without a server (a temporary local one), MLflow writes to ./mlflow.db, the store
is a DuckDB file in the run folder and the policy is SmolLM2 on this machine, unless told
otherwise.
"""

from __future__ import annotations

import sys

from lightning_core.cli import app
from lightning_rl.flows.cli import evaluate, production, train
from lightning_rl.flows.cli.openmp import passive_openmp

__all__ = ["app", "evaluate", "main", "production", "train"]


def main() -> None:
    passive_openmp(sys.argv[1:])
    from lightning_core.cli import main as core_main

    core_main()
