"""The LightningStore protocol: one interface for the in-process store and the HTTP client."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from lightning_core.types import (
    Attempt,
    Claim,
    Feedback,
    FeedbackIn,
    FeedbackReceipt,
    PolicyVersion,
    Rollout,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    Span,
    Transition,
)


@runtime_checkable
class SpanRecorder(Protocol):
    """What a component that records spans as they happen (the gateway) needs of a store.

    The in-process store implements it; the gateway depends on this protocol only, never on a
    concrete store, so the store knows nothing of the gateway and the gateway nothing of DuckDB.
    """

    def check_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        """The attempt, if it exists and belongs to the rollout; NotFound otherwise."""
        ...

    def add_spans_nowait(self, spans: Sequence[Span]) -> None:
        """Record spans without waiting for the disk; they are durable shortly after."""
        ...

    def rollout_policy(self, rollout_id: str) -> str | None:
        """The policy version a rollout is meant for; None: any (or no such rollout)."""
        ...

    async def get_policy_version(self, name: str) -> PolicyVersion: ...

    async def open_episode(
        self,
        episode_id: str,
        agent_name: str | None = None,
        policy_version: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        """The attempt recording production episode `episode_id`, created on first use."""
        ...

    async def open_episode_call(
        self, episode_id: str, agent_name: str | None = None, policy_version: str | None = None
    ) -> tuple[Attempt, Callable[[], None]]:
        """open_episode for an LLM call, counted in flight on the episode until the function
        returned is called (when the call has ended, just before its span is staged)."""
        ...


# "latest" selects the newest attempt of each rollout, which is what a trainer wants after retries.
AttemptSelector = Literal["latest"] | str | None

# Over HTTP, queries answer in pages: `POST /store/rollouts/query {}` once sent the whole store
# (100 MB) in one body, held in the server's memory while it went out. A page is at most
# MAX_PAGE_SIZE items (PAGE_SIZE when the request names no limit); when more are left the
# answer carries NEXT_PAGE_HEADER, an opaque cursor to send back as `after`. The Python API
# returns whole results: HttpStoreClient follows the cursors itself.
PAGE_SIZE = 1_000
MAX_PAGE_SIZE = 10_000
NEXT_PAGE_HEADER = "x-lightning-next-page"


@runtime_checkable
class LightningStore(Protocol):
    """Rollout queue, span sink and transition table shared by the algorithm and the runners.

    Every write returns only once it is durable, and a call that writes several things (a batch
    of rollouts, spans or transitions) lands whole or not at all. A claim (`dequeue`) is the one
    exception: it is a lease, durable before any write of its attempt is acknowledged.
    """

    async def enqueue_rollouts(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        """Queue new rollouts, in order."""
        ...

    async def dequeue(self, worker_id: str, wait: float = 0.0) -> Claim | None:
        """Claim the oldest queued rollout for `worker_id` as a new attempt.

        Waits up to `wait` seconds for work to arrive; None when there is none.
        """
        ...

    async def heartbeat(self, attempt_id: str) -> Attempt:
        """Tell the store the worker of a running attempt is alive."""
        ...

    async def complete_attempt(self, attempt_id: str, reward: float | None = None) -> Rollout:
        """Mark the attempt and its rollout succeeded.

        Without `reward`, the final reward is the last primary reward span of the attempt.
        """
        ...

    async def fail_attempt(self, attempt_id: str, error: str, retry: bool = True) -> Rollout:
        """Mark the attempt failed; the rollout is requeued while attempts remain and `retry`."""
        ...

    async def cancel_rollout(self, rollout_id: str) -> Rollout: ...

    async def get_rollout(self, rollout_id: str) -> Rollout: ...

    async def query_rollouts(
        self,
        rollout_ids: Sequence[str] | None = None,
        status: Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        group_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]: ...

    async def query_attempts(self, rollout_id: str) -> list[Attempt]: ...

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        """The finished rollouts among `rollout_ids`, waiting up to `timeout` s for all of them."""
        ...

    async def add_spans(self, spans: Sequence[Span]) -> int:
        """Store spans; returns how many were new.

        Spans are idempotent by (attempt, trace id, span id): a span sent again (an exporter's
        retry) is read back once. One re-sent while its attempt runs is not stored again and
        not counted; one re-sent after its attempt ended (or to a production episode) is
        counted, as the store no longer keeps that attempt's ids in memory, but every query
        still returns it once. (An HTTP client that sent concurrent calls in one request
        counts each call's spans as sent.)
        """
        ...

    async def query_spans(
        self, rollout_ids: Sequence[str], attempt_id: AttemptSelector = None
    ) -> list[Span]:
        """Spans of the rollouts in arrival order; `attempt_id` filters (or "latest")."""
        ...

    async def add_transitions(self, transitions: Sequence[Transition]) -> int: ...

    async def query_transitions(
        self,
        rollout_ids: Sequence[str] | None = None,
        policy_version: str | None = None,
    ) -> list[Transition]: ...

    async def add_policy_version(self, version: PolicyVersion) -> PolicyVersion: ...

    async def get_policy_version(self, name: str) -> PolicyVersion: ...

    async def list_policy_versions(self) -> list[PolicyVersion]: ...

    async def open_episode(
        self,
        episode_id: str,
        agent_name: str | None = None,
        policy_version: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        """The attempt of production episode `episode_id` (rollout `ep-<id>`, mode production).

        Idempotent: the first call creates the rollout (running) and its one attempt (worker
        "production"), later calls return that attempt. No watchdog ever ends it.
        """
        ...

    async def add_feedback(self, episode_id: str, feedback: FeedbackIn) -> FeedbackReceipt:
        """Record a reward for an episode (NotFound if unknown). Per (episode, source): the
        same value and comment again is "unchanged" (same seq, no new row), another value
        "replaced" (a new row, a new seq; the newest counts), the first "recorded"."""
        ...

    async def query_feedback(
        self,
        after_seq: int = 0,
        through_seq: int | None = None,
        episode_ids: Sequence[str] | None = None,
    ) -> list[Feedback]:
        """Newest row per (episode, source) among rows with seq <= through_seq (None: the
        watermark), for the episodes with a row in (after_seq, through_seq], or, with
        `episode_ids`, for those episodes. Ordered by episode_id, source."""
        ...

    async def feedback_watermark(self) -> int:
        """The highest feedback seq, 0 when none."""
        ...

    async def close(self) -> None: ...
