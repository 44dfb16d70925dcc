"""The client an agent uses to reach an environment service (docs/environments.md).

    async with EnvClient(url).session({"db": "chinook"}) as env:
        result = await env.step({"sql": "SELECT count(*) FROM Track"})

A session is closed on the way out, whatever happened. Every failure of the service, not of
the agent (it cannot be reached, it restarted and lost the session, it answered 5xx or ran past
its time limit), raises `EnvServiceError`: an agent that lets it propagate fails its attempt,
which the runner retries (RolloutRequest.max_attempts) in a new session. An action the
environment refuses raises `ActionRefused` instead, and the session goes on. A full service
(429) is retried with backoff before it counts as a failure.

`OpenEnvSession` speaks OpenEnv's WebSocket protocol, to any OpenEnv server (or this
project's services, which speak it too).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
import orjson
import websockets
from websockets.asyncio.client import ClientConnection

from lightning_core.envs.base import ActionRefused, StepOutcome
from lightning_core.errors import LightningError
from lightning_core.security.keys import bearer_header

# Opening a session is retried while the service is full (429) or cannot be reached (it may
# be restarting): nothing has happened yet, so a retry is safe. The first wait doubles each
# time, up to the client's open_wait_s in all.
FIRST_WAIT_S = 0.25


class EnvServiceError(LightningError):
    """The environment service failed, or cannot be reached: not the agent's doing."""

    status_code = 503


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:500]


def _checked(reply: httpx.Response, url: str) -> Any:
    if reply.status_code == 422:
        raise ActionRefused(_message(reply))
    if reply.status_code >= 400:
        raise EnvServiceError(
            f"the environment service at {url} answered {reply.status_code}: {_message(reply)}"
        )
    return reply.json() if reply.content else None


class EnvSession:
    """One episode on the service: the reset's answer, then steps."""

    def __init__(self, http: httpx.AsyncClient, url: str, session_id: str, first: StepOutcome):
        self._http, self._url = http, url
        self.session_id = session_id
        self.first = first

    async def step(self, action: Any) -> StepOutcome:
        data = await self._send("POST", f"/sessions/{self.session_id}/step", {"action": action})
        return StepOutcome.model_validate(data)

    async def close(self) -> None:
        # Best effort: a service that died has no session left to close.
        with suppress(httpx.HTTPError):
            await self._http.delete(f"/sessions/{self.session_id}")

    async def _send(self, method: str, path: str, body: Any) -> Any:
        try:
            reply = await self._http.request(method, path, content=orjson.dumps(body))
        except httpx.HTTPError as exc:
            raise EnvServiceError(
                f"the environment service at {self._url} cannot be reached: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return _checked(reply, self._url)


class EnvClient:
    """A client of one environment service."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        open_wait_s: float = 30.0,
    ):
        self.base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json", **bearer_header(api_key)}
        self._timeout, self._open_wait = timeout_s, open_wait_s

    @asynccontextmanager
    async def session(self, task: Any, seed: int | None = None) -> AsyncIterator[EnvSession]:
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self._timeout
        ) as http:
            session = await self._open(http, task, seed)
            try:
                yield session
            finally:
                await session.close()

    async def _open(self, http: httpx.AsyncClient, task: Any, seed: int | None) -> EnvSession:
        deadline = asyncio.get_running_loop().time() + self._open_wait
        wait = FIRST_WAIT_S
        opener = EnvSession(http, self.base_url, "", StepOutcome())
        while True:
            try:
                data = await opener._send("POST", "/sessions", {"task": task, "seed": seed})
            except EnvServiceError as exc:
                again = " answered 429" in str(exc) or " cannot be reached: Connect" in str(exc)
                if not again or asyncio.get_running_loop().time() + wait > deadline:
                    raise
                await asyncio.sleep(wait)
                wait *= 2
                continue
            session_id = data.pop("session_id")
            return EnvSession(http, self.base_url, session_id, StepOutcome.model_validate(data))


class OpenEnvSession:
    """One session with an OpenEnv server over its WebSocket (`<base_url>/ws`)."""

    def __init__(self, socket: ClientConnection, url: str, timeout_s: float) -> None:
        self._socket, self._url, self._timeout = socket, url, timeout_s

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, base_url: str, api_key: str | None = None, timeout_s: float = 120.0
    ) -> AsyncIterator[OpenEnvSession]:
        url = base_url.rstrip("/").replace("https://", "wss://").replace("http://", "ws://")
        url = f"{url}/ws"
        try:
            socket = await websockets.connect(
                url, additional_headers=bearer_header(api_key), open_timeout=timeout_s
            )
        except (OSError, websockets.WebSocketException) as exc:
            raise EnvServiceError(f"cannot open {url}: {type(exc).__name__}: {exc}") from None
        session = cls(socket, url, timeout_s)
        try:
            yield session
        finally:
            with suppress(websockets.WebSocketException):
                await socket.send(orjson.dumps({"type": "close"}).decode())
            await socket.close()

    async def _ask(self, message: dict[str, Any]) -> Any:
        try:
            await self._socket.send(orjson.dumps(message).decode())
            raw = await asyncio.wait_for(self._socket.recv(), self._timeout)
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            raise EnvServiceError(
                f"the OpenEnv server at {self._url} failed: {type(exc).__name__}: {exc}"
            ) from None
        reply = orjson.loads(raw)
        if reply.get("type") == "error":
            data = reply.get("data") or {}
            error = ActionRefused if data.get("code") == "ActionRefused" else EnvServiceError
            raise error(f"{data.get('message', 'error')} (code: {data.get('code')})")
        return reply.get("data") or {}

    async def reset(self, **kwargs: Any) -> StepOutcome:
        return StepOutcome.model_validate(await self._ask({"type": "reset", "data": kwargs}))

    async def step(self, action: dict[str, Any]) -> StepOutcome:
        return StepOutcome.model_validate(await self._ask({"type": "step", "data": action}))

    async def state(self) -> dict[str, Any]:
        return dict(await self._ask({"type": "state"}))
