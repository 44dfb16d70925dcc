"""`lightning-rl train` and `lightning-rl eval`: the flows, run locally on embedded defaults.

These commands live beside the flows, not in lightning_core (which imports no Prefect): the
console script is this module, which adds them to lightning_core's commands. Prefect runs
without a server (a temporary local one), MLflow writes to ./mlflow.db, the store is a DuckDB
file in the run folder and the policy is SmolLM2 on this machine, unless told otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from lightning_core.cli import _fail, app
from lightning_core.errors import LightningError


def _interrupt_on_sigterm() -> None:
    """SIGTERM stops a run like Ctrl-C does: the policy server (a child process) is stopped
    on the way out instead of being left behind."""

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _quiet_prefect() -> None:
    # The live view owns the terminal; Prefect's own log lines would tear it. They still go
    # to Prefect's database (the UI) and warnings still show.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class _LiveView:
    """Follows a run folder's progress.jsonl and renders where the run is."""

    def __init__(self, run_dir: Path, iterations: int) -> None:
        self.run_dir = run_dir
        self.iterations = iterations
        self.offset = 0
        self.stage = "starting (model load, policy server)"
        self.iteration = 0
        self.done = 0
        self.total = 0
        self.evals: list[tuple[int, float, float, float]] = []
        self.rows: list[dict[str, Any]] = []
        self.started = time.time()

    def update(self) -> None:
        from lightning_rl.tasks import progress

        events, self.offset = progress.read(self.run_dir, self.offset)
        for e in events:
            stage = e["stage"]
            if stage in ("rollout", "eval"):
                if stage != self.stage:
                    self.stage, self.done = stage, 0
                self.done += 1
                self.total = e.get("total", self.total)
            elif stage == "iteration":
                self.iteration, self.stage, self.done = e["iteration"], "planning", 0
            elif stage == "training":
                self.stage = f"training on {e['transitions']} transitions"
            elif stage == "evaluated":
                self.evals.append((e["iteration"], e["accuracy"], e["ci_low"], e["ci_high"]))
                self.stage = "evaluated"
            elif stage == "iterated":
                self.rows.append(e)
            elif stage == "done":
                self.stage = "done"

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        minutes = (time.time() - self.started) / 60
        where = self.stage
        if self.stage in ("rollout", "eval") and self.total:
            where = (
                f"{'evaluation' if self.stage == 'eval' else 'rollouts'} {self.done}/{self.total}"
            )
        head = Text(
            f"iteration {self.iteration}/{self.iterations} | {where} | {minutes:.1f} min",
            style="bold",
        )
        table = Table(box=None, pad_edge=False)
        for column in ("iter", "reward", "success", "actions/ep", "trained", "policy"):
            table.add_column(column)
        for r in self.rows[-8:]:
            table.add_row(
                str(r["iteration"]),
                f"{r.get('rollout/reward_mean', float('nan')):.3f}",
                f"{r.get('rollout/success_rate', float('nan')):.3f}",
                f"{r.get('rollout/actions_per_episode', float('nan')):.2f}",
                f"{int(r.get('train/transitions', 0))}",
                str(r.get("policy", "")),
            )
        evals = Text(
            "held-out: "
            + (
                ", ".join(f"it{i} {a:.1%} [{lo:.1%}, {hi:.1%}]" for i, a, lo, hi in self.evals)
                or "pending"
            )
        )
        return Group(head, evals, table)


def _run_with_view(fn: Any, run_dir: Path, iterations: int) -> Any:
    """Run `fn` (a flow call) here, with the live view refreshed from another thread."""
    from rich.live import Live

    view = _LiveView(run_dir, iterations)
    stop = threading.Event()
    with Live(view.render(), refresh_per_second=2, transient=False) as live:

        def follow() -> None:
            while not stop.wait(0.5):
                view.update()
                live.update(view.render())

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        try:
            return fn()
        finally:
            stop.set()
            thread.join(timeout=2)
            view.update()
            live.update(view.render())


