"""Task tables: training tasks in a folder that only grows, read back in slices with an identity.

A table is a folder of Parquet files, one per append. Their names sort in append order:
`<UTC yyyymmddThhmmss.ffffff>-<8 hex>.parquet`, so "the tasks added since the last run" is "the
files whose names sort after the last file that run read", and a run records that name (`through`)
as its watermark. A slice of the table has an identity: its row count and the sha256 of its rows
(`content_hash`), written `<table>@<first 12 hex of the hash>` (`dataset_id`); the same rows give
the same id on every machine, and any change to a task gives another.

Layout of every file, the ones `append` writes and the ones a team drops into the folder:

    id        VARCHAR  not null; the task's id, unique across the whole table
    task      VARCHAR  not null; the whole task as a JSON object (its "id", if there, equals `id`)
    added_at  DOUBLE   optional; seconds since the epoch when the row was added
    note      VARCHAR  optional; a word on where the rows came from

A dropped-in file must be named like an append's, with the UTC time it is dropped in
(`20260105T090000.000000-week2.parquet`): a name that sorts before a watermark a run already
recorded is never read by a later run, and `append` refuses to write after a name that is not a
timestamp. Files starting with "." are not part of the table (`append` writes `.<name>.tmp` and
renames it into place, so a crash never leaves half a file under a table name).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from lightning_core.data.files import write_atomically
from lightning_core.errors import DiskFull, InvalidInput

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("added_at", pa.float64()),
        pa.field("note", pa.string()),
    ]
)
_REQUIRED = ("id", "task")
_TIME_FORMAT = "%Y%m%dT%H%M%S.%f"
_STAMP = re.compile(r"^(\d{8}T\d{6}\.\d{6})-")
_LOCK = ".lock"
_LAYOUT_HINT = (
    "a task table's Parquet file needs a string column `id` and a string column `task` holding "
    "each task as a JSON object (optional: `added_at` DOUBLE, `note` VARCHAR)"
)


def content_hash(rows: Sequence[dict[str, Any]]) -> str:
    """sha256 hex of the rows' canonical JSON, in order: keys sorted, no spaces, UTF-8.

    Key order and the file the rows came from do not count; every value and the rows' order do.
    """
    try:
        text = json.dumps(
            list(rows), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"rows to hash must be plain JSON values: {exc}") from exc
    return hashlib.sha256(text.encode()).hexdigest()


class TableSlice(BaseModel):
    """The tasks of some of a table's files (those after a watermark), with their identity."""

    table: str = Field(description="The table's folder name.")
    files: list[str] = Field(description="Names of the files read, in order.")
    through: str | None = Field(
        description="Name of the last file read: the watermark of the next slice; None when "
        "there was nothing new."
    )
    tasks: list[dict[str, Any]] = Field(description="The tasks, in file order then row order.")
    rows: int = Field(description="Number of tasks.")
    content_hash: str = Field(description="sha256 hex of the tasks' canonical JSON, in order.")
    dataset_id: str = Field(description="`<table>@<first 12 hex of content_hash>`.")


