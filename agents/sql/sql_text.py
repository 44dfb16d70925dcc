"""SQL as text: finding the query in a model's reply, and telling a single read-only query
from anything else.

Small models wrap SQL in code fences, put a sentence before it, or stop without a semicolon;
`extract_sql` finds the query in all of these.
`read_only_statement` is the tool's first line of defence (the database is opened read-only
and an authorizer refuses writes too): one statement, starting with SELECT or WITH.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

_FENCE = re.compile(r"```(?:sql|sqlite)?[ \t]*\n?(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
# A query starts at a SELECT or WITH keyword: the first one in the text is taken.
_START = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)
# Where a query ends when nothing else says so: a blank line, or a line that starts with one
# of the prompts' labels (small models go on to write the "Result:" they expect next).
_QUERY_END = re.compile(
    r"\n[ \t]*\n|\n[ \t]*(?:Result|Feedback|Question|Query|Tables|Corrected SQL)[ \t]*:",
    re.IGNORECASE,
)
_READ = re.compile(r"\s*\(*\s*(SELECT|WITH)\b", re.IGNORECASE)


class NotAQuery(ValueError):
    """The text is not one read-only SQL query; the message says what is wrong."""


def strip_comments(sql: str) -> str:
    """The SQL with `-- ...` and `/* ... */` comments blanked, string literals untouched."""
    out, i, n = [], 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in "'\"`[":
            close = "]" if ch == "[" else ch
            j = i + 1
            while j < n:
                if sql[j] == close:
                    # A doubled quote inside a literal is an escaped quote, not its end.
                    if close != "]" and j + 1 < n and sql[j + 1] == close:
                        j += 2
                        continue
                    break
                j += 1
            out.append(sql[i : j + 1])
            i = j + 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j
            out.append(" ")
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _semicolons(sql: str) -> Iterator[int]:
    """Positions of the `;` in `sql` that end a statement: outside literals and comments."""
    quote = None
    i = 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
        elif ch == "[":
            quote = "]"
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end
            continue
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = len(sql) if end < 0 else end + 2
            continue
        elif ch == ";":
            yield i
        i += 1


def statements(sql: str) -> list[str]:
    """The non-empty statements of a SQL text (split at semicolons outside literals)."""
    text = strip_comments(sql)
    bounds = [-1, *_semicolons(text), len(text)]
    parts = (text[start + 1 : end] for start, end in itertools.pairwise(bounds))
    return [p.strip() for p in parts if p.strip()]


def read_only_statement(sql: str) -> str:
    """The single SELECT/WITH statement in `sql` (comments removed); NotAQuery otherwise."""
    found = statements(sql or "")
    if not found:
        raise NotAQuery("the query is empty")
    if len(found) > 1:
        raise NotAQuery("only one statement is allowed; remove everything after the first ';'")
    if not _READ.match(found[0]):
        word = found[0].split(None, 1)[0].upper()
        raise NotAQuery(f"only SELECT queries are allowed, not {word}")
    return found[0]


def extract_sql(text: str | None) -> str:
    """The SQL query in a model's reply, or "" when there is none.

    A fenced block is preferred; otherwise the text from the first SELECT/WITH keyword up to
    a blank line or a prompt label ("Result:"), so an explanation in a paragraph of its own,
    or a made-up result, is not part of it. The query is the first statement: a small model
    goes on after its query's `;` with more statements (a fifth of the failed queries of a
    first training run), and only what it wrote first is its answer. What follows is dropped,
    never run (`; DROP TABLE ...` included); the tool still checks that the first is a read.
    """
    text = text or ""
    for block in _FENCE.findall(text):
        if _START.search(block):
            text = block
            break
    match = _START.search(text)
    if match is None:
        return ""
    query = _QUERY_END.split(text[match.start() :], maxsplit=1)[0].strip()
    return _first_statement(query)


def _first_statement(sql: str) -> str:
    """`sql` up to and including its first `;` outside literals and comments (all of it when
    there is none)."""
    end = next(_semicolons(sql), None)
    return sql if end is None else sql[: end + 1]
