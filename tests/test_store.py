"""The LightningStore protocol, run against the in-process store and the HTTP client alike."""

from __future__ import annotations

import asyncio

import pytest

from lightning_core.errors import Conflict, IllegalTransition, InvalidInput, NotFound
from lightning_core.types import (
    AttemptStatus,
    PolicyVersion,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    Task,
    Transition,
)
from tests.helpers import reward_span, span


async def test_rollout_lifecycle_with_spans_and_reward(store):
    task = Task(id="t1", input={"question": "1+1"}, split="train")
    [queued] = await store.enqueue_rollouts([RolloutRequest.for_task(task, group_id="g1")])
    assert queued.status is RolloutStatus.queuing
    assert queued.task_id == "t1" and queued.input == {"question": "1+1"}

    claim = await store.dequeue("worker-1")
    assert claim.rollout.rollout_id == queued.rollout_id
    assert claim.rollout.status is RolloutStatus.running
    assert claim.attempt.sequence_id == 1 and claim.attempt.worker_id == "worker-1"

    first = span(claim, "llm", **{"gen_ai.request.model": "m", "nested.key": [1, 2]})
    await store.add_spans([first, reward_span(claim, 0.25), reward_span(claim, 0.75)])
    done = await store.complete_attempt(claim.attempt.attempt_id)
    # Without an explicit reward, the last primary reward span is the episode's return.
    assert done.status is RolloutStatus.succeeded and done.episode_return == 0.75

    spans = await store.query_spans([queued.rollout_id])
    assert [s.name for s in spans] == ["llm", "lightning.reward", "lightning.reward"]
    assert spans[0].attributes == {"gen_ai.request.model": "m", "nested.key": [1, 2]}
    assert spans[0].sequence_id < spans[1].sequence_id < spans[2].sequence_id
    [attempt] = await store.query_attempts(queued.rollout_id)
    assert attempt.status is AttemptStatus.succeeded and attempt.ended_at is not None


async def test_explicit_reward_wins_and_secondary_rewards_do_not_count(store):
    await store.enqueue_rollouts([RolloutRequest(input=1)])
    claim = await store.dequeue("w")
    await store.add_spans([reward_span(claim, 1.0), reward_span(claim, 5.0, primary=False)])
    assert (await store.complete_attempt(claim.attempt.attempt_id)).episode_return == 1.0

    await store.enqueue_rollouts([RolloutRequest(input=2)])
    claim = await store.dequeue("w")
    await store.add_spans([reward_span(claim, 1.0)])
    assert (await store.complete_attempt(claim.attempt.attempt_id, 0.5)).episode_return == 0.5


async def test_queue_is_fifo_and_empty_queue_returns_none(store):
    assert await store.dequeue("w") is None
    rollouts = await store.enqueue_rollouts([RolloutRequest(input=i) for i in range(5)])
    claimed = [(await store.dequeue("w")).rollout.rollout_id for _ in range(5)]
    assert claimed == [r.rollout_id for r in rollouts]
    assert await store.dequeue("w") is None


async def test_dequeue_waits_for_work(store):
    waiter = asyncio.create_task(store.dequeue("w", wait=5.0))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input="late")])
    claim = await asyncio.wait_for(waiter, 5)
    assert claim.rollout.rollout_id == rollout.rollout_id


async def test_failed_attempt_is_retried_then_fails(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0, max_attempts=2)])
    first = await store.dequeue("w1")
    await store.add_spans([span(first, "first-try")])
    after_first = await store.fail_attempt(first.attempt.attempt_id, "tool crashed")
    assert after_first.status is RolloutStatus.requeuing

    second = await store.dequeue("w2")
    assert second.rollout.rollout_id == rollout.rollout_id
    assert second.attempt.sequence_id == 2
    await store.add_spans([span(second, "second-try")])
    assert [s.name for s in await store.query_spans([rollout.rollout_id], "latest")] == [
        "second-try"
    ]
    assert len(await store.query_spans([rollout.rollout_id])) == 2

    final = await store.fail_attempt(second.attempt.attempt_id, "again")
    assert final.status is RolloutStatus.failed and final.ended_at is not None
    attempts = await store.query_attempts(rollout.rollout_id)
    assert [(a.sequence_id, a.status, a.error) for a in attempts] == [
        (1, AttemptStatus.failed, "tool crashed"),
        (2, AttemptStatus.failed, "again"),
    ]


