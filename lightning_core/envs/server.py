"""An environment service's HTTP app: our session protocol, and OpenEnv's WebSocket protocol.

Our protocol (docs/environments.md), JSON over HTTP, a session per episode:

    POST   /sessions            {"task", "seed"}  -> 201 {"session_id", first step's answer}
    POST   /sessions/{id}/step  {"action"}        -> {"observation", "reward", "done", "info"}
    DELETE /sessions/{id}                         -> 204
    GET    /health                                -> {"status", "sessions", "max_sessions"}

Errors answer {"error": {"type", "message"}}: 404 for a session that is gone (closed, idle,
or the service restarted), 413/400 for a request too big or not JSON, 422 for an action the
environment refuses (the session goes on), 429 when the service holds `max_sessions`, 500
when the environment failed and 504 past `step_timeout_s` (both close the session).

OpenEnv's protocol, on the same app: a WebSocket at /ws is one session; the client sends
{"type": "reset" | "step" | "state" | "close", "data": {...}} and gets {"type": "observation",
"data": {"observation", "reward", "done"}}, {"type": "state", "data": {"episode_id",
"step_count"}} or {"type": "error", "data": {"message", "code"}}. An OpenEnv client reaches
our environments as it reaches its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response

from lightning_core.envs.base import EnvironmentFactory, StepOutcome
from lightning_core.envs.config import EnvServiceConfig
from lightning_core.envs.sessions import Sessions, parse_json
from lightning_core.errors import InvalidInput, LightningError, Unauthorized
from lightning_core.security.keys import key_check


def _outcome(outcome: StepOutcome) -> dict[str, Any]:
    return outcome.model_dump(mode="json")


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"seed must be an integer, got {value!r}")
    return value


def create_env_app(
    factory: EnvironmentFactory, config: EnvServiceConfig | None = None, api_key: str | None = None
) -> FastAPI:
    """The service of the environments `factory` makes, within `config`'s limits; with
    `api_key`, every route but /health wants it as a bearer token."""
    config = config or EnvServiceConfig()
    sessions = Sessions(factory, config)
    authorized = key_check(api_key) if api_key else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sessions.start()
        try:
            yield
        finally:
            await sessions.stop()

    app = FastAPI(title="lightning-rl environment service", lifespan=lifespan)
    app.state.sessions = sessions

    def check_key(header: str | None) -> None:
        if authorized is not None and not authorized((header or "").encode()):
            raise Unauthorized("this environment service wants its key as a bearer token")

    @app.exception_handler(LightningError)
    async def _error(_: Request, exc: LightningError) -> JSONResponse:
        body = {"error": {"type": type(exc).__name__, "message": str(exc)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers())

    async def body(request: Request) -> Any:
        check_key(request.headers.get("authorization"))
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise InvalidInput(f"the request declares {declared} bytes, over the limit")
        return await parse_json(await request.body(), config.max_request_bytes)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "healthy",
            "sessions": len(sessions.open),
            "max_sessions": config.max_sessions,
        }

    @app.post("/sessions", status_code=201)
    async def create(request: Request) -> dict[str, Any]:
        given = await body(request)
        if not isinstance(given, dict):
            raise InvalidInput("the request must be an object {task, seed}")
        session_id, outcome = await sessions.create(given.get("task"), _seed(given.get("seed")))
        return {"session_id": session_id, **_outcome(outcome)}

    @app.post("/sessions/{session_id}/step")
    async def step(session_id: str, request: Request) -> dict[str, Any]:
        given = await body(request)
        if not isinstance(given, dict) or "action" not in given:
            raise InvalidInput("the request must be an object {action}")
        return _outcome(await sessions.step(session_id, given["action"]))

    @app.delete("/sessions/{session_id}", status_code=204)
    async def close(session_id: str, request: Request) -> Response:
        check_key(request.headers.get("authorization"))
        await sessions.close(session_id)
        return Response(status_code=204)

    @app.websocket("/ws")
    async def openenv(socket: WebSocket) -> None:
        try:
            check_key(socket.headers.get("authorization"))
        except Unauthorized:
            await socket.close(code=1008)
            return
        await socket.accept()
        session_id: str | None = None
        try:
            while True:
                raw = await socket.receive_text()
                try:
                    message = await parse_json(raw.encode(), config.max_request_bytes)
                    kind = message.get("type") if isinstance(message, dict) else None
                    data = message.get("data") or {} if isinstance(message, dict) else {}
                    if kind == "close":
                        break
                    if kind == "reset":
                        if session_id is not None:
                            await sessions.close(session_id)
                            session_id = None
                        task = data.get("task", data) if isinstance(data, dict) else data
                        seed = _seed(data.get("seed")) if isinstance(data, dict) else None
                        session_id, outcome = await sessions.create(task, seed)
                        reply = {"type": "observation", "data": _outcome(outcome)}
                    elif session_id is None:
                        raise InvalidInput("send a reset before a step or a state")
                    elif kind == "step":
                        outcome = await sessions.step(session_id, data)
                        reply = {"type": "observation", "data": _outcome(outcome)}
                    elif kind == "state":
                        current = sessions.get(session_id)
                        state = {"episode_id": session_id, "step_count": current.steps}
                        reply = {"type": "state", "data": state}
                    else:
                        raise InvalidInput(f"unknown message type {kind!r}")
                except LightningError as exc:
                    code = type(exc).__name__
                    reply = {"type": "error", "data": {"message": str(exc), "code": code}}
                await socket.send_text(orjson.dumps(reply).decode())
        except WebSocketDisconnect:
            pass
        finally:
            if session_id is not None:
                await sessions.close(session_id)
        with contextlib.suppress(RuntimeError):
            await socket.close()

    return app
