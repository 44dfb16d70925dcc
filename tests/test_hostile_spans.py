"""Issue 43, parts 3 and 4: spans an agent writes, and what becomes training data.

- An agent's key cannot write the attributes only the gateway writes (token ids, logprobs, the
  policy version, adapter hash, template fingerprint), over the store's span route or OTLP: a
  call it made up never becomes a transition, and each try is counted for the operator.
- A call span without the provenance the run's record expects (one the admin key wrote) is
  refused at collection.
- A rollout meant for a policy version answers calls for that version only.
- An attempt's spans are bounded in number and in bytes (settings read as LIGHTNING_*); the
  gateway's own spans are not counted, so an agent past its quota still has its calls recorded.
- A call longer than the trainer takes is dropped by collection, counted, never trained on.

One real server on loopback: a DuckDB store and the gateway on the tiny model, its quotas set
from the environment as `lightning-rl serve` reads them, an admin key, and agent keys.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_core import semconv
from lightning_core.algo.config import TrainerConfig
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.data import provenance as checks
from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import CALL_TOO_LONG, CreditConfig, collect
from lightning_core.data.provenance import ProvenanceRecord
from lightning_core.gateway.service import Gateway, GatewayConfig
from lightning_core.models import tiny_model_dir
from lightning_core.security.keys import agent_key, bearer_header
from lightning_core.settings import ServeSettings
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import Transition
from lightning_rl.tasks.rollouts import collect_transitions
from tests.conftest import ThreadedServer

KEY = "admin-key-hostile-spans-R4"
MAX_SPANS = 40
MAX_BYTES = 64 * 1024
MESSAGES = [{"role": "user", "content": "Name a colour."}]
PROTOBUF = {"content-type": "application/x-protobuf"}
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIGHTNING_MAX_SPANS_PER_ATTEMPT", str(MAX_SPANS))
        env.setenv("LIGHTNING_MAX_SPAN_BYTES_PER_ATTEMPT", str(MAX_BYTES))
        settings = ServeSettings(db=":memory:", api_key=KEY)
    store = DuckDBStore(settings.store_config())
    backend = TransformersBackend(model=str(tiny_model_dir()))
    gateway = Gateway(backend, store, settings.gateway_config())
    with ThreadedServer(create_app(store, api_key=KEY, gateway=gateway), 120) as running:
        running.model = backend.base_model
        yield running


@pytest.fixture
def admin(server):
    with httpx.Client(base_url=server.url, headers=bearer_header(KEY), timeout=60) as client:
        yield client


def _claim(admin: httpx.Client, policy_version: str | None = None) -> tuple[str, str]:
    """A new rollout (meant for `policy_version`), claimed: its id and its attempt's."""
    request: dict[str, Any] = {"input": "t", "policy_version": policy_version}
    [rollout] = admin.post("/store/rollouts", json={"rollouts": [request]}).json()
    claim = admin.post("/store/dequeue", json={"worker_id": "w"}).json()
    assert claim["rollout"]["rollout_id"] == rollout["rollout_id"]
    return rollout["rollout_id"], claim["attempt"]["attempt_id"]


def _agent(server, rollout_id: str, attempt_id: str) -> tuple[openai.OpenAI, httpx.Client]:
    """What the runner hands the agent of an attempt, as clients: the attempt's gateway
    routes and the store's routes, both with the attempt's agent key."""
    key = agent_key(KEY, attempt_id)
    base_url = f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
    chat = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    return chat, httpx.Client(base_url=server.url, headers=bearer_header(key), timeout=60)


def _span(rollout_id: str, attempt_id: str, name: str, **attributes: Any) -> dict[str, Any]:
    n = next(_ids)
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": f"{n:032x}",
        "span_id": f"{n:016x}",
        "name": name,
        "start_time": time.time(),
        "end_time": time.time(),
        "attributes": attributes,
    }


