"""Durability: every write the server acknowledged survives a SIGKILL of `lightning-rl serve`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from lightning_core.errors import LightningError
from lightning_core.serving.process import serve_command, start_serve
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest, RolloutStatus
from tests.conftest import free_port
from tests.helpers import reward_span, span


def start_server(db: Path, port: int, *options: str) -> subprocess.Popen:
    """`lightning-rl serve` on `db`; the store alone unless options say otherwise."""
    return start_serve(db, port, *(options or ("--backend", "none")))


async def _writer(client: HttpStoreClient, n: int, acked: dict, stop: asyncio.Event) -> None:
    """Enqueue, claim, add spans and complete rollouts until stopped, recording each ack."""
    while not stop.is_set():
        try:
            [rollout] = await client.enqueue_rollouts([RolloutRequest(input=n)])
            acked["enqueued"].add(rollout.rollout_id)
            claim = await client.dequeue(f"writer-{n}")
            if claim is None:
                continue
            spans = [span(claim, f"s{i}", i=i) for i in range(3)] + [reward_span(claim, 1.5)]
            await client.add_spans(spans)
            acked["spans"].update(s.span_id for s in spans)
            await client.complete_attempt(claim.attempt.attempt_id)
            acked["completed"].add(claim.rollout.rollout_id)
        except LightningError:
            return  # the server is gone: whatever was not acknowledged may be lost


@pytest.mark.fault(
    name="store SIGKILLed mid-write",
    injected="SIGKILL to `lightning-rl serve` while 8 writers enqueue, claim, add spans, complete",
    outcome="every acknowledged rollout, span and completion is in the file after a restart on "
    "it, and the restarted store takes new work (also with its database worker killed at once)",
)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("with_worker", [False, True], ids=["server", "server+worker"])
async def test_acknowledged_writes_survive_sigkill(tmp_path, with_worker):
    db = tmp_path / "store.duckdb"
    port = free_port()
    server = start_server(db, port)
    # retry_s=0: the writers stop at the kill, rather than wait for a restart that never comes.
    client = HttpStoreClient(f"http://127.0.0.1:{port}", timeout=5, retry_s=0)
    acked: dict[str, set[str]] = {"enqueued": set(), "spans": set(), "completed": set()}
    stop = asyncio.Event()
    writers = [asyncio.create_task(_writer(client, i, acked, stop)) for i in range(8)]
    try:
        # Until enough is acknowledged to test, however loaded the machine (2 s when idle).
        for _ in range(600):
            if len(acked["completed"]) > 20:
                break
            await asyncio.sleep(0.1)
        assert len(acked["completed"]) > 20, "the writers made too little progress to test"
        # Kill mid-stream: requests are in flight at this moment. With the database worker too,
        # acknowledged commits may be only in the store's write-ahead log (docs/store.md).
        victims = [server.pid]
        if with_worker:
            victims += [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
            assert len(victims) > 1, "the store's database worker was not found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        server.wait(timeout=10)
        await asyncio.wait_for(asyncio.gather(*writers), timeout=30)
    finally:
        stop.set()
        server.kill()
        await client.close()

    server = start_server(db, port)
    client = HttpStoreClient(f"http://127.0.0.1:{port}")
    try:
        rollouts = {r.rollout_id: r for r in await client.query_rollouts()}
        assert acked["enqueued"] <= set(rollouts)
        for rollout_id in acked["completed"]:
            assert rollouts[rollout_id].status is RolloutStatus.succeeded
            assert rollouts[rollout_id].episode_return == 1.5
        stored = await client.query_spans(sorted(rollouts))
        assert acked["spans"] <= {s.span_id for s in stored}
        # The restarted store keeps working on the same file.
        await client.enqueue_rollouts([RolloutRequest(input="after restart")])
        claim = await client.dequeue("after")
        await client.complete_attempt(claim.attempt.attempt_id, 1.0)
        assert (await client.get_rollout(claim.rollout.rollout_id)).episode_return == 1.0
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)
        await client.close()
    assert server.returncode == 0


def test_second_server_on_the_same_file_says_why(tmp_path):
    db = tmp_path / "store.duckdb"
    first = start_server(db, free_port())
    try:
        second = subprocess.run(
            serve_command(db, 0, "--backend", "none"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert "cannot open the store database" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=30)
