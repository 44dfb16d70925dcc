"""Curriculum and dynamic sampling in a real training flow (tiny model, Prefect, MLflow).

Half the tasks are of a tier whose groups never carry a signal (reward always 1): an iteration
that drew some of them samples another round of new tasks, and the curriculum then draws that
tier less. The held-out comparison has a row per tier."""

from __future__ import annotations

import json

import pytest

from lightning_core.rollouts.curriculum import CurriculumConfig
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from tests.conftest import use_prefect_server

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def run(prefect_test_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    with use_prefect_server(prefect_test_server):
        summary = train(
            agent="tests.flow_agents:agent",
            tasks="tests.flow_agents:load_tasks",
            iterations=2,
            run_dir=str(root / "runs"),
            run_name="cur",
            curriculum=CurriculumConfig(max_rounds=3, floor=0.1, smoothing=1.0),
            registry=RegistryConfig(
                tracking_uri=f"sqlite:///{root}/mlflow.db", registered_model="cur-test"
            ),
            data={"task_source": "tiered", "train_size": 40},
            server={"model": "tiny"},
            rollouts={
                "tasks_per_iteration": 4,
                "group_size": 4,
                "sampling": {"temperature": 1.0},
                "rollout_workers": 1,
                "rollout_concurrency": 8,
            },
            evaluation={"eval_size": 6, "eval_every": 2},
        )
    events = [json.loads(line) for line in (root / "runs" / "cur" / "progress.jsonl").open()]
    return summary, [e for e in events if e["stage"] == "iterated"]


def test_rounds_resample_new_tasks_until_enough_groups_carry_a_signal(run):
    _, iterations = run
    first = iterations[0]
    # Even tiers at first: about half the drawn tasks are constant, so one round is short.
    assert first["curriculum/weight_constant"] == pytest.approx(0.5)
    assert first["rollout/rounds"] >= 2
    assert first["rollout/tasks_drawn"] > 4
    assert first["rollout/episodes"] == first["rollout/tasks_drawn"] * 4
    for it in iterations:
        # Rounds stop once enough groups have a signal, or after max_rounds.
        assert it["rollout/groups_with_signal"] >= 4 or it["rollout/rounds"] == 3


def test_the_tier_without_signal_is_drawn_less(run):
    _, iterations = run
    weights = iterations[1]
    assert weights["curriculum/weight_constant"] < 0.25 < weights["curriculum/weight_parity"]


def test_the_summary_compares_base_and_final_per_tier(run):
    summary, _ = run
    tiers = [row["tier"] for row in summary["per_tier"]]
    assert tiers == ["constant", "parity", "all"]
    constant = summary["per_tier"][0]
    assert constant["base"] == constant["final"] == 1.0
    low, high = summary["gain_ci_points"]
    assert low <= summary["gain_points"] <= high
