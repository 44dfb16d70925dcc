"""The rag agent: its corpus, search, questions and reward; the Agents SDK loop against a scripted
endpoint; and the agent end to end against the gateway (SmolLM2, line tool format) under the real
Runner."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from countryinfo import CountryInfo

from lightning_core import semconv
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.models import DEFAULT_MODEL
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import LLMEndpoint, RolloutRequest, RolloutStatus
from lightning_rl.agents.rag import load_tasks
from lightning_rl.agents.rag.agent import MAX_TURNS, model_settings, solve
from lightning_rl.agents.rag.corpus import by_name, countries, documents
from lightning_rl.agents.rag.data import countries_in_test
from lightning_rl.agents.rag.examples import examples_for
from lightning_rl.agents.rag.languages import LANGUAGE_NAMES
from lightning_rl.agents.rag.retrieval import MAX_DOC_CHARS, ranked, search
from lightning_rl.agents.rag.reward import (
    answer_reward,
    extract_answer,
    f1_score,
    reading_reward,
)
from tests.conftest import ThreadedServer, gateway_server
from tests.rag_scripted import ANSWER, scripted_endpoint

# --- corpus and search ------------------------------------------------------------------------


def test_corpus_has_one_document_per_country_with_its_facts():
    docs = documents()
    assert 230 <= len(docs) <= 256
    assert len({d.title for d in docs}) == len(docs) == len(countries())
    assert all(d.text.startswith(f"{d.title}. ") and "Capital: " in d.text for d in docs)
    france = next(d.text for d in docs if d.title == "France")
    for fact in (
        "Region: Europe. Subregion: Western Europe.",
        "Capital: Paris.",
        "Population: 66,078,000.",
        "Area: 640,679 km2.",
        "Languages: French.",
        "Currency: EUR.",
        "Borders: Andorra, Belgium, Germany, Italy, Luxembourg, Monaco, Spain and Switzerland.",
    ):
        assert fact in france
    # "none" only where the data says so; where it says nothing, no field.
    assert "Borders: none." in next(d.text for d in docs if d.title == "Japan")
    # Duplicate entries of the data (Burma beside Myanmar) and former states are left out.
    assert "Myanmar" in by_name() and "Burma" not in by_name()
    assert "Serbia and Montenegro" not in by_name()


@pytest.mark.parametrize("name", ["France", "Kenya", "Brazil", "Mongolia", "Japan", "Switzerland"])
def test_country_facts_match_the_raw_data(name):
    raw, mine = CountryInfo(name), by_name()[name]
    assert (mine.capital, mine.population, mine.area) == (
        raw.capital(),
        raw.population(),
        raw.area(),
    )
    assert (mine.region, mine.subregion) == (raw.region(), raw.subregion())
    assert mine.borders == tuple(sorted(n.name() for n in raw.neighbors()))
    assert mine.languages == tuple(LANGUAGE_NAMES[c] for c in raw.languages())


@pytest.mark.parametrize(
    ("query", "title"),
    [
        ("France", "France"),
        ("capital of Japan", "Japan"),
        ("Nairobi", "Kenya"),
        ("Bogota", "Colombia"),  # accents folded: the document says Bogotá
        ("Sao Tome and Principe", "São Tomé and Príncipe"),
        ("Which country has Canberra as its capital?", "Australia"),
        ("population of Mongolia", "Mongolia"),
    ],
)
def test_bm25_finds_the_country_document(query, title):
    assert documents()[ranked(query)[0]].title == title


def test_search_results_are_bounded_and_nothing_matches_nonsense():
    results = search("Russia China Mongolia Kazakhstan", k=3)
    assert len(results) == 3 and all(len(r) <= MAX_DOC_CHARS for r in results)
    assert search("xyzzy qwerty") == [] and search("") == []


# --- questions --------------------------------------------------------------------------------


def _raw_country_with_capital(capital: str) -> str:
    """The one country whose capital this is, from the raw data: entries their own code names,
    less the former states Serbia and Montenegro (SCG) and the Netherlands Antilles (ANT)."""
    found = set()
    for entry in CountryInfo.all().values():
        cap = entry.get("capital")
        cap = cap[0] if isinstance(cap, list) and cap else cap
        code = (entry.get("ISO") or {}).get("alpha3")
        if code in (None, "SCG", "ANT") or cap != capital:
            continue
        if CountryInfo(code).name() == entry["name"]:
            found.add(entry["name"])
    assert len(found) == 1, (capital, found)
    return found.pop()


def _largest(name: str, key: str) -> CountryInfo:
    neighbours = CountryInfo(name).neighbors()
    values = sorted((getattr(n, key)() for n in neighbours), reverse=True)
    assert len(values) >= 2 and values[0] != values[1]
    return max(neighbours, key=lambda n: getattr(n, key)())


_RECOMPUTE = {
    r"In which subregion of the world does (.+) lie\?": lambda x: CountryInfo(x).subregion(),
    r"Which country has (.+) as its capital\?": _raw_country_with_capital,
    r"Which language is spoken in the country whose capital is (.+)\?": lambda y: LANGUAGE_NAMES[
        CountryInfo(_raw_country_with_capital(y)).languages()[0]
    ],
    r"Which currency is used in the country whose capital is (.+)\?": lambda y: CountryInfo(
        _raw_country_with_capital(y)
    ).currencies()[0],
    r"(.+) borders exactly one country\. What is the capital of that country\?": lambda x: (
        CountryInfo(x).neighbors()[0].capital()
    ),
    r"Which country bordering (.+) has the largest population\?": lambda x: _largest(
        x, "population"
    ).name(),
    r"What is the capital of the most populous country bordering (.+)\?": lambda x: _largest(
        x, "population"
    ).capital(),
    r"In which region is the largest country by area that borders (.+)\?": lambda x: _largest(
        x, "area"
    ).region(),
    r"Which has the larger population, (.+) or (.+)\?": lambda a, b: max(
        (a, b), key=lambda n: CountryInfo(n).population()
    ),
    # Last: the pattern also matches the neighbour questions above.
    r"What is the capital of (.+)\?": lambda x: CountryInfo(x).capital(),
}


def _recompute(question: str) -> str:
    for pattern, answer in _RECOMPUTE.items():  # in order: the first match wins
        match = re.fullmatch(pattern, question)
        if match:
            return answer(*match.groups())
    raise AssertionError(f"no known pattern: {question}")


def test_gold_answers_agree_with_the_raw_data():
    tasks = load_tasks("train", 10_000) + load_tasks("test", 10_000)
    kinds = {t["kind"] for t in tasks}
    assert len(kinds) == 10
    for task in tasks:
        assert _recompute(task["question"]) == task["answer"], task


def test_splits_are_fixed_disjoint_and_mixed():
    train, test = load_tasks("train", 10_000), load_tasks("test", 10_000)
    assert len(train) > 1000 and len(test) > 250
    assert load_tasks("test", 40) == test[:40]  # fixed order: a smaller size is a prefix
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert len({t["id"] for t in train + test}) == len(train) + len(test)
    # By country: the country a test question is about is never a train question's subject.
    subject = lambda t: t["id"].rsplit("-", 1)[1]  # noqa: E731
    assert {subject(t) for t in test} <= countries_in_test()
    assert not {subject(t) for t in train} & countries_in_test()
    # No task is about a country of the agent's worked examples (Poland, Portugal).
    assert not {subject(t) for t in train + test} & {"POL", "PRT"}
    assert {t["hops"] for t in test[:40]} == {1, 2, 3}
    fields = {"id", "question", "answer", "hops", "kind", "tier"}
    assert all(set(t) == fields for t in test)
    assert all(set(t) in (fields, fields | {"via"}) for t in train)
    assert {t["hops"] for t in load_tasks("test", 500, "multi_hop")} == {2, 3}
    assert {t["hops"] for t in load_tasks("test", 500, "single_hop")} == {1}


def test_train_tasks_name_the_documents_a_second_hop_needs():
    train = {t["id"]: t for t in load_tasks("train", 10_000)}
    # Tanzania's neighbours are all the documents that tell which is most populous.
    tanzania = by_name()["Tanzania"]
    assert train["populous_neighbour_capital-TZA"]["via"] == list(tanzania.borders)
    assert all("via" not in t for t in train.values() if t["hops"] == 1)
    assert all("via" in t for t in train.values() if "neighbour" in t["kind"])
    # Both countries compared, whichever the first search finds.
    pair = next(t for t in train.values() if t["kind"] == "larger_population")
    assert len(pair["via"]) == 2 and all(name in pair["question"] for name in pair["via"])
    # The worked examples' country for the neighbour kinds is asked about nowhere.
    for split in ("train", "test", "kinds"):
        assert not any(t["id"].endswith("-LIE") for t in load_tasks(split, 10_000))


def test_held_out_kinds_are_new_question_shapes_about_test_countries():
    kinds = load_tasks("kinds", 10_000)
    seen = load_tasks("train", 10_000) + load_tasks("test", 10_000)
    assert load_tasks("kinds", 30) == kinds[:30]
    assert not {t["kind"] for t in kinds} & {t["kind"] for t in seen}
    assert not {t["question"] for t in kinds} & {t["question"] for t in seen}
    assert {t["id"].rsplit("-", 1)[1] for t in kinds} <= countries_in_test()
    assert {t["tier"] for t in kinds} == {"1-hop", "2-hop", "3-hop"}
    assert len(kinds) >= 200 and all("via" not in t for t in kinds)
    first = {t["kind"]: t for t in kinds}
    # Answers read from the facts: a few by hand.
    kenya = by_name()["Kenya"]
    assert first["subregion_by_capital"]["answer"] in {c.subregion for c in countries()}
    assert {"id": "subregion_by_capital-KEN", "answer": kenya.subregion}.items() <= next(
        t for t in kinds if t["id"] == "subregion_by_capital-KEN"
    ).items()
    switzerland = next(t for t in kinds if t["id"] == "largest_neighbour_capital-CHE")
    assert switzerland["answer"] == "Paris"  # France: 551,695 km2 of its five neighbours


def test_task_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        load_tasks("dev", 10)
    with pytest.raises(ValueError, match="source"):
        load_tasks("train", 10, "trivia")
    with pytest.raises(ValueError, match="size"):
        load_tasks("train", 0)


# --- reward -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gold", "reward"),
    [
        ("ANSWER: Paris", "Paris", 1.0),  # exact
        ("ANSWER: the paris.", "Paris", 1.0),  # articles, case, punctuation normalised
        ("ANSWER: Bogota", "Bogotá", 1.0),  # accents folded
        ("ANSWER: Europe", "Western Europe", 0.1 + 0.9 * (2 / 3)),  # partial overlap
        ("ANSWER: The capital is Paris", "Paris", 0.1 + 0.9 * 0.5),  # extra words
        ("ANSWER: Lyon", "Paris", 0.1),  # wrong answer, right format
        ("ANSWER:", "Paris", 0.0),  # empty answer
        ("", "Paris", 0.0),
        (None, "Paris", 0.0),
        ("The capital of France is Paris, I think.", "Paris", 0.0),  # rambling, no marker
        ("SEARCH: France\nANSWER: Paris\nThat is all.", "Paris", 1.0),  # the answer line only
        ("answer: Lyon\nANSWER: Paris", "Paris", 1.0),  # the last marker counts
    ],
)
def test_reward_is_format_plus_f1(text, gold, reward):
    assert answer_reward(text, gold) == pytest.approx(reward)


def test_reading_the_documents_of_a_second_hop_earns_partial_credit():
    via = ["Austria", "Switzerland"]
    # A wrong answer: 0.1 for its format, or 0.1 + 0.3 x the share of `via` read, if more.
    assert reading_reward("ANSWER: Bern", "Vienna", via, set()) == pytest.approx(0.1)
    assert reading_reward("ANSWER: Bern", "Vienna", via, {"Austria"}) == pytest.approx(0.25)
    read = {"Liechtenstein", "Austria", "Switzerland"}
    assert reading_reward("ANSWER: Bern", "Vienna", via, read) == pytest.approx(0.4)
    # A right answer earns what it always did, read or not; no answer earns nothing.
    assert reading_reward("ANSWER: Vienna", "Vienna", via, set()) == 1.0
    assert reading_reward("ANSWER: Vienna", "Vienna", via, read) == 1.0
    assert reading_reward("", "Vienna", via, read) == 0.0
    # Partly right (F1 2/3: 0.1 + 0.9 x 2/3) beats the reading credit (0.4): the larger counts.
    assert reading_reward("ANSWER: Vienna city", "Vienna", via, read) == pytest.approx(0.7)
    # A task without `via` (every held-out task) is scored on its answer alone.
    assert reading_reward("ANSWER: Bern", "Vienna", None, read) == pytest.approx(0.1)
    # Never a success (0.9) without the right answer.
    assert reading_reward("ANSWER: Bern", "Vienna", via, read) < 0.9


def test_answer_extraction_and_f1():
    assert extract_answer("ANSWER: **Madrid**") == "Madrid"
    assert extract_answer("ANSWER:   \nnext") is None
    assert f1_score("Sub-Saharan Africa", "Sub Saharan Africa") == 1.0
    assert f1_score("", "Paris") == 0.0


# --- the Agents SDK loop against a scripted endpoint ------------------------------------------


def test_import_agents_is_the_sdk_even_from_the_repository_root():
    # The repository's agents/ folder has no __init__.py: a namespace portion, which the SDK's
    # regular package wins over, whatever comes first on the path.
    root = Path(__file__).resolve().parents[1]
    code = (
        "import importlib, agents;"
        "rag = importlib.import_module('lightning_rl.agents.rag.agent');"
        "print(agents.__file__, hasattr(agents, 'Runner'), rag.sdk is agents)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    where, is_sdk, same = done.stdout.split()
    assert "site-packages" in where and is_sdk == "True" and same == "True"


def test_model_settings_come_from_the_endpoints_sampling():
    llm = LLMEndpoint(base_url="http://x/v1", model="m", sampling={"temperature": 0, "seed": 3})
    settings = model_settings(llm)
    assert (settings.temperature, settings.max_tokens) == (0, 32)
    # One line and one sentence per reply.
    assert settings.extra_body == {"seed": 3, "stop": ["\n", ". "]}


async def test_agent_searches_the_question_then_the_model_searches_and_answers():
    requests: list[dict[str, Any]] = []
    question = "What is the capital of France?"
    with ThreadedServer(scripted_endpoint(requests, {question: ["Germany"]})) as server:
        llm = LLMEndpoint(base_url=f"{server.url}/v1", model="policy", sampling={"temperature": 0})
        read: set[str] = set()
        assert await solve(question, llm, read) == ANSWER
        assert read == {"France", "Germany"}  # the first search's document, then the model's
        first, second = requests
        assert first["agent_header"] == "rag" and first["temperature"] == 0
        assert first["max_output_tokens"] == 32 and first["stop"] == ["\n", ". "]
        assert "store" not in first and "previous_response_id" not in first
        assert [t["name"] for t in first["tools"]] == ["search"]
        assert first["instructions"].startswith("You answer questions about countries.")
        # Every worked example arrives whole (the SDK drops items whose call id repeats), then
        # the question, the agent's search for it and its result.
        assert first["input"][:-3] == examples_for(question)
        asked, call, found = first["input"][-3:]
        assert asked == {"role": "user", "content": question}
        assert json.loads(call["arguments"]) == {"query": question}
        assert found["type"] == "function_call_output" and found["call_id"] == call["call_id"]
        assert found["output"].startswith("France.") and "Capital: Paris." in found["output"]
        # The model's own search went back to it as the tool call's output.
        assert second["input"][-1]["type"] == "function_call_output"
        assert second["input"][-1]["output"].startswith("Germany.")
        requests.clear()
        assert await solve("Search forever?", llm) == ""  # out of turns: no answer
        assert len(requests) == MAX_TURNS


# --- the agent through the gateway ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_server():
    with gateway_server(tool_format="line") as running:
        yield running


class _OnlyLoopback:
    """Records every name lookup and connection to a host other than this machine."""

    def __init__(self) -> None:
        self.outside: list[str] = []
        self._lock = threading.Lock()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        lookup, connect = socket.getaddrinfo, socket.socket.connect

        def getaddrinfo(host, *args, **kwargs):
            self._check(host)
            return lookup(host, *args, **kwargs)

        def guarded_connect(sock, address):
            if isinstance(address, tuple):
                self._check(address[0])
            return connect(sock, address)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        monkeypatch.setattr(socket.socket, "connect", guarded_connect)

    def _check(self, host: Any) -> None:
        if isinstance(host, bytes):
            host = host.decode()
        if host not in (None, "localhost", "127.0.0.1", "::1"):
            with self._lock:
                self.outside.append(str(host))


def _final_text(call_span: Any) -> str | None:
    """The last LLM call's reply, or None when it was a tool call (the agent ran out of turns);
    "" when it was cut at the token limit (the SDK refuses an incomplete response: no answer)."""
    messages = json.loads(call_span.attributes["gen_ai.output.messages"])
    message = messages[0] if isinstance(messages, list) else messages
    if message.get("tool_calls"):
        return None
    cut = call_span.attributes[semconv.RESPONSE.format(i=0, key="finish_reason")] == "length"
    return "" if cut else message.get("content") or ""


async def test_rag_agent_runs_through_the_gateway_offline(smollm2_server, monkeypatch):
    """Greedy SmolLM2 on a one-hop and a multi-hop question: the worked examples and the
    agent's first search reach the model in the line format, its searches (if any) come back to
    the SDK as tool calls, the reply is scored; every LLM call is a transition of agent 'rag'
    with exact token ids, and nothing reaches past this machine. The one-hop question is
    answered right (the base model's sentences scored 0 before the first search, field
    documents and the nearest example last)."""
    from lightning_rl.agents.rag import agent

    guard = _OnlyLoopback()
    guard.install(monkeypatch)
    url = smollm2_server.url
    tasks = [
        {"id": "a", "question": "What is the capital of Japan?", "answer": "Tokyo", "hops": 1},
        load_tasks("test", 1, "multi_hop")[0],
    ]
    async with HttpStoreClient(url) as store:
        queued = await store.enqueue_rollouts(
            [
                RolloutRequest(input=t, task_id=t["id"], metadata={"sampling": {"temperature": 0}})
                for t in tasks
            ]
        )
        ids = [r.rollout_id for r in queued]
        # One rollout at a time: two generations in parallel crowd a 2-core CPU (2-3x slower).
        config = RunnerConfig(concurrency=1, default_model=DEFAULT_MODEL)
        runner = Runner(agent, store, url, config)
        done = await runner.run_until_done(ids, timeout=180)
        assert [r.status for r in done] == [RolloutStatus.succeeded] * 2
        spans = await store.query_spans(ids, "latest")
    assert guard.outside == []
    for rollout, task in zip(done, tasks, strict=True):
        mine = [s for s in spans if s.rollout_id == rollout.rollout_id]
        tools = [s for s in mine if s.name == semconv.TOOL_SPAN]
        calls = sorted(
            (s for s in mine if semconv.PROMPT_TOKEN_IDS in s.attributes),
            key=lambda s: s.start_time,
        )
        assert 1 <= len(calls) <= MAX_TURNS
        assert len(tools) == len(calls) - (_final_text(calls[-1]) is not None)
        transitions = spans_to_transitions(mine, rollout, AdapterConfig())
        assert [t.agent_name for t in transitions] == ["rag"] * len(calls)
        final = _final_text(calls[-1])
        expected = 0.0 if final is None else answer_reward(final, task["answer"])
        assert rollout.episode_return == pytest.approx(expected)
    assert done[0].episode_return == pytest.approx(1.0)  # "ANSWER: Tokyo"


async def test_rag_agent_runs_on_the_tiny_model():
    """The tiny random model through the gateway: whatever it writes, the rollout succeeds,
    each LLM call is a transition of agent 'rag', and the reward is what the reward function
    gives the last reply (a random model never searches, so nothing else is asked of it)."""
    from lightning_rl.agents.rag import agent

    task = load_tasks("test", 1, "multi_hop")[0]
    with gateway_server(model="tiny") as server:
        async with HttpStoreClient(server.url) as client:
            [queued] = await client.enqueue_rollouts(
                [RolloutRequest(input=task, metadata={"sampling": {"temperature": 0}})]
            )
            config = RunnerConfig(default_model=server.model)
            runner = Runner(agent, client, server.url, config)
            [done] = await runner.run_until_done([queued.rollout_id], timeout=120)
            spans = await client.query_spans([queued.rollout_id], "latest")
    assert done.status is RolloutStatus.succeeded
    calls = sorted(
        (s for s in spans if semconv.PROMPT_TOKEN_IDS in s.attributes), key=lambda s: s.start_time
    )
    transitions = spans_to_transitions(spans, done, AdapterConfig())
    assert calls and [t.agent_name for t in transitions] == ["rag"] * len(calls)
    final = _final_text(calls[-1])
    expected = 0.0 if final is None else answer_reward(final, task["answer"])
    assert done.episode_return == pytest.approx(expected)
