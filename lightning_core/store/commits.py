"""How the database worker (worker.py) acknowledges writes and then applies them to DuckDB.

Two threads, in the order the requests arrived:
- the log thread turns each commit that arrived meanwhile into Arrow tables of its columns' types
  (a commit DuckDB could not hold is refused here, never acknowledged), appends them all to the
  write-ahead log (wal.py) with one fsync, answers each, and passes them on; archives and
  checkpoints pass through it untouched, so that they stay ordered after the commits that
  arrived before them;
- the apply thread inserts runs of consecutive commits into DuckDB as one transaction, together
  with the log position they reach (one transaction instead of one per commit: DuckDB's cost is
  per transaction), runs archives and checkpoints between them, and raises the applied watermark.
A read waits for the watermark to reach the last commit that arrived before it, so it sees every
write acknowledged before it was asked. If DuckDB refuses a commit, the worker stops applying and
answers every later request with the error: the acknowledged rows stay in the log, and the next
start inserts them again (or says why it cannot).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from lightning_core.store import archive, schema, wal

# How many bytes of acknowledged commits may wait for DuckDB before the log thread waits too:
# bounds the worker's memory when DuckDB falls behind, and turns into back-pressure on writers.
MAX_UNAPPLIED_BYTES = 256 * 1024 * 1024
# The most bytes of commits one DuckDB transaction takes (its Arrow tables are built in memory):
# about 700 spans of 5 KB, past which a row costs no less (measured: 3.2 ms a transaction, 45 us
# a 5 KB span at 400 a transaction, 80 at 100).
MAX_APPLY_BYTES = 4 * 1024 * 1024
# How long the apply thread gathers commits into one transaction when no read waits for them.
APPLY_DELAY_S = 0.1
# What a replay inserts in one transaction.
MAX_REPLAY_BYTES = 32 * 1024 * 1024

Answer = Callable[[int, bool, Any], None]
_TABLES = {t.name: t for t in schema.TABLES}
_NOTHING = object()
_WAKE = object()  # put by a read that waits: apply what is gathered now


class CommitPipeline:
    """The worker's write side: `commit`, `archive` and `checkpoint` requests, and the watermark
    reads wait for."""

    def __init__(self, con: Any, log: wal.WriteAheadLog | None, next_seq: int, answer: Answer):
        self._con = con
        self._log = log
        self._answer = answer
        self._incoming: queue.SimpleQueue[tuple[int, str, Any, int] | None] = queue.SimpleQueue()
        self._logged: queue.SimpleQueue[tuple[int, str, Any, int] | None] = queue.SimpleQueue()
        self._state = threading.Condition()
        self._received = next_seq - 1  # last sequence number given to a commit
        self._applied = next_seq - 1  # last one DuckDB holds
        self._unapplied_bytes = 0
        self._failed: str | None = None
        self._readers_waiting = 0  # while any, the apply thread gathers nothing: it applies
        self._threads = [
            threading.Thread(target=self._log_loop, name="wal-log"),
            threading.Thread(target=self._apply_loop, name="wal-apply"),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ requests (main thread)

    def submit(self, request_id: int, op: str, payload: Any) -> None:
        """A write request, in arrival order; answered by the threads."""
        seq = 0
        if op == "commit":
            self._received += 1
            seq = self._received
        self._incoming.put((request_id, op, payload, seq))

    def read_mark(self) -> int:
        """The watermark a read that arrives now must wait for."""
        return self._received

    def wait_applied(self, mark: int) -> None:
        """Return once DuckDB holds every commit up to `mark`; raise if it never will."""
        with self._state:
            if self._applied < mark:
                self._readers_waiting += 1
                self._logged.put(_WAKE)
                self._state.wait_for(lambda: self._applied >= mark or self._failed is not None)
                self._readers_waiting -= 1
            if self._applied < mark:
                raise RuntimeError(self._failed)

    def close(self) -> None:
        """Finish every request asked so far, then stop."""
        self._incoming.put(None)
        for thread in self._threads:
            thread.join()
        if self._log is not None:
            if self._failed is None:
                self._log.reset()  # DuckDB holds every record
            self._log.close()

    # ------------------------------------------------------------------ the log thread

    def _log_loop(self) -> None:
        while (first := self._incoming.get()) is not None:
            items = [first]
            stop = False
            while True:
                try:
                    item = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                items.append(item)
            self._log_and_pass(items)
            if stop:
                break
        self._logged.put(None)

    def _log_and_pass(self, items: list[tuple[int, str, Any, int]]) -> None:
        # Typed before they are acknowledged: rows DuckDB's columns cannot hold are refused
        # now, not found at the apply, after the writer was told they are stored.
        passed: list[tuple[int, str, Any, int]] = []
        commits: list[tuple[int, bytes]] = []
        size = 0
        for request_id, op, payload, seq in items:
            if op == "commit":
                try:
                    tables = arrow_tables(payload)
                except Exception as exc:
                    self._answer(request_id, False, f"rows the store cannot hold: {exc!r}")
                    # Passed on empty, unlogged: the watermark reads wait for still moves past it.
                    passed.append((0, op, ({}, 0), seq))
                    continue
                commits.append((seq, payload))
                size += len(payload)
                payload = (tables, len(payload))
            passed.append((request_id, op, payload, seq))
        with self._state:
            # Back-pressure: wait while DuckDB is far behind (a lone commit bigger than the
            # bound still goes once nothing else waits).
            self._state.wait_for(
                lambda: (
                    self._failed is not None
                    or self._unapplied_bytes == 0
                    or self._unapplied_bytes + size <= MAX_UNAPPLIED_BYTES
                )
            )
            failed = self._failed
        if failed is None:
            try:
                if self._log is not None:
                    self._log.append(commits)
            except OSError as exc:
                failed = f"cannot write the store's write-ahead log: {exc!r}"
                self._fail(failed)
        if failed is not None:
            for request_id, _, _, _ in passed:
                if request_id:
                    self._answer(request_id, False, failed)
            return
        with self._state:
            self._unapplied_bytes += size
        for request_id, op, _, _ in passed:
            if op == "commit" and request_id:
                self._answer(request_id, True, None)
        for item in passed:
            self._logged.put(item)

    # ------------------------------------------------------------------ the apply thread

    def _apply_loop(self) -> None:
        carry: Any = _NOTHING  # an item taken while gathering a run, handled next
        while True:
            item = self._logged.get() if carry is _NOTHING else carry
            carry = _NOTHING
            if item is None:
                return
            if item is _WAKE:
                continue
            request_id, op, payload, seq = item
            if op != "commit":
                self._run(request_id, op, payload)
                continue
            # Gather commits for a while: a transaction costs DuckDB ~3 ms however few its rows,
            # and nobody waits for this one unless a read arrives (which wakes it at once).
            run = [payload[0]]
            size = payload[1]
            deadline = time.monotonic() + (0.0 if self._readers_waiting else APPLY_DELAY_S)
            while size < MAX_APPLY_BYTES:
                try:
                    following = self._logged.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if following is _WAKE:
                    break
                if following is None or following[1] != "commit":
                    carry = following
                    break
                run.append(following[2][0])
                size += following[2][1]
                seq = following[3]
            self._apply(run, seq, size)

    def _apply(self, run: list[dict[str, Any]], seq: int, size: int) -> None:
        if self._failed is not None:
            return
        try:
            apply_tables(self._con, run, seq)
        except Exception as exc:
            self._fail(f"DuckDB refused the commits up to {seq}: {exc!r}")
            return
        with self._state:
            self._applied = seq
            self._unapplied_bytes -= size
            self._state.notify_all()
        if self._log is not None:
            self._log.release(seq)

    def _run(self, request_id: int, op: str, payload: Any) -> None:
        if self._failed is not None:
            self._answer(request_id, False, self._failed)
            return
        try:
            if op == "archive":
                folder, name, ids, bounds, at = payload
                result = archive.archive_batch(self._con, Path(folder), name, ids, bounds, at)
            else:
                result = archive.checkpoint(self._con)
        except Exception as exc:
            self._answer(request_id, False, repr(exc))
            return
        self._answer(request_id, True, result)

    def _fail(self, reason: str) -> None:
        with self._state:
            if self._failed is None:
                self._failed = reason
            self._state.notify_all()


def arrow_tables(payload: bytes) -> dict[str, pa.Table]:
    """A commit's rows (a log record's payload) as Arrow tables of their columns' types."""
    return {name: _TABLES[name].to_arrow(rows) for name, rows in wal.decode(payload).items()}


