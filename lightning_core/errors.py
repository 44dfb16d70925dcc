"""Errors a user or a client can cause, each with the HTTP status the server answers with.

The HTTP client raises the same types from the server's answers, so code that handles errors
works the same against the in-process store and a remote one.
"""

from __future__ import annotations

import orjson


class LightningError(Exception):
    """Base of every error that says what the user did wrong and how to fix it."""

    status_code = 400

    def headers(self) -> dict[str, str]:
        """HTTP headers to answer with, beside the status and the body."""
        return {}


class InvalidInput(LightningError):
    status_code = 400


class NotFound(LightningError):
    status_code = 404


class IllegalTransition(LightningError):
    """A status change the rollout or attempt lifecycle does not allow."""

    status_code = 409


class Conflict(LightningError):
    """The thing already exists (a policy version name is taken)."""

    status_code = 409


class PayloadTooLarge(LightningError):
    status_code = 413


class Unauthorized(LightningError):
    status_code = 401


class Forbidden(LightningError):
    """The key is right but does not open this: an agent key writing another attempt's spans."""

    status_code = 403


class RateLimited(LightningError):
    """Past a limit on calls (gateway/limits.py). `retry` says whether the same call may pass
    later (too many at once) or never will (a spent budget); clients read it from the
    `x-should-retry` header, which the OpenAI and Anthropic SDKs obey."""

    status_code = 429

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "true" if self.retry else "false"}


class DiskFull(LightningError):
    """A write found its disk full (or the user's quota spent); what was written before stands."""

    status_code = 507


class StoreUnavailable(LightningError):
    """The store server cannot be reached or answered with a server error."""

    status_code = 503


class BackendUnavailable(LightningError):
    """A policy backend (a replica process, a vLLM server) cannot be reached or answered with a
    server error; another replica may serve the call (backends/replicas.py)."""

    status_code = 503


ERRORS_BY_NAME: dict[str, type[LightningError]] = {
    cls.__name__: cls
    for cls in (
        LightningError,
        InvalidInput,
        NotFound,
        IllegalTransition,
        Conflict,
        PayloadTooLarge,
        Unauthorized,
        RateLimited,
        DiskFull,
        StoreUnavailable,
        BackendUnavailable,
    )
}


def error_body(kind: str, message: str) -> dict[str, dict[str, str]]:
    """The body the project's own servers (the store, a replica) answer an error with; the
    client side reads it back with `error_from_answer`."""
    return {"error": {"type": kind, "message": message}}


def error_from_answer(
    status: int,
    payload: bytes,
    server: str = "store",
    unavailable: type[LightningError] = StoreUnavailable,
) -> LightningError:
    """The error a server's 4xx/5xx answer stands for, raised again on the client's side: the
    class named in its `{"error": {"type", "message"}}` body; a 5xx without one is
    `unavailable` (the server is in trouble, not the request)."""
    try:
        return error_from_body(orjson.loads(payload)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = payload[:500].decode(errors="replace")
        if status >= 500:
            return unavailable(f"{server} answered {status}: {text}")
        return LightningError(f"{server} answered {status}: {text}")


def error_from_body(error: dict) -> LightningError:
    """The error an `{"type", "message"}` object names (KeyError/TypeError if it is not one)."""
    return ERRORS_BY_NAME.get(error["type"], LightningError)(error["message"])


class PolicyNotServed(LightningError):
    """A published policy version does not answer as its adapter should: the server kept the
    previous weights under the new name (a load that was skipped or failed silently), so
    every rollout after it would train on another policy's tokens (data/provenance.py)."""

    status_code = 503


class BudgetSpent(LightningError):
    """A run spent what its config allows of something it pays for (judge calls or tokens)."""

    status_code = 429
