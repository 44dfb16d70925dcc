"""`lightning-rl train` and `lightning-rl eval`: the flows, run locally on embedded defaults.

These commands live beside the flows, not in lightning_core (which imports no Prefect): the
console script is this module, which adds them to lightning_core's commands. Prefect runs
without a server (a temporary local one), MLflow writes to ./mlflow.db, the store is a DuckDB
file in the run folder and the policy is SmolLM2 on this machine, unless told otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from lightning_core.cli import _fail, app
from lightning_core.errors import LightningError


def _interrupt_on_sigterm() -> None:
    """SIGTERM stops a run like Ctrl-C does: the policy server (a child process) is stopped
    on the way out instead of being left behind."""

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _agents_from_cwd() -> None:
    # `--agent mypkg.agent:run` names a module of the user's project, found relative to the
    # current directory as `lightning-rl runner` (and uvicorn) find theirs; the console script,
    # unlike `python -m`, does not put it on the path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _quiet_prefect() -> None:
    # The live view owns the terminal; Prefect's own log lines would tear it. Only the console
    # handler is raised to WARNING (logging.yml's handlers.console.level): the loggers stay at
    # INFO, so the API handler still sends the flow's INFO lines to Prefect (the UI).
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Prefect's temporary API server gets 20 s to start by default; on a busy 2-core machine it
    # took longer and the run died with a traceback before it began (seen here under load).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


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
                self.evals.append((e["iteration"], e["score"], e["ci_low"], e["ci_high"]))
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


# Option names of earlier releases, kept working beside the generated ones. " /--x" adds an
# off switch alone (click splits a declaration at "/" into on and off names; an empty on name
# is skipped).
_ALIASES: dict[str, tuple[str, ...]] = {
    "train_agents": ("--train-agent",),
    "policy_per_agent": (" /--shared-policy",),
}
_NESTED_PANEL = "Nested settings: a JSON object, merged over the default (or --config's)"


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_option(name: str, field: FieldInfo, default: Any) -> inspect.Parameter:
    """The `lightning-rl train` option of one TrainConfig field. Every option defaults to None,
    "not given", so that a --config file's value (or --resume's) stays unless a flag is given."""
    # Escaped: typer reads help as rich markup, and "lightning-rl[cluster]" is meant as text.
    help_text = escape(field.description or "")
    annotation: Any = field.annotation
    if _is_model(annotation):
        keys = ", ".join(annotation.model_fields)
        option = typer.Option(
            _flag(name),
            help=f"{help_text} Keys: {keys}.",
            metavar="JSON",
            show_default=False,
            rich_help_panel=_NESTED_PANEL,
        )
        annotation = str
    else:
        decls = (f"{_flag(name)}/--no-{_flag(name)[2:]}",) if annotation is bool else (_flag(name),)
        if get_origin(annotation) in (Union, UnionType):  # X | None: None is "not given" here
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        if get_origin(annotation) is list:
            help_text += " Repeat the option for more."
        option = typer.Option(
            *decls,
            *_ALIASES.get(name, ()),
            help=help_text,
            show_default=False if default is None else str(default),
        )
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[annotation | None, option],
    )


def _command_options() -> list[inspect.Parameter]:
    """The options of `train` that are not settings."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(
            "config",
            keyword,
            default=None,
            annotation=Annotated[
                Path | None,
                typer.Option(help="JSON file of TrainConfig fields (flows/config.py); flags win."),
            ],
        ),
        inspect.Parameter(
            "preset",
            keyword,
            default=None,
            annotation=Annotated[
                str | None,
                typer.Option(
                    metavar="NAME",
                    help="Start from a named set of settings (flows/presets.py): cpu (the "
                    "defaults) or gpu (Qwen2.5-1.5B-Instruct on vLLM, bf16, larger batches); "
                    "--config and flags win over it.",
                ),
            ],
        ),
        inspect.Parameter(
            "resume",
            keyword,
            default=None,
            annotation=Annotated[
                str | None,
                typer.Option(
                    metavar="RUN",
                    help="Continue the run folder RUN (in --run-dir) from its last finished "
                    "iteration, with the config it started with (--iterations may extend it).",
                ),
            ],
        ),
        inspect.Parameter(
            "quiet",
            keyword,
            default=False,
            annotation=Annotated[bool, typer.Option(help="No live view; print the summary only.")],
        ),
    ]


