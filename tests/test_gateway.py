"""The gateway with the official `openai` client against a real server, a real (tiny) model.

Every call made under a rollout attempt's base URL must be stored as a span whose response
token ids decode to exactly the text the client received.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.gateway.service import Gateway, GatewayConfig
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer
from tests.models import TOOL_CALL_TEXT, TOOL_QUESTION, TOOLS, tool_calling_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tool_calling_model()
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(folder))
    # Adapters load from the tests' own folders only (adapter_folder.py).
    config = GatewayConfig(adapter_roots=[str(tmp_path_factory.getbasetemp())])
    app = create_app(store, gateway=Gateway(backend, store, config))
    with ThreadedServer(app) as running:
        running.model = backend.base_model
        running.tokenizer = AutoTokenizer.from_pretrained(folder)
        yield running


@pytest.fixture
def attempt(server):
    """A claimed rollout attempt: (its OpenAI base URL, rollout id, attempt id)."""
    with httpx.Client(base_url=server.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = rollout["rollout_id"], claim["attempt"]["attempt_id"]
    assert claim["rollout"]["rollout_id"] == rollout_id
    base_url = f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
    return base_url, rollout_id, attempt_id


def spans_of(server, rollout_id: str) -> list[dict]:
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    return [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]


def response_text(server, span: dict, i: int = 0) -> str:
    ids = span["attributes"][semconv.RESPONSE.format(i=i, key="token_ids")]
    return server.tokenizer.decode(ids, skip_special_tokens=True)


def client(base_url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, **kwargs)


def test_chat_is_recorded_with_exact_token_ids(server, attempt):
    base_url, rollout_id, attempt_id = attempt
    messages = [{"role": "user", "content": "Say something."}]
    answer = client(base_url).chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0
    )
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    [span] = spans_of(server, rollout_id)
    attrs = span["attributes"]
    assert response_text(server, span) == choice.message.content
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == server.model
    assert attrs["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert attrs[semconv.ATTEMPT_ID] == attempt_id and span["attempt_id"] == attempt_id
    assert attrs[semconv.POLICY_VERSION] == server.model
    prompt = server.tokenizer.decode(attrs[semconv.PROMPT_TOKEN_IDS])
    assert prompt.endswith("<|im_start|>assistant\n") and "Say something." in prompt
    logprobs = attrs[semconv.RESPONSE.format(i=0, key="logprobs")]
    assert len(logprobs) == answer.usage.completion_tokens and all(lp <= 0 for lp in logprobs)


def test_calls_outside_a_rollout_are_served_and_not_recorded(server, attempt):
    _, rollout_id, _ = attempt
    answer = client(f"{server.url}/v1").chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content is not None
    assert spans_of(server, rollout_id) == []


def test_streaming_matches_the_plain_answer_and_reports_usage(server, attempt):
    base_url, rollout_id, _ = attempt
    messages = [{"role": "user", "content": "Count to five."}]
    api = client(base_url)
    plain = api.chat.completions.create(
        model=server.model, messages=messages, max_tokens=16, temperature=0
    )
    chunks = list(
        api.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    streamed = spans_of(server, rollout_id)[-1]
    assert response_text(server, streamed) == text


def test_tool_call_round_trip(server, attempt):
    base_url, rollout_id, _ = attempt
    api = client(base_url)
    first = api.chat.completions.create(
        model=server.model, messages=TOOL_QUESTION, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert call.function.arguments == '{"a":2,"b":3}'
    messages = [
        *TOOL_QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = api.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].message is not None
    first_span, second_span = spans_of(server, rollout_id)
    # The recorded ids are the model's own: the call, as generated, decodes to the tag text.
    assert response_text(server, first_span) == TOOL_CALL_TEXT
    prompt = server.tokenizer.decode(second_span["attributes"][semconv.PROMPT_TOKEN_IDS])
    assert "<tool_response>\n5\n</tool_response>" in prompt and '"name":"add"' in prompt
    streamed = list(
        api.chat.completions.create(
            model=server.model,
            messages=TOOL_QUESTION,
            tools=TOOLS,
            max_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("add", '{"a":2,"b":3}')]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ""


def test_n_choices_logprobs_and_seed(server, attempt):
    base_url, rollout_id, _ = attempt
    api = client(base_url)
    kwargs = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Pick a word."}],
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    answer = api.chat.completions.create(**kwargs)
    again = api.chat.completions.create(**kwargs)
    assert len(answer.choices) == 3
    assert [c.message.content for c in answer.choices] == [c.message.content for c in again.choices]
    span = spans_of(server, rollout_id)[0]
    assert span["attributes"][semconv.RESPONSE_COUNT] == 3
    for i, choice in enumerate(answer.choices):
        assert response_text(server, span, i) == choice.message.content
        recorded = span["attributes"][semconv.RESPONSE.format(i=i, key="logprobs")]
        returned = [t.logprob for t in choice.logprobs.content]
        assert returned == pytest.approx(recorded)
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_stop_sequences_cut_the_text_and_the_ids(server, attempt):
    base_url, rollout_id, _ = attempt
    api = client(base_url)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = api.chat.completions.create(
        model=server.model, messages=messages, max_tokens=24, temperature=0
    ).choices[0]
    text = full.message.content
    assert len(text) > 12, "the tiny model's answer is too short to cut"
    stop = text[8:11]
    cut = api.chat.completions.create(
        model=server.model, messages=messages, max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.message.content and text.startswith(cut.message.content)
    assert response_text(server, spans_of(server, rollout_id)[-1]) == cut.message.content


def test_text_completions_and_models(server, attempt):
    base_url, rollout_id, _ = attempt
    api = client(base_url)
    answer = api.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=1
    )
    choice = answer.choices[0]
    assert len(choice.logprobs.token_logprobs) == answer.usage.completion_tokens
    [span] = spans_of(server, rollout_id)
    assert span["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert response_text(server, span) == choice.text
    assert [m.id for m in api.models.list()] == [server.model]


def test_agent_name_from_header_or_metadata(server, attempt):
    base_url, rollout_id, _ = attempt
    messages = [{"role": "user", "content": "hi"}]
    client(base_url, default_headers={"X-Lightning-Agent": "writer"}).chat.completions.create(
        model=server.model, messages=messages, max_tokens=2
    )
    client(base_url).chat.completions.create(
        model=server.model, messages=messages, max_tokens=2, metadata={"agent_name": "checker"}
    )
    names = [s["attributes"].get(semconv.AGENT_NAME) for s in spans_of(server, rollout_id)]
    assert names == ["writer", "checker"]


def test_openai_shaped_errors(server, attempt):
    base_url, _, _ = attempt
    api = client(base_url)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.chat.completions.create(model="no-such-model", messages=messages)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=server.model, messages=messages, n=0)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        api.chat.completions.create(model=server.model, messages=messages, logit_bias={"1": 5})
    wrong = client(f"{server.url}/rollouts/ro-nope/attempts/at-nope/v1")
    with pytest.raises(openai.NotFoundError):
        wrong.chat.completions.create(model=server.model, messages=messages)
    try:
        api.chat.completions.create(model="no-such-model", messages=messages)
    except openai.NotFoundError as exc:
        assert exc.body["type"] == "not_found_error" and exc.body["code"] == "NotFound"


def test_a_stream_refused_before_it_starts_is_a_plain_http_error(server, attempt):
    base_url, _, _ = attempt
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(base_url).chat.completions.create(
            model="no-such-model", messages=messages, stream=True
        )
    wrong = client(f"{server.url}/rollouts/ro-nope/attempts/at-nope/v1")
    with pytest.raises(openai.NotFoundError):
        wrong.chat.completions.create(model=server.model, messages=messages, stream=True)


async def test_async_client_concurrent_calls(server, attempt):
    base_url, rollout_id, _ = attempt
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello there."}]

    async def one(i: int) -> str:
        answer = await api.chat.completions.create(
            model=server.model, messages=messages, max_tokens=10, temperature=0.8, seed=i
        )
        return answer.choices[0].message.content

    async def streamed() -> str:
        stream = await api.chat.completions.create(
            model=server.model, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(6)), streamed())
    await api.close()
    spans = spans_of(server, rollout_id)
    assert len(spans) == 7
    assert sorted(response_text(server, s) for s in spans) == sorted(texts)


def test_a_registered_policy_version_is_loaded_and_served_by_name(server, attempt, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tool_calling_model())
    lora = LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    get_peft_model(base, lora).save_pretrained(tmp_path / "v1")
    version = {
        "name": "policy-v1",
        "base_model": server.model,
        "adapter_path": str(tmp_path / "v1"),
    }
    httpx.post(f"{server.url}/store/policy-versions", json=version).raise_for_status()

    base_url, rollout_id, _ = attempt
    api = client(base_url)
    messages = [{"role": "user", "content": "Say something."}]
    tuned = api.chat.completions.create(
        model="policy-v1", messages=messages, max_tokens=12, temperature=0
    )
    plain = api.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0
    )
    assert tuned.choices[0].message.content != plain.choices[0].message.content
    tuned_span, plain_span = spans_of(server, rollout_id)
    assert tuned_span["attributes"][semconv.POLICY_VERSION] == "policy-v1"
    assert plain_span["attributes"][semconv.POLICY_VERSION] == server.model
    assert response_text(server, tuned_span) == tuned.choices[0].message.content
    assert "policy-v1" in [m.id for m in api.models.list()]
