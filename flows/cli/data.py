"""Commands on a store and its data: `status`, `analyze`, `data add-tasks`, `data show`,
`data archive`, `data compact`."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from lightning_core.errors import InvalidInput, LightningError
from lightning_rl.flows.cli.app import app, fail

if TYPE_CHECKING:
    import pandas as pd


class OutputFormat(StrEnum):
    """How `lightning-rl analyze` prints a result."""

    table = "table"
    csv = "csv"
    json = "json"


def format_frame(frame: pd.DataFrame, fmt: OutputFormat = OutputFormat.table) -> str:
    """A query result as text: an aligned table, CSV with a header, or a JSON array of rows."""
    if fmt is OutputFormat.csv:
        return frame.to_csv(index=False)
    if fmt is OutputFormat.json:
        return frame.to_json(orient="records") + "\n"
    if frame.empty:
        return "  ".join(map(str, frame.columns)) + "\n(0 rows)\n"
    return frame.to_string(index=False) + "\n"


@app.command()
def status(
    server: Annotated[
        str, typer.Option(help="Root URL of a running `lightning-rl serve`.")
    ] = "http://127.0.0.1:4747",
    api_key: Annotated[
        str | None, typer.Option(envvar="LIGHTNING_API_KEY", help="The server's API key.")
    ] = None,
) -> None:
    """Count a store's rollouts by status."""
    import asyncio
    from collections import Counter

    from lightning_core.store.client import HttpStoreClient

    async def count() -> Counter[str]:
        client = HttpStoreClient(server, api_key=api_key)
        try:
            await client.check()
            return Counter(r.status.value for r in await client.query_rollouts())
        finally:
            await client.close()

    try:
        counts = asyncio.run(count())
    except LightningError as exc:
        fail(exc)
    typer.echo(f"{'status':<12} rollouts")
    for name, n in sorted(counts.items()):
        typer.echo(f"{name:<12} {n}")
    typer.echo(f"{'total':<12} {sum(counts.values())}")


@app.command()
def analyze(
    sql: Annotated[
        str,
        typer.Argument(
            help="SQL over the views transitions (one row per LLM call), episodes (one per "
            "rollout), exported_rows (the Parquet files as written), feedback (production "
            "feedback, one row per seq) and live_reward (per policy version)."
        ),
    ],
    root: Annotated[
        str,
        typer.Option(
            envvar="LIGHTNING_RUN_DIR",
            help="Training run folder holding transitions/iteration=<k>/part-0.parquet.",
        ),
    ] = "runs/latest",
    output_format: Annotated[
        str, typer.Option("--format", help="Output: table, csv or json.")
    ] = "table",
    archive: Annotated[
        str | None,
        typer.Option(
            help="A production store's archive folder (<db>.archive): its feedback joins the "
            "views feedback and live_reward."
        ),
    ] = None,
) -> None:
    """Query a training run's exported transitions and feedback with DuckDB SQL."""
    from pathlib import Path

    from lightning_core.data import analytics

    try:
        fmt = OutputFormat(output_format)
    except ValueError:
        fail(LightningError(f"unknown --format {output_format!r}; use table, csv or json"))
    run = Path(root)
    try:
        if not run.is_dir():
            raise LightningError(
                f"run folder {run} does not exist; pass --root or set LIGHTNING_RUN_DIR"
            )
        if not analytics.exported_iterations(run):
            raise LightningError(
                f"no transitions exported under {run} yet: training writes "
                "transitions/iteration=<k>/part-0.parquet after each iteration"
            )
        # In memory: a training flow may hold the run's analytics.duckdb open.
        con = analytics.connect(run, ":memory:", archive)
        try:
            frame = analytics.run_sql(con, sql)
        finally:
            con.close()
    except LightningError as exc:
        fail(exc)
    typer.echo(format_frame(frame, fmt), nl=False)


data_app = typer.Typer(
    name="data",
    help="Task tables (folders of Parquet files that training reads new tasks from) and the "
    "archive of old production episodes.",
    no_args_is_help=True,
)
app.add_typer(data_app)