def _train_signature() -> inspect.Signature:
    from lightning_rl.flows.config import TrainConfig

    defaults = TrainConfig()
    fields = [
        _field_option(name, field, getattr(defaults, name))
        for name, field in TrainConfig.model_fields.items()
    ]
    clash = {p.name for p in fields} & {p.name for p in _command_options()}
    assert not clash, f"TrainConfig fields clash with train's own options: {clash}"
    return inspect.Signature([*fields, *_command_options()], return_annotation=None)


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LightningError(f"{_flag(name)} takes a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise LightningError(f"{_flag(name)} takes a JSON object, not {text!r}")
    return value


def _unknown_keys(model: type[BaseModel], value: dict[str, Any], where: str) -> list[str]:
    """Keys of `value` that `model` (which ignores unknown keys) has no field for: typos."""
    unknown = []
    for key, item in value.items():
        field = model.model_fields.get(key)
        if field is None:
            unknown.append(f"{where}{key}")
        elif isinstance(item, dict) and _is_model(field.annotation):
            unknown += _unknown_keys(field.annotation, item, f"{where}{key}.")
    return unknown


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, nested objects merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = _merged(out[key], value)
        out[key] = value
    return out


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LightningError(f"cannot read {what} {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise LightningError(f"{what} {path} is not a JSON object")
    return value


def train_fields(
    options: dict[str, Any], config: Path | None, resume: str | None
) -> dict[str, Any]:
    """TrainConfig's fields from, in the order they win: the defaults, the --preset
    (`options["preset"]`, flows/presets.py), the resumed run's config, the --config file, the
    flags. Nested settings merge key by key over the layer below, so
    `--trainer '{"learning_rate": 1e-4}'` keeps the demo's LoRA."""
    from lightning_rl.flows.config import TrainConfig
    from lightning_rl.flows.presets import preset_fields
    from lightning_rl.flows.run_state import CONFIG_FILE, check_run_name, run_path

    # The preset travels with the flags (so this signature stays) but is no setting itself.
    options = dict(options)
    preset = options.pop("preset", None)
    flags: dict[str, Any] = {}
    for name, value in options.items():
        if value is None or value == []:
            continue
        is_model = name in _nested_fields()
        flags[name] = _json_object(name, value) if is_model else value
    from_file = _read_json(config, "config") if config is not None else {}
    layers = [from_file, flags]
    if resume is not None:
        run_dir = flags.get("run_dir") or from_file.get("run_dir") or TrainConfig().run_dir
        if flags.get("run_name", resume) != resume:
            raise LightningError(f"--resume {resume} and --run-name {flags['run_name']} disagree")
        saved = run_path(run_dir, check_run_name(resume)) / CONFIG_FILE
        if not saved.is_file():
            raise LightningError(
                f"cannot resume {resume}: no {saved} (a run writes it when it starts)"
            )
        layers = [_read_json(saved, "the config of run"), *layers]
        layers.append({"run_name": resume, "run_dir": run_dir})
    if preset is not None:
        layers = [preset_fields(preset), *layers]
    defaults = TrainConfig().model_dump(mode="json")
    fields: dict[str, Any] = {}
    for layer in layers:
        fields = _merged(fields, layer)
    unknown = _unknown_keys(TrainConfig, fields, "")
    if unknown:
        raise LightningError(f"unknown training settings: {', '.join(unknown)}")
    if isinstance(fields.get("run_name"), str):  # one line here, not pydantic's report
        check_run_name(fields["run_name"])
    # Nested settings over TrainConfig's defaults (the demo trainer), not their class's.
    for name in _nested_fields():
        if name in fields:
            fields[name] = _merged(defaults[name], fields[name])
    return fields


def _nested_fields() -> set[str]:
    from lightning_rl.flows.config import nested_models

    return set(nested_models())


def train(**options: Any) -> None:
    """Train an agent's LLM with LightningRL: the Prefect flow 'train', run here.

    Every setting of TrainConfig (flows/config.py) is an option; a --config file (or the run
    --resume continues) gives the rest, and flags win over both.
    """
    _quiet_prefect()
    _interrupt_on_sigterm()
    from lightning_rl.flows.config import TrainConfig
    from lightning_rl.flows.run_state import default_run_name, run_path
    from lightning_rl.tasks.profiles import profile

    config, resume, quiet = options.pop("config"), options.pop("resume"), options.pop("quiet")
    _agents_from_cwd()
    try:
        settings = TrainConfig.model_validate(train_fields(options, config, resume))
        spec = profile(settings.agent, settings.tasks)
    except ValidationError as exc:
        _fail(LightningError(f"invalid training config: {exc}"))
    except LightningError as exc:
        _fail(exc)
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
                summary = _run_with_view(lambda: train_flow(**params), folder, settings.iterations)
    except LightningError as exc:
        _fail(exc)
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
    start = "champion" if summary.get("warm_start") == "champion" else "base"
    typer.echo(
        f"{start} {base['score']:.1%} [{base['ci_low']:.1%}, {base['ci_high']:.1%}] -> "
        f"final {final['score']:.1%} [{final['ci_low']:.1%}, {final['ci_high']:.1%}] on "
        f"{final['tasks']} held-out tasks: {summary['gain_points']:+.1f} points in "
        f"{summary['minutes']} min"
    )
    typer.echo(f"registry: {summary['promotion']['reason']}")
    typer.echo(f"report: {summary['reward_curve']}  (run folder {summary['run_dir']})")


@functools.cache
def train_command() -> TyperCommand:
    """`lightning-rl train`, its options made from TrainConfig (typer reads them from the
    signature and the type hints, both generated here)."""
    train.__signature__ = _train_signature()  # type: ignore[attr-defined]
    train.__annotations__ = {p.name: p.annotation for p in train.__signature__.parameters.values()}
    commands = typer.Typer(add_completion=False)
    commands.command()(train)
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


@app.command("eval")
def evaluate(
    agent: Annotated[str, typer.Option(help="Agent profile (calc) or 'module:function'.")] = "calc",
    policy: Annotated[
        str,
        typer.Option(help="What to score: champion (or another alias), a version number, base."),
    ] = "champion",
    eval_size: Annotated[int, typer.Option(help="Held-out tasks.")] = 200,
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
    _quiet_prefect()
    _interrupt_on_sigterm()
    from lightning_rl.flows.evaluate import evaluate as evaluate_flow
    from lightning_rl.flows.prefect_server import temporary_server
    from lightning_rl.tasks.profiles import profile

    _agents_from_cwd()
    try:
        profile(agent, tasks)  # a bad name fails here, before any flow starts
    except LightningError as exc:
        _fail(exc)
    try:
        with temporary_server():
            result = evaluate_flow(
                agent=agent, policy=policy, eval_size=eval_size, model=base_model, tasks=tasks
            )
    except LightningError as exc:
        _fail(exc)
    except ValidationError as exc:
        _fail(LightningError(f"invalid parameters: {exc}"))
    typer.echo(
        f"{result['agent']} {policy}: {result['score']:.1%} "
        f"[{result['ci_low']:.1%}, {result['ci_high']:.1%}] on {result['tasks']} tasks"
    )


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
) -> None:
    """Serve a registered policy (the champion) to agents in production, and keep their episodes.

    Clients call the OpenAI or Anthropic API at http://HOST:PORT/v1 with model "champion" (or
    the version's own name) and an `X-Lightning-Episode` header (or metadata.episode_id); each
    episode's calls are stored with their exact tokens, and feedback arrives later at
    POST /episodes/<id>/feedback. A retraining run (data=episodes) reads both from this server.
    The API key is LIGHTNING_API_KEY, else a new one written to <db>.key (mode 0600).
    """
    _quiet_prefect()
    import asyncio
    import secrets

    from lightning_core.errors import Conflict
    from lightning_core.store.config import StoreConfig
    from lightning_core.store.duckdb_store import DuckDBStore
    from lightning_core.types import PolicyVersion
    from lightning_rl.registry.config import RegistryConfig, resolve
    from lightning_rl.registry.versions import champion_adapter
    from lightning_rl.tasks.profiles import profile
    from lightning_rl.tasks.server import read_key, write_key_file

    _agents_from_cwd()
    try:
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
            name = f"{config.registered_model}-v{found.version}"
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
        _fail(exc)
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
    argv = ["serve", "--host", host, "--port", str(port), "--db", str(store_path)]
    if model:
        argv += ["--model", model]
    if spec.tool_format:
        argv += ["--tool-format", spec.tool_format]
    os.execvpe(sys.executable, [sys.executable, "-m", "lightning_core.cli", *argv], env)


def _passive_openmp(argv: list[str]) -> None:
    """`lightning-rl train` with a staleness above 0 on the transformers backend: OpenMP threads
    wait passively in this process (the trainer's) and, by inheritance, in the policy server's
    (flows/train.py _server_env). Spinning, each process's threads burn the cores the other
    needs while rollouts and training overlap on a CPU. OpenMP reads the setting once, when
    torch loads, so it is set here, before anything imports torch, from the flags, the --config
    file, the resumed run's config and the preset, in the order `train_fields` layers them.
    Measured in BENCHMARKS.md (issue 15): 3 calc iterations in 278 s passive on both sides,
    292 s without overlap."""
    if argv[:1] != ["train"] or "OMP_WAIT_POLICY" in os.environ:
        return
    flags: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name.startswith("--"):
            flags[name[2:]] = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
    fields = _overlap_fields(flags)
    if str(fields.get("staleness", 0)) not in ("", "0") and fields.get("backend") != "vllm":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _overlap_fields(flags: dict[str, str]) -> dict[str, Any]:
    """`staleness` and `backend` as the run will have them, read without importing torch. A
    layer that cannot be read counts as empty: the command itself reports it."""
    from lightning_rl.flows.presets import PRESETS
    from lightning_rl.flows.run_state import CONFIG_FILE, DEFAULT_RUN_DIR, run_path

    def read(path: str | Path) -> dict[str, Any]:
        try:
            value = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    from_file = read(flags["config"]) if flags.get("config") else {}
    layers = [PRESETS.get(flags.get("preset", ""), {})]
    if flags.get("resume"):
        run_dir = flags.get("run-dir") or from_file.get("run_dir") or DEFAULT_RUN_DIR
        layers.append(read(run_path(run_dir, flags["resume"]) / CONFIG_FILE))
    layers += [from_file, {k: v for k, v in flags.items() if k in ("staleness", "backend")}]
    fields: dict[str, Any] = {}
    for layer in layers:
        fields |= {k: layer[k] for k in ("staleness", "backend") if k in layer}
    return fields


def main() -> None:
    _passive_openmp(sys.argv[1:])
    from lightning_core.cli import main as core_main

    core_main()


if __name__ == "__main__":
    main()
