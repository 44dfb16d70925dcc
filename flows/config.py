"""The training flow's configuration: one pydantic model, declared once.

Everything else follows from `TrainConfig`: the flow's parameters and the Prefect parameter
schema (`train_config_parameters`), the `lightning-rl train` options (flows/cli/options.py)
and the docs' settings table, docs/reference/settings.md (`python -m lightning_rl.flows.config
--update-docs` rewrites it).

Defaults are the CPU demo, `make demo`: SmolLM2-135M on this machine's cores, the calc agent (its
run time is in docs/quickstart.md). On a GPU, raise `tasks_per_iteration`, `iterations` and the
model size; the algorithm does not change.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import to_jsonable_python

from lightning_core.algo.config import LoRAConfig, TrainerConfig
from lightning_core.data.collect import CreditConfig
from lightning_core.data.provenance import ProvenanceConfig
from lightning_core.judge.config import JudgeConfig
from lightning_core.rollouts.curriculum import CurriculumConfig
from lightning_core.serving.config import ServerConfig
from lightning_core.types import Sampling
from lightning_rl.flows.run_state import DEFAULT_RUN_DIR, run_name_problem
from lightning_rl.flows.sections import DataConfig, EvaluationConfig, RolloutConfig, SFTConfig
from lightning_rl.registry.config import RegistryConfig

log = logging.getLogger(__name__)


def _demo_trainer() -> TrainerConfig:
    # LoRA on the top 12 of SmolLM2's 30 layers: backward stops below them, so a step costs
    # about half of a full one on CPU, and that is enough capacity to change how the agent
    # uses its tool. 2e-4 is a usual LoRA learning rate (full fine-tuning rates are ~10x lower).
    return TrainerConfig(learning_rate=2e-4, lora=LoRAConfig(rank=16, alpha=32.0, top_layers=12))


class TrainConfig(BaseModel):
    """One training run: N iterations of rollouts, credit assignment, analytics, a LoRA update
    and, every `evaluation.eval_every` iterations, a held-out evaluation; then registration."""

    agent: str = Field("calc", description="Agent profile name (calc), or 'module:function'.")
    tasks: str | None = Field(
        None, description="Task loader 'module:function' for agents without a profile."
    )
    iterations: int = Field(12, ge=1, description="Training iterations.")
    updates_per_iteration: int = Field(
        1, ge=1, description="Optimizer updates per iteration (mini-batches of its transitions)."
    )
    seed: int = Field(
        0,
        description="Seeds task sampling, each rollout's sampling (a seed per rollout, sent to "
        "the policy with its calls) and the adapter's initialisation: a repeated run samples "
        "the same rollouts.",
    )
    run_dir: str = Field(
        DEFAULT_RUN_DIR, description="Folder of run folders (store, adapters, exports)."
    )
    run_name: str | None = Field(
        None, description="Run folder and policy version prefix; None: '<agent>-<timestamp>'."
    )
    warm_start: Literal["base", "champion", "challenger", "sft"] = Field(
        "base",
        description="Start from the base model, from the registered champion's adapter (the "
        "base model when there is no champion yet, said in the log), or from the challenger in "
        "canary when one runs (else the champion): weekly retraining then builds on the "
        "newest version past the offline gate while the live gate is still out, instead of "
        "training each week's version from the same champion again. sft: from an adapter "
        "fine-tuned on the base policy's successful episodes (the sft section).",
    )
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="warm_start=sft: how many episodes are sampled, which are kept, and how "
        "they are trained on.",
    )
    train_agents: list[str] | None = Field(
        None, description="Train only these agent names' calls; None: the profile's choice."
    )
    policy_per_agent: bool = Field(
        False,
        description="One LoRA adapter per trained agent (train_agents, else the profile's), each "
        "trained on its own agent's calls and serving them; published, evaluated, registered and "
        "promoted together. False: one policy shared by every agent, as in the paper.",
    )
    air_reward: float | None = Field(
        None, description="Override the profile's tool-success AIR reward (0 turns AIR off)."
    )
    rollouts: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Each iteration's rollouts: how many, how they sample, where they run.",
    )
    server: ServerConfig = Field(
        default_factory=ServerConfig,
        description="The policy server the rollouts call (the settings `lightning-rl serve` "
        "takes); its backend is transformers or vllm.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="What the run trains on.")
    trainer: TrainerConfig = Field(
        default_factory=_demo_trainer,
        description="The LoRA policy-gradient update; its model and seed are the run's.",
    )
    credit: CreditConfig = Field(
        default_factory=CreditConfig,
        description="Credit assignment: each action's share of its episode's return, and the "
        "advantage estimator over a task's group of rollouts.",
    )
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig,
        description="How each iteration draws its tasks: by tier, and with resampling when too "
        "few groups carry a signal.",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="The held-out evaluation: how often, on how many tasks, which benchmark.",
    )
    registry: RegistryConfig = Field(
        default_factory=lambda: RegistryConfig(registered_model=""),
        description="MLflow; an empty registered_model means the profile's.",
    )
    provenance: ProvenanceConfig = Field(
        default_factory=ProvenanceConfig,
        description="Which policy produced the tokens trained on: the record each rollout is "
        "checked against, and the probe after each publish.",
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig,
        description="A judge model whose scores join the agent's reward (docs/judge.md); off "
        "unless judge.endpoint is set.",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_flat_names(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        grouped, moved = grouped_fields(values)
        if moved:
            log.warning(flat_names_notice(moved))
        return grouped

    @field_validator("run_name")
    @classmethod
    def _safe_name(cls, value: str | None) -> str | None:
        problem = None if value is None else run_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _a_training_server_serves_a_policy(self) -> TrainConfig:
        if self.server.backend == "none":
            raise ValueError("server.backend none serves no policy: use transformers or vllm")
        return self

    @model_validator(mode="after")
    def _stale_rollouts_are_truncated(self) -> TrainConfig:
        if self.rollouts.staleness and self.data.source == "episodes":
            raise ValueError(
                "staleness overlaps rollouts with training; data=episodes trains on recorded "
                "episodes and has no rollouts: use staleness=0"
            )
        if self.rollouts.staleness and "tis_cap" not in self.trainer.model_fields_set:
            self.trainer = self.trainer.model_copy(update={"tis_cap": 2.0})
        return self

    @model_validator(mode="after")
    def _episodes_need_a_source(self) -> TrainConfig:
        if self.data.source == "episodes" and not self.data.episodes_from:
            raise ValueError(
                "data=episodes trains on a production server's episodes: set episodes_from "
                "to its URL (e.g. http://127.0.0.1:4748)"
            )
        return self


# The sections whose settings also go by a flat name (`group_size` for rollouts.group_size):
# the `lightning-rl train` flags, and the names of earlier releases in config files.
SECTIONS = ("rollouts", "server", "data", "evaluation")
# Where a section's field and its flat name differ.
_RENAMED = {("data", "source"): "data"}


@functools.cache
def flat_names() -> dict[str, tuple[str, ...]]:
    """Flat name -> where the setting lives (`temperature` -> rollouts.sampling.temperature).
    Sampling's fields are flat too; a field whose flat name is a top-level setting (the
    sampling seed: the run's seed makes it) has none."""
    names: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            where = (*path, name)
            if field.annotation is Sampling:
                walk(Sampling, where)
                continue
            flat = _RENAMED.get(where, name)
            if flat in TrainConfig.model_fields and flat not in SECTIONS:
                continue
            assert flat not in names, f"two settings flatten to {flat}"
            names[flat] = where

    for section in SECTIONS:
        walk(TrainConfig.model_fields[section].annotation, (section,))
    return names


