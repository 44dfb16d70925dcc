"""Issue 25, items 7 and 9: least privilege and hostile inputs to small tools.

- An agent holds a key for its own attempt (keys.agent_key), not the admin key: it calls its
  attempt's gateway routes (the official OpenAI and Anthropic clients) and exports spans, and
  the rest of the store refuses it.
- A password inside a URL setting (`registry.tracking_uri`, `vllm_url`) is not in the MLflow
  params nor in the parameters Prefect records.
- The calculator refuses complex results and turns every arithmetic error into a failed tool
  call with its span.
- A run cannot be named `latest` (the link to the newest run) or anything that is not one
  folder name; the CLI says so in one line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from mlflow import MlflowClient
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_core import semconv, tracing
from lightning_core.models import tiny_model_dir
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest
from lightning_rl.agents.calc.agent import calculate
from lightning_rl.agents.calc.calculator import CalculatorError, evaluate
from lightning_rl.flows.config import TrainConfig
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.runs import log_params, tracking
from tests.conftest import gateway_server
from tests.helpers import run_cli

KEY = "admin-key-hostile-Qx7"
PASSWORD = "hunter2-Zk"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)


# ---------------------------------------------------------------------------- agent keys


@pytest.fixture(scope="module")
def server():
    with gateway_server(model=str(tiny_model_dir()), api_key=KEY) as running:
        yield running


def _attempt_span(rollout_id: str, attempt_id: str) -> list[Any]:
    """One finished OpenTelemetry span stamped with a rollout attempt."""
    resource = Resource.create({semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id})
    provider = TracerProvider(resource=resource)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("test").start_as_current_span("agent-own-span"):
        pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def _key_probing_agent(server_url: str, seen: dict[str, Any]):
    """An agent that uses its key the ways an agent may: the gateway through the official
    OpenAI and Anthropic clients, and an OTLP export of a span of its own attempt."""

    def agent(task: Any, llm: Any) -> float:
        seen["key"], seen["base_url"] = llm.api_key, llm.base_url
        chat = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        reply = chat.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        seen["chat"] = reply.choices[0].message.role
        seen["models"] = [m.id for m in chat.models.list()]
        messages = anthropic.Anthropic(
            base_url=llm.base_url.removesuffix("/v1"), api_key=llm.api_key, max_retries=0
        )
        seen["message"] = messages.messages.create(
            model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ).role
        rollout_id, attempt_id = llm.base_url.split("/rollouts/")[1].split("/")[::2][:2]
        exporter = OTLPSpanExporter(
            endpoint=f"{server_url}/v1/traces",
            headers={"authorization": f"Bearer {llm.api_key}"},
            timeout=10,
        )
        seen["export"] = exporter.export(_attempt_span(rollout_id, attempt_id))
        exporter.shutdown()
        return 1.0

    return agent


async def _run_agent(server: Any, agent: Any, rollout: dict[str, Any]) -> list[Any]:
    """The real Runner, with the admin key, on one rollout."""
    client = HttpStoreClient(server.url, api_key=KEY)
    try:
        config = RunnerConfig(concurrency=1, default_model=server.model)
        runner = Runner(agent, client, server.url, config)
        return await runner.run_until_done([rollout["rollout_id"]], timeout=120)
    finally:
        await client.close()


def test_an_agent_key_opens_its_attempts_gateway_and_span_writes_and_nothing_else(server):
    """Finding: agents receive the admin key as their `api_key`, so any agent (or a framework
    that logs its key) can enqueue, read the whole store and publish policy versions. Its key
    writes its own attempt's spans only."""
    admin = httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    [rollout] = admin.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
    seen: dict[str, Any] = {}
    [done] = asyncio.run(_run_agent(server, _key_probing_agent(server.url, seen), rollout))
    [attempt] = admin.get(f"/store/rollouts/{rollout['rollout_id']}/attempts").json()
    assert done.status.value == "succeeded", str(attempt)

    # What the agent could do with its key.
    key = seen["key"]
    assert KEY not in key
    assert seen["chat"] == "assistant" and seen["message"] == "assistant"
    assert server.model in seen["models"]
    assert seen["export"] == SpanExportResult.SUCCESS
    spans = admin.post("/store/spans/query", json={"rollout_ids": [rollout["rollout_id"]]})
    assert "agent-own-span" in [s["name"] for s in spans.json()]

    # What it cannot: the store's other routes, the plain gateway, another attempt's prefix.
    agent_http = httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {key}"}, timeout=60
    )
    version = {"name": "stolen", "adapter_path": "/tmp/anything", "base_model": server.model}
    refused = {
        "enqueue": agent_http.post("/store/rollouts", json={"rollouts": [{"input": "x"}]}),
        "query": agent_http.post("/store/rollouts/query", json={}),
        "dequeue": agent_http.post("/store/dequeue", json={"worker_id": "thief"}),
        "policy version": agent_http.post("/store/policy-versions", json=version),
        "policy versions": agent_http.get("/store/policy-versions"),
        "spans query": agent_http.post("/store/spans/query", json={"rollout_ids": []}),
        "feedback": agent_http.get("/feedback"),
        "details": agent_http.get("/health/details"),
        "plain gateway": agent_http.get("/v1/models"),
        "other attempt": agent_http.get(f"/rollouts/{rollout['rollout_id']}/attempts/x/v1/models"),
        "as x-api-key": httpx.post(
            f"{server.url}/store/rollouts/query", json={}, headers={"x-api-key": key}
        ),
    }
    assert {what: r.status_code for what, r in refused.items()} == dict.fromkeys(refused, 401)
    # Spans of another attempt: refused whole, over both span routes.
    forged_span = {
        "rollout_id": rollout["rollout_id"],
        "attempt_id": "someone-else",
        "trace_id": "0" * 31 + "1",
        "span_id": "0" * 15 + "1",
        "name": "forged-reward",
        "start_time": 1.0,
    }
    r = agent_http.post("/store/spans", json={"spans": [forged_span]})
    assert r.status_code == 403 and "someone-else" in r.text, r.text
    foreign = OTLPSpanExporter(
        endpoint=f"{server.url}/v1/traces", headers={"authorization": f"Bearer {key}"}, timeout=10
    )
    assert foreign.export(_attempt_span(rollout["rollout_id"], "someone-else")) != (
        SpanExportResult.SUCCESS
    )
    foreign.shutdown()
    # A forged agent key opens not even the attempt's own prefix.
    own = seen["base_url"].removeprefix(server.url)
    forged = key.rpartition(".")[0] + "." + "0" * 64
    r = httpx.get(f"{server.url}{own}/models", headers={"authorization": f"Bearer {forged}"})
    assert r.status_code == 401

    # The admin key still opens everything.
    assert admin.post("/store/rollouts/query", json={}).status_code == 200
    assert admin.get("/store/policy-versions").status_code == 200
    assert admin.get("/v1/models").status_code == 200


