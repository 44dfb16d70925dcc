"""The settings of the drift demonstration (benchmarks/production_drift.py): the simulated
users, their feedback, the drift of their questions, and the weekly retraining's budget."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class DriftSettings(BaseModel):
    """One drift demonstration: week 0 trains a champion, then each simulated week sends users'
    traffic to the loop's production server and to a frozen week-0 champion, and retrains."""

    model: str | None = Field(
        None, description="Base model of every run and server (None: the default, SmolLM2)."
    )
    weeks: int = Field(4, ge=1, le=52, description="Simulated weeks of traffic after week 0.")
    drift_start: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Share of drifted questions in week 1 (3-4 operands of 100-999, the "
        "operators in words: agents/calc/data.py); it grows linearly to drift_end in the last "
        "week.",
    )
    drift_end: float = Field(1.0, ge=0, le=1, description="Share of drifted questions last week.")
    episodes_per_week: int = Field(
        240,
        ge=1,
        description="User episodes a week, each answered by the loop and the frozen champion "
        "(the same question: paired). The live gate sees the ~70 % with feedback, half per "
        "arm: at 120 a week (the first full run) no canary was decided within its week, and "
        "the next week's retrained version replaces an undecided canary.",
    )
    concurrency: int = Field(
        16,
        ge=1,
        description="Users calling at the same time (each call goes to the loop and to the "
        "frozen champion). As many as a training run's rollouts keep in flight: the servers "
        "batch concurrent calls, and 6 took 19 min a week on 2 cores.",
    )
    server_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads of each of the two production servers (their "
        "--backend-options threads). None: half the machine's cores each, at least 1. Two "
        "servers with a thread per core each fight for the cores: 48 users took 411 s that "
        "way on 2 cores, 74 s with one thread each.",
    )
    temperature: float = Field(
        0.7,
        ge=0,
        description="Sampling temperature of the users' calls: production samples, "
        "so that a week's episodes hold right answers to learn from.",
    )
    missing_rate: float = Field(
        0.3, ge=0, le=1, description="Share of episodes whose users send no feedback."
    )
    flip_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Share of the feedback sent that is wrong (1 for a wrong "
        "answer, 0 for a right one).",
    )
    late_rate: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Share of the feedback sent that arrives only after the "
        "week's retraining run (the next run counts it).",
    )
    max_delay_s: float = Field(
        5.0,
        ge=0,
        description="Feedback that is not late arrives 0 to this many seconds after "
        "its episode ends, while the week's traffic goes on.",
    )
    week0_iterations: int = Field(3, ge=1, description="Training iterations of the champion.")
    week0_tasks: int = Field(8, ge=1, description="Tasks per iteration of week 0.")
    group_size: int = Field(4, ge=1, description="Rollouts per task of week 0.")
    warm_start: Literal["champion", "challenger"] = Field(
        "challenger",
        description="What each weekly retraining continues: the champion, or the challenger "
        "while its canary runs (TrainConfig.warm_start). In the first full run (champion) "
        "every week's version was the week-0 champion plus one week's episodes, since no "
        "canary was decided: the weeks did not add up.",
    )
    retrain_iterations: int = Field(
        4,
        ge=1,
        description="Iterations (epochs over the week's episodes) of each weekly retraining "
        "run, as the train/calc-production deployment runs it. With 2 (the first two full "
        "runs) a week's version gained 4-9 points on the pinned benchmark and the loop "
        "recovered 8-11 points in 39-78 min; with 4, 25.8, 21.2 and 22.1 points in 76, 69 "
        "and 59 min (the last with the frozen layers replayed, on a faster day; BENCHMARKS.md).",
    )
    eval_size: int = Field(
        100,
        ge=1,
        description="Tasks of the pinned benchmark (the calc test split's first N) "
        "that the offline gate scores each week.",
    )
    canary_fraction: float = Field(
        0.5, gt=0, le=1, description="Share of episodes the challenger serves during a canary."
    )
    gate_min_episodes: int = Field(
        15, ge=2, description="Episodes with feedback each arm needs before the live gate decides."
    )
    gate_tau: float = Field(
        0.3,
        gt=0,
        description="Scale of the differences the live gate is tuned to find (LiveGateConfig."
        "tau, 0.1 by default): drift moves success by tens of points, and a test tuned to that "
        "decides on a week's feedback where one tuned to 0.1 would wait for hundreds.",
    )
    poll_s: float = Field(
        2.0, gt=0, description="Seconds between the production server's looks at the registry."
    )
    probe_s: float = Field(
        0.5,
        gt=0,
        description="Seconds between the demo's looks at the champion alias and its "
        "probe calls, which time a promotion's arrival at the served policy.",
    )
    seed: int = Field(0, description="Seed of the questions and of the users' feedback.")

    @model_validator(mode="after")
    def _drift_grows(self) -> DriftSettings:
        if self.drift_end < self.drift_start:
            raise ValueError(
                f"drift_end ({self.drift_end}) is below drift_start ({self.drift_start}): "
                "the demo drifts toward the new questions, not away"
            )
        return self

    def drift(self, week: int) -> float:
        """Share of drifted questions in `week` (1 to weeks)."""
        if self.weeks == 1:
            return self.drift_end
        step = (self.drift_end - self.drift_start) / (self.weeks - 1)
        return round(self.drift_start + step * (week - 1), 4)


# A minute or two on the tiny random model: the code path, not the learning.
QUICK = {
    "model": "tiny",
    "weeks": 2,
    "drift_start": 0.5,
    "episodes_per_week": 6,
    "concurrency": 3,
    "max_delay_s": 0.5,
    "week0_iterations": 1,
    "week0_tasks": 2,
    "group_size": 2,
    "retrain_iterations": 1,
    "eval_size": 4,
    "gate_min_episodes": 2,
    "poll_s": 1.0,
}
