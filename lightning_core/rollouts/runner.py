"""The rollout runner: claims rollouts from the store's queue and runs an agent on each attempt.

An agent is any callable `(task, llm: LLMEndpoint) -> float | None`, sync or async. It gets the
rollout's `input` and an OpenAI-compatible endpoint whose every call the gateway records on the
attempt, and returns its reward (None when it emitted the reward itself with `emit_reward`).

One attempt: the agent runs inside `rollout_context`, so that every span it starts is stamped
with the attempt, under a time budget and with a heartbeat beside it; then its spans are flushed
to the store and the attempt is completed, or, on an exception or timeout, an exception span
with the traceback is recorded and the attempt failed (the store requeues the rollout while it
has attempts left). An agent's failure is the attempt's, never the runner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.util
import inspect
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode
from pydantic import BaseModel, Field

from lightning_core import tracing
from lightning_core.errors import IllegalTransition, InvalidInput, LightningError
from lightning_core.security.keys import agent_key
from lightning_core.store.base import LightningStore
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import (
    AttemptStatus,
    Claim,
    LLMEndpoint,
    Rollout,
    Sampling,
    check_reward,
)

log = logging.getLogger(__name__)

# The span an attempt's failure is recorded as; its "exception" event carries the OpenTelemetry
# exception.type / exception.message / exception.stacktrace attributes.
EXCEPTION_SPAN = "lightning.exception"
# After a store error while claiming work, wait this long before trying again: long enough not to
# hammer a restarting server, short enough to resume promptly once it is back.
STORE_RETRY_S = 2.0
# run_until_done waits for its rollouts in slices this long, to notice workers that died.
WAIT_SLICE_S = 5.0
# An error message stored on an attempt is one line of at most this many characters.
MAX_ERROR_CHARS = 500

Agent = Callable[[Any, LLMEndpoint], float | Awaitable[float | None] | None]


class RunnerConfig(BaseModel):
    """How a runner pulls and runs rollouts."""

    concurrency: int = Field(
        8,
        ge=1,
        description="Attempts run at once. Agents mostly wait on the LLM, so this is bounded by "
        "what the gateway serves well, not by this machine's cores.",
    )
    rollout_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Time budget of one attempt; past it the attempt is failed (and retried while "
        "the rollout has attempts left). A sync agent's thread cannot be stopped and runs on.",
    )
    heartbeat_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often a running attempt tells the store its worker is alive; well under "
        "the store's unresponsive_timeout_s (300 s by default).",
    )
    poll_wait_s: float = Field(
        1.0,
        gt=0,
        description="Long-poll wait of one dequeue; a stop request is noticed within it, since a "
        "dequeue is never interrupted (that could lose a claim the store already made).",
    )
    default_model: str = Field(
        "base",
        description="Model an agent is told to use when the rollout names no policy_version: a "
        "policy version registered in the store, or the gateway's base model id.",
    )
    worker_id_prefix: str | None = Field(
        None,
        description="Workers are named '<prefix>-<n>' in the store; None uses "
        "'runner-<hostname>-<pid>', unique per process.",
    )


class AttemptTimeout(Exception):
    """The agent ran past the attempt's time budget."""


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt ended, as the runner reports it to its `on_attempt` callback."""

    rollout_id: str
    attempt_id: str
    sequence_id: int
    # succeeded, failed, or timeout when the time budget ran out (the store records it failed).
    status: AttemptStatus
    # The rollout's final reward as the store recorded it (it may come from a reward span).
    reward: float | None
    error: str | None
    duration_s: float
    # The rollout after the store took the result; None if the store could not be told.
    rollout: Rollout | None


@dataclass
class RunStats:
    """Attempts a `run` finished, by outcome."""

    succeeded: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.succeeded + self.failed

    def add(self, result: AttemptResult) -> None:
        if result.status is AttemptStatus.succeeded:
            self.succeeded += 1
        else:
            self.failed += 1


class _Budget:
    """How many more attempts may be claimed; a slot is taken before a dequeue, so concurrent
    workers never claim more than `max_rollouts` together."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def take(self) -> bool:
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def give_back(self) -> None:
        if self.left is not None:
            self.left += 1


# ---------------------------------------------------------------------------- tracing

_traced_target: tuple[Any, ...] | None = None
_traced_provider: TracerProvider | None = None
# Rollout workers (a flow's run-rollouts tasks, each on its own thread) set tracing up at once:
# unserialised, two made a provider each and the second shut the first down, so the first
# worker's flushes failed ("spans of attempt ... were not all flushed", 16 in a row) and its
# spans were dropped. A resumed run hit it: its first iteration's rollouts were the process's
# first, where an uninterrupted run's base evaluation had set tracing up alone before.
_traced_lock = threading.Lock()


