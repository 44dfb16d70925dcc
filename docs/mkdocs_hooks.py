"""MkDocs hooks: BENCHMARKS.md, at the repository root, is the site's benchmarks page.

The file stays where the benchmark scripts and their readers expect it, and the site shows it
whole instead of a copy, so each figure is written once. It holds the table of current figures
(generated from benchmarks/results.json); the runs behind them are docs/benchmarks-history.md,
an ordinary page. Pages link to BENCHMARKS.md as `../BENCHMARKS.md`, which works on GitHub; here
those links are pointed at the page that includes it, so that strict mode checks them and their
anchors like any other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
PAGE = "benchmarks.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
# A link one folder above the page's own depth in docs/: from docs/x.md `../BENCHMARKS.md`,
# from docs/reference/x.md `../../BENCHMARKS.md`.
_BENCHMARKS_LINK = re.compile(r"\]\(\.\./((?:\.\./)*)BENCHMARKS\.md")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    markdown = _BENCHMARKS_LINK.sub(rf"](\1{PAGE}", markdown)
    if page.file.src_uri == PAGE:
        markdown = with_benchmarks(markdown)
    return markdown


def with_benchmarks(markdown: str) -> str:
    """The page with the text between its markers replaced by BENCHMARKS.md."""
    head, found, rest = markdown.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise ValueError(f"{PAGE} has no {START} ... {END} section")
    text = BENCHMARKS.read_text()
    # The page has its own title; BENCHMARKS.md's paths are written from the repository root.
    if text.startswith("# "):
        text = text.split("\n", 1)[1]
    text = text.replace("](docs/", "](")
    return f"{head}{text}{tail}"
