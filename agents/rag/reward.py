"""The rag agent's reward, as in the paper's RAG task: format correctness plus answer F1.

    reward = FORMAT_WEIGHT * format_ok + F1_WEIGHT * F1(answer, gold)

The answer is the text after the last `ANSWER:` marker of the final message, up to the end of
that line. `format_ok` means the marker is there with a non-empty answer after it. Without it
there is no answer and the reward is 0: a name that merely appears in a rambling reply is not an
answer. F1 is SQuAD's word-level F1 after SQuAD's normalisation (lowercase, no punctuation, no
articles), with accents folded too, since small models often drop them ("Bogota").

Train tasks whose answer needs documents the first search does not bring name them (`via`),
and there a wrong answer that read them earns more than one that did not:

    reward = max(answer reward, FORMAT_WEIGHT + VIA_WEIGHT * share of `via` documents read)

An answer is still needed (no ANSWER line: 0), and the credit never reaches a right answer's
(0.1 + 0.3 < 0.9, the success threshold): it gives a group of four wrong answers a signal
towards the searches a second hop takes, which the base model almost never makes.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Collection

FORMAT_WEIGHT = 0.1
F1_WEIGHT = 0.9
VIA_WEIGHT = 0.3

_ANSWER = re.compile(r"ANSWER\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans(dict.fromkeys(string.punctuation, " "))


def normalize_answer(text: str) -> str:
    """Lowercase, accents folded, punctuation and articles removed, spaces collapsed."""
    text = unicodedata.normalize("NFKD", text.lower()).encode("ascii", "ignore").decode()
    text = _ARTICLES.sub(" ", text.translate(_PUNCTUATION))
    return " ".join(text.split())


def extract_answer(text: str | None) -> str | None:
    """The text after the last ANSWER: marker, or None when there is none or it is empty."""
    matches = _ANSWER.findall(text or "")
    if not matches:
        return None
    answer = matches[-1].strip().strip("*`\"'").strip()
    return answer or None


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD word-level F1 of two answers."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def answer_reward(text: str | None, gold: str) -> float:
    """The reward of a final message against the gold answer, in [0, 1]."""
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    return FORMAT_WEIGHT + F1_WEIGHT * f1_score(answer, gold)


def reading_reward(
    text: str | None, gold: str, via: Collection[str] | None, read: Collection[str]
) -> float:
    """The answer's reward, or on a task with `via` at least the credit for the share of
    those documents (titles) that were read, when there is an answer."""
    reward = answer_reward(text, gold)
    if not via or reward == 0.0:
        return reward
    share = len(set(via) & set(read)) / len(set(via))
    return max(reward, FORMAT_WEIGHT + VIA_WEIGHT * share)
