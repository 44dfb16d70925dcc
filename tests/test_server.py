"""The HTTP layer: bad input, size limits, auth, OpenAPI and the OTLP traces endpoint."""

from __future__ import annotations

import gzip
import time

import httpx
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.errors import Unauthorized
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutStatus
from tests.conftest import ThreadedServer


@pytest.fixture
def served():
    """A real server on loopback with a small body limit, plus a raw HTTP client."""
    store = DuckDBStore(db=":memory:")
    with (
        ThreadedServer(create_app(store, max_request_bytes=200_000)) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        yield server, http


def _claim(http: httpx.Client) -> dict:
    http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).raise_for_status()
    return http.post("/store/dequeue", json={"worker_id": "w"}).json()


def _span(claim: dict, **overrides) -> dict:
    return {
        "rollout_id": claim["rollout"]["rollout_id"],
        "attempt_id": claim["attempt"]["attempt_id"],
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "name": "s",
        "start_time": time.time(),
        **overrides,
    }


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def _span_count(http: httpx.Client, claim: dict) -> int:
    body = {"rollout_ids": [claim["rollout"]["rollout_id"]]}
    return len(http.post("/store/spans/query", json=body).json())


def test_malformed_json_is_a_400_and_stores_nothing(served):
    _, http = served
    claim = _claim(http)
    r = http.post(
        "/store/spans", content=b'{"spans": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert _error(r)["type"] == "InvalidInput" and "malformed JSON" in _error(r)["message"]
    assert _span_count(http, claim) == 0


def test_wrong_shape_names_the_field(served):
    _, http = served
    claim = _claim(http)
    good = _span(claim)
    bad = _span(claim, span_id="c" * 16)
    del bad["trace_id"]
    r = http.post("/store/spans", json={"spans": [good, bad]})
    assert r.status_code == 422
    assert "spans.1.trace_id: Field required" in _error(r)["message"]
    assert _span_count(http, claim) == 0


def test_unknown_rollout_and_attempt_are_404(served):
    _, http = served
    r = http.get("/store/rollouts/ro-missing")
    assert r.status_code == 404 and "ro-missing" in _error(r)["message"]
    r = http.post("/store/attempts/at-missing/complete", json={})
    assert r.status_code == 404 and _error(r)["type"] == "NotFound"


def test_illegal_transition_is_409(served):
    _, http = served
    claim = _claim(http)
    attempt = claim["attempt"]["attempt_id"]
    assert http.post(f"/store/attempts/{attempt}/complete", json={"reward": 1}).status_code == 200
    r = http.post(f"/store/attempts/{attempt}/complete", json={"reward": 1})
    assert r.status_code == 409 and _error(r)["type"] == "IllegalTransition"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_reward_is_rejected(served, literal):
    _, http = served
    claim = _claim(http)
    attempt = claim["attempt"]["attempt_id"]
    r = http.post(
        f"/store/attempts/{attempt}/complete",
        content=b'{"reward": ' + literal + b"}",
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500
    rollout = http.get(f"/store/rollouts/{claim['rollout']['rollout_id']}").json()
    assert rollout["status"] == "running"


def test_non_finite_transition_reward_is_rejected(served):
    _, http = served
    claim = _claim(http)
    transition = {
        "rollout_id": claim["rollout"]["rollout_id"],
        "step": 0,
        "prompt_token_ids": [1],
        "response_token_ids": [2],
        "reward": "nan",
    }
    r = http.post("/store/transitions", json={"transitions": [transition]})
    assert r.status_code == 422 and "reward" in _error(r)["message"]
    assert http.post("/store/transitions/query", json={}).json() == []


def test_body_over_the_limit_is_413_and_stores_nothing(served):
    _, http = served
    claim = _claim(http)
    spans = [_span(claim, span_id=f"{i:016x}", attributes={"x": "y" * 1000}) for i in range(300)]
    r = http.post("/store/spans", json={"spans": spans})
    assert r.status_code == 413 and "limit of 200000 bytes" in _error(r)["message"]
    # Without a Content-Length the limit still holds (chunked upload).
    body = orjson.dumps({"spans": spans})
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    r = http.post("/store/spans", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert _span_count(http, claim) == 0


def test_openapi_lists_the_store_operations(served):
    _, http = served
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/store/rollouts", "/store/dequeue", "/store/spans", "/v1/traces", "/health"):
        assert path in paths


async def test_bearer_key_is_required_when_set():
    store = DuckDBStore(db=":memory:")
    with ThreadedServer(create_app(store, api_key="s3cret")) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        r = httpx.post(f"{server.url}/store/dequeue", json={"worker_id": "w"})
        assert r.status_code == 401 and "LIGHTNING_API_KEY" in _error(r)["message"]
        wrong = HttpStoreClient(server.url, api_key="guess")
        with pytest.raises(Unauthorized):
            await wrong.dequeue("w")
        await wrong.close()
        right = HttpStoreClient(server.url, api_key="s3cret")
        assert await right.dequeue("w") is None
        await right.close()


# ---------------------------------------------------------------------------- OTLP


def test_otel_sdk_exports_protobuf_into_the_store(served):
    server, http = served
    claim = _claim(http)
    rollout_id = claim["rollout"]["rollout_id"]
    resource = Resource.create(
        {semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: claim["attempt"]["attempt_id"]}
    )
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("agent", kind=trace.SpanKind.CLIENT) as parent:
        parent.set_attribute("gen_ai.request.model", "smollm2")
        with tracer.start_as_current_span("tool") as child:
            child.set_attribute("ids", [1, 2, 3])
            child.add_event("called", {"ok": True})
            child.set_status(trace.Status(trace.StatusCode.ERROR, "division by zero"))
    with tracer.start_as_current_span(semconv.REWARD_SPAN) as reward:
        reward.set_attribute(semconv.REWARD_VALUE, 0.5)
    provider.shutdown()

    spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"agent", "tool", semconv.REWARD_SPAN}
    tool, agent = by_name["tool"], by_name["agent"]
    assert tool["parent_id"] == agent["span_id"] and tool["trace_id"] == agent["trace_id"]
    assert agent["kind"] == "client" and agent["attributes"]["gen_ai.request.model"] == "smollm2"
    assert tool["attributes"]["ids"] == [1, 2, 3]
    assert tool["status_code"] == "error" and tool["status_message"] == "division by zero"
    assert tool["events"][0]["name"] == "called" and tool["events"][0]["attributes"] == {"ok": True}
    assert tool["end_time"] >= tool["start_time"] > 1e9
    attempt = claim["attempt"]["attempt_id"]
    done = http.post(f"/store/attempts/{attempt}/complete", json={}).json()
    assert done["status"] == RolloutStatus.succeeded and done["episode_return"] == 0.5


def _otlp_json(claim: dict | None, **span_overrides) -> dict:
    attributes = [{"key": "n", "value": {"intValue": "7"}}]
    if claim is not None:
        attributes += [
            {"key": semconv.ROLLOUT_ID, "value": {"stringValue": claim["rollout"]["rollout_id"]}},
            {"key": semconv.ATTEMPT_ID, "value": {"stringValue": claim["attempt"]["attempt_id"]}},
        ]
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "name": "json-span",
        "kind": 3,
        "startTimeUnixNano": "1544712660000000000",
        "endTimeUnixNano": "1544712661000000000",
        "attributes": attributes,
        "status": {"code": 1},
        **span_overrides,
    }
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [span]}]}]}


