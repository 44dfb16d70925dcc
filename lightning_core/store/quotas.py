"""Bounds on what production traffic makes the store hold in memory.

The store keeps every live production episode, its labels and the feedback that counts for it in
memory (episodes.py), for as long as the episode is not archived: about 3 KB an episode without
labels, and its labels' size beside (measured: 30.7 MB RSS per 10,000 empty episodes, 650 MB
per 10,000 with 60 KiB of labels each). Unbounded, one client opening episodes in a loop, or
adding sources to one episode, grows the server until it is killed. Each bound below is a
setting of the store (config.py); what goes past one is refused with a 429 that names it, and
nothing stored is lost: episodes the store has keep working, and archiving idle episodes
(retention.py) makes room again. A new episode is refused rather than an old one dropped from
memory, since the store answers for episodes (feedback, training reads) from its memory only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from lightning_core.errors import RateLimited

if TYPE_CHECKING:
    from lightning_core.store.config import StoreConfig
    from lightning_core.types import Feedback, FeedbackIn

_ARCHIVE = "archive idle episodes (LIGHTNING_RETENTION_DAYS, `lightning-rl data archive`)"


def labels_bytes(labels: dict[str, Any]) -> int:
    """The size of `labels` as JSON; 0 for none."""
    return len(orjson.dumps(labels)) if labels else 0


def feedback_bytes(row: Feedback | FeedbackIn) -> int:
    """What a feedback row holds in memory beside its fixed fields: its labels and comment."""
    return labels_bytes(row.metadata) + (len(row.comment.encode()) if row.comment else 0)


def check_live_episodes(live: int, config: StoreConfig) -> None:
    """RateLimited if a new episode would take the store past max_live_episodes."""
    if live >= config.max_live_episodes:
        raise RateLimited(
            f"the store holds {live} live production episodes, its limit "
            f"(LIGHTNING_MAX_LIVE_EPISODES={config.max_live_episodes}): a new episode is refused "
            f"until there is room; {_ARCHIVE}, or raise the limit",
            retry=False,
        )


def check_sources(episode_id: str, sources: int, config: StoreConfig) -> None:
    """RateLimited if the episode, with `sources` already, may take no new source."""
    if sources >= config.max_feedback_sources:
        raise RateLimited(
            f"episode {episode_id!r} has feedback from {sources} sources, the limit "
            f"(LIGHTNING_MAX_FEEDBACK_SOURCES={config.max_feedback_sources}): a new source is "
            "refused; its sources may still change their values",
            retry=False,
        )


def check_labels(held: int, adding: int, what: str, config: StoreConfig) -> None:
    """RateLimited if `adding` bytes of labels would take the store past
    max_episode_metadata_bytes (nothing added never is)."""
    cap = config.max_episode_metadata_bytes
    if adding > 0 and held + adding > cap:
        raise RateLimited(
            f"{what} brings {adding} bytes of metadata and comments; the store holds {held} "
            f"bytes of episodes' labels, and its limit is "
            f"LIGHTNING_MAX_EPISODE_METADATA_BYTES={cap}: {_ARCHIVE}, send it without labels, "
            "or raise the limit",
            retry=False,
        )
