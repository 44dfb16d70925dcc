"""How far a judge agrees with gold, on a labelled sample, before a run trusts it.

Gold is the agent's own reward where the task has a right answer (RAG's F1, SQL's result
match): a trajectory is correct when that reward is at least the gold threshold, and the judge
says so when its score is at least the verdict threshold. Agreement is the share of the
sample where both say the same; the rank correlation (Spearman's, ties averaged) says how
well the judge's scores order the trajectories, which is what group-relative training uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from pydantic import BaseModel, Field

from lightning_core.errors import InvalidInput
from lightning_core.judge.config import CalibrationConfig


class Calibration(BaseModel):
    """A judge against gold on a labelled sample."""

    n: int = Field(description="Trajectories judged and labelled.")
    agreement_pct: float = Field(description="Share where the judge's verdict matches gold.")
    spearman: float | None = Field(
        description="Rank correlation of the judge's scores with the gold rewards; None when "
        "either is constant."
    )
    gold_positive_pct: float = Field(description="Share that gold calls correct.")
    judge_positive_pct: float = Field(description="Share that the judge calls correct.")

    def metrics(self) -> dict[str, float]:
        out = {
            "judge/calibration_n": float(self.n),
            "judge/agreement_pct": self.agreement_pct,
            "judge/gold_positive_pct": self.gold_positive_pct,
            "judge/judge_positive_pct": self.judge_positive_pct,
        }
        if self.spearman is not None:
            out["judge/spearman"] = self.spearman
        return out


def calibrate(
    scores: Sequence[float],
    gold: Sequence[float],
    gold_threshold: float,
    verdict_threshold: float = 0.5,
) -> Calibration:
    """The judge's `scores` against the `gold` rewards of the same trajectories."""
    if len(scores) != len(gold):
        raise ValueError("scores and gold rewards must pair up")
    if not scores:
        raise ValueError("calibration needs at least one judged trajectory")
    judge, truth = pd.Series(scores, dtype=float), pd.Series(gold, dtype=float)
    said, right = judge >= verdict_threshold, truth >= gold_threshold
    rho = judge.rank().corr(truth.rank()) if judge.nunique() > 1 and truth.nunique() > 1 else None
    return Calibration(
        n=len(scores),
        agreement_pct=100.0 * float((said == right).mean()),
        spearman=None if rho is None or pd.isna(rho) else float(rho),
        gold_positive_pct=100.0 * float(right.mean()),
        judge_positive_pct=100.0 * float(said.mean()),
    )


def enforce(result: Calibration, config: CalibrationConfig, judge: str) -> str | None:
    """Refuse (InvalidInput) a judge below `config.min_agreement_pct`, unless `allow_below`;
    then the warning to log. None: the judge passed."""
    if result.agreement_pct >= config.min_agreement_pct:
        return None
    message = (
        f"the judge {judge} agrees with gold on {result.agreement_pct:.1f} % of {result.n} "
        f"trajectories, below judge.calibration.min_agreement_pct={config.min_agreement_pct:g}"
    )
    if not config.allow_below:
        raise InvalidInput(
            f"{message}; use a stronger judge (judge.endpoint, judge.model) or set "
            "judge.calibration.allow_below=true to train with it anyway"
        )
    return f"{message}; training with it anyway (judge.calibration.allow_below)"
