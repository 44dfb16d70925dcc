"""Server-sent events as the client APIs frame them.

OpenAI's chat and text completions send bare `data:` lines and end with `data: [DONE]`; the
Responses and Anthropic Messages APIs name each event (`event: <type>`, the `type` of its data).
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def named_sse(event: dict[str, Any]) -> bytes:
    """An event named by its own `type`."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
