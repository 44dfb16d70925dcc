"""The reload webhook of `lightning-rl production`: MLflow's model-version-alias webhooks, and
calls from Prefect automations, that tell the alias follower to look at the registry now.

Untrusted input: anyone who reaches the port can send anything. So a delivery counts only when
signed with the shared secret, checked in constant time: MLflow's signature (HMAC-SHA256 of
`<delivery id>.<timestamp>.<body>`, base64, prefixed `v1,`, in X-MLflow-Signature; the
timestamp within `MAX_SKEW_S`, so that a captured delivery cannot be replayed later), or the
secret itself in X-Lightning-Reload-Secret (what a Prefect automation's webhook block sends).
Bodies are capped at `MAX_BODY_BYTES` and read whole within a deadline, by a few handlers
at a time. Nothing in a delivery is used
but as a nudge: the version is read from the registry, never taken from the payload, so a
forged body can at most cause a look.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

MLFLOW_PATH = "/hooks/mlflow"
RELOAD_PATH = "/hooks/reload"
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
RELOAD_SECRET_HEADER = "X-Lightning-Reload-Secret"
# MLflow's alias payloads are under 1 KB; 64 KiB leaves room for workspaces and new fields.
MAX_BODY_BYTES = 64 * 1024
MAX_SKEW_S = 300.0
_READ_TIMEOUT_S = 10.0
_MAX_HANDLERS = 8


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


class ReloadHook:
    """A loopback HTTP listener that calls `nudge` on each valid delivery, in its own thread."""

    def __init__(
        self, host: str, port: int, secret: str, registered_model: str, nudge: Callable[[], None]
    ) -> None:
        if not secret:
            raise ValueError("the reload webhook needs a secret")
        hook = self

        class Handler(BaseHTTPRequestHandler):
            timeout = _READ_TIMEOUT_S

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("reload hook: " + format, *args)

            def _answer(self, status: int, message: str) -> None:
                body = json.dumps({"status": message}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self, length: int) -> bytes | None:
                # A deadline on the whole body, not only between bytes: a client trickling
                # one byte at a time must not hold a handler for long.
                deadline = time.monotonic() + _READ_TIMEOUT_S
                chunks: list[bytes] = []
                while length > 0 and time.monotonic() < deadline:
                    chunk = self.rfile.read1(min(length, 16384))
                    if not chunk:
                        return None
                    chunks.append(chunk)
                    length -= len(chunk)
                return None if length > 0 else b"".join(chunks)

            def do_POST(self) -> None:  # http.server's name for it
                try:
                    length = int(self.headers.get("content-length", ""))
                except ValueError:
                    return self._answer(411, "a content-length is required")
                if not 0 <= length <= MAX_BODY_BYTES:
                    return self._answer(413, f"body over {MAX_BODY_BYTES} bytes")
                if not hook.handlers.acquire(blocking=False):
                    return self._answer(503, "busy")
                try:
                    body = self._body(length)
                finally:
                    hook.handlers.release()
                if body is None:
                    return self._answer(408, f"body not sent within {_READ_TIMEOUT_S:g} s")
                if self.path == MLFLOW_PATH:
                    refused = check_mlflow_delivery(secret, self.headers, body)
                    if refused is not None:
                        logger.warning("reload hook: MLflow delivery refused: %s", refused)
                        return self._answer(401, refused)
                    if about_model(body, registered_model):
                        hook.nudge()
                    return self._answer(200, "ok")
                if self.path == RELOAD_PATH:
                    given = self.headers.get(RELOAD_SECRET_HEADER) or ""
                    if not hmac.compare_digest(given.encode(), secret.encode()):
                        return self._answer(401, "bad secret")
                    hook.nudge()
                    return self._answer(200, "ok")
                return self._answer(404, "no such hook")

        self.nudge = nudge
        # Deliveries are rare and tiny: a few handlers at once, more are answered 503.
        self.handlers = threading.BoundedSemaphore(_MAX_HANDLERS)
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="reload-hook", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ReloadHook:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
