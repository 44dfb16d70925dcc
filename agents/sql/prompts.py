"""What each role of the SQL agent is told, and how the checker's verdict is read.

The policy is small (SmolLM2-135M): prompts stay short, show the schema as `table(col, ...)`
lines and end where the answer should begin. The three roles share one model and differ only
in these messages.
"""

from __future__ import annotations

import re

WRITER_SYSTEM = "You write SQLite queries. Reply with one SQL query and nothing else."
CHECKER_SYSTEM = (
    "You check SQLite queries. If the query and its result answer the question, reply "
    "CORRECT. Otherwise reply WRONG: and the reason."
)
REWRITER_SYSTEM = "You fix SQLite queries. Reply with one corrected SQL query and nothing else."

# The first verdict word decides; "not correct" and "incorrect" are checked before "correct".
_VERDICT = re.compile(r"\b(NOT\s+CORRECT|INCORRECT|WRONG|CORRECT)\b", re.IGNORECASE)
MAX_FEEDBACK_CHARS = 300


def writer_messages(schema: str, question: str) -> list[tuple[str, str]]:
    return [
        ("system", WRITER_SYSTEM),
        ("user", f"Tables:\n{schema}\n\nQuestion: {question}\nSQL:"),
    ]


def checker_messages(schema: str, question: str, sql: str, result: str) -> list[tuple[str, str]]:
    return [
        ("system", CHECKER_SYSTEM),
        (
            "user",
            f"Tables:\n{schema}\n\nQuestion: {question}\nQuery: {sql or '(none)'}\n"
            f"Result:\n{result}\n\nIs the query correct?",
        ),
    ]


def rewriter_messages(
    schema: str, question: str, sql: str, result: str, feedback: str
) -> list[tuple[str, str]]:
    return [
        ("system", REWRITER_SYSTEM),
        (
            "user",
            f"Tables:\n{schema}\n\nQuestion: {question}\nQuery: {sql or '(none)'}\n"
            f"Result:\n{result}\nFeedback: {feedback}\n\nCorrected SQL:",
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
