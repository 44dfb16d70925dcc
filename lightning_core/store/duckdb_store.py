"""The LightningStore on a DuckDB file: a durable queue, span sink and transition table.

How it stays fast and durable at once:
- The live state (rollouts, attempts, the queue) is kept in memory and changed on the event loop,
  one operation at a time, so every check and status move is atomic without locks.
- Every change appends rows to a pending batch. The database worker process (worker.py) commits
  the pending batch (group commit): it appends it to the store's write-ahead log and fsyncs it
  (wal.py), answers, and inserts it into DuckDB behind that (commits.py). An operation returns
  only after the batch holding its rows is committed. While one batch commits, the next one
  fills, so a thousand concurrent writers cost a few fsyncs, not a thousand.
- Reads of spans and transitions first wait for the batch in flight, and the worker answers a
  read once DuckDB holds every commit before it, so reads see every write acknowledged before
  them.
On start the live state is rebuilt from the latest row of each rollout and attempt in the logs.

Parts of the class live beside it: policy versions (policies.py), production episodes and their
feedback (episodes.py), their archiving (retention.py), transitions (transitions.py), the
paging of read queries (pages.py), and the refusals and quotas of untrusted spans (guards.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import orjson

from lightning_core import semconv
from lightning_core.errors import (
    IllegalTransition,
    InvalidInput,
    NotFound,
    StoreUnavailable,
)
from lightning_core.store import schema
from lightning_core.store.base import AttemptSelector
from lightning_core.store.config import StoreConfig
from lightning_core.store.episodes import PRODUCTION_WORKER, EpisodeStore
from lightning_core.store.guards import StoreGuards
from lightning_core.store.pages import read_cursor
from lightning_core.store.policies import PolicyVersionStore
from lightning_core.store.retention import RetentionStore
from lightning_core.store.transitions import TransitionStore
from lightning_core.store.worker import DatabaseWorker
from lightning_core.types import (
    Attempt,
    AttemptStatus,
    Claim,
    Rollout,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    Span,
    check_reward,
    new_id,
    now,
)

# How long spans recorded without waiting may sit before they are committed.
NOWAIT_FLUSH_DELAY_S = 0.05


class _Signal:
    """Wakes every waiter once per `fire`; waiters re-check their condition after waking."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        if timeout <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


