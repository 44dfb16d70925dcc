"""The key the project's servers ask for (LIGHTNING_API_KEY for the store and gateway, a
replica's LIGHTNING_REPLICA_KEY): the header its clients send, and the servers' check of it.

Beside the admin key, an agent key: what a runner hands an agent for one attempt. It opens
that attempt's gateway routes (`/rollouts/<r>/attempts/<a>/v1/...`) and the span writes
(`/v1/traces`, `/store/spans`), nothing else of the store: an agent's framework that logs or
leaks its key exposes one attempt, not the store's queue, policy versions or feedback. The key
is `lrl-agent-<attempt_id>.<hmac_sha256(admin key, "agent:<attempt_id>")>`, so the server
checks it with the admin key alone, no state, and it dies with the admin key.

Spans written with an agent key must all be its own attempt's: the check lets the request in
and names the attempt (`span_attempt`), which the span routes compare with every decoded span
(store/server.py). Limit: an agent that runs in the runner's process can reach the runner's own
admin key in memory: the agent key bounds what a leaked key opens, not what hostile code in
that process can do.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping

from lightning_core.errors import Forbidden

AGENT_KEY_PREFIX = "lrl-agent-"
# The gateway routes an attempt's prefix serves (gateway/routes.py), as its agent calls them.
_AGENT_ROUTES = frozenset({"chat/completions", "completions", "responses", "messages", "models"})
# Span writes: OTLP/HTTP and the store's own JSON route.
SPAN_PATHS = frozenset({"/v1/traces", "/store/spans"})


def bearer_header(key: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` as a header mapping; empty without a key."""
    return {"authorization": f"Bearer {key}"} if key else {}


def key_check(key: str | None, scheme: str = "Bearer ") -> Callable[[bytes], bool]:
    """Whether a header's value is `<scheme><key>`; always true when no key is asked for.
    Built once per server, so a request costs only the comparison, which is in constant time:
    compare_digest takes as long wherever the first differing byte is."""
    if not key:
        return lambda _given: True
    expected = f"{scheme}{key}".encode()
    return lambda given: hmac.compare_digest(given, expected)


def agent_key(admin_key: str, attempt_id: str) -> str:
    """The key an agent gets for the attempt `attempt_id` of a server keyed with `admin_key`."""
    return f"{AGENT_KEY_PREFIX}{attempt_id}.{_agent_mac(admin_key.encode(), attempt_id)}"


def _agent_mac(secret: bytes, attempt_id: str) -> str:
    return hmac.new(secret, f"agent:{attempt_id}".encode(), hashlib.sha256).hexdigest()


def _presented(headers: Mapping[bytes, bytes]) -> str | None:
    """The agent key a request carries, as a bearer token (OpenAI's clients) or as x-api-key
    (Anthropic's); None when it carries none."""
    bearer = headers.get(b"authorization", b"")
    value = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
    key = value.decode("latin-1")
    return key if key.startswith(AGENT_KEY_PREFIX) else None


def _attempt_of(path: str) -> str | None:
    """The attempt of a gateway route under an attempt's prefix; None for any other path."""
    parts = path.split("/", 6)
    if (
        len(parts) == 7
        and parts[:2] == ["", "rollouts"]
        and parts[3] == "attempts"
        and parts[5] == "v1"
        and parts[6] in _AGENT_ROUTES
    ):
        return parts[4]
    return None


def agent_key_check(admin_key: str | None) -> Callable[[Mapping[bytes, bytes], str], str | None]:
    """The attempt whose agent key a request's headers carry, if that key opens `path` (a span
    write, or a gateway route of the key's own attempt); None otherwise, and always without an
    admin key (a keyless server asks for none). A forged key costs one HMAC, compared in
    constant time."""
    if not admin_key:
        return lambda _headers, _path: None
    secret = admin_key.encode()

    def opens(headers: Mapping[bytes, bytes], path: str) -> str | None:
        key = _presented(headers)
        if key is None:
            return None
        attempt_id, dot, mac = key[len(AGENT_KEY_PREFIX) :].rpartition(".")
        if not dot or not attempt_id:
            return None
        if not hmac.compare_digest(mac.encode(), _agent_mac(secret, attempt_id).encode()):
            return None
        if path in SPAN_PATHS or _attempt_of(path) == attempt_id:
            return attempt_id
        return None

    return opens


def check_span_owner(only_attempt: str | None, attempt_ids: Iterable[str]) -> None:
    """Forbidden unless every span is of `only_attempt`, the attempt of the agent key that
    wrote them (None: the admin key, or a keyless server, which may write any)."""
    if only_attempt is None:
        return
    others = {a for a in attempt_ids if a != only_attempt}
    if others:
        raise Forbidden(
            f"an agent key of attempt {only_attempt} may write that attempt's spans only, not "
            f"those of {sorted(others)[:3]}"
        )
