"""The documentation: a short README, and a MkDocs site that builds cleanly and kept every section
of the long README it replaced."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_site_builds_in_strict_mode(tmp_path):
    command = _mkdocs()
    if command is None:
        pytest.skip("mkdocs is not installed: `make setup-dev` (the dev extra) installs it")
    # The theme's notice about MkDocs 2.0 is noise in a test's output.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [*command, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # BENCHMARKS.md is included whole as the benchmarks page (docs/mkdocs_hooks.py): every
    # section of it is a section of the page.
    page = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    sections = [t for level, t in _headings((REPO / "BENCHMARKS.md").read_text()) if level == 2]
    assert sections and page.count("<h2") == len(sections)


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
