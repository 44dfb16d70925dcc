"""Auth everywhere: with an API key set, every route but the bare /health refuses a request
without it or with a wrong one, in its API's own error shape, and takes the right one.

Against real servers on loopback, through each API's official client (HttpStoreClient, the
OpenTelemetry OTLP exporter, `openai.OpenAI`, `anthropic.Anthropic`) and raw HTTP; then the
flow's policy server, which always has a key, refusing a keyless request while the flow's own
tasks (an agent's OpenAI client and its OTLP spans included) go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import fastapi.routing
import httpx
import openai
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_core import semconv
from lightning_core.errors import Unauthorized
from lightning_core.models import tiny_model_dir
from lightning_core.serving import process as serving
from lightning_core.serving.config import ServerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.tracing import emit_reward
from lightning_core.types import RolloutRequest, Sampling
from tests.conftest import gateway_server
from tests.helpers import run_cli

KEY = "test-key-Zq9"
WRONG = "not-the-key"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    # The clients fall back to LIGHTNING_API_KEY: a developer's own would blur "missing key".
    monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)


@pytest.fixture(scope="module")
def server():
    with gateway_server(model=str(tiny_model_dir()), api_key=KEY) as running:
        yield running


def _http(server, key: str | None = KEY) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


@pytest.fixture
def prefix(server) -> str:
    """The gateway prefix of a claimed rollout attempt (without /v1)."""
    with _http(server) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        # Rollouts other tests queued come first.
        claim = {"rollout": {}}
        while claim["rollout"].get("rollout_id") != rollout["rollout_id"]:
            claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    return f"/rollouts/{rollout['rollout_id']}/attempts/{claim['attempt']['attempt_id']}"


def _refusal_type(path: str, body: dict[str, Any]) -> str:
    """The error type of a refusal, read the way the path's API shapes it."""
    if path.endswith("/v1/messages"):  # Anthropic's shape
        assert body["type"] == "error", body
    return body["error"]["type"]


def _expected_refusal(path: str) -> str:
    if "/v1/" in path and not path.startswith("/v1/traces"):
        return "authentication_error"  # OpenAI's and Anthropic's name
    return "Unauthorized"  # the store's: the class HttpStoreClient raises again


# ---------------------------------------------------------------------------- every route


def _route_table(server) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    # FastAPI 0.150 keeps an included router as one entry; iter_route_contexts flattens it.
    flatten = getattr(fastapi.routing, "iter_route_contexts", iter)
    table = []
    for route in flatten(server.app.app.routes):
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in sorted(set(getattr(route, "methods", None) or {"GET"}) - {"HEAD"}):
            table.append((method, path))
    return table


def test_every_route_but_health_refuses_a_missing_or_wrong_key(server):
    table = _route_table(server)
    paths = {path for _, path in table}
    # The walk covers the groups it is meant to (and is not vacuous).
    for path in (
        "/store/rollouts",
        "/store/dequeue",
        "/v1/traces",
        "/health/details",
        "/v1/chat/completions",
        "/rollouts/x/attempts/x/v1/messages",
        "/rollouts/x/attempts/x/v1/models",
        "/openapi.json",
    ):
        assert path in paths, path
    open_routes, unrefused, accepted_badly = [], [], []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path in table:
            body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
            if path == "/health":
                open_routes.append(path)
                continue
            for headers in (
                {},
                {"authorization": f"Bearer {WRONG}"},
                {"x-api-key": WRONG},
                {"authorization": KEY},  # the key without the Bearer scheme
            ):
                r = http.request(method, path, headers=headers, **body)
                if r.status_code != 401:
                    unrefused.append((method, path, headers, r.status_code))
                elif _refusal_type(path, r.json()) != _expected_refusal(path):
                    unrefused.append((method, path, headers, r.text))
            # The right key passes the door (what follows is the route's business: {} may be a
            # 4xx of its own, never a 401).
            r = http.request(method, path, headers={"authorization": f"Bearer {KEY}"}, **body)
            if r.status_code == 401:
                accepted_badly.append((method, path))
    assert open_routes == ["/health"]
    assert unrefused == [], f"routes that took a request without the right key: {unrefused}"
    assert accepted_badly == [], f"routes that refused the right key: {accepted_badly}"


