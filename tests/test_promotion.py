"""The promotion rule as pure functions: no MLflow, no registry, only scores, benchmarks and
versions; and what makes a benchmark (lightning_core.stats.evaluation.benchmark_id)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from lightning_core.errors import InvalidInput
from lightning_core.stats.evaluation import benchmark_id
from lightning_core.types import Sampling
from lightning_rl.registry.names import (
    TAG_BENCHMARK_ID,
    TAG_CHAMPION_SCORE,
    TAG_CHAMPION_VERSION,
    TAG_DECISION,
    TAG_DECISION_BENCHMARK,
    TAG_REASON,
    TAG_SCORE,
    score_tag,
)
from lightning_rl.registry.promotion import (
    PromotionDecision,
    benchmark_score,
    decide_promotion,
    decide_version,
    decision_tags,
    recorded_decision,
)

BENCH = "0123456789abcdef"


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
    decision = decide_version("3", 0.8, "2", 0.7, margin=0.02, threshold=0.0, benchmark_id=BENCH)
    assert decision.promote
    assert (decision.challenger_version, decision.champion_version) == ("3", "2")
    first = decide_version("1", 0.1, None, None, margin=0.02, threshold=0.3, benchmark_id=BENCH)
    assert not first.promote and first.champion_version is None
    assert first.reason == decide_promotion(0.1, None, 0.02, 0.3).reason


def test_a_version_does_not_compete_with_itself():
    decision = decide_version("2", 0.9, "2", 0.9, margin=0.0, threshold=0.0, benchmark_id=BENCH)
    assert not decision.promote and decision.reason == "already the champion"
    assert decision.champion_score == 0.9 and decision.champion_version == "2"


def test_a_champion_without_a_score_on_the_benchmark_is_kept():
    # Even a perfect score does not replace a champion it cannot be compared with; the reason
    # says how to give the champion a score there.
    decision = decide_version(
        "2", 1.0, "1", None, margin=0.0, threshold=0.0, benchmark_id=BENCH, benchmark_size=50
    )
    assert not decision.promote
    assert decision.reason.startswith(f"champion v1 has no score on benchmark {BENCH}")
    assert "`lightning-rl eval --policy champion --eval-size 50`" in decision.reason
    assert decision.champion_score is None and decision.champion_version == "1"
    assert decision.benchmark_id == BENCH


def test_a_score_counts_only_on_its_own_benchmark():
    other = "fedcba9876543210"
    registered = {TAG_SCORE: "0.7", TAG_BENCHMARK_ID: BENCH}
    assert benchmark_score(registered, BENCH) == 0.7
    assert benchmark_score(registered, other) is None
    # Scored on the other benchmark since (`lightning-rl eval`): that score, there only.
    rescored = {**registered, score_tag(other): "0.4"}
    assert benchmark_score(rescored, other) == 0.4 and benchmark_score(rescored, BENCH) == 0.7
    # Registered before scores had a benchmark: on none that can be named.
    assert benchmark_score({TAG_SCORE: "0.7"}, BENCH) is None
    assert benchmark_score({TAG_SCORE: "n/a", TAG_BENCHMARK_ID: BENCH}, BENCH) is None
    assert benchmark_score({TAG_SCORE: "nan", TAG_BENCHMARK_ID: BENCH}, BENCH) is None


def test_a_champion_scored_on_another_benchmark_is_never_compared():
    # A champion at 0.2 on another benchmark: the gate would promote 0.9 if it compared.
    champion_tags = {TAG_SCORE: "0.2", TAG_BENCHMARK_ID: "fedcba9876543210"}
    decision = decide_version(
        "2",
        0.9,
        "1",
        benchmark_score(champion_tags, BENCH),
        margin=0.02,
        threshold=0.0,
        benchmark_id=BENCH,
    )
    assert not decision.promote and decision.champion_score is None
    assert "0.2" not in decision.reason and "not compared" in decision.reason


def _tasks(n: int) -> list[dict]:
    return [{"id": str(i), "question": f"{i} + 1", "answer": str(i + 1)} for i in range(n)]


def test_the_benchmark_id_is_the_content_and_the_measure():
    base = benchmark_id(_tasks(5), agent="calc:agent", threshold=1.0)
    assert base == benchmark_id(_tasks(5), agent="calc:agent", threshold=1.0)
    assert len(base) == 16 and int(base, 16) >= 0
    # The order of the tasks does not change a score, so not the benchmark either.
    assert benchmark_id(_tasks(5)[::-1], agent="calc:agent", threshold=1.0) == base
    changed_answer = [*_tasks(4), {**_tasks(5)[4], "answer": "6!"}]
    different = [
        benchmark_id(_tasks(4), agent="calc:agent", threshold=1.0),  # size
        benchmark_id(changed_answer, agent="calc:agent", threshold=1.0),  # content
        benchmark_id(_tasks(5), agent="sql:agent", threshold=1.0),  # agent
        benchmark_id(_tasks(5), agent="calc:agent", threshold=0.9),  # success threshold
        benchmark_id(
            _tasks(5), agent="calc:agent", threshold=1.0, sampling=Sampling(temperature=1)
        ),
        benchmark_id(_tasks(5), agent="calc:agent", threshold=1.0, max_attempts=1),
    ]
    assert len({base, *different}) == 1 + len(different)


def test_decide_version_refuses_a_score_that_is_no_number():
    with pytest.raises(InvalidInput):
        decide_version("2", math.nan, "1", 0.5, margin=0.02, threshold=0.0, benchmark_id=BENCH)


@pytest.mark.parametrize(
    "decision",
    [
        decide_version("2", 0.8, "1", 0.7, margin=0.02, threshold=0.0, benchmark_id=BENCH),
        decide_version("2", 0.7, "1", 0.7, margin=0.02, threshold=0.0, benchmark_id=BENCH),
        decide_version("1", 0.5, None, None, margin=0.02, threshold=0.3, benchmark_id=BENCH),
        decide_version("2", 0.8, "1", None, margin=0.02, threshold=0.0, benchmark_id=BENCH),
        # Scores whose shortest repr is long still come back bit for bit.
        decide_version("5", 0.1 + 0.2, "4", 1 / 3, margin=0.0, threshold=0.0, benchmark_id=BENCH),
    ],
)
def test_the_recorded_tags_give_the_decision_back(decision: PromotionDecision):
    tags = {TAG_SCORE: repr(decision.challenger_score), **decision_tags(decision)}
    assert recorded_decision(str(decision.challenger_version), tags) == decision


def test_decision_tags_are_what_the_registry_shows():
    promoted = decide_version("2", 0.8, "1", 0.7, margin=0.02, threshold=0.0, benchmark_id=BENCH)
    assert decision_tags(promoted) == {
        TAG_DECISION: "promoted",
        TAG_REASON: promoted.reason,
        TAG_CHAMPION_SCORE: "0.7",
        TAG_CHAMPION_VERSION: "1",
        TAG_DECISION_BENCHMARK: BENCH,
    }
    first = decide_version("1", 0.1, None, None, margin=0.02, threshold=0.3, benchmark_id=BENCH)
    assert decision_tags(first) == {
        TAG_DECISION: "rejected",
        TAG_REASON: first.reason,
        TAG_CHAMPION_SCORE: "none",
        TAG_CHAMPION_VERSION: "none",
        TAG_DECISION_BENCHMARK: BENCH,
    }


def test_a_decision_recorded_before_benchmarks_reads_back_without_one():
    decision = decide_version("2", 0.8, "1", 0.7, margin=0.02, threshold=0.0, benchmark_id=BENCH)
    tags = {TAG_SCORE: "0.8", **decision_tags(decision)}
    del tags[TAG_DECISION_BENCHMARK]
    recorded = recorded_decision("2", tags)
    assert recorded == decision.model_copy(update={"benchmark_id": None})


FIRST = decide_version("1", 0.5, None, None, 0, 0, benchmark_id=BENCH)


@pytest.mark.parametrize(
    "tags",
    [
        {TAG_SCORE: "0.5"},  # registered, never decided
        {TAG_SCORE: "0.5", TAG_DECISION: "promoted"},  # the other tags missing
        {TAG_SCORE: "n/a", **decision_tags(FIRST)},
        {TAG_SCORE: "0.5", **decision_tags(FIRST)} | {TAG_DECISION: "maybe"},
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
