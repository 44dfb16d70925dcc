"""The tracing API for agent code: spans reach their rollout attempt, over OTLP or in process."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider

from lightning_core import semconv, tracing
from lightning_core.app import create_app
from lightning_core.errors import InvalidInput
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest
from tests.conftest import ThreadedServer


@tracing.operation
def add(a: int, b: int) -> int:
    return a + b


@tracing.operation(name="lookup")
async def lookup(key: str) -> str:
    await asyncio.sleep(0)
    return key.upper()


async def _agent(provider: TracerProvider) -> None:
    """An agent as users write it: its own spans, a framework's spans, rewards and a tool."""
    tracer = provider.get_tracer("some.framework")
    with tracer.start_as_current_span("framework.step"):
        assert add(2, 3) == 5
        assert await lookup("k") == "K"
    tracing.emit_tool_result("calculator", success=False, error="division by zero")
    tracing.emit_reward(0.25, name="format", primary=False)
    tracing.emit_reward(1.0)


async def test_spans_of_a_rollout_reach_the_store_over_otlp():
    store = DuckDBStore(db=":memory:")
    with ThreadedServer(create_app(store)) as server:
        client = HttpStoreClient(server.url)
        [rollout] = await client.enqueue_rollouts([RolloutRequest(input=1)])
        claim = await client.dequeue("w")
        provider = tracing.setup_tracing(server.url, provider=TracerProvider(), instrument=False)
        outside = provider.get_tracer("x").start_span("not in any rollout")
        outside.end()
        with tracing.rollout_context(rollout.rollout_id, claim.attempt.attempt_id):
            await _agent(provider)
        assert await asyncio.to_thread(tracing.flush)
        done = await client.complete_attempt(claim.attempt.attempt_id)
        spans = await client.query_spans([rollout.rollout_id])
        await client.close()
        provider.shutdown()
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {
        "framework.step",
        "lightning.operation.add",
        "lightning.operation.lookup",
        semconv.TOOL_SPAN,
        semconv.REWARD_SPAN,
    }
    assert by_name["lightning.operation.add"].parent_id == by_name["framework.step"].span_id
    assert by_name["lightning.operation.add"].attributes["lightning.operation.output"] == 5
    assert by_name["lightning.operation.lookup"].attributes["lightning.operation.input.0"] == "k"
    tool = by_name[semconv.TOOL_SPAN]
    assert tool.status_code == "error" and tool.status_message == "division by zero"
    assert tool.attributes[semconv.TOOL_SUCCESS] is False
    rewards = [s for s in spans if s.name == semconv.REWARD_SPAN]
    assert [r.attributes[semconv.REWARD_VALUE] for r in rewards] == [0.25, 1.0]
    assert done.episode_return == 1.0  # the primary one


async def test_in_process_store_exporter():
    store = DuckDBStore(db=":memory:")
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=1)])
    claim = await store.dequeue("w")
    provider = tracing.setup_tracing(store=store, provider=TracerProvider(), instrument=False)
    with tracing.rollout_context(rollout.rollout_id, claim.attempt.attempt_id):
        tracing.emit_reward(0.5)
    # The exporter waits on the store's loop: flush from a worker thread, never the loop itself.
    assert await asyncio.to_thread(tracing.flush)
    assert [s.name for s in await store.query_spans([rollout.rollout_id])] == [semconv.REWARD_SPAN]
    provider.shutdown()
    await store.close()


def test_outside_a_rollout_the_api_is_a_no_op():
    tracing.emit_reward(1.0)
    tracing.emit_tool_result("x", success=True)
    assert add(1, 1) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", True])
def test_rewards_must_be_finite_numbers(bad):
    with pytest.raises(InvalidInput):
        tracing.emit_reward(bad)
