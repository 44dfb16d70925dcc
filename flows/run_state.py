"""A training run's folder and its checkpoint: what lets a killed run continue where it stopped.

`runs/<run_name>/` holds everything of one run: the config it started with, the store
(DuckDB), the adapters (`adapters/v<k>`, each with optimizer and RNG state), the Parquet
export (`transitions/iteration=<k>/`) and `checkpoint.json`. The checkpoint is written, whole
and atomically, when an iteration has finished (after its adapter, export, policy version and
metrics); a run started again with the same name reads it and redoes only what came after.
Everything an iteration writes is keyed by its number and replaced whole when redone, so a
half-finished iteration leaves no duplicates behind.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from lightning_core.data.files import write_text_atomically
from lightning_core.errors import InvalidInput
from lightning_core.stats.evaluation import EvalResult

CHECKPOINT_FILE = "checkpoint.json"
CONFIG_FILE = "config.json"
# TrainConfig.run_dir's default, here so that the CLI can find a run before torch loads.
DEFAULT_RUN_DIR = "runs"
# Settings a resumed run may change: more iterations extend a finished or stopped run.
RESUMABLE_CHANGES = frozenset({"iterations"})
# `<run_dir>/latest` is the link to the newest run (run_folder): a run of that name would be
# the link itself, pointing at itself, and the newest run would be lost. Compared lowercased,
# for filesystems that ignore case.
RESERVED_RUN_NAMES = frozenset({"latest"})
# A run name is one folder name: no separators, no '.' or '..', no hidden or temporary name.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,80}")


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name a run, in one line; None when it can."""
    if name.lower() in RESERVED_RUN_NAMES:
        return (
            f"run name {name!r} is reserved: <run_dir>/{name.lower()} links to the newest run; "
            "pick another name"
        )
    if not _RUN_NAME.fullmatch(name):
        return (
            f"run name {name!r} is not a folder name: use letters, digits, '.', '_' and '-' "
            "(at most 81, starting with a letter or digit)"
        )
    return None


def check_run_name(name: str) -> str:
    """`name`, if it can name a run; else InvalidInput saying why."""
    problem = run_name_problem(name)
    if problem is not None:
        raise InvalidInput(problem)
    return name


def default_run_name(agent: str) -> str:
    """`<agent>-<timestamp>`: the run folder and policy version prefix when none is given."""
    return f"{agent}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_path(run_dir: str | Path, run_name: str) -> Path:
    """Where the run `run_name` keeps its folder."""
    return Path(run_dir).resolve() / run_name


def run_folder(run_dir: str | Path, run_name: str) -> Path:
    """The run's folder (created), with `<run_dir>/latest` pointing at it."""
    root = run_path(run_dir, check_run_name(run_name))
    root.mkdir(parents=True, exist_ok=True)
    # runs/latest: where `lightning-rl analyze` looks by default. A link made aside, then
    # renamed over the old one, so a reader never finds it missing.
    latest = root.parent / "latest"
    tmp = root.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(root.name)
    os.replace(tmp, latest)
    return root


class Evaluation(BaseModel):
    """A held-out evaluation after iteration `iteration` (0: the base model), with each task's
    reward, which the final paired comparison with the base needs."""

    iteration: int
    result: EvalResult
    rewards: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def of(cls, iteration: int, result: EvalResult) -> Evaluation:
        return cls(iteration=iteration, result=result, rewards=result.rewards)

    def restored(self) -> EvalResult:
        return self.result.model_copy(update={"rewards": self.rewards})


class Checkpoint(BaseModel):
    """Where a run stands after its last finished iteration."""

    iteration: int = Field(
        -1, description="Last finished iteration; 0: only the base model evaluated; -1: none."
    )
    mlflow_run_id: str = Field(description="The MLflow run every iteration logs to.")
    policy: str = Field("", description="Policy version the next rollouts use ('' = base).")
    adapter_dir: str = Field("", description="Adapter folder of that policy ('' = none yet).")
    learnability: dict[str, float] = Field(
        default_factory=dict, description="The curriculum's estimate per tier (its state)."
    )
    evaluations: list[Evaluation] = Field(default_factory=list)
    split_evaluations: dict[str, list[Evaluation]] = Field(
        default_factory=dict,
        description="Evaluations on evaluation.extra_splits, by split: the start's and the end's.",
    )
    history: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per-iteration metrics, one dict per finished iteration: what MLflow, the "
        "Prefect table artifact and the log were given.",
    )


def load_checkpoint(root: Path) -> Checkpoint | None:
    path = root / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        return Checkpoint.model_validate_json(path.read_text())
    except ValueError as exc:
        raise InvalidInput(f"cannot read the checkpoint {path}: {exc}") from exc


def save_checkpoint(root: Path, checkpoint: Checkpoint) -> None:
    """Replace the checkpoint whole: written aside, flushed to disk, then renamed."""
    write_text_atomically(root / CHECKPOINT_FILE, checkpoint.model_dump_json(indent=1))


def check_same_config(root: Path, config: dict[str, Any]) -> None:
    """A run folder continues only with the config it started with (but RESUMABLE_CHANGES):
    the iterations done so far were trained with it."""
    path = root / CONFIG_FILE
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    changed = sorted(
        k
        for k in set(saved) | set(config)
        if k not in RESUMABLE_CHANGES and saved.get(k) != config.get(k)
    )
    if changed:
        raise InvalidInput(
            f"run {root.name} exists with a different config ({', '.join(changed)} differ): "
            "resume it with the same settings (lightning-rl train --resume "
            f"{root.name}), or pick another run_name"
        )


def save_config(root: Path, config: dict[str, Any]) -> None:
    write_text_atomically(root / CONFIG_FILE, json.dumps(config, indent=2))
