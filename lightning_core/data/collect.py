"""Finished rollouts to training data: transitions with credit-assigned advantages.

For each rollout of an iteration, the spans of its latest attempt become transitions (adapter.py),
LightningRL credit assignment spreads each episode's rewards over its actions (credit.py), and
the group estimator turns those returns into advantages (advantages.py). Alongside come the
per-rollout facts that analytics need: the episode return, success, tool calls and errors.

A rollout that failed (its agent raised on every attempt) has no transitions; it still counts as
an episode with return 0, so success rates are not flattered by dropping failures. So does a
rollout whose rewards are outside the reward range (types.check_reward: stored before the range was
checked, or by a server with a wider one): trained on, one reward of 1e200 would swamp its whole
group; it is counted as refused instead, and the iteration goes on.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from lightning_core import semconv
from lightning_core.algo.advantages import Episode, Estimator, compute_advantages
from lightning_core.algo.credit import CreditStrategy, assign_credit
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.data.analytics import RolloutFacts
from lightning_core.data.provenance import ProvenanceRecord, episode_disagreement
from lightning_core.types import (
    Rollout,
    RolloutStatus,
    Span,
    Transition,
    in_reward_range,
)
from lightning_core.types import max_abs_reward as environment_max_abs_reward


class CreditConfig(BaseModel):
    """How episode returns become per-action advantages."""

    strategy: CreditStrategy = Field(
        "equal", description="Episode return to actions: equal (the paper's), discounted, last."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount for the discounted strategy.")
    estimator: Estimator = Field(
        "grpo", description="Advantage estimator over each task's group: grpo, rloo, reinforce++."
    )
    normalize_std: bool = Field(
        False, description="Divide GRPO advantages by the group's std (Dr. GRPO leaves it out)."
    )
    success_threshold: float | None = Field(
        None,
        description="A rollout succeeded when its final reward is at least this; None: the "
        "agent profile's (1.0 where there is none).",
    )


@dataclass
class Judged:
    """A judge's say on an iteration's rollouts (lightning_core/judge): final rewards that
    replace the agents' own, the judge's scores, and the rollouts it could not score."""

    finals: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)


log = logging.getLogger(__name__)

# Why a rollout gave no transitions although it ran: the judge could not score it.
JUDGE_FAILED = "judge_failed"
# Or one of its calls is longer (prompt and response tokens) than the trainer takes
# (TrainerConfig.max_call_tokens): refused whole, as for provenance, since its other calls'
# advantages come from a return that call helped earn.
CALL_TOO_LONG = "call_too_long"
# Or a reward of it is not a number within the reward range (or its rewards' sum overflows).
REWARD_OUT_OF_RANGE = "reward_out_of_range"


@dataclass
class Collected:
    """An iteration's training data."""

    transitions: list[Transition] = field(default_factory=list)
    facts: dict[str, RolloutFacts] = field(default_factory=dict)
    # Rollouts refused for their provenance, by reason (data/provenance.py), because the
    # judge could not score them (JUDGE_FAILED), for a call too long (CALL_TOO_LONG), or for
    # their rewards (REWARD_OUT_OF_RANGE).
    refused: Counter[str] = field(default_factory=Counter)

    @property
    def trainable(self) -> list[Transition]:
        """Transitions that carry a learning signal (advantage not 0)."""
        return [t for t in self.transitions if t.advantage]


def tool_counts(spans: Sequence[Span]) -> tuple[int, int]:
    tools = [s for s in spans if s.name == semconv.TOOL_SPAN]
    errors = sum(1 for s in tools if s.attributes.get(semconv.TOOL_SUCCESS) is False)
    return len(tools), errors


def _rewards_in_range(
    spans: Sequence[Span], rollout: Rollout, final: float | None, bound: float
) -> bool:
    """Whether every reward the rollout carries is within the reward range: its reward spans',
    its episode return and the judge's final (what spans_to_transitions adds up)."""
    values = [
        s.attributes.get(semconv.REWARD_VALUE, 0.0) for s in spans if s.name == semconv.REWARD_SPAN
    ]
    values += [v for v in (rollout.episode_return, final) if v is not None]
    return all(in_reward_range(v, bound) for v in values)