def _made_up_call(policy_version: str) -> dict[str, Any]:
    """The attributes of a call the gateway never answered: prompt and response token ids
    and logprobs of the writer's choosing (a response it wants reinforced)."""
    return {
        semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
        semconv.RESPONSE_COUNT: 1,
        semconv.RESPONSE.format(i=0, key="token_ids"): [4, 5],
        semconv.RESPONSE.format(i=0, key="logprobs"): [-0.01, -0.01],
        semconv.RESPONSE.format(i=0, key="finish_reason"): "stop",
        semconv.POLICY_VERSION: policy_version,
    }


def _otel_spans(rollout_id: str, attempt_id: str, n: int, **attributes: Any) -> list[ReadableSpan]:
    """`n` finished OpenTelemetry spans of an attempt, as an agent's own tracer makes them."""
    resource = Resource.create({semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id})
    provider = TracerProvider(resource=resource)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("agent")
    for i in range(n):
        with tracer.start_as_current_span(f"step-{i}", attributes=attributes or None):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def _exporter(server, attempt_id: str) -> OTLPSpanExporter:
    return OTLPSpanExporter(
        endpoint=f"{server.url}/v1/traces",
        headers=bearer_header(agent_key(KEY, attempt_id)),
        timeout=10,
    )


def _refused(admin: httpx.Client) -> dict[str, int]:
    return admin.get("/health/details").json().get("spans_refused", {})


async def _finished(server, rollout_ids: list[str]):
    """Complete each rollout's attempt; the rollouts and their spans, as collecting reads them."""
    async with HttpStoreClient(server.url, api_key=KEY) as store:
        for rollout_id in rollout_ids:
            [attempt] = await store.query_attempts(rollout_id)
            await store.complete_attempt(attempt.attempt_id, 1.0)
        rollouts = await store.query_rollouts(rollout_ids=rollout_ids)
        return rollouts, await store.query_spans(rollout_ids, "latest")


def _calls(spans) -> list:
    return [s for s in spans if semconv.PROMPT_TOKEN_IDS in s.attributes]


def test_an_agent_key_cannot_write_a_call_and_each_try_is_counted(server, admin):
    """Finding: an agent posted a span with token ids and logprobs it made up, and it became a
    transition. Every attribute only the gateway writes is refused (400, naming it) from an
    agent's key, over both span routes; its other spans still go in."""
    rollout_id, attempt_id = _claim(admin)
    chat, agent = _agent(server, rollout_id, attempt_id)
    chat.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4)
    before = _refused(admin).get("gateway_attributes", 0)

    made_up = _span(rollout_id, attempt_id, "chat made-up", **_made_up_call(server.model))
    r = agent.post("/store/spans", json={"spans": [made_up]})
    assert r.status_code == 400, r.text
    assert semconv.PROMPT_TOKEN_IDS in r.json()["error"]["message"]
    # Each alone: e.g. claiming that another version, adapter or template answered.
    alone = [
        semconv.POLICY_VERSION,
        semconv.ADAPTER_HASH,
        semconv.TEMPLATE_FINGERPRINT,
        semconv.RESPONSE.format(i=0, key="logprobs"),
    ]
    for attribute in alone:
        one = _span(rollout_id, attempt_id, "tool", **{attribute: "x"})
        r = agent.post("/store/spans", json={"spans": [one]})
        assert r.status_code == 400 and attribute in r.json()["error"]["message"], r.text

    # Over OTLP: OpenTelemetry's own exporter is refused, and the answer names the attribute.
    forged = _otel_spans(rollout_id, attempt_id, 1, **_made_up_call(server.model))
    exporter = _exporter(server, attempt_id)
    assert exporter.export(forged) == SpanExportResult.FAILURE
    exporter.shutdown()
    body = encode_spans(forged).SerializeToString()
    r = agent.post("/v1/traces", content=body, headers=PROTOBUF)
    assert r.status_code == 400 and semconv.PROMPT_TOKEN_IDS in r.text, r.text
    assert _refused(admin)["gateway_attributes"] == before + len(alone) + 3

    # The agent's own spans without them still go in: a tool span, a reward.
    reward = _span(rollout_id, attempt_id, semconv.REWARD_SPAN, **{semconv.REWARD_VALUE: 1.0})
    assert agent.post("/store/spans", json={"spans": [reward]}).status_code == 200
    assert _exporter(server, attempt_id).export(_otel_spans(rollout_id, attempt_id, 1)) == (
        SpanExportResult.SUCCESS
    )

    rollouts, spans = asyncio.run(_finished(server, [rollout_id]))
    [call] = _calls(spans)
    assert call.name.startswith("chat") and "made-up" not in call.name
    [transition] = collect(rollouts, spans).transitions
    assert transition.prompt_token_ids == call.attributes[semconv.PROMPT_TOKEN_IDS]
    assert transition.response_logprobs != [-0.01, -0.01]


