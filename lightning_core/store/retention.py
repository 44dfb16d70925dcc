"""Retention: production episodes idle for longer than a window leave the store for its archive.

A store that records every user call grows by its traffic for ever (a year at 20,000 episodes a
week is 1,000,000 episodes); every episode is also held in the store's memory. `archive_episodes`
moves the episodes with neither a call nor feedback since the cutoff, oldest first, in batches
of `archive_batch_episodes`, to Parquet files that analytics and `data=episodes` runs still read
(archive.py says how a batch is moved crash-safely). Each batch:

1. the worker lists the candidates (a query over the file, off the event loop);
2. on the event loop, in one step, the candidates still idle (no call or feedback arrived since
   the list was made: `_episode_active`) are sealed: dropped from the live state, so that the
   store answers for them as for any unknown episode;
3. every write made so far is committed, then the worker moves the sealed episodes' rows, up to
   the counters at sealing, to a batch of the archive and deletes them from the file.

At the end a checkpoint lets DuckDB reuse (and, at the file's end, give back) the freed blocks.
Feedback sent later for an archived episode is refused as for an unknown one (404).

A mixin of DuckDBStore, like episodes.py.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING

import orjson

from lightning_core.errors import Conflict, InvalidInput
from lightning_core.store.bodies import ArchiveReport
from lightning_core.store.quotas import feedback_bytes, labels_bytes
from lightning_core.types import EPISODE_ROLLOUT_PREFIX, Attempt, Feedback, Rollout, now

if TYPE_CHECKING:
    from lightning_core.store.config import StoreConfig
    from lightning_core.store.worker import DatabaseWorker

_DAY_S = 86_400.0
# Episodes started before the cutoff with neither a span nor feedback since, oldest first. The
# spans' and feedback's times are the store's clock (end_time is the caller's, so the later of
# the two is taken where a span has both).
_CANDIDATES = f"""
SELECT rollout_id FROM rollouts
WHERE mode = 'production' AND coalesce(started_at, enqueued_at) < $1
  AND rollout_id NOT IN (
      SELECT rollout_id FROM spans
      WHERE rollout_id LIKE '{EPISODE_ROLLOUT_PREFIX}%'
        AND coalesce(end_time, start_time) >= $1)
  AND substr(rollout_id, {len(EPISODE_ROLLOUT_PREFIX) + 1}) NOT IN (
      SELECT episode_id FROM feedback WHERE recorded_at >= $1)
ORDER BY coalesce(started_at, enqueued_at), rollout_id
LIMIT $2
"""


class RetentionStore:
    """Archiving of idle production episodes, on the state of the DuckDBStore it is part of."""

    config: StoreConfig
    _rollouts: dict[str, Rollout]
    _attempts: dict[str, Attempt]
    _attempts_of: dict[str, list[str]]
    _episode_written: dict[str, int]
    _episode_active: dict[str, float]
    _feedback: dict[tuple[str, str], tuple[Feedback, int]]
    _sources: dict[str, int]
    _live_episodes: int
    _labels_held: int
    _log_seq: int
    _span_seq: int
    _feedback_seq: int
    _worker: DatabaseWorker
    _archiving = False

    if TYPE_CHECKING:

        def _start_background(self) -> None: ...
        async def _sync(self, upto: int | None = None) -> None: ...

    def _file_bytes(self) -> int:
        db = self.config.db
        if db == ":memory:":
            return 0
        return sum(os.path.getsize(p) for p in (db, f"{db}.wal") if os.path.exists(p))

    async def archive_episodes(
        self, older_than_days: float | None = None, max_episodes: int | None = None
    ) -> ArchiveReport:
        """Move the production episodes idle for longer than `older_than_days` (default: the
        store's retention_days) to the archive, at most `max_episodes` of them, oldest first."""
        self._start_background()
        days = older_than_days if older_than_days is not None else self.config.retention_days
        if days is None:
            raise InvalidInput(
                "no retention window: pass older_than_days (--older-than-days) or set the "
                "store's retention_days (LIGHTNING_RETENTION_DAYS)"
            )
        folder = self.config.archive_folder()
        if folder is None:
            raise InvalidInput("a store in memory has no archive folder: set its archive_dir")
        if self._archiving:
            raise Conflict("an archive of this store is running already; wait for it to end")
        self._archiving = True
        try:
            return await self._archive(now() - days * _DAY_S, max_episodes, folder)
        finally:
            self._archiving = False

    async def _archive(self, cutoff: float, limit: int | None, folder: str) -> ArchiveReport:
        started = time.perf_counter()
        before = self._file_bytes()
        await self._sync()
        found = orjson.loads(await self._worker.query(_CANDIDATES, [cutoff, limit or 2**62]))
        candidates = [row["rollout_id"] for row in found]
        size = self.config.archive_batch_episodes
        report = ArchiveReport(
            episodes=0,
            batches=[],
            rows={},
            cutoff=cutoff,
            folder=folder,
            seconds=0.0,
            file_bytes_before=before,
            file_bytes_after=before,
        )
        episodes = {r.removeprefix(EPISODE_ROLLOUT_PREFIX) for r in candidates}
        sources: dict[str, list[tuple[str, str]]] = {}
        for key in self._feedback:
            if key[0] in episodes:
                sources.setdefault(key[0], []).append(key)
        for first in range(0, len(candidates), size):
            sealed = self._seal(candidates[first : first + size], cutoff, sources)
            if not sealed:
                continue
            bounds = {
                "log_seq": self._log_seq,
                "span_seq": self._span_seq,
                "feedback_seq": self._feedback_seq,
            }
            # Every row of the sealed episodes up to the bounds is on disk before it is moved.
            await self._sync()
            batch = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
            rows = await self._worker.archive(folder, batch, sealed, bounds, now())
            report.batches.append(batch)
            report.episodes += len(sealed)
            for table, n in rows.items():
                report.rows[table] = report.rows.get(table, 0) + n
        if report.batches:
            await self._worker.checkpoint()
        report.file_bytes_after = self._file_bytes()
        report.seconds = time.perf_counter() - started
        return report

    def _seal(
        self, rollout_ids: list[str], cutoff: float, sources: dict[str, list[tuple[str, str]]]
    ) -> list[str]:
        """Drop from the live state the episodes still idle since `cutoff`; returns them.
        One synchronous step, so no call or feedback lands between the check and the drop.
        `sources`: the feedback keys of each candidate episode (one pass over all feedback per
        archive, not per batch)."""
        sealed = []
        for rollout_id in rollout_ids:
            active = self._episode_active.get(rollout_id, 0.0) >= cutoff
            if active or rollout_id not in self._rollouts:
                continue
            rollout = self._rollouts.pop(rollout_id)
            # What it held counts no more against the store's bounds (quotas.py).
            self._live_episodes -= 1
            self._labels_held -= labels_bytes(rollout.metadata)
            episode_id = rollout_id.removeprefix(EPISODE_ROLLOUT_PREFIX)
            self._sources.pop(episode_id, None)
            for attempt_id in self._attempts_of.pop(rollout_id, ()):
                self._attempts.pop(attempt_id, None)
            self._episode_written.pop(rollout_id, None)
            self._episode_active.pop(rollout_id, None)
            # Feedback given since the pass made the episode active: these are all its keys.
            for key in sources.get(episode_id, ()):
                if (held := self._feedback.pop(key, None)) is not None:
                    self._labels_held -= feedback_bytes(held[0])
            sealed.append(rollout_id)
        # The rollout order keeps their ids (paging positions must not move); reads skip ids
        # without a rollout.
        return sealed
