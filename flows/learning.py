"""Where a run's learning comes from: training success per tier, rolling over iterations, and
each held-out evaluation per tier (or question kind) with its 95 % interval.

A run's overall curves can be flat to the eye while one tier rises and another falls (the rag
demo: a reward between 0.4 and 0.7 with no trend while the held-out score rose by 16 points,
all of it on one- and two-document questions). These tables and the figure split them.
Training success is read from the run's exported episodes (their task ids) and the tasks'
tier; held-out scores from each evaluation's per-task rewards, which the checkpoint keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lightning_core.rollouts.curriculum import tier_of
from lightning_core.stats.evaluation import EvalResult, wilson_interval
from lightning_rl.flows.report import save_figure

# Iterations a rolling training success spans: one iteration draws a few tasks per tier.
WINDOW = 3


def train_success_by_tier(
    episodes: pd.DataFrame,
    tasks: Sequence[Mapping[str, Any]],
    tier_key: str | None,
    window: int = WINDOW,
) -> pd.DataFrame:
    """Per iteration and tier: the episodes, their success rate, and the success rate over the
    last `window` iterations (episodes pooled: an iteration that drew a tier twice counts
    twice). `episodes` holds iteration, task_id and success (analytics' episodes view)."""
    columns = ["iteration", "tier", "episodes", "success", "rolling_success"]
    if episodes.empty:
        return pd.DataFrame(columns=columns)
    tiers = {str(t["id"]): tier_of(t, tier_key) for t in tasks}
    frame = episodes.assign(
        tier=episodes["task_id"].astype(str).map(tiers).fillna("unknown"),
        success=episodes["success"].astype(float),
    )
    per = (
        frame.groupby(["tier", "iteration"])["success"]
        .agg(episodes="count", solved="sum")
        .reset_index()
        .sort_values(["tier", "iteration"])
    )
    rows = []
    for tier, group in per.groupby("tier"):
        group = group.set_index("iteration")[["episodes", "solved"]]
        # Every iteration of the run, so that a window spans iterations, not rows: a tier the
        # curriculum skipped for an iteration adds nothing to its window.
        full = group.reindex(range(group.index.min(), group.index.max() + 1), fill_value=0)
        rolled = full.rolling(window, min_periods=1).sum()
        for it in group.index:
            rows.append(
                {
                    "iteration": int(it),
                    "tier": tier,
                    "episodes": int(group.at[it, "episodes"]),
                    "success": group.at[it, "solved"] / group.at[it, "episodes"],
                    "rolling_success": rolled.at[it, "solved"] / rolled.at[it, "episodes"],
                }
            )
    return pd.DataFrame(rows, columns=columns).sort_values(["iteration", "tier"], ignore_index=True)


def heldout_by_group(
    evals: Sequence[tuple[int, EvalResult]],
    tasks: Sequence[Mapping[str, Any]],
    key: str | None,
    threshold: float,
) -> pd.DataFrame:
    """Per evaluation and group of tasks (their `key`: a tier, a question kind): tasks,
    solved, score and its Wilson 95 % interval. Tasks an evaluation has no reward for count
    as unsolved, as a failed rollout does in the score."""
    columns = ["iteration", "group", "tasks", "solved", "score", "ci_low", "ci_high"]
    groups: dict[str, list[str]] = {}
    for t in tasks:
        groups.setdefault(tier_of(t, key), []).append(str(t["id"]))
    rows = []
    for iteration, result in evals:
        for name in sorted(groups):
            ids = groups[name]
            solved = sum(result.rewards.get(i, 0.0) >= threshold for i in ids)
            low, high = wilson_interval(solved, len(ids))
            rows.append(
                {
                    "iteration": iteration,
                    "group": name,
                    "tasks": len(ids),
                    "solved": solved,
                    "score": solved / len(ids),
                    "ci_low": low,
                    "ci_high": high,
                }
            )
    return pd.DataFrame(rows, columns=columns)


def tier_curves(train: pd.DataFrame, heldout: pd.DataFrame, path: Path, title: str) -> Path:
    """Two panels in one PNG: rolling training success per tier, held-out score per tier with
    its interval at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110, sharey=True)
    for tier, group in train.groupby("tier"):
        left.plot(group["iteration"], group["rolling_success"], "o-", ms=3, label=str(tier))
    left.set_title(f"training success per tier (rolling, {WINDOW} iterations)")
    for name, group in heldout.groupby("group"):
        low = (group["score"] - group["ci_low"]).clip(lower=0)
        high = (group["ci_high"] - group["score"]).clip(lower=0)
        right.errorbar(
            group["iteration"], group["score"], yerr=[low, high], fmt="D-", capsize=4, label=name
        )
    right.set_title("held-out score per tier (95 % interval)")
    for ax in (left, right):
        ax.set_xlabel("iteration")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def heldout_table(frame: pd.DataFrame) -> list[str]:
    """One row per group, one column per evaluation: score (interval), for the report."""
    if frame.empty:
        return []
    iterations = sorted(frame["iteration"].unique())
    lines = [
        "| group | tasks | " + " | ".join(f"after {i}" for i in iterations) + " |",
        "|---|---:|" + "---|" * len(iterations),
    ]
    for name, group in frame.groupby("group", sort=True):
        by_it = group.set_index("iteration")
        cells = [
            f"{by_it.at[i, 'score']:.1%} ({by_it.at[i, 'ci_low']:.0%}-{by_it.at[i, 'ci_high']:.0%})"
            for i in iterations
        ]
        lines.append(f"| {name} | {int(group['tasks'].iloc[0])} | " + " | ".join(cells) + " |")
    return lines


def train_table(frame: pd.DataFrame) -> list[str]:
    """One row per iteration, one column per tier: the rolling success (its episodes)."""
    if frame.empty:
        return []
    tiers = sorted(frame["tier"].unique())
    lines = ["| iteration | " + " | ".join(tiers) + " |", "|---:|" + "---|" * len(tiers)]
    for it, group in frame.groupby("iteration", sort=True):
        by_tier = group.set_index("tier")
        cells = [
            f"{by_tier.at[t, 'rolling_success']:.1%} ({int(by_tier.at[t, 'episodes'])})"
            if t in by_tier.index
            else "-"
            for t in tiers
        ]
        lines.append(f"| {it} | " + " | ".join(cells) + " |")
    return lines
