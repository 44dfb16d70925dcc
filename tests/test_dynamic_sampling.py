"""Dynamic sampling without Prefect: rounds of new tasks until enough groups carry a signal."""

from __future__ import annotations

import itertools

from lightning_core.data.analytics import RolloutFacts
from lightning_core.data.collect import Collected
from lightning_core.rollouts.curriculum import Curriculum, CurriculumConfig
from lightning_core.rollouts.dynamic_sampling import sample_rounds
from lightning_core.types import Transition

TASKS = [{"id": f"t{i}", "tier": "easy" if i % 2 else "hard"} for i in range(20)]


def _round(
    calls: list[tuple[list[str], int]],
    teaching: set[str],
    group_size: int = 2,
    solving: set[str] = frozenset(),
):
    """A round's rollouts: G per task, with a signal in the groups of `teaching` tasks only;
    in those of `solving` tasks the last rollout succeeds."""

    def run_round(tasks, first_index: int) -> Collected:
        calls.append(([str(t["id"]) for t in tasks], first_index))
        collected = Collected()
        for n, task in enumerate(tasks):
            for g in range(group_size):
                rollout = f"ro-{first_index + n * group_size + g}"
                signal = str(task["id"]) in teaching
                collected.transitions.append(
                    Transition(
                        rollout_id=rollout,
                        step=0,
                        prompt_token_ids=[1],
                        response_token_ids=[2],
                        response_logprobs=[-1.0],
                        reward=float(g) if signal else 0.0,
                        advantage=(g - 0.5) if signal else 0.0,
                    )
                )
                success = str(task["id"]) in solving and g == group_size - 1
                collected.facts[rollout] = RolloutFacts(
                    task_id=str(task["id"]), episode_return=float(success), success=success
                )
        return collected

    return run_round


def test_rounds_draw_new_tasks_until_enough_groups_teach():
    curriculum = Curriculum(TASKS, CurriculumConfig(tier_key="tier", max_rounds=4), seed=1)
    calls: list[tuple[list[str], int]] = []
    teaching = {t["id"] for t in TASKS if t["tier"] == "easy"}
    merged, sampled = sample_rounds(curriculum, 4, 2, 1, _round(calls, teaching))
    drawn = [task for tasks, _ in calls for task in tasks]
    # Each round asks for as many tasks as signals are missing, never one drawn before, and
    # its rollouts are numbered on from the previous round's.
    assert len(drawn) == len(set(drawn)) == sampled["rollout/tasks_drawn"]
    assert calls[0][1] == 0 and len(calls[0][0]) == 4
    for (before, first), (_, next_first) in itertools.pairwise(calls):
        assert next_first == first + 2 * len(before)
    assert sampled["rollout/groups_with_signal"] >= 4
    assert sampled["rollout/rounds"] == len(calls) > 1
    assert len(merged.transitions) == 2 * len(drawn)
    # The curriculum saw every group: the tier without a signal is now drawn less.
    assert curriculum.learnability["hard"] < curriculum.learnability["easy"]


def test_with_one_round_or_no_signal_anywhere_it_stops_at_the_rounds_limit():
    calls: list[tuple[list[str], int]] = []
    one = Curriculum(TASKS, CurriculumConfig(max_rounds=1), seed=1)
    _, sampled = sample_rounds(one, 3, 2, 1, _round(calls, set()))
    assert len(calls) == 1 and sampled["rollout/rounds"] == 1.0
    calls.clear()
    three = Curriculum(TASKS, CurriculumConfig(max_rounds=3), seed=1)
    _, sampled = sample_rounds(three, 3, 2, 1, _round(calls, set()))
    assert len(calls) == 3 and sampled == {
        "rollout/rounds": 3.0,
        "rollout/tasks_drawn": 9.0,
        "rollout/groups_with_signal": 0.0,
        "rollout/groups_mixed_success": 0.0,
        "curriculum/weight_easy": 0.5,
        "curriculum/weight_hard": 0.5,
    }


def test_success_learnability_tells_apart_tiers_that_partial_credit_does_not():
    # A graded reward: every group's rewards differ, but only the easy tier's rollouts ever
    # succeed. Counted by signal, both tiers look equally learnable; counted by success, the
    # tier that is never solved is drawn less.
    teaching = {t["id"] for t in TASKS}
    solving = {t["id"] for t in TASKS if t["tier"] == "easy"}
    learned = {}
    for rule in ("signal", "success"):
        config = CurriculumConfig(tier_key="tier", learnability=rule)
        curriculum = Curriculum(TASKS, config, seed=1)
        _, sampled = sample_rounds(curriculum, 8, 2, 1, _round([], teaching, solving=solving))
        assert sampled["rollout/groups_with_signal"] == 8.0
        # Every easy group drawn, and no other, held a success beside a failure.
        assert 0 < sampled["rollout/groups_mixed_success"] < 8
        learned[rule] = dict(curriculum.learnability)
    assert learned["signal"]["easy"] == learned["signal"]["hard"] == 0.75
    # 0.5 prior halfway to the iteration's share: 1.0 for easy, 0.0 for hard.
    assert learned["success"] == {"easy": 0.75, "hard": 0.25}
