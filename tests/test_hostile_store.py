"""The store's data layer under hostile and unlucky clients (issue 25, items 3 and 8): spans
idempotent by (trace id, span id), size caps on stored payloads, paged queries and long polls
that count each id once. Against a real `lightning-rl serve` on loopback and a real DuckDB file.
"""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_core import semconv
from lightning_core.errors import PayloadTooLarge
from lightning_core.serving.process import start_serve
from lightning_core.store.base import MAX_PAGE_SIZE, NEXT_PAGE_HEADER, PAGE_SIZE
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.store.routes import CHUNK_ITEMS
from lightning_core.types import (
    MAX_INPUT_BYTES,
    MAX_METADATA_BYTES,
    FeedbackIn,
    RolloutRequest,
    Transition,
)
from tests.conftest import free_port
from tests.helpers import span


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`lightning-rl serve` (the store alone) on a DuckDB file, and its URL."""
    db = tmp_path_factory.mktemp("hostile-store") / "store.duckdb"
    port = free_port()
    proc = start_serve(db, port, "--backend", "none")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served, timeout=120) as client:
        yield client


def _otlp_body(rollout_id: str, attempt_id: str, n: int) -> bytes:
    """What OTel's OTLP/HTTP exporter sends for `n` spans of an attempt (its own encoder)."""
    exporter = InMemorySpanExporter()
    resource = Resource.create({semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("hostile")
    for i in range(n):
        with tracer.start_as_current_span(f"step-{i}"):
            pass
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


async def test_a_retried_otlp_export_stores_each_span_once(served, http):
    """Finding: the exporter's retry stored 1,600 spans for 1,000 ids. A retry whose first try
    was stored but not answered arrives here after the runner completed the attempt (the
    exporter backs off meanwhile); each span must still be read back once."""
    async with HttpStoreClient(served) as client:
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input="otlp")])
        claim = await client.dequeue("w")
        body = _otlp_body(rollout.rollout_id, claim.attempt.attempt_id, 1000)
        headers = {"content-type": "application/x-protobuf"}
        assert http.post("/v1/traces", content=body, headers=headers).status_code == 200
        await client.complete_attempt(claim.attempt.attempt_id, 1.0)
        assert http.post("/v1/traces", content=body, headers=headers).status_code == 200
        spans = await client.query_spans([rollout.rollout_id])
    assert len(spans) == 1000
    assert len({(s.trace_id, s.span_id) for s in spans}) == 1000


async def test_a_span_sent_again_after_a_restart_is_stored_once(tmp_path):
    """Finding: spans were not de-duplicated; a store restarted between an export and its retry
    forgot which spans its running attempt had, and stored the retry again."""
    db = str(tmp_path / "store.duckdb")
    store = DuckDBStore(db=db)
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    spans = [span(claim, f"s{i}") for i in range(5)]
    assert await store.add_spans(spans) == 5
    await store.close()

    store = DuckDBStore(db=db)
    try:
        await store.add_spans(spans)
        # While the attempt runs, a span sent again is not stored again, and not counted.
        assert await store.add_spans(spans) == 0
        read = await store.query_spans([rollout.rollout_id])
    finally:
        await store.close()
    assert sorted(s.name for s in read) == [f"s{i}" for i in range(5)]


async def test_stored_payloads_over_their_cap_are_413_naming_the_field(served, http):
    """Finding: stored payloads (rollout inputs, metadata, feedback) had no size caps and stayed
    resident in the store's memory."""
    big_input = "x" * (MAX_INPUT_BYTES + 1)
    big_labels = {"note": "y" * MAX_METADATA_BYTES}
    before = len(http.post("/store/rollouts/query", json={"limit": MAX_PAGE_SIZE}).json())

    r = http.post("/store/rollouts", json={"rollouts": [{"input": big_input}]})
    assert r.status_code == 413, r.text[:500]
    error = r.json()["error"]
    assert error["type"] == "PayloadTooLarge"
    assert "input" in error["message"] and str(MAX_INPUT_BYTES) in error["message"]

    r = http.post("/store/rollouts", json={"rollouts": [{"input": 1, "metadata": big_labels}]})
    assert r.status_code == 413 and "metadata" in r.json()["error"]["message"]
    assert str(MAX_METADATA_BYTES) in r.json()["error"]["message"]

    r = http.post("/episodes/hostile-1", json={"metadata": big_labels})
    assert r.status_code == 413 and "metadata" in r.json()["error"]["message"]
    assert http.post("/episodes/hostile-1", json={}).status_code == 200
    r = http.post("/episodes/hostile-1/feedback", json={"value": 1, "metadata": big_labels})
    assert r.status_code == 413 and "metadata" in r.json()["error"]["message"]
    assert http.get("/episodes/hostile-1").json()["feedback"] == []
    # Nothing of the refused rollouts was stored (the episode opened above is one rollout).
    after = len(http.post("/store/rollouts/query", json={"limit": MAX_PAGE_SIZE}).json())
    assert after == before + 1

    # The Python API refuses them the same way, in process and over HTTP.
    with pytest.raises(PayloadTooLarge, match="input"):
        RolloutRequest(input=big_input)
    with pytest.raises(PayloadTooLarge, match="metadata"):
        FeedbackIn(value=1.0, metadata=big_labels)
    async with HttpStoreClient(served) as client:
        with pytest.raises(PayloadTooLarge, match="metadata"):
            await client.open_episode("hostile-2", metadata=big_labels)


