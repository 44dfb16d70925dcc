"""Offline training data: captured production episodes and the feedback given on them.

A production episode is a rollout (mode production, id `ep-<episode_id>`) whose spans are the
gateway's LLM-call spans, with the exact tokens and the logprobs of the policy that answered,
like a training rollout's. Its reward arrives later as feedback, one value per (episode,
source); `combine_feedback` makes one reward of them. `episode_batch` turns the episodes that
have feedback into transitions: the reward goes on the last call (as adapter.py puts a final
reward), the "equal" credit strategy gives every call the episode's reward as its return, and
the advantage is that return minus the batch's mean reward: production has no groups of the
same task, so the batch is the baseline.

The off-policy correction. The episodes were sampled by the policy that was serving (the
behaviour policy), not by the one being trained. The PPO-clip loss (algo/losses.py) already
weighs each token by the ratio of its current probability to the recorded behaviour one, and
clips that ratio: truncated importance weighting. That corrects the gradient only while the
current policy is close to the behaviour one; far from it, most tokens' ratios fall outside the
clip range, where they give no gradient, and the few that remain are weighted by high-variance
ratios. `LoRATrainer.behaviour_gap` measures the distance (mean per-token KL and the fraction of
tokens outside the clip range) and `choose_method` picks:
- importance: the policy-gradient step on the batch's advantages, while the KL is at most
  `max_behaviour_kl`;
- filtered: beyond it, reward-filtered fine-tuning, the safe fallback: keep the good episodes
  and maximise their likelihood (`LoRATrainer.step(..., objective="likelihood")`). It needs no
  ratio, so it cannot be misweighted; it learns only from what went well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from lightning_core.algo.advantages import EPS
from lightning_core.algo.credit import assign_credit
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.data.analytics import RolloutFacts
from lightning_core.data.collect import tool_counts
from lightning_core.errors import InvalidInput
from lightning_core.types import (
    EPISODE_ROLLOUT_PREFIX,
    Feedback,
    Rollout,
    RolloutMode,
    Span,
    Transition,
    finite_mean,
    in_reward_range,
)
from lightning_core.types import max_abs_reward as environment_max_abs_reward

Method = Literal["importance", "filtered"]
Combine = Literal["mean", "min", "max", "sum", "latest", "weighted"]
# The metric of LoRATrainer.behaviour_gap that choose_method compares with max_behaviour_kl.
BEHAVIOUR_KL = "offline/behaviour_kl"


class OfflineConfig(BaseModel):
    """How captured production episodes and their feedback are trained on."""

    method: Literal["auto", "importance", "filtered"] = Field(
        "auto",
        description="importance: policy gradient, weighted by the ratio to the recorded "
        "logprobs; filtered: likelihood of the good episodes only; auto: importance while the "
        "policy is within max_behaviour_kl of the one that served the episodes, else filtered.",
    )
    max_behaviour_kl: float = Field(
        0.05,
        ge=0,
        description="auto: the mean per-token KL (behaviour to current policy) above which "
        "importance weighting is no longer trusted. At 0.05 a typical token's ratio is still "
        "within PPO's clip range (|log ratio| ~ sqrt(2 * 0.05) = 0.3).",
    )
    min_reward: float | None = Field(
        None,
        description="filtered: keep episodes whose reward is at least this; None: those above "
        "the batch's mean reward.",
    )
    combine: Combine = Field(
        "mean",
        description="One reward from an episode's feedback sources: mean, min, max, sum, "
        "latest (the signal with the latest time) or weighted (mean weighted per source).",
    )
    weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="weighted: the weight of each feedback source; an unlisted source weighs 0, "
        "and an episode whose sources all weigh 0 has no reward (it is left out).",
    )
    success_threshold: float = Field(
        1.0,
        description="An episode succeeded (analytics' success rate) when its reward is at "
        "least this.",
    )
    frozen_cache_mb: int = Field(
        1024,
        ge=0,
        description="Memory (MiB, per training process) for the output of the base model's "
        "layers below the adapter (lora.top_layers) on the batch's rows: the next iteration "
        "over the same episodes starts its forward passes above them (algo/frozen.py). About "
        "hidden size x 4 bytes a token (2.3 KiB on SmolLM2-135M); 0 turns it off.",
    )


class OfflineBatch(BaseModel):
    """Training data of a batch of production episodes. A pydantic model, so that a run saves
    it in its folder and a resumed run trains on exactly the same data."""

    transitions: list[Transition] = Field(default_factory=list)
    facts: dict[str, RolloutFacts] = Field(default_factory=dict)
    # One row per episode trained on, JSON-ready: episode_id, rollout_id, reward, advantage,
    # sources, calls, prompt_tokens, response_tokens, tokens, policy_version, through_seq.
    episodes: list[dict[str, Any]] = Field(default_factory=list)
    # Episodes with feedback but no LLM call (nothing to train on): how many, and which.
    skipped: int = 0
    skipped_ids: list[str] = Field(default_factory=list)
    # Episodes whose feedback counts for nothing (weighted: only sources without weight).
    unrewarded_ids: list[str] = Field(default_factory=list)
    # Episodes with feedback whose rollout was not passed.
    missing_ids: list[str] = Field(default_factory=list)
    unusable_ids: list[str] = Field(
        default_factory=list,
        description="Episodes left out for their feedback: a value outside the reward range "
        "(stored before the range was checked) or a combined reward that overflows.",
    )
    # The feedback rows that counted for the episodes trained on (analytics exports them).
    feedback: list[Feedback] = Field(default_factory=list)

    def feedback_rows(self) -> list[dict[str, Any]]:
        """Its feedback rows, each with the policy version of its episode (analytics'
        FEEDBACK_COLUMNS)."""
        versions = {e["episode_id"]: e["policy_version"] for e in self.episodes}
        return [
            {
                **f.model_dump(exclude={"comment", "metadata"}),
                "policy_version": versions.get(f.episode_id),
            }
            for f in self.feedback
        ]

    @property
    def mean_reward(self) -> float:
        """The baseline of the advantages; 0 for an empty batch."""
        rewards = [e["reward"] for e in self.episodes]
        return finite_mean(rewards) if rewards else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "offline/episodes": float(len(self.episodes)),
            "offline/skipped_episodes": float(self.skipped),
            "offline/unusable_episodes": float(len(self.unusable_ids)),
            "offline/reward_mean": self.mean_reward,
            "offline/transitions": float(len(self.transitions)),
        }


# ---------------------------------------------------------------------------- rewards


def _newest_per_source(rows: Sequence[Feedback]) -> list[Feedback]:
    # The store answers with the newest row per (episode, source) already; a caller that passes
    # the history gets the same answer, never a source counted twice.
    newest: dict[str, Feedback] = {}
    for row in rows:
        if row.source not in newest or row.seq > newest[row.source].seq:
            newest[row.source] = row
    return [newest[s] for s in sorted(newest)]


def _counted(
    rows: Sequence[Feedback], combine: Combine, weights: Mapping[str, float]
) -> list[Feedback]:
    # Weighted: a source without weight does not count, so neither does its row.
    rows = _newest_per_source(rows)
    if combine == "weighted":
        rows = [r for r in rows if weights.get(r.source, 0.0) > 0]
    return rows


def combine_feedback(
    rows: Sequence[Feedback], combine: Combine = "mean", weights: Mapping[str, float] | None = None
) -> float:
    """One episode's reward from its feedback rows (the newest per source counts)."""
    weights = weights or {}
    if len({r.episode_id for r in rows}) > 1:
        raise InvalidInput("combine_feedback takes the feedback of one episode at a time")
    counted = _counted(rows, combine, weights)
    if not counted:
        if rows and combine == "weighted":
            raise InvalidInput(
                f"no feedback source of episode {rows[0].episode_id!r} has a weight "
                f"(sources {sorted({r.source for r in rows})}, weights {dict(weights)}); "
                "add its sources to weights"
            )
        raise InvalidInput("an episode without feedback has no reward to combine")
    values = [r.value for r in counted]
    if combine == "mean":
        return finite_mean(values)  # finite for any finite values (their sum may overflow)
    if combine == "min":
        return min(values)
    if combine == "max":
        return max(values)
    if combine == "sum":
        return float(sum(values))
    if combine == "latest":
        # The signal that happened last; the later recorded one among equal times.
        return max(counted, key=lambda r: (r.time, r.seq)).value
    if combine == "weighted":
        total = sum(weights[r.source] for r in counted)
        return sum(weights[r.source] * r.value for r in counted) / total
    raise InvalidInput(f"unknown combine {combine!r}; use mean, min, max, sum, latest or weighted")


