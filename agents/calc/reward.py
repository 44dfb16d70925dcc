"""The calc agent's reward: 1 for a correct final answer, else 0.

The answer is the number after the last `ANSWER:` in the agent's final message. Without that
marker there is no answer: the reward teaches the format too, and a number that merely appears
in a rambling reply is not an answer.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"ANSWER\s*:\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)", re.IGNORECASE)

# Relative tolerance: answers like 2.333333 for 7/3 count as right.
TOLERANCE = 1e-4


def extract_answer(text: str | None) -> float | None:
    """The number after the last ANSWER: marker, or None."""
    matches = _ANSWER.findall(text or "")
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def is_correct(answer: float | None, gold: float) -> bool:
    if answer is None:
        return False
    return abs(answer - gold) <= TOLERANCE * max(1.0, abs(gold))


def answer_reward(text: str | None, gold: float) -> float:
    return 1.0 if is_correct(extract_answer(text), gold) else 0.0
