"""The gateway's /v1/messages with Anthropic's own client against a real server and tiny model.

As for OpenAI's APIs (test_gateway.py), every call made under a rollout attempt's base URL must be
stored as a span whose response token ids decode to exactly the text the client received.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.base import Constraint
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.gateway.anthropic_protocol import MessagesRequest
from lightning_core.gateway.chat import render_chat
from lightning_core.gateway.service import Gateway
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer
from tests.models import TOOL_CALL_TEXT, TOOL_QUESTION, TOOLS, tool_calling_model

# The `add` tool of tests/models.py, as Anthropic's clients declare it.
ADD_TOOL = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": TOOLS[0]["function"]["parameters"],
}
QUESTION = TOOL_QUESTION[0]["content"]
# Anthropic's client no longer lists sampling parameters; they go in the body as extra fields.
GREEDY = {"extra_body": {"temperature": 0}}


def _serve(api_key: str | None = None) -> ThreadedServer:
    folder = tool_calling_model()
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(folder))
    server = ThreadedServer(create_app(store, api_key=api_key, gateway=Gateway(backend, store)))
    server.model = backend.base_model
    server.tokenizer = AutoTokenizer.from_pretrained(folder)
    return server


@pytest.fixture(scope="module")
def server():
    with _serve() as running:
        yield running


def _attempt(url: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """A claimed rollout attempt: (Anthropic base URL, rollout id). The client adds /v1."""
    with httpx.Client(base_url=url, headers=headers) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = rollout["rollout_id"], claim["attempt"]["attempt_id"]
    return f"{url}/rollouts/{rollout_id}/attempts/{attempt_id}", rollout_id


@pytest.fixture
def attempt(server):
    return _attempt(server.url)


def spans_of(server, rollout_id: str) -> list[dict]:
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    return [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]


def response_text(server, span: dict) -> str:
    ids = span["attributes"][semconv.RESPONSE.format(i=0, key="token_ids")]
    return server.tokenizer.decode(ids, skip_special_tokens=True)


def client(base_url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def assert_recorded(server, span: dict, message: anthropic.types.Message) -> None:
    attrs = span["attributes"]
    assert response_text(server, span) == text_of(message)
    assert attrs["gen_ai.usage.input_tokens"] == message.usage.input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == message.usage.output_tokens
    assert attrs["gen_ai.response.id"] == message.id


def test_message_is_recorded_with_exact_token_ids(server, attempt):
    base_url, rollout_id = attempt
    message = client(base_url).messages.create(
        model=server.model,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say something."}],
        **GREEDY,
    )
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.model == server.model
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    [span] = spans_of(server, rollout_id)
    assert_recorded(server, span, message)
    attrs = span["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    prompt = server.tokenizer.decode(attrs[semconv.PROMPT_TOKEN_IDS])
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n") and "Say something." in prompt


def test_streamed_events_and_the_stream_helper(server, attempt):
    base_url, rollout_id = attempt
    api = client(base_url)
    kwargs = dict(
        model=server.model,
        max_tokens=16,
        system=[{"type": "text", "text": "You count."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Count to five."}]}],
        **GREEDY,
    )
    plain = api.messages.create(**kwargs)
    events = list(api.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == [
        "content_block_start",
        *["content_block_delta"] * (len(kinds) - 5),
        "content_block_stop",
    ]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == plain.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(plain)
    assert events[-2].delta.stop_reason == plain.stop_reason
    assert events[-2].usage.output_tokens == plain.usage.output_tokens
    with api.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(plain)
    assert final.usage == plain.usage and final.stop_reason == plain.stop_reason
    plain_span, raw_span, helper_span = spans_of(server, rollout_id)
    assert_recorded(server, plain_span, plain)
    assert_recorded(server, helper_span, final)
    assert response_text(server, raw_span) == text
    assert raw_span["attributes"][semconv.API] == "messages"


def test_tool_use_round_trip(server, attempt):
    base_url, rollout_id = attempt
    api = client(base_url)
    question = [{"role": "user", "content": QUESTION}]
    # Anthropic's form of the OpenAI request the test model was trained on renders its prompt.
    translated = MessagesRequest(
        model=server.model, max_tokens=1, messages=question, tools=[ADD_TOOL]
    )
    tokenizer = server.tokenizer
    assert render_chat(
        tokenizer, translated.chat_messages(), translated.offered_tools()
    ) == render_chat(tokenizer, TOOL_QUESTION, TOOLS)

    first = api.messages.create(
        model=server.model, max_tokens=40, messages=question, tools=[ADD_TOOL], **GREEDY
    )
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "add" and call.input == {"a": 2, "b": 3} and call.id.startswith("toolu_")
    messages = [
        *question,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}],
        },
    ]
    second = api.messages.create(
        model=server.model, max_tokens=8, messages=messages, tools=[ADD_TOOL], **GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    first_span, second_span = spans_of(server, rollout_id)
    # The recorded ids are the model's own: the call, as generated, decodes to the tag text.
    assert response_text(server, first_span) == TOOL_CALL_TEXT
    assert_recorded(server, second_span, second)
    prompt = tokenizer.decode(second_span["attributes"][semconv.PROMPT_TOKEN_IDS])
    assert "<tool_response>\n5\n</tool_response>" in prompt and '"name":"add"' in prompt

    with api.messages.stream(
        model=server.model, max_tokens=40, messages=question, tools=[ADD_TOOL], **GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "add", {"a": 2, "b": 3})
    ]
    assert response_text(server, spans_of(server, rollout_id)[-1]) == TOOL_CALL_TEXT


def test_stop_sequences(server, attempt):
    base_url, rollout_id = attempt
    api = client(base_url)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = api.messages.create(model=server.model, max_tokens=24, messages=messages, **GREEDY)
    text = text_of(full)
    assert len(text) > 12, "the tiny model's answer is too short to cut"
    stop = text[8:11]
    cut = api.messages.create(
        model=server.model, max_tokens=24, messages=messages, stop_sequences=[stop], **GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in text_of(cut) and text.startswith(text_of(cut))
    assert_recorded(server, spans_of(server, rollout_id)[-1], cut)
    with api.messages.stream(
        model=server.model, max_tokens=24, messages=messages, stop_sequences=[stop], **GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert text_of(streamed) == text_of(cut)
    # Of several, the one that ended the answer is named, streamed or not.
    several = ["\u2603never\u2603", stop, "\u2604never\u2604"]
    named = api.messages.create(
        model=server.model, max_tokens=24, messages=messages, stop_sequences=several, **GREEDY
    )
    assert (named.stop_reason, named.stop_sequence) == ("stop_sequence", stop)
    with api.messages.stream(
        model=server.model, max_tokens=24, messages=messages, stop_sequences=several, **GREEDY
    ) as stream:
        assert stream.get_final_message().stop_sequence == stop


def test_anthropic_shaped_errors(server, attempt):
    base_url, _ = attempt
    api = client(base_url)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError, match="not served here"):
        api.messages.create(model="no-such-model", max_tokens=4, messages=messages)
    with pytest.raises(anthropic.NotFoundError, match="not served here"):
        api.messages.create(model="no-such-model", max_tokens=4, messages=messages, stream=True)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        api.post(
            "/v1/messages",
            body={"model": server.model, "messages": messages},
            cast_to=anthropic.types.Message,
        )
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError, match="'image' block"):
        api.messages.create(
            model=server.model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        api.messages.create(
            model=server.model,
            max_tokens=2048,
            messages=messages,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        api.messages.create(
            model=server.model, max_tokens=4, messages=messages, extra_body={"top_k": 5}
        )
    try:
        api.messages.create(model="no-such-model", max_tokens=4, messages=messages)
    except anthropic.NotFoundError as exc:
        assert exc.body == {"type": "error", "error": exc.body["error"]}
        assert exc.body["error"]["type"] == "not_found_error"
    wrong = client(f"{server.url}/rollouts/ro-nope/attempts/at-nope")
    with pytest.raises(anthropic.NotFoundError):
        wrong.messages.create(model=server.model, max_tokens=4, messages=messages)


def test_api_key_in_x_api_key():
    with _serve(api_key="k") as server:
        base_url, rollout_id = _attempt(server.url, headers={"Authorization": "Bearer k"})
        messages = [{"role": "user", "content": "hi"}]
        message = client(base_url, api_key="k").messages.create(
            model=server.model, max_tokens=4, messages=messages
        )
        with pytest.raises(anthropic.AuthenticationError):
            client(base_url, api_key="wrong").messages.create(
                model=server.model, max_tokens=4, messages=messages
            )
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}) as http:
            spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
        [span] = [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]
        assert response_text(server, span) == text_of(message)


def test_wire_format_is_anthropics(server, attempt):
    """Raw bodies and events validate strictly against the SDK's own models."""
    from pydantic import TypeAdapter

    base_url, _ = attempt
    body = {"model": server.model, "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    plain = httpx.post(f"{base_url}/v1/messages", json=body)
    anthropic.types.Message.model_validate(plain.json(), strict=True)
    events = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().split("\n\n")
    assert frames.pop() == ""
    kinds = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        kind = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == kind
        if kind != "ping":
            events.validate_python(data, strict=True)
        kinds.append(kind)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]


