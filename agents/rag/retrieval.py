"""BM25 search over the country corpus: the rag agent's one tool.

Tokens are lowercase words with accents folded ("Bogotá" matches "bogota"), minus a few function
words that questions are full of and that would otherwise pull in documents by chance. The index
is built once per process. Results are the best documents' text, each cut to a bounded length:
the model reading them is small and runs on CPU, and every character is prompt it must read.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from rank_bm25 import BM25Okapi

from lightning_rl.agents.rag.corpus import documents

DEFAULT_K = 3
# Long enough for all but the longest neighbour lists (median document: about 190 characters).
MAX_DOC_CHARS = 320

_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    re.findall(
        r"\w+",
        "a an and are as at by do does for from has have in is it its of on or than that the "
        "their this to was what when where which who whose with",
    )
)


def tokenize(text: str) -> list[str]:
    folded = unicodedata.normalize("NFKD", text.lower()).encode("ascii", "ignore").decode()
    return [w for w in _WORD.findall(folded) if w not in _STOPWORDS]


@functools.cache
def _index() -> BM25Okapi:
    # The title once more: a country's name must count for more in its own document than in its
    # neighbours' ("It borders France"), which are often shorter.
    return BM25Okapi([tokenize(f"{d.title} {d.text}") for d in documents()])


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: text.rfind(" ", 0, limit - 3)].rstrip(",") + "..."


def ranked(query: str, k: int = DEFAULT_K) -> list[int]:
    """Indices into `documents()` of the best `k` matches; documents sharing no word are left
    out, so a query about nothing in the corpus finds nothing."""
    tokens = tokenize(query)
    if not tokens or k < 1:
        return []
    scores = _index().get_scores(tokens)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [i for i in order[:k] if scores[i] > 0]


def search(query: str, k: int = DEFAULT_K, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """The text of the best `k` documents for `query`, each at most `max_chars` long."""
    return [text for _, text in search_titled(query, k, max_chars)]


def search_titled(
    query: str, k: int = DEFAULT_K, max_chars: int = MAX_DOC_CHARS
) -> list[tuple[str, str]]:
    """(title, text) of the best `k` documents for `query`, as `search` gives their text."""
    docs = documents()
    return [(docs[i].title, _clip(docs[i].text, max_chars)) for i in ranked(query, k)]
