"""Pages of the store's read queries: a query's first `limit` rows after a cursor the store gave
out, and the next page's cursor, so that no single answer holds the whole store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from lightning_core.errors import InvalidInput

if TYPE_CHECKING:
    from lightning_core.store.worker import DatabaseWorker


class PagedReads:
    """Read queries in pages, on the database worker of the DuckDBStore it is part of."""

    if TYPE_CHECKING:
        _worker: DatabaseWorker

        async def _sync(self, upto: int | None = None) -> None: ...

    async def _page(
        self, sql: str, params: list[Any], limit: int | None, cursor: tuple[str, ...]
    ) -> tuple[bytes, str | None]:
        """A read query's rows (JSON) once every acknowledged write is on disk; with `limit`,
        its first page and the next one's cursor (the last row's `cursor` columns)."""
        await self._sync()
        if limit is None:
            return await self._worker.query(sql, params), None
        if limit == 0:
            return b"[]", None
        return await self._worker.query_page(sql + " LIMIT ?", params, limit, cursor)


def read_cursor(after: str | None, columns: type[int] | int, what: str) -> Any:
    """A page cursor the store gave out (`after`), read back: an int (`columns` int: a position
    or a seq; 0 for None) or a tuple of a row's `columns` key values. InvalidInput otherwise."""
    if after is None:
        return 0
    try:
        value = orjson.loads(after)
    except orjson.JSONDecodeError:
        value = None
    if columns is int:
        # A bare number (a position) or the one value of a row's key ([seq]).
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    elif isinstance(value, list) and len(value) == columns:
        return tuple(value)
    raise InvalidInput(f"cursor {after[:100]!r} of {what} is not one the store gave out")
