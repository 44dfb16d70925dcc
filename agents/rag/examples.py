"""Worked examples for the rag agent, shown to the model as ordinary input items.

As input items (a question, searches with their real results, the answer), whichever way the
gateway renders tool calls, the examples show them that way. One example per kind of question,
each about a country no task asks about (data.EXAMPLE_COUNTRIES): copying one must not pay.
"""

from __future__ import annotations

import json
from typing import Any

from agents.rag import retrieval
from agents.rag.tool import TOOL_NAME, tool_output

# (question, the model's own searches after the agent's first one, answer)
Example = tuple[str, tuple[str, ...], str]
EXAMPLES: tuple[Example, ...] = (
    (
        "Portugal borders exactly one country. What is the capital of that country?",
        ("Spain",),
        "Madrid",
    ),
    # The first search finds Portugal's document: comparing takes a search for Poland's.
    ("Which has the larger population, Poland or Portugal?", ("Poland",), "Poland"),
    ("What is the capital of Poland?", (), "Warsaw"),
    ("Which country has Lisbon as its capital?", (), "Portugal"),
    ("Which language is spoken in the country whose capital is Warsaw?", (), "Polish"),
    ("Which currency is used in the country whose capital is Warsaw?", (), "PLN"),
    ("In which subregion of the world does Poland lie?", (), "Eastern Europe"),
)


def search_items(query: str, call_id: str) -> list[dict[str, Any]]:
    """A search for `query` and its real result, as input items."""
    call = {"query": query}
    return [
        {
            "type": "function_call",
            "call_id": call_id,
            "name": TOOL_NAME,
            "arguments": json.dumps(call),
        },
        {"type": "function_call_output", "call_id": call_id, "output": tool_output(query)},
    ]


def worked_example(question: str, queries: tuple[str, ...], answer: str) -> list[dict[str, Any]]:
    """A question, the agent's search for it, the model's own searches, then the answer."""
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for query in (question, *queries):
        items += search_items(query, f"example-{len(items)}")
    items.append({"role": "assistant", "content": f"ANSWER: {answer}"})
    return items


def _similarity(a: str, b: str) -> float:
    """Jaccard similarity of two questions' search words."""
    words_a, words_b = set(retrieval.tokenize(a)), set(retrieval.tokenize(b))
    return len(words_a & words_b) / max(1, len(words_a | words_b))


def nearest(question: str) -> Example:
    """The example whose question is most like `question` (the first of equals)."""
    return max(EXAMPLES, key=lambda e: _similarity(e[0], question))


def examples_for(question: str) -> list[dict[str, Any]]:
    """Every worked example, then the one most like `question` once more.

    SmolLM2-135M answers like the example it read last, whatever it is asked. Greedy, on the
    first 40 questions of the test split: with the capital example last, 5 of 5 capital and
    0 of 8 currency questions right; with the subregion example last, 0 of 5 and 0 of 8; with
    the nearest example last, 5 of 5 and 7 of 8. The others come first, in a fixed order: a
    prompt prefix every question shares, which the backend prefills once.
    """
    return [item for e in (*EXAMPLES, nearest(question)) for item in worked_example(*e)]