def test_a_call_without_the_provenance_the_record_expects_is_refused(server, admin):
    """Finding: provenance never checked a missing version, hash or fingerprint, so a call
    span written without them (the admin key may still write one: an import, a fixture)
    passed. Against the run's record, it is refused now, and counted by reason."""
    fingerprint = admin.get("/health/details").json()["template_fingerprint"]
    record = ProvenanceRecord(base_model=server.model, template_fingerprint=fingerprint)
    answered, answered_attempt = _claim(admin)
    chat, _ = _agent(server, answered, answered_attempt)
    chat.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4)
    written, attempt_id = _claim(admin)
    call = _span(written, attempt_id, "chat imported", **_made_up_call(server.model))
    assert admin.post("/store/spans", json={"spans": [call]}).status_code == 200

    rollouts, spans = asyncio.run(_finished(server, [answered, written]))
    collected = collect(rollouts, spans, provenance=record)
    assert dict(collected.refused) == {checks.MISSING_PROVENANCE: 1}
    assert {t.rollout_id for t in collected.transitions} == {answered}
    assert collected.facts[written].provenance_refused == checks.MISSING_PROVENANCE

    # Each field the record expects: the version always, a declared hash, its fingerprint.
    declared = record.model_copy(update={"versions": {"v1": "a" * 64}})
    whole = Transition(
        rollout_id="r",
        step=0,
        prompt_token_ids=[1],
        response_token_ids=[2],
        policy_version="v1",
        adapter_hash="a" * 64,
        template_fingerprint=fingerprint,
    )
    assert declared.disagreement(whole) is None
    for missing in ("policy_version", "adapter_hash", "template_fingerprint"):
        lacking = whole.model_copy(update={missing: None})
        assert declared.disagreement(lacking) == checks.MISSING_PROVENANCE, missing


def test_a_rollout_meant_for_a_version_answers_calls_for_that_version_only(server, admin):
    """Finding: an agent could name any published version (or the base model) inside a
    rollout meant for another, and its calls passed provenance. Refused (403), naming the
    model the rollout may use; refused calls are not recorded."""
    for name in ("hs-meant", "hs-other"):
        version = {"name": name, "base_model": server.model}
        assert admin.post("/store/policy-versions", json=version).status_code == 200
    rollout_id, attempt_id = _claim(admin, policy_version="hs-meant")
    chat, _ = _agent(server, rollout_id, attempt_id)
    for model in ("hs-other", server.model):
        with pytest.raises(openai.PermissionDeniedError, match="'hs-meant'"):
            chat.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        with pytest.raises(openai.PermissionDeniedError, match="'hs-meant'"):
            chat.completions.create(model=model, prompt="Name a colour.", max_tokens=4)
    chat.chat.completions.create(model="hs-meant", messages=MESSAGES, max_tokens=4)
    chat.completions.create(model="hs-meant", prompt="Name a colour.", max_tokens=4)

    # A rollout that names no version leaves the model to the agent (the runner's default).
    free, free_attempt = _claim(admin)
    _agent(server, free, free_attempt)[0].chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4
    )
    _, spans = asyncio.run(_finished(server, [rollout_id, free]))
    assert [s.rollout_id for s in _calls(spans)].count(rollout_id) == 2
    assert [s.rollout_id for s in _calls(spans)].count(free) == 1


