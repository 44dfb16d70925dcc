"""The `lightning-rl` command line, run as a user would."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest
from tests.conftest import free_port
from tests.helpers import run_cli
from tests.test_durability import start_server


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args)


@pytest.mark.parametrize(
    "command", [[], ["serve"], ["status"], ["runner"], ["analyze"], ["train"], ["eval"]]
)
def test_every_command_has_help(command):
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--agent", "nope"], "unknown agent 'nope'"),
        (["train", "--iterations", "0"], "iterations"),
        (["train", "--agent", "tests.flow_agents:agent"], "needs a task loader"),
        (["train", "--run-name", "../up"], "run name '../up'"),
        (["eval", "--agent", "nope"], "unknown agent 'nope'"),
    ],
)
def test_train_and_eval_refuse_bad_input_in_one_line(args, message):
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_train_takes_the_agent_from_a_config_file_unless_a_flag_names_one(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"agent": "nope-from-file"}')
    result = cli("train", "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown agent 'nope-from-file'" in result.stderr
    flagged = cli("train", "--config", str(config), "--agent", "nope-flag")
    assert "unknown agent 'nope-flag'" in flagged.stderr


def test_train_resume_of_a_run_that_is_not_there_says_so(tmp_path):
    result = cli("train", "--resume", "gone", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot resume gone" in result.stderr and "config.json" in result.stderr


def test_train_help_lists_every_setting_with_its_description():
    from lightning_rl.flows.config import SECTIONS, TrainConfig, flat_names

    result = cli("train", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # rich wraps the help across lines and boxes
    names = [n for n in TrainConfig.model_fields if n not in SECTIONS] + list(flat_names())
    for name in names:
        assert f"--{name.replace('_', '-')}" in text, name
    for flag in ("--train-agent", "--no-policy-per-agent", "--config", "--resume", "--quiet"):
        assert flag in text
    assert "Training iterations." in text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--agent", "nosuch:agent"], "agent 'nosuch:agent': no module named 'nosuch'"),
        (
            ["--agent", "nosuch:agent", "--tasks", "nosuch:load_tasks"],
            "agent 'nosuch:agent': no module named 'nosuch'",
        ),
        (
            ["--agent", "calc", "--tasks", "nosuch:load_tasks"],
            "task loader 'nosuch:load_tasks': no module named 'nosuch'",
        ),
        (
            ["--agent", "lightning_rl.agents.calc:agentt", "--tasks", "tests.no_such:tasks"],
            "has no attribute 'agentt'; did you mean 'agent'?",
        ),
    ],
)
def test_train_checks_the_agent_and_task_loader_before_a_run_starts(tmp_path, args, says):
    # Before: 22 s, a 50-line traceback from inside the flow naming the task loader for a
    # misspelt agent module, and an empty run folder left behind.
    result = cli("train", *args, "--run-dir", str(tmp_path / "runs"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_setting_in_a_config_file_gets_the_closest_name(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"iteratons": 2, "trainer": {"learnin_rate": 1}, "group_sise": 3}')
    result = cli("train", "--config", str(config))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "iteratons (did you mean iterations?)" in result.stderr
    assert "trainer.learnin_rate (did you mean trainer.learning_rate?)" in result.stderr
    assert "group_sise (did you mean rollouts.group_size?)" in result.stderr


def test_train_help_fits_80_columns_in_sections_without_cutting_a_name():
    from lightning_rl.flows.config import SECTIONS, TrainConfig, flat_names

    result = run_cli("train", "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in result.stdout
    names = [n for n in TrainConfig.model_fields if n not in SECTIONS] + list(flat_names())
    for name in names:  # each name whole, at the start of its entry
        assert any(ln.lstrip().startswith(f"--{name.replace('_', '-')}") for ln in lines), name
    headings = [ln for ln in lines if ln.endswith(":") and not ln.startswith(" ")]
    assert headings[:3] == ["Command:", "Run:", "Rollouts (rollouts.*):"]
    assert len(lines) < 250  # one sentence a setting (it was 513 lines at 80 columns)


def test_eval_takes_the_policy_and_still_understands_model():
    assert "--policy" in cli("eval", "--help").stdout
    result = cli("eval", "--agent", "nope", "--model", "champion")
    assert "eval's --model is now --policy" in result.stderr
    assert result.returncode == 2 and "unknown agent 'nope'" in result.stderr


READ_LOGS = """
import asyncio, json
from prefect.client.orchestration import get_client