# ---------------------------------------------------------------------------- secrets in URLs


def _secret_config() -> TrainConfig:
    return TrainConfig(
        server={"vllm_url": f"http://llm:{PASSWORD}@gpu-box:8000"},
        registry=RegistryConfig(
            tracking_uri=f"postgresql://mlflow:{PASSWORD}@db:5432/mlflow?sslpassword={PASSWORD}"
        ),
    )


def test_mlflow_params_hold_no_password_from_a_url(tmp_path):
    """Finding: passwords inside `tracking_uri` or `vllm_url` are logged as MLflow params."""
    registry = RegistryConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    with tracking(registry, run_name="redaction") as run:
        log_params(_secret_config().model_dump(mode="json"), run_id=run.info.run_id)
    params = MlflowClient(registry.tracking_uri).get_run(run.info.run_id).data.params
    assert not [name for name, value in params.items() if PASSWORD in value]
    # Still readable: where the URL points, with the secret masked.
    assert params["server.vllm_url"] == "http://llm:***@gpu-box:8000"
    assert params["registry.tracking_uri"] == (
        "postgresql://mlflow:***@db:5432/mlflow?sslpassword=***"
    )


def test_prefect_records_no_password_from_a_url():
    """Finding: the same URLs travel as Prefect flow parameters (the train flow's fields, the
    subflows' `config`), which Prefect records and shows."""
    from lightning_rl.flows.batch_source import rollout_batch
    from lightning_rl.flows.evaluate import evaluate as evaluate_flow
    from lightning_rl.flows.iteration import train_iteration
    from lightning_rl.flows.train import train

    config = _secret_config()
    recorded = [
        train.serialize_parameters(config.model_dump()),
        train_iteration.serialize_parameters({"config": config, "iteration": 1}),
        rollout_batch.serialize_parameters({"config": config, "iteration": 1}),
        evaluate_flow.serialize_parameters({"registry": config.registry}),
    ]
    for parameters in recorded:
        assert PASSWORD not in str(parameters)
    assert recorded[1]["config"]["server"]["vllm_url"] == "http://llm:***@gpu-box:8000"


