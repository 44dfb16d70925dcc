"""Judge rewards in real training runs (slow): a real Prefect run, the tiny model as both the
policy and the judge (judge.endpoint=server) on the run's own policy server. A judge below the
agreement bar stops the run after its calibration, with the figures in MLflow; a judge let
through trains, its scores in the export, until its budget stops the run with a message that
names the limit."""

from __future__ import annotations

import json

import duckdb
import pytest
from mlflow import MlflowClient

from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUBRIC = "The reply is an odd number of characters long."


def _run(tmp_path, name: str, judge: dict, iterations: int):
    registry = RegistryConfig(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", registered_model=f"{name}-test"
    )
    state = train(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        iterations=iterations,
        run_dir=str(tmp_path / "runs"),
        run_name=name,
        registry=registry,
        return_state=True,
        server={"model": "tiny"},
        rollouts={"tasks_per_iteration": 3, "group_size": 4, "sampling": {"temperature": 1.0}},
        evaluation={"eval_size": 3, "eval_every": 10},
        judge={"endpoint": "server", "mode": "rank", "rubric": RUBRIC, **judge},
    )
    client = MlflowClient(registry.tracking_uri)
    [run] = client.search_runs(client.get_experiment_by_name(registry.experiment).experiment_id)
    return state, client, run


def test_a_judge_below_the_agreement_bar_stops_the_run_after_calibration(prefect_harness, tmp_path):
    judge = {"calibration": {"tasks": 4, "min_agreement_pct": 95.0}}
    state, _, run = _run(tmp_path, "judged-refused", judge, iterations=2)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"agrees with gold on .* % of 16 trajectories, below"):
        state.result()
    assert run.data.metrics["judge/calibration_n"] == 16
    assert run.data.metrics["judge/agreement_pct"] < 95.0
    assert run.data.tags["judge"] == "tiny-random-llama"
    # Refused before training: no iteration began.
    root = tmp_path / "runs" / "judged-refused"
    events = [json.loads(line) for line in (root / "progress.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["stage"] == "iteration"]
    assert json.loads((root / "judge_calibration.json").read_text())["n"] == 16


def test_a_judged_run_trains_on_the_judges_scores_until_its_budget_stops_it(
    prefect_harness, tmp_path
):
    # Calibration: 4 group calls; each iteration at least 3 more (one per group drawn).
    judge = {
        "max_calls": 8,
        "rule_weight": 0.0,
        "calibration": {"tasks": 4, "allow_below": True},
    }
    state, client, run = _run(tmp_path, "judged-budget", judge, iterations=4)
    assert state.is_failed()
    spent = r"budget is spent: \d calls made.* of judge\.max_calls=8 .*raise judge\.max_calls"
    with pytest.raises(Exception, match=spent):
        state.result()
    root = tmp_path / "runs" / "judged-budget"
    checkpoint = json.loads((root / "checkpoint.json").read_text())
    assert 1 <= checkpoint["iteration"] < 4
    calls = client.get_metric_history(run.info.run_id, "judge/calls")
    assert [m.step for m in calls][:2] == [0, 1] and calls[-1].value <= 8
    # Iteration 1 trained on the judge's scores alone (rule_weight 0): each episode's return
    # is its judge score, which the export keeps beside it.
    con = duckdb.connect()
    rows = con.execute(
        f"SELECT DISTINCT rollout_id, episode_return, judge_score FROM "
        f"read_parquet('{root}/transitions/iteration=1/*.parquet') WHERE step >= 0"
    ).fetchall()
    assert rows and all(score is not None and ret == score for _, ret, score in rows)
