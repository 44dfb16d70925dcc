"""The fault matrix: every test marked `@pytest.mark.fault(name=, injected=, outcome=)`, run in
one pytest session and printed as a table with the line `faults_survived: X/Y`.

Each row is a fault injected for real (a SIGKILL, a full tmpfs, a hanging agent, ...). Its test
asserts that nothing acknowledged was lost and that the run ended in a state the user can act on,
so a passed row has lost nothing (data lost 0); a failed or skipped row has not shown that.

    python benchmarks/fault_matrix.py                   # run every row, slow ones included
    python benchmarks/fault_matrix.py --collect-only    # the rows, without running them
    python benchmarks/fault_matrix.py -k disk           # more arguments go to pytest
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402

FIELDS = ("name", "injected", "outcome")


@dataclass
class FaultRow:
    """One fault: what the marker says, the tests that carry it, and how they ended."""

    name: str
    injected: str
    outcome: str
    tests: list[str] = field(default_factory=list)
    # "not run", then "passed", "failed" or "skipped: <reason>", worst of the row's tests.
    result: str = "not run"

    @property
    def survived(self) -> bool:
        return self.result == "passed"

    @property
    def data_lost(self) -> str:
        # The tests assert that nothing acknowledged is lost: passing is what proves it.
        if self.survived:
            return "0"
        return "not run" if self.result == "not run" else "not shown"


class MatrixPlugin:
    """Keeps the items that carry the fault marker and records each one's outcome."""

    def __init__(self) -> None:
        self.rows: dict[str, FaultRow] = {}
        self.problems: list[str] = []
        self._row_of: dict[str, FaultRow] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        kept, dropped = [], []
        for item in items:
            marker = item.get_closest_marker("fault")
            if marker is None:
                dropped.append(item)
                continue
            kept.append(item)
            row = self.add(item.nodeid, marker.args, marker.kwargs)
            if row is not None:
                self._row_of[item.nodeid] = row
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept

    def add(self, nodeid: str, args: tuple, kwargs: dict[str, Any]) -> FaultRow | None:
        """The row of a test's marker, or None (and a problem noted) if the marker is wrong."""
        marked = {k: kwargs.get(k) for k in FIELDS}
        missing = [k for k in FIELDS if not isinstance(marked[k], str) or not marked[k].strip()]
        if args or missing or set(kwargs) - set(FIELDS):
            self.problems.append(
                f"{nodeid}: mark it @pytest.mark.fault(name=..., injected=..., outcome=...), "
                f"each a non-empty string (missing: {', '.join(missing) or 'none'}; "
                f"extra: {', '.join(sorted(set(kwargs) - set(FIELDS))) or 'none'})"
            )
            return None
        row = self.rows.get(marked["name"])
        if row is None:
            row = self.rows[marked["name"]] = FaultRow(**marked)
        elif (row.injected, row.outcome) != (marked["injected"], marked["outcome"]):
            self.problems.append(
                f"{nodeid}: fault {marked['name']!r} is marked with another injected/outcome "
                f"in {row.tests[0]}; one fault, one description"
            )
        row.tests.append(nodeid)
        return row

    def pytest_runtest_logreport(self, report: Any) -> None:
        row = self._row_of.get(report.nodeid)
        if row is None:
            return
        if report.failed:
            row.result = "failed"
        elif report.skipped and row.result != "failed":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
            row.result = f"skipped: {reason.removeprefix('Skipped: ')}"
        elif report.when == "call" and report.passed and row.result == "not run":
            row.result = "passed"


def marked_files(tests: Path) -> list[Path]:
    """Test files that mention the marker: collecting only these spares importing the rest."""
    return sorted(p for p in tests.rglob("test_*.py") if "mark.fault" in p.read_text())


def run_matrix(paths: list[Path], collect_only: bool, pytest_args: list[str]) -> tuple[int, Any]:
    plugin = MatrixPlugin()
    args = [*map(str, paths), "-p", "no:cacheprovider", "-q", *pytest_args]
    if collect_only:
        # Plugins no fault row needs to be listed, whose imports take most of a collection.
        unused = ("schemathesis", "langsmith_plugin", "hypothesispytest")
        args += ["--collect-only", *(f"-pno:{name}" for name in unused)]
    code = pytest.main(args, plugins=[plugin])
    return int(code), plugin


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[FaultRow]) -> str:
    lines = [
        "| fault | how injected | outcome | test | result | data lost |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        tests = "<br>".join(f"`{t}`" for t in row.tests)
        cells = (row.name, row.injected, row.outcome, tests, row.result, row.data_lost)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--collect-only", action="store_true", help="List the rows without running them."
    )
    parser.add_argument("--json", type=Path, help="Also write the rows to this JSON file.")
    parser.add_argument(
        "--tests", type=Path, default=ROOT / "tests", help="Folder of the test files."
    )
    options, pytest_args = parser.parse_known_args()
    paths = marked_files(options.tests)
    if not paths:
        print(f"error: no test under {options.tests} carries @pytest.mark.fault", file=sys.stderr)
        return 2
    code, plugin = run_matrix(paths, options.collect_only, pytest_args)
    rows = list(plugin.rows.values())
    if options.json:
        records = [asdict(r) | {"data_lost": r.data_lost} for r in rows]
        options.json.write_text(json.dumps(records, indent=1))
    print()
    print(table(rows))
    print()
    if options.collect_only:
        print(f"fault_rows: {len(rows)}")
    else:
        # A run of some rows only (pytest's own options, `-k`) is a figure of its own.
        variant = " ".join(pytest_args) or None
        survived = f"{sum(r.survived for r in rows)}/{len(rows)}"
        record("faults_survived", survived, variant=variant)
    for problem in plugin.problems:
        print(f"error: {problem}", file=sys.stderr)
    if plugin.problems:
        return 2
    if options.collect_only:
        return 0 if code in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) else code
    return 0 if rows and all(r.survived for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