# ---------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression", ["(-8)**0.5", "(-8)**0.5 // 1", "(-1) ** -1.5 * 2"])
def test_the_calculator_refuses_complex_results(expression):
    """Finding: `(-8)**0.5` is a complex number returned as a success, and `(-8)**0.5 // 1`
    raises an uncaught TypeError."""
    with pytest.raises(CalculatorError, match="not a real number"):
        evaluate(expression)


async def test_an_arithmetic_error_is_a_failed_tool_call_with_its_span():
    """Finding: the calculator tool raised past the agent instead of failing as a tool call."""
    store = DuckDBStore(db=":memory:")
    [rollout] = await store.enqueue_rollouts([RolloutRequest(input=1)])
    claim = await store.dequeue("w")
    provider = tracing.setup_tracing(store=store, provider=TracerProvider(), instrument=False)
    expressions = ["(-8)**0.5", "(-8)**0.5 // 1", "1 % 0.0"]
    with tracing.rollout_context(rollout.rollout_id, claim.attempt.attempt_id):
        answers = [await calculate(e) for e in expressions]
    assert all(a.startswith("error: ") for a in answers), answers
    assert await asyncio.to_thread(tracing.flush)
    spans = await store.query_spans([rollout.rollout_id])
    tools = [s for s in spans if s.name == semconv.TOOL_SPAN]
    assert [s.attributes[semconv.TOOL_SUCCESS] for s in tools] == [False] * len(expressions)
    assert all(s.status_code == "error" for s in tools)
    provider.shutdown()
    await store.close()


# ---------------------------------------------------------------------------- run names


@pytest.mark.parametrize(
    ("flag", "name", "why"),
    [
        ("--run-name", "latest", "reserved"),
        ("--run-name", "LATEST", "reserved"),
        ("--run-name", "a/b", "not a folder name"),
        ("--run-name", "..", "not a folder name"),
        ("--resume", "latest", "reserved"),
        ("--resume", "../elsewhere", "not a folder name"),
    ],
)
def test_a_reserved_or_pathlike_run_name_is_refused_in_one_line(tmp_path, flag, name, why):
    """Finding: a run named `latest` turns runs/latest into a link to itself and loses the
    link to the previous run. The agent reference is bad too, so that an accepted name fails
    fast, later, for another reason, instead of starting a run."""
    done = run_cli(
        "train", flag, name, "--agent", "no.such:agent", "--run-dir", str(tmp_path / "runs")
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run name"), done.stderr
    assert why in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "latest").exists()


def test_the_latest_link_survives_a_refused_name(tmp_path):
    """The same finding, at the folder maker: the link keeps pointing at the newest run."""
    from lightning_core.errors import InvalidInput
    from lightning_rl.flows.run_state import run_folder

    runs = tmp_path / "runs"
    run_folder(runs, "first")
    with pytest.raises(InvalidInput, match="reserved"):
        run_folder(runs, "latest")
    assert Path(runs / "latest").resolve() == (runs / "first").resolve()
