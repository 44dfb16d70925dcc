"""The store's HTTP API, declared once: a table of its endpoints.

The server's routes (routes.py) and the HTTP client's requests (client.py) are both derived from
this table, so an endpoint is added (or moved, or made safe to retry) here, in one place. Each
entry says how a store operation travels over HTTP; its typed Python signature stays in the
LightningStore protocol (base.py), and its one implementation in DuckDBStore.

This module imports neither FastAPI nor the store: a client loads it without the server.
"""

from __future__ import annotations

import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter

from lightning_core.store.bodies import (
    ArchiveBody,
    ArchiveReport,
    CompleteBody,
    Count,
    DequeueBody,
    EnqueueBody,
    Episode,
    EpisodeBody,
    FailBody,
    FeedbackQuery,
    FeedbackWindow,
    RolloutQuery,
    SpanQuery,
    SpansBody,
    TransitionQuery,
    TransitionsBody,
    WaitBody,
    Watermark,
)
from lightning_core.types import (
    Attempt,
    Claim,
    Feedback,
    FeedbackIn,
    FeedbackReceipt,
    PolicyVersion,
    Rollout,
    Span,
    Transition,
)


@dataclass(frozen=True, eq=False)
class Endpoint:
    """One operation of the store over HTTP.

    The server answers `method path` by calling the store method `calls` with the path's
    parameters (in order, as strings) and the request's arguments, and sends its result back.
    Compared by identity, so that an endpoint can key a mapping (the server's wrappers).
    """

    # The route's name: FastAPI derives the operation's id (and, without `summary`, its
    # summary) from it, so it must not change once clients of the OpenAPI schema exist.
    name: str
    method: Literal["GET", "POST"]
    # Path parameters in braces, in the order of the store method's arguments.
    path: str
    # The store method (of DuckDBStore) the server calls, or a function of (store, *path
    # parameters, **arguments) where an answer takes more than one call.
    calls: str | Callable[..., Awaitable[Any]]
    # The answer's model: the route's response model, and how the client reads the answer (a
    # paged query's whole result, all pages together).
    response: Any
    # The request's arguments: a POST's JSON body, a GET's query string. Its fields are the
    # store method's keyword arguments, unless `body_as` names the one argument it is.
    body: type[BaseModel] | None = None
    body_as: str | None = None
    # The store's result is answered as {wrap: result} (Count, Watermark), the client unwraps it.
    wrap: str | None = None
    # A repeat of a request whose answer was lost does no harm, so the client sends it again
    # (client.py's docstring says why each one is safe); otherwise only a request that never
    # reached the server is.
    repeatable: bool = True
    # A page of a query: the body takes `limit` (None: base.PAGE_SIZE) and `after`, the store
    # method returns (items or their JSON, the next page's cursor), and the answer carries
    # that cursor in NEXT_PAGE_HEADER. The client follows the cursors to the end.
    paged: bool = False
    summary: str | None = None
    # The status of a success: `status_code` as documented (None: 200), `status_of` where it
    # depends on the store's result; `responses` documents other successes.
    status_code: int | None = None
    status_of: Callable[[Any], int] | None = None
    responses: dict[int | str, Any] = field(default_factory=dict)
    # The body's list field whose items are validated off the event loop, a slice at a time
    # (routes.py): a write of thousands of them would hold the loop for tens of milliseconds.
    chunked: str | None = None

    @cached_property
    def path_params(self) -> tuple[str, ...]:
        return tuple(name for _, name, _, _ in string.Formatter().parse(self.path) if name)

    def url(self, *values: str) -> str:
        """The path with these values of its parameters (the caller quotes them if it must)."""
        if len(values) != len(self.path_params):
            raise TypeError(f"{self.method} {self.path} takes {self.path_params}, got {values}")
        return self.path.format(**dict(zip(self.path_params, values, strict=True)))

    @cached_property
    def answer(self) -> TypeAdapter[Any]:
        """Reads an answer (unwrapped) into the response model."""
        if self.wrap is not None:
            return TypeAdapter(self.response.model_fields[self.wrap].annotation)
        return TypeAdapter(self.response)


async def _episode(store: Any, episode_id: str) -> Episode:
    """An episode's rollout with the feedback that counts: two reads, one answer."""
    rollout = await store.get_episode(episode_id)
    return Episode(rollout=rollout, feedback=await store.query_feedback(episode_ids=[episode_id]))


def _feedback_status(receipt: FeedbackReceipt) -> int:
    return 201 if receipt.status == "recorded" else 200


# The table. Each entry is two lines (how it is reached; what it does), kept so by hand.
# fmt: off

# ------------------------------------------------------------------ the queue