def collect(
    rollouts: Sequence[Rollout],
    spans: Sequence[Span],
    adapter: AdapterConfig | None = None,
    credit: CreditConfig | None = None,
    provenance: ProvenanceRecord | None = None,
    judged: Judged | None = None,
    max_call_tokens: int | None = None,
    max_abs_reward: float | None = None,
) -> Collected:
    """Transitions (with advantages) and facts of finished rollouts, given the spans of their
    latest attempts. With `provenance`, a rollout any of whose calls disagrees with it (another
    adapter or template than the run served) gives no transitions: it is trained on by no
    update and counted as refused, its facts naming why. With `judged`, a rollout's final
    reward is the judge's combined one, and one the judge failed on is not trained on. With
    `max_call_tokens`, a rollout with a call longer than that (prompt and response) gives no
    transitions either (CALL_TOO_LONG): the trainer never sees it. Nor does a rollout with a
    reward beyond `max_abs_reward` (None: the environment's, as the store's), counted as
    refused (REWARD_OUT_OF_RANGE) with a return of 0 in its facts."""
    credit = credit or CreditConfig()
    bound = environment_max_abs_reward() if max_abs_reward is None else max_abs_reward
    by_rollout: dict[str, list[Span]] = {}
    for span in spans:
        by_rollout.setdefault(span.rollout_id, []).append(span)

    out = Collected()
    episodes: list[Episode] = []
    per_episode: list[list[Transition]] = []
    threshold = 1.0 if credit.success_threshold is None else credit.success_threshold
    for rollout in rollouts:
        mine = by_rollout.get(rollout.rollout_id, [])
        succeeded = rollout.status is RolloutStatus.succeeded
        rid = rollout.rollout_id
        rejudged = judged.finals.get(rid) if judged is not None else None
        transitions = spans_to_transitions(mine, rollout, adapter, rejudged) if succeeded else []
        refused = episode_disagreement(transitions, provenance) if provenance else None
        if refused is not None:
            out.refused[refused] += 1
            transitions = []
        elif max_call_tokens is not None and any(
            len(t.prompt_token_ids) + len(t.response_token_ids) > max_call_tokens
            for t in transitions
        ):
            out.refused[CALL_TOO_LONG] += 1
            transitions = []
        elif transitions and judged is not None and rid in judged.failed:
            out.refused[JUDGE_FAILED] += 1
            transitions = []
        out_of_range = bool(transitions) and not (
            _rewards_in_range(mine, rollout, rejudged, bound)
            and all(math.isfinite(t.reward) for t in transitions)
        )
        if out_of_range:
            out.refused[REWARD_OUT_OF_RANGE] += 1
            transitions = []
        calls, errors = tool_counts(mine)
        final = rollout.episode_return if succeeded and rollout.episode_return is not None else 0.0
        if succeeded and rejudged is not None:
            final = rejudged
        if out_of_range or not in_reward_range(final, bound):
            final = 0.0  # as for a failed rollout: the analytics' means stay finite
        out.facts[rollout.rollout_id] = RolloutFacts(
            group_id=rollout.group_id,
            task_id=rollout.task_id,
            episode_return=final,
            success=final >= threshold,
            tool_calls=calls,
            tool_errors=errors,
            policy_version=rollout.policy_version,
            provenance_refused=refused,
            judge_score=judged.scores.get(rid) if judged is not None else None,
        )
        if not transitions:
            continue
        rewards = [t.reward for t in transitions]
        episode = Episode(
            group=rollout.group_id or rollout.rollout_id,
            episode_return=float(sum(rewards)),
            action_returns=assign_credit(rewards, credit.strategy, credit.gamma),
        )
        if not all(map(math.isfinite, (episode.episode_return, *episode.action_returns))):
            # Rewards in range whose sum overflows (a range near its limit): as unusable.
            out.refused[REWARD_OUT_OF_RANGE] += 1
            out.facts[rid].episode_return, out.facts[rid].success = 0.0, False
            continue
        episodes.append(episode)
        per_episode.append(transitions)

    if out.refused[REWARD_OUT_OF_RANGE]:
        log.warning(
            "%d rollouts not trained on: a reward outside +-%g (LIGHTNING_MAX_ABS_REWARD)",
            out.refused[REWARD_OUT_OF_RANGE],
            bound,
        )
    advantages = compute_advantages(episodes, credit.estimator, credit.normalize_std)
    for transitions, values in zip(per_episode, advantages, strict=True):
        for transition, value in zip(transitions, values, strict=True):
            transition.advantage = value
        out.transitions.extend(transitions)
    return out
