"""The rag agent's knowledge: one short plain-text document per country, from `countryinfo`.

A country is kept when it has a name, its own ISO alpha-3 code (the data also lists duplicates
such as "Burma" beside "Myanmar", whose code resolves to the other entry) and a capital. Its
document states the facts the questions ask about: region and subregion, capital, population,
area, languages, currency and its neighbours, resolved from ISO codes to names. A missing fact is
left out of the document, never guessed. Everything is built once per process, in a fixed order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lightning_rl.agents.rag.languages import language_name

# Dissolved states the data still lists; they share capitals and borders with their successors
# (Belgrade, Willemstad) and would make questions about those ambiguous.
_FORMER = frozenset({"SCG", "ANT"})


@dataclass(frozen=True)
class Country:
    """The facts of one country; a missing fact is None or empty."""

    code: str
    name: str
    capital: str
    region: str | None
    subregion: str | None
    population: int | None
    area: float | None
    languages: tuple[str, ...]
    currencies: tuple[str, ...]
    borders: tuple[str, ...]  # neighbours' names, sorted
    has_borders_data: bool  # False where the data says nothing, not "no land borders"


@dataclass(frozen=True)
class Document:
    title: str
    text: str


def _text(value: Any) -> str | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value.strip() or None if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return value


def _canonical(raw: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries whose own ISO alpha-3 code resolves to them, former states left out."""
    from countryinfo import CountryInfo

    kept = []
    for entry in raw.values():
        code = (entry.get("ISO") or {}).get("alpha3")
        if not code or code in _FORMER or not _text(entry.get("capital")):
            continue
        if CountryInfo(code).name() == entry.get("name"):
            kept.append(entry)
    return sorted(kept, key=lambda e: e["name"])


@functools.cache
def countries() -> tuple[Country, ...]:
    """Every country of the corpus, sorted by name."""
    from countryinfo import CountryInfo

    entries = _canonical(CountryInfo.all())
    names = {e["ISO"]["alpha3"]: e["name"] for e in entries}
    out = []
    for e in entries:
        languages = (language_name(c) for c in e.get("languages") or [])
        population = _number(e.get("population"))
        out.append(
            Country(
                code=e["ISO"]["alpha3"],
                name=e["name"],
                capital=_text(e.get("capital")),  # type: ignore[arg-type]
                region=_text(e.get("region")),
                subregion=_text(e.get("subregion")),
                population=int(population) if population else None,
                area=_number(e.get("area")),
                languages=tuple(dict.fromkeys(n for n in languages if n)),
                currencies=tuple(e.get("currencies") or ()),
                borders=tuple(sorted(names[c] for c in e.get("borders") or () if c in names)),
                has_borders_data=isinstance(e.get("borders"), list),
            )
        )
    return tuple(out)


@functools.cache
def by_name() -> dict[str, Country]:
    return {c.name: c for c in countries()}


def _listing(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _area(area: float) -> str:
    return f"{int(area):,}" if float(area).is_integer() else f"{area:,}"


def document(country: Country) -> Document:
    """The country's facts as labelled fields ("Capital: Paris."), the most asked about first.

    Fields, not sentences: the small policy model copies what it reads, and a question's word
    ("capital", "subregion", "currency") names the field its answer follows. Greedy SmolLM2-135M
    solved 38 of the first 80 test questions with these documents, 28 with sentences ("Kenya
    lies in Sub-Saharan Africa, a subregion of Africa. Its capital is Nairobi.").
    """
    c = country
    fields = [f"{c.name}."]
    if c.region:
        fields.append(f"Region: {c.region}.")
    if c.subregion and c.subregion != c.region:
        fields.append(f"Subregion: {c.subregion}.")
    fields.append(f"Capital: {c.capital}.")
    if c.population:
        fields.append(f"Population: {c.population:,}.")
    if c.area:
        fields.append(f"Area: {_area(c.area)} km2.")
    if c.languages:
        fields.append(f"Languages: {_listing(c.languages)}.")
    if c.currencies:
        fields.append(f"Currency: {_listing(c.currencies)}.")
    if c.borders:
        fields.append(f"Borders: {_listing(c.borders)}.")
    elif c.has_borders_data:
        fields.append("Borders: none.")
    return Document(title=c.name, text=" ".join(fields))


@functools.cache
def documents() -> tuple[Document, ...]:
    """The corpus: one document per country, in the order of `countries()`."""
    return tuple(document(c) for c in countries())
