"""The servers' HTTP edge under hostile clients (issue 25, items 2, 3 and 6).

Against a real store-only `lightning-rl serve` on loopback, with its timeouts set short, through
raw sockets where a well-behaved client cannot misbehave (a body cut off, headers never sent):
a huge OTLP export does not stall /health, a body that ends in a disconnect stores nothing,
idle and stalled connections are closed, connections past the cap are refused, and a keyless
server answers neither a foreign Host name (DNS rebinding) nor a cross-site page.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.serving import process as serving
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
MAX_CONNECTIONS = 32
PROTOBUF = {"content-type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A keyless store-only server with short timeouts; yields its URL."""
    port = serving.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    env |= {
        "LIGHTNING_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "LIGHTNING_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "LIGHTNING_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    db = tmp_path_factory.mktemp("edge") / "s.duckdb"
    proc = serving.start_serve(db, port, "--backend", "none", env=env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serving.stop_serve(proc)


def _attempt(url: str) -> tuple[str, str]:
    """A claimed rollout attempt: (rollout id, attempt id)."""
    with httpx.Client(base_url=url) as http:
        http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).raise_for_status()
        claim = http.post("/store/dequeue", json={"worker_id": "edge"}).json()
    return claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]


def _export(rollout_id: str, attempt_id: str, spans: int, per_resource: bool = False) -> bytes:
    """An OTLP protobuf export of `spans` tiny spans of one attempt; with `per_resource`, each
    span in its own ResourceSpans, so that any prefix of whole entries is itself a valid
    export (what a cut-off body of such an export looks like to the server)."""
    request = ExportTraceServiceRequest()
    scope = None
    for i in range(spans):
        if per_resource or scope is None:
            resource_spans = request.resource_spans.add()
            for key, value in ((semconv.ROLLOUT_ID, rollout_id), (semconv.ATTEMPT_ID, attempt_id)):
                attribute = resource_spans.resource.attributes.add()
                attribute.key, attribute.value.string_value = key, value
            scope = resource_spans.scope_spans.add()
        span = scope.spans.add()
        span.trace_id, span.span_id = (i + 1).to_bytes(16, "big"), (i + 1).to_bytes(8, "big")
        span.name, span.start_time_unix_nano, span.end_time_unix_nano = "s", 1, 2
    return request.SerializeToString()


def _spans_of(url: str, rollout_id: str) -> int:
    answer = httpx.post(f"{url}/store/spans/query", json={"rollout_ids": [rollout_id]})
    return len(answer.raise_for_status().json())


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes `sock` within `seconds`, and what it sent before."""
    sock.settimeout(seconds)
    received = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return True, received
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        return True, received
    return False, received


def test_health_answers_while_a_150k_span_otlp_export_arrives(server):
    """Finding: a 6.3 MB OTLP protobuf of 150k tiny spans blocked the event loop 5.6 s,
    /health included. Decoded in a worker thread and past the span cap refused with a 413
    that names the setting, it leaves /health under 0.5 s (p99)."""
    body = _export(*_attempt(server), spans=150_000)
    answers: list[httpx.Response] = []

    def export() -> None:
        answers.append(httpx.post(f"{server}/v1/traces", content=body, headers=PROTOBUF))

    latencies = []
    with httpx.Client(base_url=server) as http:
        http.get("/health")  # the connection, opened before the clock starts
        exporter = threading.Thread(target=export)
        exporter.start()
        started = time.monotonic()
        while exporter.is_alive() or time.monotonic() - started < 1.0:
            t = time.perf_counter()
            assert http.get("/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)
        exporter.join()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    assert p99 < 0.5, f"/health p99 {p99:.3f} s over {len(latencies)} probes"
    [answer] = answers
    assert answer.status_code == 413, answer.text
    message = answer.json()["error"]["message"]
    assert "150000 spans" in message and "LIGHTNING_MAX_OTLP_SPANS" in message


def test_an_export_cut_off_by_a_disconnect_stores_nothing(server):
    """Finding: the middleware took `http.disconnect` for the end of the body, so an exporter
    that sent 600 of 1,000 spans and disconnected had the 600 stored (and its retry then
    stored 1,600 for 1,000 ids). A body that does not end is no request."""
    rollout_id, attempt_id = _attempt(server)
    whole = _export(rollout_id, attempt_id, 1000, per_resource=True)
    part = _export(rollout_id, attempt_id, 600, per_resource=True)
    assert whole.startswith(part)  # 600 whole spans: a valid export of its own
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-protobuf\r\n"
            b"Content-Length: %d\r\n\r\n" % len(whole)
        )
        sock.sendall(part)
        time.sleep(0.3)  # the 600 spans reach the server before the disconnect
    time.sleep(1.0)
    assert _spans_of(server, rollout_id) == 0
    # The same export whole is stored whole.
    answer = httpx.post(f"{server}/v1/traces", content=whole, headers=PROTOBUF)
    assert answer.status_code == 200, answer.text
    assert _spans_of(server, rollout_id) == 1000


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    """Finding: no header read timeout; 19,990 idle connections, no key needed, held every
    file descriptor and /health was refused. A connection that sends nothing, or headers that
    never end (slowloris), is closed after the header timeout."""
    silent = _connect(server)
    slow = _connect(server)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for sock in (silent, slow):
        with sock:
            closed, _ = _closed_within(sock, HEADER_TIMEOUT_S + 8)
            assert closed, "the server kept a connection with no complete request head"
    # A kept-alive connection between requests is the keep-alive's (30 s), not the head's.
    with httpx.Client(base_url=server) as http:
        http.get("/health")
        time.sleep(HEADER_TIMEOUT_S + 1)
        assert http.get("/health").status_code == 200


def test_a_request_head_without_end_is_answered_431(server):
    """Finding: uvicorn keeps every header line it is sent; 200 MB of headers grew the server
    by 196 MB within the header timeout. A head over 64 KiB is answered 431 and closed."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for i in range(16):
                sock.sendall(b"X-%d: %s\r\n" % (i, b"a" * 65536))
        except OSError:
            pass  # closed by the server mid-send: what it answered is still to be read
        closed, received = _closed_within(sock, 5)
    assert received.startswith(b"HTTP/1.1 431"), received[:200]
    assert closed


