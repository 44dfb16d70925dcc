"""What a run's judge is, how its score joins the agent's own reward, and how it is calibrated.

The judge is any OpenAI-compatible endpoint: this run's own gateway (`endpoint: server`, which
serves the base model as it was before training, so the judge never drifts with the policy),
a vLLM server, or a hosted API. Its key is read from an environment variable that the config
names, so that no secret is ever a run's parameter.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from lightning_core.types import FiniteFloat

SERVER = "server"


class JudgeBrief(BaseModel):
    """An agent's instructions to a judge: what a good trajectory does, and what to show."""

    rubric: str = Field(
        min_length=1, max_length=4000, description="What a good trajectory achieves, in words."
    )
    task_fields: list[str] = Field(
        default_factory=lambda: ["question"],
        min_length=1,
        description="Fields of the task shown to the judge. Leave gold answers out: the judge "
        "stands in for them.",
    )
    gold_threshold: FiniteFloat | None = Field(
        None,
        description="In calibration, an agent reward at least this counts as a correct "
        "trajectory; None: the profile's success threshold.",
    )


class CalibrationConfig(BaseModel):
    """The check of the judge against gold before a run trusts it."""

    enabled: bool = Field(
        True,
        description="Score the judge on a labelled sample (trajectories of the base policy on "
        "train tasks, labelled by the agent's own reward) before the first iteration.",
    )
    tasks: int = Field(16, ge=2, le=1024, description="Train tasks of the labelled sample.")
    group_size: int = Field(4, ge=1, le=64, description="Trajectories sampled per task.")
    min_agreement_pct: float = Field(
        70.0,
        ge=0,
        le=100,
        description="Refuse a judge whose verdicts agree with gold on fewer than this share "
        "of the sample.",
    )
    allow_below: bool = Field(
        False,
        description="Train with a judge below min_agreement_pct anyway (the figures are still "
        "logged); for research on weak judges.",
    )
    verdict_threshold: float = Field(
        0.5, ge=0, le=1, description="A judge score at least this counts as a 'correct' verdict."
    )


class JudgeConfig(BaseModel):
    """A judge model whose scores become rewards (docs/judge.md)."""

    endpoint: str | None = Field(
        None,
        description="None: no judge. 'server': this run's gateway, judging with the base "
        "model. Else the base URL of an OpenAI-compatible API (ending in /v1).",
    )
    model: str | None = Field(
        None, description="Model name at the endpoint; None with 'server': the base model."
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the endpoint's API key (never the key "
        "itself: a run's parameters are logged).",
    )
    mode: Literal["verdict", "rank"] = Field(
        "verdict",
        description="verdict: each trajectory alone, the score being the judge's probability "
        "of 'yes' (from logprobs; any model can give it). rank: the whole group in one call, "
        "a score 0-10 each, as JSON constrained by a schema.",
    )
    rubric: str | None = Field(
        None, max_length=4000, description="Replaces the agent profile's rubric when set."
    )
    rule_weight: FiniteFloat = Field(
        1.0, description="Weight of the agent's own reward in the final reward (0: judge only)."
    )
    judge_weight: FiniteFloat = Field(1.0, description="Weight of the judge's score (0 to 1).")
    gate: FiniteFloat | None = Field(
        None,
        description="When set, the judge's score counts only for trajectories whose own "
        "reward is at least this (a format check, say); the others get rule_weight times it.",
    )
    max_calls: int | None = Field(
        20_000, ge=1, description="Judge calls a run may make in all (cache hits are free)."
    )
    max_tokens: int | None = Field(
        20_000_000, ge=1, description="Judge tokens (prompt and answer) a run may spend in all."
    )
    retries: int = Field(
        2, ge=0, le=10, description="Retries of a call that failed or could not be read."
    )
    timeout_s: float = Field(120.0, gt=0, description="Time limit of one judge call.")
    concurrency: int = Field(4, ge=1, le=256, description="Judge calls in flight at once.")
    max_transcript_chars: int = Field(
        6000,
        ge=200,
        le=200_000,
        description="Longest trajectory shown to the judge; a longer one loses its middle.",
    )
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None or value == SERVER:
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be 'server' or an http(s) URL, got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _named(self) -> JudgeConfig:
        if self.endpoint not in (None, SERVER) and self.model is None:
            raise ValueError("a judge endpoint other than 'server' needs judge.model")
        return self

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def combine(self, own: float, judged: float) -> float:
        """The final reward of a trajectory: the declared rule over its own reward and the
        judge's score."""
        if self.gate is not None and own < self.gate:
            return self.rule_weight * own
        return self.rule_weight * own + self.judge_weight * judged
