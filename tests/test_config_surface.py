"""TrainConfig is declared once: the flow's parameters, the `lightning-rl train` options and the
docs' settings table all follow from it, with the same names, defaults and descriptions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.exceptions import ParameterTypeError
from pydantic import BaseModel

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.options import train_fields
from lightning_rl.flows.cli.train import train_command
from lightning_rl.flows.config import (
    SECTIONS,
    SETTINGS_END,
    SETTINGS_PAGE,
    SETTINGS_START,
    TrainConfig,
    flat_names,
    nested_models,
    settings_markdown,
    train_config_parameters,
)

REPO = Path(__file__).resolve().parents[1]
FIELDS = list(TrainConfig.model_fields)
DEFAULTS = TrainConfig().model_dump(mode="json")
COMMAND_ONLY = {"config", "preset", "resume", "quiet"}
# The options: the top-level settings, and each section's by its flat name.
OPTIONS = [name for name in FIELDS if name not in SECTIONS] + list(flat_names())


def _leaf(where: tuple[str, ...]) -> tuple[Any, Any]:
    """(field info, TrainConfig's default) of the setting at `where`."""
    value: Any = TrainConfig()
    for name in where[:-1]:
        value = getattr(value, name)
    return type(value).model_fields[where[-1]], getattr(value, where[-1])


def _described(name: str) -> tuple[str, Any]:
    """(description, default) of option `name`."""
    if name in flat_names():
        field, default = _leaf(flat_names()[name])
        return field.description or "", default
    return TrainConfig.model_fields[name].description or "", getattr(TrainConfig(), name)


@flow(name="config-surface")
@train_config_parameters
def config_flow(**params: Any) -> TrainConfig:
    return TrainConfig.model_validate(params)


def _schema_defaults(properties: dict[str, Any]) -> dict[str, Any]:
    return {name: spec.get("default") for name, spec in properties.items()}


def test_a_flow_over_the_generated_signature_has_every_field_typed_and_described():
    properties = config_flow.parameters.properties
    assert list(properties) == FIELDS
    assert _schema_defaults(properties) == DEFAULTS
    for name, field in TrainConfig.model_fields.items():
        assert properties[name].get("description") == field.description, name
    assert properties["iterations"]["minimum"] == 1  # constraints reach the schema
    rollouts = config_flow.parameters.definitions["RolloutConfig"]["properties"]
    assert rollouts["task_runner"]["enum"] == ["threads", "ray", "dask"]  # and the sections' too
    assert set(SECTIONS) <= set(nested_models())
    # Nested settings stay typed: a reference to their model's schema.
    for name, model in nested_models().items():
        assert properties[name]["$ref"] == f"#/definitions/{model.__name__}"


def test_the_generated_parameters_validate_and_coerce_as_prefect_does():
    assert config_flow.validate_parameters({"iterations": "3"})["iterations"] == 3
    with pytest.raises(ParameterTypeError, match="iterations"):
        config_flow.validate_parameters({"iterations": 0})
    with pytest.raises(ParameterTypeError, match="task_runner"):
        config_flow.validate_parameters({"rollouts": {"task_runner": "slurm"}})
    # Called outside a flow run, the function sees only what was passed.
    config = config_flow.fn(iterations=3, trainer={"learning_rate": 1e-3})
    assert config.iterations == 3 and config.trainer.learning_rate == 1e-3


def test_the_decorator_wants_a_function_of_keyword_parameters_only():
    def positional(a, **params):
        return params

    with pytest.raises(TypeError, match="params only"):
        train_config_parameters(positional)


def test_the_train_flow_takes_exactly_the_config_fields():
    from lightning_rl.flows.train import train

    properties = train.parameters.properties
    assert list(properties) == FIELDS
    assert _schema_defaults(properties) == DEFAULTS


def _options() -> dict[str, Any]:
    return {p.name: p for p in train_command().params}


def test_the_train_command_has_one_option_per_setting_and_its_own_four():
    options = _options()
    assert set(options) - {"help"} == set(OPTIONS) | COMMAND_ONLY
    assert "--group-size" in options["group_size"].opts and "--data" in options["data"].opts
    for name in OPTIONS:
        option = options[name]
        assert f"--{name.replace('_', '-')}" in option.opts, name
        assert option.default is None, f"{name}: an option defaults to 'not given'"
        description, _ = _described(name)
        assert (option.help or "").startswith(description[:30].replace("[", "\\[")), name


def test_the_options_show_the_configs_defaults():
    options = _options()
    for name in OPTIONS:
        _, default = _described(name)
        if isinstance(default, BaseModel) or default is None:
            assert options[name].show_default is False, name
        else:
            assert options[name].show_default == str(default), name


def test_the_options_keep_their_earlier_names_and_kinds():
    options = _options()
    assert "--train-agent" in options["train_agents"].opts and options["train_agents"].multiple
    assert options["policy_per_agent"].secondary_opts == [
        "--no-policy-per-agent",
        "--shared-policy",
    ]
    assert options["policy_per_agent"].opts == ["--policy-per-agent"]
    assert options["trainer"].metavar == "JSON"


def _given(**flags: Any) -> dict[str, Any]:
    return {name: flags.get(name) for name in OPTIONS}


def test_flags_win_over_the_config_file_and_nested_ones_merge_key_by_key(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps({"agent": "sql", "iterations": 5, "trainer": {"weight_decay": 0.1}})
    )
    flags = _given(iterations=7, trainer='{"learning_rate": 1e-4}', train_agents=["writer"])
    settings = TrainConfig.model_validate(train_fields(flags, config, None))
    assert (settings.agent, settings.iterations, settings.train_agents) == ("sql", 7, ["writer"])
    # The flag's keys over the file's over TrainConfig's demo trainer (not TrainerConfig's).
    assert settings.trainer.learning_rate == 1e-4 and settings.trainer.weight_decay == 0.1
    assert settings.trainer.lora == TrainConfig().trainer.lora


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"trainer": "{bad"}, "--trainer takes a JSON object"),
        ({"credit": "[1]"}, "--credit takes a JSON object"),
        ({"trainer": '{"learnin_rate": 1}'}, "unknown training settings: trainer.learnin_rate"),
    ],
)
def test_nested_flags_refuse_what_is_not_a_settings_object(flags, message):
    with pytest.raises(LightningError, match=message):
        train_fields(_given(**flags), None, None)