@data_app.command("add-tasks")
def add_tasks(
    table: Annotated[str, typer.Argument(help="The task table's folder (created if new).")],
    file: Annotated[
        str,
        typer.Argument(
            help="Tasks to add: a .jsonl file (one JSON object a line) or a .json list of "
            "objects, each with a string 'id'; '-' reads standard input."
        ),
    ],
    note: Annotated[
        str | None, typer.Option(help="A word on where the tasks came from, kept with them.")
    ] = None,
) -> None:
    """Append tasks to a task table as one new file; ids already in the table are refused."""
    from lightning_core.data.task_table import TaskTable

    try:
        tasks = _read_tasks(file)
        tasks_table = TaskTable(table)
        name = tasks_table.append(tasks, note=note)
        whole = tasks_table.snapshot()
    except LightningError as exc:
        fail(exc)
    typer.echo(f"added {len(tasks)} tasks to {table} as {name}")
    typer.echo(
        f"table: {len(whole.files)} file{'' if len(whole.files) == 1 else 's'}, {whole.rows} "
        f"tasks, dataset id {whole.dataset_id}"
    )


@data_app.command("show")
def show(
    table: Annotated[str, typer.Argument(help="The task table's folder.")],
) -> None:
    """List a task table's files with their rows, and the identity of the whole table."""
    from pathlib import Path

    from lightning_core.data.task_table import TaskTable
    from lightning_core.errors import NotFound

    try:
        if not Path(table).is_dir():
            raise NotFound(
                f"no task table at {table}: `lightning-rl data add-tasks {table} FILE` creates it"
            )
        tasks_table = TaskTable(table)
        counts = tasks_table.counts()
        whole = tasks_table.snapshot()
    except LightningError as exc:
        fail(exc)
    width = max([len("file"), *(len(name) for name in counts)])
    typer.echo(f"{'file':<{width}} {'rows':>8}")
    for name, rows in counts.items():
        typer.echo(f"{name:<{width}} {rows:>8}")
    typer.echo(f"{'total':<{width}} {whole.rows:>8}")
    typer.echo(f"dataset id {whole.dataset_id}")
    typer.echo(f"content hash {whole.content_hash}")


@data_app.command("archive")
def archive(
    server: Annotated[
        str, typer.Option(help="Root URL of the running store (`serve` or `production`).")
    ] = "http://127.0.0.1:4748",
    older_than_days: Annotated[
        float | None,
        typer.Option(
            help="Archive production episodes with no call and no feedback for this many "
            "days; default: the server's retention_days."
        ),
    ] = None,
    max_episodes: Annotated[
        int | None, typer.Option(help="Archive at most this many, the oldest first.")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="LIGHTNING_API_KEY", help="The server's API key.")
    ] = None,
    key_file: Annotated[
        str | None, typer.Option(help="A file holding the key (`production` writes <db>.key).")
    ] = None,
) -> None:
    """Move idle production episodes and their feedback from the store to its Parquet archive."""
    import asyncio

    from lightning_core.store.client import HttpStoreClient
    from lightning_rl.policy_server import read_key

    if older_than_days is not None and older_than_days <= 0:
        fail(InvalidInput(f"--older-than-days must be > 0, got {older_than_days}"))
    if max_episodes is not None and max_episodes < 1:
        fail(InvalidInput(f"--max-episodes must be >= 1, got {max_episodes}"))

    async def run():
        async with HttpStoreClient(server, api_key=api_key) as client:
            await client.check()
            return await client.archive_episodes(older_than_days, max_episodes)

    try:
        api_key = read_key(key_file) or api_key
        report = asyncio.run(run())
    except LightningError as exc:
        fail(exc)
    typer.echo(
        f"archived {report.episodes} episodes in {len(report.batches)} batches to "
        f"{report.folder} in {report.seconds:.1f} s"
    )
    for table, rows in report.rows.items():
        typer.echo(f"  {table:<12} {rows:>10} rows")
    typer.echo(
        f"store file {report.file_bytes_before / 1e6:.1f} MB -> "
        f"{report.file_bytes_after / 1e6:.1f} MB"
    )


@data_app.command("compact")
def compact(
    db: Annotated[str, typer.Argument(help="The store's DuckDB file, with no server running.")],
) -> None:
    """Give back the space of archived episodes: rewrite a stopped store's file compactly."""
    from lightning_core.store.compact import compact as compact_file

    try:
        before, after = compact_file(db)
    except LightningError as exc:
        fail(exc)
    typer.echo(f"{db}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


def _read_tasks(file: str) -> list:
    """Tasks from a JSON list or JSON lines (told apart by the first character), or stdin."""
    import json
    from pathlib import Path

    source = "standard input" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read tasks from {source}: {exc}") from exc
    if text.lstrip().startswith("["):
        try:
            tasks = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{source} is not a JSON list: {exc}") from exc
        return tasks
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidInput(
                f"{source} line {number} is not JSON ({exc}); give one JSON object a line, "
                "or a JSON list"
            ) from exc
    return tasks
