"""Difficulty tiers of SQL questions, read from the shape of their gold query.

- easy: one table (a lookup, a count, an aggregate, a top-k);
- medium: one join;
- hard: two or more joins, grouping, or a nested query.

Read from the query rather than written by hand so that every question has one, and a new
question gets the right one. A curriculum samples training tasks by tier, and evaluation
reports accuracy per tier.
"""

from __future__ import annotations

import re
from typing import Literal

Tier = Literal["easy", "medium", "hard"]
TIERS: tuple[Tier, ...] = ("easy", "medium", "hard")

_JOIN = re.compile(r"\bJOIN\b", re.IGNORECASE)
_SELECT = re.compile(r"\bSELECT\b", re.IGNORECASE)
_GROUP = re.compile(r"\bGROUP\s+BY\b", re.IGNORECASE)


def tier_of(gold_sql: str) -> Tier:
    """The tier of a question whose gold query is `gold_sql`."""
    joins = len(_JOIN.findall(gold_sql))
    if joins >= 2 or len(_SELECT.findall(gold_sql)) > 1 or _GROUP.search(gold_sql):
        return "hard"
    return "medium" if joins == 1 else "easy"
