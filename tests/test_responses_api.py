"""/v1/responses with the official clients against a real server and a real (tiny) model.

The `openai` client's `responses.create`, plain and streamed, and the OpenAI Agents SDK's default
model (the Responses API) running a tool. Every call made under a rollout attempt's base URL must
be stored as a span whose response token ids decode to exactly the text the client received
(for a tool call: the text the call was parsed from).
"""

from __future__ import annotations

import importlib
import re

import httpx
import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

import agents as sdk
from lightning_core import semconv
from lightning_core.gateway.chat import encode, render_chat
from tests.conftest import gateway_server
from tests.models import TOOL_CALL_TEXT, TOOL_QUESTION, TOOLS, answering_model
from tests.test_gateway import client, response_text, server  # noqa: F401  (server: a fixture)

QUESTION = TOOL_QUESTION[0]["content"]
# TOOLS in the Responses API's flat shape.
FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"], "strict": True}]


def new_attempt(url: str) -> tuple[str, str]:
    """A claimed rollout attempt on the server at `url`: (its OpenAI base URL, rollout id)."""
    with httpx.Client(base_url=url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    attempt_id = claim["attempt"]["attempt_id"]
    return f"{url}/rollouts/{rollout['rollout_id']}/attempts/{attempt_id}/v1", rollout["rollout_id"]


@pytest.fixture
def attempt(server):  # noqa: F811
    return new_attempt(server.url)


def spans_of(server, rollout_id: str) -> list[dict]:  # noqa: F811
    """The rollout's LLM call spans, in the order the calls were made."""
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    calls = [s for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]
    return sorted(calls, key=lambda s: s["start_time"])


def test_response_is_recorded_with_exact_token_ids(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    raw = client(base_url).responses.with_raw_response.create(
        model=server.model,
        instructions="Answer briefly.",
        input="Say something.",
        max_output_tokens=12,
        temperature=0,
    )
    # The SDK builds its models without validation: validate the wire body strictly.
    body = Response.model_validate(raw.http_response.json())
    response = raw.parse()
    assert response.id.startswith("resp_") and response.object == "response"
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].annotations == []
    [span] = spans_of(server, rollout_id)
    attrs = span["attributes"]
    assert response_text(server, span) == response.output_text == body.output_text
    assert attrs[semconv.API] == "responses"
    assert attrs["gen_ai.usage.input_tokens"] == response.usage.input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == response.usage.output_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    prompt = server.tokenizer.decode(attrs[semconv.PROMPT_TOKEN_IDS])
    assert prompt.index("Answer briefly.") < prompt.index("Say something.")
    finish = attrs[semconv.RESPONSE.format(i=0, key="finish_reason")]
    if finish == "length":
        assert response.status == "incomplete" and message.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert (response.temperature, response.max_output_tokens, response.tools) == (0, 12, [])


def test_a_short_limit_gives_an_incomplete_response(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    response = client(base_url).responses.create(
        model=server.model, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response_text(server, spans_of(server, rollout_id)[0]) == response.output_text


def test_streaming_matches_the_plain_answer(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    api = client(base_url)
    kwargs = dict(model=server.model, input="Count to five.", max_output_tokens=16, temperature=0)
    plain = api.responses.create(**kwargs)
    events = list(api.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    final = events[-1].response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = kinds[4:-4]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.model_dump(mode="json", by_alias=True, exclude_unset=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == plain.status and final.usage.output_tokens == plain.usage.output_tokens
    assert final.output[0].id == events[2].item.id == events[4].item_id
    streamed = spans_of(server, rollout_id)[-1]
    assert response_text(server, streamed) == text
    assert streamed["attributes"]["gen_ai.usage.input_tokens"] == final.usage.input_tokens


def test_sse_event_names_match_the_event_types(server, attempt):  # noqa: F811
    base_url, _ = attempt
    body = {"model": server.model, "input": "Hi.", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/responses", json=body) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        blocks = answer.read().decode().strip().split("\n\n")
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == orjson.loads(data_line[6:])["type"]
    assert "[DONE]" not in blocks[-1]


def test_tool_call_round_trip(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    api = client(base_url)
    first = api.responses.create(
        model=server.model,
        input=[{"role": "user", "content": QUESTION}],
        tools=FLAT_TOOLS,
        max_output_tokens=40,
        temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert (call.name, call.arguments, call.status) == ("add", '{"a":2,"b":3}', "completed")
    assert first.status == "completed" and first.tools[0].name == "add"
    # The flat tool and the input item render the very prompt the tool caller was trained on.
    [first_span] = spans_of(server, rollout_id)
    expected = encode(server.tokenizer, render_chat(server.tokenizer, TOOL_QUESTION, TOOLS))
    assert first_span["attributes"][semconv.PROMPT_TOKEN_IDS] == expected
    assert response_text(server, first_span) == TOOL_CALL_TEXT

    second = api.responses.create(
        model=server.model,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ],
        tools=FLAT_TOOLS,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.output[0].type == "message"
    second_span = spans_of(server, rollout_id)[1]
    prompt = server.tokenizer.decode(second_span["attributes"][semconv.PROMPT_TOKEN_IDS])
    assert "<tool_response>\n5\n</tool_response>" in prompt and '"name":"add"' in prompt
    message_text = second.output[0].content[0].text
    assert response_text(server, second_span).startswith(message_text)

    events = list(
        api.responses.create(
            model=server.model,
            input=QUESTION,
            tools=FLAT_TOOLS,
            tool_choice={"type": "function", "name": "add"},
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.status == "in_progress"
    assert events[4].arguments == '{"a":2,"b":3}' == events[-1].response.output[0].arguments
    assert response_text(server, spans_of(server, rollout_id)[2]) == TOOL_CALL_TEXT


def test_text_format_constrains_the_output(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "numbers", "schema": schema, "strict": True}
    response = client(base_url).responses.create(
        model=server.model, input="Give JSON.", max_output_tokens=12, text={"format": fmt}
    )
    assert response.text.format.type == "json_schema" and response.text.format.name == "numbers"
    assert re.match(r'\{\s*"a"\s*:', response.output_text), response.output_text
    assert response_text(server, spans_of(server, rollout_id)[0]) == response.output_text


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FLAT_TOOLS}, "nope"),
    ],
)
def test_what_is_not_served_is_refused_by_name(server, attempt, extra, named):  # noqa: F811
    base_url, rollout_id = attempt
    kwargs = {"model": server.model, "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError, match=named) as refused:
        client(base_url).responses.create(**kwargs)
    assert refused.value.body["type"] == "invalid_request_error"
    assert spans_of(server, rollout_id) == []


def test_store_is_accepted_and_nothing_is_kept(server, attempt):  # noqa: F811
    base_url, _ = attempt
    api = client(base_url)
    for store in (True, False):
        response = api.responses.create(
            model=server.model, input="hi", max_output_tokens=2, store=store, metadata={"k": "v"}
        )
        assert response.store is False and response.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        api.responses.create(
            model=server.model, input="and?", max_output_tokens=2, previous_response_id=response.id
        )


def test_a_backend_refusal_in_a_stream_is_an_error_event(server, attempt):  # noqa: F811
    base_url, rollout_id = attempt
    events = list(
        client(base_url).responses.create(
            model=server.model, input="hi", max_output_tokens=10_000, stream=True
        )
    )
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert "exceeds the model's context" in events[-1].message
    assert events[-1].code == "InvalidInput" and events[-1].sequence_number == 2
    assert spans_of(server, rollout_id) == []


def test_an_unknown_model_is_a_404_before_any_stream(server, attempt):  # noqa: F811
    base_url, _ = attempt
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(base_url).responses.create(model="no-such-model", input="hi", stream=True)


# --- the OpenAI Agents SDK's default model ----------------------------------------------------

INSTRUCTIONS = "You add numbers with the add tool."
FINAL_ANSWER = "The sum is 5."


@pytest.fixture
def sdk_defaults():
    """The SDK's global default client and tracing switch, put back after the test."""
    shared = importlib.import_module(f"{sdk.__name__}.models._openai_shared")
    client_before = shared.get_default_openai_client()
    yield
    shared.set_default_openai_client(client_before)
    sdk.set_tracing_disabled(False)


async def run_calculator(base_url: str, model: str, calls: list[tuple[int, int]]):
    """The SDK's default Agent and Runner, its default client pointed at `base_url` as the SDK's
    configuration docs show; the run's result, or None when the model's reply made it fail."""

    @sdk.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    custom_client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    sdk.set_default_openai_client(custom_client)
    sdk.set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's servers
    agent = sdk.Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[add],
        model=model,
        model_settings=sdk.ModelSettings(temperature=0, max_tokens=40),
    )
    try:
        return await sdk.Runner.run(agent, QUESTION)
    except sdk.ModelBehaviorError:  # an untrained model's reply ran out of tokens
        return None
    finally:
        await custom_client.close()


async def test_agents_sdk_default_model_runs_a_tool(server, sdk_defaults):  # noqa: F811
    """The SDK's prompts cannot be written by hand, so the tiny model learns them in two steps:
    the first turn's prompt (from a first run's span) answered with the call, then, once the
    model calls the tool, the second turn's prompt answered with the final text."""
    base_url, rollout_id = new_attempt(server.url)
    await run_calculator(base_url, server.model, [])
    first_prompt = _prompt_ids(server, rollout_id, 0)
    calls: list[tuple[int, int]] = []
    caller = answering_model([(first_prompt, TOOL_CALL_TEXT)])
    with gateway_server(tool_format="auto", model=str(caller)) as running:
        running.tokenizer = server.tokenizer
        base_url, rollout_id = new_attempt(running.url)
        await run_calculator(base_url, running.model, calls)
        assert calls == [(2, 3)]
        second_prompt = _prompt_ids(running, rollout_id, 1)
    answerer = answering_model([(first_prompt, TOOL_CALL_TEXT), (second_prompt, FINAL_ANSWER)])

    calls.clear()
    with gateway_server(tool_format="auto", model=str(answerer)) as running:
        running.tokenizer = server.tokenizer
        base_url, rollout_id = new_attempt(running.url)
        result = await run_calculator(base_url, running.model, calls)
        spans = spans_of(running, rollout_id)
    assert calls == [(2, 3)] and result.final_output == FINAL_ANSWER
    assert [s["attributes"][semconv.API] for s in spans] == ["responses", "responses"]
    assert [response_text(running, s) for s in spans] == [TOOL_CALL_TEXT, FINAL_ANSWER]
    assert [s["attributes"][semconv.PROMPT_TOKEN_IDS] for s in spans] == [
        first_prompt,
        second_prompt,
    ]
    second = server.tokenizer.decode(second_prompt)
    assert INSTRUCTIONS in second and "<tool_response>\n5\n</tool_response>" in second


def _prompt_ids(server, rollout_id: str, i: int) -> list[int]:  # noqa: F811
    return spans_of(server, rollout_id)[i]["attributes"][semconv.PROMPT_TOKEN_IDS]