def test_resume_starts_from_the_runs_saved_config_and_flags_change_it(tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    saved = TrainConfig(agent="sql", iterations=4, run_name="r1").model_dump(mode="json")
    (run / "config.json").write_text(json.dumps(saved))
    fields = train_fields(_given(iterations=9, run_dir=str(tmp_path / "runs")), None, "r1")
    settings = TrainConfig.model_validate(fields)
    assert (settings.agent, settings.iterations, settings.run_name) == ("sql", 9, "r1")
    assert settings.run_dir == str(tmp_path / "runs")
    with pytest.raises(LightningError, match=r"cannot resume r2: no .*config\.json"):
        train_fields(_given(run_dir=str(tmp_path / "runs")), None, "r2")
    with pytest.raises(LightningError, match="disagree"):
        train_fields(_given(run_dir=str(tmp_path / "runs"), run_name="other"), None, "r1")


def test_the_docs_settings_table_is_the_generated_one():
    page = (REPO / SETTINGS_PAGE).read_text()
    section = page.split(SETTINGS_START, 1)[1].split(SETTINGS_END, 1)[0]
    assert section.strip() == settings_markdown().strip(), (
        f"{SETTINGS_PAGE}'s settings table is stale: run "
        "`python -m lightning_rl.flows.config --update-docs`"
    )
    for name, model in nested_models().items():
        for field in model.model_fields:
            assert f"`{name}.{field}`" in section
    # And production's settings (lightning-rl production --live), on the same page.
    from lightning_rl.flows.config import LIVE_END, LIVE_START
    from lightning_rl.registry.live_config import LiveConfig

    live = page.split(LIVE_START, 1)[1].split(LIVE_END, 1)[0]
    assert live.strip() == settings_markdown(LiveConfig).strip(), "stale: --update-docs"
    assert "`gate.alpha`" in live and "`canary_fraction`" in live


def test_a_literal_setting_takes_only_its_choices():
    from typer.testing import CliRunner

    from lightning_rl.flows import cli  # noqa: F401  (adds train to the app)
    from lightning_rl.flows.cli import app

    result = CliRunner().invoke(app, ["train", "--task-runner", "slurm"])
    assert result.exit_code == 2
    assert "slurm" in result.output and "threads" in result.output


def test_flags_reach_the_settings_under_their_field_names(monkeypatch):
    from typer.testing import CliRunner

    from lightning_rl.flows.cli import app
    from lightning_rl.flows.cli import train as cli

    seen: dict[str, Any] = {}

    def capture(options: dict[str, Any], config: Path | None, resume: str | None) -> None:
        seen.update(options, config=config, resume=resume)
        raise LightningError("stop here")

    monkeypatch.setattr(cli, "train_fields", capture)
    # Not in the test process: they set Prefect's environment and a SIGTERM handler.
    monkeypatch.setattr(cli, "quiet_prefect", lambda: None)
    monkeypatch.setattr(cli, "interrupt_on_sigterm", lambda: None)
    args = ["--shared-policy", "--train-agent", "a", "--train-agents", "b", "--iterations", "3"]
    args += ["--trainer", "{}", "--resume", "r1"]
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["policy_per_agent"] is False and seen["train_agents"] == ["a", "b"]
    assert seen["iterations"] == 3 and seen["trainer"] == "{}" and seen["resume"] == "r1"
    assert seen["agent"] is None and seen["config"] is None  # not given


def test_a_users_success_threshold_is_kept_and_the_profiles_fills_in_only_when_unset():
    from lightning_rl.flows.profiles import profile
    from lightning_rl.flows.run_context import credit as _credit

    rag = profile("rag", None)
    assert _credit(TrainConfig(agent="rag"), rag).success_threshold == rag.success_threshold
    mine = TrainConfig(agent="rag", credit={"success_threshold": 0.5})
    assert _credit(mine, rag).success_threshold == 0.5


def test_settings_by_their_flat_names_are_read_into_their_sections_with_a_notice(
    tmp_path, capsys, caplog
):
    # A config file of an earlier release (and a resumed run's saved config) is flat.
    config = tmp_path / "old.json"
    config.write_text(json.dumps({"group_size": 8, "model": "tiny", "temperature": 0.5}))
    settings = TrainConfig.model_validate(train_fields(_given(), config, None))
    assert settings.rollouts.group_size == 8 and settings.server.model == "tiny"
    assert settings.rollouts.sampling.temperature == 0.5
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "group_size as rollouts.group_size" in notice
    # Flags go by flat names by design: no notice.
    settings = TrainConfig.model_validate(
        train_fields(_given(group_size=3, data="new_tasks"), None, None)
    )
    assert (settings.rollouts.group_size, settings.data.source) == (3, "new_tasks")
    assert capsys.readouterr().err == ""
    # In Python (or a flow's parameters) too, with the notice in the log.
    with caplog.at_level("WARNING"):
        settings = TrainConfig(eval_every=2, data="episodes", episodes_from="http://127.0.0.1:1")
    assert settings.evaluation.eval_every == 2 and settings.data.source == "episodes"
    assert "eval_every as evaluation.eval_every" in caplog.text
    # The grouped name wins over the flat one, and what was passed is left as it was.
    given = {"group_size": 8, "rollouts": {"group_size": 2}}
    assert TrainConfig.model_validate(given).rollouts.group_size == 2
    assert given == {"group_size": 8, "rollouts": {"group_size": 2}}


def test_the_deployments_parameters_are_valid_train_flow_parameters():
    import yaml

    from lightning_rl.flows.train import train

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    trains = [d for d in deployments if d["entrypoint"].endswith("flows/train.py:train")]
    assert len(trains) >= 3
    for deployment in trains:
        params = train.validate_parameters(deployment.get("parameters") or {})
        TrainConfig.model_validate(params)  # and as the flow reads them


def test_serve_settings_and_the_flows_server_agree_field_by_field():
    from lightning_core.serving.config import ServerConfig
    from lightning_core.settings import ServeSettings

    assert TrainConfig.model_fields["server"].annotation is ServerConfig
    assert issubclass(ServeSettings, ServerConfig)
    for name, field in ServerConfig.model_fields.items():
        served = ServeSettings.model_fields[name]
        assert (served.annotation, served.description) == (field.annotation, field.description)
        assert served.get_default(call_default_factory=True) == field.get_default(
            call_default_factory=True
        ), name


def test_the_flows_server_reaches_serve_as_it_was_configured(monkeypatch):
    """The command line `serve_options` makes for a training run's server, read back by the
    `serve` command: the same ServerConfig, every field set away from its default."""
    from typer.main import get_command

    from lightning_core.serving.config import ServerConfig, serve_options
    from lightning_core.settings import ServeSettings
    from lightning_rl.flows.cli import app

    server = ServerConfig(
        host="127.0.0.2",
        backend="vllm",
        model="tiny",
        vllm_url="http://user:secret@127.0.0.1:8000",
        vllm_python="/opt/vllm/bin/python",
        replicas=2,
        backend_options={"max_model_len": 4096},
    )
    assert {
        n for n in ServerConfig.model_fields if getattr(server, n) != getattr(ServerConfig(), n)
    } == set(ServerConfig.model_fields)
    options, env = serve_options(server)
    assert "secret" not in " ".join(options)  # the URL's password never on a command line
    command = get_command(app).commands["serve"]
    params = command.make_context("serve", list(options)).params
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    given = {k: v for k, v in params.items() if v is not None}
    given["backend_options"] = json.loads(given["backend_options"])
    settings = ServeSettings(**given)
    assert (
        ServerConfig.model_validate(settings.model_dump(include=set(ServerConfig.model_fields)))
        == server
    )
