"""Advantages, actions to tokens: how much better an action did than its baseline.

Rollouts of the same task form a group (GRPO). Each estimator turns the actions' credited
returns into advantages; every response token of an action gets its action's advantage.
- grpo: baseline = the group's mean episode return; divided by the group's standard deviation
  when `normalize_std` (Dr. GRPO argues to leave it out: it over-weights near-unanimous groups).
- rloo: baseline = the mean episode return of the group's *other* rollouts.
- reinforce++: no group baseline; the batch's returns are normalised (mean 0, std 1) over all
  actions of the batch.
A group whose returns are all equal carries no signal and gets advantage 0 (never NaN), as does a
group of one rollout for grpo and rloo. No finite returns overflow: huge ones are scaled down
before they are summed or squared (_exponent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_core.errors import InvalidInput
from lightning_core.types import scale_exponent, scale_up

Estimator = Literal["grpo", "rloo", "reinforce++"]
# Standard deviations below this count as zero: the group's returns are equal.
EPS = 1e-6
# Returns up to this magnitude are summed and squared as they are: the squares of their
# differences (below 2**962) cannot overflow, and the advantages keep their bits. Larger ones
# (rewards stored before the reward range was checked, types.check_reward: one of 1e200 made
# (x - m) ** 2 raise OverflowError) are scaled down by a power of two first, which is exact, and
# the advantages scaled back, saturating at the largest float.
_SAFE = 2.0**480


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


def _exponent(xs: Sequence[float]) -> int:
    """0 for values within _SAFE (used as they are); else k, so that every x * 2**-k < 1."""
    return 0 if max((abs(x) for x in xs), default=0.0) <= _SAFE else scale_exponent(xs)


def _down(x: float, k: int) -> float:
    return math.ldexp(x, -k) if k else x


def _up(x: float, k: int) -> float:
    return scale_up(x, k) if k else x


def compute_advantages(
    episodes: Sequence[Episode], estimator: Estimator = "grpo", normalize_std: bool = False
) -> list[list[float]]:
    """Per episode, the advantage of each of its actions; finite for any finite returns."""
    if not all(math.isfinite(x) for e in episodes for x in (e.episode_return, *e.action_returns)):
        raise InvalidInput(
            "advantages need finite returns; collect leaves out a rollout whose rewards are not"
        )
    if estimator == "reinforce++":
        flat = [g for e in episodes for g in e.action_returns]
        if not flat:
            return [[] for _ in episodes]
        # Normalised advantages do not depend on the returns' scale: computed on the scaled ones.
        k = _exponent(flat)
        flat = [_down(g, k) for g in flat]
        m, s = _mean(flat), _std(flat)
        scale = 1.0 / s if _up(s, k) > EPS else 0.0
        return [[(_down(g, k) - m) * scale for g in e.action_returns] for e in episodes]
    if estimator not in ("grpo", "rloo"):
        raise InvalidInput(
            f"unknown advantage estimator {estimator!r}; use grpo, rloo or reinforce++"
        )

    groups: dict[str, list[int]] = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group, []).append(i)
    out: list[list[float]] = [[] for _ in episodes]
    normalized = normalize_std and estimator == "grpo"
    for members in groups.values():
        returns = [episodes[i].episode_return for i in members]
        k = _exponent(returns + [g for i in members for g in episodes[i].action_returns])
        returns = [_down(r, k) for r in returns]
        spread = _std(returns)
        if len(members) == 1 or _up(spread, k) <= EPS:
            for i in members:
                out[i] = [0.0] * len(episodes[i].action_returns)
            continue
        total = math.fsum(returns)
        for i, own in zip(members, returns, strict=True):
            if estimator == "grpo":
                baseline = total / len(members)
            else:
                baseline = (total - own) / (len(members) - 1)
            scale = 1.0 / (spread + _down(EPS, k)) if normalized else 1.0
            advantages = [(_down(g, k) - baseline) * scale for g in episodes[i].action_returns]
            # Normalised, an advantage is a ratio, the same at any scale; else in return units.
            out[i] = advantages if normalized else [_up(a, k) for a in advantages]
    return out
