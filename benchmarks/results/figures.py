"""The current benchmark figures: benchmarks/results.json, its typed model, and `record`.

Each benchmark prints its figures as `name: value` lines. `record` prints that line and keeps the
figure in benchmarks/results.json (reviewed in git) with what reproduces it: the command, the
commit, the machine and the date. A figure measured again replaces the old entry; the old value
stays in docs/benchmarks-history.md, beside the run that gave it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lightning_core.data.files import write_text_atomically

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results.json"

Value = int | float | str


class ResultsError(ValueError):
    """benchmarks/results.json cannot be read as the figures' file."""


class Figure(BaseModel):
    """One current figure: the value of a `name: value` line and how to measure it again."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=r"^\w+$", description="The figure line's name, as the benchmark prints it."
    )
    variant: str | None = Field(
        None,
        description="What tells apart two figures of one name (e.g. `prefill 1000000`: the same "
        "benchmark on a store holding a year of episodes); none for the default run.",
    )
    value: Value = Field(description="The value as printed: a number, or text such as `14/14`.")
    means: str = Field(
        "",
        description="What the figure is, with its unit and goal, in a few words. A figure that "
        "a benchmark records for the first time has none until someone writes it.",
    )
    command: str = Field(description="The command that measures it again, from the repo root.")
    commit: str | None = Field(
        description="Short hash of the commit it was measured on (`+`: with changes in the "
        "working tree); null where not recorded."
    )
    machine: str = Field(description="Cores, memory and GPU of the machine it ran on.")
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$", description="UTC day of the measurement.")
    section: str | None = Field(
        None,
        description="Anchor of the section of docs/benchmarks-history.md that has the run.",
    )
    note: str = Field("", description="What else a reader needs: the run's name, an interval.")

    @property
    def key(self) -> str:
        """How documents name the figure: `name`, or `name[variant]`."""
        return self.name if self.variant is None else f"{self.name}[{self.variant}]"


class Results(BaseModel):
    """The file: every current figure, in the order of the generated table."""

    model_config = ConfigDict(extra="forbid")

    figures: list[Figure] = Field(description="The current figures, one per key.")

    @model_validator(mode="after")
    def _one_per_key(self) -> Results:
        keys = [f.key for f in self.figures]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"figures named more than once: {', '.join(twice)}")
        return self

    def get(self, key: str) -> Figure:
        for figure in self.figures:
            if figure.key == key:
                return figure
        raise ResultsError(f"no figure {key!r} in benchmarks/results.json")

    def with_figure(self, figure: Figure) -> Results:
        """These results with `figure` in place of the entry of its key (or added at the end)."""
        kept = [figure if f.key == figure.key else f for f in self.figures]
        if figure.key not in {f.key for f in self.figures}:
            kept.append(figure)
        return Results(figures=kept)


def load(path: Path = RESULTS) -> Results:
    """The figures of `path`, validated; ResultsError says what is wrong and where."""
    try:
        return Results.model_validate_json(path.read_bytes())
    except FileNotFoundError as e:
        raise ResultsError(f"{path} is missing: restore it from git") from e
    except ValidationError as e:
        raise ResultsError(
            f"{path} is not a valid results file (fix it or restore it):\n{e}"
        ) from e


def dump(results: Results, path: Path = RESULTS) -> None:
    """Write `results` to `path` whole or not at all (a temporary file, then a rename)."""
    text = json.dumps(results.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    write_text_atomically(path, text)


def record(
    name: str,
    value: Value,
    *,
    variant: str | None = None,
    suffix: str = "",
    echo: bool = True,
    save: bool = True,
    command: str | None = None,
    path: Path = RESULTS,
) -> None:
    """Print the figure line `name: value` (then `suffix`, which is not kept) and keep the figure
    in the results file, with this commit, machine and day. `value` is what the line shows,
    usually already formatted (`f"{x:.2f}"`); a number in it is kept as a number.

    Nothing is kept with `save=False` (a `--quick` run, whose figures measure nothing), nor under
    pytest unless `path` is given: a test that runs a benchmark must not rewrite the figures."""
    if echo:
        print(f"{name}: {value}{suffix}", flush=True)
    under_pytest = "PYTEST_CURRENT_TEST" in os.environ and path == RESULTS
    if not save or under_pytest:
        return
    results = load(path) if path.exists() else Results(figures=[])
    key = name if variant is None else f"{name}[{variant}]"
    old = next((f for f in results.figures if f.key == key), None)
    figure = Figure(
        name=name,
        variant=variant,
        value=_as_value(value),
        # What the figure means and where its runs are told stay as they were written.
        means=old.means if old else "",
        section=old.section if old else None,
        command=command or _command(),
        commit=_commit(),
        machine=machine(),
        date=datetime.now(UTC).strftime("%Y-%m-%d"),
    )
    dump(results.with_figure(figure), path)


def record_printed(text: str, prefix: str, **options: Any) -> None:
    """Keep the figure lines of `text`, already printed, whose names start with `prefix`: for a
    benchmark whose report is one block of text. `options` as for `record`."""
    for name, value in re.findall(rf"^({re.escape(prefix)}\w*): (\S+)$", text, re.M):
        record(name, value, echo=False, **options)


def _as_value(value: Value) -> Value:
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        # JSON has no NaN: a figure that could not be measured stays the text it printed.
        return number if math.isfinite(number) else value
    return value


def _command() -> str:
    """This process's command line, as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return shlex.join([".venv/bin/python", shown, *sys.argv[1:]])


def _commit() -> str | None:
    """HEAD's short hash, `+` marking a working tree with changes; None outside a checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def machine() -> str:
    """`2 cores, 24 GiB, no GPU`: what bounds most of these figures."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "no GPU"
    torch = sys.modules.get("torch")  # only a benchmark that loaded torch can have used a GPU
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return f"{os.cpu_count()} cores, {memory:.0f} GiB, {gpu}"
