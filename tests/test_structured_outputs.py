"""Structured outputs through the gateway, from the official clients, on the tiny RANDOM model.

A random model writes valid JSON only if decoding is constrained to the grammar, so every
object parsed here proves the constraint, and every span must decode to the exact text the
client received and say that the call was constrained.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.gateway.service import Gateway
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer


class Weather(BaseModel):
    """A report whose every field is bounded, so a random walk through its grammar ends."""

    city: str = Field(max_length=12, description="City name.")
    sky: Literal["sunny", "rainy", "cloudy"]
    celsius: int = Field(ge=-50, le=60)
    windy: bool


@pytest.fixture(scope="module")
def server():
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model="tiny")
    with ThreadedServer(create_app(store, gateway=Gateway(backend, store))) as running:
        running.model = backend.base_model
        running.tokenizer = backend.tokenizer
        yield running


@pytest.fixture
def attempt(server):
    with httpx.Client(base_url=server.url) as http:
        http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).raise_for_status()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    return f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1", rollout_id


def llm_spans(server, rollout_id: str) -> list[dict]:
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    return [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]


def span_text(server, span: dict, i: int = 0) -> str:
    ids = span["attributes"][semconv.RESPONSE.format(i=i, key="token_ids")]
    return server.tokenizer.decode(ids, skip_special_tokens=True)


def test_langchain_with_structured_output_returns_a_valid_object(server, attempt):
    from langchain_openai import ChatOpenAI

    base_url, rollout_id = attempt
    llm = ChatOpenAI(
        model=server.model, base_url=base_url, api_key="unused", temperature=1.0, max_retries=0
    )
    # LangChain's default method sends the pydantic model as a json_schema response_format.
    structured = llm.with_structured_output(Weather)
    reports = [structured.invoke("What is the weather in Paris?") for _ in range(3)]
    assert all(isinstance(r, Weather) for r in reports)
    spans = llm_spans(server, rollout_id)
    assert len(spans) == 3
    for span, report in zip(spans, reports, strict=True):
        assert span["attributes"][semconv.CONSTRAINT] == "json_schema"
        assert span["attributes"]["gen_ai.output.type"] == "json"
        assert Weather.model_validate_json(span_text(server, span)) == report


def test_json_object_from_the_openai_client_streamed_and_not(server, attempt):
    # json_object bounds no string, and a random model rarely closes one: of several samples,
    # every one that ends ("stop") is a JSON object, and some end within the budget.
    base_url, rollout_id = attempt
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Reply in JSON."}]
    whole = client.chat.completions.create(
        model=server.model,
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=300,
        n=8,
        seed=1,
    )
    whole_texts = [c.message.content for c in whole.choices]
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=300,
        n=4,
        seed=2,
        stream=True,
    )
    streamed, finishes = ["" for _ in range(4)], [None] * 4
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    for texts, reasons in (
        (whole_texts, [c.finish_reason for c in whole.choices]),
        (streamed, finishes),
    ):
        assert "stop" in reasons
        for text, reason in zip(texts, reasons, strict=True):
            assert reason in ("stop", "length")
            if reason == "stop":
                assert isinstance(json.loads(text), dict)
    spans = llm_spans(server, rollout_id)
    assert len(spans) == 2
    for span, texts in zip(spans, (whole_texts, streamed), strict=True):
        assert span["attributes"][semconv.CONSTRAINT] == "json_object"
        assert [span_text(server, span, i) for i in range(len(texts))] == texts


def test_unconstrained_calls_are_not_marked(server, attempt):
    base_url, rollout_id = attempt
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    [span] = llm_spans(server, rollout_id)
    assert semconv.CONSTRAINT not in span["attributes"]


# A grammar whose every walk ends within a few tokens: a random model's output is one of these
# words only if decoding followed the grammar.
ANSWERS = ("yes", "no", "maybe")
LARK = 'start: ANSWER "."\nANSWER: "yes" | "no" | "maybe"'


def test_a_lark_grammar_from_structured_outputs_in_extra_body(server, attempt):
    # vLLM's request field, sent the way its docs show from the openai client.
    base_url, rollout_id = attempt
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Will it rain?"}],
        max_tokens=16,
        n=6,
        seed=3,
        extra_body={"structured_outputs": {"grammar": LARK}},
    )
    texts = [c.message.content for c in reply.choices]
    assert all(c.finish_reason == "stop" for c in reply.choices)
    assert all(t in {f"{a}." for a in ANSWERS} for t in texts), texts
    completion = client.completions.create(
        model=server.model,
        prompt="Will it rain?",
        max_tokens=16,
        extra_body={"structured_outputs": {"grammar": LARK}},
    )
    assert completion.choices[0].text in {f"{a}." for a in ANSWERS}
    spans = llm_spans(server, rollout_id)
    assert len(spans) == 2
    for span in spans:
        assert span["attributes"][semconv.CONSTRAINT] == "grammar"
        assert span["attributes"][semconv.CONSTRAINT_GRAMMAR] == LARK
        assert span["attributes"]["gen_ai.output.type"] == "text"
    assert [span_text(server, spans[0], i) for i in range(6)] == texts


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, "not text, json_object or json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "needs a 'schema' object",
        ),
        ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}}, "unsupported grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, "regex is not supported"),
        (
            {"extra_body": {"structured_outputs": {"grammar": LARK, "json_object": True}}},
            "exactly one of",
        ),
        ({"extra_body": {"structured_outputs": {"grammar": 3}}}, "must be a Lark grammar"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "is not valid JSON"),
        ({"extra_body": {"guided_grammar": LARK}}, "vLLM's old field"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"grammar": LARK}},
            },
            "not both",
        ),
    ],
)
def test_a_bad_output_format_is_a_clear_400(server, request_fields, message):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            **request_fields,
        )
