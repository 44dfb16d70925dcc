"""The reload webhook of `lightning-rl production`: MLflow's model-version-alias webhooks, and
calls from Prefect automations, that tell the alias follower to look at the registry now.

Untrusted input: anyone who reaches the port can send anything. So a delivery counts only when
signed with the shared secret, checked in constant time: MLflow's signature (HMAC-SHA256 of
`<delivery id>.<timestamp>.<body>`, base64, prefixed `v1,`, in X-MLflow-Signature; the
timestamp within `MAX_SKEW_S`, so that a captured delivery cannot be replayed later, and each
delivery id counted once while its timestamp is fresh, so that it cannot be replayed sooner
either), or the secret itself in X-Lightning-Reload-Secret (what a Prefect automation's webhook
block sends). Nothing in a delivery is used but as a nudge: the version is read from the
registry, never taken from the payload, so a forged body can at most cause a look.

Slow clients hold no thread: one event loop reads every connection, each request (head and
body) whole within `REQUEST_DEADLINE_S` from its connection, not per read, heads capped at
`MAX_HEAD_BYTES` and bodies at `MAX_BODY_BYTES`. At most `MAX_CONNECTIONS` are open at once; a
new one past that closes the oldest, which has had the longest to send its request, so a
crowd of connections that send nothing cannot keep a signed delivery out.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import http.client
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus

logger = logging.getLogger(__name__)

MLFLOW_PATH = "/hooks/mlflow"
RELOAD_PATH = "/hooks/reload"
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
RELOAD_SECRET_HEADER = "X-Lightning-Reload-Secret"
# MLflow's alias payloads are under 1 KB; 64 KiB leaves room for workspaces and new fields.
MAX_BODY_BYTES = 64 * 1024
MAX_HEAD_BYTES = 8 * 1024
MAX_SKEW_S = 300.0
# From a connection's accept to the last byte of its request: MLflow and Prefect send theirs
# in milliseconds.
REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 64
# Delivery ids remembered at most: each needs the secret, and MLflow sends one per alias move.
_MAX_DELIVERIES = 10_000
# After its answer, what a refused client still sends is read and dropped for this long, so
# that closing does not reset the connection before the client has read the answer.
_LINGER_S = 1.0
_LINGER_BYTES = 1024 * 1024


def mlflow_signature(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The X-MLflow-Signature MLflow sends for `body` (mlflow/webhooks/delivery.py, 3.17)."""
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def check_mlflow_delivery(
    secret: str, headers: Mapping[str, str], body: bytes, now: float | None = None
) -> str | None:
    """Why this delivery is refused, or None when it is signed with `secret` and fresh."""
    signature = headers.get(SIGNATURE_HEADER) or ""
    timestamp = headers.get(TIMESTAMP_HEADER) or ""
    delivery = headers.get(DELIVERY_HEADER) or ""
    if not (signature and timestamp and delivery):
        return "unsigned (no signature, timestamp or delivery id)"
    try:
        skew = abs((time.time() if now is None else now) - int(timestamp))
    except ValueError:
        return "timestamp is not a number"
    if skew > MAX_SKEW_S:
        return f"timestamp {skew:.0f} s away from now"
    expected = mlflow_signature(secret, delivery, timestamp, body)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        return "bad signature"
    return None


