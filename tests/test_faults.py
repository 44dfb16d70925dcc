"""Rows of the fault matrix (benchmarks/fault_matrix.py): each fault injected for real, each test
asserting that nothing acknowledged is lost and that the run ends in a state the user can act on.

Other rows live beside the code they exercise: the store SIGKILLed (test_durability.py), the
flow SIGKILLed (test_resume.py), the policy server and vLLM killed (test_fault_server.py,
test_fault_vllm.py), MLflow down at registration (the registry's tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchmarks.fault_matrix import FIELDS, MatrixPlugin
from lightning_core.app import create_app
from lightning_core.data import analytics
from lightning_core.errors import DiskFull
from lightning_core.rollouts.runner import EXCEPTION_SPAN, Runner, RunnerConfig
from lightning_core.serving.process import start_serve, stop_serve
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import AttemptStatus, LLMEndpoint, RolloutRequest, RolloutStatus
from tests.conftest import ThreadedServer, free_port

REPO = Path(__file__).resolve().parents[1]


@contextlib.asynccontextmanager
async def served_store(tmp_path: Path):
    """A DuckDB store on disk behind a real HTTP server, and a client of it, as the flow has."""
    store = DuckDBStore(db=str(tmp_path / "store.duckdb"))
    with ThreadedServer(create_app(store)) as server:
        client = HttpStoreClient(server.url)
        try:
            yield client
        finally:
            await client.close()
    await store.close()


def _runner(agent: Any, client: HttpStoreClient, **config: Any) -> Runner:
    return Runner(agent, client, client.url, RunnerConfig(poll_wait_s=0.05, **config))


# ---------------------------------------------------------------------------- agent raises


def raising_agent(task: dict, llm: LLMEndpoint) -> float:
    if task.get("raise"):
        raise ValueError(f"tool exploded on task {task['id']}")
    return float(task["reward"])


@pytest.mark.fault(
    name="agent raises",
    injected="the agent raises ValueError on one task of four, on every attempt",
    outcome="each attempt failed with the error and its traceback span, the rollout retried up "
    "to max_attempts=3 then failed; the runner goes on and the other rollouts succeed",
)
async def test_an_agent_that_raises_is_retried_then_failed_and_the_run_goes_on(tmp_path):
    async with served_store(tmp_path) as client:
        tasks = [{"id": i, "reward": i / 4, "raise": i == 1} for i in range(4)]
        queued = await client.enqueue_rollouts(
            [RolloutRequest(input=t, max_attempts=3) for t in tasks]
        )
        ids = [r.rollout_id for r in queued]
        runner = _runner(raising_agent, client, concurrency=2)

        done = await runner.run_until_done(ids, timeout=60)

        assert sorted(r.rollout_id for r in done) == sorted(ids)  # every acknowledged rollout
        by_id = {r.rollout_id: r for r in done}
        bad = by_id[ids[1]]
        assert bad.status is RolloutStatus.failed and bad.attempt_count == 3
        attempts = await client.query_attempts(bad.rollout_id)
        assert [a.status for a in attempts] == [AttemptStatus.failed] * 3
        assert {a.error for a in attempts} == {"ValueError: tool exploded on task 1"}
        spans = await client.query_spans([bad.rollout_id])
        assert sorted(s.attempt_id for s in spans if s.name == EXCEPTION_SPAN) == sorted(
            a.attempt_id for a in attempts
        )
        for i in (0, 2, 3):
            assert by_id[ids[i]].status is RolloutStatus.succeeded
            assert by_id[ids[i]].episode_return == i / 4
        assert (runner.stats.succeeded, runner.stats.failed) == (3, 3)


# ---------------------------------------------------------------------------- agent hangs


@pytest.mark.fault(
    name="agent hangs past its timeout",
    injected="a sync agent blocks its thread forever (rollout_timeout_s=0.5, concurrency=1)",
    outcome="each attempt failed at the time budget, the rollout retried once then failed; the "
    "runner's slot is freed while the thread hangs, so the next rollout succeeds",
)
async def test_an_agent_hanging_past_its_timeout_does_not_stick_the_runner(tmp_path):
    release = threading.Event()
    hung = []

    def hanging_agent(task: dict, llm: LLMEndpoint) -> float:
        if task.get("hang"):
            hung.append(threading.current_thread())
            release.wait(120)  # a thread cannot be stopped: only the test lets it go
        return 1.0

    try:
        async with served_store(tmp_path) as client:
            queued = await client.enqueue_rollouts(
                [
                    RolloutRequest(input={"hang": True}, max_attempts=2),
                    RolloutRequest(input={"hang": False}),
                ]
            )
            stuck, fine = (r.rollout_id for r in queued)
            runner = _runner(hanging_agent, client, concurrency=1, rollout_timeout_s=0.5)
            started = time.monotonic()

            done = {r.rollout_id: r for r in await runner.run_until_done([stuck, fine], 60)}

            assert time.monotonic() - started < 15
            # Both hung threads still block, yet the runner finished its work around them.
            assert len(hung) == 2 and all(t.is_alive() for t in hung)
            assert done[fine].status is RolloutStatus.succeeded
            assert done[fine].episode_return == 1.0
            assert done[stuck].status is RolloutStatus.failed
            attempts = await client.query_attempts(stuck)
            assert [a.status for a in attempts] == [AttemptStatus.failed] * 2
            assert all("rollout_timeout_s=0.5" in a.error for a in attempts)
    finally:
        release.set()


# ---------------------------------------------------------------------------- runner killed


async def _wait_until(client: HttpStoreClient, ids: list[str], status: RolloutStatus) -> None:
    for _ in range(600):
        rollouts = await client.query_rollouts(rollout_ids=ids)
        if len(rollouts) == len(ids) and all(r.status is status for r in rollouts):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"rollouts {ids} never all became {status}")


@pytest.mark.fault(
    name="runner SIGKILLed mid-rollout",
    injected="SIGKILL to a `lightning-rl runner` process while its agent runs an attempt",
    outcome="the attempt is marked unresponsive after unresponsive_timeout_s, the rollout "
    "requeued and finished by another runner; rollouts the dead runner finished keep results",
)
async def test_a_runner_killed_mid_rollout_is_replaced_by_another(tmp_path, monkeypatch):
    # The watchdog's settings reach `lightning-rl serve` through its environment.
    monkeypatch.setenv("LIGHTNING_UNRESPONSIVE_TIMEOUT_S", "4")
    monkeypatch.setenv("LIGHTNING_WATCHDOG_INTERVAL_S", "0.2")
    port = free_port()
    server = start_serve(tmp_path / "store.duckdb", port, "--backend", "none")
    url = f"http://127.0.0.1:{port}"
    runner_proc = None
    try:
        async with HttpStoreClient(url) as client:
            quick = await client.enqueue_rollouts(
                [RolloutRequest(input={"sleep": 0}) for _ in range(2)]
            )
            [slow] = await client.enqueue_rollouts(
                [RolloutRequest(input={"sleep": 600}, max_attempts=2)]
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
            command = [sys.executable, "-m", "lightning_rl.flows.cli", "runner", "--server", url]
            runner_proc = subprocess.Popen(
                [*command, "--agent", "tests.runner_agents:sleepy_agent"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
            )
            quick_ids = [r.rollout_id for r in quick]
            await _wait_until(client, quick_ids, RolloutStatus.succeeded)
            await _wait_until(client, [slow.rollout_id], RolloutStatus.running)

            runner_proc.send_signal(signal.SIGKILL)
            runner_proc.wait(timeout=10)

            second = _runner(lambda task, llm: 2.0, client, worker_id_prefix="second")
            [done] = await second.run_until_done([slow.rollout_id], timeout=60)

            assert done.status is RolloutStatus.succeeded and done.episode_return == 2.0
            first, retry = await client.query_attempts(slow.rollout_id)
            assert str(runner_proc.pid) in first.worker_id
            assert first.status is AttemptStatus.unresponsive
            assert "no heartbeat or span for 4.0 s" in first.error
            assert retry.status is AttemptStatus.succeeded and retry.worker_id.startswith("second")
            # What the killed runner had finished (and the store acknowledged) stands.
            for rollout in await client.query_rollouts(rollout_ids=quick_ids):
                assert rollout.status is RolloutStatus.succeeded and rollout.episode_return == 1.0
    finally:
        if runner_proc is not None and runner_proc.poll() is None:
            runner_proc.kill()
        stop_serve(server)


# ---------------------------------------------------------------------------- disk full


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 512 KiB tmpfs mounted for the test: a disk that really fills up."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        why = f"cannot mount a tmpfs ({mounted.stderr.strip() or mounted.returncode})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run this row as root (or with CAP_SYS_ADMIN)")
        pytest.skip(f"{why}; run as root to inject a full disk")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """Write a file until the disk refuses another byte, then give `leave` bytes back."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0")
        os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)
    return filler


