"""The store's write-ahead log (store/wal.py, store/commits.py): a commit is acknowledged once it
is in the log, and every acknowledged commit reaches DuckDB exactly once, whatever was killed when.

Kill points covered: mid-append (a torn record: test_a_torn_tail...), after the append and before
DuckDB holds it (SIGKILL of the worker: test_commits_acknowledged...), after DuckDB holds it and
before its segment is deleted, and mid-replay between two of its transactions (both in
test_records_duckdb_holds...).
"""

from __future__ import annotations

import contextlib
import math
import signal

import duckdb
import pytest

from lightning_core.errors import StoreUnavailable
from lightning_core.store import commits, schema, wal
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import Rollout, RolloutRequest, now


def _rollout_rows(first_seq: int, count: int) -> tuple[list[str], bytes]:
    rollouts = [Rollout(rollout_id=f"ro-log-{first_seq + i}", input=i, enqueued_at=now())
                for i in range(count)]  # fmt: skip
    rows = [schema.rollout_row(first_seq + i, r) for i, r in enumerate(rollouts)]
    return [r.rollout_id for r in rollouts], wal.encode({"rollout_log": rows})


def _applied(db) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT coalesce(max(seq), 0) FROM wal_applied").fetchall()[0][0]
    finally:
        con.close()


def _segments(db) -> list:
    return sorted(wal.folder_of(str(db)).glob("*.seg"))


def test_rows_round_trip_exactly():
    rows = {
        "transitions": [
            ("ro", "at", 0, "agent", [1, 2**31 - 1], [], [-0.0, -math.inf, 1e-310], math.nan,
             None, "v1", '{"a": "é\\u2028"}', 0.7, 1.0, "stop"),
        ],
        "spans": [(2**62, "ro", "at", "t", "s", None, "名前", "internal", 1.5, 2.5, "ok", None,
                   "{}", "[]", "{}")],
    }  # fmt: skip
    back = wal.decode(wal.encode(rows))
    assert back.keys() == rows.keys()
    for name, table_rows in rows.items():
        assert len(back[name]) == len(table_rows)
        for got, want in zip(back[name], table_rows, strict=True):
            # repr tells nan from nan and -0.0 from 0.0, which == does not.
            assert repr(tuple(got)) == repr(want)


def test_log_segments_rotate_and_only_applied_ones_are_deleted(tmp_path):
    log = wal.WriteAheadLog(tmp_path / "log", segment_bytes=1000)
    payloads = {seq: bytes([seq]) * 400 for seq in range(1, 11)}
    for seq in range(1, 11):
        log.append([(seq, payloads[seq])])
    assert len(log._list()) == 4  # 3 records of ~416 bytes a segment, past 1000 a new one
    log.release(5)  # segments [1-3] only: [4-6] still holds 6
    assert [seq for seq, _ in log._list()] == [4, 7, 10]
    log.release(10)  # never the segment appended to
    assert [seq for seq, _ in log._list()] == [10]
    log.close()
    again = wal.WriteAheadLog(tmp_path / "log")
    assert list(again.records(after=0)) == [(10, payloads[10])]


def test_a_torn_tail_is_dropped_and_damage_before_the_end_is_refused(tmp_path):
    log = wal.WriteAheadLog(tmp_path / "log", segment_bytes=10**6)
    log.append([(1, b"one"), (2, b"two"), (3, b"three")])
    log.close()
    [segment] = log._list()
    whole = segment[1].read_bytes()
    # Killed mid-append: half of a fourth record. It was never acknowledged, so it is dropped.
    segment[1].write_bytes(whole + whole[:10])
    assert [seq for seq, _ in wal.WriteAheadLog(tmp_path / "log").records(after=0)] == [1, 2, 3]
    assert [seq for seq, _ in wal.WriteAheadLog(tmp_path / "log").records(after=2)] == [3]
    # A damaged record in a segment that others follow is not a crash's tail: refused.
    damaged = bytearray(whole)
    damaged[-1] ^= 0xFF
    segment[1].write_bytes(bytes(damaged))
    later = wal.WriteAheadLog(tmp_path / "log")
    later.append([(4, b"four")])
    later.close()
    with pytest.raises(StoreUnavailable, match="damaged at byte"):
        list(wal.WriteAheadLog(tmp_path / "log").records(after=0))


