"""The SQL agent's reward: execution match of its final query against the gold query.

Both queries run on the task's database through the SQL tool (so a query that tries to write,
or runs too long, fails like any other); the reward is 1 when they return the same rows, else
0. Rows are compared as multisets unless the task says its order matters; numbers are compared
after rounding (an average computed two ways can differ in the last bits), and an integer
equals the same float (`COUNT(*)` and `SUM(1.0)`). Columns may come in another order: the
question fixes what to return, not how to arrange it.

A query that fails, returns nothing, or returns more rows than the reward reads scores 0, as
does a reply with no SQL in it.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Any

from lightning_rl.agents.sql.sql_text import extract_sql
from lightning_rl.agents.sql.tool import QueryResult, SQLError, run_sql

DECIMALS = 4
# Enough for every gold result; a bigger result cannot match one.
MAX_ROWS = 10_000
TIMEOUT_MS = 5_000
# Column permutations tried before giving up (5 columns: 120 orders).
MAX_PERMUTED_COLUMNS = 5

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
    """1.0 when the SQL in `text` returns what the task's gold query returns, else 0.0."""
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
    return 1.0 if rows_match(predicted.rows, gold.rows, bool(task.get("ordered"))) else 0.0
