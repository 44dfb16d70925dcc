"""TrainConfig's sections (flows/config.py): the rollouts and how they sample, the data a run
trains on, and its held-out evaluation. The server's section is lightning_core's ServerConfig,
which `lightning-rl serve` shares; the trainer's, credit's, curriculum's and registry's are
declared beside the code they configure."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from lightning_core.data.offline import OfflineConfig
from lightning_core.types import Sampling

DataSource = Literal["profile", "new_tasks", "episodes"]
_SPLIT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _training_sampling() -> Sampling:
    return Sampling(temperature=0.8)


class RolloutConfig(BaseModel):
    """Each iteration's rollouts: how many, how they sample, and where they run."""

    tasks_per_iteration: int = Field(16, ge=1, description="Train tasks sampled per iteration.")
    group_size: int = Field(
        4, ge=1, description="Rollouts per task (G): the group whose mean is the baseline."
    )
    sampling: Sampling = Field(
        default_factory=_training_sampling,
        description="How training rollouts sample (temperature, top_p, max_tokens); evaluation "
        "is greedy. Each rollout's seed comes from the run's seed.",
    )
    max_attempts: int = Field(2, ge=1, description="Attempts per rollout before it fails.")
    rollout_timeout_s: float | None = Field(
        None, gt=0, description="Time budget of one attempt; None: the agent profile's."
    )
    rollout_workers: int = Field(
        2, ge=1, description="Rollout tasks fanned out with .map per iteration (one per worker)."
    )
    rollout_concurrency: int = Field(16, ge=1, description="Agents each rollout task runs at once.")
    task_runner: Literal["threads", "ray", "dask"] = Field(
        "threads",
        description="Where rollout tasks run: a thread pool here, or a Ray or Dask cluster "
        "(pip install lightning-rl[cluster]; the server must then be reachable from it).",
    )
    task_runner_address: str | None = Field(
        None, description="Ray address or Dask scheduler address; None starts a local one."
    )
    staleness: int = Field(
        0,
        ge=0,
        description="Concurrent rollouts and training: the next iterations' rollouts run on "
        "the newest published policy while this iteration's update trains, at most this many "
        "versions behind the policy they train. 0: one after the other (each iteration's "
        "rollouts on the policy the previous one published). Above 0 the update uses truncated "
        "importance sampling (trainer.tis_cap, 2.0 unless set). Not with data=episodes.",
    )


class DataConfig(BaseModel):
    """What the run trains on (docs/production.md: recurring retraining)."""

    source: DataSource = Field(
        "profile",
        description="profile (the agent's train split, the same every run), new_tasks (online "
        "RL on the tasks appended to task_table since the previous new_tasks run) or episodes "
        "(offline, on the production episodes of episodes_from whose feedback arrived since the "
        "previous episodes run). With new_tasks or episodes, a run that finds nothing new says "
        "so and ends without training or registering. Flag: --data.",
    )
    task_source: str | None = Field(
        None,
        description="Dataset of the agent's loader (calc: arithmetic, basic_arithmetic, "
        "gsm_symbolic); None: the profile's default.",
    )
    train_size: int = Field(2000, ge=1, description="Size of the train split sampled from.")
    task_table: str | None = Field(
        None,
        description="Folder of the appendable task table (Parquet files, `lightning-rl data "
        "add-tasks`) that source=new_tasks reads; None: <run_dir>/data/<agent>-tasks.",
    )
    episodes_from: str | None = Field(
        None,
        description="URL of the production server (`lightning-rl production`) whose captured "
        "episodes and feedback source=episodes trains on; its key from episodes_key_file, else "
        "LIGHTNING_API_KEY.",
    )
    episodes_key_file: str | None = Field(
        None, description="File holding the production server's API key (a path, never the key)."
    )
    episodes_archive: str | None = Field(
        None,
        description="The production store's archive folder (`<db>.archive`, `lightning-rl data "
        "archive`), read beside the server: episodes archived since the previous run are "
        "still trained on. None: the server's episodes only.",
    )
    episodes_once: bool = Field(
        False,
        description="Train each episode at most once: an episode an earlier episodes run took "
        "(it had feedback up to that run's watermark) is left out when new feedback on it "
        "arrives. False: it is taken again, with its reward from all its feedback.",
    )
    offline: OfflineConfig = Field(
        default_factory=OfflineConfig,
        description="source=episodes: how feedback becomes a reward and how the off-policy "
        "episodes are trained on (importance-weighted, or reward-filtered fine-tuning).",
    )


class EvaluationConfig(BaseModel):
    """The held-out evaluation: how often, on how many tasks, and on which benchmark."""

    eval_every: int = Field(4, ge=1, description="Evaluate on the held-out split every E.")
    eval_size: int = Field(200, ge=1, description="Held-out tasks per evaluation.")
    extra_splits: list[str] = Field(
        default_factory=list,
        max_length=4,
        description="More held-out splits the agent's task loader serves (the example "
        "agents' 'kinds': question kinds training never sees), each scored before training "
        "and at the end on up to eval_size tasks, and compared base vs final like the test "
        "split; they never decide promotion.",
    )
    benchmark_id: str | None = Field(
        None,
        description="Pin the held-out benchmark: the run stops before training unless its "
        "test split has this id (a run's eval.benchmark_id tag in MLflow; a run pinned to "
        "another id names the one it found).",
    )

    @field_validator("extra_splits")
    @classmethod
    def _other_splits(cls, value: list[str]) -> list[str]:
        # Split names become file, metric and artifact names: short, lowercase, no paths.
        named = all(_SPLIT_NAME.fullmatch(v) for v in value)
        if not named or set(value) & {"train", "test"} or len(set(value)) != len(value):
            raise ValueError(
                "extra_splits names other splits than 'train' and 'test', each once, in "
                f"lowercase letters, digits and '_' (got {value})"
            )
        return value


class SFTConfig(BaseModel):
    """warm_start=sft: supervised fine-tuning on the base policy's successful episodes before
    RL (rejection sampling; docs/pipeline.md)."""

    tasks: int = Field(64, ge=1, description="Train tasks the base policy is sampled on.")
    samples_per_task: int = Field(4, ge=1, le=64, description="Episodes sampled per task.")
    min_reward: float | None = Field(
        None,
        description="An episode is kept when its reward is at least this; None: the profile's "
        "success threshold.",
    )
    epochs: int = Field(2, ge=1, le=100, description="Passes over the kept calls.")
    updates_per_epoch: int = Field(
        4, ge=1, description="Optimizer steps per pass (the kept calls dealt into as many parts)."
    )
    learning_rate: float | None = Field(
        None, gt=0, description="Its own learning rate; None: the trainer's."
    )
