"""Credit assignment, episode to actions: how much of the return each LLM call is credited with.

A rollout's transitions carry the reward each action earned right after it (intermediate
rewards on the step they follow, the final reward on the last step; see adapter.py). The
strategies:
- equal: every action is credited with the episode return (the sum of its rewards); the
  LightningRL paper's default.
- discounted: each action gets its return-to-go, sum over k >= t of gamma^(k - t) * r_k, so
  intermediate rewards credit the actions before them and not those after.
- last: only the final action is credited (with the episode return); the others get 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from lightning_core.errors import InvalidInput

CreditStrategy = Literal["equal", "discounted", "last"]
# A strategy of one's own: per-step rewards of an episode in, per-action returns out.
CreditFn = Callable[[Sequence[float]], list[float]]


def assign_credit(
    rewards: Sequence[float], strategy: CreditStrategy | CreditFn = "equal", gamma: float = 1.0
) -> list[float]:
    """The return credited to each action of one episode, from its per-step rewards."""
    if callable(strategy):
        returns = list(strategy(rewards))
        if len(returns) != len(rewards):
            raise InvalidInput(f"a credit function returned {len(returns)} for {len(rewards)}")
        return returns
    if not 0.0 <= gamma <= 1.0:
        raise InvalidInput(f"gamma must be in [0, 1], got {gamma}")
    if not rewards:
        return []
    episode_return = float(sum(rewards))
    if strategy == "equal":
        return [episode_return] * len(rewards)
    if strategy == "last":
        return [0.0] * (len(rewards) - 1) + [episode_return]
    if strategy == "discounted":
        returns: list[float] = []
        running = 0.0
        for r in reversed(rewards):
            running = float(r) + gamma * running
            returns.append(running)
        return returns[::-1]
    raise InvalidInput(f"unknown credit strategy {strategy!r}; use equal, discounted or last")
