"""Base vs final on the same tasks: per-tier rows and the paired bootstrap gain interval."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_core.stats.comparison import compare, paired_bootstrap
from lightning_core.stats.evaluation import EvalResult


def _result(rewards: dict[str, float]) -> EvalResult:
    solved = sum(1 for v in rewards.values() if v >= 1.0)
    return EvalResult(
        policy_version="p",
        tasks=len(rewards),
        successes=solved,
        score=solved / len(rewards),
        ci_low=0,
        ci_high=1,
        mean_reward=sum(rewards.values()) / len(rewards),
        rewards=rewards,
    )


TASKS = [{"id": f"e{i}", "tier": "easy"} for i in range(40)] + [
    {"id": f"h{i}", "tier": "hard"} for i in range(40)
]


def test_rows_per_tier_and_a_gain_interval_that_excludes_zero_when_it_should():
    base = {t["id"]: 0.0 for t in TASKS}
    final = dict(base) | {f"e{i}": 1.0 for i in range(20)}  # half the easy ones now solved
    c = compare(_result(base), _result(final), TASKS)
    rows = {r.tier: r for r in c.rows}
    assert list(rows) == ["easy", "hard", "all"]
    assert rows["easy"].final == 0.5 and rows["hard"].final == 0.0 and rows["all"].final == 0.25
    assert rows["easy"].final_ci[0] < 0.5 < rows["easy"].final_ci[1]
    assert c.gain_points == 25.0
    low, high = c.gain_ci_points
    assert 0 < low < 25 < high
    assert "| easy | 40 |" in c.markdown()


def test_no_change_gives_an_interval_around_zero_and_holes_are_refused():
    same = {t["id"]: float(i % 2) for i, t in enumerate(TASKS)}
    c = compare(_result(same), _result(same), TASKS)
    assert c.gain_points == 0 and c.gain_ci_points == (0.0, 0.0)
    # Some solved, some lost: a gain of 0 whose interval straddles 0.
    moved = {k: 1.0 - v if k.startswith("e") else v for k, v in same.items()}
    c = compare(_result(same), _result(moved), TASKS)
    assert c.gain_ci_points[0] < 0 < c.gain_ci_points[1]
    with pytest.raises(ValueError, match="lack a base or final reward"):
        compare(_result({"e0": 1.0}), _result(same), TASKS)


def test_paired_bootstrap_is_seeded():
    d = np.array([1.0, 0.0, 0.0, 1.0, -1.0, 1.0])
    assert paired_bootstrap(d, seed=1) == paired_bootstrap(d, seed=1)
    low, high = paired_bootstrap(d)
    assert low <= d.mean() <= high
