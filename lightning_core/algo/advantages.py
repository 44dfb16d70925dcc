"""Advantages, actions to tokens: how much better an action did than its baseline.

Rollouts of the same task form a group (GRPO). Each estimator turns the actions' credited
returns into advantages; every response token of an action gets its action's advantage.
- grpo: baseline = the group's mean episode return; divided by the group's standard deviation
  when `normalize_std` (Dr. GRPO argues to leave it out: it over-weights near-unanimous groups).
- rloo: baseline = the mean episode return of the group's *other* rollouts.
- reinforce++: no group baseline; the batch's returns are normalised (mean 0, std 1) over all
  actions of the batch.
A group whose returns are all equal carries no signal and gets advantage 0 (never NaN), as does a
group of one rollout for grpo and rloo.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_core.errors import InvalidInput

Estimator = Literal["grpo", "rloo", "reinforce++"]
# Standard deviations below this count as zero: the group's returns are equal.
EPS = 1e-6


@dataclass
class Episode:
    """One rollout's actions: their credited returns, and the episode return for baselines."""

    group: str
    episode_return: float
    action_returns: list[float]


# Sums are math.fsum's, correctly rounded: the same returns in any order (a group's rollouts
# come back in the order of their random ids) give the same advantages to the last bit, so a
# resumed run or a rerun with the same seed trains on the same numbers.
def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


def compute_advantages(
    episodes: Sequence[Episode], estimator: Estimator = "grpo", normalize_std: bool = False
) -> list[list[float]]:
    """Per episode, the advantage of each of its actions."""
    if estimator == "reinforce++":
        flat = [g for e in episodes for g in e.action_returns]
        if not flat:
            return [[] for _ in episodes]
        m, s = _mean(flat), _std(flat)
        scale = 1.0 / s if s > EPS else 0.0
        return [[(g - m) * scale for g in e.action_returns] for e in episodes]
    if estimator not in ("grpo", "rloo"):
        raise InvalidInput(
            f"unknown advantage estimator {estimator!r}; use grpo, rloo or reinforce++"
        )

    groups: dict[str, list[int]] = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group, []).append(i)
    out: list[list[float]] = [[] for _ in episodes]
    for members in groups.values():
        returns = [episodes[i].episode_return for i in members]
        spread = _std(returns)
        if len(members) == 1 or spread <= EPS:
            for i in members:
                out[i] = [0.0] * len(episodes[i].action_returns)
            continue
        total = math.fsum(returns)
        for i in members:
            if estimator == "grpo":
                baseline = total / len(members)
            else:
                baseline = (total - episodes[i].episode_return) / (len(members) - 1)
            scale = 1.0 / (spread + EPS) if normalize_std and estimator == "grpo" else 1.0
            out[i] = [(g - baseline) * scale for g in episodes[i].action_returns]
    return out
