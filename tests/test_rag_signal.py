"""The rag agent's learning signal: tiers for the curriculum, the agent's first search, the
worked examples, and AIR rules that reward the model's own searches, through real tracing."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from lightning_core import semconv
from lightning_core.algo.rewards import air_reward
from lightning_core.app import create_app
from lightning_core.rollouts.curriculum import Curriculum, CurriculumConfig
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest, RolloutStatus
from lightning_rl.agents.rag import load_tasks
from lightning_rl.agents.rag.agent import MAX_TURNS
from lightning_rl.agents.rag.examples import EXAMPLES, examples_for, nearest
from lightning_rl.agents.rag.reward import FORMAT_WEIGHT, normalize_answer
from lightning_rl.agents.rag.tool import NO_MATCH, results_text, tool_output
from lightning_rl.flows.profiles import PROFILES
from tests.conftest import ThreadedServer
from tests.rag_scripted import scripted_endpoint

# Kinds one document answers: the agent's first search must find it.
ONE_DOCUMENT = {
    "capital",
    "subregion",
    "country_by_capital",
    "language_by_capital",
    "currency_by_capital",
}

# --- tiers ------------------------------------------------------------------------------------


def test_every_task_has_its_hop_count_as_tier_and_test_has_200_or_more():
    train, test = load_tasks("train", 10_000), load_tasks("test", 10_000)
    for task in train + test:
        assert task["tier"] == f"{task['hops']}-hop"
    tiers = Counter(t["tier"] for t in test)
    assert set(tiers) == {"1-hop", "2-hop", "3-hop"} and all(n >= 40 for n in tiers.values())
    assert len(test) >= 200  # a held-out evaluation of 200 tasks never repeats one
    # The curriculum groups by the generic key: one tier per hop count.
    curriculum = Curriculum(train, CurriculumConfig(tier_key="tier"))
    assert set(curriculum.by_tier) == {"1-hop", "2-hop", "3-hop"}
    assert sum(len(v) for v in curriculum.by_tier.values()) == len(train)


# --- the agent's first search and the worked examples -----------------------------------------


def test_the_first_search_finds_the_answer_of_the_one_document_questions():
    tasks = [t for t in load_tasks("test", 10_000) if t["kind"] in ONE_DOCUMENT]
    assert len(tasks) >= 200
    missed = []
    for task in tasks:
        found = tool_output(task["question"])  # the agent's first search
        assert "\n" not in found  # one document per search
        if normalize_answer(task["answer"]) not in normalize_answer(found):
            missed.append(task["id"])
    # Bonaire's capital is "Kralendijk / Oranjestad / The Bottom": its document ranks first for
    # "Oranjestad", Aruba's capital.
    assert missed == ["country_by_capital-ABW"]
    assert tool_output("xyzzy qwerty") == NO_MATCH


def test_worked_examples_answer_from_what_they_read():
    for question, queries, answer in EXAMPLES:
        read = " ".join(results_text(q) or "" for q in (question, *queries))
        assert normalize_answer(answer) in normalize_answer(read), question


@pytest.mark.parametrize(
    ("kind", "example"),
    [
        ("capital", "What is the capital of Poland?"),
        ("country_by_capital", "Which country has Lisbon as its capital?"),
        ("subregion", "In which subregion of the world does Poland lie?"),
        ("language_by_capital", "Which language is spoken in the country whose capital is Warsaw?"),
        ("currency_by_capital", "Which currency is used in the country whose capital is Warsaw?"),
        ("larger_population", "Which has the larger population, Poland or Portugal?"),
    ],
)
def test_the_example_of_the_same_kind_comes_last(kind, example):
    tasks = [t for t in load_tasks("test", 10_000) if t["kind"] == kind]
    assert tasks
    for task in tasks:
        assert nearest(task["question"])[-1][0] == example, task["question"]
        items = examples_for(task["question"])
        questions = [i["content"] for i in items if i.get("role") == "user"]
        assert len(questions) == 2 and questions[-1] == example


def test_call_ids_are_unique_in_every_input():
    """The SDK keeps one input item per call id: a shared id would merge examples."""
    for task in load_tasks("test", 10_000):
        items = examples_for(task["question"])
        calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
        outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
        assert calls == outputs and len(set(calls)) == len(calls)
        assert "first-search" not in calls  # the agent's own first search's id


# --- AIR on the model's own searches ----------------------------------------------------------


def test_searching_without_answering_never_pays_more_than_answering():
    rules = PROFILES["rag"].air
    best_search = max(r.reward for r in rules)
    assert 0 < best_search * MAX_TURNS < FORMAT_WEIGHT
    assert all(r.reward < 0 for r in rules if r.reward != best_search)


async def test_air_rewards_new_documents_and_costs_repeats_and_misses():
    """Scripted model, real runner and tracing: the tool spans reach the store with their
    attributes and the rag profile's AIR rules score each search."""
    scripts = {
        # A new document; the document the agent's first search showed; nothing at all.
        "What is the capital of France?": ["Germany", "France", "xyzzy qwerty"],
        # A new document, then the same again.
        "What is the capital of Japan?": ["Germany", "Germany"],
    }
    tasks = [
        {"id": "fr", "question": "What is the capital of France?", "answer": "Paris"},
        {"id": "jp", "question": "What is the capital of Japan?", "answer": "Tokyo"},
    ]
    from lightning_rl.agents.rag import agent

    requests: list[dict[str, Any]] = []
    store = DuckDBStore(db=":memory:")
    with (
        ThreadedServer(scripted_endpoint(requests, scripts)) as model,
        ThreadedServer(create_app(store)) as server,
    ):
        async with HttpStoreClient(server.url) as client:
            queued = await client.enqueue_rollouts(
                [RolloutRequest(input=t, task_id=t["id"]) for t in tasks]
            )
            ids = [r.rollout_id for r in queued]
            runner = Runner(agent, client, model.url, RunnerConfig(default_model="policy"))
            done = await runner.run_until_done(ids, timeout=60)
            spans = await client.query_spans(ids, "latest")
    assert [r.status for r in done] == [RolloutStatus.succeeded] * 2
    # The scripted model answers Paris after its searches: right for France, format for Japan.
    assert [r.episode_return for r in done] == [1.0, pytest.approx(FORMAT_WEIGHT)]
    rules = PROFILES["rag"].air
    for rollout, expected in zip(done, ([0.02, -0.05, -0.05], [0.02, -0.05]), strict=True):
        tools = sorted(
            (
                s
                for s in spans
                if s.rollout_id == rollout.rollout_id and s.name == semconv.TOOL_SPAN
            ),
            key=lambda s: s.start_time,
        )
        assert [s.attributes[semconv.TOOL_NAME] for s in tools] == ["search"] * len(expected)
        assert [air_reward(s, rules) for s in tools] == pytest.approx(expected)