async def main():
    async with get_client() as client:
        print(json.dumps([[log.level, log.message] for log in await client.read_logs()]))

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_cli_runs_info_logs_reach_prefect_but_not_the_terminal(tmp_path):
    # A Prefect database of this test's own, which the CLI's temporary server writes to and
    # the one started to read the logs back reads.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_", "PREFECT_"))},
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
    }
    args = ["eval", "--policy", "base", "--base-model", "tiny", "--eval-size", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "lightning_rl.flows.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,  # the flow's runs/ folder
    )
    assert run.returncode == 0, run.stderr
    assert "held-out" not in run.stderr and "Beginning flow run" not in run.stderr
    read = subprocess.run(
        [sys.executable, "-c", READ_LOGS], capture_output=True, text=True, timeout=180, env=env
    )
    assert read.returncode == 0, read.stderr
    logs = json.loads(read.stdout.strip().splitlines()[-1])
    info = [message for level, message in logs if level == logging.INFO]
    assert any(message.startswith("held-out: ") for message in info), logs
    assert any(message.startswith("Beginning flow run") for message in info), logs


def test_status_counts_rollouts_of_a_running_server(tmp_path):
    port = free_port()
    server = start_server(tmp_path / "s.duckdb", port)
    try:

        async def fill() -> None:
            client = HttpStoreClient(f"http://127.0.0.1:{port}")
            await client.enqueue_rollouts([RolloutRequest(input=i) for i in range(3)])
            claim = await client.dequeue("w")
            await client.complete_attempt(claim.attempt.attempt_id, 1.0)
            await client.close()

        asyncio.run(fill())
        result = cli("status", "--server", f"http://127.0.0.1:{port}")
        assert result.returncode == 0, result.stderr
        lines = dict(line.split() for line in result.stdout.splitlines()[1:])
        assert lines == {"queuing": "2", "succeeded": "1", "total": "3"}
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)


def test_status_without_a_server_says_so():
    result = cli("status", "--server", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "cannot reach the store" in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_public_address_without_a_key():
    result = cli("serve", "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "without an API key" in result.stderr and "Traceback" not in result.stderr


def test_serve_rejects_a_bad_setting_without_a_traceback():
    result = cli("serve", "--port", "70000")
    assert result.returncode == 2
    assert "port" in result.stderr and "Traceback" not in result.stderr


def test_serve_with_an_unloadable_model_says_why(tmp_path):
    result = cli("serve", "--db", str(tmp_path / "s.duckdb"), "--model", str(tmp_path))
    assert result.returncode == 2
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_serve_settings_are_the_stores_and_the_gateways_read_from_the_environment(monkeypatch):
    from lightning_core.gateway.service import GatewayConfig
    from lightning_core.settings import ServeSettings
    from lightning_core.store.config import StoreConfig

    for name, value in {
        "DB": "env.duckdb",
        "ATTEMPT_TIMEOUT_S": "12",
        "DUCKDB_THREADS": "2",
        "TOOL_FORMAT": "line",
        "BACKEND_OPTIONS": '{"max_batch_size": 8}',
        "ADAPTER_ROOTS": '["/data/adapters"]',
    }.items():
        monkeypatch.setenv(f"LIGHTNING_{name}", value)
    settings = ServeSettings(port=5000, default_max_tokens=64)
    assert settings.store_config() == StoreConfig(
        db="env.duckdb", attempt_timeout_s=12, duckdb_threads=2
    )
    # Adapters load from the store's folder, and from the roots the operator adds.
    roots = [os.getcwd(), "/data/adapters"]
    assert settings.gateway_config() == GatewayConfig(
        tool_format="line", default_max_tokens=64, adapter_roots=roots
    )
    assert settings.backend_options == {"max_batch_size": 8} and settings.port == 5000
    # Declared once: the store's and the gateway's fields, with their defaults and descriptions.
    for model in (StoreConfig, GatewayConfig):
        for name, field in model.model_fields.items():
            assert repr(ServeSettings.model_fields[name]) == repr(field), name


def test_create_backend_passes_the_backends_own_options_through():
    from lightning_core.backends import create_backend
    from lightning_core.errors import InvalidInput

    with pytest.raises(InvalidInput, match="no option 'max_batch'"):
        create_backend("transformers", "tiny", options={"max_batch": 3})
    backend = create_backend(
        "transformers", "tiny", options={"max_batch_size": 3, "served_model_name": "t"}
    )
    try:
        assert backend.config.max_batch_size == 3 and backend.base_model == "t"
        assert backend.config.model == "tiny"
    finally:
        asyncio.run(backend.close())


def test_serve_refuses_an_option_its_backend_does_not_have(tmp_path):
    result = cli(
        "serve", "--db", str(tmp_path / "s.duckdb"), "--backend-options", '{"max_batch": 3}'
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no option 'max_batch'" in result.stderr


def test_serve_runs_the_gateway_with_a_model(tmp_path):
    import openai

    port = free_port()
    server = start_server(tmp_path / "s.duckdb", port, "--model", "tiny")
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        [model] = api.models.list().data
        answer = api.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.usage.completion_tokens <= 3
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)
    assert server.returncode == 0