class TaskTable:
    """An append-only folder of Parquet files of tasks (see the module docstring for the layout)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise InvalidInput(f"task table {self.folder} is a file; a task table is a folder")
        self.name = self.folder.resolve().name

    # -- reading --------------------------------------------------------------------------------

    def files(self) -> list[str]:
        """The table's file names in order (an absent folder is an empty table)."""
        if not self.folder.is_dir():
            return []
        return sorted(
            p.name
            for p in self.folder.iterdir()
            if p.suffix == ".parquet" and not p.name.startswith(".") and p.is_file()
        )

    def counts(self) -> dict[str, int]:
        """Rows per file, from the files' footers (without reading the rows)."""
        counts = {}
        for name in self.files():
            with self._reading(name):
                counts[name] = pq.ParquetFile(self.folder / name).metadata.num_rows
        return counts

    def read(self, after: str | None = None, through: str | None = None) -> list[dict[str, Any]]:
        """The tasks of the files with `after` < name <= `through`, in order.

        Ids must be unique across the whole table, files outside the range included: a task
        dropped in again under an old id would otherwise be trained on as if new.
        """
        names = self.files()
        self._check_unique(names)
        tasks: list[dict[str, Any]] = []
        for name in self._between(names, after, through):
            tasks += self._tasks_of(name)
        return tasks

    def snapshot(self, after: str | None = None) -> TableSlice:
        """Every task after the watermark `after` (None: the whole table), with its identity."""
        names = self.files()
        # The files are listed once, so that a concurrent append lands wholly in the next slice.
        chosen = self._between(names, after, None)
        self._check_unique(names)
        tasks = [task for name in chosen for task in self._tasks_of(name)]
        digest = content_hash(tasks)
        return TableSlice(
            table=self.name,
            files=chosen,
            through=chosen[-1] if chosen else None,
            tasks=tasks,
            rows=len(tasks),
            content_hash=digest,
            dataset_id=f"{self.name}@{digest[:12]}",
        )

    # -- appending ------------------------------------------------------------------------------

    def append(self, tasks: Sequence[dict[str, Any]], note: str | None = None) -> str:
        """Add `tasks` as one new file and return its name.

        Each task is a dict of JSON values with a string `id` unique within `tasks` and across
        the table. The file appears whole or not at all: it is written under a hidden temporary
        name, flushed to disk and renamed into place.
        """
        if not tasks:
            raise InvalidInput("nothing to append: the list of tasks is empty")
        ids, texts = self._encode(tasks)
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._locked():
            names = self.files()
            clashes = sorted(set(ids) & set(self._ids_by_file(names)))
            if clashes:
                raise InvalidInput(
                    f"task table {self.folder} already has task ids {_some(clashes)}; "
                    "ids must be unique across the table"
                )
            name = self._next_name(names)
            now = time.time()
            table = pa.table(
                {
                    "id": ids,
                    "task": texts,
                    "added_at": [now] * len(ids),
                    "note": [note] * len(ids),
                },
                schema=SCHEMA,
            )
            try:
                write_atomically(self.folder / name, lambda f: pq.write_table(table, f))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(f"no room to append to {self.folder}: {exc}") from exc
                raise
        return name

    # -- private --------------------------------------------------------------------------------

    @staticmethod
    def _between(names: list[str], after: str | None, through: str | None) -> list[str]:
        return [
            n for n in names if (after is None or n > after) and (through is None or n <= through)
        ]

    @staticmethod
    def _encode(tasks: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
        ids: list[str] = []
        texts: list[str] = []
        seen: set[str] = set()
        for i, task in enumerate(tasks):
            if not isinstance(task, dict):
                raise InvalidInput(f"task {i} is a {type(task).__name__}, not a JSON object")
            task_id = task.get("id")
            if not isinstance(task_id, str) or not task_id:
                raise InvalidInput(f"task {i} has no string `id` (got {task_id!r})")
            if task_id in seen:
                raise InvalidInput(f"task id {task_id!r} appears twice in the tasks to append")
            seen.add(task_id)
            try:
                text = json.dumps(task, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"task {task_id!r} is not plain JSON: {exc}") from exc
            # JSON turns tuples into lists and int keys into strings: refuse what would come back
            # different, so that a task read back is the task appended (and hashes the same).
            if json.loads(text) != task:
                raise InvalidInput(
                    f"task {task_id!r} would not read back the same from JSON (tuples, non-string "
                    "keys?); use lists and string keys"
                )
            ids.append(task_id)
            texts.append(text)
        return ids, texts

    def _next_name(self, names: list[str]) -> str:
        stamp = datetime.now(UTC)
        last = names[-1] if names else None
        if last is not None and _name(stamp) <= last:
            # Same microsecond as the last append, or a clock set back: follow the last name so
            # that the order of names stays the order of appends.
            match = _STAMP.match(last)
            if match is None:
                raise InvalidInput(
                    f"file {last} in {self.folder} sorts after any new append's name; rename it "
                    "to <UTC yyyymmddThhmmss.ffffff>-<label>.parquet (the time it was added)"
                )
            stamp = datetime.strptime(match.group(1), _TIME_FORMAT).replace(tzinfo=UTC) + timedelta(
                microseconds=1
            )
        return _name(stamp)

    def _ids_by_file(self, names: list[str]) -> dict[str, str]:
        owner: dict[str, str] = {}
        for name in names:
            with self._reading(name):
                column = pq.read_table(self.folder / name, columns=["id"]).column("id")
            for task_id in column.to_pylist():
                if task_id in owner:
                    raise InvalidInput(
                        f"task id {task_id!r} is in both {owner[task_id]} and {name} of "
                        f"{self.folder}; ids must be unique across the table"
                    )
                owner[task_id] = name
        return owner

    def _check_unique(self, names: list[str]) -> None:
        self._ids_by_file(names)

    def _tasks_of(self, name: str) -> list[dict[str, Any]]:
        with self._reading(name):
            table = pq.read_table(self.folder / name, columns=list(_REQUIRED))
        tasks = []
        for row, (task_id, text) in enumerate(
            zip(table.column("id").to_pylist(), table.column("task").to_pylist(), strict=True)
        ):
            where = f"{self.folder / name} row {row}"
            if not isinstance(task_id, str) or not task_id:
                raise InvalidInput(f"{where}: `id` is empty; {_LAYOUT_HINT}")
            if isinstance(text, bytes):
                text = text.decode()
            try:
                task = json.loads(text) if isinstance(text, str) else None
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"{where}: `task` is not JSON ({exc}); {_LAYOUT_HINT}") from exc
            if not isinstance(task, dict):
                raise InvalidInput(f"{where}: `task` is not a JSON object; {_LAYOUT_HINT}")
            if task.setdefault("id", task_id) != task_id:
                raise InvalidInput(
                    f"{where}: the task's own id {task['id']!r} differs from its `id` {task_id!r}"
                )
            tasks.append(task)
        return tasks

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[None]:
        """Any failure to read a file (not Parquet, cut short, columns missing) names the file."""
        try:
            yield
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise InvalidInput(
                f"cannot read {self.folder / name}: {exc}. Either fix or remove it; {_LAYOUT_HINT}"
            ) from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Two appends at once would both pass the check for clashing ids; one at a time.
        with open(self.folder / _LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _name(stamp: datetime) -> str:
    return f"{stamp.strftime(_TIME_FORMAT)}-{secrets.token_hex(4)}.parquet"


def _some(ids: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")