ENQUEUE = Endpoint(
    "enqueue", "POST", "/store/rollouts",
    calls="enqueue_rollouts", body=EnqueueBody, response=list[Rollout],
)
QUERY_ROLLOUTS = Endpoint(
    "query_rollouts", "POST", "/store/rollouts/query",
    calls="query_rollouts_page", body=RolloutQuery, response=list[Rollout], paged=True,
)
GET_ROLLOUT = Endpoint(
    "get_rollout", "GET", "/store/rollouts/{rollout_id}",
    calls="get_rollout", response=Rollout,
)
CANCEL = Endpoint(
    "cancel", "POST", "/store/rollouts/{rollout_id}/cancel",
    calls="cancel_rollout", response=Rollout,
)
ATTEMPTS = Endpoint(
    "attempts", "GET", "/store/rollouts/{rollout_id}/attempts",
    calls="query_attempts", response=list[Attempt],
)
WAIT = Endpoint(
    "wait", "POST", "/store/wait",
    calls="wait_for_rollouts", body=WaitBody, response=list[Rollout],
)
# Not repeated after a lost answer: the store may have made the claim, and a repeat would claim
# another rollout while the first waits out unresponsive_timeout_s.
DEQUEUE = Endpoint(
    "dequeue", "POST", "/store/dequeue",
    calls="dequeue", body=DequeueBody, response=Claim | None, repeatable=False,
)
HEARTBEAT = Endpoint(
    "heartbeat", "POST", "/store/attempts/{attempt_id}/heartbeat",
    calls="heartbeat", response=Attempt,
)
COMPLETE = Endpoint(
    "complete", "POST", "/store/attempts/{attempt_id}/complete",
    calls="complete_attempt", body=CompleteBody, response=Rollout,
)
FAIL = Endpoint(
    "fail", "POST", "/store/attempts/{attempt_id}/fail",
    calls="fail_attempt", body=FailBody, response=Rollout,
)

# ------------------------------------------------------------------ spans and transitions

ADD_SPANS = Endpoint(
    "add_spans", "POST", "/store/spans",
    calls="add_spans", body=SpansBody, response=Count, wrap="count", chunked="spans",
)
QUERY_SPANS = Endpoint(
    "query_spans", "POST", "/store/spans/query",
    calls="query_spans_json", body=SpanQuery, response=list[Span], paged=True,
)
# Not repeated after a lost answer: transitions have no key, a repeat would store them twice.
ADD_TRANSITIONS = Endpoint(
    "add_transitions", "POST", "/store/transitions",
    calls="add_transitions", body=TransitionsBody, response=Count, wrap="count",
    repeatable=False,
)
QUERY_TRANSITIONS = Endpoint(
    "query_transitions", "POST", "/store/transitions/query",
    calls="query_transitions_json", body=TransitionQuery, response=list[Transition], paged=True,
)

# ------------------------------------------------------------------ policy versions

ADD_POLICY_VERSION = Endpoint(
    "add_policy_version", "POST", "/store/policy-versions",
    calls="add_policy_version", body=PolicyVersion, body_as="version", response=PolicyVersion,
)
LIST_POLICY_VERSIONS = Endpoint(
    "list_policy_versions", "GET", "/store/policy-versions",
    calls="list_policy_versions", response=list[PolicyVersion],
)
GET_POLICY_VERSION = Endpoint(
    "get_policy_version", "GET", "/store/policy-versions/{name}",
    calls="get_policy_version", response=PolicyVersion,
)

# ------------------------------------------------------------------ production episodes
# The paths a production app calls, outside /store.

# Repeatable: a repeat finds the episode the first one opened.
OPEN_EPISODE = Endpoint(
    "open_episode", "POST", "/episodes/{episode_id}",
    calls="open_episode", body=EpisodeBody, response=Attempt, summary="Open an episode",
)
GET_EPISODE = Endpoint(
    "get_episode", "GET", "/episodes/{episode_id}",
    calls=_episode, response=Episode, summary="An episode and feedback",
)
# Repeatable: the same value again is "unchanged", not a second row. (A repeat after a lost
# answer therefore reads "unchanged" where the lost answer said "recorded".)
ADD_FEEDBACK = Endpoint(
    "add_feedback", "POST", "/episodes/{episode_id}/feedback",
    calls="add_feedback", body=FeedbackIn, body_as="feedback", response=FeedbackReceipt,
    summary="Give an episode a reward (201 recorded; 200 unchanged or replaced)",
    status_code=201, status_of=_feedback_status,
    responses={200: {"model": FeedbackReceipt, "description": "unchanged or replaced"}},
)
FEEDBACK_WINDOW = Endpoint(
    "feedback_window", "GET", "/feedback",
    calls="query_feedback_json", body=FeedbackWindow, response=list[Feedback], paged=True,
    summary="Feedback that counts, by window",
)
# The same with a body, where a list of episode ids fits (a query string of thousands does not
# fit in a request line).
QUERY_FEEDBACK = Endpoint(
    "query_feedback", "POST", "/feedback/query",
    calls="query_feedback_json", body=FeedbackQuery, response=list[Feedback], paged=True,
    summary="Feedback that counts",
)
FEEDBACK_WATERMARK = Endpoint(
    "feedback_watermark", "GET", "/feedback/watermark",
    calls="feedback_watermark", response=Watermark, wrap="seq", summary="Highest feedback seq",
)

# ------------------------------------------------------------------ retention

# Repeatable: a repeat archives what is idle and still in the store, nothing twice. Admin only
# (the middleware lets agent keys reach their own spans and the gateway, nothing else).
ARCHIVE = Endpoint(
    "archive", "POST", "/store/archive",
    calls="archive_episodes", body=ArchiveBody, response=ArchiveReport,
    summary="Archive idle production episodes",
)

# fmt: on

# Every endpoint declared above, in the order the server matches them.
ENDPOINTS: tuple[Endpoint, ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Endpoint)
)
