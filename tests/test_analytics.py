"""Analytics over Parquet exports: exact metrics on hand-made iterations, atomic writes, the CLI."""

from __future__ import annotations

import json
import math

import duckdb
import pandas as pd
import pytest
from typer.testing import CliRunner

from lightning_core.data import analytics, files
from lightning_core.data.analytics import RolloutFacts, transition_rows
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.types import Transition
from lightning_rl.flows.cli import app


def call(
    rollout: str,
    step: int,
    agent: str | None,
    prompt: int,
    response: int,
    reward: float,
    advantage: float,
) -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt_id=f"{rollout}-a1",
        step=step,
        agent_name=agent,
        prompt_token_ids=list(range(prompt)),
        response_token_ids=list(range(response)),
        reward=reward,
        advantage=advantage,
        policy_version="v0",
    )


def iteration_0() -> list[dict]:
    # Groups g1 (r1, r2) and g2 (r3, r4); r4's agent failed before calling the LLM.
    transitions = [
        call("r1", 1, "coder", 5, 4, 0.8, 0.5),
        call("r1", 0, "planner", 3, 2, 0.2, 0.5),
        call("r2", 0, "planner", 4, 6, 0.0, -0.5),
        call("r3", 0, None, 2, 1, 0.0, 0.0),
    ]
    facts = {
        "r1": RolloutFacts(
            group_id="g1", task_id="t1", episode_return=1.0, success=True, tool_calls=2
        ),
        "r2": {
            "group_id": "g1",
            "task_id": "t1",
            "episode_return": 0.0,
            "success": False,
            "tool_calls": 1,
            "tool_errors": 1,
        },
        "r3": RolloutFacts(group_id="g2", task_id="t2", episode_return=0.0, success=False),
        "r4": RolloutFacts(
            group_id="g2", task_id="t2", episode_return=0.0, success=False, attempt_id="r4-a1"
        ),
    }
    return transition_rows(transitions, facts)


def row(rollout: str, **overrides) -> dict:
    base = {
        "rollout_id": rollout,
        "attempt_id": f"{rollout}-a1",
        "group_id": "g3",
        "task_id": "t3",
        "step": 0,
        "agent_name": "planner",
        "prompt_tokens": 10,
        "response_tokens": 3,
        "reward": 1.0,
        "advantage": 0.0,
        "episode_return": 1.0,
        "success": True,
        "tool_calls": 0,
        "tool_errors": 0,
        "policy_version": "v1",
        "prefix_break": None,
        "provenance_refused": None,
        "judge_score": None,
    }
    return base | overrides


@pytest.fixture
def run(tmp_path):
    analytics.export_iteration(tmp_path, 0, iteration_0())
    analytics.export_iteration(tmp_path, 1, pd.DataFrame([row("r5"), row("r6", step=0)]))
    return tmp_path


def test_prefix_breaks_are_a_column_counted_per_agent(tmp_path):
    # The planner's second call extends its first (prompt + response), its third does not; the
    # coder's only call has no previous one (NULL).
    first = call("r1", 0, "planner", 3, 2, 0.0, 0.5)
    second = first.model_copy(update={"step": 1, "prompt_token_ids": [0, 1, 2, 0, 1, 7]})
    third = first.model_copy(update={"step": 3, "prompt_token_ids": [0, 1, 2, 9]})
    coder = call("r1", 2, "coder", 4, 1, 0.0, 0.5)
    facts = {"r1": RolloutFacts(episode_return=1.0, success=True)}
    analytics.export_iteration(tmp_path, 0, transition_rows([third, coder, second, first], facts))
    with analytics.connect(tmp_path, ":memory:") as con:
        steps = con.execute("SELECT step, prefix_break FROM transitions ORDER BY step").fetchall()
        per_agent = con.execute(
            "SELECT agent_name, count(*) FILTER (WHERE prefix_break) FROM transitions "
            "GROUP BY agent_name ORDER BY agent_name"
        ).fetchall()
    assert steps == [(0, None), (1, False), (2, None), (3, True)]
    assert per_agent == [("coder", 0), ("planner", 1)]


def test_an_export_from_before_the_prefix_break_column_still_reads(run):
    old = pd.read_parquet(run / "transitions" / "iteration=1" / "part-0.parquet")
    old.drop(columns=["prefix_break", "iteration"]).to_parquet(
        run / "transitions" / "iteration=1" / "part-0.parquet"
    )
    with analytics.connect(run, ":memory:") as con:
        rows = con.execute(
            "SELECT iteration, prefix_break FROM transitions WHERE iteration = 1"
        ).fetchall()
    assert rows == [(1, None), (1, None)]