def test_agent_name_from_metadata(server, attempt):
    base_url, rollout_id = attempt
    client(base_url).messages.create(
        model=server.model,
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "u-1", "agent_name": "checker"},
    )
    [span] = spans_of(server, rollout_id)
    assert span["attributes"][semconv.AGENT_NAME] == "checker"


def test_output_config_format_is_enforced(server, attempt):
    base_url, rollout_id = attempt
    schema = {
        "type": "object",
        "properties": {"sky": {"enum": ["sunny", "rainy"]}, "windy": {"type": "boolean"}},
        "required": ["sky", "windy"],
        "additionalProperties": False,
    }
    message = client(base_url).messages.create(
        model=server.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    report = json.loads(text_of(message))
    assert report["sky"] in ("sunny", "rainy") and isinstance(report["windy"], bool)
    [span] = spans_of(server, rollout_id)
    assert_recorded(server, span, message)
    assert span["attributes"][semconv.CONSTRAINT] == "json_schema"


def test_a_backend_refusal_before_streaming_is_an_http_error(server, attempt):
    base_url, _ = attempt
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client(base_url).messages.create(
            model=server.model,
            max_tokens=10_000,  # over the model's context, under the gateway's limits
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )


async def test_an_error_mid_stream_is_an_error_event():
    """Once the stream has started, a failure is Anthropic's `error` event, and nothing after."""
    from lightning_core.errors import InvalidInput
    from lightning_core.gateway.anthropic_api import MessagesAPI
    from lightning_core.gateway.service import ChatCall

    async def failing():
        raise InvalidInput("the backend gave up")
        yield  # an async generator

    req = MessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    call = ChatCall(model="m", messages=req.chat_messages(), params=req.sampling())
    frames = [f async for f in MessagesAPI(gateway=None)._stream(req, call, "msg_1", 3, failing())]
    assert frames[0].startswith(b"event: message_start\n")
    last = frames[-1].decode()
    assert last.startswith("event: error\ndata: ")
    error = json.loads(last.split("data: ", 1)[1])
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the backend gave up"},
    }


def test_tool_results_come_before_the_text_of_their_turn():
    use = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}
    failed = {
        "type": "tool_result",
        "tool_use_id": "t2",
        "content": [{"type": "text", "text": "no"}],
    }
    turn = [
        {"type": "text", "text": "Here:"},
        {"type": "tool_result", "tool_use_id": "t1", "content": "5"},
        {**failed, "is_error": True},
    ]
    req = MessagesRequest(
        model="m",
        max_tokens=4,
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, use]},
            {"role": "user", "content": turn},
        ],
    )
    call = {"name": "add", "arguments": '{"a":2,"b":3}'}
    assert req.chat_messages()[1:] == [
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [{"id": "t1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "5"},
        {
            "role": "tool",
            "tool_call_id": "t2",
            "content": [{"type": "text", "text": "Error: "}, {"type": "text", "text": "no"}],
        },
        {"role": "user", "content": "Here:"},
    ]


def test_output_config_format_becomes_a_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = MessagesRequest(
        model="m",
        max_tokens=4,
        messages=[{"role": "user", "content": "q"}],
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
    )
    assert req.sampling().constraint == Constraint(kind="json_schema", json_schema=schema)
