"""The current benchmark figures: benchmarks/results.json validates, and every document that
shows a figure (BENCHMARKS.md's table, README.md's result, the docs pages' quotes) shows the
file's value. No benchmark runs here."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from benchmarks.results import RESULTS, Figure, Results, ResultsError, load, record
from benchmarks.results.docs import END, QUOTE, START, documents, table, update

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "docs" / "benchmarks-history.md"


@pytest.fixture(scope="module")
def results() -> Results:
    return load()


def test_the_results_file_validates_and_every_figure_is_described(results):
    assert results.figures
    undescribed = [f.key for f in results.figures if not f.means]
    assert not undescribed, f"describe these figures in benchmarks/results.json: {undescribed}"


def test_every_figure_links_to_a_section_of_the_history(results):
    headings = re.findall(r"^#{2,4} (.+)$", HISTORY.read_text(), re.M)
    anchors = {slugify(h.replace("`", ""), "-") for h in headings}
    missing = [f"{f.key} -> #{f.section}" for f in results.figures if f.section not in anchors]
    assert not missing, f"no such section of docs/benchmarks-history.md: {missing}"


def test_benchmarks_md_opens_with_the_generated_table(results):
    text = (REPO / "BENCHMARKS.md").read_text()
    inside = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert inside == table(results), (
        "BENCHMARKS.md's table is stale: `.venv/bin/python -m benchmarks.results --update-docs`"
    )
    assert text.index(START) < text.index("\n## History")


def test_readme_quotes_the_calc_result_from_the_file(results):
    section = (REPO / "README.md").read_text().split("## The result", 1)[1].split("\n## ", 1)[0]
    quoted = {m["key"]: m["text"] for m in QUOTE.finditer(section)}
    assert set(quoted) >= {"calc_heldout_base_pct", "calc_heldout_final_pct"}, section
    assert quoted["calc_heldout_final_pct"] == str(results.get("calc_heldout_final_pct").value)
    # No figure written by hand beside the quoted ones.
    assert not re.search(r"\d\.\d", QUOTE.sub("", section)), section


@pytest.mark.parametrize("path", documents(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_figure_equals_the_file(results, path):
    text = path.read_text()
    wrong = [
        f"{m['key']}: {m['text']!r}" for m in QUOTE.finditer(text) if update(m[0], results) != m[0]
    ]
    assert not wrong, f"{path.name} quotes figures that benchmarks/results.json does not: {wrong}"
    # A line that starts with an HTML comment is a raw HTML block on GitHub (CommonMark).
    assert not re.search(r"^ {0,3}<!-- figure", text, re.M), f"{path.name}: reflow the quote"


def test_a_changed_number_in_a_quote_is_caught_and_regenerated(results):
    quote = "**<!-- figure calc_heldout_final_pct -->{}<!-- /figure --> %**"
    current = str(results.get("calc_heldout_final_pct").value)
    assert update(quote.format(current), results) == quote.format(current)
    assert update(quote.format("93.0"), results) == quote.format(current)
    with pytest.raises(ResultsError, match="no figure 'calc_nothing'"):
        update("<!-- figure calc_nothing -->1<!-- /figure -->", results)


def test_a_bad_file_fails_with_what_is_wrong(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"figures": [{"name": "x", "value": 1}]}))
    with pytest.raises(ResultsError, match="not a valid results file"):
        load(bad)
    with pytest.raises(ResultsError, match="missing"):
        load(tmp_path / "none.json")


def test_record_prints_the_line_and_replaces_one_entry_atomically(tmp_path, capsys, monkeypatch):
    path = tmp_path / "results.json"
    kept = Figure(
        name="kept_figure",
        value=1.5,
        means="left alone",
        command="true",
        commit=None,
        machine="m",
        date="2026-01-01",
    )
    old = kept.model_copy(update={"name": "train_mfu", "value": 0.5, "means": "MFU"})
    path.write_text(Results(figures=[old, kept]).model_dump_json())
    replaced = []
    monkeypatch.setattr(
        "lightning_core.data.files.os.replace", lambda a, b: replaced.append(b) or _move(a, b)
    )
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "train_step.py"), "--steps", "3"])

    record("train_mfu", "0.610", path=path)
    record("train_mfu", "0.7", variant="checkpointing", suffix=" (6 N)", path=path)
    record("quick_only", "1", save=False, path=path)

    assert capsys.readouterr().out.splitlines() == [
        "train_mfu: 0.610",
        "train_mfu: 0.7 (6 N)",
        "quick_only: 1",
    ]
    assert replaced == [path, path], "each write goes through a temporary file and a rename"
    after = load(path)
    assert [f.key for f in after.figures] == [
        "train_mfu",
        "kept_figure",
        "train_mfu[checkpointing]",
    ]
    mfu = after.get("train_mfu")
    assert mfu.value == 0.61 and mfu.means == "MFU"
    assert mfu.command == ".venv/bin/python benchmarks/train_step.py --steps 3"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", mfu.date) and "cores" in mfu.machine
    assert after.get("kept_figure") == kept
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left"


def test_record_leaves_the_real_file_alone_under_pytest(capsys):
    before = RESULTS.read_bytes()
    record("calc_heldout_gain_points", "0.0")
    assert RESULTS.read_bytes() == before
    assert capsys.readouterr().out == "calc_heldout_gain_points: 0.0\n"


def _move(a: str, b: Path) -> None:
    Path(a).rename(b)
