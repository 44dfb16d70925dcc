"""The `lightning-rl` command line, run as a user would."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest
from tests.conftest import free_port
from tests.test_durability import start_server


def cli(*args: str) -> subprocess.CompletedProcess:
    # No LIGHTNING_* settings leak in from the environment running the tests.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    return subprocess.run(
        [sys.executable, "-m", "lightning_rl.flows.cli", *args],
        capture_output=True,
        text=True,
        # Generous: `train` imports torch, Prefect and MLflow, slow on a busy 2-core machine.
        timeout=180,
        env=env,
    )


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
        (["train", "--agent", "mod:fn"], "needs a task loader"),
        (["train", "--run-name", "../up"], "run_name"),
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