async def test_fail_without_retry_ends_the_rollout(store):
    await store.enqueue_rollouts([RolloutRequest(input=0, max_attempts=3)])
    claim = await store.dequeue("w")
    rollout = await store.fail_attempt(claim.attempt.attempt_id, "bad task", retry=False)
    assert rollout.status is RolloutStatus.failed


async def test_illegal_transitions_are_rejected(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    await store.complete_attempt(claim.attempt.attempt_id, 1.0)
    with pytest.raises(IllegalTransition, match="no longer running"):
        await store.complete_attempt(claim.attempt.attempt_id, 1.0)
    with pytest.raises(IllegalTransition, match="no longer running"):
        await store.fail_attempt(claim.attempt.attempt_id, "late")
    with pytest.raises(IllegalTransition, match="no longer running"):
        await store.heartbeat(claim.attempt.attempt_id)
    with pytest.raises(IllegalTransition, match="succeeded and cannot become cancelled"):
        await store.cancel_rollout(rollout.rollout_id)
    # Nothing changed by the refused calls.
    assert (await store.get_rollout(rollout.rollout_id)).episode_return == 1.0


async def test_cancelled_rollout_is_never_dequeued(store):
    [a, b] = await store.enqueue_rollouts([RolloutRequest(input="a"), RolloutRequest(input="b")])
    cancelled = await store.cancel_rollout(a.rollout_id)
    assert cancelled.status is RolloutStatus.cancelled
    claim = await store.dequeue("w")
    assert claim.rollout.rollout_id == b.rollout_id
    assert await store.dequeue("w") is None


async def test_cancelling_a_running_rollout_stops_its_attempt(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    await store.cancel_rollout(rollout.rollout_id)
    [attempt] = await store.query_attempts(rollout.rollout_id)
    assert attempt.status is AttemptStatus.cancelled
    with pytest.raises(IllegalTransition):
        await store.complete_attempt(claim.attempt.attempt_id)


async def test_unknown_ids_are_not_found(store):
    with pytest.raises(NotFound, match="no rollout 'ro-nope'"):
        await store.get_rollout("ro-nope")
    with pytest.raises(NotFound, match="no attempt 'at-nope'"):
        await store.complete_attempt("at-nope")
    with pytest.raises(NotFound):
        await store.query_spans(["ro-nope"])
    with pytest.raises(NotFound):
        await store.wait_for_rollouts(["ro-nope"], timeout=0)


async def test_span_batch_lands_whole_or_not_at_all(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    good = span(claim, "good")
    stray = span(claim, "stray").model_copy(update={"attempt_id": "at-unknown"})
    with pytest.raises(NotFound):
        await store.add_spans([good, stray])
    bad_reward = reward_span(claim, 1.0)
    bad_reward.attributes["lightning.reward.value"] = float("nan")
    with pytest.raises(InvalidInput, match="finite number"):
        await store.add_spans([good, bad_reward])
    wrong_rollout = span(claim, "x").model_copy(update={"rollout_id": "ro-other"})
    with pytest.raises(InvalidInput, match="belongs to rollout"):
        await store.add_spans([good, wrong_rollout])
    assert await store.query_spans([rollout.rollout_id]) == []


async def test_resent_span_is_stored_once(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    s = span(claim)
    await store.add_spans([s])
    await store.add_spans([s])
    assert len(await store.query_spans([rollout.rollout_id])) == 1


async def test_concurrent_span_writers_each_get_their_spans_stored(store):
    rollouts = await store.enqueue_rollouts([RolloutRequest(input=i) for i in range(16)])
    claims = [await store.dequeue(f"w{i}") for i in range(16)]
    await asyncio.gather(
        *(store.add_spans([span(c, f"s{i}-{j}") for j in range(3)]) for i, c in enumerate(claims))
    )
    spans = await store.query_spans([r.rollout_id for r in rollouts])
    assert len(spans) == 48
    assert {s.rollout_id for s in spans} == {r.rollout_id for r in rollouts}


async def test_wait_for_rollouts(store):
    rollouts = await store.enqueue_rollouts([RolloutRequest(input=i) for i in range(2)])
    ids = [r.rollout_id for r in rollouts]
    assert await store.wait_for_rollouts(ids, timeout=0) == []
    first = await store.dequeue("w")
    await store.complete_attempt(first.attempt.attempt_id, 1.0)
    partial = await store.wait_for_rollouts(ids, timeout=0.2)
    assert [r.rollout_id for r in partial] == [first.rollout.rollout_id]

    second = await store.dequeue("w")
    waiter = asyncio.create_task(store.wait_for_rollouts(ids, timeout=10))
    await asyncio.sleep(0.1)
    await store.complete_attempt(second.attempt.attempt_id, 0.0)
    finished = await asyncio.wait_for(waiter, 10)
    assert {r.rollout_id for r in finished} == set(ids)


async def test_query_rollouts_filters(store):
    train = await store.enqueue_rollouts([RolloutRequest(input=i, group_id="g") for i in range(3)])
    await store.enqueue_rollouts([RolloutRequest(input=9, mode=RolloutMode.test)])
    claim = await store.dequeue("w")
    await store.complete_attempt(claim.attempt.attempt_id, 1.0)
    assert len(await store.query_rollouts()) == 4
    assert len(await store.query_rollouts(mode=RolloutMode.test)) == 1
    assert len(await store.query_rollouts(group_id="g")) == 3
    done = await store.query_rollouts(status=[RolloutStatus.succeeded])
    assert [r.rollout_id for r in done] == [train[0].rollout_id]
    some = await store.query_rollouts(rollout_ids=[train[1].rollout_id, "ro-missing"])
    assert [r.rollout_id for r in some] == [train[1].rollout_id]
    assert len(await store.query_rollouts(limit=2)) == 2


async def test_attempt_timeout_requeues_then_fails(make_store):
    store = await make_store(attempt_timeout_s=0.3, watchdog_interval_s=0.05)
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0, max_attempts=2)])
    first = await store.dequeue("slow")
    await asyncio.sleep(0.6)
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.requeuing
    with pytest.raises(IllegalTransition, match="timeout"):
        await store.complete_attempt(first.attempt.attempt_id, 1.0)
    second = await store.dequeue("slow")
    assert second.attempt.sequence_id == 2
    await asyncio.sleep(0.6)
    rollout = await store.get_rollout(rollout.rollout_id)
    assert rollout.status is RolloutStatus.failed
    statuses = [a.status for a in await store.query_attempts(rollout.rollout_id)]
    assert statuses == [AttemptStatus.timeout, AttemptStatus.timeout]


async def test_heartbeats_and_spans_keep_an_attempt_alive(make_store):
    store = await make_store(unresponsive_timeout_s=0.4, watchdog_interval_s=0.05)
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    for i in range(4):
        await asyncio.sleep(0.2)
        if i % 2:
            await store.heartbeat(claim.attempt.attempt_id)
        else:
            await store.add_spans([span(claim)])
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.running
    await asyncio.sleep(0.8)
    [attempt] = await store.query_attempts(rollout.rollout_id)
    assert attempt.status is AttemptStatus.unresponsive
    assert "no heartbeat" in attempt.error
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.failed


async def test_transitions_round_trip(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    transitions = [
        Transition(
            rollout_id=rollout.rollout_id,
            step=i,
            agent_name="writer",
            prompt_token_ids=[1, 2, 3],
            response_token_ids=[4, 5],
            response_logprobs=[-0.5, -1.25],
            reward=1.0,
            advantage=0.5,
            policy_version="v1",
            finish_reason=["stop", "length"][i],
        )
        for i in range(2)
    ]
    assert await store.add_transitions(transitions) == 2
    assert await store.query_transitions([rollout.rollout_id]) == transitions
    assert await store.query_transitions(policy_version="v2") == []
    mismatch = transitions[0].model_copy(update={"response_logprobs": [-0.1]})
    with pytest.raises(InvalidInput, match="1 logprobs for 2 response tokens"):
        await store.add_transitions([mismatch])
    orphan = transitions[0].model_copy(update={"rollout_id": "ro-nope"})
    with pytest.raises(NotFound):
        await store.add_transitions([orphan])
    assert len(await store.query_transitions()) == 2


async def test_transitions_stored_again_are_read_once_as_last_written(store):
    # A collect task retried after its answer was lost stores the same transitions again.
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    first = [
        Transition(
            rollout_id=rollout.rollout_id,
            attempt_id=attempt,
            step=i,
            prompt_token_ids=[1],
            response_token_ids=[2],
            reward=0.0,
            advantage=0.0,
        )
        for attempt in ("at-1", "at-2")
        for i in range(2)
    ]
    await store.add_transitions(first)
    again = [t.model_copy(update={"advantage": 1.0}) for t in first if t.attempt_id == "at-2"]
    await store.add_transitions(again)

    read = await store.query_transitions([rollout.rollout_id])
    assert len(read) == 4  # each (attempt, step) once
    by_key = {(t.attempt_id, t.step): t.advantage for t in read}
    assert by_key == {("at-1", 0): 0.0, ("at-1", 1): 0.0, ("at-2", 0): 1.0, ("at-2", 1): 1.0}
    assert [t.step for t in read] == sorted(t.step for t in read)


async def test_policy_versions(store):
    base = PolicyVersion(name="base", base_model="smollm2")
    v1 = PolicyVersion(name="v1", base_model="smollm2", adapter_path="/tmp/v1")
    await store.add_policy_version(base)
    await store.add_policy_version(v1)
    assert (await store.get_policy_version("v1")).adapter_path == "/tmp/v1"
    assert [v.name for v in await store.list_policy_versions()] == ["base", "v1"]
    with pytest.raises(Conflict, match="exists already"):
        await store.add_policy_version(v1)
    with pytest.raises(NotFound):
        await store.get_policy_version("v9")


async def test_late_spans_of_a_finished_attempt_are_kept_but_do_not_change_its_reward(store):
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
    claim = await store.dequeue("w")
    await store.add_spans([reward_span(claim, 1.0)])
    await store.complete_attempt(claim.attempt.attempt_id)
    await store.add_spans([span(claim, "slow-exporter"), reward_span(claim, 0.0)])
    names = [s.name for s in await store.query_spans([rollout.rollout_id])]
    assert names == ["lightning.reward", "slow-exporter", "lightning.reward"]
    assert (await store.get_rollout(rollout.rollout_id)).episode_return == 1.0


async def test_a_store_made_before_the_rename_reads_its_final_reward_as_episode_return(tmp_path):
    import duckdb

    from lightning_core.store import schema
    from lightning_core.store.duckdb_store import DuckDBStore

    db = tmp_path / "old.duckdb"
    columns = [
        ("final_reward" if name == "episode_return" else name, sql_type)
        for name, sql_type in schema.ROLLOUT_LOG.columns
    ]
    with duckdb.connect(str(db)) as con:
        con.execute(f"CREATE TABLE rollout_log ({', '.join(f'{n} {t}' for n, t in columns)})")
        con.execute(
            "INSERT INTO rollout_log (log_seq, rollout_id, input, mode, status, max_attempts, "
            "attempt_count, final_reward, enqueued_at, metadata) "
            "VALUES (1, 'ro-old', '{}', 'train', 'succeeded', 1, 1, 0.75, 0, '{}')"
        )
    store = DuckDBStore(db=str(db))
    try:
        rollout = await store.get_rollout("ro-old")
    finally:
        await store.close()
    assert rollout.episode_return == 0.75


async def test_a_store_made_before_finish_reasons_keeps_its_transitions_and_takes_new_ones(
    tmp_path,
):
    import duckdb

    from lightning_core.store.duckdb_store import DuckDBStore

    db = tmp_path / "old.duckdb"
    store = DuckDBStore(db=str(db))
    try:
        [rollout] = await store.enqueue_rollouts([RolloutRequest(input=0)])
        old = Transition(
            rollout_id=rollout.rollout_id, step=0, prompt_token_ids=[1], response_token_ids=[2]
        )
        await store.add_transitions([old])
    finally:
        await store.close()
    # The table as a release before the column wrote it: without it and the columns added since.
    with duckdb.connect(str(db)) as con:
        for column in ("finish_reason", "adapter_hash", "template_fingerprint"):
            con.execute(f"ALTER TABLE transitions DROP COLUMN {column}")
    store = DuckDBStore(db=str(db))
    try:
        new = old.model_copy(
            update={"step": 1, "finish_reason": "length", "adapter_hash": "a" * 64}
        )
        await store.add_transitions([new])
        assert await store.query_transitions([rollout.rollout_id]) == [old, new]
    finally:
        await store.close()
