"""The SQL agent's reward: execution match of its final query against the gold query.

Both queries run on the task's database through the SQL tool (so a query that tries to write,
or runs too long, fails like any other); the reward is 1 when they return the same rows, else
0. Rows are compared as multisets unless the task says its order matters; numbers are compared
after rounding (an average computed two ways can differ in the last bits), and an integer
equals the same float (`COUNT(*)` and `SUM(1.0)`). Columns may come in another order: the
question fixes what to return, not how to arrange it.

A query that fails, returns nothing, or returns more rows than the reward reads scores 0, as
does a reply with no SQL in it.

On training tasks only (`partial_credit` set by data.py on the train split), a query that runs
and returns rows but not the gold rows earns partial credit, up to PARTIAL_MAX: how much of the
gold query's tables and columns it reads, and how many of its rows are gold rows (graded_reward).
A binary reward gives a group in which all four queries miss nothing to learn from, which is
most groups of a small model on joins; rows alone (the AIR bonus it replaces) paid wrong queries
as much as nearly right ones. Held-out tasks have no `partial_credit`: evaluation scores exact
matches only, and its benchmark (the test tasks) is unchanged.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from typing import Any

from lightning_rl.agents.sql.databases import tables as db_tables
from lightning_rl.agents.sql.sql_text import extract_sql, strip_comments
from lightning_rl.agents.sql.tool import QueryResult, SQLError, run_sql

DECIMALS = 4
# Enough for every gold result; a bigger result cannot match one.
MAX_ROWS = 10_000
TIMEOUT_MS = 5_000
# Column permutations tried before giving up (5 columns: 120 orders).
MAX_PERMUTED_COLUMNS = 5
# The most a wrong query earns: well below the 1 of a right one, so that no mix of partial
# credits in a group outweighs solving the question.
PARTIAL_MAX = 0.5
# How the partial credit weighs its parts: the tables read, the columns named, the rows shared.
PARTIAL_WEIGHTS = {"tables": 0.25, "columns": 0.25, "rows": 0.5}
_IDENTIFIER = re.compile(r'"([^"]+)"|`([^`]+)`|\[([^\]]+)\]|([A-Za-z_][A-Za-z0-9_]*)')

Row = tuple[Any, ...]


def _value(v: Any) -> Any:
    if isinstance(v, int | float):
        return round(float(v), DECIMALS)
    return v


def normalise(rows: list[Row]) -> list[Row]:
    """Rows with every number as a float rounded to DECIMALS places."""
    return [tuple(_value(v) for v in row) for row in rows]


def rows_match(predicted: list[Row], gold: list[Row], ordered: bool) -> bool:
    """Whether two results hold the same rows (in the same order when `ordered`)."""
    predicted, gold = normalise(predicted), normalise(gold)
    if len(predicted) != len(gold):
        return False
    width = len(gold[0]) if gold else 0
    if any(len(row) != width for row in predicted):
        return False
    target = gold if ordered else Counter(gold)
    orders = (
        itertools.permutations(range(width))
        if width <= MAX_PERMUTED_COLUMNS
        else [tuple(range(width))]
    )
    for order in orders:
        permuted = [tuple(row[i] for i in order) for row in predicted]
        if (permuted if ordered else Counter(permuted)) == target:
            return True
    return False


@functools.lru_cache(maxsize=1024)
def gold_result(db: str, gold_sql: str) -> QueryResult:
    return run_sql(db, gold_sql, max_rows=MAX_ROWS, timeout_ms=TIMEOUT_MS)


def sql_reward(text: str | None, task: dict[str, Any]) -> float:
    """1.0 when the SQL in `text` returns what the task's gold query returns; else 0.0, or the
    partial credit of graded_reward on a task with `partial_credit` (training tasks)."""
    sql = extract_sql(text)
    if not sql:
        return 0.0
    try:
        predicted = run_sql(task["db"], sql, max_rows=MAX_ROWS, timeout_ms=TIMEOUT_MS)
    except SQLError:
        return 0.0
    if not predicted.rows or predicted.truncated:
        return 0.0
    try:
        gold = gold_result(task["db"], task["gold_sql"])
    except SQLError as exc:
        # Not the agent's fault: the task itself is broken, and must not score silently.
        raise ValueError(f"the gold query of this task fails on {task['db']}: {exc}") from None
    if rows_match(predicted.rows, gold.rows, bool(task.get("ordered"))):
        return 1.0
    if not task.get("partial_credit"):
        return 0.0
    return graded_reward(sql, predicted.rows, task["gold_sql"], gold.rows, task["db"])


def graded_reward(sql: str, rows: list[Row], gold_sql: str, gold_rows: list[Row], db: str) -> float:
    """The partial credit of a query that runs and returns rows, not the gold rows:
    PARTIAL_MAX x (0.25 x J(tables) + 0.25 x J(columns) + 0.5 x F1(rows)), where J is the
    Jaccard index of the database's tables (columns) each query names, and F1 that of the two
    results as multisets of rows, each row's values taken in any order (numbers rounded as
    for the match)."""
    table_names, column_names = _schema_names(db)
    named, gold_named = _names(sql), _names(gold_sql)
    parts = {
        "tables": _jaccard(named & table_names, gold_named & table_names),
        "columns": _jaccard(named & column_names, gold_named & column_names),
        "rows": _rows_f1(rows, gold_rows),
    }
    return PARTIAL_MAX * sum(PARTIAL_WEIGHTS[k] * v for k, v in parts.items())


@functools.cache
def _schema_names(db: str) -> tuple[frozenset[str], frozenset[str]]:
    schema = db_tables(db)
    columns = {c.lower() for names in schema.values() for c in names}
    return frozenset(t.lower() for t in schema), frozenset(columns)


def _names(sql: str) -> set[str]:
    """The identifiers a query names, lower-cased (string literals left out)."""
    text = re.sub(r"'(?:[^']|'')*'", " ", strip_comments(sql))
    return {next(g for g in m.groups() if g).lower() for m in _IDENTIFIER.finditer(text)}


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def _rows_f1(rows: list[Row], gold: list[Row]) -> float:
    def key(row: Row) -> tuple[str, ...]:
        return tuple(sorted(repr(v) for v in row))

    predicted = Counter(key(r) for r in normalise(rows))
    expected = Counter(key(r) for r in normalise(gold))
    shared = sum((predicted & expected).values())
    total = sum(predicted.values()) + sum(expected.values())
    return 2 * shared / total if total else 0.0
