"""The servers' edge: what a client may hold of a server before any route runs.

`lightning-rl serve` and a policy replica run uvicorn through `run_server`, which adds what
uvicorn lacks: a deadline and a size cap on the request head (uvicorn waits forever for headers,
so 19,990 idle connections without a key held every file descriptor and /health was refused),
and a cap on open connections, where idle ones make way for new ones. The
body's deadline and the Host/Origin check live in the store's ASGI middleware
(store/middleware.py), which calls `origin_refusal`: a keyless server answers loopback Host names
only, and no cross-site browser request, so that a web page in the user's browser cannot read or
write the store (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field


class HttpLimits(BaseModel):
    """How long and how much one client may take of a server."""

    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a connection may take to send a request's headers, from its first "
        "byte (or from connecting); past it the connection is closed. Clients send headers at "
        "once; only a stalled or hostile client takes longer.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a request's body may go without a byte arriving; past it the "
        "request is answered 408 and its partial body dropped (a client that stops mid-body "
        "would otherwise hold up to --max-request-bytes of memory forever).",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="Open connections one server holds. Past it a new connection closes the one "
        "that has waited longest for its request head, or, with all in requests, is answered 503. "
        "Lowered to fit the process's file limit (ulimit -n), less 256 for its files.",
    )
    max_otlp_spans: int = Field(
        4096,
        ge=1,
        description="Spans one OTLP export (/v1/traces) may carry, answered 413 past it; 8 times "
        "what OpenTelemetry's batch exporter sends (512). Storing a span costs the event loop "
        "~20 us, so an export at the cap holds every other request up to ~80 ms.",
    )


# Descriptors kept for what the server opens besides connections: the store's files, the
# model's, the database worker's pipes, logs.
_FILE_RESERVE = 256


def connection_cap(limits: HttpLimits) -> int:
    """`max_connections`, lowered to what the file limit leaves (at least 16)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(16, min(limits.max_connections, soft - _FILE_RESERVE))


# A request head's most bytes. uvicorn's httptools parser keeps every header it is sent: 200 MB
# of headers grew the server by 196 MB. Clients send well under 8 KiB (nginx's buffer).
MAX_HEAD_BYTES = 64 * 1024

# How long `lightning-rl serve` keeps an idle connection: longer than clients keep theirs
# (KEEPALIVE_S in store/client.py), so that a client never sends on a connection the server is
# closing.
SERVER_KEEPALIVE_S = 30

_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def _guarded_protocol(base: type[asyncio.Protocol], header_timeout_s: float, cap: int) -> type:
    """uvicorn's HTTP protocol (`base`) with a deadline and a size cap on each request head, and
    a cap on connections. Headers are complete when uvicorn starts a new request cycle, which
    both of its protocols (httptools, h11) do, so that is what this watches.

    At the cap a new connection first makes way by closing the one that has waited longest for
    its request head (idle, or a slowloris): a flood of idle connections then costs the clients
    that do send requests nothing. Only when every connection is in a request is it refused."""
    import orjson

    from lightning_core.errors import error_body

    full = orjson.dumps(
        error_body(
            "StoreUnavailable",
            f"all {cap} connections the server holds are in requests; retry later, or raise "
            "LIGHTNING_MAX_CONNECTIONS",
        )
    )
    refusal = _FULL % (len(full), full)
    why = b"request head over %d bytes" % MAX_HEAD_BYTES
    head_too_large = _HEAD_TOO_LARGE % (len(why), why)
    # Connections waiting for a request head, oldest first (dicts keep insertion order).
    waiting: dict[Any, None] = {}

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None
        _cycle_seen: Any = None
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                if not waiting:
                    transport.write(refusal)
                    transport.close()
                    return
                next(iter(waiting))._drop()
            # From connecting: a connection that never sends a byte is a head never finished.
            self._arm()

        def data_received(self, data: bytes) -> None:
            between = self.cycle is None or self.cycle.response_complete
            if self._head_timer is None and between:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            in_head = self._head_timer is not None
            super().data_received(data)
            if self.cycle is not self._cycle_seen:  # a new request's headers are complete
                self._cycle_seen = self.cycle
                self._disarm()
            elif in_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self.transport.write(head_too_large)
                    self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(header_timeout_s, self._drop)
            waiting[self] = None

        def _disarm(self) -> None:
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _drop(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def run_server(
    app: Any, host: str, port: int, log_level: str, keepalive_s: int, limits: HttpLimits
) -> None:
    """uvicorn serving `app` on `host`:`port` until SIGINT, within `limits`."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=keepalive_s,
        http=_guarded_protocol(AutoHTTPProtocol, limits.header_timeout_s, connection_cap(limits)),
    )


_LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address, or a Host header's name with or without its port) names
    this machine; a name other than localhost may resolve anywhere, so it does not."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1] or [::1]:port
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:  # name:port; more colons: a bare IPv6 address
        host = host.split(":")[0]
    host = host.rstrip(".")  # "localhost." is localhost
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_refusal(headers: dict[bytes, bytes], keyed: bool) -> str | None:
    """Why a request is refused by where it comes from, or None to serve it.

    A keyless server (loopback only; settings.check_exposure) trusts whoever can connect, so a
    browser must not be able to reach it: a page on attacker.example whose name is made to
    resolve to 127.0.0.1 sends `Host: attacker.example`, and any cross-site page sends an Origin
    that is not this machine (or `Sec-Fetch-Site: cross-site`). A keyed server is reached under
    any name (behind proxies), and a browser never holds its key unless the user gave it one.
    """
    if keyed:
        return None
    host = headers.get(b"host")
    if host is not None and not is_loopback(host.decode("latin-1")):
        return (
            f"Host {host.decode('latin-1')!r} is not this machine: a server without an API key "
            "answers loopback names only (127.0.0.1, localhost, [::1]); set LIGHTNING_API_KEY to "
            "serve other names"
        )
    origin = headers.get(b"origin")
    if origin is not None:
        # "null": a sandboxed frame or a file, which any page can make itself into.
        netloc = urlsplit(origin.decode("latin-1")).netloc
        if not is_loopback(netloc):
            return (
                f"cross-site request from Origin {origin.decode('latin-1')!r} refused: a server "
                "without an API key answers pages of this machine only; set LIGHTNING_API_KEY"
            )
    if headers.get(b"sec-fetch-site", b"").lower() == b"cross-site":
        return (
            "cross-site browser request refused (Sec-Fetch-Site: cross-site): a server without an "
            "API key answers pages of this machine only; set LIGHTNING_API_KEY"
        )
    return None
