"""The documentation: a short README, and a MkDocs site that builds cleanly and kept every section
of the long README it replaced."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 300

# The sections of the 1,342-line README that the site took over (issue 26): each is still a
# heading of some page, so moving text never silently dropped one.
MOVED_SECTIONS = [
    "Two commands",
    "PyTorch: CPU or CUDA",
    "Extras",
    "The LightningStore",
    "Lifecycle",
    "Durability",
    "HTTP API",
    "Sending spans with OpenTelemetry, from any language",
    "The gateway: train any agent without changing it",
    "Policy replicas",
    "Tracing an agent's own code",
    "From spans to transitions",
    "LightningRL: from episode returns to a LoRA update",
    "The training pipeline",
    "Remote runners on other machines",
    "The calc agent",
    "The SQL agent (LangGraph)",
    "The RAG agent (OpenAI Agents SDK)",
    "Results: the calc agent on a CPU",
    "Deployments, schedules and the UIs",
    "In the Prefect UI",
    "Retrain from production",
    "Reliability and security",
    "On a GPU",
    "GPU readiness check",
    "The GPU preset",
    "Glossary",
    "Benchmarks",
    "Layout",
    "Development",
]


def _mkdocs() -> list[str] | None:
    """The mkdocs command: this interpreter's module (`make setup-dev`), else one on PATH."""
    if importlib.util.find_spec("mkdocs") is not None:
        return [sys.executable, "-m", "mkdocs"]
    found = shutil.which("mkdocs")
    return [found] if found else None


def _headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of each ATX heading of a markdown text; a `#` line in a fenced block is
    code."""
    found, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)
            elif marker.group(1).startswith(fence):
                fence = None
            continue
        heading = re.match(r"(#{1,6})\s+(.+?)\s*#*\s*$", line)
        if fence is None and heading:
            found.append((len(heading.group(1)), heading.group(2)))
    return found


def _site_checks() -> ModuleType:
    # docs/ is no package: its offline check is loaded by path, as `make screenshots-site` runs it.
    sys.path.insert(0, str(DOCS))
    try:
        return importlib.import_module("screenshots_site")
    finally:
        sys.path.remove(str(DOCS))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module's tests (`mkdocs build --strict`)."""
    if _mkdocs() is None:
        pytest.skip("mkdocs is not installed: `make setup-dev` (the dev extra) installs it")
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    _site_checks().build_site(site_dir)  # raises with mkdocs' output on a warning
    return site_dir


def test_the_site_builds_in_strict_mode(site):
    # BENCHMARKS.md is included whole as the benchmarks page (docs/mkdocs_hooks.py): every
    # section of it is a section of the page. (No directory URLs: the offline plugin.)
    page = (site / "benchmarks.html").read_text()
    sections = [t for level, t in _headings((REPO / "BENCHMARKS.md").read_text()) if level == 2]
    assert sections and page.count("<h2") == len(sections)


def test_no_page_loads_a_script_a_stylesheet_or_a_font_from_the_network(site):
    remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    found = {}
    for page in site.rglob("*.html"):
        for tag in remote.findall(page.read_text()):
            if "<link" in tag and "stylesheet" not in tag and "preconnect" not in tag:
                continue  # a plain link to another site, not something the page loads
            found.setdefault(str(page.relative_to(site)), []).append(tag)
    assert not found, found


def test_the_site_reads_offline_in_chromium(site):
    """From its folder (file://) with every network request refused: the home page's diagram is
    drawn, search answers and the security page's lists are lists."""
    _require_browser()
    seen = _site_checks().read_offline(site)
    assert seen["refused"] == []
    assert seen["diagram_height_px"] > 40
    assert seen["search_results"] > 0
    assert seen["security_list_items"] >= 20 and seen["security_paragraphs_with_items"] == 0


def _require_browser() -> None:
    """Skip without Playwright or Chromium, unless on CI, whose setup has both."""
    missing = None
    if importlib.util.find_spec("playwright") is None:
        missing = "playwright is not installed (pip install -e '.[dev]')"
    elif not Path("/usr/bin/chromium").exists():
        missing = "/usr/bin/chromium is missing (apt-get install -y chromium)"
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must have a browser for the offline site test: {missing}")
    pytest.skip(f"no headless browser: {missing}")


def test_no_list_runs_into_the_paragraph_before_it():
    """Python-Markdown reads a list that follows a paragraph line without a blank line as more
    of that paragraph ("text:\n- a\n- b" renders as one run-on line), and `--strict` does not
    see it: each page is rendered with the site's extensions and its paragraphs searched."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    renderer = markdown.Markdown(
        extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"]
    )
    item = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")
    pages = [*sorted(DOCS.rglob("*.md")), REPO / "README.md", REPO / "BENCHMARKS.md"]
    run_on = []
    for page in pages:
        html = renderer.reset().convert(page.read_text())
        for paragraph in re.findall(r"<p>(.*?)</p>", html, re.S):
            lines = paragraph.splitlines()
            items = [line for line in lines[1:] if item.match(line)]
            if items:
                run_on.append(f"{page.relative_to(REPO)}: {lines[0][:50]!r} then {items[0][:50]!r}")
    assert not run_on, "a blank line is missing before these lists:\n" + "\n".join(run_on)


def test_every_section_of_the_old_readme_is_a_heading_of_the_docs():
    headings = {title for p in DOCS.rglob("*.md") for _, title in _headings(p.read_text())}
    missing = [title for title in MOVED_SECTIONS if title not in headings]
    assert not missing, f"no page of docs/ has these headings: {missing}"


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: the reference belongs in docs/"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|#", target):
            continue
        assert (REPO / target.split("#")[0]).exists(), f"README.md links to missing {target}"
