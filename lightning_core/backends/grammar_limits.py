"""How big a structured-output grammar may be, checked before a request is admitted.

A grammar is the one part of a request whose cost is not bounded by its token counts: llguidance
compiles it, keeps one Earley row per position, and gives up on a row of more than 2,000 items
("Current row has 2101 items; max is 2000"). A constraint over these limits is refused with a
400 that names the limit, before it is compiled or reaches the engine; what stays within them
and still fails inside llguidance fails its own request only (the engine isolates it).

Measured with llguidance 1.9.1 on SmolLM2's tokenizer (2 CPU cores), compile to first mask:
- JSON `enum` values are one lexeme, cheap: 3,000 values 13 ms, 10,000 43 ms, 60,000 0.37 s.
- `anyOf` branches and Lark rule alternatives are Earley items: 1,900 anyOf branches compile in
  0.29 s, 5,000 in 0.9 s; a Lark rule of 2,100 alternatives compiles (26 ms) and then fails on
  its first token, one of 30,000 takes 1.7 s to compile.
- Nesting: llguidance refuses Lark groups nested ~36 deep itself; a JSON schema nested 100
  objects deep hits its recursion limit, and 1,000 deep a Python RecursionError (a 500).
"""

from __future__ import annotations

from typing import Any

import orjson

from lightning_core.backends.base import Constraint
from lightning_core.errors import InvalidInput

# A schema or grammar as sent; a 10,000-value enum of short strings is ~130 KB.
MAX_GRAMMAR_BYTES = 256 * 1024
# Parser-level choices (Lark `|`, JSON anyOf/oneOf branches, type lists): half of llguidance's
# 2,000 items per row, so that one position cannot reach it through the listed choices.
MAX_ALTERNATIVES = 1000
# Lexer-level choices (JSON enum values, `|` inside regexes): cheap, but compile time grows
# with them (60k values: 0.37 s); 10,000 keeps a compile under ~50 ms.
MAX_ENUM_VALUES = 10_000
# JSON containers (objects and lists) inside the schema, Lark groups inside a rule. A pydantic
# model nested five deep is ~15 levels of JSON schema.
MAX_NESTING = 64
MAX_LARK_NESTING = 32


def check_constraint(constraint: Constraint | None) -> None:
    """InvalidInput (400) naming the limit when `constraint` is over one of the limits above.
    Linear in the constraint's size: call it off the event loop for a request-sized one."""
    if constraint is None or constraint.kind == "json_object":
        return
    if constraint.kind == "grammar":
        text = constraint.grammar or ""
        where = "the structured_outputs grammar"
        _check_bytes(len(text.encode()), where)
        _check_lark(text, where)
    elif isinstance(constraint.json_schema, dict):
        where = "the JSON schema"
        try:
            size = len(orjson.dumps(constraint.json_schema))
        except orjson.JSONEncodeError:  # nested deeper than orjson writes (255)
            size = 0
        _check_bytes(size, where)
        _check_json(constraint.json_schema, where)


def _too_big(where: str, what: str, found: int, limit: int, name: str, fix: str) -> InvalidInput:
    return InvalidInput(f"{where} has {found} {what}, over the limit of {limit} ({name}): {fix}")


def _check_bytes(size: int, where: str) -> None:
    if size > MAX_GRAMMAR_BYTES:
        raise _too_big(
            where, "bytes", size, MAX_GRAMMAR_BYTES, "MAX_GRAMMAR_BYTES", "send a smaller one"
        )


def _check_counts(
    where: str, alternatives: int, values: int, depth: int, nesting: tuple[int, str]
) -> None:
    if alternatives > MAX_ALTERNATIVES:
        raise _too_big(
            where,
            "alternatives",
            alternatives,
            MAX_ALTERNATIVES,
            "MAX_ALTERNATIVES",
            "a long list of literal choices belongs in one JSON enum or one regex terminal",
        )
    if values > MAX_ENUM_VALUES:
        raise _too_big(
            where,
            "enum values or regex alternatives",
            values,
            MAX_ENUM_VALUES,
            "MAX_ENUM_VALUES",
            "narrow the choices (a free string with a pattern, or several calls)",
        )
    if depth > nesting[0]:
        raise _too_big(where, "levels of nesting", depth, *nesting, "flatten it")


def _check_lark(text: str, where: str) -> None:
    """Count `|` and group depth outside string literals; `|` inside /regexes/ is lexer-level."""
    alternatives = values = depth = deepest = 0
    i, size = 0, len(text)
    while i < size:
        c = text[i]
        if c == '"':
            i = _skip_quoted(text, i, '"')
        elif c == "/" and text.startswith("//", i):  # a comment, to the end of the line
            end = text.find("\n", i)
            i = size if end < 0 else end
        elif c == "/":
            end = _skip_quoted(text, i, "/")
            values += text.count("|", i, end)
            i = end
        else:
            if c == "|":
                alternatives += 1
            elif c in "([":
                depth += 1
                deepest = max(deepest, depth)
            elif c in ")]":
                depth -= 1
            i += 1
    _check_counts(where, alternatives, values, deepest, (MAX_LARK_NESTING, "MAX_LARK_NESTING"))


def _skip_quoted(text: str, start: int, quote: str) -> int:
    """Index just past the literal opened at `start` (backslash escapes; unclosed: the end)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == quote:
            return i + 1
        else:
            i += 1
    return len(text)


def _check_json(schema: dict[str, Any], where: str) -> None:
    """Walk the schema without recursion (a deep one must get a 400, not a RecursionError)."""
    alternatives = values = deepest = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            deepest = depth
            break
        deepest = max(deepest, depth)
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in ("anyOf", "oneOf", "type") and isinstance(value, list):
                alternatives += len(value)
            elif key == "enum" and isinstance(value, list):
                values += len(value)
            elif key == "pattern" and isinstance(value, str):
                values += value.count("|")
            elif key == "patternProperties" and isinstance(value, dict):
                values += sum(name.count("|") for name in value)
            if isinstance(value, dict | list):
                stack.append((value, depth + 1))
    _check_counts(where, alternatives, values, deepest, (MAX_NESTING, "MAX_NESTING"))