def ensure_tracing(store: LightningStore, api_key: str | None = None) -> TracerProvider:
    """Ship the spans of rollouts to `store`, setting tracing up once per process and store.

    An HttpStoreClient gets OTLP/HTTP to its server; an in-process store gets spans on the
    running event loop, which must be the store's. Tracing is global to the process: pointing it
    at another store (tests do) shuts the previous provider down, so one process runs agents for
    one store at a time.
    """
    global _traced_target, _traced_provider
    if isinstance(store, HttpStoreClient):
        key = api_key if api_key is not None else store.api_key
        # The key is part of the target: a server restarted on the same port with a new key
        # needs a new exporter.
        target: tuple[Any, ...] = ("otlp", store.url, key)
    else:
        target = ("in-process", store, asyncio.get_running_loop())
    with _traced_lock:
        if _traced_provider is not None and target == _traced_target:
            return _traced_provider
        # tracing.instrument_frameworks looks instrumentors up by their parent package, which
        # raises rather than answers "absent" when no OpenInference package is installed.
        instrument = importlib.util.find_spec("openinference") is not None
        if isinstance(store, HttpStoreClient):
            provider = tracing.setup_tracing(store.url, api_key=target[2], instrument=instrument)
        else:
            provider = tracing.setup_tracing(store=store, loop=target[2], instrument=instrument)
        if _traced_provider is not None:
            _traced_provider.shutdown()
        _traced_target, _traced_provider = target, provider
        return provider


def _record_exception(provider: TracerProvider, exc: BaseException, summary: str) -> None:
    """An error span for the failure, stamped with the current rollout attempt."""
    span = provider.get_tracer("lightning-rl.runner").start_span(EXCEPTION_SPAN)
    span.set_attributes(
        {"exception.type": type(exc).__qualname__, "exception.message": _one_line(str(exc))}
    )
    # The event carries the traceback, formatted from the exception's own frames (for a sync
    # agent, the frames of its thread).
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, summary))
    span.end()


# ---------------------------------------------------------------------------- agents


