"""The policy server (store + gateway + backend, a child of the flow) SIGKILLed while an
iteration's rollouts run: the flow restarts it on the same store file and port, the restarted
gateway serves the current policy version, and the run completes with every planned rollout
accounted for and its MLflow history whole.

The run goes through the CLI as a user runs it (tiny model, real policy server, the tests'
shared Prefect server, MLflow on SQLite); the test finds the server's process and kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from lightning_core.errors import InvalidInput, LightningError, StoreUnavailable
from lightning_core.serving import process as serving
from lightning_core.store import DuckDBStore, HttpStoreClient
from lightning_core.types import AttemptStatus, RolloutRequest, RolloutStatus
from tests import flow_agents

AGENT_DELAY_S = 0.3
CONFIG = {
    "agent": "tests.test_fault_server:slow_agent",
    "tasks": "tests.flow_agents:load_tasks",
    "model": "tiny",
    "iterations": 2,
    "tasks_per_iteration": 3,
    "group_size": 4,
    "temperature": 1.0,
    "eval_size": 4,
    "eval_every": 1,
    "max_attempts": 3,
    "rollout_workers": 1,
    "rollout_concurrency": 2,
    "seed": 5,
}


def slow_agent(task: dict[str, Any], llm: Any) -> float:
    """flow_agents.agent after a pause: a rollout lasts long enough for the kill to land in
    the middle of the iteration's rollouts, with attempts in flight."""
    time.sleep(AGENT_DELAY_S)
    return flow_agents.agent(task, llm)


def _events(run: Path) -> list[dict]:
    path = run / "progress.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _serve_pids(store: Path) -> list[int]:
    """The `lightning-rl serve` processes of `store` (not its database worker)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(store).encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


def _kill_server_in_iteration_2(proc: subprocess.Popen, run: Path) -> tuple[int, int]:
    """SIGKILL the policy server once iteration 2 has rollouts under way; its pid, and how
    many of the iteration's attempts had finished."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before iteration 2"
        events = _events(run)
        started = [i for i, e in enumerate(events) if e["stage"] == "iteration"]
        finished = (
            [e for e in events[started[1] :] if e["stage"] == "rollout"]
            if len(started) >= 2
            else []
        )
        if finished:
            [pid] = _serve_pids(run / "store.duckdb")
            os.kill(pid, signal.SIGKILL)
            return pid, len(finished)
        time.sleep(0.05)
    raise AssertionError("iteration 2 did not start in time")


def _store_state(db: Path) -> tuple[list, dict[str, list]]:
    async def read() -> tuple[list, dict[str, list]]:
        store = DuckDBStore(db=str(db))
        try:
            rollouts = await store.query_rollouts()
            attempts = {r.rollout_id: await store.query_attempts(r.rollout_id) for r in rollouts}
            return rollouts, attempts
        finally:
            await store.close()

    return asyncio.run(read())


async def test_an_enqueue_sent_again_is_answered_with_the_rollouts_it_made(tmp_path):
    store = DuckDBStore(db=str(tmp_path / "store.duckdb"))
    try:
        requests = [RolloutRequest(input=i, rollout_id=f"ro-{i}") for i in range(3)]
        first = await store.enqueue_rollouts(requests)
        again = await store.enqueue_rollouts([*requests, RolloutRequest(input=9)])
        assert [r.rollout_id for r in first] == ["ro-0", "ro-1", "ro-2"]
        assert again[:3] == first
        assert len(await store.query_rollouts()) == 4
        with pytest.raises(InvalidInput, match="same rollout_id"):
            await store.enqueue_rollouts([RolloutRequest(input=1, rollout_id="ro-x")] * 2)
    finally:
        await store.close()
    with pytest.raises(ValueError, match="rollout_id"):
        RolloutRequest(input=1, rollout_id="../x")


