"""The key the project's servers ask for (LIGHTNING_API_KEY for the store and gateway, a
replica's LIGHTNING_REPLICA_KEY): the header its clients send, and the servers' check of it."""

from __future__ import annotations

import hmac


def bearer_header(key: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` as a header mapping; empty without a key."""
    return {"authorization": f"Bearer {key}"} if key else {}


def key_matches(given: bytes, key: str | None, scheme: str = "Bearer ") -> bool:
    """Whether a header's value is `<scheme><key>`; True when no key is asked for. In
    constant time: compare_digest takes as long wherever the first differing byte is."""
    if not key:
        return True
    return hmac.compare_digest(given, f"{scheme}{key}".encode())
