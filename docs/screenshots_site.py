"""The documentation site read offline, as a user who unzipped it would: built with
`mkdocs build`, opened from its folder (file://) in headless Chromium with every network
request refused, and checked for the home page's diagram, search and the security page's lists.

    .venv/bin/python docs/screenshots_site.py      # `make screenshots-site`: retakes the PNGs

tests/test_docs.py runs the same checks without writing the screenshots.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# docs/ is no package: run as a script (or loaded by tests/test_docs.py), its folder is on the path.
from screenshots import DOCS, REPO, browser

# The pages shown, and where their screenshots go.
HOME_SHOT = DOCS / "site-offline-home.png"
SECURITY_SHOT = DOCS / "site-offline-security.png"
SEARCH_WORD = "quota"
# Drawing the diagram and indexing the search take a second or two; offline, nothing waits on
# the network, so a page that does not show them in this time will not.
SHOW_TIMEOUT_MS = 30_000
DIAGRAM_DRAWN = """() => {
    const drawn = document.querySelector('div.mermaid');
    return drawn && !document.querySelector('pre.mermaid') && drawn.getBoundingClientRect().height;
}"""


def build_site(site_dir: Path) -> None:
    """`mkdocs build --strict` into `site_dir` (this interpreter's mkdocs: `make setup-dev`)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"mkdocs build failed:\n{done.stdout}{done.stderr}")


def read_offline(site_dir: Path, shots: bool = False) -> dict[str, Any]:
    """Open the built site from its folder with the network cut off. Returns what was seen:
    the requests that tried to leave the machine, the drawn diagram's height, search results for
    SEARCH_WORD and the security page's list items; with `shots`, writes the PNGs."""
    refused: list[str] = []

    def no_network(route: Any) -> None:
        if route.request.url.startswith(("file:", "data:", "blob:", "about:")):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    seen: dict[str, Any] = {"refused": refused}
    with browser() as page:
        page.context.route("**/*", no_network)
        page.goto((site_dir / "index.html").as_uri())
        # The theme swaps the diagram's source (pre.mermaid) for a div holding the drawing in a
        # closed shadow root: drawn once that div is there and has a height.
        page.wait_for_function(DIAGRAM_DRAWN, timeout=SHOW_TIMEOUT_MS)
        seen["diagram_height_px"] = page.evaluate(DIAGRAM_DRAWN)
        if shots:
            page.screenshot(path=str(HOME_SHOT))
        page.fill("input[data-md-component=search-query]", SEARCH_WORD)
        page.wait_for_selector(".md-search-result__item", timeout=SHOW_TIMEOUT_MS)
        seen["search_results"] = page.locator(".md-search-result__item").count()
        seen["search_meta"] = page.inner_text(".md-search-result__meta")

        page.goto((site_dir / "security.html").as_uri())
        heading = page.locator("h2", has_text="What each party can and cannot do")
        # One scroll down, to just below the theme's header bar (scrolling up shows a "back to
        # top" button over the text).
        heading.evaluate("h => window.scrollTo(0, h.getBoundingClientRect().top - 70)")
        seen["security_list_items"] = page.locator("article ul > li").count()
        # A list run into the paragraph above it renders as that paragraph's text.
        seen["security_paragraphs_with_items"] = page.evaluate(
            """() => [...document.querySelectorAll('article p')]
                   .filter(p => /\\n\\s*- /.test(p.textContent)).length"""
        )
        if shots:
            page.wait_for_timeout(500)  # the header's title settles after a scroll
            page.screenshot(path=str(SECURITY_SHOT))
    return seen


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="lightning-site-") as tmp:
        site = Path(tmp) / "site"
        build_site(site)
        seen = read_offline(site, shots=True)
    for key, value in seen.items():
        print(f"{key}: {value}")
    print(f"wrote {HOME_SHOT.relative_to(REPO)} and {SECURITY_SHOT.relative_to(REPO)}")
    if seen["refused"]:
        sys.exit(f"the site tried the network: {seen['refused']}")


if __name__ == "__main__":
    main()