@app.command()
def train(
    agent: Annotated[
        str | None,
        typer.Option(help="Agent profile (calc, sql, rag) or 'module:function'; default calc."),
    ] = None,
    iterations: Annotated[int | None, typer.Option(help="Training iterations.")] = None,
    tasks_per_iteration: Annotated[int | None, typer.Option(help="Tasks per iteration.")] = None,
    group_size: Annotated[int | None, typer.Option(help="Rollouts per task (G).")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate every E iterations.")] = None,
    eval_size: Annotated[int | None, typer.Option(help="Held-out tasks per evaluation.")] = None,
    model: Annotated[
        str | None, typer.Option(help="Base model folder or hub id (default SmolLM2-135M).")
    ] = None,
    tasks: Annotated[
        str | None, typer.Option(help="Task loader 'module:function' (agents without profile).")
    ] = None,
    task_source: Annotated[str | None, typer.Option(help="Dataset of the agent.")] = None,
    run_dir: Annotated[str | None, typer.Option(help="Folder of run folders (runs).")] = None,
    run_name: Annotated[str | None, typer.Option(help="Run folder name.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
    train_agent: Annotated[
        list[str] | None,
        typer.Option(help="Train this agent name's calls (repeat it); default: the profile's."),
    ] = None,
    policy_per_agent: Annotated[
        bool | None,
        typer.Option(
            "--policy-per-agent/--shared-policy",
            help="One LoRA adapter per trained agent, or one shared by all (the default).",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="JSON file of TrainConfig fields (flows/config.py); flags win."),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No live view; print the summary only.")] = False,
) -> None:
    """Train an agent's LLM with LightningRL: the Prefect flow 'train', run here."""
    _quiet_prefect()
    _interrupt_on_sigterm()
    from lightning_rl.flows.config import TrainConfig

    fields: dict[str, Any] = {}
    if config is not None:
        try:
            fields = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            _fail(LightningError(f"cannot read config {config}: {exc}"))
    flags = {
        "agent": agent,
        "iterations": iterations,
        "tasks_per_iteration": tasks_per_iteration,
        "group_size": group_size,
        "eval_every": eval_every,
        "eval_size": eval_size,
        "model": model,
        "tasks": tasks,
        "task_source": task_source,
        "run_dir": run_dir,
        "run_name": run_name,
        "seed": seed,
        "train_agents": train_agent or None,
        "policy_per_agent": policy_per_agent,
    }
    fields |= {k: v for k, v in flags.items() if v is not None}
    try:
        settings = TrainConfig.model_validate(fields)
        from lightning_rl.tasks.profiles import profile

        spec = profile(settings.agent, settings.tasks)
    except ValidationError as exc:
        _fail(LightningError(f"invalid training config: {exc}"))
    except LightningError as exc:
        _fail(exc)
    if settings.run_name is None:
        settings.run_name = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = Path(settings.run_dir).resolve() / settings.run_name
    folder.mkdir(parents=True, exist_ok=True)

    from lightning_rl.flows.train import train as train_flow

    params = settings.model_dump()
    params["registry_config"] = params.pop("registry")
    typer.echo(f"training {spec.name} -> {folder}", err=True)
    try:
        if quiet or not sys.stderr.isatty():
            summary = train_flow(**params)
        else:
            summary = _run_with_view(lambda: train_flow(**params), folder, settings.iterations)
    except LightningError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; what was done is in {folder}", err=True)
        raise typer.Exit(130) from None
    base, final = summary["base"], summary["final"]
    typer.echo(
        f"base {base['accuracy']:.1%} [{base['ci_low']:.1%}, {base['ci_high']:.1%}] -> "
        f"final {final['accuracy']:.1%} [{final['ci_low']:.1%}, {final['ci_high']:.1%}] on "
        f"{final['tasks']} held-out tasks: {summary['gain_points']:+.1f} points in "
        f"{summary['minutes']} min"
    )
    typer.echo(f"registry: {summary['promotion']['reason']}")
    typer.echo(f"report: {summary['reward_curve']}  (run folder {summary['run_dir']})")


@app.command("eval")
def evaluate(
    agent: Annotated[str, typer.Option(help="Agent profile (calc) or 'module:function'.")] = "calc",
    model: Annotated[
        str,
        typer.Option(help="What to score: champion (or another alias), a version number, base."),
    ] = "champion",
    eval_size: Annotated[int, typer.Option(help="Held-out tasks.")] = 200,
    base_model: Annotated[str | None, typer.Option(help="Base model of the adapter.")] = None,
    tasks: Annotated[str | None, typer.Option(help="Task loader 'module:function'.")] = None,
) -> None:
    """Score a registered policy on the agent's held-out benchmark (Prefect flow 'evaluate')."""
    _quiet_prefect()
    _interrupt_on_sigterm()
    from lightning_rl.flows.evaluate import evaluate as evaluate_flow
    from lightning_rl.tasks.profiles import profile

    try:
        profile(agent, tasks)  # a bad name fails here, before any flow starts
    except LightningError as exc:
        _fail(exc)
    try:
        result = evaluate_flow(
            agent=agent, policy=model, eval_size=eval_size, model=base_model, tasks=tasks
        )
    except LightningError as exc:
        _fail(exc)
    except ValidationError as exc:
        _fail(LightningError(f"invalid parameters: {exc}"))
    typer.echo(
        f"{result['agent']} {model}: {result['accuracy']:.1%} "
        f"[{result['ci_low']:.1%}, {result['ci_high']:.1%}] on {result['tasks']} tasks"
    )


def main() -> None:
    from lightning_core.cli import main as core_main

    core_main()


if __name__ == "__main__":
    main()