def test_export_layout_and_schema(run):
    path = run / "transitions" / "iteration=0" / "part-0.parquet"
    assert analytics.exported_iterations(run) == [0, 1]
    table = pd.read_parquet(path)
    assert list(table.columns) == list(analytics.COLUMN_NAMES)
    assert len(table) == 5  # 4 transitions and r4's placeholder
    placeholder = table[table.rollout_id == "r4"].iloc[0]
    assert placeholder.step == analytics.PLACEHOLDER_STEP
    assert placeholder.response_tokens == 0 and placeholder.attempt_id == "r4-a1"
    assert math.isnan(placeholder.advantage)
    assert list(table[table.rollout_id == "r1"].step) == [0, 1]
    assert sorted(p.name for p in path.parent.iterdir()) == ["part-0.parquet"]


def test_iteration_metrics_are_exact(run):
    con = analytics.connect(run)
    m = analytics.iteration_metrics(con, 0)
    # Returns 1, 0, 0, 0: mean 0.25, population variance (0.75² + 3·0.25²) / 4 = 0.1875.
    assert m == pytest.approx(
        {
            "rollout/reward_mean": 0.25,
            "rollout/reward_std": math.sqrt(0.1875),
            "rollout/success_rate": 0.25,
            "rollout/actions_per_episode": 1.0,  # 2 + 1 + 1 + 0 calls over 4 rollouts
            "rollout/tokens_per_action": (2 + 4 + 6 + 1) / 4,
            "rollout/prompt_tokens_per_action": (3 + 5 + 4 + 2) / 4,
            "rollout/tool_error_rate": 1 / 3,
            "rollout/episodes": 4.0,
            "rollout/provenance_refused": 0.0,
            "credit/advantage_mean": 0.5 / 4,
            "credit/advantage_abs_mean": 1.5 / 4,
            "credit/zero_advantage_fraction": 0.25,
        }
    )
    m1 = analytics.iteration_metrics(con, 1)
    assert m1["rollout/reward_std"] == 0.0
    assert m1["rollout/tool_error_rate"] == 0.0  # no tool calls at all
    assert m1["credit/zero_advantage_fraction"] == 1.0
    with pytest.raises(NotFound, match="exported: 0, 1"):
        analytics.iteration_metrics(con, 7)


def test_history_has_one_row_per_iteration(run):
    frame = analytics.history(analytics.connect(run, ":memory:"))
    assert list(frame.iteration) == [0, 1]
    assert list(frame["rollout/reward_mean"]) == pytest.approx([0.25, 1.0])
    assert list(frame.columns[1:]) == list(analytics.iteration_metrics(analytics.connect(run), 0))


def test_agent_breakdown(run):
    frame = analytics.agent_breakdown(analytics.connect(run), 0)
    assert frame.agent_name.tolist()[:2] == ["coder", "planner"]
    assert frame.agent_name.isna().tolist() == [False, False, True]
    assert frame.transitions.tolist() == [1, 2, 1]
    assert frame.reward_mean.tolist() == pytest.approx([0.8, 0.1, 0.0])
    assert frame.advantage_mean.tolist() == pytest.approx([0.5, 0.0, 0.0])
    assert frame.tokens_per_action.tolist() == pytest.approx([4.0, 4.0, 1.0])


def test_episodes_view_counts_each_rollout_once(run):
    con = analytics.connect(run)
    episodes = analytics.run_sql(
        con, "SELECT rollout_id, actions, tool_calls FROM episodes WHERE iteration = 0 ORDER BY 1"
    )
    assert episodes.values.tolist() == [["r1", 2, 2], ["r2", 1, 1], ["r3", 1, 0], ["r4", 0, 0]]
    assert run_count(con, "transitions") == 6 and run_count(con, "exported_rows") == 7


def run_count(con, view: str) -> int:
    return int(analytics.run_sql(con, f"SELECT count(*) AS n FROM {view}").n[0])


def test_a_later_export_is_visible_to_an_open_connection(run):
    con = analytics.connect(run)
    analytics.export_iteration(run, 2, [row("r7", reward=0.5, episode_return=0.5)])
    assert analytics.history(con).iteration.tolist() == [0, 1, 2]
    # Re-exporting an iteration replaces it.
    analytics.export_iteration(run, 2, [row("r8"), row("r9")])
    assert analytics.iteration_metrics(con, 2)["rollout/episodes"] == 2.0
    con.close()
    # The on-disk analytics file keeps its views.
    reopened = duckdb.connect(str(run / "analytics.duckdb"))
    assert reopened.execute("SELECT count(*) FROM episodes").fetchone() == (8,)


def test_views_are_empty_before_the_first_export(tmp_path):
    con = analytics.connect(tmp_path)
    assert run_count(con, "transitions") == 0
    columns = [r[0] for r in con.execute("DESCRIBE exported_rows").fetchall()]
    assert columns == list(analytics.COLUMN_NAMES)
    assert analytics.history(con).empty
    analytics.export_iteration(tmp_path, 0, [row("r1")])
    assert run_count(con, "episodes") == 1


