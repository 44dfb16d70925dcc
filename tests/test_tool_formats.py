"""Tool calling for chat templates without tools: the Hermes and the line formats, rendered
into prompts and parsed back out of generated text."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lightning_core.gateway.chat import parse_tool_calls, render_chat, resolve_tool_format
from lightning_core.models import tiny_model_dir

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
}
HISTORY = [
    {"role": "system", "content": "You solve arithmetic."},
    {"role": "user", "content": "What is 3 * (4 + 5)?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expression": "3 * (4 + 5)"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "27"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_dir())


def test_auto_is_hermes_for_a_template_without_tools(tokenizer):
    assert resolve_tool_format(tokenizer, "auto") == "hermes"
    assert resolve_tool_format(tokenizer, "line") == "line"


def test_line_format_renders_tools_calls_and_results_as_lines(tokenizer):
    prompt = render_chat(tokenizer, HISTORY, [CALC, WEATHER], "line")
    assert "CALC: <expression>  (Evaluate an arithmetic expression.)" in prompt
    assert "GET_WEATHER: <arguments as a JSON object>" in prompt
    assert "CALC: 3 * (4 + 5)" in prompt and "RESULT: 27" in prompt
    assert "<tool_call>" not in prompt and "<tool_response>" not in prompt
    # The same history in Hermes form, for comparison.
    hermes = render_chat(tokenizer, HISTORY, [CALC], "hermes")
    assert '<tool_call>{"name":"calc","arguments":{"expression":"3 * (4 + 5)"}}' in hermes


@pytest.mark.parametrize(
    ("text", "content", "arguments"),
    [
        ("CALC: 2 * (3 + 4)", None, {"expression": "2 * (3 + 4)"}),
        ("calc: 17 - 5\nRESULT: 12\nANSWER: 12", None, {"expression": "17 - 5"}),
        ("Let me compute.\n`CALC: 6 / 2`", "Let me compute.", {"expression": "6 / 2"}),
    ],
)
def test_line_calls_are_parsed_and_what_follows_is_dropped(text, content, arguments):
    parsed_content, calls = parse_tool_calls(text, [CALC], "line")
    assert parsed_content == content
    [call] = calls
    assert call["function"]["name"] == "calc"
    assert json.loads(call["function"]["arguments"]) == arguments
    assert call["id"].startswith("call_") and call["type"] == "function"


def test_line_call_of_a_tool_with_several_arguments_takes_json(tokenizer):
    _, [call] = parse_tool_calls('GET_WEATHER: {"city": "Oslo", "unit": "C"}', [WEATHER], "line")
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    text = "GET_WEATHER: Oslo in celsius"  # not JSON: no call, the text stays
    assert parse_tool_calls(text, [WEATHER], "line") == (text, [])


@pytest.mark.parametrize("text", ["ANSWER: 27", "The answer is 27.", "CALC:", "SEARCH: cats"])
def test_text_without_a_line_call_is_plain_content(text):
    assert parse_tool_calls(text, [CALC], "line") == (text, [])
