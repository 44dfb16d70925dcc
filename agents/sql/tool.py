"""The SQL tool: run one read-only query on a database, within a time and a row budget.

Four guards, each enough alone against a different mistake of a model:
- the text must be a single SELECT/WITH statement (`read_only_statement`);
- the file is opened with `mode=ro`, so SQLite refuses every write;
- an authorizer allows only reading (no ATTACH, PRAGMA, or writes hidden in a CTE);
- a progress handler aborts a statement after `timeout_ms` (a cross join of big tables runs
  for minutes), `fetchmany` stops at `max_rows`, and SQLite's length limit stops a single
  value (`randomblob(1e9)`) from eating memory.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from lightning_rl.agents.sql.databases import connect_read_only, database_path
from lightning_rl.agents.sql.sql_text import NotAQuery, read_only_statement

TIMEOUT_MS = 2_000
MAX_ROWS = 200
# Largest string or blob a query may build, in bytes.
MAX_VALUE_BYTES = 1_000_000
# The progress handler runs every this many SQLite VM instructions: often enough to stop
# within a millisecond or so, rarely enough to cost nothing measurable.
_CHECK_EVERY = 2_000
_ALLOWED = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


class SQLError(RuntimeError):
    """The query was refused or failed; the message is what the agent is shown."""


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    # More rows existed than `max_rows`; `rows` holds the first ones.
    truncated: bool = False


def _authorize(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def run_sql(
    db: str, sql: str, max_rows: int = MAX_ROWS, timeout_ms: int = TIMEOUT_MS
) -> QueryResult:
    """The result of `sql` on database `db`; SQLError when it is refused, fails or times out."""
    try:
        statement = read_only_statement(sql)
    except NotAQuery as exc:
        raise SQLError(str(exc)) from None
    conn = connect_read_only(database_path(db))
    deadline = time.monotonic() + timeout_ms / 1000
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _CHECK_EVERY)
    conn.set_authorizer(_authorize)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    try:
        cursor = conn.execute(statement)
        rows = cursor.fetchmany(max_rows + 1)
        columns = [d[0] for d in cursor.description or ()]
    except sqlite3.OperationalError as exc:
        if time.monotonic() > deadline and "interrupt" in str(exc):
            raise SQLError(f"the query ran longer than {timeout_ms} ms and was stopped") from None
        raise SQLError(_message(exc)) from None
    except sqlite3.Error as exc:
        raise SQLError(_message(exc)) from None
    finally:
        conn.close()
    return QueryResult(columns, rows[:max_rows], truncated=len(rows) > max_rows)


def _message(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "not authorized" in text or "readonly" in text:
        return "only reading queries are allowed"
    return text


def format_result(result: QueryResult, shown: int = 5) -> str:
    """A result as a model reads it: the column names, then up to `shown` rows, one a line."""
    if not result.rows:
        return "no rows"
    lines = [" | ".join(result.columns)]
    for row in result.rows[:shown]:
        lines.append(" | ".join("NULL" if v is None else str(v) for v in row))
    if len(result.rows) > shown or result.truncated:
        total = f"{len(result.rows)}{'+' if result.truncated else ''}"
        lines.append(f"... ({total} rows in all)")
    return "\n".join(lines)