class DuckDBStore(PolicyVersionStore, EpisodeStore, RetentionStore, TransitionStore, StoreGuards):
    """LightningStore backed by a DuckDB file (or ':memory:' for tests)."""

    def __init__(self, config: StoreConfig | None = None, **overrides: Any) -> None:
        self.config = (config or StoreConfig()).model_copy(update=overrides)
        # The DuckDB file belongs to a worker process; see worker.py for why.
        self._worker = DatabaseWorker(
            self.config.db, self.config.duckdb_threads, archive_dir=self.config.archive_folder()
        )

        self._rollouts: dict[str, Rollout] = {}
        self._attempts: dict[str, Attempt] = {}
        self._attempts_of: dict[str, list[str]] = defaultdict(list)
        self._queue: deque[str] = deque()
        # Every rollout id in the order the store first saw it (the order it loads them in too):
        # a page of a query resumes at an offset into it, which no later rollout moves.
        self._rollout_order: list[str] = []
        # Per running attempt: the watchdog's work list, the (trace id, span id) pairs seen (an
        # exporter's retry is stored once) and the last primary reward (the default final reward).
        self._running: dict[str, Attempt] = {}
        self._seen_spans: dict[str, set[tuple[str, str]]] = defaultdict(set)
        self._last_reward: dict[str, float] = {}
        self._log_seq = 0
        self._span_seq = 0
        self._load()
        # The loaded state lives as long as the store: out of the cyclic GC's reach, or each
        # full collection walks it (1.4 s for 200,000 episodes on this machine, loaded; a
        # year's 1,000,000 would stall every request for seconds now and then).
        gc.freeze()

        self._pending: dict[schema.Table, list[tuple[Any, ...]]] = defaultdict(list)
        self._written = 0
        self._durable = 0
        self._flusher: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._committed = _Signal()
        self._broken: BaseException | None = None
        self._work_arrived = _Signal()
        self._rollout_finished = _Signal()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ start-up

    def _load(self) -> None:
        state = self._worker.state
        self._log_seq, self._span_seq = state["log_seq"], state["span_seq"]
        for row in state["rollouts"]:
            rollout = Rollout.model_validate(row)
            self._rollouts[rollout.rollout_id] = rollout
            self._rollout_order.append(rollout.rollout_id)
            if rollout.status in (RolloutStatus.queuing, RolloutStatus.requeuing):
                self._queue.append(rollout.rollout_id)
        restarted_at = now()
        for row in state["attempts"]:
            attempt = Attempt.model_validate(row)
            production = self._rollouts[attempt.rollout_id].mode is RolloutMode.production
            if attempt.status is AttemptStatus.running and not production:
                # Heartbeats are not persisted; a worker gets a full grace period after a restart.
                attempt.last_heartbeat_at = restarted_at
                self._running[attempt.attempt_id] = attempt
            self._attempts[attempt.attempt_id] = attempt
            self._attempts_of[attempt.rollout_id].append(attempt.attempt_id)
        self._load_policies(state)
        self._load_episodes(state)

    # ------------------------------------------------------------------ durability

    def _log(self, table: schema.Table, row: tuple[Any, ...]) -> None:
        self._pending[table].append(row)
        self._written += 1

    def _log_rollout(self, rollout: Rollout) -> None:
        self._log_seq += 1
        self._log(schema.ROLLOUT_LOG, schema.rollout_row(self._log_seq, rollout))

    def _log_attempt(self, attempt: Attempt) -> None:
        self._log_seq += 1
        self._log(schema.ATTEMPT_LOG, schema.attempt_row(self._log_seq, attempt))

    async def _sync(self, upto: int | None = None) -> None:
        """Return once every change made so far (or the first `upto` changes) is on disk."""
        target = self._written if upto is None else upto
        while self._durable < target:
            if self._broken is not None:
                raise self._unavailable()
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.get_running_loop().create_task(self._flush())
            await self._committed.wait(60.0)

    async def _flush(self) -> None:
        """Commit pending rows, batch after batch, until none are left (group commit)."""
        while self._pending:
            batch, self._pending = self._pending, defaultdict(list)
            upto = self._written
            try:
                await self._worker.commit({table.name: rows for table, rows in batch.items()})
            except BaseException as exc:
                # The in-memory state now runs ahead of the file; refuse further work rather
                # than acknowledge writes that may not exist after a restart. Waiters see it
                # through _broken; the task itself ends quietly.
                self._broken = exc
                self._committed.fire()
                return
            self._durable = upto
            self._committed.fire()

    # ------------------------------------------------------------------ helpers

    def _start_background(self) -> None:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        if self._broken is not None:
            raise self._unavailable()
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def _unavailable(self) -> StoreUnavailable:
        # The worker's errors already say "the store's database failed"; say it once.
        if isinstance(self._broken, StoreUnavailable):
            return StoreUnavailable(str(self._broken))
        return StoreUnavailable(f"the store's database failed: {self._broken}")

    def _rollout(self, rollout_id: str) -> Rollout:
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFound(f"no rollout {rollout_id!r} in the store") from None

    def _attempt(self, attempt_id: str) -> Attempt:
        try:
            return self._attempts[attempt_id]
        except KeyError:
            raise NotFound(f"no attempt {attempt_id!r} in the store") from None

    def _running_attempt(self, attempt_id: str) -> tuple[Attempt, Rollout]:
        attempt = self._attempt(attempt_id)
        if attempt.status is not AttemptStatus.running:
            raise IllegalTransition(
                f"attempt {attempt_id} is {attempt.status.value}, no longer running"
                + (f" ({attempt.error})" if attempt.error else "")
                + "; its result is not accepted. Dequeue new work instead."
            )
        return attempt, self._rollouts[attempt.rollout_id]

    def _finish_attempt(
        self, attempt: Attempt, status: AttemptStatus, t: float, error: str | None = None
    ) -> None:
        attempt.status, attempt.ended_at, attempt.error = status, t, error
        self._log_attempt(attempt)
        self._running.pop(attempt.attempt_id, None)
        self._seen_spans.pop(attempt.attempt_id, None)
        self._last_reward.pop(attempt.attempt_id, None)

    def _end_attempt(
        self, attempt: Attempt, rollout: Rollout, status: AttemptStatus, error: str | None, retry
    ) -> None:
        """Finish a running attempt unsuccessfully and requeue or fail its rollout."""
        t = now()
        self._finish_attempt(attempt, status, t, error)
        # A production episode is never requeued: no runner could replay a user's session.
        retry = retry and rollout.mode is not RolloutMode.production
        if retry and rollout.attempt_count < rollout.max_attempts:
            rollout.status.check_move(RolloutStatus.requeuing, f"rollout {rollout.rollout_id}")
            rollout.status = RolloutStatus.requeuing
            self._queue.append(rollout.rollout_id)
            self._work_arrived.fire()
        else:
            rollout.status.check_move(RolloutStatus.failed, f"rollout {rollout.rollout_id}")
            rollout.status, rollout.ended_at = RolloutStatus.failed, t
            self._rollout_finished.fire()
        self._log_rollout(rollout)

    async def _watch(self) -> None:
        """Give up on attempts that ran too long or went silent (not episodes: episodes.py)."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.watchdog_interval_s)
            t = now()
            for attempt in list(self._running.values()):
                rollout = self._rollouts[attempt.rollout_id]
                if cfg.attempt_timeout_s and t - attempt.started_at > cfg.attempt_timeout_s:
                    reason = f"ran longer than attempt_timeout_s={cfg.attempt_timeout_s}"
                    self._end_attempt(attempt, rollout, AttemptStatus.timeout, reason, True)
                elif (
                    cfg.unresponsive_timeout_s
                    and t - attempt.last_heartbeat_at > cfg.unresponsive_timeout_s
                ):
                    reason = f"no heartbeat or span for {cfg.unresponsive_timeout_s} s"
                    self._end_attempt(attempt, rollout, AttemptStatus.unresponsive, reason, True)
            try:
                await self._sync()
            except StoreUnavailable:
                return

    # ------------------------------------------------------------------ queue

    async def enqueue_rollouts(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        self._start_background()
        t = now()
        answered, created = [], []
        for request in requests:
            # A known id is an enqueue sent again after its answer was lost: answered, not redone.
            if (known := self._rollouts.get(request.rollout_id or "")) is None:
                fields = request.model_dump(exclude={"rollout_id"})
                known = Rollout(
                    rollout_id=request.rollout_id or new_id("ro"), enqueued_at=t, **fields
                )
                created.append(known)
            answered.append(known)
        if len({r.rollout_id for r in created}) != len(created):
            raise InvalidInput("two rollouts of one enqueue have the same rollout_id")
        for rollout in created:
            self._rollouts[rollout.rollout_id] = rollout
            self._rollout_order.append(rollout.rollout_id)
            self._queue.append(rollout.rollout_id)
            self._log_rollout(rollout)
        if created:
            self._work_arrived.fire()
        await self._sync()
        return [r.model_copy(deep=True) for r in answered]

    async def enqueue_rollout(self, request: RolloutRequest) -> Rollout:
        return (await self.enqueue_rollouts([request]))[0]

    def _claim(self, worker_id: str) -> Claim | None:
        while self._queue:
            rollout = self._rollouts[self._queue.popleft()]
            if rollout.status not in (RolloutStatus.queuing, RolloutStatus.requeuing):
                continue  # cancelled while it waited
            t = now()
            rollout.status.check_move(RolloutStatus.running, f"rollout {rollout.rollout_id}")
            rollout.status = RolloutStatus.running
            rollout.attempt_count += 1
            rollout.started_at = rollout.started_at or t
            attempt = Attempt(
                attempt_id=new_id("at"),
                rollout_id=rollout.rollout_id,
                sequence_id=rollout.attempt_count,
                worker_id=worker_id,
                started_at=t,
                last_heartbeat_at=t,
            )
            self._attempts[attempt.attempt_id] = attempt
            self._running[attempt.attempt_id] = attempt
            self._attempts_of[rollout.rollout_id].append(attempt.attempt_id)
            self._log_rollout(rollout)
            self._log_attempt(attempt)
            return Claim(rollout=rollout.model_copy(deep=True), attempt=attempt.model_copy())
        return None

    async def dequeue(self, worker_id: str, wait: float = 0.0) -> Claim | None:
        self._start_background()
        if not worker_id:
            raise InvalidInput("worker_id must not be empty")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait, 0.0)
        while True:
            claim = self._claim(worker_id)
            if claim is not None:
                # A claim is a lease, not data: it is not waited for. Its rows commit before any
                # write of the attempt can, and if the store dies first the rollout is simply
                # still queued after the restart, and the attempt's writes are refused.
                return claim
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self._work_arrived.wait(remaining)

    async def heartbeat(self, attempt_id: str) -> Attempt:
        self._start_background()
        attempt, _ = self._running_attempt(attempt_id)
        # Liveness only: not persisted, so a heartbeat costs no disk write.
        attempt.last_heartbeat_at = now()
        return attempt.model_copy()

    async def complete_attempt(self, attempt_id: str, reward: float | None = None) -> Rollout:
        self._start_background()
        if reward is not None:
            check_reward(reward, "the attempt's reward", self.config.max_abs_reward)
        attempt, rollout = self._running_attempt(attempt_id)
        rollout.status.check_move(RolloutStatus.succeeded, f"rollout {rollout.rollout_id}")
        t = now()
        rollout.status, rollout.ended_at = RolloutStatus.succeeded, t
        rollout.episode_return = reward if reward is not None else self._last_reward.get(attempt_id)
        self._finish_attempt(attempt, AttemptStatus.succeeded, t)
        self._log_rollout(rollout)
        self._rollout_finished.fire()
        await self._sync()
        return rollout.model_copy(deep=True)

    async def fail_attempt(self, attempt_id: str, error: str, retry: bool = True) -> Rollout:
        self._start_background()
        attempt, rollout = self._running_attempt(attempt_id)
        self._end_attempt(attempt, rollout, AttemptStatus.failed, error, retry)
        await self._sync()
        return rollout.model_copy(deep=True)

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        self._start_background()
        rollout = self._rollout(rollout_id)
        rollout.status.check_move(RolloutStatus.cancelled, f"rollout {rollout_id}")
        t = now()
        for attempt_id in self._attempts_of.get(rollout_id, ()):
            attempt = self._attempts[attempt_id]
            if attempt.status is AttemptStatus.running:
                self._finish_attempt(attempt, AttemptStatus.cancelled, t)
        rollout.status, rollout.ended_at = RolloutStatus.cancelled, t
        self._log_rollout(rollout)
        self._rollout_finished.fire()
        await self._sync()
        return rollout.model_copy(deep=True)

    # ------------------------------------------------------------------ rollout queries

    async def get_rollout(self, rollout_id: str) -> Rollout:
        rollout = self._rollout(rollout_id)
        await self._sync()
        return rollout.model_copy(deep=True)

    async def query_rollouts(
        self,
        rollout_ids: Sequence[str] | None = None,
        status: Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        group_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        rollouts, _ = await self.query_rollouts_page(rollout_ids, status, mode, group_id, limit)
        return rollouts

    async def query_rollouts_page(
        self,
        rollout_ids: Sequence[str] | None = None,
        status: Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        group_id: str | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> tuple[list[Rollout], str | None]:
        """The first `limit` matching rollouts (all: None) after cursor `after`, in the order
        named (`rollout_ids`, each once) or else of arrival, and the next page's cursor (None
        when none is left): how far the scan came, so that filters need no index."""
        ids = list(dict.fromkeys(rollout_ids)) if rollout_ids is not None else self._rollout_order
        position = read_cursor(after, int, "rollouts")
        wanted = set(status) if status else None
        out: list[Rollout] = []
        while position < len(ids) and (limit is None or len(out) < limit):
            r = self._rollouts.get(ids[position])
            position += 1
            if (
                r is not None
                and (wanted is None or r.status in wanted)
                and (mode is None or r.mode == mode)
                and (group_id is None or r.group_id == group_id)
            ):
                out.append(r)
        following = str(position) if position < len(ids) and limit != 0 else None
        await self._sync()
        return [r.model_copy(deep=True) for r in out], following

    async def query_attempts(self, rollout_id: str) -> list[Attempt]:
        self._rollout(rollout_id)
        await self._sync()
        return [self._attempts[a].model_copy() for a in self._attempts_of.get(rollout_id, ())]

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        self._start_background()
        # Each id once: every waiter rescans its list whenever any rollout finishes.
        rollouts = [self._rollout(i) for i in dict.fromkeys(rollout_ids)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while True:
            done = [r for r in rollouts if r.status.finished]
            remaining = deadline - loop.time()
            if len(done) == len(rollouts) or remaining <= 0:
                await self._sync()
                return [r.model_copy(deep=True) for r in done]
            await self._rollout_finished.wait(remaining)

    # ------------------------------------------------------------------ spans

    async def add_spans(self, spans: Sequence[Span]) -> int:
        # Spans an attempt's writers send count against its quotas; the gateway's (below) don't.
        staged = self._stage_within_quotas(spans)
        await self._sync()
        return staged

    def add_spans_nowait(self, spans: Sequence[Span]) -> None:
        """Record spans without waiting for the disk (the gateway's path, off the call's latency).

        They are ordered before any write made after this call returns, commit with the next
        group, and are seen by every read made after this call returns.
        """
        self._stage_spans(spans)
        if not self._flush_scheduled:
            # Nobody waits for these: commit them a moment later, together with whatever else
            # comes by then, rather than spend a transaction (and an fsync) on each LLM call.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(NOWAIT_FLUSH_DELAY_S, self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def check_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        """The attempt, if it exists and belongs to the rollout; NotFound otherwise."""
        attempt = self._attempt(attempt_id)
        if attempt.rollout_id != rollout_id:
            raise NotFound(f"attempt {attempt_id} does not belong to rollout {rollout_id}")
        return attempt

    def _stage_spans(self, spans: Sequence[Span]) -> int:
        """Log the spans not seen before (see add_spans); returns how many it logged."""
        self._start_background()
        # Check the whole batch before touching anything, so it lands whole or not at all.
        for span in spans:
            attempt = self._attempt(span.attempt_id)
            if attempt.rollout_id != span.rollout_id:
                raise InvalidInput(
                    f"span {span.span_id}: attempt {span.attempt_id} belongs to rollout "
                    f"{attempt.rollout_id}, not {span.rollout_id}"
                )
            if span.name == semconv.REWARD_SPAN:
                value = span.attributes.get(semconv.REWARD_VALUE)
                what = f"reward span {span.span_id}'s {semconv.REWARD_VALUE!r}"
                check_reward(value, what, self.config.max_abs_reward)
        t = now()
        staged = 0
        for span in spans:
            attempt = self._attempts[span.attempt_id]
            # Not an episode's attempt, which never ends: a set of its span ids would grow as long
            # as the store runs (and the gateway, which records episodes, never repeats an id).
            running = attempt.attempt_id in self._running
            if not running and attempt.worker_id == PRODUCTION_WORKER:
                self._episode_active[span.rollout_id] = t
            if running:
                # Spans are liveness too, and an exporter's retry is stored once. Spans that
                # arrive after their attempt ended (a slow exporter) are kept as they come, and
                # read back once each (query_spans_json). Why not a unique key in DuckDB: its
                # index made a small commit 5x slower (16-44 ms, not 3) at 500k spans.
                attempt.last_heartbeat_at = t
                seen = self._seen_spans[span.attempt_id]
                if (span.trace_id, span.span_id) in seen:
                    continue
                seen.add((span.trace_id, span.span_id))
            staged += 1
            self._span_seq += 1
            self._log(schema.SPANS, schema.span_row(span, self._span_seq))
            if (
                running
                and span.name == semconv.REWARD_SPAN
                and span.attributes.get(semconv.REWARD_PRIMARY, True)
            ):
                self._last_reward[span.attempt_id] = float(span.attributes[semconv.REWARD_VALUE])
        return staged

    def _latest_attempts(self, rollout_ids: Sequence[str]) -> list[str]:
        return [self._attempts_of[r][-1] for r in rollout_ids if self._attempts_of.get(r)]

    async def query_spans_json(
        self,
        rollout_ids: Sequence[str],
        attempt_id: AttemptSelector = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> tuple[bytes, str | None]:
        """Spans as a JSON array, ready for a server to send without parsing: the first `limit`
        (all: None) after cursor `after`, and the next page's cursor (None when none is left)."""
        for rollout_id in rollout_ids:
            self._rollout(rollout_id)
        sql = "SELECT * EXCLUDE (sequence_id), sequence_id FROM spans WHERE rollout_id IN ?"
        params: list[Any] = [list(rollout_ids)]
        if attempt_id == "latest":
            sql += " AND attempt_id IN ?"
            params.append(self._latest_attempts(rollout_ids) or [""])
        elif attempt_id is not None:
            sql += " AND attempt_id = ?"
            params.append(attempt_id)
        # Each span once, as first stored: a span re-sent after its attempt ended is not caught
        # as it arrives (add_spans), and the same row twice would be one LLM call trained twice.
        sql = (
            f"SELECT * FROM ({sql} QUALIFY row_number() OVER (PARTITION BY attempt_id, trace_id, "
            "span_id ORDER BY sequence_id) = 1) WHERE sequence_id > ? ORDER BY sequence_id"
        )
        params.append(read_cursor(after, int, "spans"))
        return await self._page(sql, params, limit, ("sequence_id",))

    async def query_spans(
        self, rollout_ids: Sequence[str], attempt_id: AttemptSelector = None
    ) -> list[Span]:
        rows = orjson.loads((await self.query_spans_json(rollout_ids, attempt_id))[0])
        return [Span.model_validate(row) for row in rows]

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        if self._closed:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            await self._sync()
        except StoreUnavailable:
            if self._broken is None:
                raise
            # Already reported to every writer that waited on it; closing must still succeed.
        finally:
            self._closed = True
            await asyncio.get_running_loop().run_in_executor(None, self._worker.close)
