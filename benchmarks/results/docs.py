"""The documents' figures, generated from benchmarks/results.json.

Two kinds of generated text, both rewritten by `python -m benchmarks.results --update-docs` and
compared by tests/test_benchmark_results.py, so that a figure is written by hand nowhere:

- the table of current figures, between `<!-- results:start -->` and `<!-- results:end -->`
  (BENCHMARKS.md);
- a figure quoted in a sentence, `<!-- figure KEY SPEC -->94.5<!-- /figure -->` (README.md and
  docs/*.md), where KEY is the figure's key and SPEC, optional, a format spec for a number
  (`+.1f` writes a gain as `+48.0`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from benchmarks.results.figures import ROOT, Figure, Results, ResultsError, Value
from lightning_core.data.files import write_text_atomically

START, END = "<!-- results:start -->", "<!-- results:end -->"
HISTORY = "docs/benchmarks-history.md"
# `\[[^\]]*\]` lets a key's variant hold spaces (`ratio_vs_agentlightning[prefill 1000000]`).
QUOTE = re.compile(
    r"<!-- figure (?P<key>\w+(?:\[[^\]]*\])?)(?: (?P<spec>\S+))? -->"
    r"(?P<text>.*?)<!-- /figure -->"
)
COLUMNS = ("figure", "value", "what it is", "command", "commit", "machine", "date")


def documents(root: Path = ROOT) -> list[Path]:
    """The files that may hold generated figures."""
    return [root / "BENCHMARKS.md", root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def table(results: Results) -> str:
    """The current figures as one markdown table, each figure linked to the run behind it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for f in results.figures:
        name = f"`{f.key}`"
        if f.section:
            name = f"[{name}]({HISTORY}#{f.section})"
        what = "; ".join(part for part in (f.means, f.note) if part) or "not described yet"
        cells = (
            name,
            show(f.value),
            what,
            f"`{f.command}`",
            f.commit or "not recorded",
            f.machine,
            f.date,
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def show(value: Value, spec: str | None = None) -> str:
    """A value as the documents write it: a number in `spec` if given, else as printed."""
    if spec and not isinstance(value, str):
        return format(value, spec)
    return str(value)


def update(text: str, results: Results, where: str = "the text") -> str:
    """`text` with its table and quoted figures generated from `results`."""
    head, found, rest = text.partition(START)
    if found:
        _, found_end, tail = rest.partition(END)
        if not found_end:
            raise ResultsError(f"{where}: {START} without {END}")
        text = f"{head}{START}\n\n{table(results)}\n\n{END}{tail}"

    def quote(match: re.Match[str]) -> str:
        figure: Figure = results.get(match["key"])
        spec = match["spec"]
        return f"<!-- figure {match['key']}{' ' + spec if spec else ''} -->" + (
            f"{show(figure.value, spec)}<!-- /figure -->"
        )

    try:
        return QUOTE.sub(quote, text)
    except ResultsError as e:
        raise ResultsError(f"{where}: {e}") from e


def _regenerated(results: Results, root: Path) -> Iterator[tuple[Path, str]]:
    """Each document whose generated figures differ from `results`, with its new text."""
    for path in documents(root):
        text = path.read_text()
        new = update(text, results, str(path.relative_to(root)))
        if new != text:
            yield path, new


def stale(results: Results, root: Path = ROOT) -> list[Path]:
    """The documents whose generated figures differ from `results`."""
    return [path for path, _ in _regenerated(results, root)]


def update_docs(results: Results, root: Path = ROOT) -> list[Path]:
    """Regenerate every document's figures, each file replaced whole; the files that changed."""
    changed = []
    for path, new in _regenerated(results, root):
        write_text_atomically(path, new)
        changed.append(path)
    return changed
