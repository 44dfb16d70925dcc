"""The store's own write-ahead log: a commit is acknowledged once it is here, not in DuckDB.

Why: a DuckDB transaction costs 7-25 ms however small (and a checkpoint stalls it for hundreds),
and every span a user's call writes waited for one. Appending the same rows to a file and
fsyncing it costs well under a millisecond, so the database worker (worker.py) acknowledges a
commit after its record is appended and fsynced here, and inserts it into DuckDB behind it, many
commits in one transaction. Reads wait until DuckDB holds every commit received before them.

The log is a folder beside the store file (`<db>.lightning-wal/`) of segment files, each named by
the sequence number of its first record. A record is a header (payload length, sequence number,
CRC-32 of the payload) and the payload: the commit's rows per table as msgpack (typed like the
rows: float64 exact, no pickle to load). DuckDB keeps the sequence number of the last commit it
holds (table `wal_applied`) in the same transaction as the rows, so on start the records after it
are inserted again (`replay`), exactly once. A record cut short by a crash was never
acknowledged: replay stops at it. Segments whose records DuckDB holds are deleted, so the log
stays about one segment long while DuckDB keeps up.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgpack

from lightning_core.errors import StoreUnavailable
from lightning_core.store.archive import fsync_path

_RECORD = struct.Struct("!IQI")  # payload length, sequence number, CRC-32 of the payload
_SUFFIX = ".seg"
# A new segment starts past this size; older ones are deleted once DuckDB holds their records.
SEGMENT_BYTES = 64 * 1024 * 1024

APPLIED_DDL = "CREATE TABLE IF NOT EXISTS wal_applied (seq BIGINT NOT NULL)"


def folder_of(db: str) -> Path | None:
    """The log folder of store file `db`; None for an in-memory store (nothing to recover)."""
    return None if db == ":memory:" else Path(f"{db}.lightning-wal")


def encode(rows: dict[str, list[tuple]]) -> bytes:
    return msgpack.packb(rows, use_bin_type=True)


def decode(payload: bytes) -> dict[str, list[list]]:
    return msgpack.unpackb(payload, raw=False, strict_map_key=True)


def applied_seq(con) -> int:
    """The sequence number of the last record DuckDB holds (0: none yet)."""
    con.execute(APPLIED_DDL)
    [(seq,)] = con.execute("SELECT coalesce(max(seq), 0) FROM wal_applied").fetchall()
    return seq


def set_applied_sql(seq: int) -> str:
    """The statements that record `seq` as applied; part of the transaction that applies it."""
    return f"DELETE FROM wal_applied; INSERT INTO wal_applied VALUES ({int(seq)})"


class WriteAheadLog:
    """Appends records and deletes the segments DuckDB holds; one appender, any releaser."""

    def __init__(self, folder: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = folder
        self.segment_bytes = segment_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the segment list (appender vs releaser)
        self._segments: list[tuple[int, Path]] = self._list()
        self._file = None
        self._size = 0

    def _list(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.folder.iterdir():
            if path.suffix == _SUFFIX and path.stem.isdigit():
                found.append((int(path.stem), path))
        return sorted(found)

    def records(self, after: int) -> Iterator[tuple[int, bytes]]:
        """The records with a sequence number above `after`, in order, up to the first record
        cut short or damaged; such a record is an error anywhere but at the log's end."""
        segments = list(self._segments)
        for index, (_, path) in enumerate(segments):
            data = path.read_bytes()
            offset = 0
            while offset < len(data):
                header = data[offset : offset + _RECORD.size]
                body_start = offset + _RECORD.size
                if len(header) == _RECORD.size:
                    length, seq, crc = _RECORD.unpack(header)
                    payload = data[body_start : body_start + length]
                    whole = len(payload) == length and zlib.crc32(payload) == crc
                else:
                    whole = False
                if not whole:
                    if index != len(segments) - 1:
                        raise StoreUnavailable(
                            f"the store's write-ahead log {path} is damaged at byte {offset} "
                            "and later segments follow; restore the store folder from a backup"
                        )
                    return  # the tail of a crash: never acknowledged
                if seq > after:
                    yield seq, payload
                offset = body_start + length

    def append(self, records: list[tuple[int, bytes]]) -> None:
        """Write records and fsync them: once this returns they survive a crash."""
        if not records:
            return
        if self._file is None or self._size >= self.segment_bytes:
            self._open_segment(records[0][0])
        chunks = []
        for seq, payload in records:
            chunks.append(_RECORD.pack(len(payload), seq, zlib.crc32(payload)))
            chunks.append(payload)
        data = b"".join(chunks)
        self._file.write(data)
        self._file.flush()
        os.fdatasync(self._file.fileno())
        self._size += len(data)

    def _open_segment(self, first_seq: int) -> None:
        if self._file is not None:
            self._file.close()
        path = self.folder / f"{first_seq:020d}{_SUFFIX}"
        self._file = open(path, "ab")  # noqa: SIM115 (kept open across appends)
        self._size = self._file.tell()
        # The new file's name must survive a crash as well as its records.
        fsync_path(self.folder)
        with self._lock:
            self._segments.append((first_seq, path))

    def release(self, applied: int) -> None:
        """Delete the segments all of whose records DuckDB holds (never the one appended to)."""
        with self._lock:
            while len(self._segments) > 1 and self._segments[1][0] <= applied + 1:
                _, path = self._segments.pop(0)
                path.unlink(missing_ok=True)

    def reset(self) -> None:
        """Delete every segment (all of them are in DuckDB: after a replay, or on close)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        with self._lock:
            for _, path in self._segments:
                path.unlink(missing_ok=True)
            self._segments = []

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
