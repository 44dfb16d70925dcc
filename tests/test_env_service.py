"""Environment services (lightning_core/envs, docs/environments.md) with the SQL databases as the
service (agents/sql/env_service.py), in its own process on loopback.

The test the issue asks for: 32 rollouts run at once by a real Runner against one service
process, each in its own session; every session writes a table of the same name and must see
only its own row. While all 32 are open the service is SIGKILLed and started again: each
rollout's attempt fails (its session is gone) and the runner retries it, in a new session,
to success. Beside it: the service's limits and errors, and OpenEnv's WebSocket protocol.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning_core.app import create_app
from lightning_core.envs.base import ActionRefused, StepOutcome
from lightning_core.envs.client import EnvClient, EnvServiceError, OpenEnvSession
from lightning_core.envs.config import EnvServiceConfig
from lightning_core.envs.server import create_env_app
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.serving.process import free_port, wait_healthy
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import AttemptStatus, RolloutRequest, RolloutStatus
from lightning_rl.agents.sql.data import load_tasks
from tests import env_agents
from tests.conftest import ThreadedServer

SQL_ENV = "lightning_rl.agents.sql.env_service:SQLEnvironment"
ROLLOUTS = 32


def _start_service(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_core.envs", "--env", SQL_ENV, "--port", str(port)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    wait_healthy(proc, port, 60.0, "the SQL environment service")
    return proc


def _sessions(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).json()["sessions"]


def test_32_concurrent_rollouts_share_one_service_in_isolated_sessions_and_survive_a_sigkill(
    tmp_path, monkeypatch
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gate = tmp_path / "gate"
    monkeypatch.setenv("TEST_SQL_ENV_URL", url)
    monkeypatch.setenv("TEST_SQL_ENV_GATE", str(gate))
    tasks = load_tasks("train", ROLLOUTS)
    service = _start_service(port, tmp_path / "service.log")
    store = DuckDBStore(db=":memory:")
    try:
        with ThreadedServer(create_app(store)) as server:

            async def run() -> tuple[list, dict]:
                async with HttpStoreClient(server.url) as client:
                    requests = [RolloutRequest(input=t, max_attempts=2) for t in tasks]
                    ids = [r.rollout_id for r in await client.enqueue_rollouts(requests)]
                    config = RunnerConfig(concurrency=ROLLOUTS, poll_wait_s=0.05)
                    runner = Runner(env_agents.sql_episode, client, server.url, config)
                    running = asyncio.create_task(runner.run_until_done(ids, timeout=240))
                    # Every rollout is inside its episode, its session open on the service
                    # and written to, waiting at the gate.
                    deadline = time.monotonic() + 120
                    while len(list(tmp_path.glob("arrived-*"))) < ROLLOUTS:
                        assert time.monotonic() < deadline, "the 32 sessions never all opened"
                        await asyncio.sleep(0.1)
                    assert await asyncio.to_thread(_sessions, url) == ROLLOUTS
                    os.kill(service.pid, signal.SIGKILL)
                    service.wait(10)
                    restarted = await asyncio.to_thread(
                        _start_service, port, tmp_path / "service.log"
                    )
                    gate.touch()
                    done = await running
                    attempts = {i: await client.query_attempts(i) for i in ids}
                    return done, {"attempts": attempts, "service": restarted}

            done, seen = asyncio.run(run())
            service = seen["service"]
    finally:
        service.kill()
        service.wait(10)
    assert len(done) == ROLLOUTS
    errors = {a.error for attempts in seen["attempts"].values() for a in attempts}
    assert all(r.status is RolloutStatus.succeeded for r in done), errors
    # Isolated: each saw only its own row and its submission of the gold query scored 1.
    assert [r.episode_return for r in done] == [1.0] * ROLLOUTS
    for attempts in seen["attempts"].values():
        # The kill failed each first attempt (its session gone); the retry succeeded.
        assert [a.status for a in attempts] == [AttemptStatus.failed, AttemptStatus.succeeded]
        assert "EnvServiceError" in attempts[0].error and "no session" in attempts[0].error


class Counter:
    """A tiny environment: counts steps; refuses negative actions; fails on 'boom'; sleeps on
    'sleep'; answers huge on 'huge'."""

    def __init__(self) -> None:
        self.count = 0

    def reset(self, task, seed):
        self.count = int(task.get("start", 0)) if isinstance(task, dict) else 0
        return StepOutcome(observation=self.count)

    def step(self, action):
        from lightning_core.envs.base import InvalidAction

        if action == "boom":
            raise RuntimeError("the environment broke")
        if action == "sleep":
            time.sleep(1.0)
        if action == "huge":
            return StepOutcome(observation="x" * 5000)
        if isinstance(action, int) and action < 0:
            raise InvalidAction("a step must not be negative")
        self.count += 1
        return StepOutcome(observation=self.count, reward=1.0, done=self.count >= 3)

    def close(self) -> None:
        pass


LIMITS = EnvServiceConfig(
    max_sessions=2, step_timeout_s=0.3, max_request_bytes=2048, max_observation_bytes=2048
)


@pytest.fixture
def counter_service():
    with ThreadedServer(create_env_app(Counter, LIMITS, api_key="env-key")) as server:
        yield server


def test_the_service_bounds_and_explains_every_failure(counter_service):
    url = counter_service.url

    async def run():
        anonymous = EnvClient(url)
        with pytest.raises(EnvServiceError, match="401"):
            async with anonymous.session({}):
                pass
        # Opening retries a full or unreachable service for 0.5 s here (30 s by default).
        client = EnvClient(url, api_key="env-key", open_wait_s=0.5)
        async with client.session({"start": 1}) as one:
            assert one.first.observation == 1
            with pytest.raises(ActionRefused, match="must not be negative"):
                await one.step(-1)
            assert (await one.step(1)).observation == 2  # the session went on
            async with client.session({}) as _:
                # Two sessions open, the limit: a third is refused (429), after retries.
                with pytest.raises(EnvServiceError, match="429"):
                    async with client.session({}):
                        pass
            with pytest.raises(EnvServiceError, match=r"took longer than 0.3 s"):
                await one.step("sleep")
            with pytest.raises(EnvServiceError, match=r"404.*no session"):
                await one.step(1)  # closed by the timeout
        async with client.session({}) as two:
            with pytest.raises(EnvServiceError, match=r"500.*the environment broke"):
                await two.step("boom")
        async with client.session({}) as three:
            with pytest.raises(EnvServiceError, match=r"500.*max_observation_bytes"):
                await three.step("huge")
        async with client.session({}) as four:
            with pytest.raises(EnvServiceError, match=r"413|over the limit"):
                await four.step("y" * 5000)

    asyncio.run(run())
    health = httpx.get(f"{url}/health").json()
    assert health == {"status": "healthy", "sessions": 0, "max_sessions": 2}


def test_an_openenv_client_drives_the_service_over_its_websocket(counter_service):
    async def run():
        async with OpenEnvSession.connect(counter_service.url, api_key="env-key") as env:
            first = await env.reset(task={"start": 1})
            assert first.observation == 1 and not first.done
            assert (await env.step(1)).observation == 2
            last = await env.step(1)
            assert last.done and last.reward == 1.0
            assert await env.state() == {"episode_id": await _episode(env), "step_count": 2}
            with pytest.raises(ActionRefused, match="must not be negative"):
                await env.step(-1)

    asyncio.run(run())
    assert httpx.get(f"{counter_service.url}/health").json()["sessions"] == 0


async def _episode(env: OpenEnvSession) -> str:
    return (await env.state())["episode_id"]


def test_an_unreachable_service_is_a_service_error_not_the_agents():
    async def run():
        with pytest.raises(EnvServiceError, match="cannot be reached"):
            unreachable = EnvClient(f"http://127.0.0.1:{free_port()}", open_wait_s=1.0)
            async with unreachable.session({}):
                pass

    asyncio.run(run())


# ---------------------------------------------------------------------------- OpenEnv, both ways
# openenv-core 0.3.0 itself (installed by `make setup-dev` without its UI dependencies): its own
# client against our service, and our client against its own server, each hosting the SQL
# environment written to its standard (agents/sql/openenv_env.py).


def test_openenvs_own_client_drives_our_service_hosting_an_openenv_standard_environment():
    from openenv.core import GenericEnvClient

    from lightning_core.envs.openenv import from_openenv
    from lightning_rl.agents.sql.openenv_env import SQLAction, SQLOpenEnv

    [task] = load_tasks("train", 1)
    app = create_env_app(from_openenv(SQLOpenEnv, SQLAction))
    with ThreadedServer(app) as server:

        async def run():
            async with GenericEnvClient(base_url=server.url) as env:
                first = await env.reset(db=task["db"], gold_sql=task["gold_sql"])
                assert "tables" in first.observation and not first.done
                made = await env.step({"sql": "CREATE TABLE scratch (x INTEGER)"})
                assert made.observation["error"] is None
                submitted = await env.step({"submit": task["gold_sql"]})
                assert submitted.done and submitted.reward == 1.0
                with pytest.raises(RuntimeError, match="not a SQLAction"):
                    await env.step({"query": "SELECT 1"})

        asyncio.run(run())
        assert httpx.get(f"{server.url}/health").json()["sessions"] == 0


def test_our_client_drives_openenvs_own_server():
    from openenv.core.env_server import create_app as openenv_app

    from lightning_rl.agents.sql.openenv_env import SQLAction, SQLObservation, SQLOpenEnv

    [task] = load_tasks("train", 1)
    app = openenv_app(SQLOpenEnv, SQLAction, SQLObservation, max_concurrent_envs=4)
    with ThreadedServer(app) as server:

        async def run():
            async with (
                OpenEnvSession.connect(server.url) as one,
                OpenEnvSession.connect(server.url) as two,
            ):
                await one.reset(db=task["db"], gold_sql=task["gold_sql"])
                await two.reset(db=task["db"])
                await one.step({"sql": "CREATE TABLE scratch (x INTEGER)"})
                # Sessions are isolated on OpenEnv's server too: the other copy has no table.
                other = await two.step({"sql": "SELECT * FROM scratch"})
                assert "no such table" in other.observation["error"]
                done = await one.step({"submit": task["gold_sql"]})
                assert done.done and done.reward == 1.0
                assert (await one.state())["step_count"] == 2

        asyncio.run(run())