async def test_store_calls_wait_out_a_restart_and_past_max_restarts_fail_clearly(tmp_path):
    """A store-only server under supervision, SIGKILLed with a claimed attempt: the calls made
    while it is down return once it is back; killed once more than allowed, it stays down and
    says why."""
    port = serving.free_port()
    db = tmp_path / "store.duckdb"
    supervised = await asyncio.to_thread(
        serving.Supervised,
        lambda: serving.start_serve(
            db, port, "--backend", "none", timeout=60, preexec_fn=serving.die_with_parent
        ),
        1,
    )
    try:
        async with HttpStoreClient(f"http://127.0.0.1:{port}", retry_s=60) as store:
            queued = await store.enqueue_rollouts(
                [RolloutRequest(input=i, max_attempts=2) for i in range(3)]
            )
            claim = await store.dequeue("w-0")
            assert claim is not None
            # A read waits for every write before it: the claim is on disk now (a claim alone
            # is not waited for; lost with the server, its rollout would simply be queued).
            assert (await store.get_rollout(claim.rollout.rollout_id)).status == "running"
            first = supervised.proc
            first.kill()
            # Sent while it is down: answered by the restarted server, from the same file.
            done, rollouts = await asyncio.gather(
                store.complete_attempt(claim.attempt.attempt_id, 1.0),
                store.query_rollouts(rollout_ids=[r.rollout_id for r in queued]),
            )
            assert supervised.restarts == 1 and supervised.proc is not first
            assert done.status is RolloutStatus.succeeded and done.episode_return == 1.0
            assert len(rollouts) == 3
            assert sorted(r.status for r in rollouts).count(RolloutStatus.queuing) == 2
            # A complete sent again after a lost answer is refused, not applied twice.
            with pytest.raises(LightningError, match="no longer running"):
                await store.complete_attempt(claim.attempt.attempt_id, 0.0)

            supervised.proc.kill()
            for _ in range(300):
                if supervised.failure is not None:
                    break
                await asyncio.sleep(0.1)
            assert supervised.failure is not None and "max_restarts=1" in supervised.failure
            store.retry_s = 2
            with pytest.raises(StoreUnavailable, match="tried for 2 s"):
                await store.get_rollout(done.rollout_id)
    finally:
        supervised.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.fault(
    name="policy server SIGKILLed mid-iteration",
    injected="SIGKILL to the `lightning-rl serve` child of a training flow while iteration 2's "
    "rollouts run",
    outcome="restarted on the same store and port with policy v1 served; the run completes; "
    "every planned rollout succeeded or failed after its attempts; MLflow history whole",
)
def test_a_policy_server_killed_mid_iteration_is_restarted_and_the_run_completes(
    tmp_path, prefect_api_env
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_", "PREFECT_"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # The kill is the policy server's, not Prefect's: the flow runs on the tests' shared
    # Prefect server rather than starting a temporary one (flows/prefect_server.py).
    env.update(prefect_api_env)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = tmp_path / "config.json"
    registry = {"tracking_uri": uri, "registered_model": "fault-server"}
    config.write_text(
        json.dumps({**CONFIG, "run_dir": str(tmp_path / "runs"), "registry": registry})
    )
    run = tmp_path / "runs" / "killed"
    log = tmp_path / "flow.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_rl.flows.cli", "train", "--config", str(config),
             "--run-name", "killed"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        killed, finished_before = _kill_server_in_iteration_2(proc, run)
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "restarting it on the same store and port" in text, text[-4000:]
    assert killed not in _serve_pids(run / "store.duckdb")

    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "checkpoint.json").read_text())["iteration"] == 2
    client = MlflowClient(uri, registry_uri=uri)
    run_id = summary["mlflow_run_id"]
    for key, steps in (
        ("rollout/reward_mean", [1, 2]),
        ("eval/score", [0, 1, 2]),
        ("server/restarts", [1, 2]),
    ):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == steps, key
    restarts = {m.step: m.value for m in client.get_metric_history(run_id, "server/restarts")}
    assert restarts == {1: 0.0, 2: 1.0}
    [version] = client.search_model_versions("name = 'fault-server'")
    assert version.tags["policy_version"] == "killed-v2"

    # Every rollout iteration 2 planned is finished: succeeded, or failed after its attempts.
    rollouts, attempts = _store_state(run / "store.duckdb")
    planned = [r for r in rollouts if (r.group_id or "").startswith("killed-it2-")]
    drawn = client.get_metric_history(run_id, "rollout/tasks_drawn")
    assert len(planned) == CONFIG["group_size"] * int(next(m.value for m in drawn if m.step == 2))
    for rollout in planned:
        assert rollout.status in (RolloutStatus.succeeded, RolloutStatus.failed), rollout
        assert rollout.policy_version == "killed-v1"
        tries = attempts[rollout.rollout_id]
        if rollout.status is RolloutStatus.failed:
            assert len(tries) == rollout.max_attempts
        assert all(a.status is not AttemptStatus.running for a in tries)
    # The kill came with most of them still to run, and the attempts it cut off (their LLM
    # calls found no server; their claims, not yet on disk, went with it) were run again.
    assert finished_before < len(planned)
    assert all(r.status is RolloutStatus.succeeded for r in planned)
