"""The SQL agent's databases: built once into the cache, then opened read-only.

`database_path(name)` gives the SQLite file of a database, building it on first use under
`$LIGHTNING_CACHE_DIR/sql` (default `~/.cache/lightning-rl/sql`). A build writes a temporary
file in the same folder and renames it into place, so processes that start at the same time
may both build, but none ever opens a half-written database. The file name carries a version:
a change to a builder bumps it and the old file is simply left behind.

`schema_text(name)` is the compact schema the agent's prompts show: one `table(col, ...)` line
per table, read back from the built file so that it always matches the data.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

from lightning_rl.agents.sql import chinook, university

# Bump when a builder changes what it writes.
VERSION = 1
BUILDERS: dict[str, Callable[[sqlite3.Connection], None]] = {
    "chinook": chinook.build,
    "university": university.build,
}
DATABASES: tuple[str, ...] = tuple(BUILDERS)


class UnknownDatabase(ValueError):
    """A task names a database the agent does not have."""


def cache_root() -> Path:
    """$LIGHTNING_CACHE_DIR or ~/.cache/lightning-rl: lightning-rl's cache root.

    The same rule as the training side's; restated here because agents import nothing from it.
    """
    default = Path.home() / ".cache" / "lightning-rl"
    return Path(os.environ.get("LIGHTNING_CACHE_DIR") or default)


def _check(name: str) -> None:
    if name not in BUILDERS:
        raise UnknownDatabase(f"unknown database {name!r}: use one of {', '.join(DATABASES)}")


def database_path(name: str, root: Path | None = None) -> Path:
    """The SQLite file of database `name`, built first if it is not in the cache yet."""
    _check(name)
    folder = (root or cache_root()) / "sql"
    target = folder / f"{name}-v{VERSION}.sqlite"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        conn = sqlite3.connect(scratch)
        try:
            BUILDERS[name](conn)
            conn.commit()
        finally:
            conn.close()
        os.replace(scratch, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(scratch)
    return target


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot write: SQLite refuses every change on a `mode=ro` file."""
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)


def tables(name: str) -> dict[str, list[str]]:
    """Each table's column names, in schema order."""
    conn = connect_read_only(database_path(name))
    try:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid"
            )
        ]
        return {t: [c[1] for c in conn.execute(f"PRAGMA table_info({t})")] for t in names}
    finally:
        conn.close()


@functools.cache
def schema_text(name: str) -> str:
    """One `table(col, col, ...)` line per table: short enough for a small model's prompt."""
    return "\n".join(f"{t}({', '.join(cols)})" for t, cols in tables(name).items())
