"""Configuration of the store: where it lives, when a silent attempt is given up on, and the
bounds on what enters it (the reward range, what production episodes hold in memory)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from lightning_core.types import LIMIT_MAX_ABS_REWARD
from lightning_core.types import max_abs_reward as environment_max_abs_reward


class StoreConfig(BaseModel):
    """Settings of a DuckDB-backed LightningStore."""

    db: str = Field(
        "lightning.duckdb",
        description="DuckDB file of the store; ':memory:' keeps nothing after exit (tests only).",
    )
    attempt_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="An attempt running longer than this is stopped and its rollout requeued or "
        "failed; None for no limit. Half an hour covers long multi-turn agents.",
    )
    unresponsive_timeout_s: float | None = Field(
        300.0,
        gt=0,
        description="An attempt with neither a heartbeat nor a span for this long is presumed dead "
        "(worker crashed, machine lost) and its rollout requeued or failed; None to wait forever.",
    )
    duckdb_threads: int = Field(
        1,
        ge=1,
        description="DuckDB worker threads. The store runs many small transactions, where "
        "DuckDB's parallelism costs more in coordination than it gains (measured: 1 thread "
        "commits a 70-span batch 20 % faster than 2).",
    )
    watchdog_interval_s: float = Field(
        1.0, gt=0, description="How often the store looks for timed-out and unresponsive attempts."
    )
    # Quotas on the spans an attempt's writers store (store/guards.py): the gateway's own LLM
    # spans and production episodes are not counted. The example agents write tens of spans of
    # a few KB a rollout; one that loops, or hostile, wrote 4,000-span requests without end.
    max_spans_per_attempt: int = Field(
        10_000,
        ge=1,
        description="Spans a rollout attempt's agent (or runner) may store over the span routes "
        "and OTLP, the gateway's own LLM-call spans not counted; past it a write is refused "
        "(413) whole.",
    )
    max_span_bytes_per_attempt: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="Bytes of span JSON (attributes, events, resource) a rollout attempt may "
        "store the same way; past it a write is refused (413) whole. Collecting a rollout reads "
        "every span of its attempt.",
    )
    feedback_wait_s: float = Field(
        60.0,
        ge=0,
        description="Feedback on an episode with an LLM call in flight waits this long at most "
        "for the call's span, so that training finds the episode whole; past it the feedback "
        "is recorded anyway (a call longer than this is rare: max_tokens bounds it).",
    )
    retention_days: float | None = Field(
        None,
        gt=0,
        description="Production episodes idle for longer than this (no call, no feedback) are "
        "moved to the archive by `lightning-rl data archive`; None: only when that command "
        "names a window. A year of traffic at 20,000 episodes a week is 1,000,000 episodes.",
    )
    archive_dir: str | None = Field(
        None,
        description="Folder of the archive's Parquet batches; None: `<db>.archive` beside the "
        "store's file. Analytics and data=episodes runs read it there.",
    )
    # The environment's (default 1e6) when not given, so that a store built in code (the
    # production CLI's) keeps the range its clients read from the same variable.
    max_abs_reward: float = Field(
        default_factory=environment_max_abs_reward,
        gt=0,
        le=LIMIT_MAX_ABS_REWARD,
        description="The reward range: a reward span, an attempt's reward or a feedback value "
        "beyond +-this is refused (400) and never stored. Agents' runners and the training flow "
        "read LIGHTNING_MAX_ABS_REWARD too: set it alike on the server and its clients.",
    )
    max_feedback_sources: int = Field(
        16,
        ge=1,
        le=10_000,
        description="Feedback sources per episode: feedback from a new source past this many "
        "is refused (429); a source the episode has may still change its value.",
    )
    max_live_episodes: int = Field(
        # A year of traffic (retention_days) fits: benchmarks/store_scale.py holds as many.
        1_000_000,
        ge=1,
        description="Production episodes the store holds in memory (about 3 KB each without "
        "labels): past it a new episode, and the call that opens it, is refused (429) until "
        "idle ones are archived (retention_days); the episodes it has keep working.",
    )
    max_episode_metadata_bytes: int = Field(
        1024**3,
        ge=0,
        description="Bytes (as JSON) of labels held in memory: episodes' metadata and their "
        "feedback's metadata and comments. A new episode or feedback that brings labels past "
        "it is refused (429) until idle episodes are archived; one without labels is not.",
    )
    archive_batch_episodes: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="Episodes moved per archive batch: each batch holds the store's writes "
        "while it is deleted, so a smaller batch is a shorter pause (BENCHMARKS.md).",
    )

    def archive_folder(self) -> str | None:
        """Where the archive lives; None for a store in memory without archive_dir."""
        if self.archive_dir is not None:
            return self.archive_dir
        return None if self.db == ":memory:" else f"{self.db}.archive"