def apply_tables(con: Any, commits: list[dict[str, pa.Table]], seq: int) -> None:
    """Insert the commits' tables and record `seq` as applied, in one transaction."""
    by_name: dict[str, list[pa.Table]] = {}
    for tables in commits:
        for name, table in tables.items():
            by_name.setdefault(name, []).append(table)
    statements = ["BEGIN"]
    try:
        for name, tables in by_name.items():
            view = f"_lightning_{name}"
            con.register(view, tables[0] if len(tables) == 1 else pa.concat_tables(tables))
            statements.append(f"INSERT INTO {name} SELECT * FROM {view}")
        statements.append(wal.set_applied_sql(seq))
        statements.append("COMMIT")
        con.execute("; ".join(statements))
    except Exception:
        with contextlib.suppress(Exception):  # no transaction may be open
            con.execute("ROLLBACK")
        raise
    finally:
        for name in by_name:
            with contextlib.suppress(Exception):
                con.unregister(f"_lightning_{name}")


def replay(con: Any, log: wal.WriteAheadLog) -> int:
    """Insert the log's records DuckDB does not hold yet; returns the last sequence number."""
    last = wal.applied_seq(con)
    batch: list[dict[str, pa.Table]] = []
    size = 0
    pending_seq = last
    for seq, payload in log.records(after=last):
        batch.append(arrow_tables(payload))
        size += len(payload)
        pending_seq = seq
        if size >= MAX_REPLAY_BYTES:
            apply_tables(con, batch, pending_seq)
            batch, size, last = [], 0, pending_seq
    if pending_seq > last:
        apply_tables(con, batch, pending_seq)
        last = pending_seq
    return last
