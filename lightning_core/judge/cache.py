"""The judge's memory: its verdicts keyed by what it was shown, and what the run has spent.

One SQLite file in the run's folder. A verdict is found again by the hash of the judge's model,
question and the exact content judged, so a repeated trajectory (a resumed iteration, a group
that answered alike, calibration's sample seen again) costs no call. The spend (calls, tokens)
lives beside it, so that a resumed run keeps counting against the budget where it stopped;
each write is one SQLite transaction, whole or absent after a crash.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, scores TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spend (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    calls INTEGER NOT NULL, tokens INTEGER NOT NULL, hits INTEGER NOT NULL,
    failures INTEGER NOT NULL
);
INSERT OR IGNORE INTO spend VALUES (0, 0, 0, 0, 0);
"""


@dataclass(frozen=True)
class Spend:
    """What a run's judge has cost so far."""

    calls: int = 0
    tokens: int = 0
    hits: int = 0
    failures: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "judge/calls": float(self.calls),
            "judge/tokens": float(self.tokens),
            "judge/cache_hits": float(self.hits),
            "judge/failures": float(self.failures),
        }


def cache_key(*parts: object) -> str:
    """The key of a judgement: a hash of everything that decides its answer."""
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()


class JudgeCache:
    """Verdicts and spend in one SQLite file (`None`: in memory, for one process's life)."""

    def __init__(self, path: Path | None = None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            str(path) if path is not None else ":memory:",
            check_same_thread=False,
            isolation_level=None,  # each statement commits: nothing half-written
        )
        self._lock = threading.Lock()
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)

    def get(self, key: str) -> list[float] | None:
        with self._lock:
            row = self._db.execute("SELECT scores FROM verdicts WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            self._db.execute("UPDATE spend SET hits = hits + 1")
        return [float(s) for s in orjson.loads(row[0])]

    def put(self, key: str, scores: list[float]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO verdicts VALUES (?, ?)", (key, orjson.dumps(scores))
            )

    def charge(self, calls: int, tokens: int, failures: int = 0) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE spend SET calls = calls + ?, tokens = tokens + ?, failures = failures + ?",
                (calls, tokens, failures),
            )

    def spent(self) -> Spend:
        with self._lock:
            row = self._db.execute("SELECT calls, tokens, hits, failures FROM spend").fetchone()
        return Spend(*row)

    def close(self) -> None:
        with self._lock:
            self._db.close()
