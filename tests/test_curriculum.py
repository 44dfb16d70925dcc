"""The curriculum's draws (by tier, no repeats, seeded, adaptive) and the group-signal count."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_core.rollouts.curriculum import UNTIERED, Curriculum, CurriculumConfig, group_signal
from lightning_core.types import Transition

TASKS = [{"id": f"e{i}", "tier": "easy"} for i in range(30)] + [
    {"id": f"h{i}", "tier": "hard"} for i in range(30)
]


def _tiers(tasks) -> Counter:
    return Counter(t["tier"] for t in tasks)


def test_draws_are_seeded_distinct_and_leave_out_what_was_drawn():
    cur = Curriculum(TASKS, CurriculumConfig(), seed=3)
    first = cur.sample(10, iteration=1)
    assert first == Curriculum(TASKS, CurriculumConfig(), seed=3).sample(10, iteration=1)
    assert first != Curriculum(TASKS, CurriculumConfig(), seed=4).sample(10, iteration=1)
    assert len({t["id"] for t in first}) == 10
    more = cur.sample(50, iteration=1, round_=1, exclude=[t["id"] for t in first])
    assert not {t["id"] for t in more} & {t["id"] for t in first}
    assert len(more) == 50  # all that is left
    assert cur.sample(5, iteration=1, exclude=[t["id"] for t in TASKS]) == []


def test_a_tier_that_never_teaches_is_drawn_less_but_still_drawn():
    cur = Curriculum(TASKS, CurriculumConfig(floor=0.2, smoothing=0.5), seed=0)
    assert cur.weights() == pytest.approx({"easy": 0.5, "hard": 0.5})
    for it in range(1, 6):
        drawn = cur.sample(10, iteration=it)
        # Easy groups all carry a signal, hard groups none (all fail).
        cur.observe({t["id"]: t["tier"] == "easy" for t in drawn}, drawn)
    weights = cur.weights()
    assert weights["easy"] > 0.75 and 0 < weights["hard"] < 0.25
    counts = Counter()
    for it in range(10, 30):
        counts += _tiers(cur.sample(10, iteration=it))
    assert counts["easy"] > 2.5 * counts["hard"] > 0


def test_uniform_when_not_adaptive_or_untiered():
    cur = Curriculum(TASKS, CurriculumConfig(adaptive=False))
    drawn = cur.sample(10, iteration=1)
    cur.observe({t["id"]: t["tier"] == "easy" for t in drawn}, drawn)
    assert cur.weights() == {"easy": 0.5, "hard": 0.5}
    plain = Curriculum([{"id": i} for i in range(5)], CurriculumConfig())
    assert plain.weights() == {UNTIERED: 1.0}
    assert sorted(t["id"] for t in plain.sample(9, iteration=1)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        Curriculum([], CurriculumConfig())


def _t(rollout: str, advantage: float | None) -> Transition:
    return Transition(
        rollout_id=rollout,
        step=0,
        prompt_token_ids=[1],
        response_token_ids=[2],
        advantage=advantage,
    )


def test_group_signal_marks_tasks_whose_group_has_a_nonzero_advantage():
    task_of = {"r1": "a", "r2": "a", "r3": "b", "r4": "c"}
    transitions = [_t("r1", 0.0), _t("r2", 0.5), _t("r3", 0.0), _t("r9", 1.0)]
    # c had no transition at all (its rollouts failed): no signal.
    assert group_signal(transitions, task_of) == {"a": True, "b": False, "c": False}
