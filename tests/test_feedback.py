"""Feedback on production episodes, over real HTTP: a store server on loopback with an API key,
reached with raw httpx, `send_feedback` and HttpStoreClient.

What must hold: feedback on an unknown episode is a 404; one value counts per (episode,
source), a resend is recorded once and a new value replaces the old with a new seq; a value
that is not a finite JSON number is a 4xx, never a 500; read windows (after_seq, through_seq]
taken end to end see late feedback exactly once; the key is required; and an acknowledged
feedback survives a SIGKILL of the server. Episodes are never ended by the watchdog.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import httpx
import pytest

from lightning_core import feedback as fb
from lightning_core.app import create_app
from lightning_core.errors import InvalidInput, NotFound, Unauthorized
from lightning_core.serving.process import start_serve
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import (
    AttemptStatus,
    FeedbackIn,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    episode_rollout_id,
)
from tests.conftest import ThreadedServer, free_port
from tests.helpers import reward_span

KEY = "feedback-key-7"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    # send_feedback and the store client fall back to LIGHTNING_API_KEY.
    monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("feedback") / "store.duckdb"
    with ThreadedServer(create_app(DuckDBStore(db=str(db)), api_key=KEY)) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    ) as client:
        yield client


_episodes = iter(range(1_000_000))


def new_episode(http: httpx.Client, prefix: str = "conv") -> str:
    """A new episode, opened as the gateway opens one: POST /episodes/{id}."""
    episode_id = f"{prefix}:{next(_episodes)}-{time.monotonic_ns()}"
    r = http.post(f"/episodes/{episode_id}", json={"agent_name": "support"})
    assert r.status_code == 200, r.text
    return episode_id


def post_feedback(http: httpx.Client, episode_id: str, **body) -> httpx.Response:
    return http.post(f"/episodes/{episode_id}/feedback", json=body)


def watermark(http: httpx.Client) -> int:
    return http.get("/feedback/watermark").json()["seq"]


def window(http: httpx.Client, after: int, through: int) -> list[dict]:
    r = http.get("/feedback", params={"after_seq": after, "through_seq": through})
    assert r.status_code == 200, r.text
    return r.json()


def send(server, episode_id: str, value: float, source: str = "user", **kw):
    return fb.send_feedback(server.url, episode_id, value, source, api_key=KEY, **kw)


# ---------------------------------------------------------------------------- episodes


def test_an_opened_episode_is_a_running_production_rollout(server, http):
    episode_id = new_episode(http)
    again = http.post(f"/episodes/{episode_id}", json={"agent_name": "other"}).json()
    r = http.get(f"/episodes/{episode_id}")
    assert r.status_code == 200, r.text
    rollout = r.json()["rollout"]
    assert rollout["rollout_id"] == f"ep-{episode_id}" == episode_rollout_id(episode_id)
    assert rollout["mode"] == "production" and rollout["status"] == "running"
    assert rollout["input"] == {"episode_id": episode_id}
    assert rollout["metadata"] == {"agent_name": "support"}  # the first call's, not later ones
    assert r.json()["feedback"] == []
    [attempt] = http.get(f"/store/rollouts/ep-{episode_id}/attempts").json()
    assert attempt == again  # opening it again answers its one attempt
    assert attempt["worker_id"] == "production" and attempt["status"] == "running"


def test_a_production_rollout_cannot_be_enqueued_or_named_like_an_episode(http):
    for request in ({"input": 1, "mode": "production"}, {"input": 1, "rollout_id": "ep-x"}):
        r = http.post("/store/rollouts", json={"rollouts": [request]})
        assert r.status_code in (400, 422), r.text
        assert r.json()["error"]["type"] == "InvalidInput" and "episode" in r.text


async def test_production_episodes_are_queried_by_mode_over_http(server, http):
    episode_id = new_episode(http)
    async with HttpStoreClient(server.url, api_key=KEY) as client:
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input="train")])
        production = await client.query_rollouts(mode=RolloutMode.production)
        attempt = await client.open_episode(episode_id)
    ids = {r.rollout_id for r in production}
    assert f"ep-{episode_id}" in ids and rollout.rollout_id not in ids
    assert all(r.mode is RolloutMode.production for r in production)
    assert attempt.rollout_id == f"ep-{episode_id}" and attempt.worker_id == "production"


# ---------------------------------------------------------------------------- feedback


def test_feedback_on_an_unknown_episode_is_a_404(server, http):
    r = post_feedback(http, "never-seen", value=1.0)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    assert "X-Lightning-Episode" in r.json()["error"]["message"]  # says how one comes to be
    assert http.get("/episodes/never-seen").status_code == 404
    with pytest.raises(NotFound):
        send(server, "never-seen", 1.0)
    # An id the gateway could never have opened is a 400, not a 404.
    r = post_feedback(http, "-starts-with-a-dash", value=1.0)
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidInput"


def test_one_value_counts_per_episode_and_source(server, http):
    episode_id = new_episode(http)
    start = watermark(http)
    first = post_feedback(http, episode_id, value=0.5, comment="ok")
    assert first.status_code == 201 and first.json()["status"] == "recorded", first.text
    seq = first.json()["feedback"]["seq"]
    assert seq == start + 1

    same = post_feedback(http, episode_id, value=0.5, comment="ok")
    assert same.status_code == 200 and same.json()["status"] == "unchanged"
    assert same.json()["feedback"] == first.json()["feedback"]  # same seq, same row
    assert send(server, episode_id, 0.5, comment="ok").status == "unchanged"
    assert watermark(http) == seq  # no new row

    changed = post_feedback(http, episode_id, value=-1.0)
    assert changed.status_code == 200 and changed.json()["status"] == "replaced"
    assert changed.json()["feedback"]["seq"] > seq
    assert changed.json()["feedback"]["value"] == -1.0

    rows = http.get(f"/episodes/{episode_id}").json()["feedback"]
    assert [(r["source"], r["value"]) for r in rows] == [("user", -1.0)]
    in_window = [r for r in window(http, start, watermark(http)) if r["episode_id"] == episode_id]
    assert [(r["source"], r["value"], r["seq"]) for r in in_window] == [
        ("user", -1.0, changed.json()["feedback"]["seq"])
    ]


def test_several_sources_count_side_by_side(server, http):
    episode_id = new_episode(http)
    when = time.time() - 3600  # a signal from an hour ago
    assert send(server, episode_id, 1.0).status == "recorded"
    assert send(server, episode_id, 0.25, "judge", comment="partly right").status == "recorded"
    assert send(server, episode_id, 0.0, "tests", time=when).status == "recorded"
    rows = http.get(f"/episodes/{episode_id}").json()["feedback"]
    assert [(r["source"], r["value"]) for r in rows] == [
        ("judge", 0.25),
        ("tests", 0.0),
        ("user", 1.0),
    ]
    by_source = {r["source"]: r for r in rows}
    assert by_source["tests"]["time"] == when and by_source["tests"]["recorded_at"] > when
    assert by_source["judge"]["comment"] == "partly right"
    assert len({r["seq"] for r in rows}) == 3


@pytest.mark.parametrize(
    "body",
    [
        b'{"value": NaN}',
        b'{"value": Infinity}',
        b'{"value": -Infinity}',
        b'{"value": 1e999}',
        b'{"value": "NaN"}',
        b'{"value": "Infinity"}',
        b'{"value": "0.5"}',
        b'{"value": true}',
        b'{"value": null}',
        b"{}",
        b'{"source": "user"}',
        b'{"value": 1, "source": "bad source"}',
        b'{"value": 1, "source": ""}',
        b'{"value": 1, "time": -1}',
        b'{"value": 1, "comment": "' + b"x" * 2001 + b'"}',
        b'{"value": 1, "unknown": 2}',
        b"[1]",
        b"not json",
    ],
    ids=lambda b: b[:40].decode(),
)
def test_a_value_that_is_not_a_finite_number_is_a_4xx(http, body):
    episode_id = new_episode(http)
    r = http.post(
        f"/episodes/{episode_id}/feedback",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert r.status_code in (400, 422), (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "InvalidInput" and error["message"]
    assert http.get(f"/episodes/{episode_id}").json()["feedback"] == []


def test_send_feedback_refuses_a_bad_value_before_sending(server, http):
    episode_id = new_episode(http)
    for value in (math.nan, math.inf, "0.5"):
        with pytest.raises(InvalidInput, match="value"):
            send(server, episode_id, value)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="source"):
        send(server, episode_id, 1.0, "two words")
    with pytest.raises(InvalidInput, match="episode id"):
        send(server, "", 1.0)
    assert http.get(f"/episodes/{episode_id}").json()["feedback"] == []


def test_bad_windows_are_a_4xx(http):
    top = watermark(http)
    for params in (
        {"after_seq": -1},
        {"after_seq": "abc"},
        {"after_seq": 2**70},
        {"through_seq": -5},
    ):
        r = http.get("/feedback", params=params)
        assert r.status_code in (400, 422) and r.json()["error"]["type"] == "InvalidInput", params
    r = http.get("/feedback", params={"through_seq": top + 1000})
    assert r.status_code == 400 and "feedback_watermark" in r.json()["error"]["message"]


async def test_late_feedback_is_read_once_in_the_window_after_it(server, http):
    old, other = new_episode(http), new_episode(http)
    send(server, old, 1.0)
    send(server, old, 1.0, "tests")
    s1 = watermark(http)
    # Late: after the first run read up to s1, the same episode's user changes their mind, a
    # judge scores it, and another episode gets its first feedback.
    send(server, old, 0.0)
    send(server, old, 0.5, "judge")
    send(server, other, 0.75)
    s2 = watermark(http)
    assert s2 == s1 + 3

    before = [r for r in window(http, 0, s1) if r["episode_id"] in (old, other)]
    assert [(r["episode_id"], r["source"], r["value"]) for r in before] == [
        (old, "tests", 1.0),
        (old, "user", 1.0),
    ]
    after = [r for r in window(http, s1, s2) if r["episode_id"] in (old, other)]
    # Every row that counts of each episode touched in the window, once: all of `old`'s
    # sources (the user's newest value, and the tests' from before the window, which still
    # count for it), `other`'s one.
    assert sorted((r["episode_id"], r["source"], r["value"]) for r in after) == sorted(
        [(old, "judge", 0.5), (old, "tests", 1.0), (old, "user", 0.0), (other, "user", 0.75)]
    )
    assert window(http, s2, s2) == []
    s3 = watermark(http)
    assert s3 == s2 and window(http, s2, s3) == []

    # The Python client reads the same windows.
    async with HttpStoreClient(server.url, api_key=KEY) as client:
        assert await client.feedback_watermark() == s3
        rows = await client.query_feedback(s1, s2)
        assert [r.model_dump(mode="json") for r in rows] == window(http, s1, s2)
        mine = await client.query_feedback(episode_ids=[old])
        assert [(r.source, r.value) for r in mine] == [
            ("judge", 0.5),
            ("tests", 1.0),
            ("user", 0.0),
        ]
        assert await client.query_feedback(s2) == []
        receipt = await client.add_feedback(other, FeedbackIn(value=0.75))
        assert receipt.status == "unchanged"


def test_feedback_routes_need_the_key(server, http, monkeypatch):
    episode_id = new_episode(http)
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for method, path, body in (
            ("POST", f"/episodes/{episode_id}/feedback", {"value": 1.0}),
            ("POST", f"/episodes/{episode_id}", {}),
            ("GET", f"/episodes/{episode_id}", None),
            ("GET", "/feedback", None),
            ("GET", "/feedback/watermark", None),
        ):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                r = anonymous.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["type"] == "Unauthorized"
    with pytest.raises(Unauthorized):
        fb.send_feedback(server.url, episode_id, 1.0)
    with pytest.raises(Unauthorized):
        fb.send_feedback(server.url, episode_id, 1.0, api_key="wrong")
    monkeypatch.setenv("LIGHTNING_API_KEY", KEY)  # the key from the environment
    assert fb.send_feedback(server.url, episode_id, 1.0).status == "recorded"
    assert [r["value"] for r in http.get(f"/episodes/{episode_id}").json()["feedback"]] == [1.0]


def test_episode_headers_name_a_valid_episode():
    assert fb.episode_headers("tenant:42.a_b-c") == {"X-Lightning-Episode": "tenant:42.a_b-c"}
    for bad in ("", "a b", "a/b", "-a", "x" * 129, "é"):
        with pytest.raises(InvalidInput):
            fb.episode_headers(bad)


# ---------------------------------------------------------------------------- the store itself


async def test_both_stores_answer_episodes_and_feedback_alike(store):
    """The protocol, against the in-process store and the HTTP client (the `store` fixture)."""
    with pytest.raises(NotFound):
        await store.add_feedback("unknown", FeedbackIn(value=1.0))
    with pytest.raises(InvalidInput):
        await store.open_episode("not valid")
    attempt = await store.open_episode("e1", agent_name="a", policy_version="v1")
    assert (await store.open_episode("e1")).attempt_id == attempt.attempt_id
    assert await store.feedback_watermark() == 0
    assert await store.query_feedback() == []

    first = await store.add_feedback("e1", FeedbackIn(value=0.5))
    assert (first.status, first.feedback.seq) == ("recorded", 1)
    same = await store.add_feedback("e1", FeedbackIn(value=0.5))
    assert same.status == "unchanged" and same.feedback == first.feedback
    other = await store.add_feedback("e1", FeedbackIn(value=0.5, comment="why"))
    assert (other.status, other.feedback.seq) == ("replaced", 2)  # a new comment is a change
    s2 = await store.feedback_watermark()
    await store.open_episode("e2")
    await store.add_feedback("e2", FeedbackIn(value=-1.0, source="judge", metadata={"k": [1]}))
    s3 = await store.feedback_watermark()
    assert (s2, s3) == (2, 3)

    assert [(f.episode_id, f.seq) for f in await store.query_feedback(0, s2)] == [("e1", 2)]
    [late] = await store.query_feedback(s2, s3)
    assert (late.episode_id, late.source, late.value, late.metadata) == (
        "e2",
        "judge",
        -1.0,
        {"k": [1]},
    )
    assert await store.query_feedback(s3) == []
    assert [f.episode_id for f in await store.query_feedback(episode_ids=["e2", "e1"])] == [
        "e1",
        "e2",
    ]
    assert await store.query_feedback(episode_ids=[]) == []
    with pytest.raises(InvalidInput, match="watermark"):
        await store.query_feedback(0, s3 + 1)
    production = {r.rollout_id: r for r in await store.query_rollouts(mode=RolloutMode.production)}
    assert sorted(production) == ["ep-e1", "ep-e2"]
    assert production["ep-e1"].policy_version == "v1" and production["ep-e2"].policy_version is None


async def test_the_watchdog_never_ends_an_episode_and_its_spans_are_always_taken(tmp_path):
    db = str(tmp_path / "store.duckdb")
    quick = {"attempt_timeout_s": 0.2, "unresponsive_timeout_s": 0.1, "watchdog_interval_s": 0.05}
    store = DuckDBStore(db=db, **quick)
    try:
        attempt = await store.open_episode("long-session", policy_version="champion")
        [runner_rollout] = await store.enqueue_rollouts([RolloutRequest(input="t")])
        claim = await store.dequeue("w")
        await asyncio.sleep(0.6)  # past both timeouts, many watchdog rounds
        [runner_attempt] = await store.query_attempts(runner_rollout.rollout_id)
        assert runner_attempt.status is AttemptStatus.unresponsive  # the watchdog does run
        [episode_attempt] = await store.query_attempts("ep-long-session")
        assert episode_attempt.status is AttemptStatus.running
        episode = await store.get_rollout("ep-long-session")
        assert episode.status is RolloutStatus.running and episode.policy_version == "champion"
        # A span days later (here: after the timeouts) is taken as any other.
        late = reward_span(claim, 1.0).model_copy(
            update={"rollout_id": "ep-long-session", "attempt_id": attempt.attempt_id}
        )
        assert await store.add_spans([late]) == 1
        assert len(await store.query_spans(["ep-long-session"])) == 1
        # Failing an episode's attempt ends it without requeueing it for a runner.
        assert (await store.fail_attempt(attempt.attempt_id, "x")).status is RolloutStatus.failed
        assert await store.dequeue("w") is None
    finally:
        await store.close()
    # Restarted: a running episode is still not the watchdog's.
    store = DuckDBStore(db=db, **quick)
    try:
        again = await store.open_episode("another")
        await asyncio.sleep(0.4)
        await store.heartbeat(again.attempt_id)  # still running
        assert (await store.open_episode("another")).attempt_id == again.attempt_id
    finally:
        await store.close()
    store = DuckDBStore(db=db, **quick)
    try:
        await store.enqueue_rollouts([RolloutRequest(input="wake the watchdog")])
        await asyncio.sleep(0.4)
        [reloaded] = await store.query_attempts("ep-another")
        assert reloaded.status is AttemptStatus.running
    finally:
        await store.close()


async def test_concurrent_opens_of_one_episode_make_one_attempt():
    store = DuckDBStore(db=":memory:")
    try:
        attempts = await asyncio.gather(*(store.open_episode("busy") for _ in range(20)))
        assert len({a.attempt_id for a in attempts}) == 1
        assert len(await store.query_attempts("ep-busy")) == 1
        with pytest.raises(InvalidInput):
            await store.open_episode("bad id")
    finally:
        await store.close()


@pytest.mark.timeout(240)
async def test_acknowledged_feedback_survives_a_sigkill(tmp_path):
    db = tmp_path / "store.duckdb"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    server = start_serve(db, port, "--backend", "none", env={**env, "LIGHTNING_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        async with HttpStoreClient(url, api_key=KEY, retry_s=0) as client:
            await client.open_episode("kept", agent_name="a")
            await client.add_feedback("kept", FeedbackIn(value=0.5))
        replaced = fb.send_feedback(url, "kept", 0.9, api_key=KEY)
        judged = fb.send_feedback(url, "kept", -0.5, "judge", api_key=KEY)
        assert replaced.status == "replaced" and judged.status == "recorded"
        server.send_signal(signal.SIGKILL)  # no shutdown, no checkpoint: the WAL alone
        server.wait(timeout=10)
    finally:
        server.kill()
        server.wait(timeout=10)

    store = DuckDBStore(db=str(db))
    try:
        rows = await store.query_feedback()
        assert [(r.source, r.value, r.seq) for r in rows] == [
            ("judge", -0.5, judged.feedback.seq),
            ("user", 0.9, replaced.feedback.seq),
        ]
        assert await store.feedback_watermark() == judged.feedback.seq == 3
        episode = await store.get_rollout("ep-kept")
        assert episode.mode is RolloutMode.production and episode.status is RolloutStatus.running
        # What a resend compares with was reloaded too: the same value is not a new row.
        again = await store.add_feedback("kept", FeedbackIn(value=0.9))
        assert again.status == "unchanged" and again.feedback.seq == replaced.feedback.seq
        fresh = await store.add_feedback("kept", FeedbackIn(value=1.0))
        assert fresh.feedback.seq == 4  # seqs go on from the file's highest
    finally:
        await store.close()
