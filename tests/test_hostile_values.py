"""Bounded values everywhere they enter (issue 43, part 2). Against real components: a DuckDB
file behind the real app on loopback, the official clients (HttpStoreClient, send_feedback,
the runner, OpenAI's client), the training flow's collect task.

What must hold: a reward outside the reward range (LIGHTNING_MAX_ABS_REWARD, default 1e6), as a
reward span (JSON or OTLP), an attempt's reward or a feedback value, is refused with a 400 that
names the value, the bound and the setting, and is never stored; a client (emit_reward, the
runner) refuses it before sending, with the same message. Values stored before the range was
checked stop nothing: collect leaves their rollout out (counted as refused) and the run goes
on, no finite return overflows the advantages, /serving/routing answers 200, and offline data
leaves the episode out. Production's memory is bounded: feedback sources per episode, live
episodes, bytes of labels, each past its limit a 429 naming the setting, and known episodes
keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_core import semconv, tracing
from lightning_core.algo.advantages import Episode, compute_advantages
from lightning_core.app import create_app
from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import REWARD_OUT_OF_RANGE, CreditConfig, collect
from lightning_core.data.offline import OfflineConfig, combine_feedback, episode_batch
from lightning_core.errors import InvalidInput, RateLimited
from lightning_core.feedback import episode_headers, send_feedback
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.settings import ServeSettings
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.config import StoreConfig
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import AttemptStatus, Claim, RolloutRequest, RolloutStatus
from lightning_rl.tasks.rollouts import collect_transitions
from tests.conftest import ThreadedServer
from tests.helpers import reward_span, span

SETTING = "LIGHTNING_MAX_ABS_REWARD"
HI = [{"role": "user", "content": "Hi."}]


@pytest.fixture(autouse=True)
def _default_range(monkeypatch):
    # The range's setting is read from the environment by clients and StoreConfig alike.
    monkeypatch.delenv(SETTING, raising=False)
    monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)


@contextlib.contextmanager
def serve(db: Path, gateway: bool = False, **config: Any) -> Iterator[ThreadedServer]:
    """The real app over a DuckDBStore on `db` (with a gateway on the tiny model if asked), on
    loopback; closing it closes the store, so the file may be opened again."""
    store = DuckDBStore(db=str(db), **config)
    if gateway:
        from lightning_core.backends.transformers_backend import TransformersBackend
        from lightning_core.gateway.service import Gateway

        backend = TransformersBackend(model="tiny")
        app = create_app(store, gateway=Gateway(backend, store))
    else:
        app = create_app(store)
    with ThreadedServer(app, start_timeout=120) as running:
        running.model = backend.base_model if gateway else None
        yield running


def _names_the_range(message: str, value: str, bound: str = "1e+06") -> None:
    assert value in message and f"[-{bound}, {bound}]" in message and SETTING in message, message


def _call_span(claim: Claim) -> Any:
    """An LLM call's span as the gateway records it: one response of two tokens."""
    return span(
        claim,
        "chat",
        **{
            semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
            semconv.RESPONSE_COUNT: 1,
            semconv.RESPONSE.format(i=0, key="token_ids"): [7, 8],
            semconv.RESPONSE.format(i=0, key="logprobs"): [-0.5, -0.25],
        },
    )


