"""The database worker process: what the store does when it dies, and what it leaves on disk."""

from __future__ import annotations

import duckdb
import pytest

from lightning_core.errors import StoreUnavailable
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest


async def test_a_dead_worker_fails_writes_clearly_instead_of_hanging():
    store = DuckDBStore(db=":memory:")
    await store.enqueue_rollouts([RolloutRequest(input=1)])
    store._worker._proc.kill()
    store._worker._proc.wait()
    with pytest.raises(StoreUnavailable, match="database worker"):
        await store.enqueue_rollouts([RolloutRequest(input=2)])
    # Once broken, the store refuses work up front, claims included.
    with pytest.raises(StoreUnavailable):
        await store.enqueue_rollouts([RolloutRequest(input=3)])
    with pytest.raises(StoreUnavailable):
        await store.dequeue("w")
    await store.close()


async def test_closed_store_leaves_a_readable_checkpointed_file(tmp_path):
    db = tmp_path / "store.duckdb"
    store = DuckDBStore(db=str(db))
    rollouts = await store.enqueue_rollouts([RolloutRequest(input={"q": i}) for i in range(3)])
    claim = await store.dequeue("w")
    await store.complete_attempt(claim.attempt.attempt_id, 0.5)
    await store.close()
    # The worker has exited, so the file opens in any DuckDB, and the views show the latest row.
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT rollout_id, status, episode_return, input->>'q' FROM rollouts ORDER BY enqueued_at"
    ).fetchall()
    con.close()
    assert {r[0] for r in rows} == {r.rollout_id for r in rollouts}
    assert sorted(r[1] for r in rows) == ["queuing", "queuing", "succeeded"]
    assert [r[2] for r in rows if r[1] == "succeeded"] == [0.5]
    assert not (tmp_path / "store.duckdb.wal").exists()
