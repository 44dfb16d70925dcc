"""What each role of the SQL agent is told, and how the checker's verdict is read.

The policy is small (SmolLM2-135M): prompts stay short and end where the answer should begin.
The tables go in the system message, the same for every question on a database, so every call
on it shares one prompt prefix (the backend prefills it once). The writer also sees worked
examples (examples.py) as earlier turns: without them the base model answers in prose. The
three roles share one model and differ only in these messages.
"""

from __future__ import annotations

import re

from lightning_rl.agents.sql.examples import examples

WRITER_SYSTEM = "You write SQLite queries. Reply with one SQL query and nothing else."
CHECKER_SYSTEM = (
    "You check SQLite queries. If the query and its result answer the question, reply "
    "CORRECT. Otherwise reply WRONG: and the reason."
)
REWRITER_SYSTEM = "You fix SQLite queries. Reply with one corrected SQL query and nothing else."

# The first verdict word decides; "not correct" and "incorrect" are checked before "correct".
_VERDICT = re.compile(r"\b(NOT\s+CORRECT|INCORRECT|WRONG|CORRECT)\b", re.IGNORECASE)
MAX_FEEDBACK_CHARS = 300


def _system(role: str, schema: str) -> tuple[str, str]:
    return ("system", f"{role}\n\nTables:\n{schema}")


def writer_messages(schema: str, question: str, db: str | None = None) -> list[tuple[str, str]]:
    """The writer's messages; `db` picks the worked examples shown before the question."""
    shots: list[tuple[str, str]] = []
    for shown_question, query in examples(db) if db else ():
        shots += [("user", f"Question: {shown_question}"), ("assistant", query)]
    return [_system(WRITER_SYSTEM, schema), *shots, ("user", f"Question: {question}")]


def checker_messages(schema: str, question: str, sql: str, result: str) -> list[tuple[str, str]]:
    return [
        _system(CHECKER_SYSTEM, schema),
        (
            "user",
            f"Question: {question}\nQuery: {sql or '(none)'}\nResult:\n{result}\n\n"
            "Is the query correct?",
        ),
    ]


def rewriter_messages(
    schema: str, question: str, sql: str, result: str, feedback: str
) -> list[tuple[str, str]]:
    return [
        _system(REWRITER_SYSTEM, schema),
        (
            "user",
            f"Question: {question}\nQuery: {sql or '(none)'}\nResult:\n{result}\n"
            f"Feedback: {feedback}\n\nCorrected SQL:",
        ),
    ]


def read_verdict(text: str) -> tuple[bool, str]:
    """(correct, feedback) from the checker's reply; a reply without a verdict is no approval."""
    text = (text or "").strip()
    match = _VERDICT.search(text)
    if match and match.group(1).upper() == "CORRECT":
        return True, ""
    feedback = text[match.end() :] if match else text
    feedback = feedback.lstrip(" :.-\n").strip()[:MAX_FEEDBACK_CHARS]
    return False, feedback or "the query does not answer the question"