def grouped_fields(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`values` with settings given by their flat names moved into their sections, and the
    flat names it found. A section given as an object stays; `data` as a string is the flat
    name of data.source."""
    grouped = {k: v for k, v in values.items() if k not in flat_names() or _is_section(k, v)}
    moved = []
    for name, value in values.items():
        if name not in flat_names() or _is_section(name, value):
            continue
        *parents, leaf = flat_names()[name]
        target = grouped
        for parent in parents:
            inner = target.get(parent, {})
            if isinstance(inner, BaseModel):
                inner = inner.model_dump(exclude_unset=True)
            if not isinstance(inner, dict):
                raise ValueError(f"{parent} must be an object of settings, not {inner!r}")
            target[parent] = target = dict(inner)  # a copy: the caller's dict stays as it was
        target.setdefault(leaf, value)  # the grouped name wins over the flat one
        moved.append(name)
    return grouped, moved


def _is_section(name: str, value: Any) -> bool:
    # A section comes as an object: a dict, or its model (a flow's validated parameters).
    return name in SECTIONS and isinstance(value, dict | BaseModel)


def flat_names_notice(moved: list[str]) -> str:
    where = ", ".join(f"{n} as {'.'.join(flat_names()[n])}" for n in moved)
    return (
        f"training settings by their flat names are read into their sections ({where}); "
        "write them there: flat names are read until the next release"
    )


F = TypeVar("F", bound=Callable[..., Any])


def nested_models() -> dict[str, type[BaseModel]]:
    """TrainConfig's fields that are themselves settings models (trainer, credit, ...)."""
    return {
        name: field.annotation
        for name, field in TrainConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }


def train_config_parameters(fn: F) -> F:
    """Give `def train(**params)` one keyword parameter per TrainConfig field, with its type,
    constraints, default and description, so that a Prefect flow over it has TrainConfig's
    parameter schema and validation without declaring them again.

        @flow(name="train")
        @train_config_parameters
        def train(**params: Any) -> dict[str, Any]:
            return run_training(TrainConfig.model_validate(params))

    The description rides in the annotation twice: as `Field(description=...)` for pydantic,
    and in `json_schema_extra`, because Prefect's schema builder sets each parameter's
    description from the docstring (None here), which overrides the annotation's but not the
    extra schema keys. Defaults are values (default_factory called once, here, so every call
    shares them: read-only, as settings are), not FieldInfo: Prefect's validation would pass a
    FieldInfo default through to the function.
    """
    kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    if kinds != {inspect.Parameter.VAR_KEYWORD}:
        raise TypeError(f"{fn.__name__} must take **params only, the fields of TrainConfig")
    parameters, annotations = [], {}
    for name, field in TrainConfig.model_fields.items():
        described = Field(
            description=field.description,
            json_schema_extra={"description": field.description} if field.description else None,
        )
        # rebuild_annotation: the type with its constraints (ge=1, ...) as Annotated metadata.
        annotation = Annotated[field.rebuild_annotation(), described]
        default = field.get_default(call_default_factory=True)
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
        annotations[name] = annotation
    returns = inspect.signature(fn).return_annotation
    fn.__signature__ = inspect.Signature(parameters, return_annotation=returns)  # type: ignore[attr-defined]
    fn.__annotations__ = {**annotations, "return": fn.__annotations__.get("return", Any)}
    return fn


def settings_rows(
    model: type[BaseModel] = TrainConfig, value: BaseModel | None = None, prefix: str = ""
) -> Iterator[tuple[str, str, str]]:
    """(dotted field name, default as JSON, description) of every setting, nested models'
    fields included (`trainer.learning_rate`), with TrainConfig's own defaults for them."""
    value = value if value is not None else model()
    for name, field in model.model_fields.items():
        current = getattr(value, name)
        description = field.description or ""
        if isinstance(current, BaseModel):
            yield prefix + name, "", description or (type(current).__doc__ or "").strip()
            yield from settings_rows(type(current), current, f"{prefix}{name}.")
        else:
            yield prefix + name, json.dumps(to_jsonable_python(current)), description


def settings_markdown(model: type[BaseModel] = TrainConfig) -> str:
    """The settings reference's table of `model`'s settings (training's, or production's)."""
    lines = ["| setting | default | description |", "|---|---|---|"]
    for name, default, description in settings_rows(model):
        cells = [f"`{name}`", f"`{default}`" if default else "", description.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# The docs page that holds the generated table, between these markers; the prose around them is
# written by hand.
SETTINGS_PAGE = "docs/reference/settings.md"
SETTINGS_START, SETTINGS_END = "<!-- settings:start -->", "<!-- settings:end -->"
# The production loop's settings (`lightning-rl production --live`), on the same page.
LIVE_START, LIVE_END = "<!-- live-settings:start -->", "<!-- live-settings:end -->"


def _with_table(page: str, start: str, end: str, table: str) -> str:
    head, found, rest = page.partition(start)
    _, found_end, tail = rest.partition(end)
    if not (found and found_end):
        raise ValueError(f"no {start} ... {end} section")
    return f"{head}{start}\n{table}{end}{tail}"


def with_settings_table(page: str) -> str:
    """`page` with the text between its settings markers replaced by the generated tables of
    TrainConfig and LiveConfig."""
    from lightning_rl.registry.live_config import LiveConfig

    page = _with_table(page, SETTINGS_START, SETTINGS_END, settings_markdown())
    return _with_table(page, LIVE_START, LIVE_END, settings_markdown(LiveConfig))


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m lightning_rl.flows.config", description="TrainConfig as documentation."
    )
    parser.add_argument("--markdown", action="store_true", help="Print the settings table.")
    parser.add_argument(
        "--update-docs",
        metavar="PATH",
        nargs="?",
        const=SETTINGS_PAGE,
        help=f"Rewrite the table between PATH's markers (default {SETTINGS_PAGE}).",
    )
    args = parser.parse_args(argv)
    if args.update_docs:
        path = Path(args.update_docs)
        path.write_text(with_settings_table(path.read_text()))
    if args.markdown or not args.update_docs:
        print(settings_markdown(), end="")


if __name__ == "__main__":
    main()
