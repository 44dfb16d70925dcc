"""Questions for the rag agent, generated from the country data, with disjoint splits.

Each kind of question chains a number of facts (`hops`), each found in the corpus:
- 1 hop: the capital of X; the subregion X lies in; the country whose capital is Y.
- 2 hops: the language or currency of the country whose capital is Y (capital -> country ->
  fact); the capital of X's only neighbour; X's most populous neighbour; which of X and one of
  its neighbours has the larger population.
- 3 hops: the capital of X's most populous neighbour; the region of X's largest neighbour.

A question is only made where its answer is unambiguous: capitals named in a question belong to
one country, superlatives have no tie, every neighbour compared has the fact, and languages and
currencies are asked about only where a country has exactly one. A question that contains its own
answer (the capital of Singapore) is skipped.

Splits go by the country a question is about: a fifth of the countries, drawn with a fixed seed,
are test countries, so the test split asks about countries train never asks about, and no test
question's text appears in train. The countries of the agent's worked examples are in neither.
A task is a dict `{"id", "question", "answer", "hops", "kind", "tier"}`; the tier names the hop
count ("1-hop", "2-hop", "3-hop"), the generic key by which training draws tasks and reports
results per difficulty. A train task whose answer needs documents the agent's first search does
not bring also names them, `"via"` (the countries compared, or the neighbours among which the
answer is): its reward gives partial credit for reading them (agent.py). Test tasks carry no
`via`: they are scored on the answer alone, as they always were.

A third split, `kinds`, holds question kinds neither train nor test ever asks (KIND_TEMPLATES:
a country's own language, currency or region; a capital's subregion; a comparison of areas;
the language of the most populous neighbour; the capital of the largest neighbour), about the
test split's countries: how far training carries over to questions of a new shape.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from lightning_rl.agents.rag.corpus import Country, by_name, countries
from lightning_rl.agents.rag.reward import normalize_answer

Split = Literal["train", "test", "kinds"]
# What each source draws: questions of these hop counts.
_HOPS = {"all": (1, 2, 3), "single_hop": (1,), "multi_hop": (2, 3)}
SOURCES: tuple[str, ...] = tuple(_HOPS)

# The agent's worked examples (agent._examples) ask about these: tasks about them would reward
# copying.
EXAMPLE_COUNTRIES = ("Poland", "Portugal")
# The worked examples of the questions about a country's largest neighbour ask about this train
# country (two neighbours, neither a frequent answer). Left out of train only: the test split
# and its benchmark stay as they were.
NEIGHBOUR_EXAMPLE_COUNTRIES = ("Liechtenstein",)
TEST_FRACTION = 0.2
SPLIT_SEED = 20240601
_ORDER_SEEDS = {"train": 11, "test": 23, "kinds": 37}


@dataclass(frozen=True)
class Question:
    kind: str
    subject: Country  # the country the question is about: splits go by it
    text: str
    answer: str
    hops: int
    # Countries whose documents the answer needs beyond the first search's (training credit).
    via: tuple[str, ...] = ()


def _unique_capitals() -> dict[str, Country]:
    counts = Counter(c.capital for c in countries())
    return {c.capital: c for c in countries() if counts[c.capital] == 1}


def _contains(text: str, answer: str) -> bool:
    return normalize_answer(answer) in normalize_answer(text)


def _neighbours(c: Country) -> list[Country]:
    return [by_name()[n] for n in c.borders]


def _top(items: list[Country], key: Callable[[Country], float | None]) -> Country | None:
    """The item with the largest key; None when any key is missing or the top is tied."""
    values = [key(c) for c in items]
    if len(items) < 2 or any(v is None for v in values):
        return None
    ranked = sorted(zip(values, items, strict=True), key=lambda p: -p[0])  # type: ignore[operator]
    return ranked[0][1] if ranked[0][0] != ranked[1][0] else None


def _by_capital(c: Country, capitals: dict[str, Country]) -> Iterator[Question]:
    if capitals.get(c.capital) is not c or _contains(c.capital, c.name):
        return
    y = c.capital
    yield Question("country_by_capital", c, f"Which country has {y} as its capital?", c.name, 1)
    if len(c.languages) == 1:
        text = f"Which language is spoken in the country whose capital is {y}?"
        yield Question("language_by_capital", c, text, c.languages[0], 2)
    if len(c.currencies) == 1:
        text = f"Which currency is used in the country whose capital is {y}?"
        yield Question("currency_by_capital", c, text, c.currencies[0], 2)


def _larger(
    c: Country,
    rng: random.Random,
    key: Callable[[Country], float | None],
    kind: str,
    template: str,
) -> Iterator[Question]:
    """Which of `c` and a neighbour drawn by `rng` has the larger `key`, both named in the
    order `rng` shuffles them into; none where either lacks the fact or they tie."""
    neighbours = _neighbours(c)
    if not neighbours or not key(c):
        return
    other = rng.choice(neighbours)
    if not key(other) or key(other) == key(c):
        return
    pair = [c.name, other.name]
    rng.shuffle(pair)
    larger = c.name if key(c) > key(other) else other.name  # type: ignore[operator]
    yield Question(kind, c, template.format(*pair), larger, 2, (c.name, other.name))


def _about_neighbours(c: Country, rng: random.Random) -> Iterator[Question]:
    x, neighbours = c.name, _neighbours(c)
    if len(neighbours) == 1 and not _contains(neighbours[0].capital, neighbours[0].name):
        text = f"{x} borders exactly one country. What is the capital of that country?"
        via = (neighbours[0].name,)
        yield Question("sole_neighbour_capital", c, text, neighbours[0].capital, 2, via)
    every = tuple(n.name for n in neighbours)
    populous = _top(neighbours, lambda n: n.population)
    if populous is not None:
        text = f"Which country bordering {x} has the largest population?"
        yield Question("populous_neighbour", c, text, populous.name, 2, every)
        text = f"What is the capital of the most populous country bordering {x}?"
        yield Question("populous_neighbour_capital", c, text, populous.capital, 3, every)
    largest = _top(neighbours, lambda n: n.area)
    if largest is not None and largest.region:
        text = f"In which region is the largest country by area that borders {x}?"
        yield Question("largest_neighbour_region", c, text, largest.region, 3, every)
    yield from _larger(
        c, rng, lambda n: n.population, "larger_population",
        "Which has the larger population, {} or {}?",
    )  # fmt: skip


def _kinds(c: Country, capitals: dict[str, Country]) -> Iterator[Question]:
    """The held-out kinds' questions about `c`: shapes neither train nor test asks."""
    x, neighbours = c.name, _neighbours(c)
    if c.region and c.region != c.subregion:
        yield Question("region", c, f"Which region of the world is {x} part of?", c.region, 1)
    if len(c.languages) == 1 and not _contains(x, c.languages[0]):
        text = f"What language do people speak in {x}?"
        yield Question("language", c, text, c.languages[0], 1)
    if len(c.currencies) == 1:
        yield Question("currency", c, f"What is the currency of {x}?", c.currencies[0], 1)
    y = c.capital
    if capitals.get(y) is c and c.subregion and not _contains(y, x):
        text = f"{y} is the capital of a country. In which subregion does that country lie?"
        yield Question("subregion_by_capital", c, text, c.subregion, 2)
    yield from _larger(
        c, random.Random(f"{SPLIT_SEED}-area-{c.code}"), lambda n: n.area, "larger_area",
        "Which country covers the larger area: {} or {}?",
    )  # fmt: skip
    every = tuple(n.name for n in neighbours)
    populous = _top(neighbours, lambda n: n.population)
    if populous is not None and len(populous.languages) == 1:
        text = f"What language is spoken in the most populous neighbouring country of {x}?"
        yield Question("populous_neighbour_language", c, text, populous.languages[0], 3, every)
    largest = _top(neighbours, lambda n: n.area)
    if largest is not None and not _contains(largest.capital, largest.name):
        text = f"Of the countries that border {x}, take the largest by area: what is its capital?"
        yield Question("largest_neighbour_capital", c, text, largest.capital, 3, every)