def test_otlp_json_and_gzip(served):
    _, http = served
    claim = _claim(http)
    r = http.post("/v1/traces", json=_otlp_json(claim))
    assert r.status_code == 200, r.text
    second = orjson.dumps(_otlp_json(claim, spanId="fff19b7ec3c1b174", name="zipped"))
    r = http.post(
        "/v1/traces",
        content=gzip.compress(second),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 200, r.text
    body = {"rollout_ids": [claim["rollout"]["rollout_id"]]}
    spans = http.post("/store/spans/query", json=body).json()
    assert [s["name"] for s in spans] == ["json-span", "zipped"]
    assert spans[0]["attributes"]["n"] == 7 and spans[0]["kind"] == "client"
    assert spans[0]["start_time"] == 1544712660.0 and spans[0]["status_code"] == "ok"


def test_otlp_rejects_bad_payloads_whole(served):
    _, http = served
    claim = _claim(http)
    r = http.post(
        "/v1/traces", content=b"\xff\x00garbage", headers={"content-type": "application/x-protobuf"}
    )
    assert r.status_code == 400 and "malformed OTLP protobuf" in _error(r)["message"]
    payload = _otlp_json(claim)
    payload["resourceSpans"][0]["scopeSpans"][0]["spans"].append(
        _otlp_json(None, spanId="1111111111111111")["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    )
    r = http.post("/v1/traces", json=payload)
    assert r.status_code == 400 and semconv.ROLLOUT_ID in _error(r)["message"]
    r = http.post("/v1/traces", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "not OTLP" in _error(r)["message"]
    assert _span_count(http, claim) == 0
