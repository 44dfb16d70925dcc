"""The SQL databases as an environment service (docs/environments.md): each session gets its own
in-memory copy of its task's database, so that many rollouts on other machines share one
process that holds the databases, and none can see another's changes.

    python -m lightning_core.envs --env lightning_rl.agents.sql.env_service:SQLEnvironment

A session begins with a task `{"db": name, ...}`. Its actions:
- `{"sql": "..."}` runs one statement on the session's copy, reading or writing (a scratch
  table is the session's own), within TIMEOUT_MS and MAX_ROWS; the observation is the columns
  and rows, or SQLite's error (a failed query is an answer, not a refused action);
- `{"submit": "..."}`, on a task with a gold query, ends the episode: the reward is the SQL
  agent's own (agents/sql/reward.py: execution match on the pristine database).

ATTACH, DETACH and extension loading are refused: a session reaches only its own copy.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from lightning_core.envs.base import InvalidAction, StepOutcome
from lightning_rl.agents.sql.databases import connect_read_only, database_path
from lightning_rl.agents.sql.reward import sql_reward

TIMEOUT_MS = 2_000
MAX_ROWS = 200
MAX_VALUE_BYTES = 1_000_000
_DENIED = frozenset({sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH})


def _authorize(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_DENY if action in _DENIED else sqlite3.SQLITE_OK


class SQLEnvironment:
    """One session: a private copy of one database."""

    def __init__(self) -> None:
        self.conn: sqlite3.Connection | None = None
        self.task: dict[str, Any] = {}

    def reset(self, task: Any, seed: int | None) -> StepOutcome:
        if not isinstance(task, dict) or not isinstance(task.get("db"), str):
            raise InvalidAction('a SQL task is an object with "db", the database name')
        try:
            source = connect_read_only(database_path(task["db"]))
        except ValueError as exc:
            raise InvalidAction(str(exc)) from None
        # check_same_thread off: the service runs a session's calls on its pool's threads,
        # one at a time (a lock per session).
        self.conn = sqlite3.connect(":memory:", check_same_thread=False)
        source.backup(self.conn)
        source.close()
        self.conn.set_authorizer(_authorize)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self.task = task
        tables = [
            r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        ]
        return StepOutcome(observation={"db": task["db"], "tables": tables})

    def step(self, action: Any) -> StepOutcome:
        if self.conn is None:
            raise InvalidAction("the session has no database: reset it first")
        if not isinstance(action, dict):
            raise InvalidAction('an action is {"sql": ...} or {"submit": ...}')
        if isinstance(action.get("submit"), str):
            if "gold_sql" not in self.task:
                raise InvalidAction("this task has no gold query to submit against")
            reward = sql_reward(action["submit"], self.task)
            return StepOutcome(observation={"submitted": True}, reward=reward, done=True)
        if not isinstance(action.get("sql"), str):
            raise InvalidAction('an action is {"sql": ...} or {"submit": ...}')
        return StepOutcome(observation=self._run(action["sql"]))

    def _run(self, sql: str) -> dict[str, Any]:
        assert self.conn is not None
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        self.conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 2_000)
        try:
            cursor = self.conn.execute(sql)
            rows = cursor.fetchmany(MAX_ROWS + 1)
            columns = [d[0] for d in cursor.description or ()]
            self.conn.commit()
        except sqlite3.Error as exc:
            late = time.monotonic() > deadline
            return {"error": f"ran longer than {TIMEOUT_MS} ms" if late else str(exc)}
        finally:
            self.conn.set_progress_handler(None, 0)
        return {
            "columns": columns,
            "rows": [list(r) for r in rows[:MAX_ROWS]],
            "truncated": len(rows) > MAX_ROWS,
        }

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
