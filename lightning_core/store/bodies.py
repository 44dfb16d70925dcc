"""The models of the store's HTTP API that are not store types: request bodies, a GET's query
string, and the small answers that wrap a number. Their bounds are the server's limits."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

from lightning_core.store.base import MAX_PAGE_SIZE, NEXT_PAGE_HEADER, PAGE_SIZE
from lightning_core.types import (
    Feedback,
    FiniteFloat,
    Labels,
    Rollout,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    Span,
    Transition,
)

# Long polls are capped so that a proxy or client timeout never cuts a request mid-wait.
MAX_WAIT_S = 30.0
# Rollouts one query or wait may name: a wait rescans its ids whenever any rollout finishes, and
# a 64 MB body holds a million ids. An iteration's batch (hundreds) is far under it.
MAX_QUERY_IDS = 10_000


def _each_once(ids: list[str]) -> list[str]:
    # 100 long polls on 10,000 copies of one id cost 190 ms of the loop per finished rollout,
    # each rescanning its copies; the same id twice asks nothing more.
    return list(dict.fromkeys(ids))


QueryIds = Annotated[
    list[str],
    Field(
        max_length=MAX_QUERY_IDS,
        description=f"At most {MAX_QUERY_IDS}; ask in batches. Each id counts once.",
    ),
    AfterValidator(_each_once),
]
PageLimit = Annotated[
    int | None,
    Field(
        ge=0,
        le=MAX_PAGE_SIZE,
        description=f"Items in this page, at most {MAX_PAGE_SIZE}; null: {PAGE_SIZE}. When more "
        f"are left the answer's {NEXT_PAGE_HEADER} header is the cursor to send as `after`.",
    ),
]
PageCursor = Annotated[
    str | None,
    Field(
        max_length=1000,
        description=f"The {NEXT_PAGE_HEADER} header of the previous page; null: the first.",
    ),
]


# A body's fields are the keyword arguments of the store method its endpoint calls (api.py).


class EnqueueBody(BaseModel):
    # "rollouts" on the wire, the store's `requests` argument in Python.
    requests: list[RolloutRequest] = Field(alias="rollouts")


class DequeueBody(BaseModel):
    worker_id: str = Field(min_length=1, description="Who claims the work (host:pid:n).")
    wait: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="Seconds to wait for work.")


class CompleteBody(BaseModel):
    reward: FiniteFloat | None = None


class FailBody(BaseModel):
    error: str
    retry: bool = True


class RolloutQuery(BaseModel):
    rollout_ids: QueryIds | None = None
    status: list[RolloutStatus] | None = None
    mode: RolloutMode | None = None
    group_id: str | None = None
    limit: PageLimit = None
    after: PageCursor = None


class WaitBody(BaseModel):
    rollout_ids: QueryIds
    timeout: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class SpansBody(BaseModel):
    spans: list[Span]


class SpanQuery(BaseModel):
    rollout_ids: QueryIds
    attempt_id: str | None = Field(None, description='An attempt id, "latest" or null for all.')
    limit: PageLimit = None
    after: PageCursor = None


class TransitionsBody(BaseModel):
    transitions: list[Transition]


class TransitionQuery(BaseModel):
    rollout_ids: QueryIds | None = None
    policy_version: str | None = None
    limit: PageLimit = None
    after: PageCursor = None


class Count(BaseModel):
    count: int


class EpisodeBody(BaseModel):
    agent_name: str | None = Field(None, description="The agent of the first call.")
    policy_version: str | None = Field(None, description="The policy that served it.")
    metadata: Labels = Field(default_factory=dict, description="Free-form labels.")


class Episode(BaseModel):
    rollout: Rollout
    feedback: list[Feedback]


class Watermark(BaseModel):
    seq: int


# Seqs are DuckDB BIGINTs: a bigger number in a query is refused here, not by the database.
MAX_SEQ = 2**63 - 1
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]


class FeedbackWindow(BaseModel):
    """GET /feedback's query string."""

    after_seq: Seq = 0
    through_seq: Seq | None = None
    limit: Annotated[int | None, Field(ge=0, le=MAX_PAGE_SIZE)] = None
    after: Annotated[str | None, Field(max_length=1000)] = None


class FeedbackQuery(BaseModel):
    after_seq: Seq = Field(0, description="Read feedback recorded after this seq.")
    through_seq: Seq | None = Field(None, description="Up to this seq; None: the watermark.")
    episode_ids: QueryIds | None = Field(
        None, description="These episodes' feedback instead of a window's (after_seq aside)."
    )
    limit: PageLimit = None
    after: PageCursor = None


class ArchiveBody(BaseModel):
    older_than_days: float | None = Field(
        None,
        gt=0,
        le=36_500,
        description="Archive episodes idle for longer than this; null: the store's retention_days.",
    )
    max_episodes: int | None = Field(
        None, ge=1, description="Archive at most this many (the oldest first); null: all."
    )


class ArchiveReport(BaseModel):
    """What one archive run moved out of the store, and the store file around it."""

    episodes: int = Field(description="Episodes moved to the archive.")
    batches: list[str] = Field(description="The archive batches written, in order.")
    rows: dict[str, int] = Field(description="Rows moved per table.")
    cutoff: float = Field(description="Episodes idle since before this time were archived.")
    folder: str = Field(description="The archive folder.")
    seconds: float = Field(description="How long the archive took, checkpoint included.")
    file_bytes_before: int = Field(description="The store's file and WAL before.")
    file_bytes_after: int = Field(description="The store's file and WAL after the checkpoint.")