def _questions(c: Country, capitals: dict[str, Country]) -> Iterator[Question]:
    if not _contains(c.name, c.capital):
        yield Question("capital", c, f"What is the capital of {c.name}?", c.capital, 1)
    if c.subregion and c.region and c.subregion != c.region:
        text = f"In which subregion of the world does {c.name} lie?"
        yield Question("subregion", c, text, c.subregion, 1)
    yield from _by_capital(c, capitals)
    # One generator per country, seeded by its code: a country's questions never depend on
    # which other countries the data holds.
    yield from _about_neighbours(c, random.Random(f"{SPLIT_SEED}-{c.code}"))


@functools.cache
def countries_in_test() -> frozenset[str]:
    """Codes of the countries whose questions form the test split."""
    codes = sorted(c.code for c in countries() if c.name not in EXAMPLE_COUNTRIES)
    random.Random(SPLIT_SEED).shuffle(codes)
    return frozenset(codes[: round(len(codes) * TEST_FRACTION)])


@functools.cache
def questions(split: Split) -> tuple[Question, ...]:
    """Every question of a split, in a fixed shuffled order (kinds mixed)."""
    capitals = _unique_capitals()
    test = countries_in_test()
    # A pair of neighbours can be compared from either side: a text asked twice is asked once,
    # and a test text that train also asks is dropped from test.
    seen = {q.text for q in questions("train")} if split == "test" else set()
    make = _kinds if split == "kinds" else _questions
    chosen: list[Question] = []
    for c in countries():
        if c.name in EXAMPLE_COUNTRIES or (c.code in test) != (split != "train"):
            continue
        for q in make(c, capitals):
            if q.text not in seen:
                seen.add(q.text)
                chosen.append(q)
    random.Random(_ORDER_SEEDS[split]).shuffle(chosen)
    # Left out after the shuffle: the other train questions keep the order they had.
    return tuple(q for q in chosen if q.subject.name not in NEIGHBOUR_EXAMPLE_COUNTRIES)


def tier(hops: int) -> str:
    """The difficulty tier of a question of `hops` hops."""
    return f"{hops}-hop"


def _task(q: Question, split: Split) -> dict[str, Any]:
    task: dict[str, Any] = {
        "id": f"{q.kind}-{q.subject.code}",
        "question": q.text,
        "answer": q.answer,
        "hops": q.hops,
        "kind": q.kind,
        "tier": tier(q.hops),
    }
    if split == "train" and q.via:
        task["via"] = list(q.via)
    return task


def load_tasks(split: Split, size: int, source: str | None = None) -> list[dict[str, Any]]:
    """The first `size` tasks of `split` (all of them when it has fewer), the same every time.

    `split` is "train", "test" or "kinds" (the held-out kinds); `source` picks the questions:
    "all" (the default), "single_hop" or "multi_hop".
    """
    if split not in _ORDER_SEEDS:
        raise ValueError(f"split must be 'train', 'test' or 'kinds', not {split!r}")
    source = source or "all"
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    if size < 1:
        raise ValueError(f"size must be at least 1, not {size}")
    return [_task(q, split) for q in questions(split) if q.hops in _HOPS[source]][:size]
