"""The process that owns the store's DuckDB file, and the handle the store talks to it through.

Why a process of its own: DuckDB and the Arrow conversions around it need Python's GIL at every
call, and in the server's process they fought the event loop for it, so that a 5 ms commit took
15 ms under load (measured). In its own process the database work runs beside the event loop
instead of between its steps, and queries come back as finished JSON, so the server forwards
them without parsing.

Protocol: length-prefixed pickle frames on the child's stdin/stdout (between these two processes
only; nothing from outside), `(request_id, op, payload)` one way and `(request_id, ok, result)`
the other. Requests: `commit` (rows per table, one transaction, sent as the write-ahead log
keeps them), `query` (SQL and parameters; the answer is a JSON array of row objects whose JSON
columns are embedded as JSON, and, for a page, the cursor of the next one), `archive` (a batch of
episodes moved to Parquet, archive.py), `checkpoint` and `close`. The child answers a commit once
its rows are in the write-ahead log and fsynced (wal.py), inserts them into DuckDB behind it, and
answers a query once DuckDB holds every commit that arrived before it (commits.py); commits,
archives and checkpoints take effect in the order they were asked. The child exits when its
stdin closes, after applying every commit, so it never outlives its store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from lightning_core.errors import StoreUnavailable
from lightning_core.store import wal

_HEADER = struct.Struct("!I")
# How long a new worker waits for the file lock: the worker of a store that was just killed
# holds it until it has noticed its parent is gone and closed the file.
OPEN_TIMEOUT_S = 10.0


def _write_frame(out: BinaryIO, lock: threading.Lock, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        out.write(_HEADER.pack(len(data)))
        out.write(data)
        out.flush()


def _read_frame(inp: BinaryIO) -> Any | None:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = inp.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


# ---------------------------------------------------------------------------- parent side

# `-c`, not `-m`: running this module as __main__ would import it twice (the package's
# __init__ imports it first).
_CHILD_ENTRY = (
    "import sys; from lightning_core.store.worker import child_main; "
    "sys.exit(child_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))"
)


class DatabaseWorker:
    """Handle on the worker process; `state` holds what the store needs to start from."""

    def __init__(
        self,
        db: str,
        threads: int = 1,
        open_timeout_s: float = OPEN_TIMEOUT_S,
        archive_dir: str | None = None,
    ):
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p
        )}  # fmt: skip
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_ENTRY, db, str(threads), str(open_timeout_s),
             archive_dir or ""],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )  # fmt: skip
        self._send_lock = threading.Lock()
        # Requests go out through a thread of their own: a commit of 500 spans is 2.5 MB, and a
        # pipe takes 64 KB at a time, so writing it on the event loop stalled every request
        # until the worker had read it all (profiled under load: 7 % of the server's time).
        self._outbox: queue.SimpleQueue[tuple[int, str, Any] | None] = queue.SimpleQueue()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._next_id = 1
        self._dead: str | None = None
        first = _read_frame(self._proc.stdout)
        if first is None or not first[1]:
            self._proc.wait(timeout=30)
            exited = f"the store's database worker exited ({self._proc.returncode})"
            raise StoreUnavailable(first[2] if first else exited)
        self.state: dict[str, Any] = first[2]
        self._reader = threading.Thread(target=self._read_answers, daemon=True,
                                        name="lightning-store-worker-reader")  # fmt: skip
        self._reader.start()
        self._sender = threading.Thread(target=self._send_requests, daemon=True,
                                        name="lightning-store-worker-sender")  # fmt: skip
        self._sender.start()

    def _send_requests(self) -> None:
        while (request := self._outbox.get()) is not None:
            request_id, op, payload = request
            if op == "commit":
                # As the write-ahead log keeps it (wal.py), encoded here, off the event loop.
                try:
                    request = (request_id, op, wal.encode(payload))
                except (TypeError, ValueError, OverflowError) as exc:
                    loop, future = self._pending.pop(request_id, (None, None))
                    if future is not None:
                        _settle_from_thread(loop, future, False, f"cannot encode rows: {exc}")
                    continue
            try:
                _write_frame(self._proc.stdin, self._send_lock, request)
            except (BrokenPipeError, ValueError, OSError) as exc:
                loop, future = self._pending.pop(request[0], (None, None))
                if future is not None:
                    # The pipe breaks before the reader sees the worker's exit: name the worker.
                    gone = f"the store's database worker is gone ({exc})"
                    _settle_from_thread(loop, future, False, gone)

    def _read_answers(self) -> None:
        while (frame := _read_frame(self._proc.stdout)) is not None:
            request_id, ok, result = frame
            loop, future = self._pending.pop(request_id, (None, None))
            if future is not None:
                _settle_from_thread(loop, future, ok, result)
        self._dead = f"the store's database worker exited ({self._proc.wait()})"
        for loop, future in list(self._pending.values()):
            _settle_from_thread(loop, future, False, self._dead)
        self._pending.clear()

    async def _request(self, op: str, payload: Any) -> Any:
        if self._dead is not None:
            raise StoreUnavailable(self._dead)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = self._next_id
        self._next_id += 1
        self._pending[request_id] = (loop, future)
        self._outbox.put((request_id, op, payload))
        return await future

    async def commit(self, rows: dict[str, list[tuple[Any, ...]]]) -> None:
        """Append rows to tables in one transaction; returns once it is on disk."""
        await self._request("commit", rows)

    async def archive(
        self,
        archive_dir: str,
        batch: str,
        rollout_ids: list[str],
        bounds: dict[str, int],
        archived_at: float,
    ) -> dict[str, int]:
        """Move these episodes' rows up to `bounds` into archive batch `batch` (archive.py);
        returns the rows moved per table."""
        return await self._request(
            "archive", (archive_dir, batch, rollout_ids, bounds, archived_at)
        )

    async def checkpoint(self) -> None:
        """Write the WAL into the file and give back the blocks of deleted rows."""
        await self._request("checkpoint", None)

    async def query(self, sql: str, params: list[Any]) -> bytes:
        """Run a read query; the answer is a JSON array of row objects."""
        return (await self._request("query", (sql, params, None)))[0]

    async def query_page(
        self, sql: str, params: list[Any], limit: int, cursor: Sequence[str]
    ) -> tuple[bytes, str | None]:
        """The first `limit` rows of a query ordered by the `cursor` columns, as a JSON array,
        and the cursor of the next page (None when none is left): the last row's `cursor`
        values as a JSON array. `sql` must end in `LIMIT ?` and leave that parameter out: it
        asks for one row more, to know whether a next page exists."""
        return await self._request("query", (sql, [*params, limit + 1], (limit, tuple(cursor))))

    def close(self, timeout: float = 60.0) -> None:
        """Let the worker finish its commits, close the file and exit."""
        self._outbox.put(None)
        self._sender.join(timeout=timeout)
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)


def _settle_from_thread(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], ok: bool, result: Any
) -> None:
    # A caller whose loop has closed no longer waits; the reader must go on for the others.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, ok, result)


def _settle(future: asyncio.Future[Any], ok: bool, result: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(StoreUnavailable(f"the store's database failed: {result}"))


# ---------------------------------------------------------------------------- child side


def _connect(db: str, threads: int, open_timeout_s: float):
    import duckdb

    if db != ":memory:":
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + open_timeout_s
    while True:
        try:
            return duckdb.connect(
                db,
                config={
                    "threads": threads,
                    # Checkpoints stall every commit behind them: let the WAL grow to 256 MB
                    # between them (a restart replays at most that much).
                    "checkpoint_threshold": "256MB",
                },
            )
        except duckdb.IOException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _load(con) -> dict[str, Any]:
    from lightning_core.store import schema

    def rows(sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cursor = con.execute(sql, params)
        columns = [d[0] for d in cursor.description]
        return [schema.row_dict(columns, row) for row in cursor.fetchall()]

    # The archive's counters count too: the newest rows may have been archived (archive.py).
    log_seq, span_seq, feedback_seq = con.execute(
        "SELECT greatest((SELECT max(log_seq) FROM rollout_log), "
        "(SELECT max(log_seq) FROM attempt_log), (SELECT max(log_seq) FROM archive_batches)), "
        "greatest((SELECT max(sequence_id) FROM spans), "
        "(SELECT max(span_seq) FROM archive_batches)), "
        "greatest((SELECT max(seq) FROM feedback), (SELECT max(feedback_seq) FROM archive_batches))"
    ).fetchone()
    feedback_seq = feedback_seq or 0
    return {
        "log_seq": log_seq or 0,
        "span_seq": span_seq or 0,
        # In the order the store first saw them, as it keeps them: pages of a query resume at a
        # position in that order, also after a restart.
        "rollouts": rows(
            "SELECT rollouts.* FROM rollouts JOIN (SELECT rollout_id, min(log_seq) AS first_seq "
            "FROM rollout_log GROUP BY rollout_id) USING (rollout_id) ORDER BY first_seq"
        ),
        "attempts": rows("SELECT * FROM attempts ORDER BY sequence_id"),
        "policy_versions": rows("SELECT * FROM policy_versions"),
        "feedback_seq": feedback_seq,
        # Only the row that counts per (episode, source): what a new feedback is compared with.
        "feedback": rows(schema.LATEST_FEEDBACK, [feedback_seq]),
    }


def child_main(db: str, threads: int, open_timeout_s: float, archive_dir: str = "") -> int:
    """The worker process: owns the DuckDB file until its stdin closes."""
    import orjson

    from lightning_core.store import archive, schema, wal
    from lightning_core.store.commits import CommitPipeline, replay

    # Frames own stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    lock = threading.Lock()
    try:
        con = _connect(db, threads, open_timeout_s)
        for table in schema.TABLES:
            con.execute(table.ddl)
        for table, old, new in schema.RENAMES:
            found = con.execute(
                "SELECT count(*) FROM information_schema.columns "
                "WHERE table_name = ? AND column_name = ?",
                [table, old],
            ).fetchone()
            if found and found[0]:
                con.execute(f"ALTER TABLE {table} RENAME COLUMN {old} TO {new}")
        for migration in schema.MIGRATIONS:
            con.execute(migration)
        for view in schema.VIEWS:
            con.execute(view)
        if archive_dir:
            # Before loading: a batch an archive was killed in must not be loaded as live too.
            archive.recover(con, Path(archive_dir))
        # Then the commits acknowledged but not yet in DuckDB when the last worker died.
        log = None
        if (folder := wal.folder_of(db)) is not None:
            log = wal.WriteAheadLog(folder)
            last = replay(con, log)
            log.reset()
        else:
            last = wal.applied_seq(con)
        _write_frame(out, lock, (0, True, _load(con)))
    except StoreUnavailable as exc:  # the write-ahead log says what is wrong with it
        _write_frame(out, lock, (0, False, str(exc)))
        return 3
    except Exception as exc:
        _write_frame(
            out,
            lock,
            (0, False, f"cannot open the store database {db!r}: {exc}. Another process (a "
             "running `lightning-rl serve`?) may hold it; stop it or choose another --db."),
        )  # fmt: skip
        return 3

    pipeline = CommitPipeline(
        con.cursor(), log, last + 1, lambda *answer: _write_frame(out, lock, answer)
    )
    local = threading.local()

    def query(
        request_id: int,
        mark: int,
        sql: str,
        params: list[Any],
        page: tuple[int, tuple[str, ...]] | None,
    ) -> None:
        try:
            pipeline.wait_applied(mark)
            cursor = getattr(local, "cursor", None)
            if cursor is None:
                cursor = local.cursor = con.cursor()
            # DuckDB writes each row as JSON itself (JSON columns embedded as JSON, floats
            # exact): building the rows in Python held the worker's GIL for tens of ms a page,
            # and the write-ahead log's acknowledgements waited behind it.
            keys = page[1] if page is not None else ()
            extra = "".join(f', q."{key}"' for key in keys)
            fetched = cursor.execute(
                f"SELECT to_json(q)::VARCHAR{extra} FROM ({sql}) q", params
            ).fetchall()
            following = None
            if page is not None and len(fetched) > page[0]:
                fetched = fetched[: page[0]]
                following = orjson.dumps(list(fetched[-1][1:]) if fetched else []).decode()
            body = ("[" + ",".join(row[0] for row in fetched) + "]").encode()
            _write_frame(out, lock, (request_id, True, (body, following)))
        except Exception as exc:
            _write_frame(out, lock, (request_id, False, repr(exc)))

    readers = ThreadPoolExecutor(2, thread_name_prefix="reader")
    while (frame := _read_frame(inp)) is not None:
        request_id, op, payload = frame
        if op in ("commit", "archive", "checkpoint"):
            pipeline.submit(request_id, op, payload)
        elif op == "query":
            readers.submit(query, request_id, pipeline.read_mark(), *payload)
    # stdin closed: the store closed, or its process died. Finish what was asked, then close
    # the file (DuckDB checkpoints on close, so the next start replays no WAL).
    pipeline.close()
    readers.shutdown(wait=True)
    con.close()
    return 0
