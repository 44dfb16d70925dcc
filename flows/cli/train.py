"""`lightning-rl train`: the Prefect flow 'train' run here, on a temporary Prefect server
unless PREFECT_API_URL names one, with a live view in a terminal."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import typer
from pydantic import ValidationError
from typer.core import TyperCommand, TyperGroup

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.app import app, fail
from lightning_rl.flows.cli.common import agents_from_cwd, interrupt_on_sigterm, quiet_prefect
from lightning_rl.flows.cli.options import train_fields, train_signature
from lightning_rl.flows.cli.train_help import TrainCommand
from lightning_rl.flows.cli.view import run_with_view


def train(**options: Any) -> None:
    """Train an agent's LLM with LightningRL: the Prefect flow 'train', run here.

    Every setting of TrainConfig (flows/config.py) is an option; a --config file (or the run
    --resume continues) gives the rest, and flags win over both.
    """
    quiet_prefect()
    interrupt_on_sigterm()
    from lightning_rl.flows.config import TrainConfig
    from lightning_rl.flows.profiles import profile
    from lightning_rl.flows.run_state import default_run_name, run_path

    config, resume, quiet = options.pop("config"), options.pop("resume"), options.pop("quiet")
    agents_from_cwd()
    try:
        settings = TrainConfig.model_validate(train_fields(options, config, resume))
        spec = profile(settings.agent, settings.tasks)
        spec.check_loaders()
    except ValidationError as exc:
        fail(LightningError(f"invalid training config: {exc}"))
    except LightningError as exc:
        fail(exc)
    if settings.run_name is None:
        settings.run_name = default_run_name(spec.name)
    folder = run_path(settings.run_dir, settings.run_name)
    folder.mkdir(parents=True, exist_ok=True)

    from lightning_rl.flows.prefect_server import temporary_server
    from lightning_rl.flows.train import train as train_flow

    params = settings.model_dump()
    verb = "resuming" if resume else "training"
    typer.echo(f"{verb} {spec.name} -> {folder}", err=True)
    try:
        # Here, on the main thread: the temporary Prefect server dies with it (a SIGKILL too).
        with temporary_server():
            if quiet or not sys.stderr.isatty():
                summary = train_flow(**params)
            else:
                summary = run_with_view(lambda: train_flow(**params), folder, settings.iterations)
    except LightningError as exc:
        fail(exc)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; what was done is in {folder}", err=True)
        raise typer.Exit(130) from None
    if summary.get("skipped"):
        # Made above for the live view; a run that found nothing new leaves no folder.
        with contextlib.suppress(OSError):
            folder.rmdir()
        typer.echo(summary["reason"])
        return
    base, final = summary["base"], summary["final"]
    # A challenger warm start falls back to the champion when no canary runs: named neutrally.
    start = {"champion": "champion", "challenger": "warm start"}.get(
        summary.get("warm_start", ""), "base"
    )
    typer.echo(
        f"{start} {base['score']:.1%} [{base['ci_low']:.1%}, {base['ci_high']:.1%}] -> "
        f"final {final['score']:.1%} [{final['ci_low']:.1%}, {final['ci_high']:.1%}] on "
        f"{final['tasks']} held-out tasks: {summary['gain_points']:+.1f} points in "
        f"{summary['minutes']} min"
    )
    for split, found in summary.get("splits", {}).items():
        low, high = found["gain_ci_points"]
        typer.echo(
            f"held-out split {split}: {found['base']['score']:.1%} -> "
            f"{found['final']['score']:.1%} on {found['final']['tasks']} tasks: "
            f"{found['gain_points']:+.1f} points [{low:+.1f}, {high:+.1f}]"
        )
    typer.echo(f"registry: {summary['promotion']['reason']}")
    typer.echo(f"report: {summary['reward_curve']}  (run folder {summary['run_dir']})")


@functools.cache
def train_command() -> TyperCommand:
    """`lightning-rl train`, its options made from TrainConfig (typer reads them from the
    signature and the type hints, both generated here)."""
    train.__signature__ = train_signature()  # type: ignore[attr-defined]
    train.__annotations__ = {p.name: p.annotation for p in train.__signature__.parameters.values()}
    # Click's plain help layout (no rich): sections, and no option name cut (train_help.py).
    commands = typer.Typer(add_completion=False, rich_markup_mode=None)
    commands.command(cls=TrainCommand)(train)
    return typer.main.get_command(commands)


class _Commands(TyperGroup):
    """lightning_core's commands, and `train` made only when asked for: TrainConfig imports
    torch (seconds), which `status` or `serve` should not wait for."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = super().list_commands(ctx)
        at = names.index("eval") if "eval" in names else len(names)
        return [*names[:at], "train", *names[at:]]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        if cmd_name == "train":
            return train_command()
        return super().get_command(ctx, cmd_name)


app.info.cls = _Commands
