"""Rollout seeds: a fixed function of the run's seed, distinct within a plan, fresh on retry."""

from __future__ import annotations

from lightning_core.rollouts.runner import Runner
from lightning_core.types import Attempt, Claim, Rollout
from lightning_rl.tasks.rollouts import rollout_seed


def test_rollout_seeds_are_fixed_and_distinct():
    plan = [rollout_seed(7, 3, k) for k in range(64)]
    assert plan == [rollout_seed(7, 3, k) for k in range(64)]
    assert len(set(plan)) == 64
    assert plan != [rollout_seed(8, 3, k) for k in range(64)]
    assert plan != [rollout_seed(7, 4, k) for k in range(64)]


def _claim(sequence_id: int) -> Claim:
    rollout = Rollout(
        rollout_id="ro-1",
        input={},
        enqueued_at=0.0,
        metadata={"sampling": {"temperature": 0.8, "seed": 41}},
    )
    attempt = Attempt(
        attempt_id=f"at-{sequence_id}",
        rollout_id="ro-1",
        sequence_id=sequence_id,
        worker_id="w",
        started_at=0.0,
        last_heartbeat_at=0.0,
    )
    return Claim(rollout=rollout, attempt=attempt)


def test_a_retry_samples_anew_and_the_first_attempt_keeps_the_plans_seed():
    runner = Runner(lambda task, llm: 1.0, None, "http://127.0.0.1:9")  # type: ignore[arg-type]
    first, retry = runner.endpoint(_claim(1)), runner.endpoint(_claim(2))
    assert first.sampling == {"temperature": 0.8, "seed": 41}
    assert retry.sampling["seed"] != 41 and retry.sampling["temperature"] == 0.8
    assert _claim(1).rollout.metadata["sampling"]["seed"] == 41  # the rollout is untouched
