"""For production apps: name the episode of a call, and send its reward when it is known.

An agent in production calls the gateway's plain /v1 routes with `episode_headers(id)` (or
`metadata={"episode_id": id}`); every such call is recorded on that episode. When the outcome is
known (a user's thumbs-up, a test that passed, an hour later), `send_feedback` gives the
episode its reward, per source: the newest value of each (episode, source) is the one training
uses. Sending the same value again is harmless, so a retry loop around it is safe.

Light on purpose (httpx and the data model, nothing of the training side), so that any service
can import it.
"""

from __future__ import annotations

import os
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from lightning_core import semconv
from lightning_core.errors import InvalidInput, StoreUnavailable, error_from_answer
from lightning_core.security.keys import bearer_header
from lightning_core.types import FeedbackIn, FeedbackReceipt, episode_rollout_id

__all__ = ["episode_headers", "send_feedback"]


def episode_headers(episode_id: str) -> dict[str, str]:
    """The headers that put a call in episode `episode_id`; InvalidInput for a bad id.

    For OpenAI's client: `extra_headers=episode_headers(id)` on a call, or
    `default_headers=...` on a client that serves one session."""
    episode_rollout_id(episode_id)
    return {semconv.EPISODE_HEADER: episode_id}


def send_feedback(
    server_url: str,
    episode_id: str,
    value: float,
    source: str = "user",
    *,
    api_key: str | None = None,
    time: float | None = None,
    comment: str | None = None,
    timeout: float = 10.0,
) -> FeedbackReceipt:
    """Give episode `episode_id` the reward `value` from `source`, on the server at
    `server_url` (its root, e.g. http://127.0.0.1:4747); the key defaults to
    LIGHTNING_API_KEY. Raises lightning_core.errors types: InvalidInput for a bad value or id,
    NotFound for an episode the gateway has not seen, Unauthorized for a wrong key,
    StoreUnavailable when the server cannot be reached."""
    episode_rollout_id(episode_id)
    # Checked here as the server would: a NaN or a string fails before anything is sent.
    try:
        body = FeedbackIn(value=value, source=source, time=time, comment=comment)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidInput(f"feedback for episode {episode_id!r} not sent: {problems}") from None
    key = api_key if api_key is not None else os.environ.get("LIGHTNING_API_KEY")
    headers = bearer_header(key)
    url = f"{server_url.rstrip('/')}/episodes/{quote(episode_id, safe='')}/feedback"
    try:
        response = httpx.post(
            url, json=body.model_dump(mode="json"), headers=headers, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise StoreUnavailable(f"cannot reach the server at {server_url}: {exc!r}") from exc
    if response.status_code >= 400:
        raise error_from_answer(response.status_code, response.content)
    return FeedbackReceipt.model_validate(response.json())
