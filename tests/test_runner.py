"""The rollout runner against real stores (in process and over HTTP), and its command line."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_core import semconv
from lightning_core.errors import InvalidInput
from lightning_core.rollouts.agent_ref import load_agent
from lightning_core.rollouts.runner import EXCEPTION_SPAN, AttemptResult, Runner, RunnerConfig
from lightning_core.security.keys import agent_key
from lightning_core.serving.process import start_serve, stop_serve
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import AttemptStatus, LLMEndpoint, RolloutRequest, RolloutStatus
from tests import runner_agents
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
GATEWAY = "http://gateway.test"


def _runner(agent: Any, store: Any, **config: Any) -> Runner:
    gateway = store.url if isinstance(store, HttpStoreClient) else GATEWAY
    config.setdefault("poll_wait_s", 0.05)
    return Runner(agent, store, gateway, RunnerConfig(**config), api_key="k")


async def test_sync_and_async_agents_succeed_with_their_rewards(make_store):
    store = await make_store()
    seen: list[LLMEndpoint] = []

    def sync_agent(task: dict, llm: LLMEndpoint) -> float:
        seen.append(llm)
        return runner_agents.echo_agent(task, llm)

    sampling = {"temperature": 0.0}
    requests = [
        RolloutRequest(input={"reward": 0.5}, policy_version="v3"),
        RolloutRequest(input={"reward": 2}, metadata={"sampling": sampling}),
    ]
    returned = await store.enqueue_rollouts(requests)
    emitted = await store.enqueue_rollouts([RolloutRequest(input={"reward": 0.75})])

    stats = await _runner(sync_agent, store).run(max_rollouts=2)
    assert (stats.succeeded, stats.failed) == (2, 0)
    done = await _runner(runner_agents.emitting_agent, store).run_until_done(
        [emitted[0].rollout_id], timeout=30
    )
    assert [r.episode_return for r in done] == [0.75]

    by_id = {r.rollout_id: r for r in await store.query_rollouts()}
    assert [by_id[r.rollout_id].episode_return for r in returned] == [0.5, 2.0]
    assert all(r.status is RolloutStatus.succeeded for r in by_id.values())
    for rollout in [*returned, *emitted]:
        spans = await store.query_spans([rollout.rollout_id])
        rewards = [s for s in spans if s.name == semconv.REWARD_SPAN]
        assert [r.attributes[semconv.REWARD_VALUE] for r in rewards] == [
            by_id[rollout.rollout_id].episode_return
        ]

    # Each attempt's endpoint is the gateway under the attempt's prefix, with the rollout's model.
    by_model = {llm.model: llm for llm in seen}
    assert set(by_model) == {"v3", "base"}
    [first] = await store.query_attempts(returned[0].rollout_id)
    prefix = f"/rollouts/{returned[0].rollout_id}/attempts/{first.attempt_id}/v1"
    assert by_model["v3"].base_url.endswith(prefix)
    assert by_model["base"].sampling == sampling and by_model["v3"].sampling == {}
    # Each agent gets its attempt's key, never the runner's (keys.agent_key).
    assert by_model["v3"].api_key == agent_key("k", first.attempt_id)


def failing_agent(task: Any, llm: LLMEndpoint) -> float:
    raise ValueError("boom at step 3")


async def test_a_failing_agent_is_retried_then_its_rollout_fails(make_store):
    store = await make_store()
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input={}, max_attempts=3)])

    [done] = await _runner(failing_agent, store, concurrency=2).run_until_done(
        [rollout.rollout_id], timeout=30
    )

    assert done.status is RolloutStatus.failed and done.attempt_count == 3
    attempts = await store.query_attempts(rollout.rollout_id)
    assert [a.status for a in attempts] == [AttemptStatus.failed] * 3
    assert {a.error for a in attempts} == {"ValueError: boom at step 3"}
    spans = await store.query_spans([rollout.rollout_id])
    assert sorted(s.attempt_id for s in spans) == sorted(a.attempt_id for a in attempts)
    for span in spans:
        assert span.name == EXCEPTION_SPAN and span.status_code == "error"
        assert span.attributes["exception.type"] == "ValueError"
        [event] = span.events
        assert event.name == "exception"
        assert event.attributes["exception.message"] == "boom at step 3"
        # The traceback reaches into the agent's own frame, in its thread.
        assert "in failing_agent" in event.attributes["exception.stacktrace"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_an_agent_past_its_time_budget_fails_the_attempt(kind):
    store = DuckDBStore(db=":memory:")

    async def slow_async(task: Any, llm: LLMEndpoint) -> float:
        await asyncio.sleep(30)
        return 1.0

    def slow_sync(task: Any, llm: LLMEndpoint) -> float:
        time.sleep(2)  # a thread cannot be stopped: it runs on, and its result is dropped
        return 1.0

    [rollout] = await store.enqueue_rollouts([RolloutRequest(input={})])
    agent = slow_async if kind == "async" else slow_sync
    started = time.monotonic()
    stats = await _runner(agent, store, rollout_timeout_s=0.3).run(max_rollouts=1)

    assert time.monotonic() - started < 1.5
    assert (stats.succeeded, stats.failed) == (0, 1)
    [attempt] = await store.query_attempts(rollout.rollout_id)
    assert attempt.status is AttemptStatus.failed
    assert "rollout_timeout_s=0.3" in attempt.error
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.failed
    [span] = await store.query_spans([rollout.rollout_id])
    assert span.name == EXCEPTION_SPAN and span.attributes["exception.type"] == "AttemptTimeout"
    await store.close()


async def test_a_slow_agent_sends_heartbeats():
    store = DuckDBStore(db=":memory:")
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input={})])
    beats: list[float] = []

    async def slow(task: Any, llm: LLMEndpoint) -> float:
        await asyncio.sleep(0.5)
        # The agent has sent no span, so only heartbeats can have moved last_heartbeat_at.
        [attempt] = await store.query_attempts(rollout.rollout_id)
        beats.append(attempt.last_heartbeat_at - attempt.started_at)
        return 1.0

    await _runner(slow, store, heartbeat_interval_s=0.05).run(max_rollouts=1)
    assert beats[0] >= 0.3
    await store.close()


async def test_concurrency_bounds_the_agents_running_at_once_and_max_rollouts_the_claims():
    store = DuckDBStore(db=":memory:")
    await store.enqueue_rollouts([RolloutRequest(input={"reward": 1}) for _ in range(10)])
    running, most = 0, 0
    finished: list[AttemptResult] = []

    async def agent(task: Any, llm: LLMEndpoint) -> float:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        return 1.0

    runner = _runner(agent, store, concurrency=3)
    runner.on_attempt = finished.append
    stats = await runner.run(max_rollouts=8)

    assert most == 3
    assert stats.succeeded == 8 and len(finished) == 8
    queued = await store.query_rollouts(status=[RolloutStatus.queuing])
    assert len(queued) == 2
    await store.close()


async def test_stopping_hard_fails_the_attempts_in_flight_for_a_retry():
    store = DuckDBStore(db=":memory:")
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input={}, max_attempts=2)])
    started = asyncio.Event()

    async def stuck(task: Any, llm: LLMEndpoint) -> float:
        started.set()
        await asyncio.sleep(30)
        return 1.0

    run = asyncio.create_task(_runner(stuck, store).run())
    await asyncio.wait_for(started.wait(), 10)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run

    [attempt] = await store.query_attempts(rollout.rollout_id)
    assert attempt.status is AttemptStatus.failed and "runner stopped" in attempt.error
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.requeuing
    await store.close()


async def test_a_bad_reward_fails_the_attempt():
    store = DuckDBStore(db=":memory:")
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input={})])

    async def wordy(task: Any, llm: LLMEndpoint) -> Any:
        return "very good"

    await _runner(wordy, store).run(max_rollouts=1)
    [attempt] = await store.query_attempts(rollout.rollout_id)
    assert attempt.status is AttemptStatus.failed and "'very good'" in attempt.error
    await store.close()


# ---------------------------------------------------------------------------- agent references


def test_load_agent_finds_functions_by_reference():
    assert load_agent("tests.runner_agents:echo_agent") is runner_agents.echo_agent


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("tests.no_such_module:agent", "no module named 'tests.no_such_module'"),
        ("no_such_agent", "no module named 'lightning_rl.agents.no_such_agent'"),
        ("tests.runner_agents:missing", "has no attribute 'missing'"),
        ("tests.runner_agents:NOT_CALLABLE", "is a int, not a callable"),
        ("tests.runner_agents:", "malformed"),
        ("a:b:c", "malformed"),
    ],
)
def test_load_agent_says_what_it_tried(ref, says):
    with pytest.raises(InvalidInput, match="agent") as caught:
        load_agent(ref)
    assert says in str(caught.value)


# ---------------------------------------------------------------------------- command line


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    return subprocess.run(
        [sys.executable, "-m", "lightning_rl.flows.cli", "runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def test_the_runner_command_works_a_served_queue(tmp_path):
    port = free_port()
    server = start_serve(tmp_path / "s.duckdb", port, "--backend", "none")
    url = f"http://127.0.0.1:{port}"
    try:

        async def enqueue() -> list[str]:
            client = HttpStoreClient(url)
            rollouts = await client.enqueue_rollouts(
                [RolloutRequest(input={"reward": i}) for i in range(3)]
            )
            await client.close()
            return [r.rollout_id for r in rollouts]

        async def results(ids: list[str]) -> tuple[list, list]:
            client = HttpStoreClient(url)
            rollouts = await client.query_rollouts(rollout_ids=ids)
            spans = await client.query_spans(ids)
            await client.close()
            return rollouts, spans

        ids = asyncio.run(enqueue())
        ran = _cli(
            "--server", url, "--agent", "tests.runner_agents:echo_agent", "--max-rollouts", "3"
        )
        assert ran.returncode == 0, ran.stderr
        assert "3 succeeded, 0 failed" in ran.stderr
        rollouts, spans = asyncio.run(results(ids))
    finally:
        stop_serve(server)
    by_id = {r.rollout_id: r for r in rollouts}
    assert [by_id[i].episode_return for i in ids] == [0.0, 1.0, 2.0]
    names = sorted(s.name for s in spans)
    assert names == sorted([semconv.TOOL_SPAN, semconv.REWARD_SPAN] * 3)
    # The agent was handed the served gateway under its attempt's prefix.
    outputs = {s.attributes["lightning.tool.output"] for s in spans if s.name == semconv.TOOL_SPAN}
    assert all(o.startswith(f"{url}/rollouts/") and o.endswith("/v1") for o in outputs)


def test_ctrl_c_lets_attempts_in_flight_finish_and_twice_fails_them(tmp_path):
    port = free_port()
    server = start_serve(tmp_path / "s.duckdb", port, "--backend", "none")
    url = f"http://127.0.0.1:{port}"

    async def enqueue(sleep: float) -> str:
        client = HttpStoreClient(url)
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input={"sleep": sleep})])
        await client.close()
        return rollout.rollout_id

    async def wait_status(rollout_id: str, wanted: set[RolloutStatus]) -> Any:
        client = HttpStoreClient(url)
        try:
            for _ in range(200):
                rollout = await client.get_rollout(rollout_id)
                if rollout.status in wanted:
                    return rollout, await client.query_attempts(rollout_id)
                await asyncio.sleep(0.05)
            raise AssertionError(f"rollout {rollout_id} never became {wanted}")
        finally:
            await client.close()

    def interrupted(sleep: float, times: int) -> tuple[subprocess.CompletedProcess, Any]:
        rollout_id = asyncio.run(enqueue(sleep))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
        command = [sys.executable, "-m", "lightning_rl.flows.cli", "runner", "--server", url]
        proc = subprocess.Popen(
            [*command, "--agent", "tests.runner_agents:sleepy_agent"],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        asyncio.run(wait_status(rollout_id, {RolloutStatus.running}))
        for _ in range(times):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        _, stderr = proc.communicate(timeout=30)
        finished = {RolloutStatus.succeeded, RolloutStatus.requeuing, RolloutStatus.failed}
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr), asyncio.run(
            wait_status(rollout_id, finished)
        )

    try:
        graceful, (rollout, _) = interrupted(sleep=1.0, times=1)
        hard, (cut, [attempt]) = interrupted(sleep=60.0, times=2)
    finally:
        stop_serve(server)
    assert graceful.returncode == 0, graceful.stderr
    assert "stopping" in graceful.stderr and "1 succeeded, 0 failed" in graceful.stderr
    assert rollout.status is RolloutStatus.succeeded and rollout.episode_return == 1.0
    # The second Ctrl-C does not wait for the agent's thread (it sleeps a minute).
    assert hard.returncode == 0, hard.stderr
    assert cut.status is RolloutStatus.failed and "runner stopped" in attempt.error


def test_the_runner_command_without_a_server_says_so():
    ran = _cli(
        "--server", f"http://127.0.0.1:{free_port()}", "--agent", "tests.runner_agents:echo_agent"
    )
    assert ran.returncode == 2
    assert "cannot reach the store" in ran.stderr and "Traceback" not in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1


def test_the_runner_command_with_a_bad_agent_says_so():
    ran = _cli("--agent", "tests.runner_agents:nope")
    assert ran.returncode == 2
    assert "has no attribute 'nope'" in ran.stderr and "Traceback" not in ran.stderr
