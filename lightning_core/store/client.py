"""A LightningStore that talks to `lightning-rl serve` over HTTP.

It implements the same protocol as the in-process DuckDBStore and raises the same exceptions, so
runners and algorithms are written once and run either way.

Concurrent `add_spans` calls are coalesced: while one request is in flight, the spans of every
caller that arrives meanwhile go out together in the next request. Thirty-two runners then cost
the server a handful of requests per round instead of thirty-two, and each caller still returns
only when its own spans are durable.

A store that cannot be reached (a policy server being restarted) is waited for, up to
`retry_s`, rather than failed at once. A call that never reached the server (connection
refused) is always sent again; one whose answer was lost (the connection dropped mid-request)
is sent again only where a repeat cannot do a thing twice: reads, waits, heartbeats, spans
(stored once per span id), complete/fail/cancel (a repeat is refused as IllegalTransition),
enqueues (the client names the rollouts, and the store answers a known id with its rollout),
episodes (opened once per id) and feedback (the same value again is recorded once). Each
endpoint's method, path and whether it is repeatable come from the store's API table (api.py),
from which the server's routes are derived too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from lightning_core.errors import LightningError, StoreUnavailable, error_from_answer
from lightning_core.security.keys import bearer_header
from lightning_core.store import api
from lightning_core.store.base import MAX_PAGE_SIZE, NEXT_PAGE_HEADER, AttemptSelector
from lightning_core.store.bodies import ArchiveReport
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
    episode_rollout_id,
    new_id,
)

log = logging.getLogger(__name__)
ARCHIVE_TIMEOUT_S = 3600.0


class _SpanBatcher:
    """Coalesces concurrent add_spans calls into few requests, at most `max_in_flight` at once."""

    def __init__(self, send, max_in_flight: int) -> None:
        self._send = send
        self._waiting: list[tuple[list[dict[str, Any]], asyncio.Future[int]]] = []
        self._senders: set[asyncio.Task[None]] = set()
        self._max_in_flight = max_in_flight

    async def add(self, spans: list[dict[str, Any]]) -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append((spans, future))
        if len(self._senders) < self._max_in_flight:
            sender = asyncio.create_task(self._drain())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                count = await self._send([s for spans, _ in batch for s in spans])
            except LightningError as exc:
                if len(batch) == 1:
                    batch[0][1].set_exception(exc)
                    continue
                # One caller's bad span must not fail the others: resend each batch on its own,
                # so that every caller gets its own answer.
                for spans, future in batch:
                    try:
                        future.set_result(await self._send(spans))
                    except LightningError as one_exc:
                        future.set_exception(one_exc)
                continue
            except BaseException as exc:
                for _, future in batch:
                    future.set_exception(exc)
                continue
            if len(batch) == 1:
                batch[0][1].set_result(count)
                continue
            # The store counted the spans new to it in the whole request, not per caller.
            for spans, future in batch:
                future.set_result(len(spans))


# Below `lightning-rl serve`'s keep-alive timeout (SERVER_KEEPALIVE_S in serving/http_edge.py).
KEEPALIVE_S = 15.0
# A policy server restarted by its supervisor answers again after a few seconds (the tiny
# model) to a minute (a real one); two minutes covers both with room to spare.
RETRY_S = 120.0
# Waits between tries grow from the first to the last: prompt after a short blip, and no more
# than a request every few seconds while a server loads its model.
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 4.0)


class StoreClientSettings(BaseSettings):
    """How a store client rides out an unreachable store; LIGHTNING_<NAME> in the environment."""

    model_config = SettingsConfigDict(env_prefix="LIGHTNING_", extra="ignore")

    store_retry_s: float = Field(
        RETRY_S,
        ge=0,
        description="How long a store call waits for an unreachable store (a policy server "
        "being restarted) before it raises StoreUnavailable; 0 fails at once.",
    )


def _retry_s_from_env() -> float:
    return StoreClientSettings().store_retry_s


class HttpStoreClient:
    """LightningStore over HTTP; `url` is the server's root, e.g. http://127.0.0.1:4747."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_connections: int = 64,
        span_requests_in_flight: int = 2,
        retry_s: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # How long a call waits for an unreachable store before raising StoreUnavailable.
        self.retry_s = retry_s if retry_s is not None else _retry_s_from_env()
        key = api_key if api_key is not None else os.environ.get("LIGHTNING_API_KEY")
        # Public: a Runner on this client hands the same key to its agents and its OTLP exporter.
        self.api_key = key or None
        self._headers = {"content-type": "application/json", **bearer_header(key)}
        self._timeout = timeout
        self._max_connections = max_connections
        # aiohttp, not httpx: at 32 concurrent runners httpx's pool bookkeeping cost more CPU
        # than everything else the runners do. The session binds to the loop of first use.
        self._session: aiohttp.ClientSession | None = None
        self._spans = _SpanBatcher(self._send_spans, span_requests_in_flight)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                base_url=self.url + "/",
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self._timeout),
                # Idle connections are dropped before the server's keep-alive (30 s) runs out:
                # reusing one the server is closing fails with "Server disconnected".
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEPALIVE_S
                ),
                json_serialize=lambda x: orjson.dumps(x).decode(),
            )
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        repeatable: bool = True,
        retry_s: float | None = None,
        paged: bool = False,
    ):
        """One request, sent again while the store is unreachable, for up to `retry_s`.

        `repeatable`: a repeat of a request whose answer was lost does no harm (see the module
        docstring); otherwise only requests that never reached the server are sent again.
        `paged`: the answer is a page of a query; returns it and the next page's cursor.
        """
        content = orjson.dumps(body) if body is not None else None
        extra = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout is not None else {}
        loop = asyncio.get_running_loop()
        retry_s = self.retry_s if retry_s is None else retry_s
        deadline = loop.time() + retry_s
        tries = 0
        while True:
            try:
                async with self._http().request(
                    method, path.lstrip("/"), data=content, **extra
                ) as response:
                    payload = await response.read()
                    status = response.status
                    following = response.headers.get(NEXT_PAGE_HEADER)
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                never_sent = isinstance(exc, aiohttp.ClientConnectorError)
                delay = RETRY_DELAYS_S[min(tries, len(RETRY_DELAYS_S) - 1)]
                if not (never_sent or repeatable) or loop.time() + delay > deadline:
                    waited = f" (tried for {retry_s:g} s)" if tries else ""
                    raise StoreUnavailable(
                        f"cannot reach the store at {self.url}{waited}: {exc!r}; is "
                        "`lightning-rl serve` running?"
                    ) from exc
                if tries == 0:
                    log.warning(
                        "store at %s unreachable (%r): %s %s again for up to %g s",
                        self.url,
                        exc,
                        method,
                        path,
                        retry_s,
                    )
                tries += 1
                await asyncio.sleep(delay)
        if status >= 400:
            raise error_from_answer(status, payload)
        data = orjson.loads(payload) if payload else None
        return (data, following) if paged else data

    async def _ask(
        self,
        endpoint: api.Endpoint,
        *path: str,
        body: Any = None,
        timeout: float | None = None,
        retry_s: float | None = None,
    ) -> Any:
        """One request to `endpoint` (with these values of its path parameters), its answer
        read into the endpoint's response model."""
        data = await self._call(
            endpoint.method,
            endpoint.url(*path),
            body,
            timeout=timeout,
            repeatable=endpoint.repeatable,
            retry_s=retry_s,
        )
        if endpoint.wrap is not None:
            data = data[endpoint.wrap]
        return endpoint.answer.validate_python(data)

    async def _query(
        self, endpoint: api.Endpoint, body: dict[str, Any], limit: int | None = None
    ) -> Any:
        """Every item of a paged query (the first `limit`), page after page (base.PAGE_SIZE)."""
        items: list[Any] = []
        after = None
        while True:
            size = MAX_PAGE_SIZE if limit is None else min(MAX_PAGE_SIZE, limit - len(items))
            page, after = await self._call(
                endpoint.method,
                endpoint.path,
                {**body, "limit": size, "after": after},
                repeatable=endpoint.repeatable,
                paged=True,
            )
            items += page
            if after is None or (limit is not None and len(items) >= limit):
                return endpoint.answer.validate_python(items)

    async def _send_spans(self, spans: list[dict[str, Any]]) -> int:
        return await self._ask(api.ADD_SPANS, body={"spans": spans})

    # ------------------------------------------------------------------ queue

    async def enqueue_rollouts(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        # Named here, so that a repeat after a lost answer finds them instead of enqueuing twice.
        named = [
            r if r.rollout_id else r.model_copy(update={"rollout_id": new_id("ro")})
            for r in requests
        ]
        body = {"rollouts": [r.model_dump(mode="json") for r in named]}
        return await self._ask(api.ENQUEUE, body=body)

    async def enqueue_rollout(self, request: RolloutRequest) -> Rollout:
        return (await self.enqueue_rollouts([request]))[0]

    async def dequeue(self, worker_id: str, wait: float = 0.0) -> Claim | None:
        body = {"worker_id": worker_id, "wait": wait}
        return await self._ask(api.DEQUEUE, body=body, timeout=wait + 30)

    async def heartbeat(self, attempt_id: str) -> Attempt:
        return await self._ask(api.HEARTBEAT, attempt_id)

    async def complete_attempt(self, attempt_id: str, reward: float | None = None) -> Rollout:
        return await self._ask(api.COMPLETE, attempt_id, body={"reward": reward})

    async def fail_attempt(self, attempt_id: str, error: str, retry: bool = True) -> Rollout:
        body = {"error": error, "retry": retry}
        return await self._ask(api.FAIL, attempt_id, body=body)

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        return await self._ask(api.CANCEL, rollout_id)

    # ------------------------------------------------------------------ rollout queries

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._ask(api.GET_ROLLOUT, rollout_id)

    async def query_rollouts(
        self,
        rollout_ids: Sequence[str] | None = None,
        status: Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        group_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        body = {
            "rollout_ids": list(rollout_ids) if rollout_ids is not None else None,
            "status": [RolloutStatus(s).value for s in status] if status else None,
            "mode": RolloutMode(mode).value if mode else None,
            "group_id": group_id,
        }
        return await self._query(api.QUERY_ROLLOUTS, body, limit)

    async def query_attempts(self, rollout_id: str) -> list[Attempt]:
        return await self._ask(api.ATTEMPTS, rollout_id)

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        # The server caps one wait; longer waits are several requests. It counts each id once.
        ids = list(dict.fromkeys(rollout_ids))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            chunk = min(max(deadline - loop.time(), 0.0), 30.0)
            body = {"rollout_ids": ids, "timeout": chunk}
            done = await self._ask(api.WAIT, body=body, timeout=chunk + 30)
            if len(done) == len(ids) or loop.time() >= deadline:
                return done

    # ------------------------------------------------------------------ spans

    async def add_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            return 0
        return await self._spans.add([s.model_dump(mode="json") for s in spans])

    async def query_spans(
        self, rollout_ids: Sequence[str], attempt_id: AttemptSelector = None
    ) -> list[Span]:
        body = {"rollout_ids": list(rollout_ids), "attempt_id": attempt_id}
        return await self._query(api.QUERY_SPANS, body)

    # ------------------------------------------------------------------ transitions

    async def add_transitions(self, transitions: Sequence[Transition]) -> int:
        body = {"transitions": [t.model_dump(mode="json") for t in transitions]}
        return await self._ask(api.ADD_TRANSITIONS, body=body)

    async def query_transitions(
        self,
        rollout_ids: Sequence[str] | None = None,
        policy_version: str | None = None,
    ) -> list[Transition]:
        body = {
            "rollout_ids": list(rollout_ids) if rollout_ids is not None else None,
            "policy_version": policy_version,
        }
        return await self._query(api.QUERY_TRANSITIONS, body)

    # ------------------------------------------------------------------ policy versions

    async def add_policy_version(self, version: PolicyVersion) -> PolicyVersion:
        return await self._ask(api.ADD_POLICY_VERSION, body=version.model_dump(mode="json"))

    async def get_policy_version(self, name: str) -> PolicyVersion:
        return await self._ask(api.GET_POLICY_VERSION, name)

    async def list_policy_versions(self) -> list[PolicyVersion]:
        return await self._ask(api.LIST_POLICY_VERSIONS)

    # ------------------------------------------------------------------ production episodes

    async def open_episode(
        self,
        episode_id: str,
        agent_name: str | None = None,
        policy_version: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        body = {"agent_name": agent_name, "policy_version": policy_version}
        body["metadata"] = metadata or {}
        return await self._ask(api.OPEN_EPISODE, _segment(episode_id), body=body)

    async def add_feedback(self, episode_id: str, feedback: FeedbackIn) -> FeedbackReceipt:
        body = feedback.model_dump(mode="json")
        return await self._ask(api.ADD_FEEDBACK, _segment(episode_id), body=body)

    async def query_feedback(
        self,
        after_seq: int = 0,
        through_seq: int | None = None,
        episode_ids: Sequence[str] | None = None,
    ) -> list[Feedback]:
        if through_seq is None and episode_ids is None:
            # Every page must read the same window, which new feedback would widen.
            through_seq = await self.feedback_watermark()
        body = {
            "after_seq": after_seq,
            "through_seq": through_seq,
            "episode_ids": list(episode_ids) if episode_ids is not None else None,
        }
        return await self._query(api.QUERY_FEEDBACK, body)

    async def feedback_watermark(self) -> int:
        return await self._ask(api.FEEDBACK_WATERMARK)

    async def archive_episodes(
        self, older_than_days: float | None = None, max_episodes: int | None = None
    ) -> ArchiveReport:
        body = {"older_than_days": older_than_days, "max_episodes": max_episodes}
        # Minutes for a year of episodes (BENCHMARKS.md), not the seconds of a write.
        return await self._ask(api.ARCHIVE, body=body, timeout=ARCHIVE_TIMEOUT_S)

    async def check(self) -> None:
        """Reach the store once, now: StoreUnavailable (or Unauthorized, for a refused key) at
        once rather than after retry_s. For a command's first call, where an unreachable
        store is a wrong URL, not an outage to wait out."""
        await self._ask(api.QUERY_ROLLOUTS, body={"limit": 1}, retry_s=0)

    async def health(self) -> bool:
        try:
            # A health check answers now; it does not wait for a store to come back.
            return (await self._call("GET", "/health", retry_s=0))["status"] == "ok"
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> HttpStoreClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def _segment(episode_id: str) -> str:
    """An episode id as a path segment, checked here (InvalidInput) as the server would: a '/'
    would not reach the episode's route at all, only a 404 elsewhere."""
    episode_rollout_id(episode_id)
    return quote(episode_id, safe="")