def _rows(n: int, reward: float) -> list[dict[str, Any]]:
    return [
        {
            "rollout_id": f"r{i}",
            "attempt_id": f"a{i}",
            "group_id": f"g{i // 4}",
            "task_id": f"t{i // 4}",
            "step": 0,
            "agent_name": "solver",
            "prompt_tokens": 100 + i,
            "response_tokens": 20,
            "reward": reward,
            "advantage": 0.5,
            "episode_return": reward,
            "success": True,
            "tool_calls": 1,
            "tool_errors": 0,
            "policy_version": f"run-v{i}",
            "prefix_break": None,  # each row is its agent's first call
            "provenance_refused": None,
            "judge_score": None,
        }
        for i in range(n)
    ]


def _read(root: Path) -> pd.DataFrame:
    con = analytics.connect(root, ":memory:")
    try:
        return con.execute("SELECT * FROM exported_rows ORDER BY iteration, rollout_id").df()
    finally:
        con.close()


@pytest.mark.fault(
    name="disk full while exporting an iteration",
    injected="the run folder on a 512 KiB tmpfs with 64 KiB left; the export needs about 120 KiB",
    outcome="DiskFull says to free space and resume; no file half-written, the earlier exports "
    "(the same iteration's included) read back whole; after freeing space the export succeeds",
)
def test_a_full_disk_fails_the_export_atomically_and_says_what_to_do(small_disk):
    root = small_disk / "run"
    analytics.export_iteration(root, 1, _rows(8, 1.0))
    before = _read(root)
    first_file = root / "transitions" / "iteration=1" / analytics.PART_FILE
    first_bytes = first_file.read_bytes()
    # 64 KiB left: the export (about 120 KiB) starts writing and runs out part-way.
    filler = _fill(small_disk, leave=64 * 1024)

    # A new iteration, and the same iteration again (a retried task).
    for iteration in (2, 1):
        with pytest.raises(DiskFull) as refused:
            analytics.export_iteration(root, iteration, _rows(4000, 0.0))
        message = str(refused.value)
        assert f"no space left on the disk of {root}" in message
        assert f"export iteration {iteration}" in message
        assert "Free space" in message and "--resume" in message

    assert analytics.exported_iterations(root) == [1]
    assert first_file.read_bytes() == first_bytes
    pd.testing.assert_frame_equal(_read(root), before)  # nothing acknowledged lost
    leftovers = [p.name for p in root.rglob("*") if p.is_file() and p != first_file]
    assert leftovers == []  # no temporary file, no half-written part
    assert not (root / "transitions" / "iteration=2").exists()

    filler.unlink()  # what the message says to do
    analytics.export_iteration(root, 2, _rows(4000, 0.0))
    assert analytics.exported_iterations(root) == [1, 2]
    assert len(_read(root)) == 8 + 4000


