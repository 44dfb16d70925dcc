"""The promotion rule as pure functions: no MLflow, no registry, only scores and versions."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from lightning_core.errors import InvalidInput
from lightning_rl.registry.names import (
    TAG_CHAMPION_SCORE,
    TAG_CHAMPION_VERSION,
    TAG_DECISION,
    TAG_REASON,
    TAG_SCORE,
)
from lightning_rl.registry.promotion import (
    PromotionDecision,
    decide_promotion,
    decide_version,
    decision_tags,
    recorded_decision,
)


@pytest.mark.parametrize(
    ("challenger", "champion", "promote_it"),
    [
        (0.5, None, True),  # no champion, above the threshold
        (0.3, None, True),  # no champion, exactly at the threshold
        (0.2, None, False),  # no champion, below the threshold
        (0.75, 0.70, True),  # gain above the margin
        (0.72, 0.70, True),  # gain of exactly the margin, despite 0.72 - 0.70 < 0.02 in floats
        (0.71, 0.70, False),  # gain below the margin
        (0.70, 0.70, False),  # equal: no gain is less than any margin
        (0.60, 0.70, False),  # worse
        (0.20, 0.10, True),  # with a champion the threshold no longer counts, only the gain
    ],
)
def test_decide_promotion(challenger, champion, promote_it):
    decision = decide_promotion(challenger, champion, margin=0.02, threshold=0.3)
    assert decision.promote is promote_it
    assert decision.challenger_score == challenger
    assert decision.champion_score == champion
    assert str(challenger) in decision.reason
    # The gate alone knows no versions; decide_version adds them.
    assert decision.challenger_version is None and decision.champion_version is None


def test_the_reason_says_which_side_of_the_gate():
    assert decide_promotion(0.5, None, 0.02, 0.3).reason == (
        "no champion yet; score 0.5 reaches threshold 0.3"
    )
    assert "is below threshold 0.3" in decide_promotion(0.2, None, 0.02, 0.3).reason
    assert decide_promotion(0.75, 0.70, 0.02, 0.3).reason == (
        "score 0.75 vs champion 0.7: gain +0.05 is at least the margin 0.02"
    )
    assert "gain +0 is less than the margin 0.02" in decide_promotion(0.7, 0.7, 0.02, 0).reason


def test_a_zero_margin_promotes_an_equal_score():
    assert decide_promotion(0.7, 0.7, margin=0.0, threshold=0.0).promote


def test_a_negative_threshold_promotes_any_first_version():
    assert decide_promotion(0.0, None, margin=0.02, threshold=-1.0).promote


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decide_promotion_refuses_a_score_that_is_no_number(bad):
    with pytest.raises(InvalidInput, match="challenger's score"):
        decide_promotion(bad, 0.5, margin=0.02, threshold=0.0)
    with pytest.raises(InvalidInput, match="champion's score"):
        decide_promotion(0.5, bad, margin=0.02, threshold=0.0)


def test_decide_version_names_both_versions():
    decision = decide_version("3", 0.8, "2", 0.7, margin=0.02, threshold=0.0)
    assert decision.promote
    assert (decision.challenger_version, decision.champion_version) == ("3", "2")
    first = decide_version("1", 0.1, None, None, margin=0.02, threshold=0.3)
    assert not first.promote and first.champion_version is None
    assert first.reason == decide_promotion(0.1, None, 0.02, 0.3).reason


def test_a_version_does_not_compete_with_itself():
    decision = decide_version("2", 0.9, "2", 0.9, margin=0.0, threshold=0.0)
    assert not decision.promote and decision.reason == "already the champion"
    assert decision.champion_score == 0.9 and decision.champion_version == "2"


def test_a_champion_without_a_score_is_kept():
    # Even a perfect score does not replace a champion it cannot be compared with.
    decision = decide_version("2", 1.0, "1", None, margin=0.0, threshold=0.0)
    assert not decision.promote
    assert decision.reason.startswith(f"champion v1 has no numeric {TAG_SCORE} tag")
    assert decision.champion_score is None and decision.champion_version == "1"


def test_decide_version_refuses_a_score_that_is_no_number():
    with pytest.raises(InvalidInput):
        decide_version("2", math.nan, "1", 0.5, margin=0.02, threshold=0.0)


@pytest.mark.parametrize(
    "decision",
    [
        decide_version("2", 0.8, "1", 0.7, margin=0.02, threshold=0.0),
        decide_version("2", 0.7, "1", 0.7, margin=0.02, threshold=0.0),
        decide_version("1", 0.5, None, None, margin=0.02, threshold=0.3),
        decide_version("2", 0.8, "1", None, margin=0.02, threshold=0.0),
        # Scores whose shortest repr is long still come back bit for bit.
        decide_version("5", 0.1 + 0.2, "4", 1 / 3, margin=0.0, threshold=0.0),
    ],
)
def test_the_recorded_tags_give_the_decision_back(decision: PromotionDecision):
    tags = {TAG_SCORE: repr(decision.challenger_score), **decision_tags(decision)}
    assert recorded_decision(str(decision.challenger_version), tags) == decision


def test_decision_tags_are_what_the_registry_shows():
    promoted = decide_version("2", 0.8, "1", 0.7, margin=0.02, threshold=0.0)
    assert decision_tags(promoted) == {
        TAG_DECISION: "promoted",
        TAG_REASON: promoted.reason,
        TAG_CHAMPION_SCORE: "0.7",
        TAG_CHAMPION_VERSION: "1",
    }
    first = decide_version("1", 0.1, None, None, margin=0.02, threshold=0.3)
    assert decision_tags(first) == {
        TAG_DECISION: "rejected",
        TAG_REASON: first.reason,
        TAG_CHAMPION_SCORE: "none",
        TAG_CHAMPION_VERSION: "none",
    }


@pytest.mark.parametrize(
    "tags",
    [
        {TAG_SCORE: "0.5"},  # registered, never decided
        {TAG_SCORE: "0.5", TAG_DECISION: "promoted"},  # the other tags missing
        {TAG_SCORE: "n/a", **decision_tags(decide_version("1", 0.5, None, None, 0, 0))},
        {TAG_SCORE: "0.5", **decision_tags(decide_version("1", 0.5, None, None, 0, 0))}
        | {TAG_DECISION: "maybe"},
    ],
)
def test_no_recorded_decision_without_a_full_record(tags):
    assert recorded_decision("1", tags) is None


def test_the_rule_loads_neither_mlflow_nor_prefect():
    code = (
        "import sys, lightning_rl.registry.promotion, lightning_rl.registry.config\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlflow', 'prefect'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