async def test_numbers_the_store_cannot_hold_are_refused_at_the_edge(served, http):
    """Finding: a token id or step past 32 bits reached the store's database, which refused the
    commit, and a refused commit stops the store for everyone."""
    [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": 1}]}).json()
    for bad in ({"prompt_token_ids": [2**40]}, {"step": 2**40}, {"response_token_ids": [-1]}):
        transition = {"rollout_id": rollout["rollout_id"], "step": 0, "prompt_token_ids": [1],
                      "response_token_ids": [2], **bad}  # fmt: skip
        r = http.post("/store/transitions", json={"transitions": [transition]})
        assert r.status_code == 422, r.text[:300]
    # The store goes on taking writes.
    assert http.post("/store/rollouts", json={"rollouts": [{"input": 2}]}).status_code == 200


async def test_queries_answer_in_pages_and_the_client_pages_through(served, http):
    """Finding: `POST /store/rollouts/query {}` returned the whole store (100 MB) in one body.
    It now answers one page (PAGE_SIZE) and a cursor; the client follows the cursors, so its
    callers (the CLI, the trainer) still get whole results."""
    n = PAGE_SIZE * 2 + 500
    async with HttpStoreClient(served) as client:
        enqueued = await client.enqueue_rollouts(
            [RolloutRequest(input=i, group_id="paged") for i in range(n)]
        )
        everything = await client.query_rollouts()
        group = await client.query_rollouts(group_id="paged")
        assert len(await client.query_rollouts(limit=PAGE_SIZE + 7)) == PAGE_SIZE + 7

        claim = await client.dequeue("w")
        spans = [span(claim, f"s{i}") for i in range(PAGE_SIZE + 10)]
        await client.add_spans(spans)
        read_spans = await client.query_spans([claim.rollout.rollout_id])

    r = http.post("/store/rollouts/query", json={})
    assert r.status_code == 200 and len(r.json()) == PAGE_SIZE
    assert r.headers.get(NEXT_PAGE_HEADER)

    # Walking the pages by hand finds every rollout once, in the order of arrival.
    walked, after = [], None
    while True:
        r = http.post("/store/rollouts/query", json={"group_id": "paged", "after": after})
        walked += [row["rollout_id"] for row in r.json()]
        if (after := r.headers.get(NEXT_PAGE_HEADER)) is None:
            break
    assert walked == [ro.rollout_id for ro in enqueued] == [ro.rollout_id for ro in group]
    assert len(everything) == len({ro.rollout_id for ro in everything}) >= n

    r = http.post("/store/rollouts/query", json={"after": "not a cursor"})
    assert r.status_code == 400 and "cursor" in r.json()["error"]["message"]
    r = http.post("/store/rollouts/query", json={"limit": MAX_PAGE_SIZE + 1})
    assert r.status_code == 422

    # Spans page the same way, by their sequence.
    r = http.post("/store/spans/query", json={"rollout_ids": [claim.rollout.rollout_id]})
    assert len(r.json()) == PAGE_SIZE and r.headers.get(NEXT_PAGE_HEADER)
    assert [s.name for s in read_spans] == [s.name for s in spans]


async def test_transitions_and_feedback_answer_in_pages_too(served, http):
    """Finding (as above): the transitions and feedback queries had no page either."""
    async with HttpStoreClient(served) as client:
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input="transitions")])
        steps = [
            Transition(
                rollout_id=rollout.rollout_id, step=i, prompt_token_ids=[1], response_token_ids=[2]
            )
            for i in range(PAGE_SIZE + 5)
        ]
        await client.add_transitions(steps)
        read = await client.query_transitions([rollout.rollout_id])
        for i in range(5):
            await client.open_episode(f"paged-{i}")
            await client.add_feedback(f"paged-{i}", FeedbackIn(value=float(i)))
        feedback = await client.query_feedback(episode_ids=[f"paged-{i}" for i in range(5)])
    assert [t.step for t in read] == list(range(PAGE_SIZE + 5))
    r = http.post("/store/transitions/query", json={"rollout_ids": [rollout.rollout_id]})
    assert len(r.json()) == PAGE_SIZE and r.headers.get(NEXT_PAGE_HEADER)

    walked, after = [], None
    while True:
        body = {"episode_ids": [f"paged-{i}" for i in range(5)], "limit": 2, "after": after}
        r = http.post("/feedback/query", json=body)
        assert len(r.json()) <= 2
        walked += [row["episode_id"] for row in r.json()]
        if (after := r.headers.get(NEXT_PAGE_HEADER)) is None:
            break
    assert walked == [f.episode_id for f in feedback] == [f"paged-{i}" for i in range(5)]
    r = http.get("/feedback", params={"limit": 1})
    assert len(r.json()) == 1 and r.headers.get(NEXT_PAGE_HEADER)


