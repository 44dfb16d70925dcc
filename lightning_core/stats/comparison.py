"""Base against final on the same held-out tasks: per-tier score and a paired gain interval.

Two policies scored on the same tasks are paired: each task is a (base, final) pair of
outcomes. The gain's interval comes from a paired bootstrap, resampling tasks with both of
their outcomes, which is narrower and more honest than treating the two scores as independent
samples. Each tier gets its own row with Wilson intervals, so a gain can be traced to the
questions that moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from lightning_core.rollouts.curriculum import tier_of
from lightning_core.stats.evaluation import EvalResult, wilson_interval

BOOTSTRAP_RESAMPLES = 10_000


class TierRow(BaseModel):
    """One tier's (or all tasks') base and final score."""

    tier: str
    tasks: int
    base: float = Field(description="Base score.")
    base_ci: tuple[float, float] = Field(description="Wilson 95 % interval of base.")
    final: float = Field(description="Final score.")
    final_ci: tuple[float, float] = Field(description="Wilson 95 % interval of final.")
    base_mean_reward: float
    final_mean_reward: float

    @property
    def gain_points(self) -> float:
        return round((self.final - self.base) * 100, 1)


class Comparison(BaseModel):
    """Base vs final on one benchmark."""

    rows: list[TierRow] = Field(description="One per tier, then 'all'.")
    gain_points: float = Field(description="Final minus base score, in points.")
    gain_ci_points: tuple[float, float] = Field(
        description="Paired bootstrap 95 % interval of the gain, in points."
    )
    mean_reward_gain: float = Field(description="Final minus base mean reward.")
    mean_reward_gain_ci: tuple[float, float] = Field(
        description="Paired bootstrap 95 % interval of the mean reward gain."
    )

    def markdown(self) -> str:
        lines = [
            "| tier | tasks | base | final | gain (points) |",
            "|---|---:|---|---|---:|",
        ]
        for r in self.rows:
            base = f"{r.base:.1%} ({r.base_ci[0]:.1%}–{r.base_ci[1]:.1%})"
            final = f"{r.final:.1%} ({r.final_ci[0]:.1%}–{r.final_ci[1]:.1%})"
            lines.append(f"| {r.tier} | {r.tasks} | {base} | {final} | {r.gain_points:+.1f} |")
        low, high = self.gain_ci_points
        lines.append("")
        lines.append(
            f"gain {self.gain_points:+.1f} points, paired bootstrap 95 % interval "
            f"[{low:+.1f}, {high:+.1f}]; mean reward gain {self.mean_reward_gain:+.3f} "
            f"[{self.mean_reward_gain_ci[0]:+.3f}, {self.mean_reward_gain_ci[1]:+.3f}]"
        )
        return "\n".join(lines)


def _row(tier: str, base: np.ndarray, final: np.ndarray, threshold: float) -> TierRow:
    b, f = int((base >= threshold).sum()), int((final >= threshold).sum())
    n = len(base)
    return TierRow(
        tier=tier,
        tasks=n,
        base=b / n,
        base_ci=wilson_interval(b, n),
        final=f / n,
        final_ci=wilson_interval(f, n),
        base_mean_reward=float(base.mean()),
        final_mean_reward=float(final.mean()),
    )


def paired_bootstrap(
    diffs: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The 95 % percentile interval of the mean of paired differences."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(diffs), size=(resamples, len(diffs)))
    means = diffs[picks].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def compare(
    base: EvalResult,
    final: EvalResult,
    tasks: Sequence[Mapping[str, Any]],
    tier_key: str | None = "tier",
    threshold: float = 1.0,
    seed: int = 0,
) -> Comparison:
    """Per-tier and overall base-vs-final rows over `tasks`, with the paired gain interval.

    Both results must hold every task's reward (EvalResult.rewards); a task missing from one
    of them is an error, since a pair with a hole in it is no pair."""
    ids = [str(t["id"]) for t in tasks]
    missing = [i for i in ids if i not in base.rewards or i not in final.rewards]
    if missing:
        raise ValueError(f"{len(missing)} tasks lack a base or final reward, e.g. {missing[0]}")
    b = np.array([base.rewards[i] for i in ids], dtype=float)
    f = np.array([final.rewards[i] for i in ids], dtype=float)
    tiers = [tier_of(t, tier_key) for t in tasks]
    rows = []
    for tier in sorted(set(tiers)):
        mask = np.array([x == tier for x in tiers])
        rows.append(_row(tier, b[mask], f[mask], threshold))
    if len(rows) > 1:
        rows.append(_row("all", b, f, threshold))
    solved = (f >= threshold).astype(float) - (b >= threshold).astype(float)
    low, high = paired_bootstrap(solved, seed=seed)
    r_low, r_high = paired_bootstrap(f - b, seed=seed)
    return Comparison(
        rows=rows,
        gain_points=round(float(solved.mean()) * 100, 1),
        gain_ci_points=(round(low * 100, 1), round(high * 100, 1)),
        mean_reward_gain=float((f - b).mean()),
        mean_reward_gain_ci=(r_low, r_high),
    )
