"""The key the project's servers ask for (LIGHTNING_API_KEY for the store and gateway, a
replica's LIGHTNING_REPLICA_KEY): the header its clients send, and the servers' check of it."""

from __future__ import annotations

import hmac
from collections.abc import Callable


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