def test_an_attempts_spans_past_its_quotas_are_refused_naming_the_setting(server, admin):
    """Finding: no quota per attempt (4,000-span requests added 84 MB each; collecting one
    rollout read 89 MB). Past LIGHTNING_MAX_SPANS_PER_ATTEMPT spans, or
    LIGHTNING_MAX_SPAN_BYTES_PER_ATTEMPT bytes, a write is refused (413) whole, naming the
    limit and the setting; an exporter's retry is not counted twice, and the gateway's own
    spans are not counted: the agent's calls are still recorded once its quota is spent."""
    rollout_id, attempt_id = _claim(admin)
    chat, agent = _agent(server, rollout_id, attempt_id)
    exporter = _exporter(server, attempt_id)
    first = _otel_spans(rollout_id, attempt_id, MAX_SPANS - 10)
    assert exporter.export(first) == SpanExportResult.SUCCESS
    assert exporter.export(first) == SpanExportResult.SUCCESS  # a retry: stored, counted once
    over = encode_spans(_otel_spans(rollout_id, attempt_id, 11)).SerializeToString()
    r = agent.post("/v1/traces", content=over, headers=PROTOBUF)
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "LIGHTNING_MAX_SPANS_PER_ATTEMPT" in message and f"limit of {MAX_SPANS}" in message
    assert exporter.export(_otel_spans(rollout_id, attempt_id, 10)) == SpanExportResult.SUCCESS
    exporter.shutdown()
    one_more = _span(rollout_id, attempt_id, "tool")
    r = agent.post("/store/spans", json={"spans": [one_more]})
    assert r.status_code == 413 and "LIGHTNING_MAX_SPANS_PER_ATTEMPT" in r.text
    for _ in range(2):
        chat.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4)

    # Bytes: three spans of 20 KB fit in 64 KiB, a fourth does not (and the admin key's
    # writes count too: the quota bounds what collecting the rollout reads).
    big, big_attempt = _claim(admin)
    _, big_agent = _agent(server, big, big_attempt)
    spans = [_span(big, big_attempt, "tool", output="x" * 20_000) for _ in range(4)]
    assert big_agent.post("/store/spans", json={"spans": spans[:3]}).status_code == 200
    r = admin.post("/store/spans", json={"spans": spans[3:]})
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "LIGHTNING_MAX_SPAN_BYTES_PER_ATTEMPT" in message and f"limit of {MAX_BYTES}" in message

    refused = _refused(admin)
    assert refused["spans_per_attempt"] == 2 and refused["span_bytes_per_attempt"] == 1
    _, stored = asyncio.run(_finished(server, [rollout_id, big]))
    mine = [s for s in stored if s.rollout_id == rollout_id]
    assert len(_calls(mine)) == 2 and len(mine) == MAX_SPANS + 2
    assert len([s for s in stored if s.rollout_id == big]) == 3


def test_a_call_longer_than_the_trainer_takes_is_dropped_by_collection(server, admin, tmp_path):
    """Finding: no sequence-length cap before the trainer. A rollout with a call over the
    trainer's max_call_tokens gives no transitions (counted as call_too_long); the flow's
    collect task passes the setting on."""
    assert TrainerConfig().max_call_tokens >= (
        GatewayConfig().max_prompt_tokens + GatewayConfig().max_generation_tokens
    )
    rollout_id, attempt_id = _claim(admin)
    chat, _ = _agent(server, rollout_id, attempt_id)
    chat.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4)
    rollouts, spans = asyncio.run(_finished(server, [rollout_id]))
    [whole] = collect(rollouts, spans).transitions
    length = len(whole.prompt_token_ids) + len(whole.response_token_ids)

    assert len(collect(rollouts, spans, max_call_tokens=length).transitions) == 1
    cut = collect(rollouts, spans, max_call_tokens=length - 1)
    assert dict(cut.refused) == {CALL_TOO_LONG: 1} and not cut.transitions

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    collected = asyncio.run(
        collect_transitions.fn(
            server.url,
            [rollout_id],
            AdapterConfig(),
            CreditConfig(),
            key_file=str(key_file),
            max_call_tokens=length - 1,
        )
    )
    assert dict(collected.refused) == {CALL_TOO_LONG: 1} and not collected.transitions