def test_a_crash_mid_write_leaves_no_partial_file(run, monkeypatch):
    before = (run / "transitions" / "iteration=1" / "part-0.parquet").read_bytes()

    def crash(src, dst):
        raise OSError("disk pulled out")

    # The rename of lightning_core.data.files.write_atomically, which the export writes with.
    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError, match="disk pulled out"):
        analytics.export_iteration(run, 1, [row("r5", reward=9.0)])
    with pytest.raises(OSError):
        analytics.export_iteration(run, 3, [row("r10")])
    monkeypatch.undo()
    folder = run / "transitions" / "iteration=1"
    assert [p.name for p in folder.iterdir()] == ["part-0.parquet"]
    assert (folder / "part-0.parquet").read_bytes() == before
    assert not any((run / "transitions" / "iteration=3").iterdir())
    # A process killed before the rename leaves its temporary file behind: readers skip it.
    (folder / ".part-0.parquet.x1y2.tmp").write_bytes(b"PAR1 half a file")
    assert analytics.history(analytics.connect(run)).iteration.tolist() == [0, 1]


def test_invalid_rows_are_refused_clearly(tmp_path):
    with pytest.raises(InvalidInput, match="lack columns success"):
        analytics.export_iteration(
            tmp_path, 0, [{k: v for k, v in row("r1").items() if k != "success"}]
        )
    with pytest.raises(InvalidInput, match="unknown columns rewrad"):
        analytics.export_iteration(tmp_path, 0, [row("r1", rewrad=1.0)])
    with pytest.raises(InvalidInput, match="column reward has empty values"):
        analytics.export_iteration(tmp_path, 0, [row("r1", reward=None)])
    with pytest.raises(InvalidInput, match="disagree on its facts"):
        analytics.export_iteration(tmp_path, 0, [row("r1"), row("r1", step=1, success=False)])
    with pytest.raises(InvalidInput, match="placeholder must be its only row"):
        analytics.export_iteration(tmp_path, 0, [row("r1"), row("r1", step=-1)])
    with pytest.raises(InvalidInput, match="wrong type"):
        analytics.export_iteration(tmp_path, 0, [row("r1", reward="high")])
    with pytest.raises(InvalidInput, match="has no facts"):
        transition_rows([call("r9", 0, None, 1, 1, 0.0, 0.0)], {})
    with pytest.raises(InvalidInput, match="tool_errors"):
        transition_rows([], {"r1": {"episode_return": 0.0, "success": False, "tool_errors": 1}})
    with pytest.raises(InvalidInput, match="step must hold whole numbers"):
        analytics.export_iteration(tmp_path, 0, [row("r1", step=1.5)])
    with pytest.raises(InvalidInput, match="no rows"):
        analytics.export_iteration(tmp_path, 0, [])
    assert analytics.exported_iterations(tmp_path) == []


def test_sql_errors_and_missing_roots(run, tmp_path):
    con = analytics.connect(run, ":memory:")
    with pytest.raises(InvalidInput, match=r"SQL failed: Catalog Error: .*nope") as err:
        analytics.run_sql(con, "SELECT * FROM nope")
    assert "\n" not in str(err.value)
    with pytest.raises(NotFound, match="does not exist"):
        analytics.connect(tmp_path / "missing")


cli = CliRunner()


def test_cli_analyze_prints_a_table(run):
    sql = "SELECT iteration, count(*) AS episodes FROM episodes GROUP BY 1 ORDER BY 1"
    result = cli.invoke(app, ["analyze", sql, "--root", str(run)])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == ["iteration", "episodes", "0", "4", "1", "2"]
    as_json = cli.invoke(
        app, ["analyze", sql, "--format", "json"], env={"LIGHTNING_RUN_DIR": str(run)}
    )
    assert json.loads(as_json.stdout) == [
        {"iteration": 0, "episodes": 4},
        {"iteration": 1, "episodes": 2},
    ]
    as_csv = cli.invoke(app, ["analyze", sql, "--root", str(run), "--format", "csv"])
    assert as_csv.stdout == "iteration,episodes\n0,4\n1,2\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["SELEC 1"], "SQL failed: Parser Error"),
        (["SELECT 1", "--format", "xml"], "unknown --format"),
        (["SELECT 1", "--root", "{tmp}/missing"], "does not exist"),
        (["SELECT 1", "--root", "{tmp}"], "no transitions exported"),
    ],
)
def test_cli_analyze_errors_are_one_line(run, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.replace("{tmp}", str(tmp_path / "empty")) for a in args]
    result = cli.invoke(app, ["analyze", *args], env={"LIGHTNING_RUN_DIR": str(run)})
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
