"""The training report's markdown: what the Prefect artifact shows."""

from __future__ import annotations

import pandas as pd

from lightning_rl.flows.report import SIGNAL_SHARE, _table, markdown


def test_the_iteration_column_stays_an_integer_beside_float_metrics():
    frame = pd.DataFrame({"iteration": [1, 2], "rollout/reward_mean": [0.5, 0.25]})
    lines = _table(frame, ["iteration", "rollout/reward_mean"]).splitlines()
    assert lines[2:] == ["| 1 | 0.500 |", "| 2 | 0.250 |"]


def test_the_iterations_table_shows_the_share_of_groups_with_a_signal(tmp_path):
    history = pd.DataFrame(
        {
            "iteration": [1, 2],
            "rollout/reward_mean": [0.1, 0.2],
            "rollout/success_rate": [0.0, 0.1],
            "rollout/tasks_drawn": [12.0, 8.0],
            "rollout/groups_with_signal": [3.0, 8.0],
            "rollout/groups_mixed_success": [1.0, 2.0],
        }
    )
    curve = tmp_path / "curve.png"
    curve.write_bytes(b"png")
    text = markdown("run", history, [], curve)
    header = next(line for line in text.splitlines() if line.startswith("| iteration"))
    assert header.endswith(
        f"| rollout/tasks_drawn | {SIGNAL_SHARE} | rollout/groups_mixed_success |"
    )
    assert "| 12.000 | 0.250 | 1.000 |" in text and "| 8.000 | 1.000 | 2.000 |" in text
    # A run without dynamic sampling's metrics (older runs, offline data) has no such column.
    older = markdown("run", history.drop(columns=["rollout/tasks_drawn"]), [], curve)
    assert SIGNAL_SHARE not in older
