"""The training report's markdown: what the Prefect artifact shows."""

from __future__ import annotations

import pandas as pd

from lightning_rl.flows.report import _table


def test_the_iteration_column_stays_an_integer_beside_float_metrics():
    frame = pd.DataFrame({"iteration": [1, 2], "rollout/reward_mean": [0.5, 0.25]})
    lines = _table(frame, ["iteration", "rollout/reward_mean"]).splitlines()
    assert lines[2:] == ["| 1 | 0.500 |", "| 2 | 0.250 |"]
