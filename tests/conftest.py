"""Shared fixtures: stores in-process and behind a real HTTP server on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import uvicorn

from lightning_core.app import create_app
from lightning_core.serving.http_edge import SERVER_KEEPALIVE_S
from lightning_core.serving.process import free_port  # noqa: F401  (the tests import it from here)
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


class ThreadedServer:
    """uvicorn serving an app on 127.0.0.1 from a background thread (its own event loop)."""

    def __init__(self, app: Any, start_timeout: float = 20.0) -> None:
        self.start_timeout = start_timeout
        # Bound now and handed to uvicorn: a port only looked up here would stay free during
        # the app's start-up (which may launch a server of its own, vLLM, on a free port).
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        # The served CLI's keep-alive, above the store client's (KEEPALIVE_S): with uvicorn's
        # default 5 s a long test reuses a connection the server is closing (StoreUnavailable).
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=SERVER_KEEPALIVE_S,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.socket.close()


@contextlib.contextmanager
def gateway_server(
    tool_format: str = "line",
    gateway_options: dict[str, Any] | None = None,
    api_key: str | None = None,
    **backend_options: Any,
) -> Iterator[ThreadedServer]:
    """A store + gateway + transformers backend on loopback, for agents to run against; the
    served base model's name is `.model`, the store `.store`, the app `.app`. `gateway_options`
    are more GatewayConfig fields (limits, ...); `api_key` the server's admin key."""
    from lightning_core.backends.transformers_backend import TransformersBackend
    from lightning_core.gateway.service import Gateway, GatewayConfig

    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(**backend_options)
    config = GatewayConfig(tool_format=tool_format, **(gateway_options or {}))
    gateway = Gateway(backend, store, config)
    app = create_app(store, api_key=api_key, gateway=gateway)
    with ThreadedServer(app, start_timeout=120) as running:
        running.app = app
        running.model = backend.base_model
        running.store = store
        yield running


@pytest.fixture(params=["inprocess", "http"])
async def make_store(request) -> AsyncIterator[Callable[..., Any]]:
    """Factory of fresh stores: `await make_store(**StoreConfig fields)`.

    The same tests run against the in-process DuckDBStore and against the HTTP client talking to
    a real server, which proves both implement one protocol.
    """
    opened: list[Any] = []
    servers: list[ThreadedServer] = []

    async def make(**config: Any):
        config.setdefault("db", ":memory:")
        store = DuckDBStore(**config)
        if request.param == "inprocess":
            opened.append(store)
            return store
        server = ThreadedServer(create_app(store)).__enter__()
        servers.append(server)
        client = HttpStoreClient(server.url)
        opened.append(client)
        return client

    yield make
    for store in opened:
        await store.close()
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
async def store(make_store):
    return await make_store()


@pytest.fixture(scope="session", autouse=True)
def _stop_prefects_own_server() -> Iterator[None]:
    """A task or flow that some test runs without a Prefect API makes Prefect start a temporary
    server of its own, which Prefect stops at interpreter exit. By then pytest has closed the
    streams Prefect's console handler writes to, and a passing run ended with a "--- Logging
    error ---" traceback after its summary line. Stopped here, at the end of the session, its
    last logs and events sent first (as flows/prefect_server.py does for a flow's server)."""
    yield
    if "prefect.server.api.server" not in sys.modules:
        return  # none was started
    from prefect.server.api.server import SubprocessASGIServer

    from lightning_rl.flows.prefect_server import flush_to_server

    flush_to_server()
    for server in list(SubprocessASGIServer._instances.values()):
        server.stop()
