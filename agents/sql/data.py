"""Text-to-SQL tasks for the SQL agent: disjoint train and test splits, and held-out kinds.

A task is a plain dict `{"id", "question", "db", "gold_sql", "ordered", "tier"}`; `tier` is
easy, medium or hard (tiers.py), what a curriculum samples by and evaluation breaks down by.
Train tasks also carry `"partial_credit": True`: their reward grades near misses (reward.py).
Its id is a hash of its database and question. The questions of questions.py are split by
that hash (about 70% train, 30% test), so a question's split never changes when questions are
added or removed. The third split, "kinds", holds the questions of kinds.py: question shapes
that neither train nor test has, held out as a whole, so evaluation on it measures how a
policy generalises to kinds of questions it never trained on. Training never draws from it.
Within a split, tasks come in hash order: any prefix mixes databases and question shapes.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Literal

from lightning_rl.agents.sql.databases import DATABASES
from lightning_rl.agents.sql.kinds import kind_questions
from lightning_rl.agents.sql.questions import Question, all_questions
from lightning_rl.agents.sql.tiers import tier_of

Split = Literal["train", "test", "kinds"]
SPLITS: tuple[str, ...] = ("train", "test", "kinds")
# Of every 100 hash buckets, this many go to train.
TRAIN_PERCENT = 70


def _digest(q: Question) -> str:
    return hashlib.sha256(f"{q.db}\n{q.question}".encode()).hexdigest()


@functools.cache
def _kinds() -> frozenset[Question]:
    return frozenset(kind_questions())


def split_of(q: Question) -> Split:
    """The split of `q`: kinds for a question of kinds.py, else train or test by its hash."""
    if q in _kinds():
        return "kinds"
    return "train" if int(_digest(q)[:8], 16) % 100 < TRAIN_PERCENT else "test"


def task(q: Question, split: Split | None = None) -> dict[str, Any]:
    """The task dict of `q` as loaded for `split` (by default the split `q` belongs to)."""
    found = {
        "id": f"{q.db}-{_digest(q)[:10]}",
        "question": q.question,
        "db": q.db,
        "gold_sql": q.gold_sql,
        "ordered": q.ordered,
        "tier": tier_of(q.gold_sql),
    }
    if (split or split_of(q)) == "train":
        # Training rewards near misses (reward.graded_reward); held-out tasks (test, kinds)
        # stay as they were, exact matches only, so the benchmark they define is the same.
        found["partial_credit"] = True
    return found


def load_tasks(split: Split, size: int, source: str | None = None) -> list[dict[str, Any]]:
    """Up to `size` tasks of `split`, the same every time.

    `source` is a database name ("chinook", "university") or None (or "all") for every
    database. A `size` beyond what the split holds returns all of it (no repeats): the split
    is small, and repeating questions would only reweigh them.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    if source not in (None, "all", *DATABASES):
        raise ValueError(f"source must be one of all, {', '.join(DATABASES)}, not {source!r}")
    if size < 1:
        raise ValueError(f"size must be at least 1, not {size}")
    pool = kind_questions() if split == "kinds" else all_questions()
    chosen = [q for q in pool if split_of(q) == split and source in (None, "all", q.db)]
    chosen.sort(key=_digest)
    return [task(q, split) for q in chosen[:size]]
