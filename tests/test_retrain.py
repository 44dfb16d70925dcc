"""Recurring retraining from production, end to end (slow): a champion trained and registered;
`lightning-rl production` serving it; simulated production traffic through the gateway with
episode ids; feedback arriving later for some episodes; the `train/calc-production`
deployment's parameters run as a scheduled run would, training only on the new episodes,
warm-started from the champion, with the dataset id and hash in MLflow and the evaluation on
the pinned benchmark; late feedback counted by the next run; and a run with nothing new that
trains nothing and says why. Tiny model, real Prefect, real MLflow on SQLite, real servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import openai
import pytest
import yaml
from mlflow import MlflowClient

from lightning_core.data import analytics
from lightning_core.feedback import send_feedback
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from tests.conftest import free_port
from tests.helpers import train_params, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[1]
AGENT = {"agent": "tests.flow_agents:agent", "tasks": "tests.flow_agents:load_tasks"}


def _deployment_parameters(name: str) -> dict:
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    (found,) = [d for d in deployments if d["name"] == name]
    return dict(found["parameters"])


def _episodes_trained(run_dir: Path, iteration: int) -> set[str]:
    part = run_dir / "transitions" / f"iteration={iteration}" / "part-0.parquet"
    rows = duckdb.sql(f"SELECT DISTINCT rollout_id FROM '{part}'").fetchall()
    return {r[0] for r in rows}


def test_scheduled_run_trains_on_new_episodes_from_the_champion(prefect_harness, tmp_path):
    registry = RegistryConfig(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        registered_model="prod-test",
        promotion_threshold=0.0,
        promotion_margin=0.0,
    )
    common = {
        **AGENT,
        "model": "tiny",
        "eval_size": 6,
        "rollout_workers": 1,
        "rollout_concurrency": 3,
        "run_dir": str(tmp_path / "runs"),
        "registry": registry,
    }
    # Week 0: a champion, trained on the agent's tasks.
    week0 = train(
        **train_params(
            common,
            {"iterations": 1, "run_name": "w0", "tasks_per_iteration": 2, "group_size": 2},
            {"eval_every": 1},
        )
    )
    assert week0["promotion"]["promote"], week0["promotion"]
    pinned = week0["benchmark_id"]

    # Production: the champion served, episodes kept.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db = tmp_path / "production" / "store.duckdb"
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_API_KEY"}
    log = (tmp_path / "production.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "lightning_rl.flows.cli", "production", *_agent_flags(),
         "--model", "tiny", "--port", str(port), "--db", str(db),
         "--tracking-uri", registry.tracking_uri, "--registered-model", "prod-test"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_healthy(url, server, what="production server")
        key = Path(f"{db}.key").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

        def episode(episode_id: str | None, calls: int = 2) -> None:
            headers = {"X-Lightning-Episode": episode_id} if episode_id else None
            for turn in range(calls):
                client.chat.completions.create(
                    model="champion",
                    messages=[{"role": "user", "content": f"Say {turn}."}],
                    max_tokens=6,
                    temperature=1.0,
                    extra_headers=headers,
                )

        for i in range(6):
            episode(f"order-{i}")
        episode(None)  # served, not kept
        # Feedback arrives later, for some episodes only, from two sources.
        for i, value in enumerate([1.0, 0.0, 1.0, 0.0]):
            send_feedback(url, f"order-{i}", value, source="user", api_key=key)
        send_feedback(url, "order-1", 1.0, source="evaluator", api_key=key)

        params = train_params(
            _deployment_parameters("calc-production"),
            common,
            {
                "episodes_from": url,
                "episodes_key_file": f"{db}.key",
                "benchmark_id": pinned,
                "iterations": 2,
                "eval_every": 2,
            },
        )
        week1 = train(**params, run_name="w1")
        assert not week1.get("skipped"), week1
        assert week1["data"]["source"] == "episodes" and week1["data"]["rows"] == 4
        w1 = tmp_path / "runs" / "w1"
        wanted = {f"ep-order-{i}" for i in range(4)}
        assert _episodes_trained(w1, 1) == wanted == _episodes_trained(w1, 2)
        # The feedback it trained on, per policy version, in the analytics views (order-1 has
        # two sources: 5 rows for 4 episodes, all served by the champion).
        con = analytics.connect(w1, ":memory:")
        [(episodes, rows)] = con.execute("SELECT episodes, feedback FROM live_reward").fetchall()
        con.close()
        assert (episodes, rows) == (4, 5)
        # Warm-started from the champion: the run's iteration 0 is the champion's score.
        assert week1["base"]["policy_version"] == "w1-v0"
        assert week1["base"]["score"] == pytest.approx(week0["final"]["score"])
        ml = MlflowClient(registry.tracking_uri)
        run = ml.get_run(week1["mlflow_run_id"])
        tags = run.data.tags
        assert tags["warm_start"] == "prod-test/1"
        assert tags["data.training.dataset_id"] == week1["data"]["dataset_id"]
        assert tags["data.training.hash"] == week1["data"]["content_hash"]
        assert tags["data.training.rows"] == "4"
        assert tags["eval.benchmark_id"] == pinned
        inputs = {d.dataset.name: d.dataset for d in run.inputs.dataset_inputs}
        assert week1["data"]["name"] in inputs and len(inputs) == 2  # training, evaluation

        # Late feedback: a new episode's, and a second source on one the last run took.
        send_feedback(url, "order-4", 1.0, source="user", api_key=key)
        send_feedback(url, "order-0", 0.0, source="evaluator", api_key=key)
        week2 = train(**params, run_name="w2")
        assert week2["data"]["rows"] == 2, week2["data"]
        assert _episodes_trained(tmp_path / "runs" / "w2", 1) == {"ep-order-4", "ep-order-0"}
        assert int(week2["data"]["after"]) == int(week1["data"]["through"])

        # Nothing new: the run says why and trains, logs and registers nothing.
        runs_before = len(ml.search_runs([run.info.experiment_id]))
        versions_before = len(ml.search_model_versions("name='prod-test'"))
        week3 = train(**params, run_name="w3")
        assert week3["skipped"] and "no new feedback" in week3["reason"], week3
        assert not (tmp_path / "runs" / "w3").exists()
        assert len(ml.search_runs([run.info.experiment_id])) == runs_before
        assert len(ml.search_model_versions("name='prod-test'")) == versions_before
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _agent_flags() -> list[str]:
    return ["--agent", AGENT["agent"], "--tasks", AGENT["tasks"]]