async def test_records_duckdb_holds_are_not_inserted_again(tmp_path, monkeypatch):
    db = tmp_path / "store.duckdb"
    await DuckDBStore(db=str(db)).close()
    # Left by a worker killed after DuckDB committed records 1-2, before their segment went.
    held, first = _rollout_rows(1, 2)
    new, second = _rollout_rows(3, 2)
    last, third = _rollout_rows(5, 1)
    con = duckdb.connect(str(db))
    con.execute(wal.set_applied_sql(2))
    log = wal.WriteAheadLog(wal.folder_of(str(db)))
    log.append([(1, first), (2, first), (3, second), (4, third)])
    log.close()
    # Killed mid-replay, after its first transaction (one record each here) committed.
    monkeypatch.setattr(commits, "MAX_REPLAY_BYTES", 1)
    applied_once = commits.apply_tables

    def killed_after_one(*args):
        if _applied_in(con) > 2:
            raise KeyboardInterrupt("killed")
        applied_once(*args)

    monkeypatch.setattr(commits, "apply_tables", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        commits.replay(con, wal.WriteAheadLog(wal.folder_of(str(db))))
    con.close()
    assert _applied(db) == 3

    store = DuckDBStore(db=str(db))
    try:
        ids = [r.rollout_id for r in await store.query_rollouts()]
        # Records 3 and 4 are in once each; 1 and 2 were DuckDB's already, not inserted again.
        assert sorted(ids) == sorted(new + last)
        assert not set(held) & set(ids)
    finally:
        await store.close()
    assert _applied(db) == 4 and _segments(db) == []


def _applied_in(con) -> int:
    return con.execute("SELECT coalesce(max(seq), 0) FROM wal_applied").fetchall()[0][0]


@pytest.mark.fault(
    name="store's database worker SIGKILLed with commits only in its write-ahead log",
    injected="SIGKILL to the database worker right after it acknowledged a commit, before "
    "DuckDB holds it",
    outcome="the next start inserts every acknowledged commit from the log, once",
)
async def test_commits_acknowledged_but_not_in_duckdb_survive_a_worker_kill(tmp_path):
    db = tmp_path / "store.duckdb"
    acked: list[str] = []
    for _ in range(5):  # until the kill lands before DuckDB holds the last commits
        store = DuckDBStore(db=str(db))
        try:
            for i in range(20):
                [rollout] = await store.enqueue_rollouts([RolloutRequest(input=i)])
                acked.append(rollout.rollout_id)
            # No read has asked for them, so the worker is still gathering them for DuckDB.
            store._worker._proc.send_signal(signal.SIGKILL)
            store._worker._proc.wait()
        finally:
            with contextlib.suppress(Exception):
                await store.close()
        unapplied = list(wal.WriteAheadLog(wal.folder_of(str(db))).records(after=_applied(db)))
        if unapplied:
            break
    assert unapplied, "every kill came after DuckDB held the commits: nothing was tested"

    store = DuckDBStore(db=str(db))
    try:
        ids = [r.rollout_id for r in await store.query_rollouts()]
        assert sorted(ids) == sorted(acked)  # all of them, each once
        # And the store goes on from there.
        [more] = await store.enqueue_rollouts([RolloutRequest(input="after")])
        assert (await store.get_rollout(more.rollout_id)).input == "after"
    finally:
        await store.close()
    assert _segments(db) == []


async def test_a_store_whose_log_is_damaged_says_so(tmp_path):
    db = tmp_path / "store.duckdb"
    await DuckDBStore(db=str(db)).close()
    log = wal.WriteAheadLog(wal.folder_of(str(db)), segment_bytes=1)
    _, rows = _rollout_rows(1, 1)
    log.append([(1, rows)])
    log.append([(2, rows)])
    log.close()
    first = _segments(db)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(StoreUnavailable, match=r"write-ahead log .* is damaged"):
        DuckDBStore(db=str(db))


async def test_rows_duckdb_cannot_hold_are_refused_before_they_are_acknowledged(tmp_path):
    store = DuckDBStore(db=str(tmp_path / "store.duckdb"))
    try:
        with pytest.raises(StoreUnavailable, match="rows the store cannot hold"):
            # A token id past INTEGER (the API refuses it; the worker must too, for any caller).
            await store._worker.commit({"transitions": [
                ("ro", "at", 0, "a", [2**40], [], [], 0.0, 0.0, "v", None, None, None, None)
            ]})  # fmt: skip
        # Nothing of it was logged, and reads after it do not wait for it forever.
        assert list(wal.WriteAheadLog(wal.folder_of(store.config.db)).records(after=0)) == []
        assert await store.query_transitions() == []
    finally:
        await store.close()
