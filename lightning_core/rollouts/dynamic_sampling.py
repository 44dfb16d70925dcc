"""Dynamic sampling (DAPO): an iteration samples rounds of tasks until enough groups carry a
learning signal.

A group whose G rollouts all got the same reward has advantage 0 everywhere and teaches
nothing. So after the first round of `wanted` tasks, while fewer than `wanted` groups carry a
signal and rounds are left (CurriculumConfig.max_rounds), another round draws as many new
tasks as signals are missing, none drawn before. The curriculum then learns from every group
of the iteration at once. How a round's rollouts run (Prefect tasks, threads, a cluster) is
the caller's: `run_round`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_core.data.collect import Collected
from lightning_core.rollouts.curriculum import Curriculum, group_signal, group_success_spread

# (the round's tasks, the index of its first rollout in the iteration) -> its transitions
RunRound = Callable[[Sequence[Mapping[str, Any]], int], Collected]


def _task_of(collected: Collected) -> dict[str, str]:
    return {rollout: str(facts.task_id) for rollout, facts in collected.facts.items()}


def sample_rounds(
    curriculum: Curriculum,
    wanted: int,
    group_size: int,
    iteration: int,
    run_round: RunRound,
) -> tuple[Collected, dict[str, float]]:
    """An iteration's rollouts, round after round as the module doc says; returns the merged
    transitions and what was sampled (`rollout/rounds`, `rollout/tasks_drawn`,
    `rollout/groups_with_signal`, `rollout/groups_mixed_success` (groups with a success and a
    failure), `curriculum/weight_<tier>` as the draws saw them)."""
    merged, drawn, with_signal = Collected(), [], 0
    weights = curriculum.weights()
    rounds = 0
    for round_ in range(curriculum.config.max_rounds):
        chosen = curriculum.sample(
            wanted - with_signal, iteration, round_, exclude=(str(t["id"]) for t in drawn)
        )
        if not chosen:
            break
        rounds = round_ + 1
        collected = run_round(chosen, len(drawn) * group_size)
        drawn += chosen
        merged.transitions += collected.transitions
        merged.facts |= collected.facts
        merged.refused += collected.refused
        with_signal += sum(group_signal(collected.transitions, _task_of(collected)).values())
        if with_signal >= wanted:
            break
    spread = group_success_spread(merged.facts)
    signal = group_signal(merged.transitions, _task_of(merged))
    curriculum.observe(spread if curriculum.config.learnability == "success" else signal, drawn)
    return merged, {
        # A round that found no task left is not counted, but the first always is.
        "rollout/rounds": float(max(rounds, 1)),
        "rollout/tasks_drawn": float(len(drawn)),
        "rollout/groups_with_signal": float(with_signal),
        "rollout/groups_mixed_success": float(sum(spread.values())),
        **{f"curriculum/weight_{tier}": w for tier, w in weights.items()},
    }
