"""`lightning-rl train`'s options, one per TrainConfig field (generated, so the CLI, the flow's
parameters and the settings reference cannot drift apart), and how the command layers the
preset, a resumed run's config, a --config file and the flags into one set of fields."""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.train_help import NESTED, RUN, SECTION_TITLES

# Option names of earlier releases, kept working beside the generated ones. " /--x" adds an
# off switch alone (click splits a declaration at "/" into on and off names; an empty on name
# is skipped).
_ALIASES: dict[str, tuple[str, ...]] = {
    "train_agents": ("--train-agent",),
    "policy_per_agent": (" /--shared-policy",),
}


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_option(name: str, field: FieldInfo, default: Any, panel: str) -> inspect.Parameter:
    """The `lightning-rl train` option of one TrainConfig field, shown in `panel` of the help.
    Every option defaults to None, "not given", so that a --config file's value (or --resume's)
    stays unless a flag is given."""
    # Plain text: the train command's help is click's layout, not rich markup.
    help_text = field.description or ""
    annotation: Any = field.annotation
    if _is_model(annotation):
        keys = ", ".join(annotation.model_fields)
        option = typer.Option(
            _flag(name),
            help=f"{help_text} Keys: {keys}.",
            metavar="JSON",
            show_default=False,
            rich_help_panel=panel,
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
            rich_help_panel=panel,
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


def _leaf(value: Any, where: tuple[str, ...]) -> Any:
    for name in where:
        value = getattr(value, name)
    return value


def train_signature() -> inspect.Signature:
    """One option per setting: a section's settings (rollouts, server, data, evaluation) by
    their flat names (`--group-size`, `--model`), the other nested settings as JSON objects."""
    from lightning_rl.flows.config import SECTIONS, TrainConfig, flat_names

    defaults = TrainConfig()
    fields = [
        _field_option(
            name, field, getattr(defaults, name), NESTED if _is_model(field.annotation) else RUN
        )
        for name, field in TrainConfig.model_fields.items()
        if name not in SECTIONS
    ]
    for flat, where in flat_names().items():
        *parents, leaf = where
        owner = type(_leaf(defaults, tuple(parents)))
        fields.append(
            _field_option(
                flat, owner.model_fields[leaf], _leaf(defaults, where), SECTION_TITLES[where[0]]
            )
        )
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
    """Keys of `value` that `model` (which ignores unknown keys) has no field for: typos,
    each with the closest known name when one is close."""
    known = {name: f"{where}{name}" for name in model.model_fields}
    if not where:  # a section's setting misplaced at the top: say where it lives
        from lightning_rl.flows.config import flat_names

        known |= {flat: ".".join(path) for flat, path in flat_names().items()}
    unknown = []
    for key, item in value.items():
        field = model.model_fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {known[close[0]]}?)" if close else ""
            unknown.append(f"{where}{key}{hint}")
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


def config_layers(
    flags: dict[str, Any],
    config: Path | None,
    resume: str | None,
    preset: str | None,
    group: Callable[[dict[str, Any], Any], dict[str, Any]] = lambda fields, _: fields,
    strict: bool = True,
) -> list[dict[str, Any]]:
    """The layers of a run's settings, lowest first: the --preset (flows/presets.py), the
    resumed run's config, the --config file, the flags. `group` puts a layer's settings in
    their sections (`train_fields`); without it the layers are read as written. Not `strict`
    (OpenMP's early look, flows/cli/openmp.py, which must not import torch), a file that cannot
    be read is an empty layer: the command itself reports it."""

    def read(path: Path, what: str) -> dict[str, Any]:
        try:
            return _read_json(path, what)
        except LightningError:
            if strict:
                raise
            return {}

    from lightning_rl.flows.presets import preset_fields
    from lightning_rl.flows.run_state import CONFIG_FILE, DEFAULT_RUN_DIR, check_run_name, run_path

    from_file = group(read(config, "config"), config) if config is not None else {}
    layers = [from_file, flags]
    if resume is not None:
        run_dir = flags.get("run_dir") or from_file.get("run_dir") or DEFAULT_RUN_DIR
        if flags.get("run_name", resume) != resume:
            raise LightningError(f"--resume {resume} and --run-name {flags['run_name']} disagree")
        saved = run_path(run_dir, check_run_name(resume)) / CONFIG_FILE
        if strict and not saved.is_file():
            raise LightningError(
                f"cannot resume {resume}: no {saved} (a run writes it when it starts)"
            )
        layers = [group(read(saved, "the config of run"), saved), *layers]
        layers.append({"run_name": resume, "run_dir": run_dir})
    if preset is not None:
        layers = [group(preset_fields(preset), f"preset {preset}"), *layers]
    return layers


def merged_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The layers merged, each over the ones below it, nested objects key by key."""
    fields: dict[str, Any] = {}
    for layer in layers:
        fields = _merged(fields, layer)
    return fields


def train_fields(
    options: dict[str, Any], config: Path | None, resume: str | None
) -> dict[str, Any]:
    """TrainConfig's fields from, in the order they win: the defaults, the --preset
    (`options["preset"]`), the resumed run's config, the --config file, the flags (flat names:
    `--group-size` is rollouts.group_size). Nested settings merge key by key over the layer
    below, so `--trainer '{"learning_rate": 1e-4}'` keeps the demo's LoRA."""
    from lightning_rl.flows.config import TrainConfig, grouped_fields
    from lightning_rl.flows.run_state import check_run_name

    # The preset travels with the flags (so this signature stays) but is no setting itself.
    options = dict(options)
    preset = options.pop("preset", None)
    flags: dict[str, Any] = {}
    for name, value in options.items():
        if value is None or value == []:
            continue
        is_model = name in _json_options()
        flags[name] = _json_object(name, value) if is_model else value
    flags = grouped_fields(flags)[0]  # flags go by flat names: no notice
    fields = merged_layers(config_layers(flags, config, resume, preset, _grouped))
    unknown = _unknown_keys(TrainConfig, fields, "")
    if unknown:
        raise LightningError(f"unknown training settings: {', '.join(unknown)}")
    if isinstance(fields.get("run_name"), str):  # one line here, not pydantic's report
        check_run_name(fields["run_name"])
    # Nested settings over TrainConfig's defaults (the demo trainer), not their class's.
    defaults = TrainConfig().model_dump(mode="json")
    for name in nested_fields():
        if name in fields:
            fields[name] = _merged(defaults[name], fields[name])
    return fields


def nested_fields() -> set[str]:
    from lightning_rl.flows.config import nested_models

    return set(nested_models())


def _json_options() -> set[str]:
    """The options that take a JSON object: nested settings (--trainer) and a section's nested
    settings (--offline)."""
    from lightning_rl.flows.config import SECTIONS, TrainConfig, flat_names

    defaults = TrainConfig()
    nested = {n for n in nested_fields() if n not in SECTIONS}
    return nested | {
        n for n, w in flat_names().items() if isinstance(_leaf(defaults, w), BaseModel)
    }


def _grouped(fields: dict[str, Any], source: Any) -> dict[str, Any]:
    """A config file's fields in their sections; flat names of earlier releases get a notice."""
    from lightning_rl.flows.config import flat_names_notice, grouped_fields

    try:
        grouped, moved = grouped_fields(fields)
    except ValueError as exc:
        raise LightningError(f"{source}: {exc}") from exc
    if moved:
        typer.secho(f"notice: {source}: {flat_names_notice(moved)}", err=True)
    return grouped
