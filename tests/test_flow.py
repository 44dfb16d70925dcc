"""The training flow end to end, in a real Prefect run: tiny model, real policy server, DuckDB
store and Parquet exports, MLflow on SQLite; then the promotion rule on the real registry."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import httpx
import pandas as pd
import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file

from lightning_core.data import analytics
from lightning_core.serving import process as serving
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.promotion import PromotionDecision
from lightning_rl.registry.versions import register_policy_version
from lightning_rl.tasks.rollouts import rollout_seed
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def trained_state(prefect_harness, tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    config = RegistryConfig(
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="flow-test",
        promotion_threshold=0.0,
        promotion_margin=0.05,
    )
    state = train(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        iterations=2,
        run_dir=str(root / "runs"),
        run_name="e2e",
        registry=config,
        return_state=True,
        server={"model": "tiny"},
        rollouts={
            "tasks_per_iteration": 3,
            "group_size": 4,
            "sampling": {"temperature": 1.0},
            "rollout_workers": 2,
            "rollout_concurrency": 3,
        },
        evaluation={"eval_size": 6, "eval_every": 1, "extra_splits": ["kinds"]},
    )
    assert state.is_completed(), state.message
    return state, config, root / "runs" / "e2e"


@pytest.fixture(scope="module")
def trained(trained_state):
    state, config, run = trained_state
    return state.result(), config, run


def test_each_iteration_is_a_subflow_run_with_its_tasks_and_the_run_has_a_progress_bar(
    trained_state,
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    state, _, _ = trained_state
    parent = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])
            )
        )
        assert sorted(r.name for r in children) == ["iteration-1", "iteration-2"]
        for child in children:
            assert child.state.is_completed()
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[child.id]))
            )
            # Task run names are the task's name and a short suffix.
            names = {r.name.rsplit("-", 1)[0] for r in tasks}
            for stage in (
                "plan-rollouts",
                "run-rollouts",
                "collect-transitions",
                "analyze-iteration",
                "train-policy",
                "publish-policy",
                "evaluate-policy",
            ):
                assert stage in names, (child.name, sorted(names))
        # The parent's own task runs are only what comes before and after the iterations.
        own = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[parent]))
        )
        assert not any(r.name.startswith("run-rollouts") for r in own)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[parent]))
        )
    bars = [a for a in artifacts if a.type == "progress"]
    assert len(bars) == 1 and float(bars[0].data) == 100.0
    assert bars[0].key.endswith("training-progress")


def test_transitions_are_stored_with_rewards_and_advantages(trained):
    summary, _, run = trained
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT reward, advantage, policy_version FROM transitions ORDER BY rollout_id"
        ).fetchall()
    assert len(rows) == 2 * 3 * 4  # iterations x tasks x G, one LLM call each
    assert {reward for reward, _, _ in rows} == {0.0, 1.0}
    assert all(advantage is not None for _, advantage, _ in rows)
    assert any(advantage != 0 for _, advantage, _ in rows)  # mixed groups: a real signal
    assert {version for *_, version in rows} == {"tiny-random-llama", "e2e-v1"}
    # The analytics export of each iteration, queryable in DuckDB.
    con = analytics.connect(run, ":memory:")
    assert analytics.exported_iterations(run) == [1, 2]
    assert analytics.iteration_metrics(con, 2)["rollout/episodes"] == 12
    assert summary["iterations"] == 2 and (run / "reward_curve.png").stat().st_size > 1000


def test_each_rollout_samples_with_its_own_seed_from_the_runs_seed(trained):
    _, _, run = trained
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT r.group_id, r.metadata, s.attributes FROM rollouts r "
            "JOIN spans s USING (rollout_id) WHERE s.name LIKE 'chat %' AND r.mode = 'train'"
        ).fetchall()
    assert len(rows) == 2 * 3 * 4
    seeds = [json.loads(metadata)["sampling"]["seed"] for _, metadata, _ in rows]
    # The seed reached the policy with the call, and the G rollouts of a group differ in it.
    assert [json.loads(attributes)["gen_ai.request.seed"] for *_, attributes in rows] == seeds
    assert len(set(seeds)) == len(seeds)
    # A fixed function of (run seed, iteration, place in the plan): a rerun samples the same.
    assert sorted(seeds) == sorted(
        rollout_seed(0, iteration, k) for iteration in (1, 2) for k in range(3 * 4)
    )


def test_each_iteration_trained_a_new_adapter_and_version_2_is_served_by_name(trained):
    summary, _, run = trained
    assert summary["policy_version"] == "e2e-v2"
    first = load_file(run / "adapters" / "v1" / "adapter_model.safetensors")
    second = load_file(run / "adapters" / "v2" / "adapter_model.safetensors")
    assert any(not (first[k] == second[k]).all() for k in first)
    # A new server on the run's store serves the registered version by its name.
    port = free_port()
    proc = serving.start_serve(run / "store.duckdb", port, "--model", "tiny")
    try:
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "e2e-v2",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "e2e-v2"
    finally:
        serving.stop_serve(proc)


def test_mlflow_run_metrics_and_challenger(trained):
    summary, config, _ = trained
    client = MlflowClient(config.tracking_uri)
    history = client.get_metric_history(summary["mlflow_run_id"], "rollout/reward_mean")
    assert sorted(m.step for m in history) == [1, 2]
    evals = client.get_metric_history(summary["mlflow_run_id"], "eval/score")
    assert sorted(m.step for m in evals) == [0, 1, 2]
    challenger = client.get_model_version_by_alias("flow-test", "challenger")
    assert challenger.tags["policy_version"] == "e2e-v2"
    # No champion before this run: the threshold (0) decided, and it was met.
    champion = client.get_model_version_by_alias("flow-test", "champion")
    assert str(champion.version) == str(challenger.version) == "1"
    assert summary["promotion"]["promote"] is True
    assert "no champion" in summary["promotion"]["reason"]


def test_promotion_rule_on_the_registry(trained):
    summary, config, run = trained
    adapter = run / "adapters" / "v2"
    champion_score = summary["final"]["score"]

    def register(score: float) -> PromotionDecision:
        return register_policy_version(
            config,
            adapter,
            base_model="tiny",
            policy_version="e2e-v2",
            iteration=2,
            score=score,
            benchmark_id=summary["final"]["benchmark_id"],
            benchmark_size=summary["final"]["tasks"],
        )

    client = MlflowClient(config.tracking_uri)
    # Not better by the margin: the challenger moves, the champion stays.
    stays = register(champion_score + 0.01)
    assert not stays.promote
    assert str(client.get_model_version_by_alias("flow-test", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("flow-test", "challenger").version) == "2"
    # Better by more than the margin: the champion moves to it.
    moves = register(champion_score + 0.2)
    assert moves.promote
    assert str(client.get_model_version_by_alias("flow-test", "champion").version) == "3"
    tags = client.get_model_version("flow-test", "3").tags
    assert tags["promotion.decision"] == "promoted"
    assert float(tags["promotion.champion_score"]) == pytest.approx(champion_score)


def test_run_folder_has_config_summary_and_progress(trained):
    _, _, run = trained
    config = json.loads((run / "config.json").read_text())
    assert config["iterations"] == 2 and config["server"]["model"] == "tiny"
    stages = [json.loads(line)["stage"] for line in (run / "progress.jsonl").open()]
    assert stages[0] == "start" and stages[-1] == "done"
    assert stages.count("iterated") == 2 and stages.count("evaluated") == 3
    assert Path(run.parent / "latest").resolve() == run.resolve()


def test_an_extra_held_out_split_is_scored_at_the_start_and_the_end_and_compared(trained):
    summary, config, run = trained
    kinds = summary["splits"]["kinds"]
    assert kinds["base"]["tasks"] == kinds["final"]["tasks"] == 6
    assert kinds["base"]["policy_version"] != kinds["final"]["policy_version"]
    expected = round((kinds["final"]["score"] - kinds["base"]["score"]) * 100, 1)
    assert kinds["gain_points"] == pytest.approx(expected)
    low, high = kinds["gain_ci_points"]
    assert low <= kinds["gain_points"] <= high
    saved = json.loads((run / "heldout_kinds_comparison.json").read_text())
    assert saved["gain_points"] == kinds["gain_points"]
    # Another benchmark than the test split's: its own tasks, its own id.
    assert kinds["final"]["benchmark_id"] not in (None, summary["final"]["benchmark_id"])
    checkpoint = json.loads((run / "checkpoint.json").read_text())
    assert [e["iteration"] for e in checkpoint["split_evaluations"]["kinds"]] == [0, 2]
    client = MlflowClient(config.tracking_uri)
    logged = client.get_metric_history(summary["mlflow_run_id"], "eval_kinds/score")
    assert sorted(m.step for m in logged) == [0, 2]


def test_the_report_shows_training_success_and_held_out_scores_per_tier(trained, capsys):
    _, _, run = trained
    train = pd.read_csv(run / "train_success_by_tier.csv")
    # The flow's tasks have no tier: every episode is in the one untiered group.
    assert sorted(train["iteration"]) == [1, 2] and train["episodes"].sum() >= 2 * 3 * 4
    heldout = pd.read_csv(run / "heldout_by_tier.csv")
    assert sorted(heldout["iteration"]) == [0, 1, 2] and set(heldout["tasks"]) == {6}
    assert (run / "tier_curves.png").read_bytes()[:4] == b"\x89PNG"
    # The same section made again from the run folder (benchmarks/learning_report.py).
    from benchmarks import learning_report

    (run / "tier_curves.png").unlink()
    assert learning_report.main([str(run)]) == 0
    assert (run / "tier_curves.png").exists()
    assert "held-out score per tier" in capsys.readouterr().out


def test_extra_splits_name_other_splits_than_train_and_test():
    from pydantic import ValidationError

    from lightning_rl.flows.sections import EvaluationConfig

    assert EvaluationConfig(extra_splits=["kinds"]).extra_splits == ["kinds"]
    for bad in (["test"], ["train"], ["kinds", "kinds"], ["../x"], ["a"] * 5):
        with pytest.raises(ValidationError):
            EvaluationConfig(extra_splits=bad)


def test_evaluate_flow_scores_the_champion(trained, tmp_path):
    from lightning_rl.flows.evaluate import evaluate

    summary, config, _ = trained
    result = evaluate(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        policy="champion",
        eval_size=4,
        model="tiny",
        concurrency=4,
        run_dir=str(tmp_path),
        registry=config,
    )
    client = MlflowClient(config.tracking_uri)
    champion = client.get_model_version_by_alias("flow-test", "champion")
    assert result["version"] == str(champion.version)
    assert result["tasks"] == 4 and 0.0 <= result["score"] <= 1.0
    # 4 tasks, not the 6 training scored on: another benchmark, whose score the champion now
    # carries for promotions measured there.
    assert result["benchmark_id"] not in (None, summary["final"]["benchmark_id"])
    assert champion.tags[f"eval.score.{result['benchmark_id']}"] == repr(result["score"])
    assert champion.tags[f"eval.benchmark_size.{result['benchmark_id']}"] == "4"
    runs = client.search_runs(
        [client.get_experiment_by_name(config.experiment).experiment_id],
        filter_string="tags.kind = 'evaluation'",
    )
    assert runs and runs[0].data.metrics["eval/score"] == result["score"]
    assert sorted(result["rewards"]) == [f"test-{i}" for i in range(4)]


def test_evaluate_flow_scores_another_held_out_split_without_recording_it(trained, tmp_path):
    from lightning_rl.flows.evaluate import evaluate

    _, config, _ = trained
    result = evaluate(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        policy="champion",
        split="kinds",
        eval_size=3,
        model="tiny",
        concurrency=3,
        run_dir=str(tmp_path),
        registry=config,
    )
    assert result["split"] == "kinds" and sorted(result["rewards"]) == [
        "kinds-0",
        "kinds-1",
        "kinds-2",
    ]
    champion = MlflowClient(config.tracking_uri).get_model_version_by_alias("flow-test", "champion")
    # The version's scores are on the test split: promotion compares those alone.
    assert f"eval.score.{result['benchmark_id']}" not in champion.tags
    # benchmarks/heldout_split.py: the base model and the champion on the same split's tasks.
    from benchmarks.heldout_split import compare_split

    comparison, found = compare_split(
        "tests.flow_agents:agent", "kinds", "champion", 3, str(tmp_path),
        tasks="tests.flow_agents:load_tasks", model="tiny", registry=config,
    )  # fmt: skip
    assert found["split"] == "kinds" and comparison.rows[-1].tasks == 3
    with pytest.raises(Exception, match="train"):
        evaluate(
            agent="tests.flow_agents:agent",
            tasks="tests.flow_agents:load_tasks",
            split="train",
            model="tiny",
            run_dir=str(tmp_path),
            registry=config,
        )