def about_model(body: bytes, registered_model: str) -> bool:
    """Whether a signed MLflow delivery concerns an alias of `registered_model` (others, such as
    another model's or a prompt's, are no reason to look)."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(payload, dict) or payload.get("entity") != "model_version_alias":
        return False
    data = payload.get("data")
    return isinstance(data, dict) and data.get("name") == registered_model


class Deliveries:
    """The ids of MLflow deliveries already taken, each until its timestamp is no longer fresh
    (past then the clock refuses a replay): a delivery replayed within its window is seen."""

    def __init__(self, capacity: int = _MAX_DELIVERIES) -> None:
        self.capacity = capacity
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def first(self, delivery_id: str, timestamp: str, now: float | None = None) -> bool:
        """Whether `delivery_id` is new (and now taken); False for one taken before."""
        now = time.time() if now is None else now
        with self._lock:
            self._until = {d: t for d, t in self._until.items() if t >= now}
            if delivery_id in self._until:
                return False
            if len(self._until) >= self.capacity:
                # The one that leaves its window soonest goes: a replay of it has least time.
                del self._until[min(self._until, key=self._until.__getitem__)]
            # Fresh until timestamp + MAX_SKEW_S (check_mlflow_delivery), kept one second more
            # for the rounding of a whole-second timestamp.
            self._until[delivery_id] = int(timestamp) + MAX_SKEW_S + 1
            return True


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ReloadHook:
    """An HTTP listener that calls `nudge` on each valid delivery, served by one event loop in
    its own thread."""

    def __init__(
        self, host: str, port: int, secret: str, registered_model: str, nudge: Callable[[], None]
    ) -> None:
        if not secret:
            raise ValueError("the reload webhook needs a secret")
        self.secret, self.registered_model, self.nudge = secret, registered_model, nudge
        self.deliveries = Deliveries()
        # Bound here, so that a port in use fails the caller, and `url` is known before start.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self._loop = asyncio.new_event_loop()
        self._open: dict[asyncio.Task, None] = {}  # insertion order: the oldest first
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="reload-hook", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> ReloadHook:
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise RuntimeError("the reload webhook's event loop did not start")
        return self

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)
        self._socket.close()

    # ---- the loop

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(
            self._connection, sock=self._socket, limit=MAX_HEAD_BYTES
        )
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for task in list(self._open):
                task.cancel()
            await asyncio.gather(*self._open, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        if len(self._open) >= MAX_CONNECTIONS:
            oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.cancel()
        self._open[me] = None
        try:
            try:
                async with asyncio.timeout(REQUEST_DEADLINE_S):
                    status, message = await self._request(reader)
            except _Refused as refused:
                status, message = refused.status, refused.message
            except TimeoutError:
                status, message = 408, f"request not sent within {REQUEST_DEADLINE_S:g} s"
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client left
            await self._answer(reader, writer, status, message)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self._open.pop(me, None)
            writer.close()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int, message: str
    ) -> None:
        body = json.dumps({"status": message}).encode()
        writer.write(
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(_LINGER_S):
            await writer.drain()
            # What the client still sends (a refused body) is read and dropped: closing a
            # socket with unread input resets the connection, and the answer with it.
            left = _LINGER_BYTES
            while left > 0 and (chunk := await reader.read(min(left, 65536))):
                left -= len(chunk)

    async def _request(self, reader: asyncio.StreamReader) -> tuple[int, str]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(431, f"request head over {MAX_HEAD_BYTES} bytes") from None
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(400, "not an HTTP/1 request")
        method, path, _ = parts
        try:
            headers = http.client.parse_headers(io.BytesIO(rest))
        except http.client.HTTPException:
            raise _Refused(431, "too many headers") from None
        if method != "POST":
            raise _Refused(405, "POST only")
        if path not in (MLFLOW_PATH, RELOAD_PATH):
            raise _Refused(404, "no such hook")
        try:
            length = int(headers.get("content-length", ""))
        except ValueError:
            raise _Refused(411, "a content-length is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise _Refused(413, f"body over {MAX_BODY_BYTES} bytes")
        if path == RELOAD_PATH:
            # Its secret is in the head: checked before any body is waited for.
            given = headers.get(RELOAD_SECRET_HEADER) or ""
            if not hmac.compare_digest(given.encode(), self.secret.encode()):
                raise _Refused(401, "bad secret")
            self.nudge()
            return 200, "ok"
        body = await reader.readexactly(length)
        refused = check_mlflow_delivery(self.secret, headers, body)
        if refused is not None:
            logger.warning("reload hook: MLflow delivery refused: %s", refused)
            raise _Refused(401, refused)
        # Signed and fresh: its id counts once (a replay inside the window does nothing).
        if not self.deliveries.first(headers[DELIVERY_HEADER], headers[TIMESTAMP_HEADER]):
            return 200, "already seen"
        if about_model(body, self.registered_model):
            self.nudge()
        return 200, "ok"