def test_health_is_a_bare_probe_and_details_need_the_key(server):
    with httpx.Client(base_url=server.url) as http:
        r = http.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        for headers in ({}, {"authorization": f"Bearer {WRONG}"}):
            r = http.get("/health/details", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
            assert "LIGHTNING_API_KEY" in r.json()["error"]["message"]
        r = http.get("/health/details", headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    details = r.json()
    assert details["status"] == "ok" and details["uptime_s"] > 0
    assert details["db"] == ":memory:" and details["policy_versions"] == 0
    assert details["requests_in_flight"] == 1  # this one
    assert details["backend"] == "TransformersBackend" and details["base_model"] == server.model
    assert details["adapters_loaded"] == 0
    assert set(details["backend_stats"]) >= {"running", "waiting"}


# ---------------------------------------------------------------------------- store


async def test_store_routes_through_the_python_client(server):
    missing, wrong = HttpStoreClient(server.url), HttpStoreClient(server.url, api_key=WRONG)
    right = HttpStoreClient(server.url, api_key=KEY)
    try:
        for client in (missing, wrong):
            with pytest.raises(Unauthorized, match="LIGHTNING_API_KEY"):
                await client.enqueue_rollout(RolloutRequest(input="denied"))
            with pytest.raises(Unauthorized):
                await client.list_policy_versions()
        rollout = await right.enqueue_rollout(RolloutRequest(input="allowed"))
        assert (await right.get_rollout(rollout.rollout_id)).input == "allowed"
        inputs = [r.input for r in await right.query_rollouts()]
        assert "allowed" in inputs and "denied" not in inputs
    finally:
        for client in (missing, wrong, right):
            await client.close()


def test_store_routes_over_raw_http(server):
    with _http(server, None) as anonymous, _http(server, WRONG) as wrong, _http(server) as right:
        for http in (anonymous, wrong):
            r = http.post("/store/rollouts", json={"rollouts": [{"input": "raw-denied"}]})
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "Unauthorized"
        r = right.post("/store/rollouts", json={"rollouts": [{"input": "raw-allowed"}]})
        assert r.status_code == 200, r.text
        inputs = [x["input"] for x in right.post("/store/rollouts/query", json={}).json()]
    assert "raw-allowed" in inputs and "raw-denied" not in inputs


# ---------------------------------------------------------------------------- OTLP


def _finished_spans(rollout_id: str, attempt_id: str) -> list[Any]:
    resource = Resource.create({semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id})
    provider = TracerProvider(resource=resource)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("test").start_as_current_span("tool"):
        pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def test_otlp_traces_through_the_otel_exporter(server, prefix):
    _, _, rollout_id, _, attempt_id = prefix.split("/")
    spans = _finished_spans(rollout_id, attempt_id)
    endpoint = f"{server.url}/v1/traces"
    for headers in (None, {"authorization": f"Bearer {WRONG}"}):
        exporter = OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=10)
        assert exporter.export(spans) == SpanExportResult.FAILURE
        exporter.shutdown()
    with _http(server) as http:
        stored = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
        assert stored == []
        r = http.post("/v1/traces", json={"resourceSpans": []}, headers={"authorization": ""})
        assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
        exporter = OTLPSpanExporter(endpoint=endpoint, headers={"authorization": f"Bearer {KEY}"})
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        exporter.shutdown()
        stored = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    assert [s["name"] for s in stored] == ["tool"]


# ---------------------------------------------------------------------------- gateway


def _openai_calls(api: openai.OpenAI, model: str) -> dict[str, Any]:
    return {
        "chat": lambda: api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
        "completions": lambda: api.completions.create(model=model, prompt="hi", max_tokens=2),
        "responses": lambda: api.responses.create(model=model, input="hi", max_output_tokens=2),
        "models": lambda: api.models.list(),
    }


@pytest.mark.parametrize("in_rollout", [False, True], ids=["plain", "rollout-prefix"])
def test_openai_routes_through_the_openai_client(server, prefix, in_rollout):
    base = server.url + (prefix if in_rollout else "")
    with httpx.Client(base_url=base) as anonymous:  # the client itself refuses to send no key
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            r = anonymous.post(path, json={"model": server.model})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert anonymous.get("/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key=WRONG, max_retries=0)
    for name, call in _openai_calls(wrong, server.model).items():
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.status_code == 401, name
        assert refused.value.code == "Unauthorized", name
    right = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    answers = {name: call() for name, call in _openai_calls(right, server.model).items()}
    assert answers["chat"].choices[0].message.role == "assistant"
    assert answers["completions"].choices[0].text is not None
    assert answers["responses"].status in ("completed", "incomplete")
    assert server.model in [m.id for m in answers["models"].data]
    if in_rollout:
        with _http(server) as http:
            rollout_id = prefix.split("/")[2]
            spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
        # The three generating calls with the right key, nothing of the refused ones.
        assert len([s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]) == 3


@pytest.mark.parametrize("in_rollout", [False, True], ids=["plain", "rollout-prefix"])
def test_anthropic_messages_through_the_anthropic_client(server, prefix, in_rollout):
    base = server.url + (prefix if in_rollout else "")
    message = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=base) as anonymous:
        for headers in ({}, {"x-api-key": WRONG}):
            r = anonymous.post(
                "/v1/messages", json={"model": server.model, **message}, headers=headers
            )
            assert r.status_code == 401
            assert r.json() == {
                "type": "error",
                "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
            }
        # As Anthropic's API reference sends it: the key in x-api-key.
        r = anonymous.post(
            "/v1/messages", json={"model": server.model, **message}, headers={"x-api-key": KEY}
        )
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
    wrong = anthropic.Anthropic(base_url=base, api_key=WRONG, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=server.model, **message)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
    reply = right.messages.create(model=server.model, **message)
    assert reply.role == "assistant" and reply.usage.output_tokens >= 1


# ---------------------------------------------------------------------------- the flow's server


def emitting_agent(task: dict[str, Any], llm: Any) -> None:
    """One call with the plain OpenAI client, its reward sent as a span (over OTLP)."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], max_tokens=2
    )
    emit_reward(float(task["reward"]))


def _command_lines() -> list[bytes]:
    lines = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            lines.append((proc / "cmdline").read_bytes())
    return lines


@pytest.mark.slow  # about 20 s: a policy server process and six rollouts
@pytest.mark.timeout(300)
def test_the_flows_policy_server_needs_its_key_and_the_flows_tasks_have_it(tmp_path):
    from lightning_core.data.adapter import AdapterConfig
    from lightning_core.data.collect import CreditConfig
    from lightning_rl.policy_server import policy_server, store_client
    from lightning_rl.tasks.rollouts import collect_transitions, plan_rollouts, run_rollouts

    db = tmp_path / "store.duckdb"
    with policy_server(db, ServerConfig(model="tiny"), tool_format="line") as server:
        key_file = Path(server.key_file)
        assert key_file.parent == tmp_path and key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text()
        assert len(key) >= 32
        if Path("/proc/self/cmdline").exists():  # the key is on no command line of the machine
            assert not any(key.encode() in line for line in _command_lines())
        with httpx.Client(base_url=server.url) as anonymous:
            assert anonymous.get("/health").status_code == 200
            assert anonymous.post("/store/rollouts/query", json={}).status_code == 401
            assert anonymous.get("/v1/models").status_code == 401
            assert anonymous.post("/v1/traces", json={"resourceSpans": []}).status_code == 401

        tasks = [{"id": i, "question": f"Say {i}.", "reward": i % 2} for i in range(3)]
        ids = asyncio.run(
            plan_rollouts.fn(
                server.url,
                tasks,
                2,
                server.base_model,
                "g",
                Sampling(),
                1,
                key_file=server.key_file,
            )
        )
        stats = asyncio.run(
            run_rollouts.fn(
                0,
                server.url,
                "tests.test_auth:emitting_agent",
                ids,
                3,
                120.0,
                server.base_model,
                key_file=server.key_file,
            )
        )
        assert stats == {"succeeded": len(ids), "failed": 0}
        collected = asyncio.run(
            collect_transitions.fn(
                server.url, ids, AdapterConfig(), CreditConfig(), key_file=server.key_file
            )
        )
        assert len(collected.transitions) == len(ids)  # one per LLM call, from gateway spans

        async def returns() -> list[float | None]:
            async with store_client(server.url, server.key_file) as store:
                return [r.episode_return for r in await store.query_rollouts(rollout_ids=ids)]

        # The rewards came as the agents' spans over OTLP: a refused export would leave None.
        assert sorted(asyncio.run(returns())) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert not key_file.exists()  # the key dies with its server


@pytest.mark.timeout(300)
def test_the_flows_policy_server_takes_the_users_key(tmp_path, monkeypatch):
    from lightning_rl.policy_server import policy_server, store_client

    monkeypatch.setenv("LIGHTNING_API_KEY", KEY)
    with policy_server(
        tmp_path / "store.duckdb", ServerConfig(model="tiny"), tool_format="line"
    ) as server:
        key_file = Path(server.key_file)
        assert key_file.read_text() == KEY and key_file.stat().st_mode & 0o777 == 0o600
        with httpx.Client(base_url=server.url) as anonymous:
            assert anonymous.get("/v1/models").status_code == 401
        # An external runner with the user's key gets in.
        with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}) as http:
            assert http.get("/v1/models").status_code == 200
        monkeypatch.delenv("LIGHTNING_API_KEY")

        async def count() -> int:
            async with store_client(server.url, server.key_file) as store:
                return len(await store.query_rollouts())

        assert asyncio.run(count()) == 0
    assert not key_file.exists()


# ---------------------------------------------------------------------------- command line


def _cli(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"LIGHTNING_API_KEY": key} if key is not None else None)


def test_cli_commands_send_the_key_and_say_when_it_is_refused(tmp_path):
    port = serving.free_port()
    env = {**os.environ, "LIGHTNING_API_KEY": KEY}
    proc = serving.start_serve(tmp_path / "s.duckdb", port, "--backend", "none", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for result in (
            _cli("status", "--server", url),
            _cli("status", "--server", url, "--api-key", WRONG),
            _cli("runner", "--agent", "tests.flow_agents:agent", "--server", url, key=WRONG),
        ):
            assert result.returncode == 2, result.stderr
            assert "missing or wrong API key" in result.stderr
            assert "Traceback" not in result.stderr
        result = _cli("status", "--server", url, key=KEY)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1].split() == ["total", "0"]
    finally:
        serving.stop_serve(proc)
