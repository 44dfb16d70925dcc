"""Task tables (lightning_core/data/task_table.py), their `lightning-rl data` commands, and the calc
agent's fresh tasks: appends in order, slices after a watermark, identity by content hash."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from lightning_core.data.task_table import TableSlice, TaskTable, content_hash
from lightning_core.errors import InvalidInput
from lightning_rl.agents.calc.calculator import evaluate
from lightning_rl.agents.calc.data import fresh_tasks, load_tasks
from lightning_rl.flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
# The calc tasks' phrasings (agents/calc/data.py's _PHRASES) around the expression.
QUESTION = r"(?:What is (?:the value of )?|Calculate |Compute )(.+)[?.]"


def tasks(prefix: str, n: int, **extra) -> list[dict]:
    return [
        {"id": f"{prefix}-{i}", "question": f"{prefix} {i}?", "answer": i, **extra}
        for i in range(n)
    ]


@pytest.fixture
def table(tmp_path) -> TaskTable:
    return TaskTable(tmp_path / "calc-tasks")


def test_appends_read_back_in_order_and_slice_after_a_watermark(table):
    assert table.files() == [] and table.read() == []
    first = table.append(tasks("a", 3), note="week 1")
    second = table.append(tasks("b", 2))
    third = table.append(tasks("c", 1))
    assert table.files() == [first, second, third] == sorted([first, second, third])
    assert [t["id"] for t in table.read()] == ["a-0", "a-1", "a-2", "b-0", "b-1", "c-0"]
    assert table.read()[:3] == tasks("a", 3)
    assert [t["id"] for t in table.read(after=first)] == ["b-0", "b-1", "c-0"]
    assert [t["id"] for t in table.read(through=first)] == ["a-0", "a-1", "a-2"]
    assert [t["id"] for t in table.read(after=first, through=second)] == ["b-0", "b-1"]
    assert table.counts() == {first: 3, second: 2, third: 1}
    stored = pq.read_table(table.folder / first)
    assert stored.column_names == ["id", "task", "added_at", "note"]
    assert stored.column("note").to_pylist() == ["week 1"] * 3

    whole = table.snapshot()
    assert whole.table == "calc-tasks"
    assert whole.files == [first, second, third] and whole.through == third
    assert whole.rows == 6 == len(whole.tasks)
    assert whole.content_hash == content_hash(whole.tasks)
    assert whole.dataset_id == f"calc-tasks@{whole.content_hash[:12]}"
    new = table.snapshot(after=first)
    assert new.files == [second, third] and new.through == third and new.rows == 3
    assert new.tasks == table.read(after=first)


def test_nothing_after_the_last_watermark_is_an_empty_slice(table):
    name = table.append(tasks("a", 2))
    empty = table.snapshot(after=name)
    assert empty == TableSlice(
        table="calc-tasks",
        files=[],
        through=None,
        tasks=[],
        rows=0,
        content_hash=content_hash([]),
        dataset_id=f"calc-tasks@{content_hash([])[:12]}",
    )
    assert TaskTable(table.folder / "never-made").snapshot().rows == 0


def test_the_hash_is_the_rows_identity(table, tmp_path):
    table.append(tasks("a", 3))
    table.append(tasks("b", 2))
    once = table.snapshot()
    # Another reader, another process's object: the same identity.
    again = TaskTable(str(table.folder)).snapshot()
    assert again.content_hash == once.content_hash and again.dataset_id == once.dataset_id
    # Key order does not count; a changed value and the rows' order do.
    assert content_hash([{"b": 1, "a": [1, 2]}]) == content_hash([{"a": [1, 2], "b": 1}])
    changed = TaskTable(tmp_path / "other" / "calc-tasks")
    rows = tasks("a", 3) + tasks("b", 2)
    rows[4] = {**rows[4], "answer": 99}
    changed.append(rows)
    assert changed.snapshot().content_hash != once.content_hash
    assert content_hash(rows) != content_hash([*rows[1:], rows[0]])
    with pytest.raises(InvalidInput, match="plain JSON"):
        content_hash([{"x": float("nan")}])


def test_a_crash_mid_append_leaves_nothing_visible(table, monkeypatch):
    name = table.append(tasks("a", 2))
    before = table.snapshot()
    # A crash between writing and renaming leaves a hidden temporary file: not part of the table.
    (table.folder / ".20990101T000000.000000-deadbeef.parquet.tmp").write_bytes(b"PAR1 half")
    assert table.files() == [name]
    assert table.snapshot() == before

    # A write that fails half-way removes its temporary file and adds no table file.
    def broken(table_, where, **_):
        where.write(b"PAR1 partial")
        raise OSError("disk went away")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError, match="disk went away"):
        table.append(tasks("b", 1))
    monkeypatch.undo()
    assert table.files() == [name]
    assert not [
        p for p in table.folder.iterdir() if p.name.endswith(".tmp") and "deadbeef" not in p.name
    ]
    # The ids of the failed append are free again.
    assert table.append(tasks("b", 1)) > name


def test_duplicate_ids_are_refused_and_change_nothing(table):
    table.append(tasks("a", 3))
    with pytest.raises(InvalidInput, match=r"already has task ids 'a-1'"):
        table.append([{"id": "new"}, {"id": "a-1"}])
    with pytest.raises(InvalidInput, match=r"'x' appears twice"):
        table.append([{"id": "x"}, {"id": "x"}])
    assert [t["id"] for t in table.read()] == ["a-0", "a-1", "a-2"]
    assert len(table.files()) == 1


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "empty"),
        ([{"question": "no id"}], "no string `id`"),
        ([{"id": 7}], "no string `id`"),
        (["not a dict"], "not a JSON object"),
        ([{"id": "a", "x": object()}], "not plain JSON"),
        ([{"id": "a", "x": float("inf")}], "not plain JSON"),
        ([{"id": "a", "x": (1, 2)}], "read back the same"),
        ([{"id": "a", "x": {1: 2}}], "read back the same"),
    ],
)
def test_bad_tasks_are_refused_clearly(table, rows, message):
    with pytest.raises(InvalidInput, match=message):
        table.append(rows)
    assert table.files() == []


def test_a_folder_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "tasks"
    path.write_text("x")
    with pytest.raises(InvalidInput, match="is a file"):
        TaskTable(path)


def test_files_a_team_drops_in_are_read_in_name_order(table):
    first = table.append(tasks("a", 1))
    dropped = table.folder / "29990101T000000.000000-week2.parquet"
    # Written with DuckDB, as a team might; no `id` in the task JSON: the column gives it.
    duckdb.sql(
        'COPY (SELECT * FROM (VALUES (\'d-0\', \'{"question": "q0", "answer": 0}\'), '
        '(\'d-1\', \'{"id": "d-1", "question": "q1", "answer": 1}\')) t(id, task)) '
        f"TO '{dropped}' (FORMAT parquet)"
    )
    assert table.files() == [first, dropped.name]
    assert table.read(after=first) == [
        {"question": "q0", "answer": 0, "id": "d-0"},
        {"id": "d-1", "question": "q1", "answer": 1},
    ]
    # A later append still sorts after the dropped file, though its time is in the future.
    later = table.append(tasks("c", 1))
    assert table.files() == [first, dropped.name, later]


@pytest.mark.parametrize(
    ("select", "message"),
    [
        ("SELECT 'x' AS id, 1 AS question", "cannot read .*bad.parquet"),
        ("SELECT 'x' AS id, 'not json' AS task", "bad.parquet row 0: `task` is not JSON"),
        ("SELECT 'x' AS id, '[1]' AS task", "bad.parquet row 0: `task` is not a JSON object"),
        ("SELECT 'x' AS id, '{\"id\": \"y\"}' AS task", "own id 'y' differs"),
        ("SELECT 'a-0' AS id, '{}' AS task", "'a-0' is in both"),
    ],
)
def test_a_dropped_file_of_another_layout_is_named(table, select, message):
    table.append(tasks("a", 1))
    duckdb.sql(f"COPY ({select}) TO '{table.folder / 'bad.parquet'}' (FORMAT parquet)")
    with pytest.raises(InvalidInput, match=message):
        table.snapshot()


def test_an_unreadable_file_is_named_and_blocks_appends_after_an_odd_name(table):
    table.append(tasks("a", 1))
    (table.folder / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InvalidInput, match=r"cannot read .*broken\.parquet"):
        table.read()
    with pytest.raises(InvalidInput, match=r"cannot read .*broken\.parquet"):
        table.append(tasks("b", 1))
    (table.folder / "broken.parquet").unlink()
    duckdb.sql(
        f"COPY (SELECT 'z' AS id, '{{}}' AS task) TO '{table.folder / 'zz.parquet'}' "
        "(FORMAT parquet)"
    )
    with pytest.raises(InvalidInput, match=r"zz\.parquet .* sorts after any new append"):
        table.append(tasks("b", 1))


# -- lightning-rl data -------------------------------------------------------------------------

cli = CliRunner()


def test_cli_adds_jsonl_and_json_lists_and_shows_the_table(tmp_path):
    folder = tmp_path / "calc-tasks"
    lines = tmp_path / "week1.jsonl"
    lines.write_text("\n".join(json.dumps(t) for t in tasks("a", 3)) + "\n\n")
    listed = tmp_path / "week2.json"
    listed.write_text(json.dumps(tasks("b", 2), indent=2))
    first = cli.invoke(app, ["data", "add-tasks", str(folder), str(lines), "--note", "w1"])
    assert first.exit_code == 0, first.output
    assert f"added 3 tasks to {folder}" in first.stdout
    second = cli.invoke(app, ["data", "add-tasks", str(folder), str(listed)])
    assert second.exit_code == 0, second.output
    whole = TaskTable(folder).snapshot()
    assert f"2 files, 5 tasks, dataset id {whole.dataset_id}" in second.stdout

    shown = cli.invoke(app, ["data", "show", str(folder)])
    assert shown.exit_code == 0, shown.output
    out = shown.stdout.splitlines()
    assert out[1].split() == [whole.files[0], "3"]
    assert out[2].split() == [whole.files[1], "2"]
    assert out[3].split() == ["total", "5"]
    assert f"dataset id {whole.dataset_id}" in shown.stdout
    assert whole.content_hash in shown.stdout

    from_stdin = cli.invoke(
        app, ["data", "add-tasks", str(folder), "-"], input=json.dumps({"id": "s"}) + "\n"
    )
    assert from_stdin.exit_code == 0, from_stdin.output
    assert TaskTable(folder).read()[-1] == {"id": "s"}


@pytest.mark.parametrize(
    ("args", "content", "message"),
    [
        (["add-tasks", "{t}", "{f}"], '{"id": "a"}\n{"id": "a"}\n', "'a' appears twice"),
        (["add-tasks", "{t}", "{f}"], '{"id": "a"}\nnope\n', "line 2 is not JSON"),
        (["add-tasks", "{t}", "{f}"], '[{"id": "a"},', "is not a JSON list"),
        (["add-tasks", "{t}", "{f}"], "", "the list of tasks is empty"),
        (["add-tasks", "{t}", "{tmp}/missing.jsonl"], "", "cannot read tasks from"),
        (["add-tasks", "{f}", "{f}"], '{"id": "a"}\n', "is a file"),
        (["show", "{tmp}/none"], "", "no task table at"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, args, content, message):
    source = tmp_path / "tasks.jsonl"
    source.write_text(content)
    args = [
        a.replace("{t}", str(tmp_path / "t"))
        .replace("{f}", str(source))
        .replace("{tmp}", str(tmp_path))
        for a in args
    ]
    result = cli.invoke(app, ["data", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_fresh_tasks_pipe_into_a_table_from_the_command_line(tmp_path):
    folder = tmp_path / "calc-tasks"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        f"{sys.executable} -m lightning_rl.agents.calc.fresh --fresh 5 --seed 3 "
        f"| lightning-rl data add-tasks {folder} - --note week-3",
        shell=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "added 5 tasks" in done.stdout
    assert TaskTable(folder).read() == fresh_tasks(5, 3)


# -- the calc agent's fresh tasks --------------------------------------------------------------


def test_fresh_tasks_are_new_questions_of_their_own_stream():
    week = fresh_tasks(300, seed=1)
    assert week == fresh_tasks(300, seed=1)
    assert [t["id"] for t in week] == [f"arithmetic-fresh1-{i}" for i in range(300)]
    assert {t["source"] for t in week} == {"arithmetic"}
    for task in week:
        expression = re.fullmatch(QUESTION, task["question"]).group(1)
        assert task["answer"] == evaluate(expression), task
    questions = [t["question"] for t in week]
    assert len(set(questions)) == 300
    other = {t["question"] for t in fresh_tasks(300, seed=2)}
    assert len(other & set(questions)) < 10
    for split, size in (("test", 1000), ("test", 200), ("train", 2000)):
        assert not set(questions) & {t["question"] for t in load_tasks(split, size)}, (split, size)
    with pytest.raises(ValueError, match="at least 1"):
        fresh_tasks(0, seed=1)
