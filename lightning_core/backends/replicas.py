"""`ReplicatedBackend`: one policy served from several backends (replicas), as one Backend.

Routing, per call:
- The least-loaded replica: fewest calls in flight, then fewest calls routed so far (so that
  calls one after another alternate).
- A call with an `affinity` key (the gateway gives each rollout's calls its rollout id) goes
  where its key's earlier calls went, while that replica has at most `affinity_slack` more calls
  in flight than the least-loaded one: a rollout's calls share their growing prompt, and its
  prefix is cached on that replica. Past the slack the key moves to the least-loaded one.
  Keys are kept for the `max_affinity_keys` most recently used.
- Only replicas that hold the call's adapter are candidates.

Adapters are loaded on every replica at once; if any fails, the ones that succeeded unload it
again and the error is raised: a version is never half-loaded. `adapters()` lists the names held
by every replica that is up.

A replica that raises BackendUnavailable (refused connection, a process gone, a vLLM server
restarting) is marked down: calls skip it for `recheck_s`, then one call tries it again. A
failed `generate` is sent once more to another replica; a stream only while nothing of it was
yielded. A replica marked down when an adapter is loaded is left out of that load, and never
gets that adapter's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from lightning_core.backends.base import (
    Backend,
    Choice,
    GenerationRequest,
    StreamDelta,
    check_stream_request,
)
from lightning_core.errors import BackendUnavailable, InvalidInput, NotFound

# A rollout's next call waits at most this many calls' worth of queue for its cached prefix:
# a prefill of a few thousand tokens saved is worth a few sequences of batch position.
AFFINITY_SLACK = 4
# Rollouts in flight at once are in the hundreds; older keys belong to finished rollouts.
MAX_AFFINITY_KEYS = 10_000
# A vLLM server restarts in 30 s and more; a dead replica process costs one refused connect
# (under a millisecond) per recheck.
RECHECK_S = 10.0


@dataclass(eq=False)
class Replica:
    """One backend and what the router knows of it."""

    index: int
    backend: Backend
    in_flight: int = 0
    calls: int = 0
    errors: int = 0
    up: bool = True
    retry_at: float = 0.0
    last_error: str | None = field(default=None, repr=False)

    def usable(self, now: float) -> bool:
        return self.up or now >= self.retry_at

    def serves(self, adapter: str | None) -> bool:
        return adapter is None or adapter in self.backend.adapters()

    def stats(self) -> dict[str, Any]:
        return {
            "replica": self.index,
            "url": getattr(self.backend, "url", None),
            "up": self.up,
            "in_flight": self.in_flight,
            "calls": self.calls,
            "errors": self.errors,
            "adapters": self.backend.adapters(),
            "last_error": self.last_error,
        }


class ReplicatedBackend:
    """The Backend protocol over `replicas`, all serving the same base model."""

    def __init__(
        self,
        replicas: list[Backend],
        affinity_slack: int = AFFINITY_SLACK,
        max_affinity_keys: int = MAX_AFFINITY_KEYS,
        recheck_s: float = RECHECK_S,
    ) -> None:
        if not replicas:
            raise InvalidInput("a replicated backend needs at least one replica")
        names = {r.base_model for r in replicas}
        if len(names) > 1:
            raise InvalidInput(f"replicas serve different base models: {sorted(names)}")
        self.replicas = [Replica(i, b) for i, b in enumerate(replicas)]
        self.base_model: str = replicas[0].base_model
        self.tokenizer: Any = replicas[0].tokenizer
        self.affinity_slack = affinity_slack
        self.max_affinity_keys = max_affinity_keys
        self.recheck_s = recheck_s
        self._homes: OrderedDict[str, Replica] = OrderedDict()
        self.affinity_hits = 0
        self.affinity_moves = 0

    # ---- lifecycle

    async def start(self) -> ReplicatedBackend:
        """Start the replicas that need it (vLLM servers), all at once."""
        starts = [getattr(r.backend, "start", None) for r in self.replicas]
        try:
            await asyncio.gather(*(start() for start in starts if start is not None))
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        results = await asyncio.gather(
            *(r.backend.close() for r in self.replicas), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # ---- routing

    def _pick(self, request: GenerationRequest, tried: list[Replica]) -> Replica:
        now = time.monotonic()
        candidates = [
            r
            for r in self.replicas
            if r not in tried and r.usable(now) and r.serves(request.adapter)
        ]
        if not candidates:
            raise BackendUnavailable(self._why_none(request))
        chosen = self._route(request.affinity, candidates)
        if not chosen.up:  # a down replica's recheck: this one call tries it
            chosen.retry_at = now + self.recheck_s
        return chosen

    def _route(self, key: str | None, candidates: list[Replica]) -> Replica:
        least = min(candidates, key=lambda r: (r.in_flight, r.calls))
        if key is None:
            return least
        home = self._homes.get(key)
        if home in candidates and home.in_flight <= least.in_flight + self.affinity_slack:
            self._homes.move_to_end(key)
            self.affinity_hits += 1
            return home
        if home is not None:
            self.affinity_moves += 1
        self._homes[key] = least
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_affinity_keys:
            self._homes.popitem(last=False)
        return least

    def _why_none(self, request: GenerationRequest) -> str:
        def state(r: Replica) -> str:
            if not r.up:
                return f"down ({r.last_error})"
            return "up" if r.serves(request.adapter) else f"no adapter {request.adapter!r}"

        states = "; ".join(f"replica {r.index}: {state(r)}" for r in self.replicas)
        return f"no policy replica can serve this call ({states})"

    def _down(self, replica: Replica, exc: BaseException) -> None:
        replica.up = False
        replica.retry_at = time.monotonic() + self.recheck_s
        replica.last_error = str(exc)

    @contextlib.contextmanager
    def _serving(self, replica: Replica) -> Iterator[None]:
        """Count a call on `replica` while it runs; mark the replica down if it is unreachable."""
        replica.in_flight += 1
        replica.calls += 1
        try:
            yield
        except BackendUnavailable as exc:
            replica.errors += 1
            self._down(replica, exc)
            raise
        except Exception:
            replica.errors += 1
            raise
        else:
            replica.up = True
        finally:
            replica.in_flight -= 1

    # ---- the Backend protocol

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        tried: list[Replica] = []
        while True:
            replica = self._pick(request, tried)
            tried.append(replica)
            try:
                with self._serving(replica):
                    return await replica.backend.generate(request)
            except BackendUnavailable:
                if len(tried) > 1:  # sent once more already
                    raise

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        check_stream_request(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        tried: list[Replica] = []
        while True:
            replica = self._pick(request, tried)
            tried.append(replica)
            yielded = False
            try:
                with self._serving(replica):
                    deltas = replica.backend.stream(request)
                    async with _closing(deltas):
                        async for delta in deltas:
                            yielded = True
                            yield delta
                return
            except BackendUnavailable:
                if yielded or len(tried) > 1:
                    raise

    def adapters(self) -> list[str]:
        up = [r for r in self.replicas if r.up] or self.replicas
        held = set.intersection(*(set(r.backend.adapters()) for r in up))
        return sorted(held)

    async def load_adapter(self, name: str, path: str) -> None:
        targets = [r for r in self.replicas if r.up]
        if not targets:
            raise BackendUnavailable(f"cannot load adapter {name!r}: every replica is down")
        results = await asyncio.gather(
            *(self._on(r, r.backend.load_adapter(name, path)) for r in targets),
            return_exceptions=True,
        )
        failed = [e for e in results if isinstance(e, BaseException)]
        if not failed:
            return
        loaded = [r for r, e in zip(targets, results, strict=True) if e is None]
        # All or none: a version half-loaded would be served by some replicas only.
        await asyncio.gather(
            *(r.backend.unload_adapter(name) for r in loaded), return_exceptions=True
        )
        raise failed[0]

    async def unload_adapter(self, name: str) -> None:
        holders = [r for r in self.replicas if name in r.backend.adapters()]
        if not holders:
            raise NotFound(f"no adapter {name!r} is loaded; loaded: {self.adapters()}")
        results = await asyncio.gather(
            *(self._on(r, r.backend.unload_adapter(name)) for r in holders),
            return_exceptions=True,
        )
        # A replica that is down has nothing to unload; any other failure is the caller's.
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, BackendUnavailable):
                raise result

    async def _on(self, replica: Replica, call: Any) -> None:
        try:
            await call
        except BackendUnavailable as exc:
            self._down(replica, exc)
            raise

    def stats(self) -> dict[str, Any]:
        """Per replica: up, calls in flight and routed, errors, adapters; and how often a
        rollout's call went where its earlier calls went (hits) or moved (moves)."""
        return {
            "replicas": [r.stats() for r in self.replicas],
            "affinity_hits": self.affinity_hits,
            "affinity_moves": self.affinity_moves,
            "affinity_keys": len(self._homes),
        }


def _closing(deltas: AsyncIterator[StreamDelta]) -> Any:
    """Close a replica's stream when ours is closed (a client gone): it stops its sequence."""
    if hasattr(deltas, "aclose"):
        return contextlib.aclosing(deltas)  # type: ignore[type-var]
    return contextlib.nullcontext()