# ---------------------------------------------------------------------------- the batch


def _episode_id(rollout: Rollout) -> str:
    if rollout.mode is not RolloutMode.production:
        raise InvalidInput(
            f"rollout {rollout.rollout_id!r} is a {rollout.mode} rollout, not a production "
            "episode; offline training takes episodes captured by the gateway"
        )
    if isinstance(rollout.input, dict) and isinstance(rollout.input.get("episode_id"), str):
        return rollout.input["episode_id"]
    return rollout.rollout_id.removeprefix(EPISODE_ROLLOUT_PREFIX)


def episode_batch(
    rollouts: Sequence[Rollout],
    spans: Sequence[Span],
    feedback: Sequence[Feedback],
    config: OfflineConfig | None = None,
    adapter: AdapterConfig | None = None,
    max_abs_reward: float | None = None,
) -> OfflineBatch:
    """Transitions with advantages, facts and rows of the production episodes that have
    feedback, given their rollouts and spans (the rollouts without feedback are left out, and
    so are those with feedback beyond `max_abs_reward`, None: the environment's, as the
    store's, or whose combined reward overflows: unusable_ids)."""
    config = config or OfflineConfig()
    bound = environment_max_abs_reward() if max_abs_reward is None else max_abs_reward
    by_episode: dict[str, list[Feedback]] = {}
    for row in feedback:
        by_episode.setdefault(row.episode_id, []).append(row)
    by_rollout: dict[str, list[Span]] = {}
    for span in spans:
        by_rollout.setdefault(span.rollout_id, []).append(span)

    batch = OfflineBatch()
    seen: set[str] = set()  # a rollout passed twice is one episode
    per_episode: list[tuple[float, list[Transition], dict[str, Any]]] = []
    counted_of: dict[str, list[Feedback]] = {}
    for rollout in rollouts:
        episode_id = _episode_id(rollout)
        rows = by_episode.get(episode_id)
        first = episode_id not in seen
        seen.add(episode_id)
        if not rows or not first:
            continue
        counted = _counted(rows, config.combine, config.weights)
        if not counted:
            batch.unrewarded_ids.append(episode_id)
            continue
        reward = combine_feedback(counted, config.combine, config.weights)
        if not (math.isfinite(reward) and all(in_reward_range(r.value, bound) for r in counted)):
            batch.unusable_ids.append(episode_id)
            continue
        mine = by_rollout.get(rollout.rollout_id, [])
        transitions = spans_to_transitions(mine, None, adapter)
        if not transitions:
            batch.skipped += 1
            batch.skipped_ids.append(episode_id)
            continue
        # The feedback is the episode's reward; rewards the spans carry (reward spans, AIR)
        # are a training rollout's and are not added to it.
        for t in transitions:
            t.reward = 0.0
        transitions[-1].reward = reward
        tools, errors = tool_counts(mine)
        policy_version = transitions[-1].policy_version or rollout.policy_version
        batch.facts[rollout.rollout_id] = RolloutFacts(
            episode_return=reward,
            success=reward >= config.success_threshold,
            tool_calls=tools,
            tool_errors=errors,
            attempt_id=transitions[0].attempt_id,
            policy_version=policy_version,
        )
        prompt_tokens = sum(len(t.prompt_token_ids) for t in transitions)
        response_tokens = sum(len(t.response_token_ids) for t in transitions)
        row = {
            "episode_id": episode_id,
            "rollout_id": rollout.rollout_id,
            "reward": reward,
            "sources": [r.source for r in counted],
            "calls": len(transitions),
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
            "tokens": prompt_tokens + response_tokens,
            "policy_version": policy_version,
            "through_seq": max(r.seq for r in counted),
        }
        per_episode.append((reward, transitions, row))
        counted_of[episode_id] = counted
    batch.missing_ids = sorted(set(by_episode) - seen)

    baseline = finite_mean([r for r, _, _ in per_episode]) if per_episode else 0.0
    for reward, transitions, row in per_episode:
        returns = assign_credit([t.reward for t in transitions], "equal")
        for t, credited in zip(transitions, returns, strict=True):
            t.advantage = credited - baseline
        row["advantage"] = reward - baseline
        batch.transitions.extend(transitions)
        batch.episodes.append(row)
        batch.feedback.extend(counted_of[row["episode_id"]])
    return batch


