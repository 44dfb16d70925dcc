"""The SQL agent's grammar (agents/sql/grammar.py) on the model's real tokenizer: every gold
query is in its language, and names the database does not have are not."""

from __future__ import annotations

import re
from typing import Any

import pytest
from transformers import AutoTokenizer

from lightning_core.backends.base import Constraint
from lightning_core.backends.grammar import GrammarCompiler
from lightning_core.models import resolve_model
from lightning_core.types import LLMEndpoint
from lightning_rl.agents.sql.agent import chat_model
from lightning_rl.agents.sql.data import SPLITS, load_tasks
from lightning_rl.agents.sql.databases import DATABASES, UnknownDatabase
from lightning_rl.agents.sql.grammar import sql_grammar


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


def accepts(compiler: GrammarCompiler, tokenizer: Any, db: str, text: str) -> bool:
    """Whether `text` followed by EOS is a complete reply under the database's grammar."""
    matcher = compiler.matcher(Constraint(kind="grammar", grammar=sql_grammar(db)))
    try:
        for token in [*tokenizer.encode(text), tokenizer.eos_token_id]:
            matcher.accept(token)
    except RuntimeError:
        return False
    return matcher.is_terminated


def test_every_gold_query_is_in_the_grammar(compiler, tokenizer):
    tasks = [t for split in SPLITS for t in load_tasks(split, 10_000)]
    assert {t["db"] for t in tasks} == set(DATABASES)
    # The one free alias of the question set is written as one of Spider's t1..t9.
    refused = [
        t["gold_sql"]
        for t in tasks
        if not accepts(
            compiler, tokenizer, t["db"], re.sub(r"\bmanager\b", "t2", t["gold_sql"]) + ";"
        )
    ]
    assert refused == []


@pytest.mark.parametrize(
    ("db", "text"),
    [
        ("chinook", "SELECT title FROM tracks;"),  # no table `tracks`
        ("chinook", "SELECT album.name FROM album;"),  # album has no column `name`
        ("chinook", "SELECT album_title FROM album;"),  # no such column anywhere
        ("chinook", "SELECT name FROM artist"),  # a reply ends with `;`
        ("chinook", "SELECT name FROM artist; SELECT 1;"),  # one query
        ("chinook", "The number of employees is 1."),  # prose
        ("chinook", "```sql\nSELECT name FROM artist;\n```"),  # nothing around the query
        ("university", "SELECT name FROM artist;"),  # another database's table
        ("chinook", "SELECT name FROM artist WHERE name = 'AC/DC' ;;"),
        ("chinook", "SELECT " + ", ".join(["name"] * 7) + " FROM artist;"),  # a bounded list
    ],
)
def test_names_the_database_lacks_and_text_around_the_query_are_refused(
    compiler, tokenizer, db, text
):
    assert not accepts(compiler, tokenizer, db, text)


@pytest.mark.parametrize(
    ("db", "text"),
    [
        ("chinook", "select Name from ARTIST where name like 'A%' order by name desc limit 3;"),
        ("chinook", "SELECT COUNT(DISTINCT t1.genre_id) FROM track AS t1;"),
        (
            "university",
            "SELECT name FROM instructor WHERE salary BETWEEN 1 AND 2 OR salary IS NULL;",
        ),
        ("university", "SELECT title FROM course WHERE credits IN (2, 3) GROUP BY title;"),
    ],
)
def test_case_aliases_and_operators_are_in_the_grammar(compiler, tokenizer, db, text):
    assert accepts(compiler, tokenizer, db, text)


def test_an_unknown_database_has_no_grammar():
    with pytest.raises(UnknownDatabase):
        sql_grammar("nope")


def test_the_writer_and_rewriter_send_the_grammar_as_vllms_field():
    endpoint = LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="m", sampling={})
    grammar = sql_grammar("chinook")
    writer = chat_model(endpoint, "writer", max_tokens=9, grammar=grammar)
    assert writer.extra_body == {"structured_outputs": {"grammar": grammar}}
    assert chat_model(endpoint, "checker", max_tokens=9).extra_body is None
