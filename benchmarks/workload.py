"""The synthetic agent workload of Agent Lightning's store benchmark, shared by both sides.

Standard library only: the Agent Lightning side imports this file inside its own virtual
environment, so both stores receive spans of exactly the same shape.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkloadShape:
    """One benchmark configuration; the defaults are the issue's (32 runners, 0.001 s sleeps)."""

    total_rollouts: int = 2048
    batch_size: int = 1024
    max_rounds: int = 6
    sleep_seconds: float = 0.001
    runners: int = 32


def _random_text(rng: random.Random, low: int, high: int) -> str:
    # base64 of random bytes is ~50x faster than random.choices per character, which keeps the
    # generator from competing with the stores for the machine's two cores.
    n = rng.randint(low, high)
    return base64.b64encode(rng.randbytes(n)).decode()[:n]


def random_dict(
    rng: random.Random,
    depth: tuple[int, int] = (1, 3),
    breadth: tuple[int, int] = (2, 6),
    key_length: tuple[int, int] = (3, 20),
    value_length: tuple[int, int] = (5, 300),
) -> dict[str, Any]:
    """A nested dict: `depth` levels, `breadth` keys per level, random string keys and values."""
    levels = rng.randint(*depth)

    def level(remaining: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(rng.randint(*breadth)):
            key = _random_text(rng, *key_length)
            if remaining > 1:
                out[key] = level(remaining - 1)
            else:
                out[key] = _random_text(rng, *value_length)
        return out

    return level(levels)


def flatten_dict(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys, as OpenTelemetry attributes must be flat."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(flatten_dict(value, name))
        else:
            flat[name] = value
    return flat


def generate_attributes(rng: random.Random) -> dict[str, Any]:
    """The attributes of one benchmark span (about 28 keys, about 5 KB on average)."""
    return flatten_dict(random_dict(rng))


def rollout_plan(rng: random.Random, max_rounds: int) -> tuple[int, int, list[bool]]:
    """(rounds, the round whose span carries the task, whether each round emits a reward)."""
    rounds = rng.randint(1, max_rounds)
    selected = rng.randint(0, rounds - 1)
    rewards = [rng.random() < 0.5 for _ in range(rounds)]
    return rounds, selected, rewards