def test_a_body_that_stops_coming_is_answered_408_and_dropped(server):
    """Finding: no body read timeout; 5 clients that sent 59 of 60 MB and stopped held 282 MB
    for good. A body with no byte for the body timeout is answered 408 and the connection
    closed, which frees what it had sent."""
    with _connect(server) as sock:
        sock.sendall(
            b"POST /store/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
        )
        sock.sendall(b'{"rollouts": [' + b" " * 100_000)
        closed, received = _closed_within(sock, BODY_TIMEOUT_S + 8)
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"LIGHTNING_BODY_TIMEOUT_S" in received
    assert closed


def test_idle_connections_make_way_and_busy_ones_past_the_cap_are_refused(server):
    """Finding: no per-server connection limit; 19,990 idle connections exhausted the file
    limit and /health was refused. At LIGHTNING_MAX_CONNECTIONS a new connection closes the one
    idle longest, so /health answers beside a flood of idle connections; only with every
    connection in a request is a new one answered 503."""
    idle = [_connect(server) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        t = time.perf_counter()
        assert httpx.get(f"{server}/health").status_code == 200
        assert time.perf_counter() - t < 1.0
        made_way = sum(_closed_within(sock, 0.2) == (True, b"") for sock in idle[:10])
        assert made_way >= 8
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    # Every connection in a request (a body still to come): none can make way.
    busy = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(
                b"POST /store/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
        time.sleep(0.5)
        with _connect(server) as extra:
            closed, received = _closed_within(extra, 2)
        assert closed and received.startswith(b"HTTP/1.1 503"), received[:200]
        assert b"LIGHTNING_MAX_CONNECTIONS" in received
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "attacker.example"},
        {"Host": "attacker.example:4747"},
        {"Origin": "http://attacker.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
    ],
)
def test_a_keyless_server_refuses_foreign_hosts_and_cross_site_pages(server, headers):
    """Finding: DNS rebinding. A keyless loopback server answered `Host: attacker.example`
    with data, so a web page in the user's browser could read and write the store. It now
    answers loopback Host names only, and no cross-site page, with a 403 that says why."""
    answer = httpx.post(f"{server}/store/rollouts/query", json={}, headers=headers)
    assert answer.status_code == 403, answer.text
    assert "LIGHTNING_API_KEY" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Host": "localhost"},
        {"Host": "localhost:4747"},
        {"Host": "[::1]:4747"},
        {"Host": "127.0.0.1"},
        {"Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"},
    ],
)
def test_a_keyless_server_answers_this_machine(server, headers):
    """The other side of the DNS-rebinding fix: loopback names and local pages still pass."""
    answer = httpx.post(f"{server}/store/rollouts/query", json={}, headers=headers)
    assert answer.status_code == 200, answer.text


def test_a_keyed_server_answers_any_host():
    """With a key, a server may sit behind a proxy under any name: Host is not restricted (a
    browser page cannot send the key unless the user gave it one)."""
    app = create_app(DuckDBStore(db=":memory:"), api_key="edge-key")
    with ThreadedServer(app) as running:
        answer = httpx.post(
            f"{running.url}/store/rollouts/query",
            json={},
            headers={"Host": "store.example", "Authorization": "Bearer edge-key"},
        )
        assert answer.status_code == 200, answer.text
        refused = httpx.post(
            f"{running.url}/store/rollouts/query", json={}, headers={"Host": "store.example"}
        )
        assert refused.status_code == 401
