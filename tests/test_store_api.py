"""The store's HTTP API is declared once (lightning_core/store/api.py): the server's routes and
the HTTP client's requests both come from that table, and nothing under /store, /episodes or
/feedback is served or called outside it."""

from __future__ import annotations

import inspect
import re
from typing import Any

import orjson
import pytest
from fastapi.routing import APIRoute

from lightning_core.errors import InvalidInput
from lightning_core.store import api
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.server import create_store_app
from lightning_core.types import FeedbackIn, PolicyVersion, RolloutRequest, Transition
from tests.conftest import ThreadedServer
from tests.helpers import span

STORE_PREFIXES = ("/store/", "/episodes/", "/feedback/")
# What the client has no method for: a person's or another program's reads.
NOT_CALLED_BY_THE_CLIENT = {api.GET_EPISODE, api.FEEDBACK_WINDOW}


def _routes() -> list[APIRoute]:
    app = create_store_app(DuckDBStore(db=":memory:"), close_store=False).app
    return [r for r in app.routes if isinstance(r, APIRoute)]


def _in_the_store_api(path: str) -> bool:
    return (path + "/").startswith(STORE_PREFIXES)


def test_the_table_names_each_endpoint_once():
    assert len({e.name for e in api.ENDPOINTS}) == len(api.ENDPOINTS)
    assert len({(e.method, e.path) for e in api.ENDPOINTS}) == len(api.ENDPOINTS)
    assert all(_in_the_store_api(e.path) for e in api.ENDPOINTS)


def test_every_endpoint_is_a_route_of_the_app():
    routes = {(method, r.path): r for r in _routes() for method in r.methods}
    for endpoint in api.ENDPOINTS:
        route = routes[(endpoint.method, endpoint.path)]
        assert route.name == endpoint.name
        assert route.response_model == endpoint.response
        assert route.summary == endpoint.summary
        body = route.body_field.field_info.annotation if route.body_field else None
        if endpoint.chunked is not None:
            # Read by the handler itself (validated off the loop); OpenAPI still shows it.
            assert body is None
            schema = route.openapi_extra["requestBody"]["content"]["application/json"]["schema"]
            assert schema["title"] == endpoint.body.__name__
            continue
        assert body is (endpoint.body if endpoint.method == "POST" else None)


def test_every_route_of_the_store_api_is_in_the_table():
    table = {(e.method, e.path) for e in api.ENDPOINTS}
    served = {(m, r.path) for r in _routes() if _in_the_store_api(r.path) for m in r.methods}
    assert served == table


def test_each_endpoint_calls_a_store_method_that_takes_its_arguments():
    for endpoint in api.ENDPOINTS:
        if not isinstance(endpoint.calls, str):
            continue
        parameters = list(inspect.signature(getattr(DuckDBStore, endpoint.calls)).parameters)
        path_params = list(endpoint.path_params)
        assert parameters[1 : 1 + len(path_params)] == path_params, endpoint.name
        if endpoint.body_as is not None:
            assert endpoint.body_as in parameters, endpoint.name
        elif endpoint.body is not None:
            assert set(endpoint.body.model_fields) <= set(parameters), endpoint.name


def _recording(app: Any, seen: list[tuple[str, str, bytes]]) -> Any:
    """`app`, noting each request's method, path and body as it arrives."""

    async def record(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def receive_and_keep() -> dict:
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        await app(scope, receive_and_keep, send)
        seen.append((scope["method"], scope["path"], b"".join(chunks)))

    return record


def _endpoint_of(method: str, path: str) -> api.Endpoint | None:
    for endpoint in api.ENDPOINTS:
        pattern = re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(endpoint.path))
        if endpoint.method == method and re.fullmatch(pattern, path):
            return endpoint
    return None


async def _every_call(client: HttpStoreClient) -> None:
    """Each public method of the client once (some twice, to reach every answer)."""
    await client.check()
    assert await client.health()
    first, failed, cancelled = await client.enqueue_rollouts(
        [RolloutRequest(input=n) for n in range(3)]
    )
    ids = [first.rollout_id]
    claim = await client.dequeue("w")
    assert claim is not None and claim.rollout.rollout_id == first.rollout_id
    attempt_id = claim.attempt.attempt_id
    await client.heartbeat(attempt_id)
    assert await client.add_spans([span(claim)]) == 1
    assert len(await client.query_spans(ids, "latest")) == 1
    transition = Transition(
        rollout_id=first.rollout_id, step=0, prompt_token_ids=[1], response_token_ids=[2]
    )
    assert await client.add_transitions([transition]) == 1
    assert len(await client.query_transitions(ids)) == 1
    assert (await client.complete_attempt(attempt_id, 1.0)).episode_return == 1.0
    assert len(await client.wait_for_rollouts(ids, 1.0)) == 1
    assert len(await client.query_attempts(first.rollout_id)) == 1
    assert (await client.get_rollout(first.rollout_id)).status.finished
    second = await client.dequeue("w")
    assert second is not None and second.rollout.rollout_id == failed.rollout_id
    await client.fail_attempt(second.attempt.attempt_id, "no", retry=False)
    await client.cancel_rollout(cancelled.rollout_id)
    assert await client.dequeue("w") is None
    assert len(await client.query_rollouts(limit=2)) == 2
    await client.add_policy_version(PolicyVersion(name="v1", base_model="m"))
    assert (await client.get_policy_version("v1")).name == "v1"
    assert [v.name for v in await client.list_policy_versions()] == ["v1"]
    await client.open_episode("e1", agent_name="a")
    assert (await client.add_feedback("e1", FeedbackIn(value=1.0))).status == "recorded"
    assert await client.feedback_watermark() == 1
    assert len(await client.query_feedback()) == 1
    # A store in memory has nowhere to archive to: the request still goes out, and is refused.
    with pytest.raises(InvalidInput, match="archive folder"):
        await client.archive_episodes(older_than_days=1)


async def test_the_client_calls_the_tables_endpoints():
    seen: list[tuple[str, str, bytes]] = []
    app = create_store_app(DuckDBStore(db=":memory:"))
    with ThreadedServer(_recording(app, seen)) as server:
        async with HttpStoreClient(server.url, retry_s=0) as client:
            await _every_call(client)
    called = set()
    for method, path, body in seen:
        if not _in_the_store_api(path):
            assert (method, path) == ("GET", "/health")
            continue
        endpoint = _endpoint_of(method, path)
        assert endpoint is not None, f"{method} {path} is not in the table"
        called.add(endpoint)
        if endpoint.body is not None:
            # What the client sends is what the table says the server takes.
            endpoint.body.model_validate(orjson.loads(body))
        else:
            assert body == b"", f"{method} {path} sent a body the table does not declare"
    assert called == set(api.ENDPOINTS) - NOT_CALLED_BY_THE_CLIENT
