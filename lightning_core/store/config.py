"""Configuration of the store: where it lives and when a silent attempt is given up on."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
