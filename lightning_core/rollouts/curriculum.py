"""Which training tasks an iteration samples: a curriculum over tiers, and dynamic sampling.

A group of rollouts teaches only when its rewards differ: when all G fail (too hard) or all
succeed (too easy), every advantage is 0 and the group costs compute for nothing. Two measures
keep an iteration's batch full of groups that teach:

- **Curriculum by tier.** Tasks carry a tier (a task key, `tier` by default: the SQL agent's
  easy/medium/hard, the rag agent's hop count). Each tier is drawn with weight
  `floor + learnability`, where learnability is a running share of the tier's groups that
  carried a signal. A tier the policy has mastered or cannot yet touch is drawn less, but never
  stops being drawn: the floor keeps measuring it. With a graded reward (partial credit for a
  near miss) nearly every group's rewards differ, even on a tier the policy never solves, and
  "carried a signal" stops telling tiers apart; `learnability="success"` counts a group as
  teaching only when some of its rollouts succeeded and some did not.
- **Dynamic sampling** (DAPO's). After a round of rollouts, while fewer than the wanted number of
  groups carry a signal and rounds are left, another round samples that many more tasks, not
  yet drawn this iteration. Groups without a signal are left out of training anyway; this only
  replaces them.

Everything is a fixed function of the run's seed, the iteration and the round, so a repeated
run draws the same tasks.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from lightning_core.data.analytics import RolloutFacts
from lightning_core.types import Transition

# Tasks without the tier key share this tier.
UNTIERED = "all"


class CurriculumConfig(BaseModel):
    """How an iteration's training tasks are drawn."""

    tier_key: str | None = Field(
        "tier",
        description="Task key whose value is the task's tier; None (or tasks without it): "
        "one tier, drawn uniformly.",
    )
    adaptive: bool = Field(
        True,
        description="Weigh tiers by learnability (the running share of their groups with a "
        "signal); False: every tier equally often.",
    )
    learnability: Literal["signal", "success"] = Field(
        "signal",
        description="Which groups count as teaching in a tier's learnability: signal (its "
        "advantages are not all 0) or success (some of its rollouts succeeded and some did "
        "not; for graded rewards, whose partial credit gives nearly every group a signal).",
    )
    floor: float = Field(
        0.2, gt=0, description="Weight every tier keeps beside its learnability (0 to 1)."
    )
    smoothing: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Weight of an iteration's observed share in a tier's running learnability.",
    )
    max_rounds: int = Field(
        1,
        ge=1,
        description="Rollout rounds per iteration, the first included: while fewer groups "
        "than tasks_per_iteration carry a signal, another round samples that many more tasks "
        "(DAPO dynamic sampling). 1: no resampling.",
    )


def tier_of(task: Mapping[str, Any], key: str | None) -> str:
    value = task.get(key) if key else None
    return UNTIERED if value is None else str(value)


class Curriculum:
    """Draws training tasks by tier and learns which tiers teach (see the module doc)."""

    def __init__(
        self, tasks: Sequence[Mapping[str, Any]], config: CurriculumConfig, seed: int = 0
    ) -> None:
        if not tasks:
            raise ValueError("a curriculum needs at least one task")
        self.config = config
        self.seed = seed
        self.by_tier: dict[str, list[Mapping[str, Any]]] = {}
        for task in tasks:
            self.by_tier.setdefault(tier_of(task, config.tier_key), []).append(task)
        # Prior: every tier half learnable, so the first draws are even.
        self.learnability = dict.fromkeys(self.by_tier, 0.5)

    def weights(self) -> dict[str, float]:
        """Each tier's share of the next draws."""
        raw = {
            tier: (self.config.floor + self.learnability[tier]) if self.config.adaptive else 1.0
            for tier in self.by_tier
        }
        total = sum(raw.values())
        return {tier: w / total for tier, w in raw.items()}

    def sample(
        self, count: int, iteration: int, round_: int = 0, exclude: Iterable[str] = ()
    ) -> list[Mapping[str, Any]]:
        """`count` tasks (fewer when fewer are left), none of them in `exclude` (task ids), no
        repeats; a tier drawn when it has nothing left gives its turn to the others."""
        rng = random.Random(f"{self.seed}-{iteration}-{round_}")
        taken = {str(t) for t in exclude}
        left = {
            tier: [t for t in tasks if str(t["id"]) not in taken]
            for tier, tasks in self.by_tier.items()
        }
        for tasks in left.values():
            rng.shuffle(tasks)
        weights = self.weights()
        chosen: list[Mapping[str, Any]] = []
        while len(chosen) < count:
            tiers = [tier for tier, tasks in left.items() if tasks]
            if not tiers:
                break
            tier = rng.choices(tiers, weights=[weights[t] for t in tiers])[0]
            chosen.append(left[tier].pop())
        return chosen

    def observe(self, signal_by_task: Mapping[str, bool], tasks: Sequence[Mapping[str, Any]]):
        """Update each tier's learnability from an iteration's groups (task id -> whether its
        group carried a signal)."""
        seen: dict[str, list[bool]] = {}
        for task in tasks:
            task_id = str(task["id"])
            if task_id in signal_by_task:
                tier = tier_of(task, self.config.tier_key)
                seen.setdefault(tier, []).append(signal_by_task[task_id])
        s = self.config.smoothing
        for tier, flags in seen.items():
            if tier in self.learnability:
                share = sum(flags) / len(flags)
                self.learnability[tier] = (1 - s) * self.learnability[tier] + s * share


def group_signal(
    transitions: Sequence[Transition], task_of_rollout: Mapping[str, str]
) -> dict[str, bool]:
    """Task id -> whether its group carried a learning signal (some advantage not 0), for
    every task with a rollout in `task_of_rollout` (rollout id -> task id)."""
    signal = dict.fromkeys(task_of_rollout.values(), False)
    for t in transitions:
        if t.advantage and t.rollout_id in task_of_rollout:
            signal[task_of_rollout[t.rollout_id]] = True
    return signal


def group_success_spread(facts: Mapping[str, RolloutFacts]) -> dict[str, bool]:
    """Task id -> whether its group held both a success and a failure, for every task with a
    rollout in `facts` (rollout id -> its facts)."""
    outcomes: dict[str, set[bool]] = {}
    for fact in facts.values():
        if fact.task_id is not None:
            outcomes.setdefault(str(fact.task_id), set()).add(fact.success)
    return {task: len(seen) == 2 for task, seen in outcomes.items()}