# ---------------------------------------------------------------------------- the method


def choose_method(gap: Mapping[str, float], config: OfflineConfig) -> Method:
    """importance or filtered: the configured method, or for auto, by the behaviour gap
    (`LoRATrainer.behaviour_gap` of the batch, measured before training on it)."""
    if config.method != "auto":
        return config.method
    if BEHAVIOUR_KL not in gap:
        raise InvalidInput(f"choose_method needs {BEHAVIOUR_KL!r}: pass LoRATrainer.behaviour_gap")
    return "filtered" if gap[BEHAVIOUR_KL] > config.max_behaviour_kl else "importance"


def filtered(batch: OfflineBatch | Sequence[Transition], config: OfflineConfig) -> list[Transition]:
    """The transitions of the good episodes, each with advantage 1.0, for the likelihood step:
    episodes whose reward is at least min_reward, or above the batch's mean reward when it is
    None (so a batch whose rewards are all equal keeps nothing). The batch is not changed."""
    transitions = batch.transitions if isinstance(batch, OfflineBatch) else list(batch)
    # An episode's reward is the sum of its transitions' (episode_batch puts it on the last).
    rewards: dict[str, float] = {}
    for t in transitions:
        rewards[t.rollout_id] = rewards.get(t.rollout_id, 0.0) + t.reward
    if not rewards:
        return []
    if config.min_reward is not None:
        kept = {e for e, r in rewards.items() if r >= config.min_reward}
    else:
        average = finite_mean(list(rewards.values()))
        # EPS: equal rewards whose float mean lands a hair below them are not "above" it.
        kept = {e for e, r in rewards.items() if r - average > EPS}
    return [t.model_copy(update={"advantage": 1.0}) for t in transitions if t.rollout_id in kept]