def test_the_analysis_task_does_not_retry_a_full_disk_but_retries_other_errors():
    from prefect.states import Failed

    from lightning_rl.tasks.analysis import analyze_iteration

    retry = analyze_iteration.retry_condition_fn
    assert analyze_iteration.retries == 2
    assert retry(analyze_iteration, None, Failed(data=DiskFull("no space"))) is False
    assert retry(analyze_iteration, None, Failed(data=OSError("flaky mount"))) is True


# ---------------------------------------------------------------------------- the matrix itself


def test_the_fault_matrix_collects_every_row_with_its_three_fields(tmp_path):
    out = tmp_path / "rows.json"
    ran = subprocess.run(
        [sys.executable, "benchmarks/fault_matrix.py", "--collect-only", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = [row["name"] for row in rows]
    assert len(set(names)) == len(names) >= 8, names
    for row in rows:
        assert all(row[k].strip() for k in FIELDS), row
        assert row["tests"] and row["result"] == "not run"
    assert {
        "agent raises",
        "agent hangs past its timeout",
        "runner SIGKILLed mid-rollout",
        "flow process SIGKILLed",
        "disk full while exporting an iteration",
        "store SIGKILLed mid-write",
    } <= set(names)
    assert f"fault_rows: {len(rows)}" in ran.stdout


def test_a_malformed_or_contradicting_fault_marker_is_reported():
    plugin = MatrixPlugin()
    fields = {"name": "x dies", "injected": "SIGKILL", "outcome": "restarted"}
    assert plugin.add("t.py::a", (), fields) is not None
    assert plugin.add("t.py::b", (), fields).tests == ["t.py::a", "t.py::b"]
    assert plugin.add("t.py::c", (), {"name": "y", "injected": "z"}) is None
    plugin.add("t.py::d", (), fields | {"outcome": "something else"})
    assert [p.split(":")[2] for p in plugin.problems] == ["c", "d"]
    assert "missing: outcome" in plugin.problems[0]
    assert "one fault, one description" in plugin.problems[1]
    assert list(plugin.rows) == ["x dies"]
