"""The report's per-tier view of learning (flows/learning.py), against hand computations."""

from __future__ import annotations

import pandas as pd
import pytest

from lightning_core.stats.evaluation import EvalResult, wilson_interval
from lightning_rl.flows import learning

TASKS = [
    {"id": "e1", "tier": "easy", "kind": "lookup"},
    {"id": "e2", "tier": "easy", "kind": "count"},
    {"id": "h1", "tier": "hard", "kind": "count"},
]


def _episodes(rows: list[tuple[int, str, bool]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["iteration", "task_id", "success"])


def test_training_success_per_tier_rolls_over_iterations_not_rows():
    episodes = _episodes(
        [
            (1, "e1", True), (1, "e1", False), (1, "h1", False), (1, "h1", False),
            (2, "e2", True), (2, "e2", True),
            # Iteration 3 draws no easy task; iteration 4 draws one easy group.
            (3, "h1", True), (3, "h1", False),
            (4, "e1", False), (4, "e1", False), (4, "x9", True),
        ]
    )  # fmt: skip
    frame = learning.train_success_by_tier(episodes, TASKS, "tier", window=3)
    by = {(r.iteration, r.tier): r for r in frame.itertuples()}
    assert by[(1, "easy")].success == 0.5 and by[(1, "easy")].rolling_success == 0.5
    assert by[(2, "easy")].rolling_success == pytest.approx(3 / 4)  # 1 + 2 of 2 + 2
    # Iteration 4's window is iterations 2-4: 2 of 4 easy episodes (iteration 1 has left it).
    assert by[(4, "easy")].success == 0.0 and by[(4, "easy")].rolling_success == 0.5
    assert by[(3, "hard")].rolling_success == pytest.approx(1 / 4)
    assert (4, "hard") not in by  # no hard episode in iteration 4: no row
    # A task the list does not hold (production episodes, say) is in a tier of its own.
    assert by[(4, "unknown")].episodes == 1 and by[(4, "unknown")].success == 1.0
    assert learning.train_success_by_tier(_episodes([]), TASKS, "tier").empty


def _result(policy: str, rewards: dict[str, float]) -> EvalResult:
    return EvalResult(
        policy_version=policy, tasks=3, successes=0, score=0.0, ci_low=0.0, ci_high=1.0,
        mean_reward=0.0, rewards=rewards,
    )  # fmt: skip


def test_held_out_score_per_group_at_each_evaluation_with_its_interval():
    evals = [
        (0, _result("base", {"e1": 0.0, "e2": 1.0, "h1": 0.0})),
        (4, _result("v4", {"e1": 1.0, "e2": 1.0})),  # h1 failed: no reward, unsolved
    ]
    frame = learning.heldout_by_group(evals, TASKS, "tier", threshold=0.9)
    by = {(r.iteration, r.group): r for r in frame.itertuples()}
    assert (by[(0, "easy")].solved, by[(0, "easy")].tasks) == (1, 2)
    assert (by[(4, "easy")].ci_low, by[(4, "easy")].ci_high) == wilson_interval(2, 2)
    assert by[(4, "hard")].score == 0.0
    kinds = learning.heldout_by_group(evals, TASKS, "kind", threshold=0.9)
    assert set(kinds["group"]) == {"lookup", "count"}
    assert kinds[(kinds.iteration == 0) & (kinds.group == "count")].solved.item() == 1
    table = learning.heldout_table(frame)
    assert table[0] == "| group | tasks | after 0 | after 4 |"
    assert table[2].startswith("| easy | 2 | 50.0% (") and "| 100.0% (" in table[2]


def test_the_tables_and_the_figure_are_written(tmp_path):
    episodes = _episodes([(1, "e1", True), (1, "h1", False), (2, "e1", True)])
    train = learning.train_success_by_tier(episodes, TASKS, "tier")
    lines = learning.train_table(train)
    assert lines[0] == "| iteration | easy | hard |"
    assert lines[2] == "| 1 | 100.0% (1) | 0.0% (1) |"
    assert lines[3] == "| 2 | 100.0% (1) | - |"
    heldout = learning.heldout_by_group([(0, _result("b", {"e1": 1.0}))], TASKS, "tier", 0.9)
    png = learning.tier_curves(train, heldout, tmp_path / "tiers.png", "run")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
