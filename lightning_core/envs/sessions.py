"""The sessions of one environment service: one environment instance each, bounded in number,
time per call and idle time.

Each call (reset, step, close) runs on the service's thread pool, within `step_timeout_s`, and
one session's calls run one at a time (a lock per session): an agent that sends two steps at
once gets them in order, never interleaved on the same instance. A call past its time limit
answers at once; its thread cannot be killed, so the session is closed as soon as the call
returns, and meanwhile counts against `max_sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson

from lightning_core.envs.base import (
    ActionRefused,
    Environment,
    EnvironmentFactory,
    InvalidAction,
    StepOutcome,
)
from lightning_core.envs.config import EnvServiceConfig
from lightning_core.errors import InvalidInput, LightningError, NotFound, RateLimited


class EnvTimeout(LightningError):
    status_code = 504


class EnvFailed(LightningError):
    """The environment raised (not a refused action): the session is closed."""

    status_code = 500


@dataclass
class Session:
    session_id: str
    env: Environment
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    closing: bool = False


class Sessions:
    """All sessions of a service."""

    def __init__(self, factory: EnvironmentFactory, config: EnvServiceConfig) -> None:
        self.factory, self.config = factory, config
        self.open: dict[str, Session] = {}
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="env")
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session_id in list(self.open):
            await self.close(session_id)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, session: Session | None, fn: Callable[..., Any], *args: Any) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.step_timeout_s)
        except TimeoutError:
            if session is not None:
                self._close_after(session, future)
            raise EnvTimeout(
                f"the environment took longer than {self.config.step_timeout_s:g} s; "
                "its session is closed"
            ) from None

    def _close_after(self, session: Session, future: asyncio.Future[Any]) -> None:
        session.closing = True

        def done(_: Any) -> None:
            self.open.pop(session.session_id, None)
            self._pool.submit(_quietly, session.env.close)

        future.add_done_callback(done)

    async def create(self, task: Any, seed: int | None) -> tuple[str, StepOutcome]:
        if len(self.open) >= self.config.max_sessions:
            raise RateLimited(
                f"the environment service holds {self.config.max_sessions} sessions, its "
                "limit; retry when one closes"
            )
        session = Session(secrets.token_hex(12), env=None)  # type: ignore[arg-type]
        self.open[session.session_id] = session  # holds the slot while the env starts
        try:
            session.env = await self._run(None, self.factory)
        except BaseException as exc:
            self.open.pop(session.session_id, None)  # whatever stopped the start frees the slot
            if isinstance(exc, LightningError) or not isinstance(exc, Exception):
                raise
            raise EnvFailed(
                f"the environment could not start: {type(exc).__name__}: {str(exc)[:500]}"
            ) from None
        try:
            outcome = await self._call(session, session.env.reset, task, seed)
        except ActionRefused as exc:  # a task the environment cannot begin: no session
            self._discard(session)
            raise ActionRefused(str(exc).replace("the action", "the task")) from None
        return session.session_id, outcome

    def get(self, session_id: str) -> Session:
        session = self.open.get(session_id)
        if session is None or session.closing or session.env is None:
            raise NotFound(
                f"no session {session_id!r}: it was closed, timed out or idle, or the service "
                "restarted since it began; start a new one"
            )
        return session

    async def step(self, session_id: str, action: Any) -> StepOutcome:
        session = self.get(session_id)
        async with session.lock:
            self.get(session_id)  # closed while this call waited for the lock
            outcome = await self._call(session, session.env.step, action)
            session.steps += 1
            return outcome

    async def _call(self, session: Session, fn: Callable[..., Any], *args: Any) -> StepOutcome:
        session.last_used = time.monotonic()
        try:
            result = await self._run(session, fn, *args)
        except InvalidAction as exc:
            raise ActionRefused(f"the environment refused the action: {exc}") from None
        except (LightningError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self._discard(session)
            raise EnvFailed(
                f"the environment failed: {type(exc).__name__}: {str(exc)[:500]}; its session "
                "is closed"
            ) from None
        outcome = result if isinstance(result, StepOutcome) else StepOutcome.model_validate(result)
        size = len(orjson.dumps(outcome.model_dump(mode="json"), default=str))
        if size > self.config.max_observation_bytes:
            self._discard(session)
            raise EnvFailed(
                f"the environment's answer holds {size} bytes, over the service's "
                f"max_observation_bytes={self.config.max_observation_bytes}; its session is closed"
            )
        session.last_used = time.monotonic()
        return outcome

    def _discard(self, session: Session) -> None:
        # From inside a call of the session (its lock held): gone now, released on the pool.
        session.closing = True
        self.open.pop(session.session_id, None)
        self._pool.submit(_quietly, session.env.close)

    async def close(self, session_id: str) -> bool:
        session = self.open.pop(session_id, None)
        if session is None or session.env is None:
            return False
        async with session.lock:
            await asyncio.get_running_loop().run_in_executor(
                self._pool, _quietly, session.env.close
            )
        return True

    async def _reap(self) -> None:
        every = min(self.config.idle_timeout_s / 4, 5.0)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for session in list(self.open.values()):
                idle = now - session.last_used > self.config.idle_timeout_s
                if idle and not session.lock.locked() and not session.closing:
                    await self.close(session.session_id)


def _quietly(close: Callable[[], None]) -> None:
    # A session's close must not take the service down; what it failed to release is the
    # environment's to log.
    with contextlib.suppress(Exception):
        close()


# Bodies past this are parsed on a worker thread, off the event loop that serves every session.
PARSE_INLINE_BYTES = 64 * 1024


def check_json(body: bytes, limit: int) -> Any:
    """A request body, bounded in size before it is parsed."""
    if len(body) > limit:
        raise InvalidInput(f"the request holds {len(body)} bytes, over the limit of {limit}")
    try:
        return orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request is not JSON: {exc}") from None


async def parse_json(body: bytes, limit: int) -> Any:
    """check_json, on a worker thread for a big body."""
    if len(body) <= PARSE_INLINE_BYTES:
        return check_json(body, limit)
    return await asyncio.to_thread(check_json, body, limit)
