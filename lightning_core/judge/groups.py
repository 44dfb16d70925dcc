"""An iteration's rollouts judged group by group: the judge's scores, the final rewards they
make with the agents' own (JudgeConfig.combine), and a span per judged rollout.

A group is the G rollouts of one task (GRPO's group): in rank mode the judge sees them side
by side, in verdict mode one by one. Only rollouts that ran to the end and made a recorded
LLM call are judged; the others have nothing to train on. The judge's span goes to the
rollout's latest attempt, in the trace of its calls, and is never a transition: it holds the
score and what the judge was (model, mode, whether the cache answered), for reading traces.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence

from lightning_core import semconv
from lightning_core.data.collect import Judged
from lightning_core.judge.client import Judge, Judgement
from lightning_core.judge.transcript import render, task_text
from lightning_core.types import Rollout, RolloutStatus, Span


def judge_span_id(attempt_id: str) -> str:
    """The judge span's id, the same each time an attempt is judged: a collect task retried
    after it stored the spans stores them again, and the store reads an attempt's spans back
    once per (trace, span id)."""
    return hashlib.sha256(f"{semconv.JUDGE_SPAN}:{attempt_id}".encode()).hexdigest()[:16]


def judge_span(rollout: Rollout, spans: Sequence[Span], judge: Judge, verdict: Judgement) -> Span:
    first = min(spans, key=lambda s: s.start_time)
    now = time.time()
    attributes: dict[str, object] = {
        semconv.JUDGE_MODEL: judge.model,
        semconv.JUDGE_MODE: judge.config.mode,
        semconv.JUDGE_CACHED: verdict.cached,
    }
    if verdict.score is not None:
        attributes[semconv.JUDGE_SCORE] = verdict.score
    if verdict.error is not None:
        attributes[semconv.JUDGE_ERROR] = verdict.error
    if verdict.call_id is not None:
        attributes["gen_ai.response.id"] = verdict.call_id
    return Span(
        rollout_id=rollout.rollout_id,
        attempt_id=first.attempt_id,
        trace_id=first.trace_id,
        span_id=judge_span_id(first.attempt_id),
        name=semconv.JUDGE_SPAN,
        start_time=now,
        end_time=now,
        attributes=attributes,
    )


async def judge_rollouts(
    judge: Judge, task_fields: Sequence[str], rollouts: Sequence[Rollout], spans: Sequence[Span]
) -> tuple[Judged, list[Span]]:
    """The judge's say on `rollouts` (given the spans of their latest attempts) and its spans."""
    by_rollout: dict[str, list[Span]] = {}
    for span in spans:
        by_rollout.setdefault(span.rollout_id, []).append(span)
    groups: dict[str, list[tuple[Rollout, str]]] = {}
    for rollout in rollouts:
        mine = by_rollout.get(rollout.rollout_id)
        if rollout.status is not RolloutStatus.succeeded or not mine:
            continue
        transcript = render(mine, judge.config.max_transcript_chars)
        if transcript is not None:
            groups.setdefault(rollout.group_id or rollout.rollout_id, []).append(
                (rollout, transcript)
            )
    verdicts = await asyncio.gather(
        *(
            judge.judge(task_text(members[0][0].input, task_fields), [t for _, t in members])
            for members in groups.values()
        )
    )
    judged, recorded = Judged(), []
    for members, scores in zip(groups.values(), verdicts, strict=True):
        for (rollout, _), verdict in zip(members, scores, strict=True):
            rid = rollout.rollout_id
            recorded.append(judge_span(rollout, by_rollout[rid], judge, verdict))
            if verdict.score is None:
                judged.failed.add(rid)
                continue
            judged.scores[rid] = verdict.score
            judged.finals[rid] = judge.config.combine(rollout.episode_return or 0.0, verdict.score)
    return judged, recorded
