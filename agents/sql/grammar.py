"""A Lark grammar of the read-only SQL the agent may write, with the database's own names.

Measured on the demo's greedy base answers (BENCHMARKS.md, "SQL failure analysis"): of 98
failed tool calls, 53 named a column and 28 a table that the database does not have. The
writer and rewriter therefore decode under this grammar (sent as vLLM's `structured_outputs`
grammar, which the gateway enforces token by token): every table is one of the database's,
every `table.column` names a column of that table, every bare column is a column of some
table, and the reply is one query ending in `;`, with nothing before or after it.

What the grammar cannot know is which tables a query's FROM names (the SELECT list comes
first), so a bare column of another table still fails at run time; so does a wrong join.
Aliases are Spider's `t1` ... `t9` (any column may follow them): free alias names would let
`album.name` through as an alias reference. Every gold query of the question set is accepted
once its one alias (`manager`) is written `t2` (tests/test_sql_grammar.py).

Lists are bounded (6 result columns, 4 joins, 4 conditions per AND or OR, ...), each above
what any gold query uses: greedy, the base model otherwise repeats `album.album_id, ` until it
runs out of tokens, and a bound makes the grammar close the query instead.

The subset: SELECT [DISTINCT] ... FROM t [AS tN] [[LEFT] JOIN ... ON ...]* [WHERE] [GROUP BY]
[HAVING] [ORDER BY ... [ASC|DESC]] [LIMIT n], expressions with AND/OR/NOT, comparisons,
arithmetic, IS [NOT] NULL, [NOT] IN (list or subquery), [NOT] LIKE, BETWEEN, aggregates and a
few scalar functions, string and number literals.
"""

from __future__ import annotations

import functools
import json

from lightning_rl.agents.sql.databases import tables

ALIASES = tuple(f"t{i}" for i in range(1, 10))
FUNCTIONS = (
    "COUNT",
    "SUM",
    "AVG",
    "MIN",
    "MAX",
    "strftime",
    "LOWER",
    "UPPER",
    "LENGTH",
    "ROUND",
    "ABS",
    "SUBSTR",
    "COALESCE",
    "IFNULL",
    "DATE",
)

_RULES = r"""
start: query ";"
query: "SELECT"i distinct? results "FROM"i source join{0,3} where? group? having? order? limit?
distinct: "DISTINCT"i
results: result ("," result){0,5}
result: "*" | expr
source: TABLE ("AS"i ALIAS)?
join: ("LEFT"i | "INNER"i)? "JOIN"i source "ON"i expr
where: "WHERE"i expr
group: "GROUP"i "BY"i expr ("," expr){0,2}
having: "HAVING"i expr
order: "ORDER"i "BY"i ordered ("," ordered){0,2}
ordered: expr ("ASC"i | "DESC"i)?
limit: "LIMIT"i NUMBER
expr: conj ("OR"i conj){0,3}
conj: neg ("AND"i neg){0,3}
neg: "NOT"i? test
test: sum (CMP sum | "IS"i "NOT"i? "NULL"i | "NOT"i? "IN"i "(" (query | list) ")"
    | "NOT"i? "LIKE"i sum | "BETWEEN"i sum "AND"i sum)?
list: expr ("," expr){0,9}
sum: product (("+" | "-" | "||") product)*
product: atom (("*" | "/" | "%") atom)*
atom: NUMBER | STRING | "NULL"i | column | call | "(" query ")" | "(" expr ")" | "-" atom
call: FUNCTION "(" ("*" | "DISTINCT"i? list) ")"
column: COLUMN | QUALIFIED | ALIAS "." COLUMN
CMP: "=" | "==" | "!=" | "<>" | "<" | "<=" | ">" | ">="
NUMBER: /[0-9]+(\.[0-9]+)?/
STRING: /'([^'\n]|'')*'/
%ignore /[ \t\n]+/
"""


def _alternatives(names: list[str] | tuple[str, ...]) -> str:
    # Longest first: the lexer then prefers `invoice_line` over `invoice`. JSON strings are
    # valid Lark string literals; the `i` makes them case-insensitive, as SQLite's names are.
    return " | ".join(f"{json.dumps(n)}i" for n in sorted(set(names), key=lambda n: (-len(n), n)))


@functools.cache
def sql_grammar(db: str) -> str:
    """The Lark grammar (llguidance's dialect, which vLLM's `grammar` takes) for database
    `db`; UnknownDatabase for a database the agent does not have."""
    schema = tables(db)
    columns = [c for cols in schema.values() for c in cols]
    qualified = [f"{t}.{c}" for t, cols in schema.items() for c in cols]
    return "\n".join(
        [
            _RULES.strip(),
            f"TABLE: {_alternatives(list(schema))}",
            f"COLUMN: {_alternatives(columns)}",
            f"QUALIFIED: {_alternatives(qualified)}",
            f"ALIAS: {_alternatives(ALIASES)}",
            f"FUNCTION: {_alternatives(FUNCTIONS)}",
        ]
    )