def _otlp_reward(rollout_id: str, attempt_id: str, value: float) -> bytes:
    """What OTel's OTLP/HTTP exporter sends for one reward span (its own encoder)."""
    exporter = InMemorySpanExporter()
    resource = Resource.create({semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    attributes = {semconv.REWARD_VALUE: value, semconv.REWARD_PRIMARY: True}
    with provider.get_tracer("hostile").start_as_current_span(semconv.REWARD_SPAN) as s:
        s.set_attributes(attributes)
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


# ---------------------------------------------------------------------------- the reward range


async def test_a_reward_out_of_range_is_refused_where_it_enters_and_never_stored(tmp_path):
    """Finding: one reward span of 1e200 on an agent's own attempt was stored (only finiteness
    was checked). As a span (JSON or OTLP) or as the attempt's reward, it is a 400 naming the
    value, the bound and the setting; nothing of it is stored, and the bound itself passes."""
    with serve(tmp_path / "store.duckdb") as server:
        async with HttpStoreClient(server.url) as client:
            [rollout] = await client.enqueue_rollouts([RolloutRequest(input="r")])
            claim = await client.dequeue("w")
            attempt_id = claim.attempt.attempt_id
            with pytest.raises(InvalidInput) as refused:
                await client.add_spans([reward_span(claim, 1e200)])
            _names_the_range(str(refused.value), "1e+200")
            body = _otlp_reward(rollout.rollout_id, attempt_id, -1e200)
            answer = httpx.post(
                f"{server.url}/v1/traces",
                content=body,
                headers={"content-type": "application/x-protobuf"},
            )
            assert answer.status_code == 400, answer.text
            _names_the_range(answer.text, "-1e+200")
            with pytest.raises(InvalidInput) as refused:
                await client.complete_attempt(attempt_id, -1e7)
            _names_the_range(str(refused.value), "-10000000.0")

            assert await client.query_spans([rollout.rollout_id]) == []
            assert (await client.get_rollout(rollout.rollout_id)).status is RolloutStatus.running
            await client.add_spans([reward_span(claim, 1e6)])  # the bound is in the range
            done = await client.complete_attempt(attempt_id)
    assert done.status is RolloutStatus.succeeded and done.episode_return == 1e6


async def test_clients_fail_early_with_the_servers_message(tmp_path, monkeypatch):
    """emit_reward and the runner refuse a reward out of range before sending it: the agent's
    attempt fails with the store's message and nothing of the reward is stored. The setting is
    one variable, read by the server's settings, StoreConfig and the clients alike."""
    with pytest.raises(InvalidInput) as refused:
        tracing.emit_reward(1e200)  # refused even outside a rollout: the agent learns at once
    _names_the_range(str(refused.value), "1e+200")

    def returns_too_much(task: Any, llm: Any) -> float:
        return 1e200

    async def emits_too_much(task: Any, llm: Any) -> None:
        tracing.emit_reward(-1e200)

    with serve(tmp_path / "store.duckdb") as server:
        async with HttpStoreClient(server.url) as client:
            for agent, value in ((returns_too_much, "1e+200"), (emits_too_much, "-1e+200")):
                [rollout] = await client.enqueue_rollouts([RolloutRequest(input="r")])
                runner = Runner(agent, client, server.url, RunnerConfig(poll_wait_s=0.05))
                stats = await runner.run(max_rollouts=1)
                assert (stats.succeeded, stats.failed) == (0, 1)
                [attempt] = await client.query_attempts(rollout.rollout_id)
                assert attempt.status is AttemptStatus.failed
                _names_the_range(attempt.error or "", value)
                spans = await client.query_spans([rollout.rollout_id])
                assert not [s for s in spans if s.name == semconv.REWARD_SPAN]

    monkeypatch.setenv(SETTING, "10")
    assert StoreConfig().max_abs_reward == 10 == ServeSettings().max_abs_reward
    with pytest.raises(InvalidInput) as refused:
        tracing.emit_reward(11)
    _names_the_range(str(refused.value), "11", bound="10")
    monkeypatch.setenv(SETTING, "lots")
    with pytest.raises(InvalidInput, match=SETTING):
        tracing.emit_reward(0.5)


async def _legacy_group(db: Path) -> tuple[list[str], str]:
    """Three finished rollouts of one group (rewards 0.25, 0.75 and one more), then the third's
    reward made 1e200 in the file, as a store from before the range kept it. Their ids, and
    the third's."""
    ids = []
    with serve(db) as server:
        async with HttpStoreClient(server.url) as client:
            for reward in (0.25, 0.75, 0.125):
                [rollout] = await client.enqueue_rollouts(
                    [RolloutRequest(input="t", group_id="g", task_id="t")]
                )
                claim = await client.dequeue("w")
                await client.add_spans([_call_span(claim), reward_span(claim, reward)])
                await client.complete_attempt(claim.attempt.attempt_id)
                ids.append(rollout.rollout_id)
    with duckdb.connect(str(db)) as con:
        con.execute(
            "UPDATE spans SET attributes = replace(attributes::VARCHAR, '0.125', '1e200')::JSON "
            "WHERE rollout_id = ? AND name = ?",
            [ids[2], semconv.REWARD_SPAN],
        )
        con.execute("UPDATE rollout_log SET episode_return = 1e200 WHERE rollout_id = ?", [ids[2]])
    return ids, ids[2]


async def test_collect_leaves_out_a_stored_reward_out_of_range_and_the_run_goes_on(tmp_path):
    """Finding: a reward of 1e200 stored on one attempt made collect raise OverflowError in the
    advantages on every retry of the flow's task: one agent stopped the run. Now that rollout
    is counted as refused (reward_out_of_range, return 0 in its facts) and its group trains."""
    db = tmp_path / "store.duckdb"
    ids, bad = await _legacy_group(db)
    with serve(db) as server:
        async with HttpStoreClient(server.url) as client:
            rollouts = await client.query_rollouts(rollout_ids=ids)
            spans = await client.query_spans(ids, "latest")
            assert any(
                s.attributes.get(semconv.REWARD_VALUE) == 1e200 for s in spans
            )  # as an old store kept it
            collected = collect(rollouts, spans)
            assert dict(collected.refused) == {REWARD_OUT_OF_RANGE: 1}
            assert collected.facts[bad].episode_return == 0.0
            by_rollout = {t.rollout_id: t.advantage for t in collected.transitions}
            assert by_rollout == {ids[0]: -0.25, ids[1]: 0.25}  # the group's mean is 0.5

            # The training flow's task: the same, its transitions stored, no exception.
            task = await collect_transitions.fn(server.url, ids, AdapterConfig(), CreditConfig())
            assert dict(task.refused) == {REWARD_OUT_OF_RANGE: 1}
            stored = await client.query_transitions(ids)
            assert {t.rollout_id for t in stored} == {ids[0], ids[1]}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_no_finite_return_overflows_the_advantages(estimator, normalize_std):
    """(x - m) ** 2 raised OverflowError for returns near 1e155 and above; any finite returns
    now give finite advantages, the same in any order, and ordinary ones keep their bits."""
    biggest = sys.float_info.max
    for returns in ([1e200, 0.0, 0.5], [biggest, -biggest], [biggest, biggest, 1.0]):
        batch = [Episode("g", r, [r, r / 2]) for r in returns]
        forward = compute_advantages(batch, estimator, normalize_std)
        backward = compute_advantages(batch[::-1], estimator, normalize_std)[::-1]
        assert forward == backward
        assert all(math.isfinite(a) for actions in forward for a in actions), forward
    ordinary = [Episode("g", r, [r]) for r in (0.61, 0.58, 0.16)]
    mean = math.fsum([0.61, 0.58, 0.16]) / 3
    if estimator == "grpo" and not normalize_std:
        assert compute_advantages(ordinary) == [[0.61 - mean], [0.58 - mean], [0.16 - mean]]


# ---------------------------------------------------------------------------- feedback


async def test_feedback_out_of_range_is_refused_and_the_routing_answers(tmp_path):
    """Finding: feedback of 1e200 on one episode made GET /serving/routing a 500 from then on.
    It is a 400 naming the value, the bound and the setting (for raw HTTP and send_feedback),
    never stored, and the routing answers with the version's live feedback."""
    with serve(tmp_path / "store.duckdb", gateway=True) as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        assert http.post("/episodes/e1", json={"policy_version": "v1"}).status_code == 200
        answer = http.post("/episodes/e1/feedback", json={"value": 1e200, "source": "user"})
        assert answer.status_code == 400, answer.text
        _names_the_range(answer.text, "1e+200")
        with pytest.raises(InvalidInput) as refused:
            send_feedback(server.url, "e1", -2e6, source="judge")
        _names_the_range(str(refused.value), "-2000000.0")
        assert http.get("/episodes/e1").json()["feedback"] == []

        send_feedback(server.url, "e1", 0.5)
        routing = http.get("/serving/routing")
        assert routing.status_code == 200, routing.text
        [row] = routing.json()["feedback"]
        assert (row["policy_version"], row["episodes"], row["mean"]) == ("v1", 1, 0.5)
        http.close()


async def test_feedback_stored_before_the_range_stops_neither_routing_nor_offline_data(tmp_path):
    """A store from before the range, with feedback of 1e308 from two sources on one episode
    (their sum is inf) and of 1e200 on another: /serving/routing answers 200 with finite
    statistics, the mean of the two sources is finite, and offline data leaves both episodes
    out (unusable_ids) rather than train on them."""
    db = tmp_path / "store.duckdb"
    marks = {("two", "user"): 0.125, ("two", "judge"): 0.375, ("big", "user"): 0.625}
    with serve(db) as server:
        async with HttpStoreClient(server.url) as client:
            for episode_id, version in (("two", "v1"), ("zero", "v1"), ("big", "v2")):
                await client.open_episode(episode_id, policy_version=version)
            for (episode_id, source), mark in marks.items():
                send_feedback(server.url, episode_id, mark, source=source)
            send_feedback(server.url, "zero", 0.0)
            await client.open_episode("small", policy_version="v2")
            send_feedback(server.url, "small", 0.0)
    legacy = {0.125: 1e308, 0.375: 1e308, 0.625: 1e200}
    with duckdb.connect(str(db)) as con:
        for mark, value in legacy.items():
            con.execute("UPDATE feedback SET value = ? WHERE value = ?", [value, mark])

    with serve(db, gateway=True) as server:
        routing = httpx.get(f"{server.url}/serving/routing", timeout=60)
        assert routing.status_code == 200, routing.text
        rows = {row["policy_version"]: row for row in routing.json()["feedback"]}
        assert rows["v1"]["mean"] == 1e308 / 2 and rows["v2"]["mean"] == 5e199
        assert all(math.isfinite(r["variance"]) and r["variance"] > 0 for r in rows.values())
        async with HttpStoreClient(server.url) as client:
            feedback = await client.query_feedback(episode_ids=["two", "big", "zero"])
            episodes = await client.query_rollouts(rollout_ids=["ep-two", "ep-big", "ep-zero"])
    two = [f for f in feedback if f.episode_id == "two"]
    assert combine_feedback(two, "mean") == 1e308
    for combine in ("mean", "sum"):
        batch = episode_batch(episodes, [], feedback, OfflineConfig(combine=combine))
        assert sorted(batch.unusable_ids) == ["big", "two"]
        assert batch.skipped_ids == ["zero"]  # in range, but no call to train on


# ---------------------------------------------------------------------------- quotas


async def test_feedback_sources_per_episode_are_bounded(tmp_path):
    """Finding: feedback sources per episode were unbounded (each a row held in memory). A new
    source past LIGHTNING_MAX_FEEDBACK_SOURCES is a 429 naming it; a source the episode has may
    change its value; the count survives a restart."""
    assert StoreConfig().max_feedback_sources == 16
    db = tmp_path / "store.duckdb"
    with serve(db, max_feedback_sources=3) as server:
        async with HttpStoreClient(server.url) as client:
            await client.open_episode("e1")
            await client.open_episode("e2")
        for i in range(3):
            assert send_feedback(server.url, "e1", 0.5, source=f"s{i}").status == "recorded"
        with pytest.raises(RateLimited) as refused:
            send_feedback(server.url, "e1", 0.5, source="s3")
        assert "LIGHTNING_MAX_FEEDBACK_SOURCES=3" in str(refused.value)
        assert send_feedback(server.url, "e1", 1.0, source="s0").status == "replaced"
        assert send_feedback(server.url, "e2", 1.0, source="s3").status == "recorded"
        answer = httpx.post(f"{server.url}/episodes/e1/feedback", json={"value": 1, "source": "x"})
        assert answer.status_code == 429 and "LIGHTNING_MAX_FEEDBACK_SOURCES" in answer.text
    with serve(db, max_feedback_sources=3) as server:
        with pytest.raises(RateLimited):
            send_feedback(server.url, "e1", 0.5, source="s3")
        assert send_feedback(server.url, "e1", 0.0, source="s1").status == "replaced"


async def test_live_episodes_are_bounded_and_known_ones_keep_working(tmp_path):
    """Finding: live production episodes held in memory had no bound (30.7 MB RSS per 10k
    empty ones). Past LIGHTNING_MAX_LIVE_EPISODES a new episode is a 429 naming it, and so is
    the call that would open it (OpenAI's client gets a RateLimitError); known episodes take
    calls and feedback; archiving idle ones makes room, and a restart counts what is left."""
    db = tmp_path / "store.duckdb"
    with serve(db, gateway=True, max_live_episodes=2) as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        llm = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = server.model
        for episode_id in ("e0", "e1"):
            assert http.post(f"/episodes/{episode_id}", json={}).status_code == 200
        refused = http.post("/episodes/e2", json={})
        assert refused.status_code == 429 and "LIGHTNING_MAX_LIVE_EPISODES=2" in refused.text
        with pytest.raises(openai.RateLimitError, match="LIGHTNING_MAX_LIVE_EPISODES"):
            llm.chat.completions.create(
                model=model, messages=HI, max_tokens=2, extra_headers=episode_headers("e2")
            )
        llm.chat.completions.create(
            model=model, messages=HI, max_tokens=2, extra_headers=episode_headers("e1")
        )
        assert send_feedback(server.url, "e0", 1.0).status == "recorded"
        assert http.get("/episodes/e2").status_code == 404  # the refused one left nothing

        await asyncio.sleep(0.5)
        async with HttpStoreClient(server.url) as client:
            report = await client.archive_episodes(older_than_days=0.2 / 86_400)
        assert report.episodes == 2
        assert http.post("/episodes/e2", json={}).status_code == 200
        http.close()
    with serve(db, max_live_episodes=2) as server:
        assert httpx.post(f"{server.url}/episodes/e3", json={}).status_code == 200
        assert httpx.post(f"{server.url}/episodes/e4", json={}).status_code == 429


async def test_labels_held_in_memory_are_bounded(tmp_path):
    """Finding: ~650 MB RSS per 10k episodes with 60 KiB of metadata. Labels held in memory
    (episodes' metadata, feedback's metadata and comments) are bounded by
    LIGHTNING_MAX_EPISODE_METADATA_BYTES: what brings labels past it is a 429 naming it, what
    brings none is never refused, a replaced feedback gives its bytes back, and a restart
    counts what is held."""
    db = tmp_path / "store.duckdb"
    note = {"note": "x" * 580}  # 591 bytes as JSON
    setting = "LIGHTNING_MAX_EPISODE_METADATA_BYTES=1000"
    with serve(db, max_episode_metadata_bytes=1000) as server:
        async with HttpStoreClient(server.url) as client:
            await client.open_episode("a", metadata=note)
            with pytest.raises(RateLimited, match=setting):
                await client.open_episode("b", metadata=note)
            await client.open_episode("plain")  # no labels: never refused for them
            send_feedback(server.url, "a", 1.0, comment="y" * 300)  # 891 bytes held
            with pytest.raises(RateLimited, match=setting):
                send_feedback(server.url, "plain", 1.0, comment="z" * 200)
            send_feedback(server.url, "a", 0.5)  # replaces the comment: 591 bytes held
            send_feedback(server.url, "plain", 1.0, comment="z" * 200)  # 791 bytes held
            assert (await client.get_rollout("ep-plain")).metadata == {}
    with serve(db, max_episode_metadata_bytes=1000) as server:
        async with HttpStoreClient(server.url) as client:
            with pytest.raises(RateLimited, match=setting):
                await client.open_episode("c", metadata={"note": "x" * 200})
            await client.open_episode("c", metadata={"note": "x" * 190})  # 201 bytes: 992


def test_the_bounds_settings_are_served_settings(monkeypatch):
    """Each bound is a LIGHTNING_* setting of `lightning-rl serve`, with its documented
    default."""
    defaults = ServeSettings()
    assert (defaults.max_abs_reward, defaults.max_feedback_sources) == (1e6, 16)
    assert defaults.max_live_episodes == 1_000_000
    assert defaults.max_episode_metadata_bytes == 1024**3
    monkeypatch.setenv("LIGHTNING_MAX_LIVE_EPISODES", "7")
    monkeypatch.setenv("LIGHTNING_MAX_FEEDBACK_SOURCES", "2")
    settings = ServeSettings().store_config()
    assert (settings.max_live_episodes, settings.max_feedback_sources) == (7, 2)
    monkeypatch.setenv(SETTING, "1e300")  # wider than any statistic over rewards can square
    with pytest.raises(ValueError, match="max_abs_reward"):
        ServeSettings()
