"""The promotion rule, as pure functions of scores and versions: whether a newly registered
version replaces the champion, and why; and the decision as the version tags that record it.

The champion moves to a new version only when its held-out score beats the champion's by a
margin: a gate, so that noise in a small benchmark cannot swap the served model back and forth.
Only scores on the same benchmark (lightning_core.stats.evaluation.benchmark_id) are compared: a
champion without a score on the new version's benchmark stays, and the reason says how to score
it there. No MLflow here: versions.py reads the registry, asks this module, and writes the answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from lightning_core.errors import InvalidInput
from lightning_rl.registry.names import (
    CANARY,
    NONE,
    PROMOTED,
    REJECTED,
    TAG_BENCHMARK_ID,
    TAG_CHAMPION_SCORE,
    TAG_CHAMPION_VERSION,
    TAG_DECISION,
    TAG_DECISION_BENCHMARK,
    TAG_REASON,
    TAG_SCORE,
    score_tag,
)

# Scores are fractions in floating point (0.72 - 0.70 is 0.0199999...): without slack a gain of
# exactly the margin would be refused.
_SCORE_EPSILON = 1e-9


class PromotionDecision(BaseModel):
    """Whether a version becomes champion, and why."""

    model_config = ConfigDict(frozen=True)

    promote: bool = Field(description="True: the challenger becomes champion.")
    canary: bool = Field(
        False,
        description="True: past the offline gate, the challenger goes to a canary on live "
        "traffic, whose gate decides (promote is then False).",
    )
    reason: str = Field(description="Why, in words, with both scores.")
    challenger_score: float = Field(description="Held-out score of the new version.")
    champion_score: float | None = Field(
        description="Held-out score of the champion at decision time, on the challenger's "
        "benchmark; None when there was no champion, or it had no score there."
    )
    challenger_version: str | None = Field(None, description="Registry version decided on.")
    champion_version: str | None = Field(
        None, description="Champion's version before the decision; None when there was none."
    )
    benchmark_id: str | None = Field(
        None,
        description="The benchmark both scores are on; None: decided before scores had one.",
    )


def decide_promotion(
    challenger_score: float, champion_score: float | None, margin: float, threshold: float
) -> PromotionDecision:
    """The gate: beat the champion by `margin`, or, with no champion, reach `threshold`."""
    for name, score in (("challenger", challenger_score), ("champion", champion_score)):
        if score is not None and not math.isfinite(score):
            raise InvalidInput(f"the {name}'s score is {score}; evaluation must give a number")
    if champion_score is None:
        promote = challenger_score >= threshold - _SCORE_EPSILON
        relation = "reaches" if promote else "is below"
        reason = f"no champion yet; score {challenger_score:.4g} {relation} threshold {threshold:g}"
    else:
        gain = challenger_score - champion_score
        promote = gain >= margin - _SCORE_EPSILON
        relation = "at least" if promote else "less than"
        reason = (
            f"score {challenger_score:.4g} vs champion {champion_score:.4g}: gain {gain:+.4g} is "
            f"{relation} the margin {margin:g}"
        )
    return PromotionDecision(
        promote=promote,
        reason=reason,
        challenger_score=challenger_score,
        champion_score=champion_score,
    )


def benchmark_score(tags: Mapping[str, str], benchmark_id: str) -> float | None:
    """A version's score on benchmark `benchmark_id`, from its tags: the score it was registered
    with if that was measured there, else one recorded since (score_tag); None if it has none.

    A score without a benchmark id (a version registered before ids existed) is on no known
    benchmark: never this one.
    """
    raw = tags.get(TAG_SCORE) if tags.get(TAG_BENCHMARK_ID) == benchmark_id else None
    if raw is None:
        raw = tags.get(score_tag(benchmark_id))
    try:
        score = float(raw) if raw is not None else None
    except ValueError:
        return None
    return score if score is not None and math.isfinite(score) else None


def decide_version(
    challenger_version: str | None,
    challenger_score: float,
    champion_version: str | None,
    champion_score: float | None,
    margin: float,
    threshold: float,
    *,
    benchmark_id: str,
    benchmark_size: int | None = None,
) -> PromotionDecision:
    """The decision on a version scored `challenger_score` on benchmark `benchmark_id` (of
    `benchmark_size` tasks), given the champion as the registry has it.

    The gate (decide_promotion), except that a version never competes with itself, and that a
    champion without a score on this benchmark (scored on another, registered before benchmarks
    had ids, or aliased by hand) is kept: comparing scores of different measures, or replacing
    it blindly, could serve a worse model. `champion_version` None: there is no champion;
    `champion_score`: the champion's score on `benchmark_id` (benchmark_score), None if it has
    none. `challenger_version` None: a version about to be registered. The decision names both
    versions and the benchmark.
    """
    if champion_version is not None and champion_version == challenger_version:
        decision = PromotionDecision(
            promote=False,
            reason="already the champion",
            challenger_score=challenger_score,
            champion_score=champion_score,
        )
    elif champion_version is not None and champion_score is None:
        size = f" --eval-size {benchmark_size}" if benchmark_size else ""
        decision = PromotionDecision(
            promote=False,
            reason=f"champion v{champion_version} has no score on benchmark {benchmark_id}, so "
            f"score {challenger_score:.4g} is not compared and the champion stays; score it "
            f"there with `lightning-rl eval --policy champion{size}` (the same agent and task "
            "source), and the next promotion compares",
            challenger_score=challenger_score,
            champion_score=None,
        )
    else:
        decision = decide_promotion(challenger_score, champion_score, margin, threshold)
    return decision.model_copy(
        update={
            "challenger_version": challenger_version,
            "champion_version": champion_version,
            "benchmark_id": benchmark_id,
        }
    )


def decision_tags(decision: PromotionDecision) -> dict[str, str]:
    """The version tags that record `decision`: the registry alone tells why each version was
    or was not promoted."""
    champion_score = decision.champion_score
    return {
        TAG_DECISION: PROMOTED if decision.promote else CANARY if decision.canary else REJECTED,
        TAG_REASON: decision.reason,
        TAG_CHAMPION_SCORE: NONE if champion_score is None else repr(champion_score),
        TAG_CHAMPION_VERSION: decision.champion_version or NONE,
        TAG_DECISION_BENCHMARK: decision.benchmark_id or NONE,
    }


def recorded_decision(version: str, tags: Mapping[str, str]) -> PromotionDecision | None:
    """The decision recorded on version `version` by its tags (decision_tags, and its score);
    None when it has not been decided (or its tags are not ours)."""
    try:
        decision, reason, score = tags[TAG_DECISION], tags[TAG_REASON], float(tags[TAG_SCORE])
        champion_score = tags[TAG_CHAMPION_SCORE]
        champion_version = tags[TAG_CHAMPION_VERSION]
        # Absent from decisions recorded before scores had a benchmark.
        benchmark = tags.get(TAG_DECISION_BENCHMARK, NONE)
        if decision not in (PROMOTED, REJECTED, CANARY):
            return None
        return PromotionDecision(
            promote=decision == PROMOTED,
            canary=decision == CANARY,
            reason=reason,
            challenger_score=score,
            champion_score=None if champion_score == NONE else float(champion_score),
            challenger_version=version,
            champion_version=None if champion_version == NONE else champion_version,
            benchmark_id=None if benchmark == NONE else benchmark,
        )
    except (KeyError, ValueError):
        return None


def through_canary(decision: PromotionDecision) -> PromotionDecision:
    """`decision` with the live gate second: a version past the offline gate that would
    replace a champion goes to a canary instead; the first champion is promoted at once (there
    is nothing to compare live traffic with)."""
    if not decision.promote or decision.champion_version is None:
        return decision
    return decision.model_copy(
        update={
            "promote": False,
            "canary": True,
            "reason": f"{decision.reason}; canary on live traffic, the live gate decides",
        }
    )
