"""Compacting a store file: the same data in a new file, without the space deleted rows held.

DuckDB 2.0 does not shrink a file when rows are deleted (a checkpoint gives back only free blocks
at the file's end, VACUUM nothing); it reuses the freed blocks for new rows, so a store archived
every week stays at its size (BENCHMARKS.md). To get the space back once, say after the first
archive of a year of episodes, the file is copied table by table into a new one, which then
replaces it with one rename: a crash leaves the old file or the new one, never half of either.
Only while no server has the file open (DuckDB's lock refuses a second writer).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_core.errors import InvalidInput
from lightning_core.store.archive import fsync_path, sql_string


def compact(db: str | Path) -> tuple[int, int]:
    """Rewrite the store file `db` compactly; returns its size in bytes before and after."""
    import duckdb

    db = Path(db)
    if not db.is_file():
        raise InvalidInput(f"no store file at {db}")
    before = db.stat().st_size
    tmp = db.with_name(f".{db.name}.compact.tmp")
    tmp.unlink(missing_ok=True)
    try:
        con = duckdb.connect(str(db))
    except duckdb.IOException as exc:
        raise InvalidInput(
            f"cannot open {db}: {str(exc).splitlines()[0]}. Stop the server that holds it "
            "(`lightning-rl serve` or `production`) and run this again."
        ) from None
    try:
        # Everything in the file first, so that no WAL is left to replay onto the new file.
        con.execute("CHECKPOINT")
        name = con.execute("SELECT current_database()").fetchone()[0]
        con.execute(f"ATTACH {sql_string(str(tmp))} AS lightning_compacted")
        con.execute(f'COPY FROM DATABASE "{name}" TO lightning_compacted')
        con.execute("DETACH lightning_compacted")
    except BaseException:
        con.close()
        tmp.unlink(missing_ok=True)
        raise
    con.close()
    if Path(f"{db}.wal").exists():
        tmp.unlink(missing_ok=True)
        raise InvalidInput(f"{db} still has a write-ahead log after a checkpoint; not compacted")
    fsync_path(tmp)
    os.replace(tmp, db)
    fsync_path(db.parent)
    return before, db.stat().st_size
