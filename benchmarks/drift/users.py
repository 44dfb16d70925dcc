"""The simulated users of the drift demonstration: each asks the calc agent one question through
two production servers (the loop's and the frozen week-0 champion's, so that both answer the
same question), and sends the loop's server feedback that is sometimes missing, sometimes wrong,
and late.

The users know the right answers (the tasks carry them): an episode's *outcome* is the truth,
what the tables report; its *feedback* is what a user says, what retraining and the live gate
see.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from benchmarks.drift.settings import DriftSettings
from lightning_core.errors import LightningError
from lightning_core.feedback import episode_headers, send_feedback
from lightning_rl.agents.calc.agent import MAX_TOKENS, solve
from lightning_rl.agents.calc.reward import answer_reward


@dataclass(frozen=True)
class Server:
    """A production server the users call."""

    url: str
    key: str


@dataclass
class Week:
    """What one week's users did: outcomes per episode on both servers, and their feedback."""

    loop: dict[str, bool] = field(default_factory=dict)
    frozen: dict[str, bool] = field(default_factory=dict)
    errors: int = 0
    sent: int = 0
    missing: int = 0
    flipped: int = 0
    late: list[tuple[str, float]] = field(default_factory=list)


async def _answer(server: Server, task: dict[str, Any], episode: str, temperature: float) -> bool:
    llm = SimpleNamespace(
        base_url=f"{server.url}/v1",
        model="champion",
        api_key=server.key,
        sampling={"temperature": temperature, "max_tokens": MAX_TOKENS},
    )
    reply = await solve(task["question"], llm, episode_headers(episode))
    return answer_reward(reply, float(task["answer"])) >= 1.0


async def _outcome(
    server: Server, task: dict[str, Any], episode: str, temperature: float
) -> bool | None:
    """Whether the agent answered right; None when it failed (said on stdout)."""
    try:
        return await _answer(server, task, episode, temperature)
    except (LightningError, OSError, ValueError, RuntimeError) as exc:
        print(f"episode {episode} on {server.url}: {type(exc).__name__}: {exc}", flush=True)
        return None


def _send(server: Server, episode: str, value: float) -> None:
    send_feedback(server.url, episode, value, source="user", api_key=server.key)


async def run_week(
    week: int,
    tasks: list[dict[str, Any]],
    loop: Server,
    frozen: Server,
    settings: DriftSettings,
) -> Week:
    """The week's episodes, `settings.concurrency` users at a time; returns when every episode
    is answered and every on-time feedback sent (the late ones are in `Week.late`)."""
    rng = random.Random(f"drift-feedback-{settings.seed}-{week}")
    # Drawn up front, in task order: the same settings give the same feedback whatever order
    # the concurrent episodes finish in.
    fates = [
        (
            rng.random() < settings.missing_rate,
            rng.random() < settings.flip_rate,
            rng.random() < settings.late_rate,
            rng.uniform(0, settings.max_delay_s),
        )
        for _ in tasks
    ]
    result = Week()
    users = asyncio.Semaphore(settings.concurrency)
    pending: list[asyncio.Task[None]] = []

    async def feedback_later(episode: str, value: float, delay: float) -> None:
        await asyncio.sleep(delay)
        await asyncio.to_thread(_send, loop, episode, value)

    async def user(i: int, task: dict[str, Any]) -> None:
        episode = f"w{week}-{i}"
        async with users:
            right = await _outcome(loop, task, episode, settings.temperature)
            frozen_right = await _outcome(frozen, task, episode, settings.temperature)
        result.errors += (right is None) + (frozen_right is None)
        # An agent that failed answered nothing: wrong, as its user sees it.
        result.loop[episode], result.frozen[episode] = bool(right), bool(frozen_right)
        if right is None:
            return  # the loop's server may not know the episode: nothing to give feedback on
        missing, flipped, late, delay = fates[i]
        if missing:
            result.missing += 1
            return
        value = float(right != flipped)
        result.flipped += flipped
        if late:
            result.late.append((episode, value))
            return
        result.sent += 1
        pending.append(asyncio.create_task(feedback_later(episode, value, delay)))

    await asyncio.gather(*(user(i, t) for i, t in enumerate(tasks)))
    await asyncio.gather(*pending)
    return result


def send_late(server: Server, late: list[tuple[str, float]]) -> None:
    """Last week's late feedback, arriving now."""
    for episode, value in late:
        _send(server, episode, value)
