"""A real training run made short, for the --quick modes of the benchmarks that read runs.

calc_gain.py, rag_heldout.py, overlap.py and ablation_sql.py print figures of finished
`lightning-rl train` runs, which take 10-60 minutes. Their quick modes (the tests run them) run
the same command on the tiny random model for one iteration of 2 tasks x 2 rollouts with 4
held-out tasks (QUICK_FLAGS, about a minute), so that every figure is read from a real run
folder; the numbers are noise (the model is random), the code path is the real one.

Each quick run has its own Prefect home and MLflow database beside its run folder (`run_env`):
it registers nothing in the user's registry and competes for no `champion` alias.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

QUICK_FLAGS = (
    *("--model", "tiny"),
    *("--iterations", "1"),
    *("--tasks-per-iteration", "2"),
    *("--group-size", "2"),
    *("--eval-size", "4"),
    *("--eval-every", "1"),
    "--quiet",
)


def train_command(*flags: str) -> list[str]:
    """`lightning-rl train FLAGS` with this interpreter (whatever venv runs the benchmark)."""
    return [sys.executable, "-m", "lightning_rl.flows.cli", "train", *flags]


def run_env(home: Path, **more: str) -> dict[str, str]:
    """The environment of a run whose Prefect and MLflow state stays under `home`."""
    home.mkdir(parents=True, exist_ok=True)
    return os.environ | {
        "PREFECT_HOME": str(home / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **more,
    }


def train_quick(agent: str, run_dir: Path, name: str, *flags: str) -> Path:
    """Train `agent` with QUICK_FLAGS (then `flags`, which win) into `run_dir`/`name`; return
    the run folder. Exits with the log's tail if the run fails."""
    home = run_dir / f"{name}.state"
    command = train_command(
        *("--agent", agent, "--run-dir", str(run_dir), "--run-name", name),
        *QUICK_FLAGS,
        *flags,
    )
    print(f"quick: {' '.join(command[1:])}", flush=True)
    run_logged(command, run_env(home), home / "train.log", f"quick run {name}")
    return run_dir / name


def run_logged(command: list[str], env: dict[str, str], log: Path, what: str, **kw: Any) -> None:
    """Run `command` with its output in `log`; exit with the log's tail if it fails (the log
    may be in a temporary folder, gone by the time anyone reads the message)."""
    with log.open("w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        sys.exit(f"{what} failed (exit {done.returncode}); {log}:\n{tail}")