def _is_async(agent: Callable[..., Any]) -> bool:
    # An object with an async __call__ is an async agent too.
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """Run `fn` in a thread of its own, with the caller's context variables (the rollout).

    A daemon thread, not an executor's: an agent that hangs past its timeout cannot be killed,
    and in a pool it would hold a worker forever and block the interpreter's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # the attempt timed out or was cancelled meanwhile
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def target() -> None:
        result, exc = None, None
        try:
            result = context.run(fn, *args)
        except Exception as caught:
            exc = caught
        except BaseException as caught:
            # SystemExit or KeyboardInterrupt in an agent's thread ends its attempt, not the
            # runner awaiting it.
            exc = RuntimeError(f"the agent raised {type(caught).__name__}")
            exc.__cause__ = caught
        with contextlib.suppress(RuntimeError):  # the loop closed while the agent ran
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=target, name="lightning-agent", daemon=True).start()
    return future


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    not_finite = isinstance(value, float) and not math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not_finite:
        raise InvalidInput(
            f"the agent returned {value!r}; an agent returns its reward as a finite number, or "
            "None after recording it with emit_reward"
        )
    # The store would refuse it on completion; refused here, the message is the same.
    return check_reward(value, "the reward the agent returned")


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"


def _summary(exc: BaseException) -> str:
    message = str(exc)
    return _one_line(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


# ---------------------------------------------------------------------------- runner


class Runner:
    """Runs `agent` on the rollouts of `store`'s queue, `config.concurrency` attempts at a time.

    `gateway_url` is the root URL of the server whose gateway serves the policy (the store's own
    server); `api_key` is that server's key (None: the key of `store`, when it is an
    HttpStoreClient), used for OTLP. Agents never get it: each attempt's agent gets an agent
    key derived from it (keys.agent_key), which opens that attempt's gateway routes and span
    writes only. `on_attempt` is called with each finished attempt's AttemptResult, for
    progress reporting.
    """

    def __init__(
        self,
        agent: Agent,
        store: LightningStore,
        gateway_url: str,
        config: RunnerConfig | None = None,
        api_key: str | None = None,
        on_attempt: Callable[[AttemptResult], None] | None = None,
    ) -> None:
        if not callable(agent):
            raise InvalidInput(f"an agent must be callable, got {type(agent).__name__}")
        self.agent = agent
        self.store = store
        self.gateway_url = gateway_url.rstrip("/")
        self.config = config or RunnerConfig()
        if api_key is None and isinstance(store, HttpStoreClient):
            api_key = store.api_key
        self.api_key = api_key
        self.on_attempt = on_attempt
        # Over every run of this runner, so that a run that was cancelled still counts.
        self.stats = RunStats()
        self._provider: TracerProvider | None = None

    @property
    def worker_id_prefix(self) -> str:
        return self.config.worker_id_prefix or f"runner-{socket.gethostname()}-{os.getpid()}"

    def endpoint(self, claim: Claim) -> LLMEndpoint:
        """The LLM endpoint of an attempt: the gateway, under the attempt's prefix."""
        rollout, attempt = claim.rollout, claim.attempt
        sampling = Sampling.model_validate(rollout.metadata.get("sampling") or {})
        return LLMEndpoint(
            base_url=f"{self.gateway_url}/rollouts/{rollout.rollout_id}"
            f"/attempts/{attempt.attempt_id}/v1",
            model=rollout.policy_version or self.config.default_model,
            # A keyless server takes any key; OpenAI's client insists on one.
            api_key=agent_key(self.api_key, attempt.attempt_id) if self.api_key else "lightning",
            sampling=sampling.for_attempt(attempt.sequence_id).as_kwargs(),
        )

    async def run(
        self, stop: asyncio.Event | None = None, max_rollouts: int | None = None
    ) -> RunStats:
        """Claim and run attempts until `stop` is set or `max_rollouts` attempts are finished.

        After `stop`, attempts in flight run to their end (or timeout). Cancelling `run` fails
        the attempts in flight instead, so the store requeues their rollouts at once.
        """
        stop = stop or asyncio.Event()
        self._provider = ensure_tracing(self.store, self.api_key)
        budget, stats = _Budget(max_rollouts), RunStats()
        async with asyncio.TaskGroup() as workers:
            for n in range(self.config.concurrency):
                worker_id = f"{self.worker_id_prefix}-{n}"
                workers.create_task(self._work(worker_id, stop, budget, stats))
        return stats

    async def run_until_done(
        self, rollout_ids: Sequence[str], timeout: float | None = None
    ) -> list[Rollout]:
        """Run until every rollout of `rollout_ids` is finished, or `timeout` s have passed.

        Returns the finished ones, as `wait_for_rollouts` does. For a training loop that enqueues
        a batch and waits for it; workers may also take other queued rollouts meanwhile, which
        they finish before this returns.
        """
        if not rollout_ids:
            return []
        stop = asyncio.Event()
        workers = asyncio.create_task(self.run(stop))
        try:
            return await self._wait_finished(rollout_ids, timeout, workers)
        except BaseException:
            workers.cancel()
            raise
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await workers

    async def _wait_finished(
        self, rollout_ids: Sequence[str], timeout: float | None, workers: asyncio.Task
    ) -> list[Rollout]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = math.inf if deadline is None else max(deadline - loop.time(), 0.0)
            finished = await self.store.wait_for_rollouts(rollout_ids, min(left, WAIT_SLICE_S))
            if len(finished) == len(rollout_ids) or left <= WAIT_SLICE_S:
                return finished
            if workers.done():  # they only end early by raising: surface why
                workers.result()
                return finished

    # ------------------------------------------------------------------ one worker

    async def _work(
        self, worker_id: str, stop: asyncio.Event, budget: _Budget, stats: RunStats
    ) -> None:
        while not stop.is_set() and budget.take():
            try:
                claim = await self.store.dequeue(worker_id, wait=self.config.poll_wait_s)
            except LightningError as exc:
                budget.give_back()
                log.warning(
                    "%s: cannot claim work: %s; retrying in %g s", worker_id, exc, STORE_RETRY_S
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), STORE_RETRY_S)
                continue
            if claim is None:
                budget.give_back()
                continue
            result = await self._run_attempt(claim)
            for counts in (stats, self.stats):
                counts.add(result)
            self._report(result)

    def _report(self, result: AttemptResult) -> None:
        log.info(
            "rollout %s attempt %d %s in %.1f s%s",
            result.rollout_id,
            result.sequence_id,
            result.status.value,
            result.duration_s,
            f": {result.error}" if result.error else f", reward {result.reward}",
        )
        if self.on_attempt is not None:
            try:
                self.on_attempt(result)
            except Exception:
                log.exception("the on_attempt callback failed")

    # ------------------------------------------------------------------ one attempt

    async def _run_attempt(self, claim: Claim) -> AttemptResult:
        rollout, attempt = claim.rollout, claim.attempt
        started = time.monotonic()
        status, reward, error = AttemptStatus.succeeded, None, None
        heartbeat = asyncio.create_task(self._heartbeat(attempt.attempt_id))
        try:
            with tracing.rollout_context(rollout.rollout_id, attempt.attempt_id):
                try:
                    reward = await self._call_agent(claim)
                    if reward is not None:
                        # A returned reward is a span too, so that it is ordered after the
                        # attempt's LLM calls like one the agent emits itself.
                        tracing.emit_reward(reward)
                except asyncio.CancelledError as exc:
                    # The runner is stopping hard: hand the rollout back rather than hold it
                    # until the store presumes this worker dead.
                    error = "the runner stopped before the agent finished"
                    _record_exception(self._require_provider(), exc, error)
                    await self._finish(claim, AttemptStatus.failed, None, error)
                    raise
                except Exception as exc:
                    timed_out = isinstance(exc, AttemptTimeout)
                    status = AttemptStatus.timeout if timed_out else AttemptStatus.failed
                    error = str(exc) if timed_out else _summary(exc)
                    _record_exception(self._require_provider(), exc, error)
                    # Info, not warning: the failure is the attempt's, reported with it below,
                    # and its traceback is in the exception span.
                    log.info(
                        "rollout %s attempt %d: the agent failed",
                        rollout.rollout_id,
                        attempt.sequence_id,
                        exc_info=not timed_out,
                    )
        finally:
            heartbeat.cancel()
        after = await self._finish(claim, status, reward, error)
        return AttemptResult(
            rollout_id=rollout.rollout_id,
            attempt_id=attempt.attempt_id,
            sequence_id=attempt.sequence_id,
            status=status,
            reward=after.episode_return if after is not None else reward,
            error=error,
            duration_s=time.monotonic() - started,
            rollout=after,
        )

    async def _call_agent(self, claim: Claim) -> float | None:
        """The agent's reward; AttemptTimeout past the time budget."""
        llm = self.endpoint(claim)
        limit = self.config.rollout_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                if _is_async(self.agent):
                    value = await self.agent(claim.rollout.input, llm)
                else:
                    value = await _in_daemon_thread(self.agent, claim.rollout.input, llm)
                    if inspect.isawaitable(value):  # e.g. a partial of an async function
                        value = await value
        except TimeoutError:
            if deadline.expired():  # not a TimeoutError the agent raised itself
                raise AttemptTimeout(f"the agent ran past rollout_timeout_s={limit:g}") from None
            raise
        return _as_reward(value)

    async def _heartbeat(self, attempt_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.store.heartbeat(attempt_id)
            except IllegalTransition as exc:
                # The store ended the attempt (cancelled, or timed out there): nothing to keep
                # alive. The agent runs on; its result will be refused.
                log.info("attempt %s ended in the store: %s", attempt_id, exc)
                return
            except LightningError as exc:
                log.warning("heartbeat of attempt %s failed: %s", attempt_id, exc)

    async def _finish(
        self, claim: Claim, status: AttemptStatus, reward: float | None, error: str | None
    ) -> Rollout | None:
        """Flush the attempt's spans, then tell the store how it ended."""
        attempt_id = claim.attempt.attempt_id
        # Off the loop: the in-process exporter schedules its write onto this very loop and
        # waits for it, so flushing here would deadlock.
        if not await asyncio.to_thread(self._flush):
            log.warning("spans of attempt %s were not all flushed", attempt_id)
        try:
            if status is AttemptStatus.succeeded:
                return await self.store.complete_attempt(attempt_id, reward)
            return await self.store.fail_attempt(attempt_id, error=error or "failed", retry=True)
        except IllegalTransition as exc:
            log.info("the store no longer takes attempt %s: %s", attempt_id, exc)
        except LightningError as exc:
            log.warning("could not record the end of attempt %s: %s", attempt_id, exc)
        return None

    def _flush(self) -> bool:
        # The agent's spans go to tracing's current provider, which is ours unless someone set
        # tracing up again since; flushing both (the same one is a no-op) loses nothing.
        flushed = self._require_provider().force_flush()
        return tracing.flush() and flushed

    def _require_provider(self) -> TracerProvider:
        if self._provider is None:
            self._provider = ensure_tracing(self.store, self.api_key)
        return self._provider
