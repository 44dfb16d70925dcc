"""Shared fixtures: stores in-process and behind a real HTTP server on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import sys
import tempfile
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

# Each test process gets a PREFECT_HOME of its own, set before anything imports Prefect (which
# reads it once): `make test` runs two pytest-xdist workers, and on one shared home their
# temporary Prefect servers would share one SQLite database and the `gpu` slot records of
# lightning_rl/gpu_slot.py would make one worker's training wait for the other's. It also keeps the
# tests out of the user's own ~/.prefect. Removed at exit (_stop_prefects_own_server).
_PREFECT_HOME = tempfile.mkdtemp(
    prefix=f"prefect-home-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"
)
os.environ["PREFECT_HOME"] = _PREFECT_HOME


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


@dataclasses.dataclass(frozen=True)
class PrefectTestServer:
    """The session's Prefect server (a SubprocessASGIServer) and the database it serves."""

    server: Any
    database: str

    @property
    def api_url(self) -> str:
        return self.server.api_url


@pytest.fixture(scope="session")
def prefect_test_server() -> Iterator[PrefectTestServer]:
    """One Prefect server (SQLite in a temporary folder) for the whole session, started on first
    use: each module that ran flows started its own with prefect_test_harness, 30-45 s each on
    a 2-core machine. Only the server: the settings pointing at it are entered by whoever uses
    it (use_prefect_server, the `prefect_harness` fixture, prefect_api_env), so that a test
    which asked for none keeps running without a Prefect API, as before. Tests on it share its
    flow runs, deployments and events: a test reads back only the ones of its own runs."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings
    from prefect.testing.utilities import _find_available_port

    from lightning_rl.flows.prefect_server import flush_to_server

    folder = tempfile.mkdtemp(prefix="prefect-test-")
    database = f"sqlite+aiosqlite:///{folder}/prefect-test.db"
    server = SubprocessASGIServer(port=_find_available_port())
    # The database setting only while the server starts: it reads its settings from the
    # environment it is started with (SubprocessASGIServer._run_uvicorn_command).
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database}):
        server.start(timeout=120)
    try:
        yield PrefectTestServer(server, database)
    finally:
        flush_to_server()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def use_prefect_server(shared: PrefectTestServer) -> Iterator[str]:
    """Flows run in the block talk to the shared server (prefect_test_server); yields its API URL.

    What prefect_test_harness sets for its own server, set here for the shared one and unset
    when the block ends: the API and database settings, the process-global settings context
    (for contexts copied before the block) and the default SubprocessASGIServer (so that Prefect
    code looking for an ephemeral server finds this one rather than starting another)."""
    import prefect.context
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    from lightning_rl.flows.prefect_server import flush_to_server

    prior_default = SubprocessASGIServer._instances.get(None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_database_interface())
        stack.enter_context(
            temporary_settings(
                updates={
                    PREFECT_SERVER_DATABASE_CONNECTION_URL: shared.database,
                    PREFECT_API_URL: shared.api_url,
                }
            )
        )
        stack.enter_context(
            prefect.context._temporary_global_settings_context(
                prefect.context.get_settings_context()
            )
        )
        SubprocessASGIServer._instances[None] = shared.server
        try:
            yield shared.api_url
        finally:
            # The block's last logs and events, sent now: Prefect's log and event workers
            # outlive the block, and would send them on to whichever server comes next.
            flush_to_server()
            if prior_default is not None:
                SubprocessASGIServer._instances[None] = prior_default
            else:
                SubprocessASGIServer._instances.pop(None, None)


@pytest.fixture(scope="module")
def prefect_harness(prefect_test_server: PrefectTestServer) -> Iterator[str]:
    """The shared Prefect server for the rest of the module (its API URL), as the module's own
    prefect_test_harness was."""
    with use_prefect_server(prefect_test_server) as url:
        yield url


@pytest.fixture
def prefect_api_env(prefect_test_server: PrefectTestServer) -> dict[str, str]:
    """The environment variable that points a child process (`lightning-rl train`, a
    benchmark) at the shared Prefect server, so that it starts no temporary server of its
    own (flows/prefect_server.py)."""
    return {"PREFECT_API_URL": prefect_test_server.api_url}


@pytest.fixture(scope="session", autouse=True)
def _stop_prefects_own_server() -> Iterator[None]:
    """A task or flow that some test runs without a Prefect API makes Prefect start a temporary
    server of its own, which Prefect stops at interpreter exit. By then pytest has closed the
    streams Prefect's console handler writes to, and a passing run ended with a "--- Logging
    error ---" traceback after its summary line. Stopped here, at the end of the session, its
    last logs and events sent first (as flows/prefect_server.py does for a flow's server)."""
    yield
    if "prefect.server.api.server" in sys.modules:
        from prefect.server.api.server import SubprocessASGIServer

        from lightning_rl.flows.prefect_server import flush_to_server

        flush_to_server()
        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)