async def test_a_long_poll_counts_each_id_once(served, http):
    """Finding: 100 long polls on 10,000 copies of one id cost 190 ms of the event loop per
    finished rollout (each rescanned its copies); the ids are now de-duplicated where the request
    is read, and the cap on them stays."""
    async with HttpStoreClient(served) as client:
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input="wait")])
        # Finished without a runner (the queue holds the other tests' rollouts before it).
        await client.cancel_rollout(rollout.rollout_id)
        # The client's wait ends as soon as each distinct rollout has finished.
        done = await client.wait_for_rollouts([rollout.rollout_id] * 3, timeout=30)
        assert [r.rollout_id for r in done] == [rollout.rollout_id]

    r = http.post("/store/wait", json={"rollout_ids": [rollout.rollout_id] * 10_000})
    assert r.status_code == 200 and [x["rollout_id"] for x in r.json()] == [rollout.rollout_id]
    r = http.post("/store/wait", json={"rollout_ids": [rollout.rollout_id] * 10_001})
    assert r.status_code == 422 and "10000" in r.json()["error"]["message"]

    store = DuckDBStore(db=":memory:")
    try:
        [queued] = await store.enqueue_rollouts([RolloutRequest(input=0)])
        claim = await store.dequeue("w")
        await store.complete_attempt(claim.attempt.attempt_id, 0.0)
        assert len(await store.wait_for_rollouts([queued.rollout_id] * 5, timeout=0)) == 1
    finally:
        await store.close()


async def test_a_big_span_write_is_validated_a_slice_at_a_time_and_errors_name_the_span(
    served, http
):
    """/store/spans validates its spans off the event loop, CHUNK_ITEMS at a time (a 4,000-span
    write held the loop 15-20 ms in one piece; benchmarks/abuse.py's span flood). What a client
    sees is unchanged: every span of a good write is stored, a bad span past the first slice
    is located by its index in the whole body, and a write that is not JSON is a 400."""
    async with HttpStoreClient(served) as client:
        await client.enqueue_rollouts([RolloutRequest(input="slices")])
        # Whichever rollout the queue gives (other tests of the module leave some queued).
        claim = await client.dequeue("w")
        good = [span(claim).model_dump(mode="json") for _ in range(3 * CHUNK_ITEMS + 5)]
        assert http.post("/store/spans", json={"spans": good}).json() == {"count": len(good)}
        bad = [span(claim).model_dump(mode="json") for _ in range(2 * CHUNK_ITEMS)]
        del bad[CHUNK_ITEMS + 7]["trace_id"]
        answer = http.post("/store/spans", json={"spans": bad})
        assert answer.status_code == 422
        assert f"body.spans.{CHUNK_ITEMS + 7}.trace_id: Field required" in answer.text
        for body in (b"{not json", b'{"spans": 3}'):
            answer = http.post(
                "/store/spans", content=body, headers={"content-type": "application/json"}
            )
            assert answer.status_code in (400, 422), answer.text
        spans = await client.query_spans([claim.rollout.rollout_id], claim.attempt.attempt_id)
    assert len(spans) == len(good)  # the bad write stored none of its spans
    schema = http.get("/openapi.json").json()["paths"]["/store/spans"]["post"]["requestBody"]
    items = schema["content"]["application/json"]["schema"]["properties"]["spans"]["items"]
    assert items == {"$ref": "#/components/schemas/Span"}
