"""Production episodes and their feedback: the part of DuckDBStore that the gateway's capture
and the feedback API use.

An episode is a rollout the gateway opens itself (`open_episode`, rollout `ep-<id>`, mode
production) for calls that carry an episode id: running from its first call, with one attempt
that no watchdog ends and no runner claims, since a production conversation may pause for days.
Its reward arrives later as feedback, an append-only log (schema.FEEDBACK): one row per recorded
change, numbered by `seq`, the newest row per (episode, source) the one that counts. A training
run that read up to seq S reads what is new since with after_seq=S, late feedback included.

A mixin of DuckDBStore: it works on the store's live state and durable log (declared below),
with the same rule as the rest of the store: a write returns once it is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, Field

from lightning_core.errors import Conflict, InvalidInput, NotFound
from lightning_core.store import quotas, schema
from lightning_core.types import (
    MAX_METADATA_BYTES,
    Attempt,
    Feedback,
    FeedbackIn,
    FeedbackReceipt,
    Rollout,
    RolloutMode,
    RolloutStatus,
    check_payload_size,
    check_reward,
    episode_rollout_id,
    finite_mean,
    finite_variance,
    new_id,
    now,
)

if TYPE_CHECKING:
    from lightning_core.store.config import StoreConfig
    from lightning_core.store.worker import DatabaseWorker


class VersionFeedback(BaseModel):
    """The live feedback of one serving policy version (EpisodeStore.feedback_by_version)."""

    policy_version: str = Field(description="The version that served the episodes.")
    episodes: int = Field(description="Episodes with feedback it served (in the window).")
    mean: float = Field(description="Mean of their feedback values.")
    variance: float = Field(
        description="Sample variance of their values (n - 1; 0 for one), at most the largest "
        "float (values stored before the reward range was checked can square past it)."
    )


# The worker id of every production episode's attempt: no runner claims it.
PRODUCTION_WORKER = "production"


class EpisodeStore:
    """Production episodes and feedback, on the state of the DuckDBStore it is part of."""

    # What it uses of the store (duckdb_store.py).
    config: StoreConfig
    _rollouts: dict[str, Rollout]
    _attempts: dict[str, Attempt]
    _attempts_of: dict[str, list[str]]
    _rollout_order: list[str]
    _written: int
    _worker: DatabaseWorker

    if TYPE_CHECKING:

        def _start_background(self) -> None: ...
        def _log(self, table: schema.Table, row: tuple[Any, ...]) -> None: ...
        def _log_rollout(self, rollout: Rollout) -> None: ...
        def _log_attempt(self, attempt: Attempt) -> None: ...
        async def _sync(self, upto: int | None = None) -> None: ...
        async def _page(
            self, sql: str, params: list[Any], limit: int | None, cursor: tuple[str, ...]
        ) -> tuple[bytes, str | None]: ...

    def _load_episodes(self, state: dict[str, Any]) -> None:
        # Per production episode (rollout id) just created: the write count once its rows were
        # logged, so that opening a known episode waits for those rows only, not for others.
        self._episode_written: dict[str, int] = {}
        # Per (episode, source): the row that counts and the write count once it was logged
        # (0: loaded from the file, on disk already).
        self._feedback: dict[tuple[str, str], tuple[Feedback, int]] = {}
        self._feedback_seq: int = state["feedback_seq"]
        # Per episode (rollout id) with a call or feedback since the store started: when, so
        # that an archive never takes an episode that became active while it chose (retention.py).
        self._episode_active: dict[str, float] = {}
        # Per episode (rollout id): its LLM calls the gateway is answering now, and, while
        # feedback waits for them to end, the event that says they have (episode_call).
        self._calls_in_flight: dict[str, int] = {}
        self._calls_ended: dict[str, asyncio.Event] = {}
        for row in state["feedback"]:
            feedback = Feedback.model_validate(row)
            self._feedback[(feedback.episode_id, feedback.source)] = (feedback, 0)
        # What production holds in memory, for its bounds (quotas.py): the live episodes, the
        # sources of each episode with feedback, and the bytes of labels (an episode's metadata,
        # its feedback's metadata and comments). Kept up to date by every write and archive.
        self._live_episodes = 0
        self._labels_held = 0
        for rollout in self._rollouts.values():
            if rollout.mode is RolloutMode.production:
                self._live_episodes += 1
                self._labels_held += quotas.labels_bytes(rollout.metadata)
        self._sources: dict[str, int] = {}
        for (episode_id, _source), (feedback, _written) in self._feedback.items():
            self._sources[episode_id] = self._sources.get(episode_id, 0) + 1
            self._labels_held += quotas.feedback_bytes(feedback)

    def _episode(self, episode_id: str) -> Rollout:
        rollout = self._rollouts.get(episode_rollout_id(episode_id))
        if rollout is None or rollout.mode is not RolloutMode.production:
            raise NotFound(
                f"no episode {episode_id!r} in the store: an episode exists once a call with "
                "this id has gone through the gateway (X-Lightning-Episode)"
            )
        return rollout

    async def get_episode(self, episode_id: str) -> Rollout:
        """The rollout of production episode `episode_id`; NotFound if there is none."""
        rollout = self._episode(episode_id)
        await self._sync()
        return rollout.model_copy(deep=True)

    async def open_episode(
        self,
        episode_id: str,
        agent_name: str | None = None,
        policy_version: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        """The attempt recording production episode `episode_id`, created by the first call:
        rollout `ep-<id>` (mode production, running) with one attempt. Later calls return that
        attempt, whatever they pass; durable before it returns. A new episode past the store's
        max_live_episodes, or with labels past max_episode_metadata_bytes, is refused
        (RateLimited, 429): quotas.py."""
        self._start_background()
        rollout_id = episode_rollout_id(episode_id)
        if (rollout := self._rollouts.get(rollout_id)) is None:
            check_payload_size(metadata or {}, "metadata", MAX_METADATA_BYTES)
            labels = {**(metadata or {}), **({"agent_name": agent_name} if agent_name else {})}
            size = quotas.labels_bytes(labels)
            quotas.check_live_episodes(self._live_episodes, self.config)
            # An episode its caller gave no labels (the gateway's) is never refused for them:
            # its agent name alone is a few bytes, bounded with the count of episodes.
            what = f"episode {episode_id!r}"
            quotas.check_labels(self._labels_held, size if metadata else 0, what, self.config)
            t = now()
            rollout = Rollout(
                rollout_id=rollout_id,
                input={"episode_id": episode_id},
                mode=RolloutMode.production,
                status=RolloutStatus.running,
                policy_version=policy_version,
                attempt_count=1,
                enqueued_at=t,
                started_at=t,
                metadata=labels,
            )
            attempt = Attempt(
                attempt_id=new_id("at"),
                rollout_id=rollout_id,
                sequence_id=1,
                worker_id=PRODUCTION_WORKER,
                started_at=t,
                last_heartbeat_at=t,
            )
            # Not in `_running`: the watchdog never ends an episode.
            self._rollouts[rollout_id] = rollout
            self._rollout_order.append(rollout_id)
            self._attempts[attempt.attempt_id] = attempt
            self._attempts_of[rollout_id].append(attempt.attempt_id)
            self._log_rollout(rollout)
            self._log_attempt(attempt)
            self._episode_written[rollout_id] = self._written
            self._live_episodes += 1
            self._labels_held += size
        elif rollout.mode is not RolloutMode.production:
            raise Conflict(f"rollout {rollout_id} exists and is not a production episode")
        self._episode_active[rollout_id] = now()
        written = self._episode_written.get(rollout_id, 0)
        await self._sync(written)
        if written:
            # On disk now: later opens need not wait for anything (0), and the map stays small.
            self._episode_written.pop(rollout_id, None)
        return self._attempts[self._attempts_of[rollout_id][0]].model_copy()

    async def open_episode_call(
        self, episode_id: str, agent_name: str | None = None, policy_version: str | None = None
    ) -> tuple[Attempt, Callable[[], None]]:
        """open_episode for the gateway's LLM call on the episode, and the call counted in
        flight until the function returned is called (episode_call)."""
        attempt = await self.open_episode(episode_id, agent_name, policy_version)
        return attempt, self.episode_call(attempt.rollout_id)

    def episode_call(self, rollout_id: str) -> Callable[[], None]:
        """Count an LLM call in flight on episode `rollout_id` until the function returned is
        called (the gateway, once the call's span is staged, or the call failed); twice is
        harmless. Feedback on the episode waits for its calls in flight (add_feedback)."""
        self._calls_in_flight[rollout_id] = self._calls_in_flight.get(rollout_id, 0) + 1
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            left = self._calls_in_flight.pop(rollout_id) - 1
            if left:
                self._calls_in_flight[rollout_id] = left
            elif (event := self._calls_ended.pop(rollout_id, None)) is not None:
                event.set()

        return end

    async def _calls_done(self, rollout_id: str) -> None:
        """Return once the episode has no call in flight, or after feedback_wait_s."""
        if not self._calls_in_flight.get(rollout_id):
            return
        event = self._calls_ended.setdefault(rollout_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), self.config.feedback_wait_s)

    async def add_feedback(self, episode_id: str, feedback: FeedbackIn) -> FeedbackReceipt:
        """Record a reward for an episode; one value counts per (episode, source), the newest.
        The same value and comment again is "unchanged" (no new row): a resent feedback is
        recorded once. A value outside the reward range (max_abs_reward) is refused, and so is
        a new source past max_feedback_sources, or labels past max_episode_metadata_bytes.

        Feedback that arrives while a call of the episode is in flight waits for the call's span
        (up to feedback_wait_s): its seq then comes after the span, and it returns once both
        are on disk, so a training run that reads the feedback finds the episode whole."""
        self._start_background()
        self._episode(episode_id)
        check_reward(feedback.value, "the feedback's value", self.config.max_abs_reward)
        await self._calls_done(episode_rollout_id(episode_id))
        self._episode(episode_id)  # archived while it waited: unknown now
        key = (episode_id, feedback.source)
        current = self._feedback.get(key)
        if current is not None:
            row, written = current
            if row.value == feedback.value and row.comment == feedback.comment:
                await self._sync(written)
                return FeedbackReceipt(feedback=row.model_copy(deep=True), status="unchanged")
        else:
            quotas.check_sources(episode_id, self._sources.get(episode_id, 0), self.config)
        # A replaced row's labels leave memory as the new row's enter it.
        grows = quotas.feedback_bytes(feedback) - (
            quotas.feedback_bytes(current[0]) if current is not None else 0
        )
        where = f"feedback on episode {episode_id!r}"
        quotas.check_labels(self._labels_held, grows, where, self.config)
        t = now()
        self._feedback_seq += 1
        row = Feedback(
            seq=self._feedback_seq,
            episode_id=episode_id,
            source=feedback.source,
            value=feedback.value,
            time=feedback.time if feedback.time is not None else t,
            recorded_at=t,
            comment=feedback.comment,
            metadata=dict(feedback.metadata),
        )
        self._log(schema.FEEDBACK, schema.feedback_row(row))
        self._feedback[key] = (row, self._written)
        self._labels_held += grows
        if current is None:
            self._sources[episode_id] = self._sources.get(episode_id, 0) + 1
        self._episode_active[episode_rollout_id(episode_id)] = t
        await self._sync()
        status = "recorded" if current is None else "replaced"
        return FeedbackReceipt(feedback=row.model_copy(deep=True), status=status)

    async def query_feedback(
        self,
        after_seq: int = 0,
        through_seq: int | None = None,
        episode_ids: Sequence[str] | None = None,
    ) -> list[Feedback]:
        rows, _ = await self.query_feedback_json(after_seq, through_seq, episode_ids)
        return [Feedback.model_validate(row) for row in orjson.loads(rows)]

    async def query_feedback_json(
        self,
        after_seq: int = 0,
        through_seq: int | None = None,
        episode_ids: Sequence[str] | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> tuple[bytes, str | None]:
        """As a JSON array, the first `limit` (all: None) after page cursor `after`, and the
        next page's cursor (None when none is left).

        The feedback that counts (newest per episode and source, among rows up to
        `through_seq`) of the episodes with a row in (after_seq, through_seq], or, with
        `episode_ids`, of those episodes (`after_seq` then plays no part). Ordered by episode
        and source. Read windows end to end ((0, S1], (S1, S2], ...): late feedback on an old
        episode brings that episode back once, with its whole current feedback."""
        watermark = self._feedback_seq
        through = watermark if through_seq is None else through_seq
        if after_seq < 0 or through < 0:
            raise InvalidInput("after_seq and through_seq must be >= 0")
        if through > watermark:
            # Rows up to it may still arrive: a later read of the next window would see them
            # again. Only a watermark the store gave out is a safe end.
            raise InvalidInput(
                f"through_seq {through} is past the feedback watermark {watermark}: take it "
                "from feedback_watermark()"
            )
        if episode_ids is None and after_seq >= through:
            return b"[]", None
        sql = f"SELECT * FROM ({schema.LATEST_FEEDBACK}) WHERE "
        params: list[Any] = [through]
        if episode_ids is not None:
            sql += "episode_id IN ?"
            params.append(list(episode_ids) or [""])
        else:
            sql += "episode_id IN (SELECT episode_id FROM feedback WHERE seq > ? AND seq <= ?)"
            params += [after_seq, through]
        if after is not None:
            episode_id, source = _feedback_cursor(after)
            sql += " AND (episode_id, source) > (?, ?)"
            params += [episode_id, source]
        return await self._page(
            sql + " ORDER BY episode_id, source", params, limit, ("episode_id", "source")
        )

    async def feedback_by_version(
        self, window: int | None = None, since: float | None = None
    ) -> list[VersionFeedback]:
        """Live feedback per serving policy version: each episode with feedback counts once,
        for the version that served its first call, with the mean of its sources' values
        (the `mean` rule of offline.combine); `window`: a version's newest `window` episodes
        only (by their newest feedback), None: all; `since`: episodes begun at or after that
        time only (a canary's start). Read from the store's memory: no query."""
        if window is not None and window < 1:
            raise InvalidInput(f"window must be at least 1, not {window}")
        per_episode: dict[str, list[Feedback]] = {}
        for (episode_id, _source), (row, _written) in self._feedback.items():
            per_episode.setdefault(episode_id, []).append(row)
        per_version: dict[str, list[tuple[float, float]]] = {}
        for episode_id, rows in per_episode.items():
            rollout = self._rollouts.get(episode_rollout_id(episode_id))
            if rollout is None or rollout.policy_version is None:
                continue
            if since is not None and (rollout.started_at or 0.0) < since:
                continue
            value = finite_mean([r.value for r in rows])
            newest = max(r.recorded_at for r in rows)
            per_version.setdefault(rollout.policy_version, []).append((newest, value))
        await self._sync()
        answer = []
        for version, items in sorted(per_version.items()):
            items.sort(reverse=True)
            values = [v for _, v in items[:window]]
            # Finite for any finite values (a 500 on every read otherwise, as long as a value
            # of 1e200 stored before the reward range was checked is in the window).
            mean = finite_mean(values)
            variance = finite_variance(values)
            answer.append(
                VersionFeedback(
                    policy_version=version, episodes=len(values), mean=mean, variance=variance
                )
            )
        return answer

    async def feedback_watermark(self) -> int:
        """The highest feedback seq recorded, 0 when none: the end of the next read window."""
        seq = self._feedback_seq
        await self._sync()
        return seq


def _feedback_cursor(after: str) -> tuple[str, str]:
    """The (episode, source) key of the last row of a page, from the cursor the store gave."""
    try:
        value = orjson.loads(after)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return value[0], value[1]
    raise InvalidInput(f"cursor {after[:100]!r} of feedback is not one the store gave out")
